// The sparsity recipe: the run config's top-level `recipe:` list of modifiers (in the
// spirit of sparseml recipes), each claiming some linear weights over a range of steps.
// This layer parses, validates and schedules; the trainer applies what plan_at(step)
// says by building Linear kinds, and distills from a teacher where distills_at(step) says.
// docs/recipes.md is the user-facing reference.
//
// Life of a recipe:
//   Recipe r = Recipe::parse(cfg.recipe_yaml, "run.yaml");  // syntax, keys, values (TrainConfig::recipe())
//   r.validate(shapes_of_the_model, cfg.steps);              // names, shapes, clashes; binds steps
//   at start / resume step s: apply r.plan_at(s) to every layer in it
//   before each later step s: apply r.plan_at(s) to the layers in r.changed_at(s)
// plan_at is a pure function of the step (and of what validate bound), so a resumed run
// recomputes exactly the plan of the uninterrupted one.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "model/linear_kinds.h"
#include "sparse/pattern.h"

namespace YAML {
class Node;
}

namespace esplag {

// Linear weight name ("blocks.3.mlp.fc.weight") -> (out_features, in_features) = (rows, cols).
using LinearShapes = std::map<std::string, std::pair<int, int>>;

// What one linear weight should be at one step: the options its layer is built with
// (model/linear_kinds.h; the trainer adds the run's seed) and the modifier in charge. The
// recipe sets kind, pattern and sparsity (masked: the mask to hold; semi_sparse, slope:
// 2:4 of the weight; semi_sparse_activation: 2:4 of the input; vnm: the mask handed over by
// gradual_magnitude) and the options of the kind.
struct LayerPlan : LinearOptions {
  int modifier = -1;  // index in the recipe of the modifier in charge; -1: none

  // Same effect on the layer (everything but `modifier`): what changed_at compares.
  bool same_effect(const LayerPlan& o) const { return LinearOptions(*this) == LinearOptions(o); }
  friend bool operator==(const LayerPlan&, const LayerPlan&) = default;
};

// A step as written in a recipe: an integer is a step index, a number written with a '.'
// or an exponent is a fraction of train.steps in [0, 1] (rounded to the nearest step).
struct StepValue {
  bool is_fraction = false;
  int64_t steps = 0;
  double fraction = 0.0;
  std::string text;  // as written (kept so that to_yaml round-trips)

  int64_t resolve(int64_t total_steps) const;
};

class Recipe {
 public:
  // A modifier: the LinearOptions it hands to its layers (kind, pattern and the options its
  // keys set: activation, mask_change_freq, lora_rank, sparse_dw; plan_at adds what
  // depends on the step) and its own scheduling. A kind's modifier has the keys of its
  // registry entry (LinearKindInfo::recipe_keys); gradual_magnitude and kernel_replacement,
  // which are not kinds, have their own. distill claims no weights: it changes the loss.
  struct Modifier : LinearOptions {
    std::string type;  // gradual_magnitude | kernel_replacement | distill | a kind with recipe_modifier
    std::vector<std::string> params;  // as written: exact names or "re:REGEX" (full match)
    StepValue start;
    // gradual_magnitude
    SparsityPattern mask;  // the target (for unstructured: its sparsity is final_sparsity)
    double init_sparsity = 0.0;
    double final_sparsity = 0.0;  // for N:M / V:N:M: implied by the pattern
    bool final_given = false;
    StepValue end, update_every;
    // key until: dense from then on
    bool has_until = false;
    StepValue until;
    // key lora_start: the adapter of rank lora_rank from then on
    StepValue lora_start;
    // distill: the teacher's checkpoint or run directory (as written) and the loss's weights
    std::string teacher;
    double alpha = 0.5, temperature = 2.0;

    // Whether `params` names the weight (an exact name, or a "re:" pattern matching it whole).
    bool claims(const std::string& weight_name) const;
    // The Linear kind it gives its layers (LinearOptions::kind, which this hides): masked
    // (gradual_magnitude), vnm (kernel_replacement), else the kind of its own name.
    const std::string& kind() const { return LinearOptions::kind; }
  };

  // `yaml_list_text`: the YAML of the list (what TrainConfig::recipe_yaml holds); empty or
  // null text is the empty recipe. `source` (the config file) prefixes every error.
  static Recipe parse(const std::string& yaml_list_text, const std::string& source);
  static Recipe parse(const YAML::Node& list, const std::string& source);
  // The keys a modifier type knows (params, start, ...); empty for an unknown type.
  static std::vector<std::string> modifier_keys(const std::string& type);

  // Checks the recipe against the model's linear weights and binds it to the run length:
  // resolves regexes and fractions of `total_steps`, checks shapes and that no weight is
  // claimed by two modifiers at once. Must precede plan_at / changed_at; may be repeated.
  void validate(const LinearShapes& linear_shapes, int64_t total_steps);
  bool validated() const { return validated_; }

  // The plan of every weight any modifier claims (at any step) for step `step` (0-based,
  // the step about to run). Weights absent from the map are dense for the whole run.
  std::map<std::string, LayerPlan> plan_at(int64_t step) const;
  // Weights whose plan at `step` differs in effect from the one at `step - 1` (at step 0:
  // from dense), in name order: what the trainer rebuilds before running `step`.
  std::vector<std::string> changed_at(int64_t step) const;
  bool is_update_step(int64_t step) const { return !changed_at(step).empty(); }
  // Step 0 and the steps at which a modifier's hold on a weight begins or ends, ascending:
  // a weight's kind changes only there (gradual_magnitude's ramp changes masks in between).
  std::vector<int64_t> kind_boundaries() const;
  // The distill modifier, or null when the recipe has none (at most one is allowed).
  const Modifier* distill() const;
  // Whether the loss of `step` is the distillation loss: a distill modifier in [start, until).
  bool distills_at(int64_t step) const;
  // Whether a layer changed at `step` takes another kind, pattern or sparsity: chosen from
  // the weights as they are then (not only an adapter, sparse dW or a refresh schedule).
  bool reads_weights_at(int64_t step) const;

  // Human-readable summary, one line per modifier (with resolved steps once validated).
  std::string describe() const;
  // The recipe list as YAML, every key explicit (defaults filled in); parse() reads it back
  // to the same recipe.
  std::string to_yaml() const;
  bool empty() const { return modifiers_.empty(); }
  // The steps written as fractions of train.steps (e.g. "recipe[0] (semi_sparse) until
  // 0.7"), in recipe order: a run resumed with another total would move them.
  std::vector<std::string> fractional_steps() const;
  const std::vector<Modifier>& modifiers() const { return modifiers_; }
  const std::string& source() const { return source_; }

 private:
  // One modifier's hold on one weight over [begin, end) (end = INT64_MAX: to the end).
  struct Claim {
    int modifier = -1;
    int64_t begin = 0;
    int64_t end = 0;
  };
  struct Bound {  // a modifier's resolved steps and weights
    int64_t start = 0, end = 0, update_every = 1, until = 0, lora_start = 0;
    std::vector<std::string> names;
  };

  void parse_items(const YAML::Node& list);
  // distill's keys (teacher, alpha, temperature) of modifier `index`, described by `w`.
  void parse_distill(const std::string& w, const std::map<std::string, YAML::Node>& kv, int index);
  // The plan of the step before `step` for the weights of `now` (plan_at(step)): dense ones
  // at step 0.
  std::map<std::string, LayerPlan> plan_before(int64_t step, const std::map<std::string, LayerPlan>& now) const;
  std::string where(int i) const;  // "<source>: recipe[i] (type)"
  LayerPlan plan_of(int modifier, int64_t step) const;

  std::string source_;
  std::vector<Modifier> modifiers_;
  bool validated_ = false;
  int64_t total_steps_ = 0;
  std::vector<Bound> bound_;
  std::map<std::string, std::vector<Claim>> claims_;  // per weight, ordered by begin
};

}  // namespace esplag
