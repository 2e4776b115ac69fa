// Stopping a run cleanly on SIGINT / SIGTERM. The first signal only raises a flag that the
// training loop polls after each step (it then saves a checkpoint and returns); a second
// one ends the process at once with the shell's status for that signal (130 / 143), for a
// user who would rather lose the steps since the last checkpoint than wait.
#pragma once

namespace esplag {

// Installs the handlers for SIGINT and SIGTERM (a program's entry point calls it once).
void install_stop_handlers();

// Whether a stop signal has arrived since the handlers were installed (or the last clear).
bool stop_requested();
// The signal that asked to stop (SIGINT or SIGTERM), 0 when none did.
int stop_signal();
// Forgets an earlier request, for a process that goes on after an interrupted run.
void clear_stop_request();

}  // namespace esplag
