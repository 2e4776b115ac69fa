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
  uint64_t teacher = 0;      // a distillation teacher's forward-only model (GpuModelOptions::forward_only)
  uint64_t total() const { return params + grads + optimizer + activations + scratch + workspace + teacher; }
};

// The model state of one GPU of a run over `world` data-parallel ranks (docs/distributed.md,
// "ZeRO stage 1 on the GPU"): the weights, gradients and AdamW moments of the E stored
// elements, laid out as GpuTransformer::memory_plan lays out the state a run starts with
// (every Linear layer dense; a slope layer's kept values take half). With
// train.parallel.zero 1 and several ranks each keeps the moments of its slice of every
// gradient bucket (train.parallel.bucket_mb; one bucket of the whole layout without), each
// bucket padded to world slices of a multiple of 64 elements (GpuModelOptions::
// shard_optimizer, model/gradient_buckets.h); otherwise every GPU keeps the whole state.
// With zero 2 the gradients are the ring's slots, the rest's buffers and the mean gradient
// of the GPU's slices (GpuModelOptions::shard_gradients, GradientStorage); with zero 3 the
// bf16 weights take the same slots and rest, the master weights the slices only
// (GpuModelOptions::shard_parameters).
struct GpuModelState {
  int world = 1;
  int zero = 0;            // train.parallel.zero
  bool sharded = false;    // zero 1 to 3 over several ranks
  uint64_t elements = 0;   // E: the largest stored layout's (train/stored_layout.h)
  uint64_t kept_values = 0;  // weights stored as their kind's form in it (slope's kept values)
  uint64_t chunk = 0;      // elements whose moments one GPU keeps (its slices): E unsharded
  uint64_t padded = 0;     // elements of the weights and gradients: E, plus the buckets' padding sharded
  // Zero 2 with block buckets: the ring's slots of slot_elements each, and the gradient
  // elements in all (slots, the rest's buffers, the chunk's mean gradient); 0 slots else.
  int slots = 0;
  uint64_t slot_elements = 0, gradient_elements = 0;
  // Zero 3 with block buckets: the bf16 weights are the slots and the rest's (weight_elements),
  // the master weights the chunk's only. Else weight_elements = padded.
  bool sharded_params = false;
  uint64_t weight_elements = 0;
  uint64_t params = 0;     // on the device: bf16 weights + the master weights' low halves
  uint64_t grads = 0;      // fp32
  uint64_t optimizer = 0;  // AdamW m and v of the chunk (its slices)
  uint64_t offloaded = 0;  // train.offload's part of the above, in pinned host memory instead
  // Sharded: the whole moments (8 bytes per stored element, padded) that a checkpoint gathers
  // into pinned host memory on every rank, from the save until the next step. 0 unsharded.
  uint64_t checkpoint_moments = 0;
  uint64_t total() const { return params + grads + optimizer; }
};

// The GPU model state of `config` (model.vocab_size resolved) over `world` ranks (>= 1).
GpuModelState gpu_model_state(const TrainConfig& config, int world);

// The memory to plan against, in bytes (0: unknown, anything fits), and where each number
// comes from ("--gpu-memory", "free on CUDA device 0", ...), for the report.
struct MemoryBudget {
  uint64_t gpu = 0;
  uint64_t host = 0;
  std::string gpu_source, host_source;
};

struct MemoryPlan {
  std::string device;  // "cpu" or "cuda": where the steps run
  int world = 1;       // data-parallel ranks: the numbers are one rank's (one GPU's)
  // One rank's host memory. On the CPU with train.parallel.zero 1 or 2 over several ranks, the
  // moments (stage 2: and the mean gradient's buffer) of its range of the trained elements
  // (train/zero_partition.h, the largest range).
  HostMemoryPlan host;
  std::optional<GpuModelState> gpu_state;  // a cuda run, in either build
  // The model of the recipe's distill teacher (read from its checkpoint), when there is one;
  // its memory is in host.teacher and gpu->teacher.
  std::optional<ModelConfig> teacher;
  std::string teacher_problem;  // why a distill entry's teacher is not counted ("" when it is)
  std::optional<GpuMemoryBytes> gpu;  // a cuda run in the CUDA build with a visible device only
  std::string no_gpu_plan;            // for a cuda run without `gpu`: why
  // The ranks of the run on this host, which share its memory: `host` is rank 0's, and the
  // others' take `other_local_ranks_host` more (host_bytes_of_local_ranks): all must fit.
  int local_ranks = 1;
  uint64_t other_local_ranks_host = 0;
  uint64_t host_of_local_ranks() const { return host.total() + other_local_ranks_host; }
  bool fits_host(const MemoryBudget& budget) const { return budget.host == 0 || host_of_local_ranks() <= budget.host; }
  bool fits_gpu(const MemoryBudget& budget) const { return !gpu || budget.gpu == 0 || gpu->total() <= budget.gpu; }
  bool fits(const MemoryBudget& budget) const { return fits_host(budget) && fits_gpu(budget); }
};

// The plan of `config` (model.vocab_size resolved) on `device` ("cpu" or "cuda"), for one of
// `world` data-parallel ranks (>= 1) under train.parallel.zero, with the recipe's distill
// teacher where it has one. An Error for a teacher whose checkpoint cannot be read (naming
// the key).
MemoryPlan plan_memory(const TrainConfig& config, const std::string& device, int world = 1, int local_ranks = 1);

// Throws an Error when the host memory of the run's `local_ranks` ranks on this host
// (plan_memory's host_of_local_ranks: a distill teacher and ZeRO's smaller moments counted)
// exceeds `available` bytes (0: unknown, no check), giving both numbers and what would fit:
// the largest train.batch_size when the weights fit but the activations do not, else the
// largest model preset.
void check_host_memory(const TrainConfig& config, const std::string& device, uint64_t available, int world = 1,
                       int local_ranks = 1);

// The plan of a config where the run steps: plan_memory with the run's device, or a
// stand-in (tests).
using PlanFunction = std::function<MemoryPlan(const TrainConfig&)>;

// check_host_memory with the plans of `plan` (planner's: the run's device and ranks).
void check_host_memory(const TrainConfig& config, uint64_t available, const PlanFunction& plan);

// plan_memory on `device` over `world` ranks (`local_ranks` of them on this host) for the
// configs cheapest_fit tries from `config` (the same recipe): its distill teacher's
// checkpoint is read once, here.
PlanFunction planner(const TrainConfig& config, const std::string& device, int world = 1, int local_ranks = 1);

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

// cheapest_fit(config, budget, plan_memory on `device` over `world` ranks, `local_ranks` on this
// host, smaller_batches) as the config overrides to give ("train.checkpointing=full", ...):
// empty when the config fits as it is; nullopt when nothing tried fits.
std::optional<std::vector<std::string>> settings_that_fit(const TrainConfig& config, const std::string& device,
                                                          const MemoryBudget& budget, int world = 1,
                                                          int local_ranks = 1);

// Applies train.memory to `config` (model resolved; `plan` plans where it steps), before
// anything is allocated. fixed keeps the settings as written and throws an Error with the
// plan (describe) and the settings that would fit when the GPU plan exceeds budget.gpu (the
// host is check_host_memory's). auto sets train.checkpointing (and _every) to the first of
// checkpointing_choices that fits `budget` and returns the line that says so ("memory auto:
// train.checkpointing=full every 2 (none needs 91.2 GiB of GPU memory, 79.1 GiB free on
// CUDA device 0; full every 2 needs 77.0 GiB)"); when none fits it throws an Error with the
// plan of full in every block and what would fit. Returns "" with fixed.
std::string apply_train_memory(TrainConfig& config, const MemoryBudget& budget, const PlanFunction& plan);

// The same for a run on `device` (CUDA device `cuda_device`) with memory_at_hand, planned for
// one of `world` ranks, `local_ranks` of them on this host, then check_host_memory of the
// settings applied with the same plans (a distill teacher's checkpoint read once): what the
// trainer calls once the config is final.
std::string apply_train_memory(TrainConfig& config, const std::string& device, int cuda_device, int world = 1,
                               int local_ranks = 1);

// The plan as text: the run, the ranks and ZeRO stage the numbers are one rank's of, one line
// per category on the host and on the GPU with the totals (without a GPU plan, the GPU model
// state), and for each whether it fits its budget ("unknown" without one); a sharded GPU run
// notes the pinned host memory of a checkpoint's whole moments.
std::string describe(const TrainConfig& config, const MemoryPlan& plan, const MemoryBudget& budget);

}  // namespace esplag
