// Validation of what-if predictions (profile/validate.h): module phases, speed-ups from a
// calibration or from specs, predicted vs measured on hand-made steps whose answer is
// known exactly, the JSON and CSV outputs, and the interleaved profiling driver.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "core/error.h"
#include "profile/profiler.h"
#include "profile/validate.h"

using namespace esplag;
using nlohmann::json;

namespace {

// Builds one step's records: ops run back to back on host thread 0 unless placed.
struct Step {
  std::vector<OpRecord> records;
  int64_t t = 1'000'000;  // a clock that does not start at 0
  Step& op(const std::string& name, OpCategory cat, int64_t dur, std::vector<const void*> in = {},
           std::vector<const void*> out = {}) {
    OpRecord r;
    r.name = name;
    r.category = cat;
    r.start_ns = t;
    r.end_ns = t + dur;
    r.thread = 0;
    r.inputs = std::move(in);
    r.outputs = std::move(out);
    records.push_back(std::move(r));
    t += dur;
    return *this;
  }
  // An op on a device stream (asynchronous: no host order), at an explicit time.
  Step& device_op(const std::string& name, OpCategory cat, int stream, int64_t start, int64_t dur,
                  std::vector<const void*> in = {}, std::vector<const void*> out = {}) {
    OpRecord r;
    r.name = name;
    r.category = cat;
    r.stream = stream;
    r.device = true;
    r.thread = -1;
    r.start_ns = 1'000'000 + start;
    r.end_ns = r.start_ns + dur;
    r.inputs = std::move(in);
    r.outputs = std::move(out);
    records.push_back(std::move(r));
    return *this;
  }
};

// A dense step (one changed module "m", times in ns, no gaps) and its sparse counterpart:
//   dense:  embed 10 | m.fwd 40 | act 10 | m.bwd 80 | m.weight.adamw 5 | head.adamw 5 = 150
//   sparse: embed 10 | m.sparsify 10, m.fwd 20 | act 10 | m.sparsify 10, m.bwd.dx 20,
//           m.bwd.dw 40 | m.weight.adamw 5, m.sync 2 | head.adamw 5                 = 132
// m's forward goes 40 -> 30 (1.33x), its backward 80 -> 72 (sync included, 1.11x), its
// AdamW is the same op in both. Scaling the dense step by these gives exactly 132.
std::vector<OpRecord> dense_step(int64_t fwd = 40) {
  Step s;
  s.op("embed", OpCategory::elementwise, 10)
      .op("m.fwd", OpCategory::dense_gemm, fwd)
      .op("act", OpCategory::elementwise, 10)
      .op("m.bwd", OpCategory::dense_gemm, 80)
      .op("m.weight.adamw", OpCategory::optimizer, 5)
      .op("head.adamw", OpCategory::optimizer, 5);
  return s.records;
}

std::vector<OpRecord> sparse_step(int64_t fwd = 20) {
  Step s;
  s.op("embed", OpCategory::elementwise, 10)
      .op("m.sparsify", OpCategory::other, 10)
      .op("m.fwd", OpCategory::sparse_gemm, fwd)
      .op("act", OpCategory::elementwise, 10)
      .op("m.sparsify", OpCategory::other, 10)
      .op("m.bwd.dx", OpCategory::sparse_gemm, 20)
      .op("m.bwd.dw", OpCategory::dense_gemm, 40)
      .op("m.weight.adamw", OpCategory::optimizer, 5)
      .op("m.sync", OpCategory::memcpy, 2)
      .op("head.adamw", OpCategory::optimizer, 5);
  return s.records;
}

const TwinGroup* find_group(const SpeedupModel& m, const std::string& module, const std::string& phase) {
  for (const auto& g : m.groups)
    if (g.module == module && g.phase == phase) return &g;
  return nullptr;
}

double category_ns(const ValidationResult& v, OpCategory c, bool predicted) {
  for (const auto& x : v.by_category)
    if (x.category == c) return predicted ? x.predicted_ns : x.measured_ns;
  return 0;
}

}  // namespace

TEST(ValidateMedian, OddEvenAndEmpty) {
  EXPECT_DOUBLE_EQ(median({}), 0);
  EXPECT_DOUBLE_EQ(median({3}), 3);
  EXPECT_DOUBLE_EQ(median({5, 1, 100}), 5);
  EXPECT_DOUBLE_EQ(median({4, 1, 100, 2}), 3);
}

TEST(ValidatePhases, HelperOpsJoinTheNextFwdOrBwdOfTheirModule) {
  const auto step = sparse_step();
  const auto p = module_phases(step, {"m"});
  ASSERT_EQ(p.size(), step.size());
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"", ""},          {"m", "fwd"}, {"m", "fwd"},       {"", ""},      {"m", "bwd"},
      {"m", "bwd"},      {"m", "bwd"}, {"m", "optimizer"}, {"m", "bwd"},  {"head.adamw", "optimizer"}};
  EXPECT_EQ(p, expected);

  // The longest module prefix wins, a name must continue with '.', enclosing ops are no
  // leaves, and a module with no fwd/bwd op in the step puts its helpers in "other".
  Step s;
  s.op("blocks.1.mlp.fc.fwd.lora", OpCategory::dense_gemm, 1)
      .op("blocks.1.mlp.fc2.fwd", OpCategory::dense_gemm, 1)
      .op("blocks.1.mlp.mask", OpCategory::other, 1)
      .op("blocks.1.mlp.fc.bwd", OpCategory::dense_gemm, 1);
  s.records[3].leaf = false;
  const auto q = module_phases(s.records, {"blocks.1.mlp", "blocks.1.mlp.fc"});
  EXPECT_EQ(q[0], (std::pair<std::string, std::string>{"blocks.1.mlp.fc", "fwd"}));
  EXPECT_EQ(q[1], (std::pair<std::string, std::string>{"blocks.1.mlp", "other"}));  // "fc2" is not "fc"
  EXPECT_EQ(q[2], (std::pair<std::string, std::string>{"blocks.1.mlp", "other"}));
  EXPECT_EQ(q[3], (std::pair<std::string, std::string>{"", ""}));
}

TEST(ValidateCalibration, GroupsFactorsAndSpecs) {
  // Three calibration steps; the middle one is an outlier that the median ignores.
  const std::vector<std::vector<OpRecord>> dense = {dense_step(40), dense_step(400), dense_step(40)};
  const std::vector<std::vector<OpRecord>> sparse = {sparse_step(20), sparse_step(20), sparse_step(200)};
  const SpeedupModel m = speedups_from_calibration(dense, sparse, {"m"});
  EXPECT_EQ(m.source, "calibration");
  EXPECT_EQ(m.calibration_steps, 3);
  ASSERT_EQ(m.groups.size(), 4u);
  const TwinGroup* fwd = find_group(m, "m", "fwd");
  const TwinGroup* bwd = find_group(m, "m", "bwd");
  const TwinGroup* opt = find_group(m, "m", "optimizer");
  ASSERT_TRUE(fwd && bwd && opt);
  EXPECT_DOUBLE_EQ(fwd->dense_ns, 40);
  EXPECT_DOUBLE_EQ(fwd->sparse_ns, 30);
  EXPECT_DOUBLE_EQ(fwd->factor(), 40.0 / 30.0);
  EXPECT_EQ(fwd->dense_ops, (std::vector<std::string>{"m.fwd"}));
  EXPECT_EQ(fwd->sparse_ops, (std::vector<std::string>{"m.sparsify", "m.fwd"}));
  EXPECT_NEAR(fwd->sparse_category_share[size_t(OpCategory::other)], 1.0 / 3, 1e-12);
  EXPECT_NEAR(fwd->sparse_category_share[size_t(OpCategory::sparse_gemm)], 2.0 / 3, 1e-12);
  EXPECT_DOUBLE_EQ(bwd->dense_ns, 80);
  EXPECT_DOUBLE_EQ(bwd->sparse_ns, 72);
  EXPECT_EQ(bwd->sparse_ops, (std::vector<std::string>{"m.sparsify", "m.bwd.dx", "m.bwd.dw", "m.sync"}));
  // The AdamW of m is the same op in both runs: speed-up 1, no spec.
  EXPECT_TRUE(opt->identical);
  EXPECT_EQ(opt->spec, -1);
  EXPECT_FALSE(fwd->identical);

  // head's AdamW, outside the changed module, is scaled by its own factor (1 here).
  const TwinGroup* head = find_group(m, "head.adamw", "optimizer");
  ASSERT_TRUE(head);
  EXPECT_TRUE(head->identical);
  EXPECT_EQ(head->spec, 2);
  ASSERT_EQ(m.specs.size(), 3u);
  ASSERT_EQ(m.category_share.size(), 3u);
  EXPECT_EQ(fwd->spec, 0);
  EXPECT_EQ(bwd->spec, 1);
  EXPECT_DOUBLE_EQ(m.specs[2].factor, 1.0);
  EXPECT_EQ(m.specs[0].text, "re:^(?:m\\.fwd)$=1.33333333");
  EXPECT_NEAR(m.specs[1].factor, 80.0 / 72.0, 1e-8);
  // The spec matches the dense op and nothing else.
  GraphNode n;
  n.name = "m.fwd";
  EXPECT_TRUE(m.specs[0].matches(n));
  n.name = "m.fwd.lora";
  EXPECT_FALSE(m.specs[0].matches(n));
  n.name = "mXfwd";
  EXPECT_FALSE(m.specs[0].matches(n));

  EXPECT_THROW(speedups_from_calibration({}, sparse, {"m"}), Error);
}

// One fused optimizer op over every parameter (the GPU's AdamW) that the recipe makes
// faster without renaming it: predicted from its measured factor, not held at its dense
// time.
TEST(ValidatePrediction, ScalesAnOptimizerOpOutsideTheChangedModules) {
  auto with_adamw = [](std::vector<OpRecord> step, int64_t ns) {
    Step s;
    s.t = step.back().end_ns;
    s.records = std::move(step);
    s.op("adamw", OpCategory::optimizer, ns);
    return s.records;
  };
  const std::vector<std::vector<OpRecord>> dense(3, with_adamw(dense_step(), 20));
  const std::vector<std::vector<OpRecord>> sparse(3, with_adamw(sparse_step(), 12));
  const ValidationResult v = validate_prediction(dense, sparse, speedups_from_calibration(dense, sparse, {"m"}));
  EXPECT_DOUBLE_EQ(v.measured_ns, 132 + 12);
  EXPECT_NEAR(v.predicted_ns, 132 + 12, 1e-6);
  EXPECT_NEAR(category_ns(v, OpCategory::optimizer, true), 5 + 5 + 12, 1e-6);
  EXPECT_TRUE(v.uncovered_sparse_ops.empty());
}

TEST(ValidatePrediction, ExactOnAKnownStep) {
  const std::vector<std::vector<OpRecord>> dense = {dense_step(), dense_step(), dense_step()};
  const std::vector<std::vector<OpRecord>> sparse = {sparse_step(), sparse_step(), sparse_step()};
  const ValidationResult v =
      validate_prediction(dense, sparse, speedups_from_calibration(dense, sparse, {"m"}));
  EXPECT_EQ(v.steps, 3);
  EXPECT_DOUBLE_EQ(v.dense_ns, 150);
  EXPECT_NEAR(v.predicted_ns, 132, 1e-6);
  EXPECT_DOUBLE_EQ(v.measured_ns, 132);
  EXPECT_NEAR(v.error_pct(), 0, 1e-6);
  EXPECT_DOUBLE_EQ(v.measured_spread_pct(), 0);
  ASSERT_EQ(v.predicted_ns_list.size(), 3u);
  // Per category the calibration's split puts the predicted time where the sparse run
  // spends it: sparse_gemm 20 + 20, dense_gemm 40, other 10 + 10, memcpy 2.
  EXPECT_NEAR(category_ns(v, OpCategory::sparse_gemm, true), 40, 1e-6);
  EXPECT_NEAR(category_ns(v, OpCategory::dense_gemm, true), 40, 1e-6);
  EXPECT_NEAR(category_ns(v, OpCategory::other, true), 20, 1e-6);
  EXPECT_NEAR(category_ns(v, OpCategory::memcpy, true), 2, 1e-6);
  EXPECT_NEAR(category_ns(v, OpCategory::elementwise, true), 20, 1e-6);
  for (const auto& c : v.by_category) EXPECT_NEAR(c.error_pct(), 0, 1e-6) << op_category_name(c.category);
  EXPECT_NEAR(v.predicted_op_ns, v.measured_op_ns, 1e-6);
  EXPECT_TRUE(v.uncovered_sparse_ops.empty());
  EXPECT_TRUE(v.dense_only_ops.empty());
  // Categories come in enum order, only those with time.
  ASSERT_FALSE(v.by_category.empty());
  EXPECT_EQ(v.by_category.front().category, OpCategory::dense_gemm);
  EXPECT_EQ(v.by_category.size(), 6u);
}

TEST(ValidatePrediction, MediansOverNoisySteps) {
  // Noise in one dense step and one sparse step (an unrelated op taking 10x) moves no
  // median.
  auto noisy_dense = dense_step();
  noisy_dense[2].end_ns += 90;
  for (size_t i = 3; i < noisy_dense.size(); ++i) noisy_dense[i].start_ns += 90, noisy_dense[i].end_ns += 90;
  auto noisy_sparse = sparse_step();
  noisy_sparse.back().end_ns += 500;
  const std::vector<std::vector<OpRecord>> dense = {dense_step(), noisy_dense, dense_step()};
  const std::vector<std::vector<OpRecord>> sparse = {noisy_sparse, sparse_step(), sparse_step()};
  const ValidationResult v =
      validate_prediction(dense, sparse, speedups_from_calibration(dense, sparse, {"m"}));
  EXPECT_DOUBLE_EQ(v.dense_ns, 150);
  EXPECT_NEAR(v.predicted_ns, 132, 1e-6);
  EXPECT_DOUBLE_EQ(v.measured_ns, 132);
  EXPECT_DOUBLE_EQ(v.sparse_wall_ns[0], 632);
  EXPECT_NEAR(v.measured_spread_pct(), 100.0 * 500 / 132, 1e-9);
  EXPECT_NE(v.sparse_step, 0);  // a step with the median wall time
  EXPECT_NE(v.dense_step, 1);
}

TEST(ValidatePrediction, FollowsTheCriticalPathNotTheSumOfOps) {
  // The changed op runs on a second stream beside a longer chain: making it slower by
  // less than its slack changes nothing, and the measured sparse step agrees.
  int A, B, C;
  auto build = [&](int64_t b_dur, OpCategory b_cat) {
    Step s;
    s.op("a", OpCategory::attention, 50, {}, {&A});
    s.device_op("m.fwd", b_cat, 1, 0, b_dur, {}, {&B});
    s.t = 1'000'000 + std::max<int64_t>(50, b_dur);  // c waits for both inputs
    s.op("c", OpCategory::loss, 10, {&A, &B}, {&C});
    return s.records;
  };
  const std::vector<std::vector<OpRecord>> dense = {build(20, OpCategory::dense_gemm)};
  const std::vector<std::vector<OpRecord>> sparse = {build(45, OpCategory::sparse_gemm)};
  const ValidationResult v =
      validate_prediction(dense, sparse, speedups_from_calibration(dense, sparse, {"m"}));
  EXPECT_DOUBLE_EQ(v.dense_ns, 60);
  EXPECT_NEAR(v.predicted_ns, 60, 1e-6);  // not 60 + 25: m.fwd had 30 of slack
  EXPECT_DOUBLE_EQ(v.measured_ns, 60);
  EXPECT_NEAR(category_ns(v, OpCategory::sparse_gemm, true), 45, 1e-6);
  EXPECT_NEAR(category_ns(v, OpCategory::dense_gemm, true), 0, 1e-6);
  // Slower than its slack: the stream-1 path becomes critical, 65 + 10 = 75.
  const std::vector<std::vector<OpRecord>> slow = {build(65, OpCategory::sparse_gemm)};
  const ValidationResult w = validate_prediction(dense, slow, speedups_from_calibration(dense, slow, {"m"}));
  EXPECT_NEAR(w.predicted_ns, 75, 1e-6);
  EXPECT_DOUBLE_EQ(w.measured_ns, 75);
}

TEST(ValidatePrediction, UncoveredAndDenseOnlyOps) {
  Step d, s;
  d.op("embed", OpCategory::elementwise, 10).op("m.fwd", OpCategory::dense_gemm, 40).op("gone", OpCategory::other, 7);
  s.op("embed", OpCategory::elementwise, 10)
      .op("m.fwd", OpCategory::sparse_gemm, 20)
      .op("fresh", OpCategory::other, 9)
      .op("n.pack", OpCategory::other, 3);  // a module the dense run never ran
  const std::vector<std::vector<OpRecord>> dense = {d.records}, sparse = {s.records};
  const SpeedupModel m = speedups_from_calibration(dense, sparse, {"m", "n"});
  const TwinGroup* n = find_group(m, "n", "other");
  ASSERT_NE(n, nullptr);
  EXPECT_EQ(n->spec, -1);  // no dense twin to scale
  const ValidationResult v = validate_prediction(dense, sparse, m);
  ASSERT_EQ(v.uncovered_sparse_ops.size(), 2u);
  EXPECT_EQ(v.uncovered_sparse_ops[0].name, "fresh");  // longest first
  EXPECT_DOUBLE_EQ(v.uncovered_sparse_ops[0].ns, 9);
  EXPECT_EQ(v.uncovered_sparse_ops[1].name, "n.pack");
  ASSERT_EQ(v.dense_only_ops.size(), 1u);
  EXPECT_EQ(v.dense_only_ops[0].name, "gone");
  // "gone" stays in the prediction (nothing says it vanishes): 10 + 20 + 7 vs 42 measured.
  EXPECT_NEAR(v.predicted_ns, 37, 1e-6);
  EXPECT_DOUBLE_EQ(v.measured_ns, 42);
  EXPECT_NEAR(v.error_pct(), 100.0 * (37 - 42) / 42, 1e-9);
  const std::string text = validation_summary(v);
  EXPECT_NE(text.find("not covered by the prediction: 2 sparse op(s)"), std::string::npos) << text;
  EXPECT_NE(text.find("dense ops the sparse run does not have: 1 (e.g. gone)"), std::string::npos) << text;
}

TEST(ValidatePrediction, FromSpecs) {
  const std::vector<std::vector<OpRecord>> dense = {dense_step()};
  const std::vector<std::vector<OpRecord>> sparse = {sparse_step()};
  std::vector<std::string> texts = {"re:^m\\.fwd$=2", "re:^m\\.bwd$=1.25"};
  const ValidationResult v = validate_prediction(dense, sparse, speedups_from_specs(parse_what_if_specs(texts)));
  EXPECT_EQ(v.model.source, "what-if specs");
  EXPECT_EQ(v.model.calibration_steps, 0);
  // 150 - 40 - 80 + 20 + 64 = 114 predicted vs 132 measured.
  EXPECT_NEAR(v.predicted_ns, 114, 1e-9);
  EXPECT_NEAR(v.error_pct(), 100.0 * (114 - 132) / 132, 1e-9);
  // Without a calibration the predicted time keeps the dense ops' categories.
  EXPECT_NEAR(category_ns(v, OpCategory::dense_gemm, true), 84, 1e-9);
  EXPECT_NEAR(category_ns(v, OpCategory::sparse_gemm, true), 0, 1e-9);
  EXPECT_NEAR(category_ns(v, OpCategory::sparse_gemm, false), 40, 1e-9);
  // By name: the sparse-only names are uncovered, m.bwd is dense-only.
  std::vector<std::string> uncovered;
  for (const auto& n : v.uncovered_sparse_ops) uncovered.push_back(n.name);
  EXPECT_EQ(uncovered, (std::vector<std::string>{"m.bwd.dw", "m.bwd.dx", "m.sparsify", "m.sync"}));
  ASSERT_EQ(v.dense_only_ops.size(), 1u);
  EXPECT_EQ(v.dense_only_ops[0].name, "m.bwd");
}

TEST(ValidatePrediction, Errors) {
  const std::vector<std::vector<OpRecord>> one = {dense_step()};
  EXPECT_THROW(validate_prediction({}, one, speedups_from_specs({})), Error);
  EXPECT_THROW(validate_prediction(one, {}, speedups_from_specs({})), Error);
  SpeedupModel broken = speedups_from_specs({});
  broken.category_share.emplace_back();
  EXPECT_THROW(validate_prediction(one, one, broken), Error);
  // An op still open in a step (end before start) is reported by the graph.
  auto open = dense_step();
  open[1].end_ns = open[1].start_ns - 1;
  EXPECT_THROW(validate_prediction({open}, one, speedups_from_specs({})), Error);
}

TEST(ValidateOutputs, JsonAndSpeedupsCsv) {
  const std::vector<std::vector<OpRecord>> dense = {dense_step(), dense_step()};
  const std::vector<std::vector<OpRecord>> sparse = {sparse_step(), sparse_step()};
  const ValidationResult v =
      validate_prediction(dense, sparse, speedups_from_calibration(dense, sparse, {"m"}));
  const json doc = json::parse(validation_json(v));
  EXPECT_EQ(doc["source"], "calibration");
  EXPECT_EQ(doc["steps"], 2);
  EXPECT_EQ(doc["calibration_steps"], 2);
  EXPECT_DOUBLE_EQ(doc["dense"]["median_wall_ns"].get<double>(), 150);
  EXPECT_EQ(doc["dense"]["wall_ns"].size(), 2u);
  EXPECT_NEAR(doc["predicted"]["median_ns"].get<double>(), 132, 1e-6);
  EXPECT_DOUBLE_EQ(doc["measured"]["median_wall_ns"].get<double>(), 132);
  EXPECT_NEAR(doc["error_pct"].get<double>(), 0, 1e-6);
  EXPECT_NEAR(doc["measured_speedup"].get<double>(), 150.0 / 132, 1e-12);
  ASSERT_TRUE(doc["by_category"].is_array());
  EXPECT_EQ(doc["by_category"][0]["category"], "dense_gemm");
  ASSERT_EQ(doc["groups"].size(), 4u);  // m's fwd, bwd and optimizer, head's AdamW
  EXPECT_EQ(doc["groups"][0]["module"], "m");
  EXPECT_EQ(doc["groups"][0]["phase"], "fwd");
  EXPECT_EQ(doc["groups"][0]["sparse_ops"], (json{"m.sparsify", "m.fwd"}));
  EXPECT_EQ(doc["specs"].size(), 3u);

  // A free group's factor and an undefined error are null, not a non-JSON inf/nan.
  Step gone;
  gone.op("m.fwd", OpCategory::dense_gemm, 5);
  Step nothing;
  nothing.op("other", OpCategory::other, 0);
  const ValidationResult w = validate_prediction({gone.records}, {nothing.records},
                                                 speedups_from_calibration({gone.records}, {nothing.records}, {"m"}));
  const json d2 = json::parse(validation_json(w));
  EXPECT_TRUE(d2["groups"][0]["factor"].is_null());
  EXPECT_TRUE(d2["error_pct"].is_null());
  EXPECT_DOUBLE_EQ(w.predicted_ns, 0);  // the only dense op became free

  // The CSV reads back as the same specs.
  const std::string csv = speedups_csv(v.model);
  EXPECT_EQ(csv.substr(0, csv.find('\n')), "pattern,factor,module,phase,dense_us,sparse_us");
  const auto back = parse_what_if_csv(csv, "speedups.csv");
  ASSERT_EQ(back.size(), v.model.specs.size());
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i].pattern, v.model.specs[i].pattern);
    EXPECT_DOUBLE_EQ(back[i].factor, v.model.specs[i].factor);
  }
  EXPECT_NE(csv.find(",m,fwd,0.040,0.030"), std::string::npos) << csv;
}

namespace {

// A recorder on a virtual clock that the test's "ops" advance instead of sleeping, so the
// whole driver (real ScopedOps, Profiler, recorder, graph) runs with exact timings.
std::atomic<int64_t> g_virtual_ns{1'000'000};
class VirtualClockRecorder : public OpRecorder {
 protected:
  int64_t now_ns() const override { return g_virtual_ns.load(); }
};
void advance(int64_t ns) { g_virtual_ns += ns; }

}  // namespace

TEST(ValidateDriver, InterleavesProfiledStepsAndPredictsExactly) {
  // The sparse step's "x" takes half the time and is preceded by a helper op of its
  // module; "y" is the same op in both runs; 1 us of untraced host time between ops.
  std::vector<char> order;
  int64_t round = 0;
  auto dense = [&] {
    order.push_back('d');
    ScopedOp step("step", OpCategory::other);
    advance(1000);
    { ScopedOp op("x.fwd", OpCategory::dense_gemm, 0); advance(round++ == 1 ? 600'000 : 6000); }  // one outlier
    advance(1000);
    { ScopedOp op("y", OpCategory::elementwise, 0); advance(3000); }
  };
  auto sparse = [&] {
    order.push_back('s');
    ScopedOp step("step", OpCategory::other);
    advance(1000);
    { ScopedOp op("x.pack", OpCategory::other, 0); advance(500); }
    { ScopedOp op("x.fwd", OpCategory::sparse_gemm, 0); advance(2500); }
    advance(1000);
    { ScopedOp op("y", OpCategory::elementwise, 0); advance(3000); }
  };
  Profiler p(std::make_unique<VirtualClockRecorder>());
  const ValidationSteps st = run_validation_steps(p, dense, sparse, ValidationPlan{1, 3, 3});
  EXPECT_FALSE(p.running());
  EXPECT_EQ(current_op_tracer(), nullptr);
  EXPECT_EQ(std::string(order.begin(), order.end()), "dsdsdsdsdsdsds");
  ASSERT_EQ(st.calibration_dense.size(), 3u);
  ASSERT_EQ(st.calibration_sparse.size(), 3u);
  ASSERT_EQ(st.dense.size(), 3u);
  ASSERT_EQ(st.sparse.size(), 3u);
  for (const auto& s : st.dense) EXPECT_EQ(s.size(), 3u);   // step + two leaves
  for (const auto& s : st.sparse) EXPECT_EQ(s.size(), 4u);  // step + three leaves

  const ValidationResult v = validate_prediction(
      st.dense, st.sparse, speedups_from_calibration(st.calibration_dense, st.calibration_sparse, {"x"}));
  // x: 6000 -> 500 + 2500 (the outlier round is outvoted by the median).
  ASSERT_EQ(v.model.specs.size(), 1u);
  EXPECT_DOUBLE_EQ(v.model.specs[0].factor, 2.0);
  EXPECT_DOUBLE_EQ(v.dense_ns, 11'000);
  EXPECT_DOUBLE_EQ(v.measured_ns, 8'000);
  EXPECT_NEAR(v.predicted_ns, 8'000, 1e-6);
  EXPECT_NEAR(v.error_pct(), 0, 1e-9);
  EXPECT_NEAR(category_ns(v, OpCategory::other, true), 500, 1e-6);
  EXPECT_NEAR(category_ns(v, OpCategory::sparse_gemm, true), 2500, 1e-6);
  EXPECT_TRUE(v.uncovered_sparse_ops.empty());

  EXPECT_THROW(run_validation_steps(p, dense, sparse, ValidationPlan{0, 0, 0}), Error);
  EXPECT_THROW(run_validation_steps(p, dense, sparse, ValidationPlan{-1, 0, 1}), Error);
  EXPECT_THROW(run_validation_steps(p, dense, sparse, ValidationPlan{0, -1, 1}), Error);
}

TEST(ValidateDriver, AStepThatThrowsLeavesNoTracerInstalled) {
  Profiler p;
  auto ok = [] { ScopedOp op("a", OpCategory::other); };
  auto bad = [] {
    ScopedOp op("b", OpCategory::other);
    throw std::runtime_error("step failed");
  };
  EXPECT_THROW(run_validation_steps(p, ok, bad, ValidationPlan{0, 0, 1}), std::runtime_error);
  EXPECT_FALSE(p.running());
  EXPECT_EQ(current_op_tracer(), nullptr);
  // The profiler is usable again.
  const ValidationSteps st = run_validation_steps(p, ok, ok, ValidationPlan{0, 1, 1});
  EXPECT_EQ(st.sparse.size(), 1u);
}
