#include "train/stored_layout.h"

#include <cmath>
#include <map>

#include "core/error.h"
#include "model/linear_registry.h"
#include "model/transformer.h"
#include "train/layer_kinds.h"
#include "train/recipe.h"

namespace esplag {

StoredLayout largest_stored_layout(const TrainConfig& config) {
  const uint64_t all = uint64_t(config.model.num_params());
  StoredLayout largest{all, {}};
  if (config.recipe_yaml.empty()) return largest;
  Recipe recipe = config.recipe();
  try {
    recipe.validate(linear_shapes(config.model), config.steps);
  } catch (const Error&) {
    // Not this model's recipe (the planner also sizes other presets with it): the dense
    // layout bounds it. A run of it is refused by the trainer's own validation.
    return largest;
  }
  std::map<std::string, uint64_t> numel;
  for (const ParamInfo& info : transformer_param_layout(config.model)) numel[info.name] = info.numel;
  bool first = true;
  for (const int64_t step : recipe.kind_boundaries()) {  // where the layout can change
    if (step >= config.steps) break;
    StoredLayout at{all, {}};
    for (const auto& [name, plan] : recipe.plan_at(step)) {
      const double fraction = find_linear_kind(plan.kind, "recipe").stored_fraction;
      if (fraction == 1) continue;
      at.elements -= numel.at(name) - uint64_t(std::llround(fraction * double(numel.at(name))));
      at.kept_values.insert(name);
    }
    if (first || at.elements > largest.elements) largest = at;
    first = false;
  }
  return largest;
}

}  // namespace esplag
