#include "train/host_memory.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "model/linear_registry.h"
#include "model/transformer.h"
#include "train/recipe.h"
#include "train/stored_layout.h"

namespace esplag {

namespace {

constexpr uint64_t kFloat = sizeof(float);

// The first number of the line of /proc/meminfo that starts with `key`, in bytes; 0 without it.
uint64_t meminfo_bytes(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) {
      std::istringstream fields(line.substr(key.size()));
      uint64_t kib = 0;
      fields >> kib;
      return kib * 1024;
    }
  return 0;
}

// A single number in a cgroup file ("max" or no file: 0).
uint64_t cgroup_value(const char* path) {
  std::ifstream in(path);
  uint64_t v = 0;
  return (in >> v) ? v : 0;
}

// The bytes the recipe's sparse kinds keep on the host in a run on `device`: per block
// Linear weight, the most any modifier that claims it keeps (a layer may go masked, then
// vnm); on the GPU their twins' bytes.
uint64_t kinds_host_bytes(const TrainConfig& config, const std::string& device) {
  if (config.recipe_yaml.empty()) return 0;
  const Recipe recipe = config.recipe();
  std::map<std::string, size_t> numel;
  for (const ParamInfo& info : transformer_param_layout(config.model)) numel[info.name] = info.numel;
  double bytes = 0;
  for (const std::string& name : transformer_linear_names(config.model)) {
    double per_weight = 0;
    for (const auto& m : recipe.modifiers())
      if (!m.kind().empty() && m.claims(name)) {
        const LinearKindInfo& k = find_linear_kind(m.kind(), "recipe");
        per_weight = std::max(per_weight, device == "cuda" ? k.host_twin_bytes_per_weight : k.host_bytes_per_weight);
      }
    bytes += per_weight * double(numel.at(name));
  }
  return uint64_t(bytes);
}

}  // namespace

HostMemoryPlan host_memory_plan(const TrainConfig& config, const std::string& device) {
  const uint64_t params = uint64_t(config.model.num_params());
  HostMemoryPlan plan;
  plan.weights = params * kFloat;
  plan.moments = 2 * params * kFloat;
  plan.kinds = kinds_host_bytes(config, device);
  if (device == "cuda") {
    // The moments (offloaded, or the host copies a checkpoint writes) and the master's low
    // halves are of the stored elements: a slope weight's kept values only.
    const uint64_t stored = largest_stored_layout(config).elements;
    plan.moments = 2 * stored * kFloat;
    if (config.offload == "optimizer+master") plan.master_low = stored * sizeof(uint16_t);
    return plan;
  }
  plan.gradients = params * kFloat;
  plan.activations =
      transformer_activation_elements(config.model, config.batch_size, config.seq_len, config.checkpointing) * kFloat;
  return plan;
}

uint64_t host_bytes_for_training(const TrainConfig& config, const std::string& device) {
  return host_memory_plan(config, device).total();
}

uint64_t host_bytes_of_local_ranks(const HostMemoryPlan& plan, const TrainConfig& config, const std::string& device,
                                   int local_ranks) {
  const uint64_t leader_only = device == "cuda" && config.offload == "none" ? plan.moments : 0;
  return plan.total() + uint64_t(std::max(local_ranks, 1) - 1) * (plan.total() - leader_only);
}

uint64_t available_host_bytes() {
  uint64_t available = meminfo_bytes("MemAvailable:");
  const uint64_t limit = cgroup_value("/sys/fs/cgroup/memory.max");
  const uint64_t used = cgroup_value("/sys/fs/cgroup/memory.current");
  if (limit > 0) {
    const uint64_t left = limit > used ? limit - used : 0;
    available = available == 0 ? left : std::min(available, left);
  }
  return available;
}


}  // namespace esplag
