// The sparsity-recipe parser (train/recipe.h) on arbitrary YAML lists, validated against
// the linear weights of the default model as the trainer does, then scheduled; an
// accepted recipe written back by to_yaml parses again to the same plans.
#include "fuzz_input.h"
#include "model/transformer.h"
#include "train/config.h"
#include "train/layer_kinds.h"
#include "train/recipe.h"

using namespace esplag;

namespace {

constexpr int64_t kSteps = 1000;

const LinearShapes& shapes() {
  static const LinearShapes s = [] {
    ModelConfig m = TrainConfig{}.model;
    m.vocab_size = 257;
    Transformer<float> model(m);
    return linear_shapes(model);
  }();
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  Recipe r;
  if (!fuzz::accepts([&] {
        r = Recipe::parse(text, "fuzz.yaml");
        r.validate(shapes(), kSteps);
      }))
    return 0;
  std::vector<std::map<std::string, LayerPlan>> plans;
  for (const int64_t step : {int64_t(0), int64_t(1), kSteps / 3, kSteps / 2, kSteps - 1}) {
    plans.push_back(r.plan_at(step));
    (void)r.changed_at(step);
  }
  (void)r.describe();

  // An Error from here on is a bug: it escapes.
  Recipe back = Recipe::parse(r.to_yaml(), "to_yaml");
  back.validate(shapes(), kSteps);
  fuzz::require(back.to_yaml() == r.to_yaml(), "to_yaml then parse changed the recipe");
  size_t i = 0;
  for (const int64_t step : {int64_t(0), int64_t(1), kSteps / 3, kSteps / 2, kSteps - 1})
    fuzz::require(back.plan_at(step) == plans[i++], "to_yaml then parse changed a plan");
  return 0;
}
