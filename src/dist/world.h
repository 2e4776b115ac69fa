// Which process of a multi-process run this is, read from the environment its launcher set:
// torchrun, mpirun (Open MPI), Slurm's srun, or `esplag train --gpus N` (which sets torchrun's
// variables). Without any of them the run is one process, exactly as before.
#pragma once
#include <cstdlib>
#include <functional>
#include <string>

namespace esplag {

struct World {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  std::string master_addr = "127.0.0.1";  // where rank 0 listens (host channel, NCCL bootstrap)
  int master_port = 29500;
  std::string launcher;  // "" single process, "torchrun", "mpirun", "slurm", "esplag" (--gpus)
  bool distributed() const { return size > 1; }
  // "rank 1 of 2 (local 1 of 2), torchrun, rendezvous 10.0.0.1:29500", or "single process".
  std::string describe() const;
};

// Reads an environment variable; null when unset. Tests pass a map instead of the process's.
using GetEnv = std::function<const char*(const char*)>;

// The world of this process. Precedence: torchrun's RANK/WORLD_SIZE, then Open MPI's
// OMPI_COMM_WORLD_*, then a Slurm job step (SLURM_STEP_ID set: started by srun), else a
// single process. A malformed or contradictory value is an Error naming the variable and
// its value; docs/distributed.md lists the variables of each launcher.
World world_from_env(const GetEnv& getenv = [](const char* name) -> const char* { return std::getenv(name); });

// The first host of a Slurm node list: "gpu[07-09,12],cpu3" -> "gpu07", "a,b" -> "a",
// "n[1-2]" -> "n1". An Error for a list it cannot parse.
std::string first_slurm_host(const std::string& nodelist);

}  // namespace esplag
