// `esplag train` on the GPU against the CPU reference, through the Trainer itself.
//
// The default config (configs/tiny.yaml: 0.37M parameters, 16 x 128 tokens per step,
// warm-up 20 steps to lr 3e-3) cut to 30 steps, on a small structured byte-level corpus
// prepared in a scratch directory, trained once with train.device=cpu and once with
// cuda. Both start from the same weights (the host initialisation), see the same
// batches and follow the same schedule, so the GPU's loss at every logged step must be
// within 2% (relative) of the CPU's, the bf16 tolerance of tests/gpu_model.cu, and the
// first step's gradient norm within 1%. Then: a GPU checkpoint resumed on the GPU
// continues the same curve (within 0.1%: the GPU is deterministic, so in practice the
// same bits) and loads and resumes on the CPU; a CPU checkpoint resumes on the GPU;
// gradient accumulation matches; reading the loss only at the log cadence gives the same
// logged values; activation checkpointing logs the same bits; device auto picks the GPU; a
// sparse recipe is refused; divergence is reported with the first bad step and writes no
// checkpoint.
//
// Host code only (the GPU work is the library's), so a C++ file: nvcc 13.0's device front
// end (cicc) aborts without a diagnostic on this file compiled as CUDA.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/prepare.h"
#include "data/tokenizer.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/linear_masked.h"
#include "model/linear_slope.h"
#include "model/linear_vnm.h"
#include "sparse/cuda/cusparselt.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace {

using namespace esplag;
namespace fs = std::filesystem;

constexpr int kSteps = 30;
constexpr double kLossTol = 2e-2;  // relative, per logged step

fs::path scratch(const std::string& name) {
  struct Dirs {
    std::vector<fs::path> paths;
    ~Dirs() {
      std::error_code ec;
      for (const auto& p : paths) fs::remove_all(p, ec);
    }
  };
  static Dirs dirs;
  const fs::path p = fs::temp_directory_path() / ("esplag_gpu_train_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  dirs.paths.push_back(p);
  return p;
}

// configs/tiny.yaml: from $ESPLAG_SOURCE_DIR, the working directory (the repository
// root, where scripts run the tests) or next to this file's directory.
std::string tiny_yaml() {
  std::vector<fs::path> roots;
  if (const char* env = std::getenv("ESPLAG_SOURCE_DIR")) roots.emplace_back(env);
  roots.push_back(fs::current_path());
  roots.push_back(fs::path(__FILE__).parent_path().parent_path());
  for (const auto& r : roots)
    if (fs::exists(r / "configs" / "tiny.yaml")) return (r / "configs" / "tiny.yaml").string();
  ADD_FAILURE() << "configs/tiny.yaml not found (set ESPLAG_SOURCE_DIR to the repository)";
  return "configs/tiny.yaml";
}

// A corpus with structure (verses that repeat with variations), byte tokens, ~120 KB.
std::string make_dataset(const fs::path& dir) {
  const char* words[] = {"light", "darkness", "waters", "earth", "heaven", "firmament", "evening", "morning",
                         "seed",  "fruit",    "beast",  "fowl",  "sea",    "land",      "day",     "night"};
  std::string text;
  for (int i = 0; i < 2000; ++i)
    text += std::string("And God said, Let there be ") + words[i % 16] + " in the " + words[(i * 7) % 16] +
            ": and there was " + words[(i * 3) % 16] + ".\n";
  std::ofstream(dir / "corpus.txt") << text;
  prepare_dataset((dir / "corpus.txt").string(), ByteTokenizer(), (dir / "data").string(), 0.1, 1 << 20);
  return (dir / "data").string();
}

TrainConfig tiny(const std::string& data, const std::string& device, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"data.path=" + data,
                                "train.device=" + device,
                                "train.steps=" + std::to_string(kSteps),
                                "train.log_every=1",
                                "train.eval_every=0",
                                "train.eval_batches=4",
                                "train.checkpoint_every=15",
                                "train.keep_checkpoints=0"};
  o.insert(o.end(), extra.begin(), extra.end());
  return load_train_config(tiny_yaml(), o);
}

struct RunLog {
  std::map<int64_t, double> loss, norm, tok_s;
  double val_loss = 0;
  std::vector<std::string> log;
  TrainResult result;
};

RunLog read_metrics(const fs::path& dir) {
  RunLog r;
  std::ifstream in(dir / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    const int64_t s = j.at("step").get<int64_t>();
    if (j.contains("loss")) {
      r.loss[s] = j["loss"].get<double>();
      r.norm[s] = j["grad_norm"].get<double>();
      r.tok_s[s] = j["tokens_per_s"].get<double>();
    }
    if (j.contains("val_loss")) r.val_loss = j["val_loss"].get<double>();
  }
  return r;
}

RunLog train(const TrainConfig& cfg, const fs::path& dir) {
  std::vector<std::string> log;
  Trainer t(cfg, dir.string(), [&](const std::string& s) { log.push_back(s); });
  EXPECT_EQ(t.device(), cfg.device);
  const TrainResult result = t.run();
  RunLog r = read_metrics(dir);
  r.log = log;
  r.result = result;
  return r;
}

RunLog resume(const fs::path& from_run, const std::string& checkpoint, const fs::path& dir, const std::string& device) {
  fs::create_directories(dir);
  fs::copy(from_run / checkpoint, dir / checkpoint, fs::copy_options::recursive);
  std::ofstream(dir / "latest") << checkpoint << "\n";
  auto t = Trainer::resume(dir.string(), [](const std::string&) {}, 0, device);
  EXPECT_EQ(t->device(), device);
  const TrainResult result = t->run();
  RunLog r = read_metrics(dir);
  r.result = result;
  return r;
}

// Every step of `expected` in [from, to] is in `got` and within `rel` of it.
void expect_curve(const RunLog& got, const RunLog& expected, int64_t from, int64_t to, double rel, const char* what) {
  for (int64_t s = from; s <= to; ++s) {
    ASSERT_TRUE(got.loss.count(s) && expected.loss.count(s)) << what << ": step " << s << " was not logged";
    const double g = got.loss.at(s), e = expected.loss.at(s);
    ASSERT_TRUE(std::isfinite(g)) << what << ": step " << s;
    EXPECT_NEAR(g, e, rel * e) << what << ": loss at step " << s;
  }
}

bool bit_identical(const RunLog& a, const RunLog& b, int64_t from, int64_t to) {
  for (int64_t s = from; s <= to; ++s)
    if (!a.loss.count(s) || !b.loss.count(s) || std::memcmp(&a.loss.at(s), &b.loss.at(s), sizeof(double)) != 0)
      return false;
  return true;
}

bool has_device() {
  const DeviceProbe p = probe_devices();
  return p.cuda_build && p.gpus > 0;
}

// One CPU and one GPU run of the tiny config, shared by the tests below.
class GpuTrain : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!has_device()) return;
    dir_ = new fs::path(scratch("suite"));
    data_ = new std::string(make_dataset(*dir_));
    cpu_ = new RunLog(train(tiny(*data_, "cpu", {"train.eval_every=30"}), *dir_ / "cpu"));
    gpu_ = new RunLog(train(tiny(*data_, "cuda", {"train.eval_every=30"}), *dir_ / "gpu"));
  }
  static void TearDownTestSuite() {
    delete cpu_;
    delete gpu_;
    delete data_;
    delete dir_;
  }
  void SetUp() override { ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"; }
  // The config `yaml` for 12 steps on the suite's data, logging every step, a checkpoint
  // at step 6.
  static TrainConfig twelve_steps(const fs::path& yaml, const std::string& device,
                                  const std::vector<std::string>& extra = {}) {
    std::vector<std::string> sets = {"data.path=" + *data_,   "train.device=" + device,   "train.steps=12",
                                     "schedule.warmup_steps=12", "train.log_every=1",       "train.eval_every=0",
                                     "train.checkpoint_every=6", "train.keep_checkpoints=0"};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return load_train_config(yaml.string(), sets);
  }
  // tiny.yaml with `recipe` (and the `extra` settings) for twelve_steps, run on the CPU
  // ("<name>_cpu_run") and on the GPU ("<name>_gpu_run"); both curves printed, the GPU's
  // within `rel` of the CPU's.
  struct Runs {
    RunLog cpu, gpu;
  };
  static Runs recipe_on_both(const std::string& name, const std::string& recipe, double rel,
                             const std::vector<std::string>& extra = {}) {
    const fs::path yaml = *dir_ / (name + ".yaml");
    std::ofstream(yaml) << read_file(tiny_yaml()) << "recipe:\n  - " << recipe << "\n";
    Runs r{train(twelve_steps(yaml, "cpu", extra), *dir_ / (name + "_cpu_run")),
           train(twelve_steps(yaml, "cuda", extra), *dir_ / (name + "_gpu_run"))};
    for (int64_t s = 1; s <= 12; ++s)
      std::printf("  %s step %2lld loss cpu %.5f gpu %.5f\n", name.c_str(), static_cast<long long>(s),
                  r.cpu.loss.at(s), r.gpu.loss.at(s));
    expect_curve(r.gpu, r.cpu, 1, 12, rel, name.c_str());
    return r;
  }
  // The step-6 checkpoints of recipe_on_both's runs resumed: the GPU's on the GPU (within
  // 1e-3 of the GPU run) and on the CPU, the CPU's on the GPU (when given; within `rel` of
  // the run they came from).
  static void expect_resumes(const std::string& name, const Runs& r, double rel, bool cpu_checkpoint_on_gpu) {
    const fs::path gpu_run = *dir_ / (name + "_gpu_run");
    const RunLog on_gpu = resume(gpu_run, "step-000006", *dir_ / (name + "_resume_gpu"), "cuda");
    expect_curve(on_gpu, r.gpu, 7, 12, 1e-3, (name + ": gpu checkpoint resumed on gpu").c_str());
    const RunLog on_cpu = resume(gpu_run, "step-000006", *dir_ / (name + "_resume_cpu"), "cpu");
    expect_curve(on_cpu, r.gpu, 7, 12, rel, (name + ": gpu checkpoint resumed on cpu").c_str());
    if (!cpu_checkpoint_on_gpu) return;
    const RunLog cpu_on_gpu =
        resume(*dir_ / (name + "_cpu_run"), "step-000006", *dir_ / (name + "_cpu_resume_gpu"), "cuda");
    expect_curve(cpu_on_gpu, r.cpu, 7, 12, rel, (name + ": cpu checkpoint resumed on gpu").c_str());
  }

  static fs::path* dir_;
  static std::string* data_;
  static RunLog *cpu_, *gpu_;
};
fs::path* GpuTrain::dir_ = nullptr;
std::string* GpuTrain::data_ = nullptr;
RunLog* GpuTrain::cpu_ = nullptr;
RunLog* GpuTrain::gpu_ = nullptr;

TEST_F(GpuTrain, LossCurveMatchesTheCpu) {
  const RunLog &c = *cpu_, &g = *gpu_;
  for (int64_t s = 1; s <= kSteps; ++s)
    if (c.loss.count(s) && g.loss.count(s))
      std::printf("  step %2lld  loss cpu %.5f gpu %.5f (rel %+.2e)  norm cpu %.4f gpu %.4f  tok/s cpu %.0f gpu %.0f\n",
                  static_cast<long long>(s), c.loss.at(s), g.loss.at(s), (g.loss.at(s) - c.loss.at(s)) / c.loss.at(s),
                  c.norm.at(s), g.norm.at(s), c.tok_s.at(s), g.tok_s.at(s));
  std::printf("  val loss cpu %.5f gpu %.5f\n", c.val_loss, g.val_loss);
  ASSERT_EQ(g.loss.size(), size_t(kSteps));  // log_every 1: every step, as on the CPU
  ASSERT_EQ(c.loss.size(), g.loss.size());
  expect_curve(g, c, 1, kSteps, kLossTol, "gpu vs cpu");
  // Same weights at step 1: the gradient norms agree to bf16 accuracy.
  EXPECT_NEAR(g.norm.at(1), c.norm.at(1), 1e-2 * c.norm.at(1));
  EXPECT_NEAR(g.val_loss, c.val_loss, kLossTol * c.val_loss);
  EXPECT_LT(g.loss.at(kSteps), 0.85 * g.loss.at(1)) << "the GPU run did not learn";
  EXPECT_EQ(g.result.steps, kSteps);
  EXPECT_EQ(g.result.first_loss, g.loss.at(1));
  EXPECT_EQ(g.result.last_loss, g.loss.at(kSteps));
  for (const auto& [s, t] : g.tok_s) EXPECT_GT(t, 0) << "tokens/s at step " << s;
  // The progress line and the first line name the device.
  ASSERT_FALSE(g.log.empty());
  EXPECT_NE(g.log.front().find("| device cuda ("), std::string::npos) << g.log.front();
  EXPECT_TRUE(std::any_of(g.log.begin(), g.log.end(), [](const std::string& l) {
    return l.find("step     30/30 | loss") != std::string::npos && l.find("tok/s | ETA") != std::string::npos;
  }));
}

TEST_F(GpuTrain, GpuCheckpointResumesOnTheGpuAndOnTheCpu) {
  const fs::path gpu_run = *dir_ / "gpu";
  ASSERT_TRUE(fs::exists(gpu_run / "step-000015" / "model.safetensors"));
  ASSERT_TRUE(fs::exists(gpu_run / "step-000015" / "optimizer.safetensors"));
  const CheckpointContents info = read_checkpoint_info((gpu_run / "step-000015").string());
  EXPECT_EQ(info.state.step, 15);
  EXPECT_EQ(info.state.tokens_seen, int64_t(15) * 16 * 128);

  // On the GPU: the step counter continues at 16 and the curve is the uninterrupted one.
  const RunLog on_gpu = resume(gpu_run, "step-000015", *dir_ / "resume_gpu", "cuda");
  EXPECT_EQ(on_gpu.result.steps, kSteps);
  ASSERT_FALSE(on_gpu.loss.empty());
  EXPECT_EQ(on_gpu.loss.begin()->first, 16);  // the copy holds no metrics of its own before
  EXPECT_EQ(on_gpu.loss.rbegin()->first, kSteps);
  expect_curve(on_gpu, *gpu_, 16, kSteps, 1e-3, "gpu resumed on gpu");
  std::printf("  resumed on the GPU: losses of steps 16-30 %s the uninterrupted run's\n",
              bit_identical(on_gpu, *gpu_, 16, kSteps) ? "bit-identical to" : "close to (not bit-identical)");

  // On the CPU: the checkpoint loads and continues within bf16 tolerance.
  const RunLog on_cpu = resume(gpu_run, "step-000015", *dir_ / "resume_cpu", "cpu");
  EXPECT_EQ(on_cpu.result.steps, kSteps);
  expect_curve(on_cpu, *gpu_, 16, kSteps, kLossTol, "gpu checkpoint resumed on cpu");

  // The final GPU checkpoint evaluates on the CPU to the GPU's validation loss.
  const EvalResult ev = evaluate_checkpoint((gpu_run / "step-000030").string(), *data_, "val", 4);
  EXPECT_NEAR(ev.loss, gpu_->val_loss, kLossTol * gpu_->val_loss);
  // ... and on the GPU (eval --device cuda) to the same loss within bf16 tolerance.
  const EvalResult ev_gpu = evaluate_checkpoint((gpu_run / "step-000030").string(), *data_, "val", 4, 0, 0, "cuda");
  EXPECT_EQ(ev_gpu.device, "cuda");
  EXPECT_EQ(ev_gpu.batches, ev.batches);
  EXPECT_NEAR(ev_gpu.loss, ev.loss, kLossTol * ev.loss);
  std::printf("  final checkpoint: val loss on the CPU %.5f, on the GPU %.5f\n", ev.loss, ev_gpu.loss);
  auto model = load_model((gpu_run / "step-000030").string());
  for (size_t i = 0; i < model->num_params(); ++i) ASSERT_TRUE(std::isfinite(model->params()[i])) << i;
}

TEST_F(GpuTrain, CpuCheckpointResumesOnTheGpu) {
  const RunLog r = resume(*dir_ / "cpu", "step-000015", *dir_ / "cpu_on_gpu", "cuda");
  EXPECT_EQ(r.result.steps, kSteps);
  expect_curve(r, *cpu_, 16, kSteps, kLossTol, "cpu checkpoint resumed on gpu");
}

// The loss is read from the device only when a step is logged: the logged values are
// those of every-step logging.
TEST_F(GpuTrain, LogCadenceChangesNoLoggedValue) {
  const RunLog r = train(tiny(*data_, "cuda", {"train.log_every=10", "train.checkpoint_every=0"}), *dir_ / "cadence");
  ASSERT_EQ(r.loss.size(), 4u);  // steps 1, 10, 20, 30
  for (int64_t s : {1, 10, 20, 30}) {
    ASSERT_TRUE(r.loss.count(s)) << s;
    EXPECT_NEAR(r.loss.at(s), gpu_->loss.at(s), 1e-6 * gpu_->loss.at(s)) << "step " << s;
    EXPECT_NEAR(r.norm.at(s), gpu_->norm.at(s), 1e-6 * gpu_->norm.at(s)) << "step " << s;
  }
}

TEST_F(GpuTrain, GradientAccumulationMatchesTheCpu) {
  const std::vector<std::string> o = {"train.batch_size=8", "train.grad_accum=2", "train.steps=10",
                                      "schedule.warmup_steps=10", "train.checkpoint_every=0"};
  const RunLog c = train(tiny(*data_, "cpu", o), *dir_ / "accum_cpu");
  const RunLog g = train(tiny(*data_, "cuda", o), *dir_ / "accum_gpu");
  for (int64_t s = 1; s <= 10; ++s)
    std::printf("  accum step %2lld loss cpu %.5f gpu %.5f\n", static_cast<long long>(s), c.loss.at(s), g.loss.at(s));
  expect_curve(g, c, 1, 10, kLossTol, "grad_accum 2");
  EXPECT_NEAR(g.norm.at(1), c.norm.at(1), 1e-2 * c.norm.at(1));
}

// Activation checkpointing on the GPU: the run of the suite again with train.checkpointing
// full (and selective on every other block) logs the same losses, gradient norms and
// validation loss bit for bit; its checkpoint resumes on the GPU with the mode it saved.
TEST_F(GpuTrain, CheckpointingTrainsTheSameBits) {
  const RunLog full =
      train(tiny(*data_, "cuda", {"train.eval_every=30", "train.checkpointing=full"}), *dir_ / "ckpt_full");
  const RunLog selective = train(tiny(*data_, "cuda",
                                      {"train.eval_every=30", "train.checkpointing=selective",
                                       "train.checkpointing_every=2", "train.checkpoint_every=0"}),
                                 *dir_ / "ckpt_selective");
  for (const auto* r : {&full, &selective}) {
    ASSERT_EQ(r->loss.size(), size_t(kSteps));
    for (int64_t s = 1; s <= kSteps; ++s) {
      EXPECT_EQ(r->loss.at(s), gpu_->loss.at(s)) << (r == &full ? "full" : "selective") << ": loss at step " << s;
      EXPECT_EQ(r->norm.at(s), gpu_->norm.at(s)) << (r == &full ? "full" : "selective") << ": norm at step " << s;
    }
    EXPECT_EQ(r->val_loss, gpu_->val_loss);
  }
  const CheckpointContents info = read_checkpoint_info((*dir_ / "ckpt_full" / "step-000015").string());
  EXPECT_EQ(info.config.checkpointing.mode, CheckpointMode::full);
  const RunLog resumed = resume(*dir_ / "ckpt_full", "step-000015", *dir_ / "ckpt_full_resumed", "cuda");
  expect_curve(resumed, *gpu_, 16, kSteps, 1e-3, "full checkpointing resumed on the gpu");
}

// Every tensor of two checkpoints' model.safetensors and optimizer.safetensors equal, bit
// for bit (the metadata, which holds the config, may differ).
void expect_same_tensors(const fs::path& a, const fs::path& b) {
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const SafetensorsFile fa = load_safetensors((a / file).string()), fb = load_safetensors((b / file).string());
    ASSERT_EQ(fa.tensors.size(), fb.tensors.size()) << file;
    for (const auto& [name, t] : fa.tensors) {
      ASSERT_TRUE(fb.tensors.count(name)) << file << ": " << name;
      const Tensor& u = fb.tensors.at(name);
      ASSERT_EQ(t.nbytes(), u.nbytes()) << name;
      EXPECT_EQ(std::memcmp(t.raw(), u.raw(), t.nbytes()), 0) << file << ": " << name << " differs";
    }
  }
}

// The optimizer offload (train.offload) moves the moments, and with optimizer+master the
// master weights' low halves, to pinned host memory; the kernels are the same, so nothing
// changes by a bit: the suite's GPU run and a slope run with adapters (its layers change
// their stored form at step 0 and gain adapters at step 4, so the offloaded state is laid
// out again twice) log the same losses and norms as without offload and save the same
// tensors; the offloaded slope run's checkpoint resumes without offload.
TEST_F(GpuTrain, OptimizerOffloadChangesNoBit) {
  for (const std::string mode : {"optimizer", "optimizer+master"}) {
    const fs::path run = *dir_ / ("offload_" + mode);
    const RunLog r = train(tiny(*data_, "cuda", {"train.eval_every=30", "train.offload=" + mode}), run);
    EXPECT_TRUE(bit_identical(r, *gpu_, 1, kSteps)) << mode;
    for (int64_t s = 1; s <= kSteps; ++s) EXPECT_EQ(r.norm.at(s), gpu_->norm.at(s)) << mode << ": norm at step " << s;
    EXPECT_EQ(r.val_loss, gpu_->val_loss) << mode;
    const auto first = std::find_if(r.log.begin(), r.log.end(), [](const std::string& l) { return l.rfind("model ", 0) == 0; });
    ASSERT_NE(first, r.log.end());
    EXPECT_NE(first->find("the optimizer offloaded (" + mode + ")"), std::string::npos) << *first;
    expect_same_tensors(run / "step-000015", *dir_ / "gpu" / "step-000015");
  }
  if (!esplag::gpu::cusparselt_available()) GTEST_SKIP() << esplag::gpu::cusparselt_unavailable_reason();
  const fs::path yaml = *dir_ / "offload_slope.yaml";
  std::ofstream(yaml) << read_file(tiny_yaml()) << "recipe:\n  - slope: {params: ['re:blocks\\..*\\.(attn|mlp)\\.\\w+"
                      << "\\.weight'], lora_rank: 4, lora_start: 4}\n";
  const RunLog plain = train(twelve_steps(yaml, "cuda"), *dir_ / "offload_slope_plain");
  TrainConfig cfg = twelve_steps(yaml, "cuda");
  cfg.offload = "optimizer+master";
  const RunLog offloaded = train(cfg, *dir_ / "offload_slope");
  EXPECT_TRUE(bit_identical(offloaded, plain, 1, 12));
  expect_same_tensors(*dir_ / "offload_slope" / "step-000012", *dir_ / "offload_slope_plain" / "step-000012");
  const RunLog resumed = resume(*dir_ / "offload_slope", "step-000006", *dir_ / "offload_slope_resumed", "cuda");
  expect_curve(resumed, plain, 7, 12, 1e-3, "offloaded slope checkpoint resumed");
}

// fp8 products on the GPU (train.precision fp8: the dense layers' GEMMs on e4m3 activations
// and weights and, by default, e4m3 output gradients) follow the CPU's fp8 emulation of the same run,
// within 3% per step (the bf16 suite's 2%, plus the GPU's casts of bf16 rather than fp32
// tensors and its fast accumulation in the forward); the run learns, it is not the bf16 run,
// and full activation checkpointing gives its bits. fp8 slope needs e4m3 gradients on the
// GPU (refused with e5m2, trains with e4m3).
TEST_F(GpuTrain, Fp8TracksTheCpuEmulation) {
  const RunLog cpu = train(tiny(*data_, "cpu", {"train.precision=fp8"}), *dir_ / "fp8_cpu");
  const RunLog gpu = train(tiny(*data_, "cuda", {"train.precision=fp8"}), *dir_ / "fp8_gpu");
  for (int64_t s = 1; s <= kSteps; s += 5)
    std::printf("  fp8 step %2lld loss cpu %.5f gpu %.5f (bf16 gpu %.5f)\n", static_cast<long long>(s), cpu.loss.at(s),
                gpu.loss.at(s), gpu_->loss.at(s));
  expect_curve(gpu, cpu, 1, kSteps, 3e-2, "fp8");
  EXPECT_LT(gpu.loss.at(kSteps), 0.8 * gpu.loss.at(1));
  EXPECT_FALSE(bit_identical(gpu, *gpu_, 2, kSteps)) << "the fp8 run logged the bf16 run's losses";
  // Full activation checkpointing casts the recomputed inputs again: the same bits.
  const RunLog full = train(tiny(*data_, "cuda", {"train.precision=fp8", "train.checkpointing=full"}), *dir_ / "fp8_full");
  EXPECT_TRUE(bit_identical(full, gpu, 1, kSteps)) << "fp8 with full checkpointing";
  const fs::path yaml = *dir_ / "fp8_slope.yaml";
  std::ofstream(yaml) << read_file(tiny_yaml()) << "recipe:\n  - slope: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight']}\n";
  TrainConfig cfg = twelve_steps(yaml, "cuda");
  cfg.precision = "fp8";
  cfg.fp8_grad = "e5m2";
  try {
    Trainer t(cfg, (*dir_ / "fp8_slope").string(), [](const std::string&) {});
    ADD_FAILURE() << "fp8 slope with e5m2 gradients trained on the GPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.fp8_grad is e5m2"), std::string::npos) << e.what();
  }
  // With e4m3 gradients (the default) fp8 slope trains on the GPU (tests/gpu_fp8_sparse.cpp checks its
  // products against the CPU's emulation) and learns.
  cfg.fp8_grad = "e4m3";
  Trainer t(cfg, (*dir_ / "fp8_slope_e4m3").string(), [](const std::string&) {});
  EXPECT_EQ(t.device(), "cuda");
  const esplag::TrainResult r = t.run();
  EXPECT_EQ(r.steps, cfg.steps);
  EXPECT_LT(r.last_loss, 0.9 * r.first_loss);
}

// train.fp8_scaling delayed, dense layers and fp8 slope on fc (its Fp8SparseProducts): the
// GPU's curve within 3% of the CPU's emulation; another run than current scaling; full
// activation checkpointing (recomputed casts record the same amaxes again) and the step-6
// checkpoint (the histories saved and loaded) give the same bits; the checkpoint resumes on
// the CPU, and the CPU's on the GPU. The 2:4 products everywhere, so that runs repeat.
TEST_F(GpuTrain, Fp8DelayedScalingTracksTheCpuAndResumes) {
  const std::vector<std::string> delayed = {"train.precision=fp8", "train.fp8_scaling=delayed",
                                            "train.fp8_amax_history=3", "train.sparse_dispatch=sparse"};
  const std::string slope = "slope: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight']}";
  const Runs r = recipe_on_both("fp8_delayed", slope, 3e-2, delayed);
  const fs::path yaml = *dir_ / "fp8_delayed.yaml";
  const RunLog current =
      train(twelve_steps(yaml, "cuda", {"train.precision=fp8", "train.sparse_dispatch=sparse"}), *dir_ / "fp8_current");
  EXPECT_FALSE(bit_identical(current, r.gpu, 2, 12)) << "delayed scaling trained the current-scaling run";
  std::vector<std::string> full = delayed;
  full.push_back("train.checkpointing=full");
  EXPECT_TRUE(bit_identical(train(twelve_steps(yaml, "cuda", full), *dir_ / "fp8_delayed_full"), r.gpu, 1, 12))
      << "delayed scaling with full activation checkpointing";
  const RunLog resumed = resume(*dir_ / "fp8_delayed_gpu_run", "step-000006", *dir_ / "fp8_delayed_resumed", "cuda");
  EXPECT_TRUE(bit_identical(resumed, r.gpu, 7, 12)) << "the resumed run scaled its casts otherwise";
  expect_resumes("fp8_delayed", r, 3e-2, true);
}

// Delayed scaling on a LLaMA-style model (llama-tiny: SwiGLU, RMSNorm, no biases, dense
// layers), where from the second step SwiGLU writes mproj's X codes in the forward, and fc's
// output-gradient codes and mproj's Xᵀ codes in the backward (gpu::fp8_swiglu_forward,
// _backward; H = 176: a partial column tile), and the recomputed norms qkv's and fc's Xᵀ
// codes (gpu::fp8_norm_recompute), instead of the casts: the GPU's curve within 3% of the
// CPU's emulation; full activation checkpointing and the resumed step-6 checkpoint give its
// bits. (That the producers' codes are the casts' bits is GpuFp8.SwigluCodesAreTheCastsOfItsValues
// and GpuFp8.NormRecomputeCodesAreTheCastsOfItsValues.)
TEST_F(GpuTrain, Fp8DelayedSwigluTracksTheCpuAndResumes) {
  const fs::path yaml = *dir_ / "fp8_swiglu.yaml";
  std::ofstream(yaml) << read_file(tiny_yaml());
  const std::vector<std::string> delayed = {"model.preset=llama-tiny", "train.precision=fp8",
                                            "train.fp8_scaling=delayed", "train.fp8_amax_history=3"};
  const RunLog cpu = train(twelve_steps(yaml, "cpu", delayed), *dir_ / "fp8_swiglu_cpu");
  const RunLog gpu = train(twelve_steps(yaml, "cuda", delayed), *dir_ / "fp8_swiglu_gpu");
  for (int64_t s = 1; s <= 12; ++s)
    std::printf("  fp8 delayed llama-tiny step %2lld loss cpu %.5f gpu %.5f\n", static_cast<long long>(s),
                cpu.loss.at(s), gpu.loss.at(s));
  expect_curve(gpu, cpu, 1, 12, 3e-2, "fp8 delayed llama-tiny");
  std::vector<std::string> full = delayed;
  full.push_back("train.checkpointing=full");
  EXPECT_TRUE(bit_identical(train(twelve_steps(yaml, "cuda", full), *dir_ / "fp8_swiglu_full"), gpu, 1, 12))
      << "full activation checkpointing";
  const RunLog resumed = resume(*dir_ / "fp8_swiglu_gpu", "step-000006", *dir_ / "fp8_swiglu_resumed", "cuda");
  EXPECT_TRUE(bit_identical(resumed, gpu, 7, 12)) << "the resumed run";
}

TEST_F(GpuTrain, AutoPicksTheGpuAndSparseRecipesAreRefused) {
  std::vector<std::string> log;
  Trainer t(tiny(*data_, "auto", {"train.steps=2", "schedule.warmup_steps=2"}), (*dir_ / "auto").string(),
            [&](const std::string& s) { log.push_back(s); });
  EXPECT_EQ(t.device(), "cuda");
  EXPECT_EQ(t.run().steps, 2);
  EXPECT_NE(log.front().find("| device cuda ("), std::string::npos) << log.front();

  const std::string recipe =
      read_file(tiny_yaml()) +
      "recipe:\n"
      "  - gradual_magnitude: {params: ['re:blocks\\..*\\.mlp\\.proj\\.weight'], mask_type: '2:4', start: 0.0, "
      "end: 0.5, update_every: 1}\n"
      "  - kernel_replacement: {params: ['re:blocks\\..*\\.mlp\\.proj\\.weight'], start: 0.75, lora_rank: 2, "
      "lora_start: 1.0}\n";
  const fs::path yaml = *dir_ / "venom_lora.yaml";
  std::ofstream(yaml) << recipe;
  try {
    Trainer bad(load_train_config(yaml.string(), {"data.path=" + *data_, "train.device=cuda"}),
                (*dir_ / "slope_cuda").string(), [](const std::string&) {});
    ADD_FAILURE() << "a sparse recipe trained on the GPU";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("modifier kernel_replacement with LoRA adapters"), std::string::npos) << m;
    EXPECT_NE(m.find(gpu_kinds_note()), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(*dir_ / "slope_cuda"));
  // auto keeps such a run on the CPU and says why in the first line.
  std::vector<std::string> log2;
  Trainer cpu(
      load_train_config(yaml.string(), {"data.path=" + *data_, "train.steps=4", "schedule.warmup_steps=4"}),
      (*dir_ / "slope_auto").string(), [&](const std::string& s) { log2.push_back(s); });
  EXPECT_EQ(cpu.device(), "cpu");
  cpu.run();
  const auto first = std::find_if(log2.begin(), log2.end(), [](const std::string& l) { return l.rfind("model ", 0) == 0; });
  ASSERT_NE(first, log2.end());
  EXPECT_NE(first->find("device cpu (auto: the run needs sparse Linear kinds"), std::string::npos) << *first;
}

// The torchao recipe on the GPU: the MLP linears semi_sparse (runtime transposable 2:4 on
// cuSPARSELt) for the first 6 steps, then dense; the curve follows the CPU run's, and the
// log names the layers that change kind.
TEST_F(GpuTrain, SemiSparseRecipeTracksTheCpu) {
  if (!esplag::gpu::cusparselt_available()) GTEST_SKIP() << esplag::gpu::cusparselt_unavailable_reason();
  const fs::path yaml = *dir_ / "semi.yaml";
  std::ofstream(yaml) << read_file(tiny_yaml())
                      << "recipe:\n  - semi_sparse: {params: ['re:blocks\\..*\\.mlp\\..*\\.weight'], until: 6}\n";
  auto cfg = [&](const std::string& device) {
    return load_train_config(yaml.string(), {"data.path=" + *data_, "train.device=" + device, "train.steps=10",
                                             "schedule.warmup_steps=10", "train.log_every=1", "train.eval_every=0",
                                             "train.checkpoint_every=0"});
  };
  const RunLog c = train(cfg("cpu"), *dir_ / "semi_cpu");
  const RunLog g = train(cfg("cuda"), *dir_ / "semi_gpu");
  for (int64_t s = 1; s <= 10; ++s)
    std::printf("  semi_sparse step %2lld loss cpu %.5f gpu %.5f\n", static_cast<long long>(s), c.loss.at(s),
                g.loss.at(s));
  expect_curve(g, c, 1, 10, kLossTol, "semi_sparse until step 6");
  const auto dense_again = std::count_if(g.log.begin(), g.log.end(), [](const std::string& l) {
    return l.find("mlp") != std::string::npos && l.find("dense") != std::string::npos;
  });
  EXPECT_GT(dense_again, 0) << "the log does not say that the MLP linears went back to dense";
  const auto dispatch = std::count_if(g.log.begin(), g.log.end(), [](const std::string& l) {
    return l.find("semi_sparse products by layer shape") != std::string::npos;
  });
  EXPECT_EQ(dispatch, 1) << "the log does not say which products each layer shape runs";
}

// torchao's runtime 2:4 of the activations on the GPU: the MLP linears prune their inputs
// (tile_24) until step 8, then run dense. The curve follows the CPU run's, the log names the
// pattern and the products chosen per layer shape, and the step-6 checkpoints resume on
// either device.
TEST_F(GpuTrain, SemiSparseActivationRecipeTracksTheCpuAndResumes) {
  if (!esplag::gpu::cusparselt_available()) GTEST_SKIP() << esplag::gpu::cusparselt_unavailable_reason();
  const Runs r = recipe_on_both(
      "activation",
      "semi_sparse_activation: {params: ['re:blocks\\..*\\.mlp\\..*\\.weight'], activation: tile_24, until: 8}",
      kLossTol);
  const auto converted = std::count_if(r.gpu.log.begin(), r.gpu.log.end(), [](const std::string& l) {
    return l.find("blocks.0.mlp.fc.weight -> semi_sparse_activation (tile_24)") != std::string::npos;
  });
  EXPECT_EQ(converted, 1) << "the log does not say that the MLP linears prune their inputs";
  const auto dispatch = std::count_if(r.gpu.log.begin(), r.gpu.log.end(), [](const std::string& l) {
    return l.find("semi_sparse_activation products by layer shape") != std::string::npos;
  });
  EXPECT_EQ(dispatch, 1) << "the log does not say which products each layer shape runs";
  expect_resumes("activation", r, kLossTol, true);
}

// SLoPe on the GPU: the attention and MLP-output linears become slope at step 2 (masks
// from the weights the GPU trained until then), the backward mask refreshed every 3 steps.
// The curve follows the CPU run's; the checkpoint holds the CPU's slope state (kept values,
// their moments, masks, refresh step) and resumes on the GPU and on the CPU.
TEST_F(GpuTrain, SlopeRecipeTracksTheCpuAndResumes) {
  if (!esplag::gpu::cusparselt_available()) GTEST_SKIP() << esplag::gpu::cusparselt_unavailable_reason();
  const Runs r = recipe_on_both(
      "slope", "slope: {params: ['re:blocks\\..*\\.(attn\\.\\w+|mlp\\.proj)\\.weight'], start: 2, mask_change_freq: 3}",
      kLossTol);
  const auto converted = std::count_if(r.gpu.log.begin(), r.gpu.log.end(), [](const std::string& l) {
    return l.find("step 2: blocks.0.attn.qkv.weight -> slope 2:4") != std::string::npos;
  });
  EXPECT_EQ(converted, 1) << "the log does not say that the layers became slope";

  auto model = load_model((*dir_ / "slope_gpu_run" / "step-000006").string());
  const auto& l = dynamic_cast<const SlopeLinear<float>&>(model->linear("blocks.1.attn.proj.weight"));
  EXPECT_EQ(l.refresh_step(), 5) << "made at step 2, refreshed for step 5";
  // The flat weight holds W1: zero wherever the forward mask prunes.
  const float* w = model->linear_params("blocks.1.attn.proj.weight").weight;
  const std::vector<uint8_t> fwd = l.forward_mask();  // built from the metadata: once
  for (size_t i = 0; i < fwd.size(); ++i)
    if (!fwd[i]) ASSERT_EQ(w[i], 0.f) << i;
  expect_resumes("slope", r, kLossTol, true);
}

// Distillation on the GPU (a forward-only GPU copy of the teacher: the suite's CPU run)
// of a slope student: the curve and the logged loss parts follow the CPU run's, and the run
// resumes, the teacher loaded again.
TEST_F(GpuTrain, DistillRecipeTracksTheCpuAndResumes) {
  if (!esplag::gpu::cusparselt_available()) GTEST_SKIP() << esplag::gpu::cusparselt_unavailable_reason();
  const std::string teacher = (*dir_ / "cpu").string();
  const Runs r = recipe_on_both("distill",
                                "slope: {params: ['re:blocks\\..*\\.mlp\\.proj\\.weight'], start: 2}\n"
                                "  - distill: {teacher: '" + teacher + "', alpha: 0.5, temperature: 2.0, start: 1}",
                                kLossTol);
  const auto parts = [&](const std::string& run) {
    std::map<int64_t, std::pair<double, double>> out;  // step: (ce, kl)
    std::ifstream in(*dir_ / run / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("distill_kl")) out[j["step"].get<int64_t>()] = {j["distill_ce"], j["distill_kl"]};
    }
    return out;
  };
  const auto cpu = parts("distill_cpu_run"), gpu = parts("distill_gpu_run");
  EXPECT_EQ(cpu.size(), 11u) << "steps 2..12 distil";
  ASSERT_EQ(gpu.size(), cpu.size());
  for (const auto& [step, c] : cpu) {
    const auto& g = gpu.at(step);
    EXPECT_NEAR(g.first, c.first, kLossTol * c.first) << "ce at step " << step;
    EXPECT_NEAR(g.second, c.second, 0.1 * c.second) << "kl at step " << step;
    EXPECT_GT(g.second, 0.0);
  }
  expect_resumes("distill", r, kLossTol, true);
}

// SLoPe's lazy adapters on the GPU: every block linear slope from the start, rank-4
// adapters from step 4 (the last part of a short run). The curve follows the CPU run's,
// the log says when the adapters come, the checkpoint at step 6 holds trained adapters
// (values and moments, under the CPU's names) and resumes on the GPU and on the CPU.
TEST_F(GpuTrain, SlopeAdapterRecipeTracksTheCpuAndResumes) {
  if (!esplag::gpu::cusparselt_available()) GTEST_SKIP() << esplag::gpu::cusparselt_unavailable_reason();
  const Runs r = recipe_on_both(
      "slope_lora", "slope: {params: ['re:blocks\\..*\\.(attn|mlp)\\.\\w+\\.weight'], lora_rank: 4, lora_start: 4}",
      kLossTol);
  const auto adapters = std::count_if(r.gpu.log.begin(), r.gpu.log.end(), [](const std::string& l) {
    return l.find("step 4: blocks.0.mlp.fc.weight") != std::string::npos && l.find("adapter r=4") != std::string::npos;
  });
  EXPECT_EQ(adapters, 1) << "the log does not say that the adapters came at step 4";

  auto model = load_model((*dir_ / "slope_lora_gpu_run" / "step-000006").string());
  auto& l = dynamic_cast<SlopeLinear<float>&>(model->linear("blocks.1.mlp.proj.weight"));
  ASSERT_EQ(l.lora_rank(), 4);
  EXPECT_TRUE(std::any_of(l.lora_r().begin(), l.lora_r().end(), [](float x) { return x != 0.f; }))
      << "R was not trained";
  expect_resumes("slope_lora", r, kLossTol, true);
}

// Gradual magnitude pruning on the GPU (VENOM's and sparseml's first phase): the MLP
// linears masked 2:4 from step 2, the mask chosen again on the host from the weights the
// GPU trained every 2 steps until step 8 (the 2:4 ramp's rungs). The curve follows the CPU
// run's; the checkpoint's weights are zero where its masks prune, and it resumes on the
// GPU and on the CPU.
TEST_F(GpuTrain, GradualMagnitudeRecipeTracksTheCpuAndResumes) {
  const Runs r = recipe_on_both("gmp",
                                "gradual_magnitude: {params: ['re:blocks\\..*\\.mlp\\.\\w+\\.weight'], "
                                "mask_type: '2:4', start: 2, end: 8, update_every: 2}",
                                kLossTol);
  auto model = load_model((*dir_ / "gmp_gpu_run" / "step-000006").string());
  for (const char* name : {"blocks.0.mlp.fc.weight", "blocks.1.mlp.proj.weight"}) {
    const auto& l = dynamic_cast<const esplag::MaskedLinear<float>&>(model->linear(name));
    const float* w = model->linear_params(name).weight;
    size_t pruned = 0;
    for (size_t i = 0; i < l.mask().size(); ++i)
      if (!l.mask()[i]) {
        ++pruned;
        ASSERT_EQ(w[i], 0.f) << name << " pruned position " << i;
      }
    EXPECT_GT(pruned, l.mask().size() / 5) << name << ": the ramp has not pruned by step 6";
  }
  expect_resumes("gmp", r, kLossTol, true);
}

// VENOM on the GPU: the MLP's fc layers pruned to 64:2:8 by gradual magnitude pruning
// (steps 1 to 4), then compressed (kind vnm, the mask frozen) from step 5, which the GPU
// trains on the dense products of the masked weight. The curve follows the CPU run's; the
// checkpoint at step 6 holds the CPU's vnm state (kept values and their moments) and
// resumes on the GPU and on the CPU.
TEST_F(GpuTrain, VenomRecipeTracksTheCpuAndResumes) {
  const Runs r = recipe_on_both("venom",
                                "gradual_magnitude: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight'], "
                                "mask_type: '64:2:8', start: 1, end: 4, update_every: 1}\n"
                                "  - kernel_replacement: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight'], start: 5}",
                                kLossTol);
  const auto replaced = std::count_if(r.gpu.log.begin(), r.gpu.log.end(), [](const std::string& l) {
    return l.find("step 5: blocks.0.mlp.fc.weight -> vnm 64:2:8") != std::string::npos;
  });
  EXPECT_EQ(replaced, 1) << "the log does not say that the layers were compressed";
  auto model = load_model((*dir_ / "venom_gpu_run" / "step-000006").string());
  const auto& l = dynamic_cast<const VnmLinear<float>&>(model->linear("blocks.1.mlp.fc.weight"));
  const std::vector<uint8_t> mask = l.mask();
  const float* w = model->linear_params("blocks.1.mlp.fc.weight").weight;
  for (size_t i = 0; i < mask.size(); ++i)
    if (!mask[i]) ASSERT_EQ(w[i], 0.f) << i;
  expect_resumes("venom", r, kLossTol, true);
}

// VENOM in fp8 on the GPU: masked layers during the ramp, then vnm, both on the dense fp8
// products of the masked weight. The curve follows the CPU's emulation (within 3%, as dense
// fp8 does in Fp8TracksTheCpuEmulation), with e5m2 gradients (the 2:4 kinds' cuSPARSELt
// products take e4m3 only; these take both), and the checkpoints resume both ways.
TEST_F(GpuTrain, Fp8VenomRecipeTracksTheCpuEmulationAndResumes) {
  const Runs r = recipe_on_both("venom_fp8",
                                "gradual_magnitude: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight'], "
                                "mask_type: '64:2:8', start: 1, end: 4, update_every: 1}\n"
                                "  - kernel_replacement: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight'], start: 5}",
                                3e-2, {"train.precision=fp8", "train.fp8_grad=e5m2"});
  const RunLog bf16 = train(twelve_steps(*dir_ / "venom_fp8.yaml", "cuda"), *dir_ / "venom_bf16_run");
  EXPECT_FALSE(bit_identical(r.gpu, bf16, 2, 12)) << "the fp8 run logged the bf16 run's losses";
  EXPECT_LT(r.gpu.loss.at(12), 0.9 * r.gpu.loss.at(1));
  expect_resumes("venom_fp8", r, 3e-2, true);
}

// sparse_dw on the GPU: the MLP's fc layers (384 outputs, 2048 tokens: multiples of 64)
// slope with the weight gradient from the MVUE 2:4 of dYᵀ. The run learns like the CPU's
// (its draws differ: the GPU samples the bf16 dY, the CPU the fp32 one), the checkpoint
// holds the GPU's draw count (one per micro-batch), and a resumed run goes on with the
// same draws, on the GPU and on the CPU.
TEST_F(GpuTrain, SparseDwRecipeTrainsAndResumes) {
  if (!esplag::gpu::cusparselt_available()) GTEST_SKIP() << esplag::gpu::cusparselt_unavailable_reason();
  const Runs r =
      recipe_on_both("sparse_dw", "slope: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight'], sparse_dw: true}", 5e-2);
  EXPECT_LT(r.gpu.loss.at(12), 0.8 * r.gpu.loss.at(1)) << "the GPU run with sparse_dw does not learn";

  auto model = load_model((*dir_ / "sparse_dw_gpu_run" / "step-000006").string());
  for (const char* name : {"blocks.0.mlp.fc.weight", "blocks.1.mlp.fc.weight"}) {
    const auto& l = dynamic_cast<const SlopeLinear<float>&>(model->linear(name));
    ASSERT_TRUE(l.sparse_dw()) << name;
    EXPECT_EQ(l.weight_grad().draws(), 6u) << name << ": one draw per micro-batch of the 6 steps";
  }
  expect_resumes("sparse_dw", r, 5e-2, false);
}

// A learning rate of 1e30 diverges at once. Read only at the end (no logging, no
// checkpoints before), the error names the first bad step, not the step that noticed,
// and nothing is saved; with a checkpoint every step, the checkpoints written are finite.
TEST_F(GpuTrain, DivergenceIsReportedAndSavesNothingBad) {
  const fs::path good = *dir_ / "gpu" / "step-000030" / "model.safetensors";
  const std::string saved = read_file(good.string());
  const std::vector<std::string> bad = {"optimizer.lr=1e30", "schedule.warmup_steps=0", "train.steps=20",
                                        "train.log_every=100"};
  std::vector<std::string> quiet_ck = bad;
  quiet_ck.push_back("train.checkpoint_every=0");
  Trainer t(tiny(*data_, "cuda", quiet_ck), (*dir_ / "diverge").string(), [](const std::string&) {});
  try {
    t.run();
    ADD_FAILURE() << "expected divergence";
  } catch (const Error& e) {
    const std::string m = e.what();
    std::printf("  %s\n", m.c_str());
    ASSERT_NE(m.find("training diverged"), std::string::npos) << m;
    const auto at = m.find(" at step ");
    if (m.find(" loss is ") != std::string::npos && at != std::string::npos) {
      const long long step = std::atoll(m.c_str() + at + 9);
      EXPECT_GE(step, 2) << m;  // step 1 was logged with a finite loss
      EXPECT_LT(step, 20) << "the first bad step, not the one that noticed: " << m;
    }
  }
  EXPECT_FALSE(fs::exists(*dir_ / "diverge" / "latest")) << "a diverged run saved a checkpoint";

  std::vector<std::string> every = bad;
  every.push_back("train.checkpoint_every=1");
  Trainer t2(tiny(*data_, "cuda", every), (*dir_ / "diverge_ck").string(), [](const std::string&) {});
  EXPECT_THROW(t2.run(), Error);
  if (fs::exists(*dir_ / "diverge_ck" / "latest")) {
    auto model = load_model(resolve_checkpoint((*dir_ / "diverge_ck").string()));
    for (size_t i = 0; i < model->num_params(); ++i) ASSERT_TRUE(std::isfinite(model->params()[i])) << i;
  }
  EXPECT_EQ(read_file(good.string()), saved);
}

}  // namespace
