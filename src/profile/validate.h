// Validation of the what-if model against a real run: profile the dense version of a
// configuration, predict the sparse configuration's step time from per-op speed-ups with
// what_if() over the dense step's graph, then profile the sparse configuration and compare
// the prediction with what it really took, per step and per op category.
//
//   auto steps = run_validation_steps(profiler, dense_step, sparse_step, {warmup, 3, 5});
//   SpeedupModel m = speedups_from_calibration(steps.calibration_dense,
//                                              steps.calibration_sparse, modules);
//   // or: SpeedupModel m = speedups_from_specs(specs);  (e.g. a kernel benchmark's CSV)
//   ValidationResult v = validate_prediction(steps.dense, steps.sparse, m);
//
// Everything works on op records, so the same code validates a CPU run (OpRecorder) and a
// GPU run (the CUDA recorder): only the Profiler's recorder and the step functions differ.
//
// Speed-ups from a calibration. The sparse configuration changes some Linear modules
// (their kind is no longer dense); `modules` names them by op-name prefix
// ("blocks.0.mlp.fc"). Within one step, an op of a module falls in a phase:
//   - "optimizer" when its category is optimizer (the module's parameters' AdamW, norms);
//   - "fwd" / "bwd" when the name after the module starts with "fwd" / "bwd"
//     ("m.fwd", "m.fwd.lora", "m.bwd.dx", "m.bwd.mask");
//   - otherwise (a helper op such as "m.sparsify", "m.mask", "m.sync") the phase of the
//     module's next fwd/bwd op in the step, or of its last one when none follows, or
//     "other" when the module ran no fwd/bwd op in the step.
// A (module, phase) group is matched between the runs: its speed-up is the median over the
// calibration steps of the dense group's summed op time, divided by the sparse group's. A
// group whose ops are the same in both runs (same names and categories, e.g. the AdamW of
// a weight that stays dense in memory) keeps speed-up 1.
// Each matched group becomes one what-if spec over the dense op names of the group
// ("re:^(?:blocks\.0\.mlp\.fc\.fwd)$=0.93"), so the prediction is an ordinary what-if: the
// dense ops take the sparse group's time and the graph decides what that does to the step.
#pragma once
#include <array>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/op_trace.h"
#include "profile/what_if.h"

namespace esplag {

class Profiler;

// The profiled steps of a validation: one record list per step.
struct ValidationSteps {
  std::vector<std::vector<OpRecord>> calibration_dense, calibration_sparse;
  std::vector<std::vector<OpRecord>> dense, sparse;
};

struct ValidationPlan {
  int warmup = 1;       // unprofiled rounds first (allocations, one-time setup)
  int calibration = 3;  // profiled rounds for speed-ups (0: speed-ups come from specs)
  int steps = 5;        // profiled rounds that are compared
};

// Runs the two configurations' steps in rounds, dense then sparse in each round, so that
// a slow drift of the machine (clock, other load) touches both alike: `warmup` rounds
// unprofiled, then `calibration` and `steps` rounds with every step its own profiled
// window. Throws Error for negative counts or steps < 1.
ValidationSteps run_validation_steps(Profiler& profiler, const std::function<void()>& dense_step,
                                     const std::function<void()>& sparse_step,
                                     const ValidationPlan& plan);

// One (module, phase) group of a calibration.
struct TwinGroup {
  std::string module;  // op-name prefix, e.g. "blocks.0.mlp.fc"
  std::string phase;   // "fwd", "bwd", "optimizer" or "other"
  std::vector<std::string> dense_ops;   // distinct op names, in order of first appearance
  std::vector<std::string> sparse_ops;
  double dense_ns = 0;   // median over the calibration steps of the group's summed op time
  double sparse_ns = 0;
  // How the sparse group's time splits over categories (fractions summing to 1; all 0
  // when the sparse run has no op in the group).
  std::array<double, kNumOpCategories> sparse_category_share{};
  // The same op names with the same categories in both runs: the group's ops are
  // unchanged, so its speed-up is 1 by definition and it gets no spec (a measured ratio
  // would only be noise).
  bool identical = false;
  int spec = -1;  // index of its spec in SpeedupModel::specs, -1 when it has none

  // dense_ns / sparse_ns; +inf when the sparse run has no time in the group.
  double factor() const;
};

// The per-op speed-ups a prediction applies to the dense graph.
struct SpeedupModel {
  std::string source;              // "calibration" or "what-if specs"
  std::vector<WhatIfSpec> specs;   // applied to the dense graph, first match wins
  // Per spec: the categories its predicted time belongs to (a calibration group's sparse
  // split); nullopt keeps each matched op's own category.
  std::vector<std::optional<std::array<double, kNumOpCategories>>> category_share;
  std::vector<TwinGroup> groups;   // calibration only
  int calibration_steps = 0;
};

// Which module and phase each leaf op of one step belongs to (see the top of this file):
// {module, phase} per record: an optimizer op outside `modules` (when there are any) is
// its own group {its name, "optimizer"}; empty strings for the other ops outside
// `modules` and for records that are not leaves. Exposed for tests.
std::vector<std::pair<std::string, std::string>> module_phases(
    const std::vector<OpRecord>& step, const std::vector<std::string>& modules);

// Speed-ups measured in calibration steps of both runs. Throws Error when the step lists
// are empty.
SpeedupModel speedups_from_calibration(const std::vector<std::vector<OpRecord>>& dense_steps,
                                       const std::vector<std::vector<OpRecord>>& sparse_steps,
                                       const std::vector<std::string>& modules);
// Speed-ups given as what-if specs over the dense run's op names.
SpeedupModel speedups_from_specs(std::vector<WhatIfSpec> specs);

// The calibration as a what-if CSV (pattern,factor,module,phase,dense_us,sparse_us), which
// `--what-if-from` reads back.
std::string speedups_csv(const SpeedupModel& model);

struct CategoryValidation {
  OpCategory category = OpCategory::other;
  double predicted_ns = 0;  // median over steps of the category's predicted op time
  double measured_ns = 0;   // median over the sparse steps of its measured op time
  double error_pct() const;  // (predicted - measured) / measured in %; NaN if measured is 0
};

struct NamedTime {
  std::string name;
  double ns = 0;  // median over steps of the op's summed time per step
};

struct ValidationResult {
  SpeedupModel model;
  int steps = 0;  // compared steps per run
  std::vector<double> dense_wall_ns;      // per dense step: measured wall time
  std::vector<double> predicted_ns_list;  // per dense step: predicted sparse step time
  std::vector<double> sparse_wall_ns;     // per sparse step: measured wall time
  double dense_ns = 0;      // medians of the three lists
  double predicted_ns = 0;
  double measured_ns = 0;
  std::vector<CategoryValidation> by_category;  // categories with time in either, enum order
  double predicted_op_ns = 0;  // median of the per-step summed predicted op time
  double measured_op_ns = 0;   // median of the per-step summed measured op time
  // Sparse ops the prediction does not cover (no dense twin), and dense ops the sparse
  // run never ran: both by name with their median time per step.
  std::vector<NamedTime> uncovered_sparse_ops;
  std::vector<NamedTime> dense_only_ops;
  int dense_step = 0;   // index of the dense step with the median wall time
  int sparse_step = 0;  // index of the sparse step with the median wall time

  // (predicted - measured) / measured in %.
  double error_pct() const;
  // Spread of the measured sparse steps: (max - min) / median in %.
  double measured_spread_pct() const;
};

// Predicts every dense step's sparse counterpart with `model` and compares the medians
// with the measured sparse steps. Throws Error when either list is empty.
ValidationResult validate_prediction(const std::vector<std::vector<OpRecord>>& dense_steps,
                                     const std::vector<std::vector<OpRecord>>& sparse_steps,
                                     SpeedupModel model);

// validate.json: the result with every per-step value (times in ns; an infinite factor
// or an undefined error is null).
std::string validation_json(const ValidationResult& v);
// A few lines for the terminal.
std::string validation_summary(const ValidationResult& v);

// The median of `values` (the mean of the middle two for an even count); 0 when empty.
double median(std::vector<double> values);

// One number through a printf format holding a single double conversion ("%.3f"), and a
// duration in nanoseconds with a unit that keeps 3-4 significant digits ("1.234 ms"): the
// formatting of the validation tables and of the reports (profile/report.h).
std::string format_value(const char* format, double v);
std::string format_ns(double ns);
// A CSV field: as is, or quoted (inner quotes doubled) when it holds a comma, quote or
// line break.
std::string csv_field(const std::string& s);

}  // namespace esplag
