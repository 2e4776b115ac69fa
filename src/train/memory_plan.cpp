#include "train/memory_plan.h"

#include <iomanip>
#include <limits>
#include <sstream>

#include "train/progress.h"
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
  return o;
}

// The settings settings_that_fit tries, cheapest first.
std::vector<TrainConfig> candidates(const TrainConfig& config) {
  std::vector<TrainConfig> tried;
  auto with = [&](ActivationCheckpointing checkpointing, int batch_size, int grad_accum) {
    TrainConfig c = config;
    c.checkpointing = checkpointing;
    c.batch_size = batch_size;
    c.grad_accum = grad_accum;
    tried.push_back(c);
  };
  const ActivationCheckpointing selective{CheckpointMode::selective, 1}, full{CheckpointMode::full, 1};
  with(selective, config.batch_size, config.grad_accum);
  with(full, config.batch_size, config.grad_accum);
  const int64_t sequences = int64_t(config.batch_size) * config.grad_accum;
  for (const ActivationCheckpointing& checkpointing : {config.checkpointing, full})
    for (int b = config.batch_size - 1; b >= 1; --b)
      if (sequences % b == 0 && sequences / b <= std::numeric_limits<int32_t>::max())
        with(checkpointing, b, int(sequences / b));
  return tried;
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

}  // namespace

MemoryPlan plan_memory(const TrainConfig& config, const std::string& device) {
  MemoryPlan plan;
  plan.device = device;
  plan.host = host_memory_plan(config, device);
  if (device != "cuda") return plan;
#ifdef ESPLAG_HAVE_CUDA
  // The attention's workspace size is the device library's answer: no device, no plan.
  if (cuda_device_count() > 0) plan.gpu = gpu_memory_plan(config);
  else plan.no_gpu_plan = "no CUDA device is visible (the attention's workspace is the device library's answer)";
#else
  plan.no_gpu_plan = "this esplag was built without the CUDA backend (the cuda preset)";
#endif
  return plan;
}

std::optional<std::vector<std::string>> settings_that_fit(const TrainConfig& config, const std::string& device,
                                                          const MemoryBudget& budget) {
  if (plan_memory(config, device).fits(budget)) return std::vector<std::string>{};
  for (const TrainConfig& c : candidates(config)) {
    const std::vector<std::string> changes = overrides(config, c);
    if (!changes.empty() && plan_memory(c, device).fits(budget)) return changes;
  }
  return std::nullopt;
}

std::string describe(const TrainConfig& config, const MemoryPlan& plan, const MemoryBudget& budget) {
  std::ostringstream os;
  os << "model " << config.model.preset << " (" << config.model.num_params() << " parameters), micro-batch "
     << config.batch_size << " x " << config.seq_len << ", train.grad_accum " << config.grad_accum
     << ", train.checkpointing " << to_string(config.checkpointing.mode);
  if (config.checkpointing.mode != CheckpointMode::none) os << " every " << config.checkpointing.every;
  os << ", on " << plan.device << "\n";
  os << "host memory" << (plan.device == "cuda" ? " (the host copy of the weights and moments)" : "") << ":\n"
     << row("weights", plan.host.weights) << row("gradients", plan.host.gradients) << row("moments", plan.host.moments)
     << row("activations", plan.host.activations) << row("total", plan.host.total()) << "  "
     << verdict(plan.fits_host(budget), budget.host, budget.host_source) << "\n";
  os << "GPU memory:";
  if (plan.device != "cuda") return os.str() + " none (train.device " + plan.device + ")\n";
  if (!plan.gpu) return os.str() + " unknown: " + plan.no_gpu_plan + "\n";
  const GpuMemoryBytes& g = *plan.gpu;
  os << "\n"
     << row("params", g.params) << row("grads", g.grads) << row("optimizer", g.optimizer)
     << row("activations", g.activations) << row("scratch", g.scratch) << row("workspace", g.workspace)
     << row("total", g.total()) << "  " << verdict(plan.fits_gpu(budget), budget.gpu, budget.gpu_source) << "\n";
  return os.str();
}

}  // namespace esplag
