// `--gpus N` of train and profile: the same command as N local processes, one per GPU, as
// `torchrun --nproc-per-node N` would start them (dist/launch.h).
#pragma once

#include "args.h"

namespace esplag::cli {

// Runs this process's command line without --gpus as `gpus` ranks and returns the exit code
// (launch_local_ranks). Refused inside a world a launcher has already started.
int run_as_local_ranks(const Command& command, int gpus);

}  // namespace esplag::cli
