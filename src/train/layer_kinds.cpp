#include "train/layer_kinds.h"

#include <memory>
#include <sstream>
#include <utility>
#include <vector>

#include "core/parallel.h"
#include "model/linear_kinds.h"
#include "model/linear_registry.h"

namespace esplag {

LinearShapes linear_shapes(Transformer<float>& model) {
  LinearShapes shapes;
  for (const auto& name : model.linear_names()) {
    const auto& p = model.linear(name).params();
    shapes[name] = {p.out_features, p.in_features};
  }
  return shapes;
}

LinearShapes linear_shapes(const ModelConfig& c) {
  LinearShapes shapes;
  for (int l = 0; l < c.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    shapes[b + "attn.qkv.weight"] = {c.qkv_dim(), c.d_model};
    shapes[b + "attn.proj.weight"] = {c.d_model, c.n_head * c.head_dim()};
    shapes[b + "mlp.fc.weight"] = {c.fc_dim(), c.d_model};
    shapes[b + "mlp.proj.weight"] = {c.d_model, c.d_ff};
  }
  return shapes;
}

namespace {

LinearOptions options_of(const LayerPlan& plan, uint64_t seed) {
  LinearOptions o = plan;
  o.seed = seed;
  return o;
}

// The layers of `plans` built in parallel, one per task (a layer's construction reads and
// writes only its own layer and its slice of the flat weights; a 1B model's 64 slope
// layers take about a minute one after the other), then installed in order.
void apply_layer_plans(Transformer<float>& model, const std::vector<std::pair<std::string, LayerPlan>>& plans,
                       uint64_t seed) {
  std::vector<std::unique_ptr<Linear<float>>> built(plans.size());
  parallel_tasks(int64_t(plans.size()), [&](int64_t i) {
    const auto& [name, plan] = plans[size_t(i)];
    built[size_t(i)] = make_linear(model.linear_params(name), options_of(plan, seed), &model.linear(name));
  });
  for (size_t i = 0; i < plans.size(); ++i) model.replace_linear(plans[i].first, std::move(built[i]));
}

}  // namespace

void apply_layer_plan(Transformer<float>& model, const std::string& name, const LayerPlan& plan, uint64_t seed) {
  model.replace_linear(name, make_linear(model.linear_params(name), options_of(plan, seed), &model.linear(name)));
}

void apply_recipe_step(Transformer<float>& model, const Recipe& recipe, int64_t step, uint64_t seed,
                       const std::function<void(const std::string&)>& log) {
  const auto changed = recipe.changed_at(step);
  if (changed.empty()) return;
  const auto plan = recipe.plan_at(step);
  std::vector<std::pair<std::string, LayerPlan>> plans;
  for (const auto& name : changed) plans.emplace_back(name, plan.at(name));
  apply_layer_plans(model, plans, seed);
  for (const auto& name : changed) {
    const LayerPlan& p = plan.at(name);
    const Linear<float>& l = model.linear(name);
    std::ostringstream line;
    line << "step " << step << ": " << name << " -> " << l.kind();
    if (l.pattern() != "dense") line << " " << l.pattern();
    if (p.lora_enabled) line << ", low-rank adapter r=" << p.lora_rank;
    if (p.sparse_dw) line << ", sparse dW";
    if (find_linear_kind(p.kind, "linear '" + name + "'").takes_activation)
      line << " (" << activation_sparsity_name(p.activation) << ")";
    log(line.str());
  }
}

void build_kinds_after(Transformer<float>& model, const Recipe& recipe, int64_t steps_done, uint64_t seed) {
  if (steps_done <= 0 || recipe.empty()) return;
  std::vector<std::pair<std::string, LayerPlan>> plans;
  for (const auto& [name, plan] : recipe.plan_at(steps_done - 1))
    if (plan.kind != dense_linear_kind()) plans.emplace_back(name, plan);
  apply_layer_plans(model, plans, seed);
}

}  // namespace esplag
