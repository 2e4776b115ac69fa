// esplag profile: one training step (or the median of several) recorded op by op, its
// graph and critical path, what-if predictions, and with --validate the prediction checked
// against a measured sparse run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "commands.h"
#include "core/error.h"
#include "dist/world.h"
#include "io/atomic_file.h"
#include "local_ranks.h"
#include "model/linear.h"
#include "model/linear_registry.h"
#include "profile/profiler.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace esplag::cli {

namespace {

// Wall time of one profiled window: max end - min start over its records.
double window_wall_ns(const std::vector<OpRecord>& records) {
  if (records.empty()) return 0;
  int64_t t0 = records.front().start_ns, t1 = records.front().end_ns;
  for (const auto& r : records) {
    t0 = std::min(t0, r.start_ns);
    t1 = std::max(t1, r.end_ns);
  }
  return static_cast<double>(t1 - t0);
}

// profile --validate: the dense version of the config (recipe removed, so every Linear is
// dense) and the config itself are stepped in alternation; calibration steps give each
// changed module's speed-up (unless --what-if specs give them), the dense steps' graphs
// give the prediction, the sparse steps the measurement (profile/validate.h).
int profile_validate(const TrainConfig& cfg, const std::vector<WhatIfSpec>& specs, int warmup, int steps,
                     int calibration, const std::string& out) {
  TrainConfig sparse = cfg, dense = cfg;
  dense.recipe_yaml.clear();
  const int64_t need = int64_t(warmup) + (specs.empty() ? calibration : 0) + steps;
  for (TrainConfig* c : {&sparse, &dense}) c->steps = c->schedule.total_steps = std::max<int64_t>(c->steps, need);
  if (cfg.recipe_yaml.empty())
    print_line("note: the config has no recipe, so the sparse run is the dense one again: the error shows the "
               "noise floor of the measurement");
  Trainer sparse_trainer(sparse, out, [](const std::string&) {});
  // Both runs on the device the sparse one got (`auto` may put only the dense one on a GPU).
  dense.device = sparse_trainer.device();
  Trainer dense_trainer(dense, (fs::path(out) / "dense").string(), [](const std::string&) {});
  Profiler profiler(sparse_trainer.device() == "cuda" ? make_cuda_op_recorder() : nullptr);
  const ValidationSteps st = run_validation_steps(
      profiler, [&] { dense_trainer.train_step(); }, [&] { sparse_trainer.train_step(); },
      ValidationPlan{warmup, specs.empty() ? calibration : 0, steps});
  // The modules the recipe changed: Linears whose kind is no longer plain dense.
  std::vector<std::string> modules;
  for (const auto& name : sparse_trainer.model().linear_names()) {
    const Linear<float>& l = sparse_trainer.model().linear(name);
    if (l.kind() != dense_linear_kind()) modules.push_back(l.params().module);
  }
  if (modules.empty() && !cfg.recipe_yaml.empty())
    print_line("note: every Linear was still dense in the profiled steps (does the recipe start later than step " +
               std::to_string(need) + "? --set can move it)");
  SpeedupModel model = specs.empty() ? speedups_from_calibration(st.calibration_dense, st.calibration_sparse, modules)
                                     : speedups_from_specs(specs);
  const ValidationResult v = validate_prediction(st.dense, st.sparse, std::move(model));

  // Reports: the median dense step with the prediction as its what-if, and the median
  // measured sparse step; both carry the validation section.
  const ProfileResult dense_result = Profiler::analyse(st.dense[v.dense_step], v.model.specs);
  if (!specs.empty()) std::cerr << unmatched_what_if_warnings(dense_result.graph, dense_result.what_if);
  const ProfileResult sparse_result = Profiler::analyse(st.sparse[v.sparse_step]);
  const std::string dense_dir = (fs::path(out) / "profile").string();
  const std::string sparse_dir = (fs::path(out) / "profile-sparse").string();
  Profiler::write_reports(dense_dir, dense_result, &v);
  Profiler::write_reports(sparse_dir, sparse_result, &v);
  const std::string json_path = (fs::path(out) / "validate.json").string();
  write_text_file(json_path, validation_json(v));
  std::string files = json_path;
  if (!v.model.groups.empty()) {
    const std::string csv_path = (fs::path(out) / "speedups.csv").string();
    write_text_file(csv_path, speedups_csv(v.model));
    files += ", " + csv_path;
  }
  std::cout << validation_summary(v);
  std::printf("reports: %s/report.html (dense + prediction), %s/report.html (sparse measured); %s\n",
              dense_dir.c_str(), sparse_dir.c_str(), files.c_str());
  return 0;
}

int profile(const Args& a) {
  const bool validate = a.has("validate");
  ESPLAG_CHECK(!validate || (a.int32("gpus") == 1 && !world_from_env().distributed()),
               "profile --validate runs on one rank (it steps two models in turns); drop --gpus or the launcher");
  if (a.int32("gpus") > 1) return run_as_local_ranks(kProfile, a.int32("gpus"));
  const std::string config_path = a.get("config");
  TrainConfig cfg = load_train_config(config_path, a.all("set"));
  const int warmup = a.int32("warmup");
  const int steps = a.int32("steps", validate ? 5 : 1);
  const int calibration = a.int32("calibration-steps");
  ESPLAG_CHECK(validate || !a.has("calibration-steps"), "profile: --calibration-steps only applies with --validate");
  // Parse the what-if specs before spending time on the run, so a typo fails at once.
  const auto specs = Profiler::what_if_specs(a.all("what-if"), a.all("what-if-from"));
  ESPLAG_CHECK(specs.empty() || !a.has("calibration-steps"),
               "profile: --calibration-steps does not apply with --what-if/--what-if-from (the given speed-ups are used)");
  const std::string out = a.get("out", "runs/" + fs::path(config_path).stem().string() + "-profile");
  if (validate) return profile_validate(cfg, specs, warmup, steps, calibration, out);

  cfg.steps = cfg.schedule.total_steps = std::max<int64_t>(cfg.steps, int64_t(warmup) + steps);
  Trainer trainer(cfg, out, [](const std::string&) {});
  for (int i = 0; i < warmup; ++i) trainer.train_step();
  Profiler profiler(trainer.device() == "cuda" ? make_cuda_op_recorder() : nullptr);
  std::vector<std::vector<OpRecord>> windows;
  std::vector<double> walls, step_ms;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    profiler.start();
    trainer.train_step();
    windows.push_back(profiler.stop());
    step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    walls.push_back(window_wall_ns(windows.back()));
  }
  if (!trainer.leader()) return 0;  // every rank steps and traces alike; rank 0 reports
  // The step with the median wall time stands for the run.
  std::vector<int> order(steps);
  for (int i = 0; i < steps; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return walls[x] < walls[y]; });
  const int chosen = order[(steps - 1) / 2];
  const ProfileResult result = Profiler::analyse(std::move(windows[chosen]), specs);
  const std::string dir = (fs::path(out) / "profile").string();
  Profiler::write_reports(dir, result);
  std::cout << Profiler::summary(result);
  std::cerr << unmatched_what_if_warnings(result.graph, result.what_if);
  if (steps > 1)
    std::printf("profiled %d steps: wall %.3f ms median (min %.3f, max %.3f); the reports show step %d\n", steps,
                walls[chosen] / 1e6, walls[order.front()] / 1e6, walls[order.back()] / 1e6, chosen);
  std::printf("step measured outside the profiler: %.2f ms\nreports: %s/{report.html,trace.json,ops.csv}\n",
              step_ms[chosen], dir.c_str());
  return 0;
}

}  // namespace

const Command kProfile = {
    "profile",
    "time a training step op by op: critical path, breakdowns, what-if predictions",
    "Writes report.html, trace.json and ops.csv to OUT/profile. A what-if spec is PATTERN=FACTOR: PATTERN is\n"
    "re:REGEX, category:NAME or a category name, FACTOR a speed-up such as 1.5, 2x or inf (docs/profiler.md).\n"
    "--validate steps the config and its dense version in turns and compares the predicted sparse step with\n"
    "the measured one. --gpus N profiles a data-parallel run of N local ranks (as train --gpus N; or start\n"
    "the ranks with torchrun, mpirun or srun): every rank is traced, rank 0's step is reported, and the\n"
    "collectives are ops of category comm on their streams.",
    {
        Option::text("config", "FILE.yaml", "", "the run's config").mandatory(),
        Option::list("set", "KEY=VALUE", "override one config key"),
        Option::integer("warmup", "1", 0, kIntMax, "steps run before the profiled ones"),
        Option::integer("steps", "", 1, kIntMax,
                        "profiled steps; the median one is reported (default: 1, 5 with --validate)"),
        Option::text("out", "DIR", "", "the run directory (default: runs/<config name>-profile)"),
        Option::list("what-if", "PATTERN=FACTOR", "predict the step with the matched ops FACTOR times faster"),
        Option::list("what-if-from", "FILE.csv", "what-if specs from a CSV with pattern and factor columns"),
        Option::flag("validate", "compare the prediction with a measured run of the config"),
        Option::integer("calibration-steps", "3", 1, kIntMax,
                        "with --validate and no what-if specs: steps that measure each changed layer's speed-up"),
        Option::integer("gpus", "1", 1, 1024, "local processes, one per GPU, as train --gpus N"),
    },
    profile,
};

}  // namespace esplag::cli
