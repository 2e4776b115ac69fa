// `esplag profile` end to end on a tiny model: --validate (dense version vs the sparse
// config, calibration or --what-if-from speed-ups) writes validate.json, speedups.csv and
// both reports; --steps reports the median step; malformed what-if specs and options fail
// with one clear line before any training step runs.
//
// The binary is ESPLAG_BINARY, the esplag target of this build (tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <vector>

#include "cli_util.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using esplag::testing::read_text;
using esplag::testing::write_text;
using Result = esplag::testing::CommandResult;

const fs::path& root() { return esplag::testing::scratch_root("test_profile_cli"); }

fs::path binary() { return ESPLAG_BINARY; }

Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }

// A byte-level dataset and two configs of a one-block model: dense, and with SLoPe on the
// MLP plus runtime 2:4 on the attention projection.
struct Fixture {
  fs::path dense_config, sparse_config;
  Fixture() {
    const fs::path& d = root();
    EXPECT_TRUE(fs::exists(binary())) << "the esplag binary was not found at " << binary()
                                      << " (build the esplag target)";
    std::string text;
    for (int i = 0; i < 300; ++i) text += "And the evening and the morning were day " + std::to_string(i) + ".\n";
    write_text(d / "corpus.txt", text);
    const Result r = run("data prepare --input " + (d / "corpus.txt").string() + " --out " + (d / "data").string() +
                         " --val-fraction 0.1");
    EXPECT_EQ(r.code, 0) << r.err;
    const std::string base =
        "model: {preset: tiny, n_layer: 1, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 32}\n"
        "data: {path: " + (d / "data").string() + "}\n"
        "train: {batch_size: 4, seq_len: 32, steps: 20}\n";
    dense_config = d / "dense.yaml";
    write_text(dense_config, base);
    sparse_config = d / "sparse.yaml";
    write_text(sparse_config, base +
                                  "recipe:\n"
                                  "  - slope: {params: ['re:blocks\\.0\\.mlp\\..*'], mask_change_freq: 100}\n"
                                  "  - semi_sparse: {params: [blocks.0.attn.proj.weight]}\n");
  }
};

const Fixture& fixture() {
  static Fixture f;
  return f;
}

// Expects failure with exactly one line on stderr that contains `needle`.
void expect_error(const Result& r, const std::string& needle) { esplag::testing::expect_one_line_error(r, needle); }

}  // namespace

TEST(ProfileCli, ValidateWritesThePredictionTheMeasurementAndTheReports) {
  const Fixture& f = fixture();
  const fs::path out = root() / "validate";
  const Result r = run("profile --config " + f.sparse_config.string() +
                       " --validate --steps 3 --calibration-steps 2 --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("validation (3 steps per run, medians; speed-ups from calibration over 2 steps)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("sparse predicted"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("blocks.0.mlp.fc"), std::string::npos) << r.out;
  for (const char* file : {"validate.json", "speedups.csv", "config.yaml", "dense/config.yaml", "profile/report.html",
                           "profile/trace.json", "profile/ops.csv", "profile-sparse/report.html"})
    EXPECT_TRUE(fs::exists(out / file)) << file;
  // The dense run is the config without its recipe.
  EXPECT_EQ(read_text(out / "dense/config.yaml").find("slope"), std::string::npos);
  EXPECT_NE(read_text(out / "config.yaml").find("slope"), std::string::npos);

  const json v = json::parse(read_text(out / "validate.json"));
  EXPECT_EQ(v["source"], "calibration");
  EXPECT_EQ(v["steps"], 3);
  EXPECT_EQ(v["calibration_steps"], 2);
  EXPECT_EQ(v["dense"]["wall_ns"].size(), 3u);
  EXPECT_EQ(v["measured"]["wall_ns"].size(), 3u);
  const double dense = v["dense"]["median_wall_ns"], predicted = v["predicted"]["median_ns"],
               measured = v["measured"]["median_wall_ns"];
  EXPECT_GT(dense, 0);
  EXPECT_GT(predicted, 0);
  EXPECT_GT(measured, 0);
  ASSERT_TRUE(v["error_pct"].is_number());
  EXPECT_NEAR(v["error_pct"].get<double>(), 100.0 * (predicted - measured) / measured, 1e-6);
  // Timings of a millisecond step on a shared machine bound nothing here (the exact
  // arithmetic is tested on known steps in test_profile_validate); they must only agree
  // with each other.
  EXPECT_NEAR(v["measured_speedup"].get<double>(), dense / measured, 1e-9 * dense / measured);
  EXPECT_NEAR(v["predicted_speedup"].get<double>(), dense / predicted, 1e-9 * dense / predicted);
  std::vector<double> per_step = v["predicted"]["per_step_ns"];
  std::sort(per_step.begin(), per_step.end());
  EXPECT_DOUBLE_EQ(predicted, per_step[1]);  // the median of three
  // The changed modules, each with a forward and a backward group.
  std::set<std::string> changed;
  for (const auto& g : v["groups"]) {
    if (g["phase"] == "fwd" || g["phase"] == "bwd") changed.insert(g["module"].get<std::string>() + ":" +
                                                                    g["phase"].get<std::string>());
  }
  for (const char* key : {"blocks.0.mlp.fc:fwd", "blocks.0.mlp.fc:bwd", "blocks.0.mlp.proj:fwd", "blocks.0.mlp.proj:bwd",
                          "blocks.0.attn.proj:fwd", "blocks.0.attn.proj:bwd"})
    EXPECT_TRUE(changed.count(key)) << key << " in " << v["groups"].dump();
  bool sparse_gemm = false;
  for (const auto& c : v["by_category"]) sparse_gemm |= c["category"] == "sparse_gemm";
  EXPECT_TRUE(sparse_gemm);
  const std::string html = read_text(out / "profile/report.html");
  EXPECT_NE(html.find("Validation: predicted vs measured"), std::string::npos);
  EXPECT_NE(read_text(out / "profile-sparse/report.html").find("Validation: predicted vs measured"), std::string::npos);

  // The calibration's CSV feeds --what-if-from: speed-ups from specs, no calibration.
  const fs::path again = root() / "validate-from-csv";
  const Result s = run("profile --config " + f.sparse_config.string() + " --validate --steps 2 --what-if-from " +
                       (out / "speedups.csv").string() + " --out " + again.string());
  ASSERT_EQ(s.code, 0) << s.err;
  const json w = json::parse(read_text(again / "validate.json"));
  EXPECT_EQ(w["source"], "what-if specs");
  EXPECT_EQ(w["calibration_steps"], 0);
  EXPECT_EQ(w["specs"].size(), v["specs"].size());
  EXPECT_FALSE(fs::exists(again / "speedups.csv"));
}

TEST(ProfileCli, ValidateWithoutARecipeMeasuresTheNoiseFloor) {
  const fs::path out = root() / "validate-dense";
  const Result r = run("profile --config " + fixture().dense_config.string() + " --validate --steps 3 --out " +
                       out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("note: the config has no recipe"), std::string::npos) << r.out;
  const json v = json::parse(read_text(out / "validate.json"));
  EXPECT_TRUE(v["groups"].empty());
  EXPECT_TRUE(v["specs"].empty());
  // No speed-ups: the prediction is the dense step as modelled, i.e. as measured.
  EXPECT_NEAR(v["predicted"]["median_ns"].get<double>(), v["dense"]["median_wall_ns"].get<double>(),
              1e-6 * v["dense"]["median_wall_ns"].get<double>());
  EXPECT_TRUE(v["uncovered_sparse_ops"].empty());
  EXPECT_TRUE(v["dense_only_ops"].empty());
}

TEST(ProfileCli, SeveralStepsReportTheMedianStep) {
  const fs::path out = root() / "plain";
  const Result r = run("profile --config " + fixture().sparse_config.string() + " --steps 3 --what-if 'sparse_gemm=2' --out " +
                       out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("profiled 3 steps: wall"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sparse_gemm=2:"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(out / "profile/report.html"));
  EXPECT_FALSE(fs::exists(out / "validate.json"));
}

// Two CPU ranks: rank 0 alone reports, and the collectives are ops of category comm (the
// gradients' all-reduce; under ZeRO their reduce-scatter and the weights' all-gather).
TEST(ProfileCli, TwoRanksReportTheirCollectives) {
  const std::string cfg = fixture().dense_config.string();
  for (const std::string zero : {"0", "1"}) {
    const fs::path out = root() / ("ranks-zero" + zero);
    const Result r = run("profile --gpus 2 --config " + cfg + " --set train.device=cpu --set parallel.zero=" + zero +
                         " --what-if comm=2 --out " + out.string());
    ASSERT_EQ(r.code, 0) << r.err;
    size_t reports = 0;
    for (size_t at = r.out.find("step time:"); at != std::string::npos; at = r.out.find("step time:", at + 1))
      ++reports;
    EXPECT_EQ(reports, 1u) << r.out;
    EXPECT_NE(r.out.find("collectives: "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("comm=2: "), std::string::npos) << r.out;
    const std::string csv = read_text(out / "profile/ops.csv");
    const std::vector<std::string> ops =
        zero == "0" ? std::vector<std::string>{"gradients.all_reduce,comm,"}
                    : std::vector<std::string>{"gradients.reduce_scatter,comm,", "weights.all_gather,comm,"};
    for (const std::string& op : ops) EXPECT_NE(csv.find(op), std::string::npos) << op << "\n" << csv;
  }
  expect_error(run("profile --gpus 2 --validate --config " + cfg + " --out " + (root() / "never-ranks").string()),
               "profile --validate runs on one rank");
}

TEST(ProfileCli, MalformedWhatIfSpecsFailBeforeTheRun) {
  const std::string cfg = fixture().sparse_config.string();
  const fs::path out = root() / "never";
  auto profile = [&](const std::string& extra) { return run("profile --config " + cfg + " --out " + out.string() + " " + extra); };
  expect_error(profile("--what-if 'mlp=abc'"), "factor 'abc' is not a number");
  expect_error(profile("--what-if 'mlp=0'"), "factor must be > 0, got '0'");
  expect_error(profile("--what-if 'mlp=-1'"), "factor must be > 0, got '-1'");
  expect_error(profile("--what-if 're:mlp(=2'"), "invalid regex 'mlp('");
  expect_error(profile("--what-if 'mlp'"), "missing '='");
  expect_error(profile("--what-if 'category:gemm=2'"), "unknown category 'gemm'");
  expect_error(profile("--validate --what-if 'mlp=abc'"), "factor 'abc' is not a number");
  write_text(root() / "bad.csv", "pattern,factor\nmlp,2\nattention,fast\n");
  expect_error(profile("--what-if-from " + (root() / "bad.csv").string()), "bad.csv:3:");
  expect_error(profile("--what-if-from " + (root() / "missing.csv").string()), "cannot open");
  expect_error(profile("--steps 0"), "--steps must be an integer in [1, 2147483647], got '0'");
  expect_error(profile("--validate --calibration-steps 0"), "--calibration-steps must be an integer in [1, 2147483647], got '0'");
  expect_error(profile("--calibration-steps 2"), "only applies with --validate");
  expect_error(profile("--validate=yes"), "--validate takes no value");
  EXPECT_FALSE(fs::exists(out)) << "a failed command must not have started the run";
}

TEST(ProfileCli, AWhatIfSpecThatMatchesNoOpWarnsWithWhatItCouldMatch) {
  const fs::path out = root() / "unmatched";
  const Result r = run("profile --config " + fixture().dense_config.string() +
                       " --what-if 're:no_such_op=2' --what-if 'attention=2' --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("warning: what-if spec 're:no_such_op=2' matches no op of the "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("categories here: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("dense_gemm"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("op names such as "), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "only the unmatched spec warns: " << r.err;
  EXPECT_NE(r.out.find("re:no_such_op=2: 0 ops"), std::string::npos) << r.out;
}
