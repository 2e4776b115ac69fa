#include "train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <string>

#include "core/error.h"

namespace esplag {

namespace fs = std::filesystem;

namespace {

// The PID after `marker` at the end of `name` ("step-000100.tmp-4242" with ".tmp-"), or 0.
pid_t writer_pid(const std::string& name, const std::string& marker) {
  const size_t at = name.rfind(marker);
  if (at == std::string::npos || at == 0) return 0;
  const std::string digits = name.substr(at + marker.size());
  if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return 0;
  return static_cast<pid_t>(std::stol(digits));
}

bool process_alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

uint64_t size_on_disk(const fs::path& p) {
  std::error_code ec;
  if (!fs::is_directory(p, ec)) {
    const auto n = fs::file_size(p, ec);
    return ec ? 0 : n;
  }
  uint64_t total = 0;
  for (auto it = fs::recursive_directory_iterator(p, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec))
    if (it->is_regular_file(ec)) {
      const auto n = it->file_size(ec);
      if (!ec) total += n;
    }
  return total;
}

}  // namespace

RunLock::RunLock(const std::string& run_dir) {
  const std::string path = (fs::path(run_dir) / "lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot open the run's lock file '", path, "': ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    ::close(fd_);
    fd_ = -1;
    std::string holder = n > 0 ? std::string(buf, size_t(n)) : "";
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    if (err == EWOULDBLOCK)
      fail("run directory '", run_dir, "' is in use by another esplag process (PID ",
           holder.empty() ? "unknown" : holder, ", holding ", path, "): wait for it to end or stop it");
    fail("cannot lock the run directory '", run_dir, "' (", path, "): ", std::strerror(err));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != ssize_t(pid.size())) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    fail("cannot write the run's lock file '", path, "': ", std::strerror(err));
  }
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);
}

RemovedLeftovers remove_dead_writers(const std::string& run_dir) {
  RemovedLeftovers removed;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool dir = e.is_directory(ec);
    const pid_t pid = dir ? (name.rfind("step-", 0) == 0 ? writer_pid(name, ".tmp-") : 0) : writer_pid(name, ".tmp.");
    if (pid <= 0 || (pid != ::getpid() && process_alive(pid))) continue;
    const uint64_t bytes = size_on_disk(e.path());
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    ESPLAG_CHECK(!rm, "cannot remove '", e.path().string(), "', an unfinished write of a process no longer running: ",
                 rm.message());
    removed.names.push_back(name);
    removed.bytes += bytes;
  }
  return removed;
}

}  // namespace esplag
