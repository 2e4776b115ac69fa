#include "train/layer_kinds.h"

#include <sstream>

#include "model/linear_kinds.h"

namespace esplag {

LinearShapes linear_shapes(Transformer<float>& model) {
  LinearShapes shapes;
  for (const auto& name : model.linear_names()) {
    const auto& p = model.linear(name).params();
    shapes[name] = {p.out_features, p.in_features};
  }
  return shapes;
}

void apply_layer_plan(Transformer<float>& model, const std::string& name, const LayerPlan& plan, uint64_t seed) {
  LinearOptions o;
  o.kind = plan.kind;
  o.pattern = plan.pattern;
  o.sparsity = plan.sparsity;
  o.mask_change_freq = plan.mask_change_freq;
  o.lora_rank = plan.lora_rank;
  o.lora_enabled = plan.lora_enabled;
  o.seed = seed;
  model.replace_linear(name, make_linear(model.linear_params(name), o, &model.linear(name)));
}

void apply_recipe_step(Transformer<float>& model, const Recipe& recipe, int64_t step, uint64_t seed,
                       const std::function<void(const std::string&)>& log) {
  const auto changed = recipe.changed_at(step);
  if (changed.empty()) return;
  const auto plan = recipe.plan_at(step);
  for (const auto& name : changed) {
    const LayerPlan& p = plan.at(name);
    apply_layer_plan(model, name, p, seed);
    const Linear<float>& l = model.linear(name);
    std::ostringstream line;
    line << "step " << step << ": " << name << " -> " << l.kind();
    if (l.pattern() != "dense") line << " " << l.pattern();
    if (p.lora_enabled) line << ", low-rank adapter r=" << p.lora_rank;
    log(line.str());
  }
}

void build_kinds_after(Transformer<float>& model, const Recipe& recipe, int64_t steps_done, uint64_t seed) {
  if (steps_done <= 0 || recipe.empty()) return;
  for (const auto& [name, plan] : recipe.plan_at(steps_done - 1))
    if (plan.kind != "dense") apply_layer_plan(model, name, plan, seed);
}

}  // namespace esplag
