#include "model/linear_registry.h"

#include <algorithm>

#include "core/error.h"
#include "model/linear_masked.h"
#include "model/linear_semi_sparse.h"
#include "model/linear_slope.h"
#include "model/linear_vnm.h"

namespace esplag {

namespace {

template <typename T>
std::unique_ptr<Linear<T>> make_slope(LinearBuild<T>& b) {
  const LinearOptions& o = b.options;
  std::unique_ptr<SlopeLinear<T>> s;
  if (const auto* ps = dynamic_cast<const SlopeLinear<T>*>(b.previous))
    s = std::make_unique<SlopeLinear<T>>(b.params, *ps, o.mask_change_freq, std::move(b.dw));
  else
    s = std::make_unique<SlopeLinear<T>>(b.params, o.mask_change_freq, std::move(b.dw));
  if (b.adapter) s->enable_lora(o.lora_rank, b.adapter_seed);
  return s;
}

template <typename T>
std::unique_ptr<Linear<T>> make_vnm(LinearBuild<T>& b) {
  const LinearParams<T>& p = b.params;
  const SparsityPattern& pattern = b.options.pattern;
  const bool no_pattern = pattern.kind == SparsityPattern::Kind::dense;
  if (const auto* pv = dynamic_cast<const VnmLinear<T>*>(b.previous)) {
    ESPLAG_CHECK(no_pattern || pattern == pv->sparsity_pattern(), "linear '", p.name, "': kind vnm with pattern ",
                 pattern.to_string(), " cannot continue a vnm layer of pattern ", pv->sparsity_pattern().to_string());
    return std::make_unique<VnmLinear<T>>(p, *pv);
  }
  if (const auto* pm = dynamic_cast<const MaskedLinear<T>*>(b.previous))  // kernel replacement: GMP's mask as it is
    return std::make_unique<VnmLinear<T>>(p, no_pattern ? pm->sparsity_pattern() : pattern, pm->mask());
  return std::make_unique<VnmLinear<T>>(p, pattern);
}

std::deque<LinearKindInfo> builtin_kinds() {
  std::deque<LinearKindInfo> kinds(6);
  LinearKindInfo& dense = kinds[0];
  dense.name = "dense";
  dense.description = "dense products, no sparsity";
  dense.gpu = true;
  dense.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
    return std::make_unique<DenseLinear<T>>(b.params);
  });

  LinearKindInfo& masked = kinds[1];
  masked.name = "masked";
  masked.description = "a fixed mask on the weight (unstructured, N:M or V:N:M), dense products";
  masked.stores_sparse_weight = true;
  masked.host_rechooses_mask = true;
  masked.gpu = true;
  masked.host_bytes_per_weight = 1;  // the u8 mask
  masked.host_twin_bytes_per_weight = 1;
  masked.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
    const LinearOptions& o = b.options;
    return std::make_unique<MaskedLinear<T>>(b.params, o.pattern, o.sparsity > 0 ? o.sparsity : o.pattern.sparsity);
  });

  LinearKindInfo& semi = kinds[2];
  semi.name = "semi_sparse";
  semi.description = "2:4 weight pruned at run time from a dense master, sparse forward and dX";
  semi.takes_sparse_dw = true;
  semi.recipe_modifier = true;
  semi.recipe_keys = {"until", "sparse_dw"};
  semi.gpu = true;
  semi.gpu_needs_16 = true;
  semi.host_bytes_per_weight = 4;  // the pruned weight Ws, made by the first forward
  semi.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
    return std::make_unique<SemiSparseLinear<T>>(b.params, std::move(b.dw));
  });

  LinearKindInfo& act = kinds[3];
  act.name = "semi_sparse_activation";
  act.description = "2:4 pruning of the input activations, sparse forward";
  act.takes_activation = true;
  act.recipe_modifier = true;
  act.recipe_keys = {"until", "activation"};
  act.gpu = true;
  act.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
    return std::make_unique<SemiSparseActivationLinear<T>>(b.params, b.options.activation);
  });

  LinearKindInfo& slope = kinds[4];
  slope.name = "slope";
  slope.description = "SLoPe: stored 2:4 weight, double-pruned backward, lazy low-rank adapter";
  slope.stores_sparse_weight = true;
  slope.takes_sparse_dw = true;
  slope.adapter = AdapterStyle::own;
  slope.recipe_modifier = true;
  slope.recipe_keys = {"mask_change_freq", "lora_rank", "lora_start", "sparse_dw"};
  slope.gpu = true;
  slope.gpu_needs_16 = true;
  // W1 and W2ᵀ compressed (half the values, fp32, and their metadata) and the int32 slot
  // index of each; the twin keeps W1 and W2ᵀ's metadata (the CPU products build the rest).
  slope.host_bytes_per_weight = 2 * 2.125 + 2 * 2;
  slope.host_twin_bytes_per_weight = 2.125 + 0.125;
  slope.stored_fraction = 0.5;  // the kept values [out, in/2]
  slope.set_make_cpu([]<typename T>(LinearBuild<T>& b) { return make_slope(b); });

  LinearKindInfo& vnm = kinds[5];
  vnm.name = "vnm";
  vnm.description = "VENOM: stored V:2:M weight (kernel replacement after gradual magnitude pruning)";
  vnm.stores_sparse_weight = true;
  vnm.gpu = true;
  // The kept values (fp32) and their int32 slot index: 8 bytes per kept weight, at most half.
  vnm.host_bytes_per_weight = 4;
  vnm.host_twin_bytes_per_weight = 4;  // built at construction
  vnm.set_make_cpu([]<typename T>(LinearBuild<T>& b) { return make_vnm(b); });
  return kinds;
}

void check_recipe_keys(const LinearKindInfo& kind) {
  const auto& known = linear_recipe_keys();
  std::string known_text;
  for (const auto& k : known) known_text += (known_text.empty() ? "" : ", ") + k;
  const auto& keys = kind.recipe_keys;
  auto has = [&](const char* key) { return std::find(keys.begin(), keys.end(), key) != keys.end(); };
  for (size_t i = 0; i < keys.size(); ++i) {
    ESPLAG_CHECK(std::find(known.begin(), known.end(), keys[i]) != known.end(), "register_linear_kind: kind '",
                 kind.name, "': recipe key '", keys[i], "' is not one a recipe knows (", known_text, ")");
    ESPLAG_CHECK(std::find(keys.begin(), keys.begin() + i, keys[i]) == keys.begin() + i, "register_linear_kind: kind '",
                 kind.name, "': recipe key '", keys[i], "' is listed twice");
  }
  ESPLAG_CHECK(!has("sparse_dw") || kind.takes_sparse_dw, "register_linear_kind: kind '", kind.name,
               "': recipe key 'sparse_dw' needs takes_sparse_dw");
  ESPLAG_CHECK(!has("activation") || kind.takes_activation, "register_linear_kind: kind '", kind.name,
               "': recipe key 'activation' needs takes_activation");
  ESPLAG_CHECK(has("lora_rank") == has("lora_start"), "register_linear_kind: kind '", kind.name,
               "': recipe keys 'lora_rank' and 'lora_start' go together");
}

std::deque<LinearKindInfo>& registry() {
  static std::deque<LinearKindInfo> kinds = builtin_kinds();
  return kinds;
}

}  // namespace

const std::deque<LinearKindInfo>& linear_kinds() { return registry(); }

const LinearKindInfo* lookup_linear_kind(const std::string& name) {
  for (const auto& k : registry())
    if (k.name == name) return &k;
  return nullptr;
}

const LinearKindInfo& find_linear_kind(const std::string& name, const std::string& context) {
  const LinearKindInfo* k = lookup_linear_kind(name);
  auto all = [](const LinearKindInfo&) { return true; };
  if (!k) fail(context, ": unknown kind '", name, "' (known kinds: ", linear_kind_list(all), ")");
  return *k;
}

void register_linear_kind(LinearKindInfo kind) {
  const std::string& name = kind.name;
  auto word_char = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'; };
  ESPLAG_CHECK(!name.empty() && std::all_of(name.begin(), name.end(), word_char), "register_linear_kind: kind name '",
               name, "' is not a word of a-z, 0-9 and _");
  ESPLAG_CHECK(!lookup_linear_kind(name), "register_linear_kind: kind '", name, "' is registered already");
  ESPLAG_CHECK(kind.make_float && kind.make_double, "register_linear_kind: kind '", name, "' has no make_cpu");
  check_recipe_keys(kind);
  registry().push_back(std::move(kind));
}

const std::vector<std::string>& linear_recipe_keys() {
  static const std::vector<std::string> keys = {"until",     "lora_start", "activation", "mask_change_freq",
                                                "lora_rank", "sparse_dw"};
  return keys;
}

const std::string& dense_linear_kind() { return registry().front().name; }

std::string base_linear_kind(const std::string& kind) { return kind.substr(0, kind.find('+')); }

std::string linear_kind_list(const std::function<bool(const LinearKindInfo&)>& pick, const std::string& last) {
  std::vector<std::string> names;
  for (const auto& k : registry())
    if (pick(k)) names.push_back(k.name);
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " " + last + " " : ", ") + names[i];
  return out;
}

}  // namespace esplag
