#include "train/memory_plan.h"

#include <algorithm>
#include <iomanip>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "model/gradient_buckets.h"
#include "train/checkpoint.h"
#include "train/progress.h"
#include "train/recipe.h"
#include "train/stored_layout.h"
#include "train/zero_partition.h"
#ifdef ESPLAG_HAVE_CUDA
#include "train/gpu_memory_plan.h"
#include "train/gpu_step.h"
#endif

namespace esplag {

namespace {

// The overrides that turn `from` into `to` (the keys settings_that_fit changes).
std::vector<std::string> overrides(const TrainConfig& from, const TrainConfig& to) {
  std::vector<std::string> o;
  if (to.checkpointing.mode != from.checkpointing.mode)
    o.push_back("train.checkpointing=" + to_string(to.checkpointing.mode));
  if (to.checkpointing.mode != CheckpointMode::none && to.checkpointing.every != from.checkpointing.every)
    o.push_back("train.checkpointing_every=" + std::to_string(to.checkpointing.every));
  if (to.batch_size != from.batch_size) o.push_back("train.batch_size=" + std::to_string(to.batch_size));
  if (to.grad_accum != from.grad_accum) o.push_back("train.grad_accum=" + std::to_string(to.grad_accum));
  if (to.offload != from.offload) o.push_back("train.offload=" + to.offload);
  return o;
}

// The configs cheapest_fit tries after `config` itself, cheapest first.
std::vector<TrainConfig> candidates(const TrainConfig& config, bool smaller_batches) {
  std::vector<TrainConfig> tried;
  auto with = [&](ActivationCheckpointing checkpointing, const std::string& offload, int batch_size, int grad_accum) {
    TrainConfig c = config;
    c.checkpointing = checkpointing;
    c.offload = offload;
    c.batch_size = batch_size;
    c.grad_accum = grad_accum;
    tried.push_back(c);
  };
  // Checkpointing costs compute, the optimizer offload PCIe traffic in every step (more
  // than a step of llama-1b takes): the checkpointing choices first, then each again with
  // more of the optimizer offloaded (GPU runs only).
  const std::vector<std::string> more_offloaded = {"none", "optimizer", "optimizer+master"};
  const auto from = std::find(more_offloaded.begin(), more_offloaded.end(), config.offload);
  std::vector<std::string> offloads = {config.offload};
  if (config.device != "cpu" && from != more_offloaded.end()) offloads.assign(from, more_offloaded.end());
  for (const std::string& offload : offloads)
    for (const ActivationCheckpointing& checkpointing : checkpointing_choices(config.model))
      with(checkpointing, offload, config.batch_size, config.grad_accum);
  if (!smaller_batches) return tried;
  const int64_t sequences = int64_t(config.batch_size) * config.grad_accum;
  const ActivationCheckpointing full{CheckpointMode::full, 1};
  for (const auto& [checkpointing, offload] : {std::pair{config.checkpointing, config.offload}, std::pair{full, offloads.back()}})
    for (int b = config.batch_size - 1; b >= 1; --b)
      if (sequences % b == 0 && sequences / b <= std::numeric_limits<int32_t>::max())
        with(checkpointing, offload, b, int(sequences / b));
  return tried;
}

// "none", "selective", "full", "full every 2".
std::string checkpointing_text(const ActivationCheckpointing& c) {
  const bool every = c.mode != CheckpointMode::none && c.every != 1;
  return to_string(c.mode) + (every ? " every " + std::to_string(c.every) : "");
}

// The memory that limits a plan: the GPU's where there is a GPU plan (unless only the host
// does not fit), else the host's.
struct Limit {
  bool gpu;
  uint64_t need, have;
  std::string source;
};
Limit limit_of(const MemoryPlan& p, const MemoryBudget& b) {
  if (p.gpu && (p.fits_host(b) || !p.fits_gpu(b))) return {true, p.gpu->total(), b.gpu, b.gpu_source};
  return {false, p.host_of_local_ranks(), b.host, b.host_source};
}

// "91.2 GiB of GPU memory, 79.1 GiB free on CUDA device 0" ("..., 20.0 GiB given by --gpu-memory").
std::string need_text(const Limit& l) {
  return format_bytes(l.need) + " of " + (l.gpu ? "GPU" : "host") + " memory, " +
         (l.have ? format_bytes(l.have) + (l.source.rfind("--", 0) == 0 ? " given by " : " ") + l.source
                 : "the memory at hand unknown" + (l.source.empty() ? "" : " (" + l.source + ")"));
}

std::string overrides_text(const std::vector<std::string>& overrides) {
  std::string text;
  for (const std::string& o : overrides) text += (text.empty() ? "--set " : " --set ") + o;
  return text;
}

std::string row(const std::string& name, uint64_t bytes) {
  std::ostringstream os;
  os << "  " << std::left << std::setw(13) << name << std::right << std::setw(10) << format_bytes(bytes) << "\n";
  return os.str();
}

// "fits in 79.1 GiB (free on CUDA device 0)", "does NOT fit ...", or "unknown (...)".
std::string verdict(bool fits, uint64_t budget, const std::string& source) {
  if (budget == 0) return "fits: unknown (" + (source.empty() ? std::string("no budget") : source) + ")";
  return std::string(fits ? "fits in " : "does NOT fit in ") + format_bytes(budget) + " (" + source + ")";
}

// The elements of the largest range when `elements` are cut among `world` ranks: ceil(elements / world).
uint64_t largest_range(int64_t elements, int world) { return uint64_t(ZeroPartition({elements}, world).count(0)); }

// Whose numbers the plan gives: "per GPU of 4, ZeRO stage 1: each GPU keeps the AdamW moments
// of a chunk of 3136 of the 12345 stored elements (...)".
std::string ranks_text(const TrainConfig& config, const MemoryPlan& plan) {
  const bool gpu = plan.device == "cuda";
  const std::string rank = gpu ? "GPU" : "rank", world = std::to_string(plan.world);
  const int zero = config.parallel.zero;
  const std::string line = "per " + rank + " of " + world + ", ZeRO stage " + std::to_string(zero) + ": ";
  if (gpu && plan.gpu_state->sharded) {
    const GpuModelState& s = *plan.gpu_state;
    const std::string kept = "each GPU keeps the AdamW moments" + std::string(s.slots ? " and the mean gradient" : "") +
                             " of " + std::to_string(s.chunk) + " of the " + std::to_string(s.elements) +
                             " stored elements (1/" + world + " of every gradient bucket, rounded up to 64), ";
    if (s.sharded_params)
      return line + "each GPU keeps the master weights, the AdamW moments and the mean gradient of " +
             std::to_string(s.chunk) + " of the " + std::to_string(s.elements) + " stored elements (1/" + world +
             " of every gradient bucket, rounded up to 64); the blocks' bf16 weights are gathered, and their " +
             "gradients written, into " + std::to_string(s.slots) + " slots of " + std::to_string(s.slot_elements) +
             " elements, the rest's kept whole\n";
    if (s.slots)
      return line + kept + "the weights padded to " + std::to_string(s.padded) + "; the backward writes the blocks' " +
             "gradients into " + std::to_string(s.slots) + " slots of " + std::to_string(s.slot_elements) +
             " elements and the rest's into buffers of their own\n";
    return line + kept + "the weights and gradients padded to " + std::to_string(s.padded) +
           (zero >= 2 ? " (without gradient buckets, stage " + std::to_string(zero) +
                            " keeps the whole gradients, as stage 1)"
                      : "") +
           "\n";
  }
  if (!gpu && plan.world > 1 && zero >= 1)
    return line + "each rank keeps the AdamW moments" + (zero >= 2 ? " and the mean gradient" : "") + " of at most " +
           std::to_string(largest_range(config.model.num_params(), plan.world)) + " of the " +
           std::to_string(config.model.num_params()) + " trained elements\n";
  if (plan.world == 1)
    return line + "one " + rank + " keeps the whole state" + (zero >= 1 ? " (sharding needs several ranks)" : "") + "\n";
  return line + "every " + rank + " keeps the whole state\n";
}

// The GPU model state's rows (without a GPU plan) and notes on the pinned host memory it
// takes outside the device.
std::string model_state_text(const GpuModelState& s, const std::string& offload, bool rows) {
  std::string text;
  if (rows)
    text += row("params", s.params) + row("grads", s.grads) + row("optimizer", s.optimizer) +
            row("model state", s.total());
  if (s.kept_values)
    text += "  note: the state is of " + std::to_string(s.elements) + " stored elements: " +
            std::to_string(s.kept_values) + " weights are stored as their kept values (slope) in the largest layout the run holds\n";
  if (s.offloaded)
    text += "  note: " + format_bytes(s.offloaded) + " of the optimizer state is in pinned host memory (train.offload " +
            offload + "), not counted above\n";
  if (s.checkpoint_moments)
    text += "  note: a checkpoint gathers the whole moments into " + format_bytes(s.checkpoint_moments) +
            " of pinned host memory on rank 0 (on every rank where a recipe step lays the state out again), kept "
            "until the next step, not counted above\n";
  return text;
}

// The model of the recipe's distill teacher, read from its checkpoint's config; nullopt
// without a distill entry, or with `problem` saying why the checkpoint cannot be read (the
// trainer refuses the run then, when it loads the teacher, naming the key).
std::optional<ModelConfig> teacher_model(const TrainConfig& config, std::string& problem) {
  if (config.recipe_yaml.empty()) return std::nullopt;
  const Recipe recipe = config.recipe();
  const Recipe::Modifier* d = recipe.distill();
  if (!d) return std::nullopt;
  try {
    return read_checkpoint_info(resolve_checkpoint(d->teacher)).config.model;
  } catch (const Error& e) {
    problem = "the distillation teacher '" + d->teacher + "' cannot be read (" + e.what() + "): not counted";
    return std::nullopt;
  }
}

}  // namespace

GpuModelState gpu_model_state(const TrainConfig& config, int world) {
  ESPLAG_CHECK(world >= 1, "the world size must be at least 1, got ", world);
  GpuModelState s;
  s.world = world;
  s.zero = config.parallel.zero;
  s.sharded = world > 1 && config.parallel.zero >= 1;
  const StoredLayout layout = largest_stored_layout(config);
  s.elements = layout.elements;
  s.kept_values = layout.kept_values.size();
  s.chunk = s.padded = s.elements;
  if (s.sharded) {  // a slice of every gradient bucket, as GpuTransformer lays them out
    std::vector<ParamInfo> stored = stored_param_layout(config.model, layout.kept_values);
    const size_t bucket_elements = size_t(config.parallel.bucket_mb * double(1 << 20)) / sizeof(float);
    std::vector<GradientBucket> buckets =
        plan_gradient_buckets(stored, config.model.n_layer, size_t(s.elements), bucket_elements);
    const ShardedBuckets sharded = shard_gradient_buckets(stored, buckets, world);
    s.chunk = sharded.per_rank();
    s.padded = sharded.padded;
    const GradientStorage ring = plan_gradient_storage(buckets, config.parallel.zero >= 2);
    s.slots = ring.slots;
    s.slot_elements = ring.slot_elements;
    if (ring.slots > 0) s.gradient_elements = ring.elements + s.chunk;
    s.sharded_params = ring.slots > 0 && config.parallel.zero >= 3;
    if (s.sharded_params) s.weight_elements = ring.elements;
  }
  if (s.slots == 0) s.gradient_elements = s.padded;
  if (!s.sharded_params) s.weight_elements = s.padded;
  // Stage 3 keeps both master halves of the chunk; below it the bf16 weights are the high halves.
  const uint64_t master = s.sharded_params ? s.chunk : s.padded;
  const uint64_t master_low = master * sizeof(uint16_t), moments = s.chunk * 2 * sizeof(float);
  const bool offload_master = config.offload == "optimizer+master", offload_moments = config.offload != "none";
  s.params = (s.weight_elements + (s.sharded_params ? s.chunk : 0)) * sizeof(uint16_t) +
             (offload_master ? 0 : master_low);
  s.grads = s.gradient_elements * sizeof(float);
  s.optimizer = offload_moments ? 0 : moments;
  s.offloaded = (offload_master ? master_low : 0) + (offload_moments ? moments : 0);
  s.checkpoint_moments = s.sharded ? s.padded * 2 * sizeof(float) : 0;
  return s;
}

namespace {

// plan_memory with the teacher's model (or why there is none) already read.
MemoryPlan plan_with_teacher(const TrainConfig& config, const std::string& device, int world, int local_ranks,
                             const std::optional<ModelConfig>& teacher, const std::string& teacher_problem) {
  ESPLAG_CHECK(world >= 1, "the world size must be at least 1, got ", world);
  MemoryPlan plan;
  plan.device = device;
  plan.world = world;
  plan.local_ranks = std::clamp(local_ranks, 1, world);
  plan.host = host_memory_plan(config, device);
  plan.teacher = teacher;
  plan.teacher_problem = teacher_problem;
  if (plan.teacher) {
    TrainConfig t = config;
    t.model = *plan.teacher;
    t.checkpointing = {};
    plan.host.teacher = uint64_t(plan.teacher->num_params()) * sizeof(float) +
                        (device == "cpu" ? host_memory_plan(t, "cpu").activations : 0);
  }
  if (device != "cuda" && world > 1 && config.parallel.zero >= 1) {
    // ZeroCpuOptimizer: the moments of the rank's range; stage 2 also its mean gradient.
    const uint64_t range = largest_range(config.model.num_params(), world);
    plan.host.moments = range * 2 * sizeof(float);
    if (config.parallel.zero == 2) plan.host.gradients += range * sizeof(float);
  }
  if (device == "cuda") plan.gpu_state = gpu_model_state(config, world);
  // Offloaded and sharded, each rank's pinned moments are its slices' (the whole copy a
  // checkpoint gathers is noted apart, as without the offload).
  if (plan.gpu_state && plan.gpu_state->sharded && config.offload != "none")
    plan.host.moments = plan.gpu_state->chunk * 2 * sizeof(float);
  // So are the master weights' low halves under stage 3.
  if (plan.gpu_state && plan.gpu_state->sharded_params && config.offload == "optimizer+master")
    plan.host.master_low = plan.gpu_state->chunk * sizeof(uint16_t);
  plan.other_local_ranks_host =
      host_bytes_of_local_ranks(plan.host, config, device, plan.local_ranks) - plan.host.total();
  if (device != "cuda") return plan;
#ifdef ESPLAG_HAVE_CUDA
  // The attention's workspace size is the device library's answer: no device, no plan.
  if (cuda_device_count() > 0) {
    plan.gpu = gpu_memory_plan(config, world);
    if (plan.teacher) plan.gpu->teacher = gpu_teacher_bytes(*plan.teacher, config);
  }
  else plan.no_gpu_plan = "no CUDA device is visible (the attention's workspace is the device library's answer)";
#else
  plan.no_gpu_plan = "this esplag was built without the CUDA backend (the cuda preset)";
#endif
  return plan;
}

}  // namespace

PlanFunction planner(const TrainConfig& config, const std::string& device, int world, int local_ranks) {
  std::string problem;
  std::optional<ModelConfig> teacher = teacher_model(config, problem);
  return [=](const TrainConfig& c) { return plan_with_teacher(c, device, world, local_ranks, teacher, problem); };
}

MemoryPlan plan_memory(const TrainConfig& config, const std::string& device, int world, int local_ranks) {
  return planner(config, device, world, local_ranks)(config);
}

void check_host_memory(const TrainConfig& config, const std::string& device, uint64_t available, int world,
                       int local_ranks) {
  if (available > 0) check_host_memory(config, available, planner(config, device, world, local_ranks));
}

void check_host_memory(const TrainConfig& config, uint64_t available, const PlanFunction& plan) {
  if (available == 0) return;
  const MemoryPlan planned = plan(config);
  const std::string& device = planned.device;
  const int local_ranks = planned.local_ranks;
  const auto need_of = [&](const TrainConfig& c) { return plan(c).host_of_local_ranks(); };
  const uint64_t need = planned.host_of_local_ranks();
  if (need <= available) return;
  std::string fits;
  TrainConfig smaller = config;
  smaller.batch_size = 1;
  if (need_of(smaller) <= available) {
    // The weights fit: the activations grow with the batch, so the largest batch that fits.
    while (need_of(smaller) <= available) ++smaller.batch_size;
    fits = "train.batch_size " + std::to_string(smaller.batch_size - 1) + " would fit (with train.grad_accum for the " +
           "same tokens per step)";
    TrainConfig checkpointed = config;
    checkpointed.checkpointing = {CheckpointMode::full, 1};
    if (device == "cpu" && need_of(checkpointed) <= available)
      fits += ", and so would train.checkpointing full with this batch size (the same gradients, each block's forward "
              "run twice)";
  } else {
    std::string best;
    int64_t best_params = 0;
    for (const auto& name : model_preset_names()) {
      TrainConfig preset = config;
      preset.model = model_preset(name);
      preset.model.vocab_size = config.model.vocab_size;
      preset.seq_len = std::min(config.seq_len, preset.model.max_seq_len);
      if (need_of(preset) <= available && preset.model.num_params() > best_params) {
        best = name;
        best_params = preset.model.num_params();
      }
    }
    fits = best.empty() ? "no model preset fits either" : "model.preset " + best + " would fit";
  }
  fail("model ", config.model.preset, " (", config.model.num_params(), " parameters) needs about ", format_bytes(need),
       " of host memory to train on ", device,
       local_ranks > 1 ? " (its " + std::to_string(local_ranks) + " ranks on this host)" : std::string(),
       " with train.batch_size ", config.batch_size, " and train.seq_len ", config.seq_len, ", but ",
       format_bytes(available), " is available; ", fits);
}

MemoryBudget memory_at_hand(const std::string& device, int cuda_device) {
  MemoryBudget budget;
#ifdef ESPLAG_HAVE_CUDA
  if (device == "cuda") {
    budget.gpu = gpu_free_bytes(cuda_device);
    budget.gpu_source = budget.gpu ? "free on CUDA device " + std::to_string(cuda_device) : "no CUDA device visible";
  }
#else
  (void)device, (void)cuda_device;
#endif
  budget.host = available_host_bytes();
  budget.host_source = budget.host ? "available now" : "not readable";
  return budget;
}

std::vector<ActivationCheckpointing> checkpointing_choices(const ModelConfig& model) {
  std::vector<ActivationCheckpointing> choices = {{CheckpointMode::none, 1}, {CheckpointMode::selective, 1}};
  // Blocks 0, K, 2K, ... are checkpointed: K's with as many blocks save as much.
  int64_t blocks = 0;
  for (int every = std::max(model.n_layer, 1); every >= 1; --every) {
    const int64_t checkpointed = (int64_t(model.n_layer) + every - 1) / every;
    if (checkpointed == blocks) continue;
    blocks = checkpointed;
    choices.push_back({CheckpointMode::full, every});
  }
  return choices;
}

std::optional<TrainConfig> cheapest_fit(const TrainConfig& config, const MemoryBudget& budget,
                                        const PlanFunction& plan, bool smaller_batches) {
  if (plan(config).fits(budget)) return config;
  for (const TrainConfig& c : candidates(config, smaller_batches))
    if (!overrides(config, c).empty() && plan(c).fits(budget)) return c;
  return std::nullopt;
}

std::optional<std::vector<std::string>> settings_that_fit(const TrainConfig& config, const std::string& device,
                                                          const MemoryBudget& budget, int world, int local_ranks) {
  const PlanFunction plan = planner(config, device, world, local_ranks);
  const std::optional<TrainConfig> fit = cheapest_fit(config, budget, plan, true);
  if (!fit) return std::nullopt;
  return overrides(config, *fit);
}

std::string apply_train_memory(TrainConfig& config, const MemoryBudget& budget, const PlanFunction& plan) {
  if (config.memory == "fixed") {
    const MemoryPlan p = plan(config);
    if (p.fits_gpu(budget)) return "";
    const std::optional<TrainConfig> fit = cheapest_fit(config, budget, plan, true);
    fail("the run does not fit: it needs ", need_text(limit_of(p, budget)),
         " (train.memory fixed: the settings as written)\n", describe(config, p, budget),
         fit ? "cheapest settings that fit: " + overrides_text(overrides(config, *fit)) +
                   " (train.memory auto chooses train.checkpointing and train.offload when the run starts)"
             : std::string("nothing fits, not with train.checkpointing full and train.batch_size 1 either: the run "
                           "needs a smaller model, a shorter train.seq_len or more memory"));
  }
  TrainConfig none = config;
  none.checkpointing = {CheckpointMode::none, 1};
  const std::optional<TrainConfig> chosen = cheapest_fit(none, budget, plan, false);
  if (!chosen) {
    TrainConfig full = config;
    full.checkpointing = {CheckpointMode::full, 1};
    if (config.device != "cpu") full.offload = "optimizer+master";
    const MemoryPlan p = plan(full);
    // What would fit beyond checkpointing: a smaller micro-batch (with auto's checkpointing).
    std::string would_fit =
        "nothing smaller fits either: the run needs a smaller model, a shorter train.seq_len or more memory";
    if (const std::optional<TrainConfig> fit = cheapest_fit(none, budget, plan, true)) {
      TrainConfig same_batch = *fit;
      same_batch.batch_size = config.batch_size;
      same_batch.grad_accum = config.grad_accum;
      would_fit = "a smaller micro-batch fits (the same sequences per step): " +
                  overrides_text(overrides(same_batch, *fit));
    }
    fail("train.memory auto: the run does not fit, not even with train.checkpointing full in every block",
         full.offload == config.offload ? "" : " and train.offload " + full.offload, ": it needs ",
         need_text(limit_of(p, budget)), "\n", describe(full, p, budget), would_fit);
  }
  const Limit before = limit_of(plan(none), budget);
  std::string line = "memory auto: train.checkpointing=" + checkpointing_text(chosen->checkpointing) + " (";
  if (chosen->checkpointing.mode == CheckpointMode::none) {
    line += "it needs " + need_text(before) + ")";
  } else {
    const MemoryPlan after = plan(*chosen);
    line += "none needs " + need_text(before) + "; " + checkpointing_text(chosen->checkpointing) + " needs " +
            format_bytes(before.gpu ? after.gpu->total() : after.host_of_local_ranks()) + ")";
  }
  if (chosen->offload != config.offload)
    line += "; train.offload=" + chosen->offload + " (the checkpointing alone does not fit)";
  config.checkpointing = chosen->checkpointing;
  config.offload = chosen->offload;
  return line;
}

std::string apply_train_memory(TrainConfig& config, const std::string& device, int cuda_device, int world,
                               int local_ranks) {
  const PlanFunction plan = planner(config, device, world, local_ranks);
  const MemoryBudget budget = memory_at_hand(device, cuda_device);
  const std::string line = apply_train_memory(config, budget, plan);
  check_host_memory(config, budget.host, plan);
  return line;
}

std::string describe(const TrainConfig& config, const MemoryPlan& plan, const MemoryBudget& budget) {
  std::ostringstream os;
  os << "model " << config.model.preset << " (" << config.model.num_params() << " parameters), micro-batch "
     << config.batch_size << " x " << config.seq_len << ", train.grad_accum " << config.grad_accum
     << ", train.checkpointing " << to_string(config.checkpointing.mode);
  if (config.checkpointing.mode != CheckpointMode::none) os << " every " << config.checkpointing.every;
  os << ", on " << plan.device << "\n" << ranks_text(config, plan);
  const bool offload = plan.device == "cuda" && config.offload != "none";
  os << "host memory"
     << (plan.device != "cuda" ? ""
         : offload             ? " (the host copy of the weights, and the optimizer state offloaded to pinned memory)"
                               : " (the host copy of the weights and moments)")
     << ":\n"
     << row("weights", plan.host.weights) << row("gradients", plan.host.gradients) << row("moments", plan.host.moments)
     << (plan.host.master_low ? row("master low", plan.host.master_low) : "")
     << (plan.host.kinds ? row("sparse kinds", plan.host.kinds) : "")
     << (plan.host.teacher ? row("teacher", plan.host.teacher) : "")
     << row("activations", plan.host.activations) << row("total", plan.host.total())
     << (plan.local_ranks == 1 ? ""
                               : "  " + std::to_string(plan.local_ranks) + " ranks on this host: " +
                                     format_bytes(plan.host_of_local_ranks()) +
                                     (plan.device == "cuda" && !offload
                                          ? " (rank 0 alone makes the host copy of the moments)\n"
                                          : "\n"))
     << "  " << verdict(plan.fits_host(budget), budget.host, budget.host_source) << "\n"
     << (plan.teacher_problem.empty() ? "" : "  note: " + plan.teacher_problem + "\n");
  os << "GPU memory:";
  if (plan.device != "cuda") return os.str() + " none (train.device " + plan.device + ")\n";
  if (!plan.gpu)
    return os.str() + " unknown: " + plan.no_gpu_plan + "; the model state:\n" +
           model_state_text(*plan.gpu_state, config.offload, true) +
           (plan.teacher ? "  note: the distillation teacher (" + std::to_string(plan.teacher->num_params()) +
                               " parameters, forward only) adds its bf16 weights and their low halves (" +
                               format_bytes(uint64_t(plan.teacher->num_params()) * 4) +
                               ") and one block's activations\n"
                         : "");
  const GpuMemoryBytes& g = *plan.gpu;
  os << "\n"
     << row("params", g.params) << row("grads", g.grads) << row("optimizer", g.optimizer)
     << row("activations", g.activations) << row("scratch", g.scratch) << row("workspace", g.workspace)
     << (g.teacher ? row("teacher", g.teacher) : "")
     << row("total", g.total()) << "  " << verdict(plan.fits_gpu(budget), budget.gpu, budget.gpu_source) << "\n"
     << model_state_text(*plan.gpu_state, config.offload, false);
  return os.str();
}

}  // namespace esplag
