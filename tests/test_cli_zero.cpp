// ZeRO stages 1 and 2 end to end on the CPU reference (`esplag train --gpus N` with
// train.device=cpu and parallel.zero): they train as stage 0 does, save the whole optimizer
// state as stage 0 does, resume across world sizes and stages, and follow a slope recipe
// whose kind changes create and drop trained tensors. Also the refusal of stage 3 on the
// CPU, of recipes stage 3 cannot follow, and that the GPU takes stages 0 to 3.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "cli_util.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

fs::path root() { return esplag::testing::scratch_root("test_cli_zero"); }

Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }

// Losses and the optimizer state of ZeRO and stage 0 agree within this (relative); they are
// the same sums, only the global norm's partial sums are grouped by rank.
constexpr double kTolerance = 1e-6;

struct Fixture {
  fs::path data, config, slope;
  Fixture() {
    const fs::path d = root();
    data = esplag::testing::prepared_verses(d);
    const std::string base =
        "model: {preset: tiny, n_layer: 2, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 32}\n"
        "data: {path: " + data.string() + "}\n"
        "train: {device: cpu, batch_size: 4, seq_len: 32, steps: 6, log_every: 1, eval_every: 0,"
        " eval_batches: 2, checkpoint_every: 3, keep_checkpoints: 0}\n";
    config = d / "tiny.yaml";
    esplag::testing::write_text(config, base);
    // Step 2: the mlp weights of block 0 become slope's kept values (the dense weights'
    // tensors dropped); step 4: its adapters appear; step 3: block 1's proj goes back to dense.
    slope = d / "slope.yaml";
    esplag::testing::write_text(slope, base +
                                           "recipe:\n"
                                           "  - slope: {params: ['re:blocks\\.0\\.mlp\\..*'], start: 2, "
                                           "mask_change_freq: 2, lora_rank: 2, lora_start: 4}\n"
                                           "  - semi_sparse: {params: [blocks.1.attn.proj.weight], until: 3}\n");
  }
};

const Fixture& fixture() {
  static Fixture f;
  return f;
}

bool near(double a, double b) { return std::abs(a - b) <= kTolerance * std::max(1.0, std::abs(b)); }

// Whether two runs' logged steps agree; counts the steps whose losses are bit-identical.
void expect_same_losses(const fs::path& got, const fs::path& want, size_t steps, int* identical = nullptr) {
  const auto a = esplag::testing::logged_steps(got), b = esplag::testing::logged_steps(want);
  ASSERT_EQ(a.size(), steps) << got;
  ASSERT_EQ(b.size(), steps) << want;
  for (size_t i = 0; i < steps; ++i) {
    EXPECT_NEAR(a[i].loss, b[i].loss, kTolerance * b[i].loss) << got << " step " << i + 1;
    EXPECT_NEAR(a[i].grad_norm, b[i].grad_norm, kTolerance * b[i].grad_norm) << got << " step " << i + 1;
    EXPECT_EQ(a[i].tokens_seen, b[i].tokens_seen) << got << " step " << i + 1;
    if (identical && a[i].loss == b[i].loss) ++*identical;
  }
}

// Every tensor of a checkpoint's weights and optimizer state agrees with the other's.
void expect_same_checkpoint(const fs::path& got, const fs::path& want) {
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const auto a = esplag::load_safetensors((got / file).string()), b = esplag::load_safetensors((want / file).string());
    ASSERT_EQ(a.tensors.size(), b.tensors.size()) << got / file;
    for (const auto& [name, tb] : b.tensors) {
      ASSERT_TRUE(a.tensors.count(name)) << got / file << ": " << name;
      const esplag::Tensor& ta = a.tensors.at(name);
      ASSERT_EQ(ta.numel(), tb.numel()) << name;
      if (tb.dtype() != esplag::DType::f32) continue;
      int64_t off = 0;
      for (int64_t i = 0; i < tb.numel(); ++i) off += !near(ta.data<float>()[i], tb.data<float>()[i]);
      EXPECT_EQ(off, 0) << got / file << ": " << name << " differs in " << off << " of " << tb.numel() << " elements";
    }
  }
}

Result train(const fs::path& config, const fs::path& out, int gpus, int zero, const std::string& more = "") {
  return run("train --gpus " + std::to_string(gpus) + " --config " + config.string() + " --out " + out.string() +
             " --set parallel.zero=" + std::to_string(zero) + more);
}

// A copy of run `from` holding its checkpoint at step 3 alone, saved as if with ZeRO stage `zero`.
fs::path copy_at_step3(const fs::path& from, const fs::path& to, int zero) {
  fs::remove_all(to);
  fs::create_directories(to);
  fs::copy(from / "step-000003", to / "step-000003", fs::copy_options::recursive);
  const fs::path model = to / "step-000003" / "model.safetensors";
  auto file = esplag::load_safetensors(model.string());
  std::string& yaml = file.metadata.at("config");
  const size_t at = yaml.find("zero: ", yaml.find("parallel:"));
  EXPECT_NE(at, std::string::npos) << yaml;
  yaml.replace(at, 7, "zero: " + std::to_string(zero));
  std::vector<esplag::Tensor> tensors;
  for (auto& [name, t] : file.tensors) {
    t.set_name(name);
    tensors.push_back(t);
  }
  esplag::save_safetensors(model.string(), tensors, file.metadata);
  return to / "step-000003";
}

}  // namespace

TEST(CliZero, StagesOneAndTwoFollowStageZeroOnTwoAndThreeRanks) {
  const auto& f = fixture();
  int identical = 0, compared = 0;
  for (int gpus : {2, 3}) {
    const fs::path ref = root() / ("zero0_" + std::to_string(gpus));
    const Result a = train(f.config, ref, gpus, 0);
    ASSERT_EQ(a.code, 0) << a.err;
    for (int zero : {1, 2}) {
      const fs::path out = root() / ("zero" + std::to_string(zero) + "_" + std::to_string(gpus));
      const Result b = train(f.config, out, gpus, zero);
      ASSERT_EQ(b.code, 0) << b.err;
      EXPECT_NE(b.out.find("ZeRO stage " + std::to_string(zero) + " (each rank keeps the AdamW moments of 1/" +
                           std::to_string(gpus)),
                std::string::npos)
          << b.out;
      expect_same_losses(out, ref, 6, &identical);
      compared += 6;
      expect_same_checkpoint(out / "step-000003", ref / "step-000003");
      expect_same_checkpoint(out / "step-000006", ref / "step-000006");
    }
  }
  std::printf("losses bit-identical to stage 0 in %d of %d steps\n", identical, compared);
}

TEST(CliZero, ResumesAcrossWorldSizesAndStages) {
  const auto& f = fixture();
  const fs::path single = root() / "resume_single", zero1 = root() / "resume_zero1";
  ASSERT_EQ(train(f.config, single, 1, 0, " --set train.grad_accum=3").code, 0);
  ASSERT_EQ(train(f.config, zero1, 2, 1).code, 0);

  // A ZeRO-1 run resumed as it was continues exactly.
  const fs::path again = copy_at_step3(zero1, root() / "resume_again", 1);
  const Result r = run("train --gpus 2 --resume " + again.string());
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_checkpoint(again.parent_path() / "step-000006", zero1 / "step-000006");

  // The 2-rank ZeRO-1 checkpoint, and the single-process one, resumed on 3 ranks under stage
  // 2 and under stage 1 take the steps that stage 0 on 3 ranks takes from them: the whole
  // moments were saved and are cut again for 3 ranks.
  for (const auto& [from, name] : {std::pair{zero1, "zero1"}, std::pair{single, "single"}}) {
    const fs::path want = copy_at_step3(from, root() / ("want_" + std::string(name)), 0);
    ASSERT_EQ(run("train --gpus 3 --resume " + want.string()).code, 0);
    for (int zero : {1, 2}) {
      const fs::path got = copy_at_step3(from, root() / ("got_" + std::string(name) + std::to_string(zero)), zero);
      const Result g = run("train --gpus 3 --resume " + got.string());
      ASSERT_EQ(g.code, 0) << g.err;
      EXPECT_NE(g.out.find("ZeRO stage " + std::to_string(zero)), std::string::npos) << g.out;
      expect_same_checkpoint(got.parent_path() / "step-000006", want.parent_path() / "step-000006");
    }
  }
  // And a 3-rank ZeRO-2 checkpoint resumes in one process.
  const Result one = run("train --resume " + (root() / "got_zero12").string() + " --steps 7");
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_TRUE(fs::exists(root() / "got_zero12" / "step-000007" / "optimizer.safetensors"));
}

TEST(CliZero, SlopeRecipeWhoseKindsChange) {
  const auto& f = fixture();
  for (int gpus : {2, 3}) {
    const fs::path ref = root() / ("slope0_" + std::to_string(gpus));
    const Result a = train(f.slope, ref, gpus, 0);
    ASSERT_EQ(a.code, 0) << a.err;
    ASSERT_NE(a.out.find("blocks.0.mlp.fc.weight -> slope 2:4"), std::string::npos) << a.out;
    for (int zero : {1, 2}) {
      const fs::path out = root() / ("slope" + std::to_string(zero) + "_" + std::to_string(gpus));
      const Result b = train(f.slope, out, gpus, zero);
      ASSERT_EQ(b.code, 0) << b.err;
      expect_same_losses(out, ref, 6);
      expect_same_checkpoint(out / "step-000003", ref / "step-000003");
      expect_same_checkpoint(out / "step-000006", ref / "step-000006");
    }
  }
}

// Rank 0 alone saves, so a stop signal's checkpoint needs the moments of every rank: the
// ranks gather them after the step the signal ends.
TEST(CliZero, AStopSignalSavesTheWholeOptimizerState) {
  const auto& f = fixture();
  const fs::path run_dir = root() / "interrupted";
  fs::remove_all(run_dir);
  const std::string train = std::string(ESPLAG_BINARY) + " --threads 1 train --gpus 2 --config " + f.config.string() +
                            " --set parallel.zero=2 --set train.steps=100000 --set train.checkpoint_every=0" +
                            " --out " + run_dir.string();
  const fs::path script = root() / "interrupt.sh";
  esplag::testing::write_text(script, train + " &\npid=$!\nfor i in $(seq 600); do\n  grep -q step '" +
                                          (run_dir / "metrics.jsonl").string() +
                                          "' 2>/dev/null && break\n  sleep 0.1\ndone\nkill -INT $pid\nwait $pid\n");
  const Result r = esplag::testing::run_command("sh '" + script.string() + "'", root() / "sig.out", root() / "sig.err");
  EXPECT_EQ(r.code, 130) << r.err;
  std::string latest = esplag::read_file((run_dir / "latest").string());
  ASSERT_EQ(latest.rfind("step-", 0), 0u) << latest;
  latest = latest.substr(0, latest.find_first_of("\n"));
  const auto model = esplag::load_safetensors((run_dir / latest / "model.safetensors").string());
  const auto optimizer = esplag::load_safetensors((run_dir / latest / "optimizer.safetensors").string());
  int64_t params = 0, moments = 0;
  for (const auto& [name, t] : model.tensors) params += t.numel();
  for (const auto& [name, t] : optimizer.tensors) moments += t.numel();
  EXPECT_EQ(moments, 2 * params);  // m and v of every trained element (the tiny model trains all of them)
  int64_t nonzero = 0;
  for (const auto& [name, t] : optimizer.tensors)
    for (int64_t i = 0; i < t.numel(); ++i) nonzero += t.data<float>()[i] != 0.0f;
  EXPECT_GT(nonzero, moments / 2) << "the moments of rank 1's range were not gathered";
}

TEST(CliZero, StageThreeIsRefusedOnTheCpu) {
  const auto& f = fixture();
  const Result r = run("train --gpus 2 --config " + f.config.string() + " --out " + (root() / "zero3").string() +
                       " --set parallel.zero=3");
  // Every rank checks the config and says why; the launch then names the failed rank.
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("tiny.yaml: parallel.zero = 3 (sharded parameters) is built for train.device cuda"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(root() / "zero3" / "config.yaml"));
}

TEST(CliZero, StageThreeRefusesARecipeThatChangesALayerAfterTheStart) {
  const std::string run = "model: {preset: tiny, vocab_size: 257}\ntrain: {device: cuda, steps: 100}\n"
                          "parallel: {zero: 3}\nrecipe:\n  - ";
  const std::string mlp = "params: ['re:blocks\\.\\d+\\.mlp\\.\\w+\\.weight']";
  auto error_of = [&](const std::string& modifier) -> std::string {
    try {
      esplag::parse_train_config(run + modifier + "\n", "run.yaml", {}).validate();
    } catch (const esplag::Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error_of("slope: {" + mlp + ", start: 0}"), "");
  EXPECT_EQ(error_of("semi_sparse: {" + mlp + ", start: 0}"), "");
  const std::pair<std::string, std::string> refused[] = {
      {"slope: {" + mlp + ", start: 10}", "its layers change kind at step 10"},
      {"slope: {" + mlp + ", start: 0, lora_rank: 8, lora_start: 0.9}", "it adds adapters"},
      {"semi_sparse: {" + mlp + ", start: 0, until: 0.5}", "its layers turn dense at `until`"},
      {"gradual_magnitude: {" + mlp + ", mask_type: \"2:4\", start: 0, end: 50, update_every: 10}",
       "rewrite their weights"}};
  for (const auto& [modifier, why] : refused) {
    const std::string e = error_of(modifier);
    EXPECT_NE(e.find("parallel.zero = 3: the recipe's"), std::string::npos) << modifier << ": " << e;
    EXPECT_NE(e.find(why), std::string::npos) << modifier << ": " << e;
  }
}

TEST(CliZero, TheGpuTakesEveryStage) {
  esplag::TrainConfig config;
  for (const int zero : {0, 1, 2, 3}) {
    config.parallel.zero = zero;
    EXPECT_EQ(esplag::gpu_training_blocker(config), "") << zero;
  }
}
