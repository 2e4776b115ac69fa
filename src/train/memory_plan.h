// The memory a training run needs, planned without allocating anything (`esplag plan`): on
// the host by category (train/host_memory.h) and, for a CUDA run in the CUDA build, on the
// GPU by category (GpuTransformer::memory_plan); whether that fits the memory at hand, the
// cheapest settings that would make it fit, and train.memory, which applies that choice
// when a run starts.
#pragma once
#include <cstdint>
#include <functional>
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

// The plan of a config where the run steps: plan_memory with the run's device, or a
// stand-in (tests).
using PlanFunction = std::function<MemoryPlan(const TrainConfig&)>;

// The memory a run on `device` has at hand: for "cuda" in the CUDA build the free memory of
// CUDA device `cuda_device` ("free on CUDA device 0"), and the host memory available now.
MemoryBudget memory_at_hand(const std::string& device, int cuda_device);

// The train.checkpointing settings, cheapest in compute first: none, selective (every
// block), then full every K blocks for K from model.n_layer down to 1, one K per number of
// checkpointed blocks.
std::vector<ActivationCheckpointing> checkpointing_choices(const ModelConfig& model);

// The cheapest config that fits `budget`: `config` itself when it does, else the first of
// its checkpointing_choices that does; with `smaller_batches`, then the largest smaller
// train.batch_size with train.grad_accum raised to keep the sequences per step (with the
// config's checkpointing, then with full in every block). nullopt when nothing tried fits.
std::optional<TrainConfig> cheapest_fit(const TrainConfig& config, const MemoryBudget& budget,
                                        const PlanFunction& plan, bool smaller_batches);

// cheapest_fit(config, budget, plan_memory on `device`, smaller_batches) as the config
// overrides to give ("train.checkpointing=full", ...): empty when the config fits as it is;
// nullopt when nothing tried fits.
std::optional<std::vector<std::string>> settings_that_fit(const TrainConfig& config, const std::string& device,
                                                          const MemoryBudget& budget);

// Applies train.memory to `config` (model resolved; `plan` plans where it steps), before
// anything is allocated. fixed keeps the settings as written and throws an Error with the
// plan (describe) and the settings that would fit when the GPU plan exceeds budget.gpu (the
// host is check_host_memory's). auto sets train.checkpointing (and _every) to the first of
// checkpointing_choices that fits `budget` and returns the line that says so ("memory auto:
// train.checkpointing=full every 2 (none needs 91.2 GiB of GPU memory, 79.1 GiB free on
// CUDA device 0; full every 2 needs 77.0 GiB)"); when none fits it throws an Error with the
// plan of full in every block and what would fit. Returns "" with fixed.
std::string apply_train_memory(TrainConfig& config, const MemoryBudget& budget, const PlanFunction& plan);

// The same for a run on `device` (CUDA device `cuda_device`) with memory_at_hand: what the
// trainer calls once the config is final.
std::string apply_train_memory(TrainConfig& config, const std::string& device, int cuda_device);

// The plan as text: the run, one line per category on the host and on the GPU with the
// totals, and for each whether it fits its budget ("unknown" without one).
std::string describe(const TrainConfig& config, const MemoryPlan& plan, const MemoryBudget& budget);

}  // namespace esplag
