// Turning a recipe's plan into Linear kinds on a model: what the trainer does at each
// step boundary, and what every command that loads a checkpoint does to rebuild the kinds
// the checkpoint was saved with (the recipe is part of the saved config, and a plan is a
// pure function of the step, so the kinds at step s are those of plan_at(s - 1)).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "model/transformer.h"
#include "train/recipe.h"

namespace esplag {

// Weight name -> (out, in) of every block linear: what Recipe::validate checks against.
LinearShapes linear_shapes(Transformer<float>& model);
// The same from the config alone (Transformer's layout: qkv [Q, C], attn.proj [C, H·D],
// mlp.fc [F, C], mlp.proj [C, d_ff]), so a recipe is checked before a model is built.
LinearShapes linear_shapes(const ModelConfig& config);

// Rebuilds the layer `name` as `plan` says (from the layer it replaces, so kernel
// replacement keeps a mask and SLoPe keeps its state). `seed` (the run's) seeds adapters
// and sparse_dw's MVUE draws.
void apply_layer_plan(Transformer<float>& model, const std::string& name, const LayerPlan& plan, uint64_t seed);

// Applies every change the recipe makes at `step`; `log` gets one line per changed layer.
void apply_recipe_step(Transformer<float>& model, const Recipe& recipe, int64_t step, uint64_t seed,
                       const std::function<void(const std::string&)>& log);

// On a freshly built model: gives every layer the kind it had after `steps_done` steps.
void build_kinds_after(Transformer<float>& model, const Recipe& recipe, int64_t steps_done, uint64_t seed);

}  // namespace esplag
