#include "train/stop_signal.h"

#include <unistd.h>

#include <csignal>
#include <cstring>

namespace esplag {

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) {
  if (g_stop_signal != 0) _exit(128 + sig);
  g_stop_signal = sig;
  // Only async-signal-safe calls here: write(2), no stdio.
  static const char msg[] =
      "\nstop requested: finishing the current step and saving a checkpoint (signal again to exit at once, "
      "losing the steps since the last checkpoint)\n";
  const ssize_t ignored = ::write(STDERR_FILENO, msg, sizeof msg - 1);
  (void)ignored;
}

}  // namespace

void install_stop_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a read or write in progress goes on rather than failing with EINTR
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool stop_requested() { return g_stop_signal != 0; }

int stop_signal() { return g_stop_signal; }

void clear_stop_request() { g_stop_signal = 0; }

}  // namespace esplag
