// The one list of Linear kinds (docs/linear-kinds.md, "Adding a sparsity method"): per kind
// its name, a line saying what it is, the properties the rest of the engine asks about, and
// how the CPU builds it. make_linear's dispatch, its errors, the trainer's device rule,
// `esplag sparsity`'s pattern check and the bench options are queries of it; the GPU's kind
// table (model/cuda/device_linear_kinds.cu) is checked against it.
//
//   LinearKindInfo k;
//   k.name = "halves";  k.description = "dense, its product in two halves of the outputs";
//   k.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
//     return std::make_unique<HalvesLinear<T>>(b.params);
//   });
//   register_linear_kind(std::move(k));  // make_linear(p, {.kind = "halves"}) builds it
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "model/linear.h"
#include "model/linear_kinds.h"
#include "model/linear_semi_sparse.h"

namespace esplag {

// What a kind's make_cpu gets from make_linear, which has checked the kind's options
// (sparse_dw only where takes_sparse_dw) and adds the LoRA wrapper where the kind's adapter
// style is `wrapper`.
template <typename T>
struct LinearBuild {
  const LinearParams<T>& params;
  const LinearOptions& options;
  // The layer being replaced, unwrapped from its LoRA wrapper; null when there is none.
  const Linear<T>* previous = nullptr;
  // sparse_dw's MVUE draws (continuing the previous layer's); off without options.sparse_dw.
  MvueWeightGrad<T> dw;
  bool adapter = false;        // options.lora_enabled && options.lora_rank > 0
  uint64_t adapter_seed = 0;   // layer_seed(options.seed, params.name)
};

template <typename T>
using MakeCpuLinear = std::function<std::unique_ptr<Linear<T>>(LinearBuild<T>&)>;

// How a kind takes a low-rank adapter: make_linear's LoRA wrapper around it, or its own
// (slope's lazy W1 + L·R, built by its make_cpu from LinearBuild::adapter).
enum class AdapterStyle { wrapper, own };

struct LinearKindInfo {
  std::string name;         // as written in recipes and returned by Linear::kind()
  std::string description;  // one line
  // The stored weight holds the kind's pattern (masked, slope, vnm): `esplag sparsity`
  // checks it. Kinds that prune at run time keep a dense master weight.
  bool stores_sparse_weight = false;
  bool takes_sparse_dw = false;     // LinearOptions::sparse_dw
  bool takes_activation = false;    // LinearOptions::activation
  // Rebuilt under the same kind with a mask chosen anew on the host (gradual magnitude
  // pruning's ramp): a device copy must take the host's mask again after a write-back.
  bool host_rechooses_mask = false;
  AdapterStyle adapter = AdapterStyle::wrapper;
  // On the GPU its products are cuSPARSELt's 2:4 ones: the layer's shape and the
  // micro-batch's tokens must be multiples of 16 (the trainer's device rule checks them).
  bool gpu_needs_16 = false;
  // A recipe modifier of the kind's name holds layers as this kind from its `start` on
  // (docs/recipes.md). Its keys are params, start and recipe_keys, in this order (the order
  // Recipe::to_yaml writes them): steps (until: dense from then on; lora_start: when the
  // adapter of lora_rank starts) and the LinearOptions a recipe sets (activation,
  // mask_change_freq, lora_rank, sparse_dw), one of linear_recipe_keys() each. masked and
  // vnm are reached through gradual_magnitude and kernel_replacement, which are not kinds.
  bool recipe_modifier = false;
  std::vector<std::string> recipe_keys = {"until"};
  // The GPU model trains it: the CUDA build's kind table has an entry of this name, and
  // has none for a kind without it (checked by device_linear_kinds()).
  bool gpu = false;
  // About the host memory its CPU layer keeps per weight of the layer besides the flat
  // weight (masks, compressed copies, their indices; not the work buffers of a product) in
  // a CPU run, and in a GPU run, where it is the host model's twin that checkpoints are
  // written from and runs no CPU product: the host memory plan counts the one of the run's
  // device.
  double host_bytes_per_weight = 0;
  double host_twin_bytes_per_weight = 0;
  // The share of its weight's elements the trained parameter holds (slope: the kept values,
  // half): a GPU model stores, and keeps gradients and moments of, that many per weight.
  double stored_fraction = 1;
  MakeCpuLinear<float> make_float;
  MakeCpuLinear<double> make_double;

  // Sets both precisions from one generic lambda
  // `[]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> { ... }`.
  template <typename F>
  void set_make_cpu(F f) {
    make_float = f;
    make_double = f;
  }
  template <typename T>
  const MakeCpuLinear<T>& make_cpu() const {
    if constexpr (std::is_same_v<T, float>) return make_float;
    else return make_double;
  }
};

// Every kind, the built-in ones first in a fixed order (dense first), then the registered
// ones in the order of registration. References stay valid across registrations.
const std::deque<LinearKindInfo>& linear_kinds();
// The kind named `name`, or null.
const LinearKindInfo* lookup_linear_kind(const std::string& name);
// The kind named `name`; else Error "<context>: unknown kind 'name' (known kinds: ...)".
const LinearKindInfo& find_linear_kind(const std::string& name, const std::string& context);
// Adds a kind. Error for an empty name, a name that is not [a-z0-9_], one already
// registered, a missing make_cpu, or recipe keys that are not linear_recipe_keys(), repeat
// one, name an option the kind does not take (sparse_dw, activation) or give lora_rank
// without lora_start. Not thread-safe: register before building layers.
void register_linear_kind(LinearKindInfo kind);

// The keys a kind's recipe modifier may have besides params and start
// (LinearKindInfo::recipe_keys), each parsed by the recipe into the modifier's
// LinearOptions or steps: until, lora_start, activation, mask_change_freq, lora_rank,
// sparse_dw.
const std::vector<std::string>& linear_recipe_keys();

// The kind every layer starts as, with no sparsity: "dense".
const std::string& dense_linear_kind();
// The kind of the layer under a LoRA wrapper: "masked" for "masked+lora" (LoraLinear::kind()).
std::string base_linear_kind(const std::string& kind);
// "dense, masked and slope": the names of the kinds `pick` accepts, in registry order
// (`last` joins the last two: "and", "or").
std::string linear_kind_list(const std::function<bool(const LinearKindInfo&)>& pick, const std::string& last = "and");

}  // namespace esplag
