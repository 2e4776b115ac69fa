// The host memory a run needs, checked before anything is allocated or written, so a
// model too large for the machine is refused with numbers instead of dying in an
// allocation after the run directory exists.
#pragma once
#include <cstdint>
#include <string>

#include "train/config.h"

namespace esplag {

// The host memory training `config` needs on `device` ("cpu" or "cuda"), by category, in
// bytes of fp32: on the CPU the weights, their gradients, the two AdamW moments and the
// activations of one micro-batch as train.checkpointing keeps them (model/transformer.cpp's
// Activations); on the GPU the host copy of the weights and of the moments that checkpoints
// are written from (no gradients nor activations); and the sparse kinds' own state. model.vocab_size
// must be resolved (not 0). An estimate from below: the data and scratch buffers come on top.
struct HostMemoryPlan {
  uint64_t weights = 0;
  uint64_t gradients = 0;
  uint64_t moments = 0;  // AdamW m and v
  uint64_t activations = 0;
  // train.offload optimizer+master: the low halves of the master weights (2 bytes each; the
  // offloaded moments are `moments`, which checkpoints are then written from in place).
  uint64_t master_low = 0;
  // The CPU layers' own state of the sparse kinds a recipe gives its layers (the largest a
  // layer takes over the run): LinearKindInfo::host_bytes_per_weight on the CPU, and on the
  // GPU host_twin_bytes_per_weight (the host model's layers run no CPU product there).
  uint64_t kinds = 0;
  // A distillation teacher (the recipe's distill entry, train/memory_plan.h): its fp32
  // weights, loaded on the host on either device, and on the CPU its forward's activations.
  uint64_t teacher = 0;
  uint64_t total() const { return weights + gradients + moments + activations + master_low + kinds + teacher; }
};
HostMemoryPlan host_memory_plan(const TrainConfig& config, const std::string& device);

// host_memory_plan(config, device).total().
uint64_t host_bytes_for_training(const TrainConfig& config, const std::string& device);

// The host memory of `local_ranks` ranks of a run on one host whose rank 0 needs `plan`: the
// others hold the same less what rank 0 alone holds, a GPU run's host copy of the moments
// that only the checkpoint's writer makes (offloaded moments are every rank's).
uint64_t host_bytes_of_local_ranks(const HostMemoryPlan& plan, const TrainConfig& config, const std::string& device,
                                   int local_ranks);

// MemAvailable of /proc/meminfo, lowered to what the cgroup's memory.max leaves; 0 when
// neither can be read (no check then).
uint64_t available_host_bytes();

}  // namespace esplag
