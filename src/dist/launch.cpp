#include "dist/launch.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <thread>

#include "core/error.h"

extern char** environ;

namespace esplag {

namespace {

// The children's ids for the signal handler, which forwards SIGINT/SIGTERM to them.
pid_t* g_children = nullptr;
volatile sig_atomic_t g_child_count = 0;
volatile sig_atomic_t g_forwarded = 0;  // the last signal forwarded, 0 when none

extern "C" void forward_signal(int sig) {
  g_forwarded = sig;
  for (int i = 0; i < g_child_count; ++i)
    if (g_children[i] > 0) ::kill(g_children[i], sig);
}

// Binds a socket to 127.0.0.1:port (0: any free one); returns the port bound, or -1. The socket stays open in `fd`.
int bind_local(int port, int& fd) {
  fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    return -1;
  return ntohs(a.sin_port);
}

std::string program_path(const std::string& argv0) {
  if (argv0.find('/') != std::string::npos) return argv0;
  char path[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  ESPLAG_CHECK(n > 0, "cannot find this program's path (/proc/self/exe): ", std::strerror(errno));
  return std::string(path, static_cast<size_t>(n));
}

// The environment of rank `rank`: this process's, with the launch variables replaced.
std::vector<std::string> rank_environment(int rank, int n, int port) {
  const std::vector<std::string> set = {
      "RANK=" + std::to_string(rank),       "WORLD_SIZE=" + std::to_string(n),
      "LOCAL_RANK=" + std::to_string(rank), "LOCAL_WORLD_SIZE=" + std::to_string(n),
      "MASTER_ADDR=127.0.0.1",              "MASTER_PORT=" + std::to_string(port),
      "ESPLAG_LAUNCHER=esplag"};
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string v(*e);
    const std::string name = v.substr(0, v.find('=') + 1);
    bool replaced = false;
    for (const std::string& s : set) replaced = replaced || s.rfind(name, 0) == 0;
    if (!replaced) env.push_back(v);
  }
  env.insert(env.end(), set.begin(), set.end());
  return env;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> p;
  for (std::string& s : strings) p.push_back(s.data());
  p.push_back(nullptr);
  return p;
}

// "exit status 3" or "signal 9 (Killed)".
std::string status_text(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "status " + std::to_string(status);
}

bool succeeded(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

// The shell's exit code for a child's status: its exit code, or 128 + the signal that ended it.
int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

// Starts rank `rank`; signals stay blocked in this process until its id is recorded.
pid_t start_rank(const std::string& path, std::vector<char*>& args, std::vector<char*>& env, pid_t launcher) {
  const pid_t pid = ::fork();
  ESPLAG_CHECK(pid >= 0, "cannot start a process (fork): ", std::strerror(errno));
  if (pid > 0) return pid;
  // The child: its own process group (a terminal's Ctrl-C reaches it once, forwarded), SIGTERM when the launcher dies.
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != launcher) ::_exit(128 + SIGTERM);
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(path.c_str(), args.data(), env.data());
  const std::string message = "esplag: error: cannot run " + path + ": " + std::strerror(errno) + "\n";
  [[maybe_unused]] const ssize_t written = ::write(2, message.data(), message.size());
  ::_exit(127);
}

// Restores the signal handlers and mask that were in place before the launch.
struct SignalScope {
  struct sigaction old_int {}, old_term {};
  sigset_t old_mask{};
  SignalScope() {
    struct sigaction forward {};
    forward.sa_handler = forward_signal;
    sigemptyset(&forward.sa_mask);
    ::sigaction(SIGINT, &forward, &old_int);
    ::sigaction(SIGTERM, &forward, &old_term);
  }
  ~SignalScope() {
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    g_child_count = 0;
    g_children = nullptr;
    g_forwarded = 0;
  }
};

}  // namespace

int free_local_port() {
  int fd = -1;
  const int port = bind_local(0, fd);
  if (fd >= 0) ::close(fd);
  ESPLAG_CHECK(port > 0, "cannot find a free TCP port on 127.0.0.1 for the ranks' rendezvous");
  return port;
}

int launch_local_ranks(const std::vector<std::string>& argv, int n, double grace_s) {
  ESPLAG_CHECK(n >= 1, "the number of local processes must be at least 1, got ", n);
  ESPLAG_CHECK(!argv.empty(), "launch_local_ranks: no program to run");
  const std::string path = program_path(argv[0]);
  std::vector<std::string> arg_strings = argv;
  arg_strings[0] = path;
  std::vector<char*> args = pointers(arg_strings);
  const int port = free_local_port();

  std::vector<pid_t> pids(n, -1);
  std::vector<int> status(n, 0);
  std::vector<bool> running(n, false);
  SignalScope scope;
  g_children = pids.data();
  sigset_t stop_signals, old_mask;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> env_strings = rank_environment(r, n, port);
    std::vector<char*> env = pointers(env_strings);
    ::sigprocmask(SIG_BLOCK, &stop_signals, &old_mask);
    pids[r] = start_rank(path, args, env, ::getpid());
    running[r] = true;
    g_child_count = r + 1;
    ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  }

  using Clock = std::chrono::steady_clock;
  int first_failed = -1, left = n;
  Clock::time_point kill_at;
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      if (!running[r] || ::waitpid(pids[r], &status[r], WNOHANG) != pids[r]) continue;
      running[r] = false;
      pids[r] = -1;  // no signal for a reaped id, which the system may reuse
      --left;
      if (succeeded(status[r]) || first_failed >= 0 || g_forwarded) continue;
      // The first failure: the others cannot go on without this rank.
      first_failed = r;
      kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s));
      for (const pid_t p : pids)
        if (p > 0) ::kill(p, SIGTERM);
    }
    if (first_failed >= 0 && Clock::now() >= kill_at)
      for (const pid_t p : pids)
        if (p > 0) ::kill(p, SIGKILL);
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (first_failed >= 0)
    fail("rank ", first_failed, " of ", n, " failed (", status_text(status[first_failed]), "); the other ranks were ",
         "stopped");
  for (int r = 0; r < n; ++r)
    if (!succeeded(status[r])) return exit_code(status[r]);  // after a forwarded signal
  return 0;
}

}  // namespace esplag
