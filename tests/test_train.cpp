// The training loop end to end on small data: the loss falls, checkpoints resume bit for
// bit, evaluation matches, and bad data stops a run without damaging what was saved.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/prepare.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "train/trainer.h"

using namespace esplag;
namespace fs = std::filesystem;

namespace {

// Scratch directories of this process, removed when it ends.
struct ScratchDirs {
  std::vector<fs::path> paths;
  ~ScratchDirs() {
    std::error_code ec;
    for (const auto& p : paths) fs::remove_all(p, ec);
  }
};

fs::path scratch(const std::string& name) {
  static ScratchDirs dirs;
  const fs::path p = fs::temp_directory_path() / ("esplag_test_train_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  dirs.paths.push_back(p);
  return p;
}

// A small corpus with real structure (repeated verses with variations) as byte tokens.
std::string make_dataset(const fs::path& dir) {
  std::string text;
  const char* words[] = {"light", "darkness", "waters", "earth", "heaven", "firmament", "evening", "morning"};
  for (int i = 0; i < 400; ++i)
    text += std::string("And God said, Let there be ") + words[i % 8] + ": and there was " + words[(i * 3) % 8] +
            ".\n";
  const fs::path txt = dir / "corpus.txt";
  std::ofstream(txt) << text;
  prepare_dataset((dir / "corpus.txt").string(), ByteTokenizer(), (dir / "data").string(), 0.1, 1 << 20);
  return (dir / "data").string();
}

TrainConfig small_config(const std::string& data) {
  return parse_train_config(R"(
model: {preset: tiny, n_layer: 2, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 32}
train: {batch_size: 4, seq_len: 32, steps: 6, log_every: 1, eval_every: 3, eval_batches: 2,
        checkpoint_every: 3, keep_checkpoints: 0, device: cpu}
optimizer: {lr: 1.0e-2}
schedule: {warmup_steps: 2}
)",
                            "test", {"data.path=" + data});
}

std::vector<nlohmann::json> read_metrics(const fs::path& run) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

void quiet(const std::string&) {}

// dir/full resumed from its step-3 checkpoint in a run directory dir/part that holds only
// that checkpoint, as if the run had been interrupted right after saving it; run to the end.
std::unique_ptr<Trainer> resume_from_step_3(const fs::path& dir) {
  const fs::path part = dir / "part";
  fs::create_directories(part);
  fs::copy(dir / "full" / "step-000003", part / "step-000003", fs::copy_options::recursive);
  std::ofstream(part / "latest") << "step-000003\n";
  auto resumed = Trainer::resume(part.string(), quiet);
  resumed->run();
  return resumed;
}

}  // namespace

// A recipe step written as a fraction resolves against train.steps, so resuming with
// another total is refused (the phases would move under the run) and leaves the run as it
// was; the same total, or step numbers, resume.
TEST(Trainer, ResumeWithAnotherTotalKeepsTheRecipeWhereItWas) {
  const fs::path dir = scratch("resume_recipe");
  const std::string data = make_dataset(dir);
  TrainConfig cfg = small_config(data);
  cfg.steps = 3;
  cfg.schedule.total_steps = 3;
  cfg.recipe_yaml = "- semi_sparse: {params: ['blocks.0.mlp.fc.weight'], until: 0.5}\n";
  Trainer(cfg, (dir / "fraction").string(), quiet).run();
  const std::string metrics_before = read_file((dir / "fraction" / "metrics.jsonl").string());
  try {
    Trainer::resume((dir / "fraction").string(), quiet, 6);
    ADD_FAILURE() << "resumed with another total and a fractional recipe step";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("recipe[0] (semi_sparse) until 0.5"), std::string::npos) << m;
    EXPECT_NE(m.find("keep --steps 3"), std::string::npos) << m;
  }
  EXPECT_EQ(read_file((dir / "fraction" / "metrics.jsonl").string()), metrics_before);
  EXPECT_EQ(Trainer::resume((dir / "fraction").string(), quiet, 3)->run().steps, 3);

  cfg.recipe_yaml = "- semi_sparse: {params: ['blocks.0.mlp.fc.weight'], until: 2}\n";
  Trainer(cfg, (dir / "numbers").string(), quiet).run();
  EXPECT_EQ(Trainer::resume((dir / "numbers").string(), quiet, 4)->run().steps, 4);
}

TEST(Trainer, ResumedRunIsBitIdenticalToUninterrupted) {
  const fs::path dir = scratch("resume");
  const std::string data = make_dataset(dir);
  TrainConfig cfg = small_config(data);
  cfg.grad_accum = 2;  // accumulation must resume exactly too
  Trainer full(cfg, (dir / "full").string(), quiet);
  full.run();

  auto resumed = resume_from_step_3(dir);

  const auto& a = full.model();
  const auto& b = resumed->model();
  ASSERT_EQ(a.num_params(), b.num_params());
  for (size_t i = 0; i < a.num_params(); ++i)
    ASSERT_EQ(std::memcmp(&a.params()[i], &b.params()[i], sizeof(float)), 0) << "parameter element " << i;

  auto losses = [](const std::vector<nlohmann::json>& m) {
    std::map<int64_t, double> out;
    for (const auto& j : m)
      if (j.contains("loss")) out[j["step"].get<int64_t>()] = j["loss"].get<double>();
    return out;
  };
  const auto la = losses(read_metrics(dir / "full")), lb = losses(read_metrics(dir / "part"));
  for (int64_t s = 4; s <= 6; ++s) {
    ASSERT_TRUE(la.count(s) && lb.count(s)) << "step " << s;
    EXPECT_EQ(la.at(s), lb.at(s)) << "loss at step " << s;
  }
}

// sparse_dw (the weight gradient from the MVUE 2:4 of dYᵀ) on slope and semi_sparse
// layers: the draws depend only on the run seed, the layer and the number of backward
// calls, which checkpoints keep, so a resumed run takes the uninterrupted run's draws.
TEST(Trainer, SparseDwRunResumesBitIdentically) {
  const fs::path dir = scratch("resume_sparse_dw");
  const std::string data = make_dataset(dir);
  TrainConfig cfg = small_config(data);
  cfg.grad_accum = 2;  // two draws per layer and step
  auto recipe = [](const std::string& sparse_dw) {
    return "- slope: {params: ['re:blocks\\.\\d+\\.attn\\..*'], mask_change_freq: 2, sparse_dw: " + sparse_dw +
           "}\n- semi_sparse: {params: ['re:blocks\\.\\d+\\.mlp\\..*'], sparse_dw: " + sparse_dw + "}\n";
  };
  cfg.recipe_yaml = recipe("true");
  std::vector<std::string> log;
  Trainer full(cfg, (dir / "full").string(), [&](const std::string& s) { log.push_back(s); });
  const TrainResult r = full.run();
  EXPECT_TRUE(std::isfinite(r.last_loss));
  EXPECT_TRUE(std::any_of(log.begin(), log.end(), [](const std::string& s) {
    return s.find("step 0: blocks.0.mlp.fc.weight -> semi_sparse 2:4, sparse dW") != std::string::npos;
  }));

  auto resumed = resume_from_step_3(dir);
  const auto& a = full.model();
  const auto& b = resumed->model();
  ASSERT_EQ(a.num_params(), b.num_params());
  for (size_t i = 0; i < a.num_params(); ++i)
    ASSERT_EQ(std::memcmp(&a.params()[i], &b.params()[i], sizeof(float)), 0) << "parameter element " << i;
  const std::string qkv = "blocks.0.attn.qkv.weight";
  EXPECT_EQ(full.model().linear(qkv).state().at(qkv + ".sparse_dw_draws").data<double>()[0], 12.0);  // 6 steps x 2
  EXPECT_EQ(resumed->model().linear(qkv).state().at(qkv + ".sparse_dw_draws").data<double>()[0], 12.0);

  // Without sparse_dw the same recipe trains to other weights: the option reaches the layers.
  cfg.recipe_yaml = recipe("false");
  Trainer plain(cfg, (dir / "plain").string(), quiet);
  plain.run();
  EXPECT_NE(std::memcmp(plain.model().params(), a.params(), a.num_params() * sizeof(float)), 0);
}

// train.precision fp8 reaches the layers (another run than full precision) and resumes bit
// for bit, as every CPU run does.
TEST(Trainer, Fp8RunResumesBitIdentically) {
  const fs::path dir = scratch("resume_fp8");
  const std::string data = make_dataset(dir);
  TrainConfig cfg = small_config(data);
  cfg.recipe_yaml = "- slope: {params: ['re:blocks\\.\\d+\\.mlp\\..*']}\n";
  Trainer plain(cfg, (dir / "plain").string(), quiet);
  plain.run();
  cfg.precision = "fp8";
  Trainer full(cfg, (dir / "full").string(), quiet);
  const TrainResult r = full.run();
  EXPECT_TRUE(std::isfinite(r.last_loss));
  EXPECT_NE(std::memcmp(plain.model().params(), full.model().params(), plain.model().num_params() * sizeof(float)), 0);

  auto resumed = resume_from_step_3(dir);
  ASSERT_EQ(full.model().num_params(), resumed->model().num_params());
  EXPECT_EQ(std::memcmp(full.model().params(), resumed->model().params(), full.model().num_params() * sizeof(float)),
            0);
}

// train.fp8_scaling delayed: the checkpoint keeps every layer's amax history, so a resumed
// run scales its casts as the uninterrupted one did and ends on the same bits; the histories
// reach the layers (another run than current scaling).
TEST(Trainer, Fp8DelayedScalingResumesBitIdentically) {
  const fs::path dir = scratch("resume_fp8_delayed");
  const std::string data = make_dataset(dir);
  TrainConfig cfg = small_config(data);
  cfg.grad_accum = 2;
  cfg.precision = "fp8";
  cfg.recipe_yaml = "- slope: {params: ['re:blocks\\.\\d+\\.mlp\\..*']}\n";
  Trainer current(cfg, (dir / "current").string(), quiet);
  current.run();
  cfg.fp8_scaling = "delayed";
  cfg.fp8_amax_history = 2;
  Trainer full(cfg, (dir / "full").string(), quiet);
  full.run();
  const size_t n = full.model().num_params();
  EXPECT_NE(std::memcmp(current.model().params(), full.model().params(), n * sizeof(float)), 0);
  const SafetensorsFile opt = load_safetensors((dir / "full" / "step-000003" / "optimizer.safetensors").string());
  ASSERT_TRUE(opt.tensors.count("fp8_amax_history.blocks.1.mlp.proj"));
  EXPECT_EQ(opt.tensors.at("fp8_amax_history.blocks.1.mlp.proj").shape(), (Shape{2, 3}));

  auto resumed = resume_from_step_3(dir);
  EXPECT_EQ(std::memcmp(full.model().params(), resumed->model().params(), n * sizeof(float)), 0);
  Transformer<float>& a = full.model();
  Transformer<float>& b = resumed->model();
  for (size_t i = 0; i < a.fp8_histories().size(); ++i)
    EXPECT_EQ(a.fp8_histories()[i].values(), b.fp8_histories()[i].values()) << "layer " << i;
}

TEST(Trainer, LossFallsOnStructuredText) {
  const fs::path dir = scratch("falls");
  const std::string data = make_dataset(dir);
  TrainConfig cfg = small_config(data);
  cfg.steps = cfg.schedule.total_steps = 200;
  cfg.checkpoint_every = 0;
  cfg.eval_every = 0;
  Trainer t(cfg, (dir / "run").string(), quiet);
  const TrainResult r = t.run();
  EXPECT_NEAR(r.first_loss, std::log(257.0), 0.2);
  EXPECT_LT(r.last_loss, 1.6) << "first " << r.first_loss;
  EXPECT_LT(r.final_val_loss, 1.8);
  // The saved checkpoint evaluates to the same validation loss.
  const EvalResult ev = evaluate_checkpoint((dir / "run").string(), data, "val", cfg.eval_batches);
  EXPECT_NEAR(ev.loss, r.final_val_loss, 1e-6);
  EXPECT_TRUE(fs::exists(dir / "run" / "config.yaml"));
}

TEST(Trainer, RefusesToOverwriteARunAndReportsDivergence) {
  const fs::path dir = scratch("guard");
  const std::string data = make_dataset(dir);
  TrainConfig cfg = small_config(data);
  cfg.steps = cfg.schedule.total_steps = 3;
  Trainer(cfg, (dir / "run").string(), quiet).run();
  EXPECT_THROW(Trainer(cfg, (dir / "run").string(), quiet), Error);

  const std::string saved = read_file((dir / "run" / "step-000003" / "model.safetensors").string());
  TrainConfig bad = cfg;
  bad.optimizer.lr = bad.schedule.lr = 1e30;
  bad.steps = bad.schedule.total_steps = 20;
  bad.schedule.warmup_steps = 0;
  bad.checkpoint_every = 1;
  Trainer diverging(bad, (dir / "bad").string(), quiet);
  try {
    diverging.run();
    FAIL() << "expected divergence";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("diverged"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file((dir / "run" / "step-000003" / "model.safetensors").string()), saved);
  // The diverging run's own last checkpoint is complete and finite.
  const std::string last = resolve_checkpoint((dir / "bad").string());
  Transformer<float> model(read_checkpoint_info(last).config.model);
  load_checkpoint_weights(last, model);
  for (size_t i = 0; i < model.num_params(); ++i) ASSERT_TRUE(std::isfinite(model.params()[i])) << i;
}

// The shipped default (configs/tiny.yaml on the bundled corpus that scripts/setup.sh
// prepares), cut to 200 of its 600 steps: the loss must already be well below the
// 5.55 of a uniform guess over 257 byte tokens.
TEST(Trainer, DefaultTinyRunLossFallsBelowBound) {
  const fs::path data = fs::path(ESPLAG_SOURCE_DIR) / "data" / "kjv";
  ASSERT_TRUE(fs::exists(data / "meta.json")) << data << " is missing: run scripts/setup.sh first";
  const fs::path dir = scratch("default");
  TrainConfig cfg = load_train_config(std::string(ESPLAG_SOURCE_DIR) + "/configs/tiny.yaml",
                                      {"data.path=" + data.string(), "train.steps=200", "train.checkpoint_every=0",
                                       "train.eval_every=0"});
  Trainer t(cfg, (dir / "run").string(), quiet);
  const TrainResult r = t.run();
  EXPECT_NEAR(r.first_loss, std::log(257.0), 0.1);
  EXPECT_LT(r.last_loss, 2.6);
  EXPECT_LT(r.final_val_loss, 2.6);
}

// A recipe that walks the model through gradual magnitude pruning with a V:N:M mask,
// kernel replacement to compressed vnm layers, then low-rank adapters; training goes on
// (loss finite and falling) and a resume from the middle of the walk is bit-identical.
TEST(Trainer, RecipeWalksGmpThenKernelReplacementThenLora) {
  const fs::path dir = scratch("walk");
  const std::string data = make_dataset(dir);
  TrainConfig cfg = parse_train_config(R"(
model: {preset: tiny, n_layer: 1, d_model: 64, n_head: 2, n_kv_head: 2, d_ff: 128, max_seq_len: 32}
train: {batch_size: 4, seq_len: 32, steps: 40, log_every: 1, eval_every: 0, eval_batches: 2,
        checkpoint_every: 5, keep_checkpoints: 0}
optimizer: {lr: 1.0e-2}
recipe:
  - gradual_magnitude: {params: ['re:blocks\.0\.(attn\.proj|mlp\.fc|mlp\.proj)\.weight'], mask_type: "64:2:8",
                        start: 5, end: 20, update_every: 5}
  - kernel_replacement: {params: ['re:blocks\.0\.(attn\.proj|mlp\.fc|mlp\.proj)\.weight'], start: 20,
                         lora_rank: 4, lora_start: 30}
)",
                                       "walk", {"data.path=" + data});
  std::vector<std::string> log;
  Trainer full(cfg, (dir / "full").string(), [&](const std::string& s) { log.push_back(s); });
  const TrainResult r = full.run();
  EXPECT_TRUE(std::isfinite(r.last_loss));
  EXPECT_LT(r.last_loss, r.first_loss - 1.0);
  auto logged = [&](const std::string& needle) {
    return std::any_of(log.begin(), log.end(), [&](const std::string& s) { return s.find(needle) != std::string::npos; });
  };
  EXPECT_TRUE(logged("step 10: blocks.0.mlp.fc.weight -> masked 64:2:4"));  // the ramp: dense, 64:2:4, 64:2:8
  EXPECT_TRUE(logged("step 15: blocks.0.mlp.fc.weight -> masked 64:2:8"));
  EXPECT_TRUE(logged("step 20: blocks.0.mlp.fc.weight -> vnm 64:2:8"));
  EXPECT_TRUE(logged("step 30: blocks.0.mlp.fc.weight -> vnm+lora 64:2:8, low-rank adapter r=4"));
  EXPECT_TRUE(logged("step 20: recipe update: host layers rebuilt in "));  // the stall's time, per update
  EXPECT_FALSE(logged("step 21: recipe update"));
  EXPECT_EQ(full.model().linear("blocks.0.mlp.fc.weight").kind(), "vnm+lora");
  EXPECT_EQ(full.model().linear("blocks.0.attn.qkv.weight").kind(), "dense");

  // Resume from step 25 (compressed, before the adapters) and from step 35 (with them).
  for (const char* ck : {"step-000025", "step-000035"}) {
    const fs::path part = dir / (std::string("part_") + ck);
    fs::create_directories(part);
    fs::copy(dir / "full" / ck, part / ck, fs::copy_options::recursive);
    std::ofstream(part / "latest") << ck << "\n";
    auto resumed = Trainer::resume(part.string(), quiet);
    resumed->run();
    const auto& a = full.model();
    const auto& b = resumed->model();
    for (size_t i = 0; i < a.num_params(); ++i)
      ASSERT_EQ(std::memcmp(&a.params()[i], &b.params()[i], sizeof(float)), 0) << ck << ": parameter element " << i;
  }
}
