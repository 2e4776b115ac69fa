// `esplag train --gpus N`: this program run as N local processes, one per GPU, with the
// environment torchrun would give them (dist/world.h reads it back in each).
#pragma once
#include <string>
#include <vector>

namespace esplag {

// Runs argv (argv[0] = this program's path, then its arguments, without --gpus) as n local
// processes with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
// MASTER_PORT=<a free port> and ESPLAG_LAUNCHER=esplag set (other variables inherited);
// argv[0] "" or without a '/' runs /proc/self/exe. Forwards SIGINT and SIGTERM to the
// children (each in its own process group, so a terminal's Ctrl-C reaches them once, through
// this process); a child whose launcher dies gets SIGTERM.
//
// Returns 0 when all exit 0. After a forwarded signal, returns the first non-zero exit code
// of a child (128 + the signal for one killed by a signal). Otherwise, when one fails, stops
// the others (SIGTERM, then SIGKILL after `grace_s` seconds) and throws an Error naming the
// first rank that failed and its exit status or signal.
int launch_local_ranks(const std::vector<std::string>& argv, int n, double grace_s = 30);

// A TCP port of 127.0.0.1 that was free when asked (the host channel's).
int free_local_port();

}  // namespace esplag
