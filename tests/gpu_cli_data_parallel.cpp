// Data-parallel training on two GPUs end to end (`esplag train --gpus 2`, NCCL): two ranks
// with grad_accum 1 follow one GPU with grad_accum 2 (the same tokens and mean gradient;
// bf16 products and another order of the fp32 sums), slope and semi_sparse included, with
// ZeRO stages 0, 1, 2 and 3, and the run resumes on one GPU; the sharded stages' gathered checkpoints hold the
// moments stage 0 holds; the gradients averaged in buckets during the backward give the
// bits of one collective after it; stage 2's ring of gradient slots gives stage 1's bits,
// stage 3's sharded parameters stage 2's; delayed fp8 scaling's amax histories are one GPU's.
// Skipped on machines with fewer than two GPUs.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "cli_util.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

fs::path root() { return esplag::testing::scratch_root("gpu_cli_data_parallel"); }

Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }

int gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

fs::path prepared_data() {
  static const fs::path data = [] {
    std::string text;
    for (int i = 0; i < 2000; ++i) text += "And God said, Let there be light: and there was light " + std::to_string(i) + ".\n";
    esplag::testing::write_text(root() / "corpus.txt", text);
    const fs::path d = root() / "data";
    const Result r = run("data prepare --input " + (root() / "corpus.txt").string() + " --out " + d.string() +
                         " --val-fraction 0.1");
    EXPECT_EQ(r.code, 0) << r.err;
    return d;
  }();
  return data;
}

std::vector<double> losses(const fs::path& run_dir) {
  std::vector<double> out;
  std::istringstream in(esplag::read_file((run_dir / "metrics.jsonl").string()));
  for (std::string line; std::getline(in, line);)
    if (const auto j = nlohmann::json::parse(line); j.contains("loss")) out.push_back(j["loss"]);
  return out;
}

// The largest difference between two checkpoints' fp32 tensors of the same names, relative
// to the largest magnitude of each tensor, and the tensor's name; the other tensors (slope's
// masks) are equal. Left out are the tensors AdamW moves by its normalised steps of gradients
// that are mostly rounding, where two runs that sum in another order part by the learning
// rate, by design: the low-rank adapters (their L factor starts where its gradient is zero)
// and the qkv biases (the key bias's gradient is zero in exact arithmetic: a shift of every
// key by one vector does not change any softmax).
std::pair<double, std::string> max_relative_difference(const fs::path& a, const fs::path& b) {
  const auto ta = esplag::load_safetensors(a.string()).tensors, tb = esplag::load_safetensors(b.string()).tensors;
  EXPECT_EQ(ta.size(), tb.size());
  std::pair<double, std::string> worst{0.0, ""};
  for (const auto& [name, x] : ta) {
    if (name.find(".lora_") != std::string::npos || name.find(".attn.qkv.bias") != std::string::npos) continue;
    const auto it = tb.find(name);
    if (it == tb.end()) {
      ADD_FAILURE() << name << " is missing from " << b;
      continue;
    }
    const int64_t n = x.numel();
    if (n != it->second.numel()) {
      ADD_FAILURE() << name << " holds " << n << " values in " << a << " but " << it->second.numel() << " in " << b;
      continue;
    }
    if (x.dtype() != esplag::DType::f32) {
      EXPECT_EQ(std::memcmp(x.raw(), it->second.raw(), x.nbytes()), 0) << name;
      continue;
    }
    const float *p = x.data<float>(), *q = it->second.data<float>();
    double scale = 1e-30, diff = 0;
    for (int64_t i = 0; i < n; ++i) {
      scale = std::max(scale, double(std::abs(p[i])));
      diff = std::max(diff, double(std::abs(p[i] - q[i])));
    }
    worst = std::max(worst, std::pair{diff / scale, name});
  }
  return worst;
}

// The two-block tiny model's config with `recipe`, written as `name`.yaml. The 2:4 products
// everywhere (train.sparse_dispatch: sparse): at these shapes the timed dispatch picks 2:4 or
// dense by a hair, differently from run to run, and the runs are compared to the bit.
fs::path tiny_config(const std::string& name, const std::string& recipe) {
  const fs::path config = root() / (name + ".yaml");
  esplag::testing::write_text(
      config, "model: {preset: tiny, n_layer: 2, d_model: 64, n_head: 4, n_kv_head: 4, d_ff: 256, max_seq_len: 64}\n"
              "data: {path: " + prepared_data().string() + "}\n"
              "train: {device: cuda, batch_size: 8, seq_len: 64, steps: 12, log_every: 1, eval_every: 0,"
              " eval_batches: 2, checkpoint_every: 6, sparse_dispatch: sparse}\n"
              "optimizer: {lr: 1.0e-3}\n" + recipe);
  return config;
}

// Two 12-step runs agree: to the bit (losses and both final checkpoints), or within the
// rounding of other orders of sums (losses within 0.5%, checkpoints within 2% of each
// tensor's largest magnitude).
void expect_runs_agree(const fs::path& a, const fs::path& b, bool bitwise, const std::string& tag) {
  const auto la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), 12u) << tag;
  ASSERT_EQ(lb.size(), la.size()) << tag;
  if (bitwise) EXPECT_EQ(la, lb) << tag;
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(la[i], lb[i], 5e-3 * lb[i]) << tag << ", step " << i + 1;
  for (const char* file : {"optimizer.safetensors", "model.safetensors"}) {
    const auto [difference, tensor] = max_relative_difference(a / "step-000012" / file, b / "step-000012" / file);
    if (bitwise)
      EXPECT_EQ(difference, 0.0) << tag << ": " << file << ", " << tensor;
    else
      EXPECT_LT(difference, 2e-2) << tag << ": " << file << ", " << tensor;
  }
}

// slope on the MLP's layers from step 0, its adapters from step 6 (laying the state out again).
const std::string kSlope =
    "recipe:\n  - slope: {params: ['re:blocks\\.\\d+\\.mlp\\.\\w+\\.weight'], start: 0, lora_rank: 8, lora_start: 6}\n";

void expect_two_ranks_follow_one_gpu(const std::string& name, const std::string& recipe, int zero = 0) {
  const fs::path config = tiny_config(name, recipe);
  const fs::path one = root() / (name + "-one"), two = root() / (name + "-two");
  const Result a = run("train --config " + config.string() + " --out " + one.string() + " --set train.grad_accum=2");
  ASSERT_EQ(a.code, 0) << a.err;
  const Result b = run("train --gpus 2 --config " + config.string() + " --out " + two.string() +
                       " --set parallel.zero=" + std::to_string(zero));
  ASSERT_EQ(b.code, 0) << b.err;
  if (zero >= 1) EXPECT_NE(b.out.find("ZeRO stage " + std::to_string(zero)), std::string::npos) << b.out;
  const auto la = losses(one), lb = losses(two);
  ASSERT_EQ(la.size(), 12u);
  ASSERT_EQ(lb.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(lb[i], la[i], 5e-3 * la[i]) << name << ", step " << i + 1;
  if (zero >= 1) {
    // The gathered moments and the weights are stage 0's (up to the clipping norm's order of
    // sums).
    const fs::path zero0 = root() / (name + "-zero0");
    const Result d = run("train --gpus 2 --config " + config.string() + " --out " + zero0.string());
    ASSERT_EQ(d.code, 0) << d.err;
    for (const char* file : {"optimizer.safetensors", "model.safetensors"}) {
      const auto [difference, tensor] =
          max_relative_difference(two / "step-000012" / file, zero0 / "step-000012" / file);
      EXPECT_LT(difference, 2e-2) << name << ": " << file << ", " << tensor;
    }
  }
  const Result c = run("train --resume " + two.string() + " --steps 14");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_TRUE(fs::exists(two / "step-000014" / "model.safetensors"));
  if (zero == 0) return;
  const Result e = run("train --gpus 2 --resume " + two.string() + " --steps 16");  // its config says its stage
  ASSERT_EQ(e.code, 0) << e.err;
  EXPECT_TRUE(fs::exists(two / "step-000016" / "optimizer.safetensors"));
}

}  // namespace

TEST(GpuDataParallel, TwoGpusFollowOneGpuWithTwiceTheAccumulation) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  expect_two_ranks_follow_one_gpu("dense", "");
}

TEST(GpuDataParallel, SlopeOnTwoGpusFollowsOneGpu) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  expect_two_ranks_follow_one_gpu("slope", kSlope);
}

TEST(GpuDataParallel, ZeroStageOneFollowsOneGpu) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  expect_two_ranks_follow_one_gpu("dense-zero1", "", 1);
}

TEST(GpuDataParallel, ZeroStageOneSlopeFollowsOneGpu) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  expect_two_ranks_follow_one_gpu("slope-zero1", kSlope, 1);
}

TEST(GpuDataParallel, ZeroStageTwoFollowsOneGpu) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  expect_two_ranks_follow_one_gpu("dense-zero2", "", 2);
}

// ZeRO stage 2's ring: the blocks' buckets take turns in two gradient slots, each
// reduce-scattered into the rank's slices as soon as the backward has made it: four blocks
// of a bucket each, and five in buckets of two, two and one (a tiny block's 49,984 elements
// are padded to 50,048 on two ranks, two blocks are not), where the last bucket's padding
// lies in its slot where the first, larger bucket wrote gradients. With one micro-batch per
// step the mean gradients, the norm and the update are stage 1's in the same buckets, to
// the bit, dense and slope with its adapters (which appear at step 6 and lay the state out
// again). With two micro-batches each one's mean adds into the slices (stage 1 averages the
// sum once): the same within the rounding of the other order.
TEST(GpuDataParallel, ZeroStageTwoRingGivesTheBitsOfStageOne) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  struct Case {
    std::string name, recipe, layout;
  };
  const std::string each = " --set model.n_layer=4 --set parallel.bucket_mb=0.01";
  for (const Case& c : {Case{"dense", "", each}, Case{"slope", kSlope, each},
                        Case{"dense-uneven", "", " --set model.n_layer=5 --set parallel.bucket_mb=0.29"}})
    for (const int accum : {1, 2}) {
      const std::string tag = "ring-" + c.name + "-accum" + std::to_string(accum);
      const fs::path config = tiny_config(tag, c.recipe);
      const auto train = [&](int zero) {
        const fs::path out = root() / (tag + "-zero" + std::to_string(zero));
        const Result r = run("train --gpus 2 --config " + config.string() + " --out " + out.string() + c.layout +
                             " --set train.grad_accum=" + std::to_string(accum) + " --set parallel.zero=" +
                             std::to_string(zero));
        EXPECT_EQ(r.code, 0) << r.err;
        return out;
      };
      const fs::path one = train(1), two = train(2);
      expect_runs_agree(two, one, accum == 1, tag);
    }
}

// ZeRO stage 3: the master weights sharded, the blocks' bf16 weights all-gathered into the
// ring's slots ahead of each bucket, in the forward and again in the backward. It moves the
// same numbers as stage 2 (the slices' update, stage 1's bf16 all-gather, the checkpoint
// assembled by a sum of bits in which one rank gives each value and the other zero), so the runs
// are stage 2's to the bit: one block bucket (the slot's only bucket), four (each gathered
// twice but the top two), five in uneven buckets of two, two and one, slope from step 0
// (its per-step preparation from the gathered kept values), with two micro-batches, and
// with full activation checkpointing (the backward's recompute reads the gathered slot).
TEST(GpuDataParallel, ZeroStageThreeGivesTheBitsOfStageTwo) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  struct Case {
    std::string name, recipe, layout;
  };
  const std::string each = " --set model.n_layer=4 --set parallel.bucket_mb=0.01";
  const std::string slope = "recipe:\n  - slope: {params: ['re:blocks\\.\\d+\\.mlp\\.\\w+\\.weight'], start: 0}\n";
  for (const Case& c : {Case{"dense-one-bucket", "", ""}, Case{"dense", "", each}, Case{"slope", slope, each},
                        Case{"dense-uneven", "", " --set model.n_layer=5 --set parallel.bucket_mb=0.29"},
                        Case{"dense-accum2", "", each + " --set train.grad_accum=2"},
                        Case{"dense-recompute", "", each + " --set train.checkpointing=full"}}) {
    const std::string tag = "zero3-" + c.name;
    const fs::path config = tiny_config(tag, c.recipe);
    const auto train = [&](int zero) {
      const fs::path out = root() / (tag + "-zero" + std::to_string(zero));
      const Result r = run("train --gpus 2 --config " + config.string() + " --out " + out.string() + c.layout +
                           " --set parallel.zero=" + std::to_string(zero));
      EXPECT_EQ(r.code, 0) << r.err;
      return out;
    };
    const fs::path two = train(2), three = train(3);
    expect_runs_agree(three, two, true, tag);
  }
}

TEST(GpuDataParallel, ZeroStageThreeFollowsOneGpu) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  expect_two_ranks_follow_one_gpu("dense-zero3", "", 3);
}

// semi_sparse (the MLP's layers pruned to 2:4 from the current weights in every step) at
// every stage: each rank prunes the same gathered weights.
TEST(GpuDataParallel, SemiSparseAtEveryStageFollowsOneGpu) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  const std::string semi = "recipe:\n  - semi_sparse: {params: ['re:blocks\\.\\d+\\.mlp\\.\\w+\\.weight'], start: 0}\n";
  for (const int zero : {0, 1, 2, 3}) expect_two_ranks_follow_one_gpu("semi-zero" + std::to_string(zero), semi, zero);
}

// parallel.bucket_mb: buckets of one block each (the tiny blocks hold about 50K parameters),
// averaged while the backward runs, give the bits of one all-reduce after the backward (two
// ranks: each element's mean is (a + b) / 2 whatever the collective), dense and slope with
// its adapters. At ZeRO stage 1 each bucket is reduce-scattered and every rank owns a slice
// of each: the same means, but the clipping norm sums the squares by other slices, so the
// runs agree to that rounding (the bound of the stage 0 against stage 1 comparison above).
TEST(GpuDataParallel, GradientBucketsMatchOneCollective) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  for (const auto& [name, recipe] : {std::pair<std::string, std::string>{"dense", ""}, {"slope", kSlope}})
    for (const int zero : {0, 1}) {
      const std::string tag = "buckets-" + name + "-zero" + std::to_string(zero);
      const fs::path config = tiny_config(tag, recipe);
      const auto train = [&](const std::string& bucket_mb) {
        const fs::path out = root() / (tag + "-" + bucket_mb);
        const Result r = run("train --gpus 2 --config " + config.string() + " --out " + out.string() +
                             " --set parallel.zero=" + std::to_string(zero) + " --set parallel.bucket_mb=" + bucket_mb);
        EXPECT_EQ(r.code, 0) << r.err;
        return out;
      };
      const fs::path after = train("0"), during = train("0.01");
      expect_runs_agree(during, after, zero == 0, tag);
    }
}

// Delayed fp8 scaling: the ranks' amax histories take the largest amaxes over the ranks
// (NCCL's max), so they are one GPU's with twice the accumulation (whose losses, and so dY,
// are scaled by 1/2): to the bit after the first step (the same weights), then within what
// other orders of sums give through bf16 and the fp8 casts. A rank that kept only its own
// batches' amaxes would differ at once (by 16% on the CPU's tiny model).
TEST(GpuDataParallel, DelayedFp8ScalingFollowsOneGpu) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs";
  const fs::path config = tiny_config("delayed", "");
  const fs::path one = root() / "delayed-one", two = root() / "delayed-two";
  const std::string fp8 =
      " --set train.precision=fp8 --set train.fp8_scaling=delayed --set train.checkpoint_every=1"
      " --set train.keep_checkpoints=0";
  const Result a = run("train --config " + config.string() + " --out " + one.string() + fp8 +
                       " --set train.grad_accum=2");
  ASSERT_EQ(a.code, 0) << a.err;
  const Result b = run("train --gpus 2 --config " + config.string() + " --out " + two.string() + fp8);
  ASSERT_EQ(b.code, 0) << b.err;
  const auto la = losses(one), lb = losses(two);
  ASSERT_EQ(la.size(), 12u);
  ASSERT_EQ(lb.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(lb[i], la[i], 5e-3 * la[i]) << "step " << i + 1;
  EXPECT_EQ(esplag::testing::amax_history_difference(one / "step-000001", two / "step-000001", 2.0f), 0.0);
  EXPECT_LT(esplag::testing::amax_history_difference(one / "step-000006", two / "step-000006", 2.0f), 5e-2);
  const Result c = run("train --gpus 2 --resume " + two.string() + " --steps 14");  // rank 0's histories on both
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_TRUE(fs::exists(two / "step-000014" / "optimizer.safetensors"));
}
