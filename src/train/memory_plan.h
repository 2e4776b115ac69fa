// The memory a training run needs, planned without allocating anything (`esplag plan`): on
// the host by category (train/host_memory.h) and, for a CUDA run in the CUDA build, on the
// GPU by category (GpuTransformer::memory_plan); whether that fits the memory at hand, and
// the cheapest settings that would make it fit.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/host_memory.h"

namespace esplag {

// The device memory of a GPU run by category: model/gpu_transformer.h's GpuMemoryPlan for
// the config's micro-batch (train.batch_size x train.seq_len) and train.checkpointing.
struct GpuMemoryBytes {
  uint64_t params = 0;       // bf16 weights + the low halves of the fp32 master weights
  uint64_t grads = 0;        // fp32
  uint64_t optimizer = 0;    // AdamW m and v
  uint64_t activations = 0;  // saved for the backward
  uint64_t scratch = 0;      // shared step buffers, LM-head chunk, attention workspace, losses
  uint64_t workspace = 0;    // cuBLASLt workspace and bias scratch
  uint64_t total() const { return params + grads + optimizer + activations + scratch + workspace; }
};

// The memory to plan against, in bytes (0: unknown, anything fits), and where each number
// comes from ("--gpu-memory", "free on CUDA device 0", ...), for the report.
struct MemoryBudget {
  uint64_t gpu = 0;
  uint64_t host = 0;
  std::string gpu_source, host_source;
};

struct MemoryPlan {
  std::string device;  // "cpu" or "cuda": where the steps run
  HostMemoryPlan host;
  std::optional<GpuMemoryBytes> gpu;  // a cuda run in the CUDA build with a visible device only
  std::string no_gpu_plan;            // for a cuda run without `gpu`: why
  bool fits_host(const MemoryBudget& budget) const { return budget.host == 0 || host.total() <= budget.host; }
  bool fits_gpu(const MemoryBudget& budget) const { return !gpu || budget.gpu == 0 || gpu->total() <= budget.gpu; }
  bool fits(const MemoryBudget& budget) const { return fits_host(budget) && fits_gpu(budget); }
};

// The plan of `config` (model.vocab_size resolved) on `device` ("cpu" or "cuda").
MemoryPlan plan_memory(const TrainConfig& config, const std::string& device);

// The cheapest settings with which `config` fits `budget` on `device`, as the config
// overrides to give ("train.checkpointing=full", ...). Tried in order: train.checkpointing
// selective, then full (both in every block), then the largest smaller train.batch_size
// with train.grad_accum raised to keep the sequences per step (with the config's
// checkpointing, then with full). Empty when the config fits as it is; nullopt when
// nothing tried fits.
std::optional<std::vector<std::string>> settings_that_fit(const TrainConfig& config, const std::string& device,
                                                          const MemoryBudget& budget);

// The plan as text: the run, one line per category on the host and on the GPU with the
// totals, and for each whether it fits its budget ("unknown" without one).
std::string describe(const TrainConfig& config, const MemoryPlan& plan, const MemoryBudget& budget);

}  // namespace esplag
