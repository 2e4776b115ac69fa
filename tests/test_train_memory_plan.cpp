// The memory planner (train/memory_plan.h): the host breakdown and its sum, the settings it
// suggests when a budget is too small, its report, and train.memory (fixed and auto).
#include <gtest/gtest.h>

#include <tuple>

#include "model/gradient_buckets.h"
#include "model/transformer.h"
#include "test_util.h"
#include "train/memory_plan.h"
#include "train/stored_layout.h"
#ifdef ESPLAG_HAVE_CUDA
#include "train/gpu_step.h"
#endif

using namespace esplag;
using esplag::testing::contains;
using esplag::testing::error_of;

namespace {

TrainConfig tiny_config(const std::string& device) {
  TrainConfig c = load_train_config(std::string(ESPLAG_SOURCE_DIR) + "/configs/tiny.yaml",
                                    {"train.device=" + device, "model.vocab_size=257"});
  c.validate();
  return c;
}

TrainConfig with_checkpointing(TrainConfig c, CheckpointMode mode) {
  c.checkpointing = {mode, 1};
  return c;
}

// The config the suggested overrides make of `c`.
TrainConfig applied(const TrainConfig& c, const std::vector<std::string>& overrides) {
  return parse_train_config(to_yaml(c), "suggested", overrides);
}

}  // namespace

TEST(MemoryPlan, TheHostBreakdownSumsToHostBytesForTraining) {
  for (const std::string device : {"cpu", "cuda"})
    for (CheckpointMode mode : {CheckpointMode::none, CheckpointMode::selective, CheckpointMode::full}) {
      const TrainConfig c = with_checkpointing(tiny_config("cpu"), mode);
      const HostMemoryPlan p = host_memory_plan(c, device);
      EXPECT_EQ(p.weights + p.gradients + p.moments + p.activations, host_bytes_for_training(c, device));
      const uint64_t params = uint64_t(c.model.num_params());
      EXPECT_EQ(p.weights, params * 4);
      EXPECT_EQ(p.moments, params * 8);
      EXPECT_EQ(p.gradients, device == "cpu" ? params * 4 : 0);
      const uint64_t activations =
          transformer_activation_elements(c.model, c.batch_size, c.seq_len, c.checkpointing) * sizeof(float);
      EXPECT_EQ(p.activations, device == "cpu" ? activations : 0) << to_string(mode);
    }
}

// A recipe's sparse kinds keep state on the host (their CPU layers, which checkpoints are
// written from in a GPU run too): the plan counts each claimed block Linear weight at its
// kind's bytes, the most of the kinds it takes over the run; in a GPU run the bytes of the
// twin, which runs no CPU product (slope: W1 and W2ᵀ's metadata, 2.25 bytes per weight,
// against 8.25 with both compressed copies and their slot indices on the CPU).
TEST(MemoryPlan, TheHostPlanCountsTheSparseKindsState) {
  TrainConfig c = tiny_config("cuda");
  EXPECT_EQ(host_memory_plan(c, "cuda").kinds, 0u);
  uint64_t mlp = 0, all = 0;
  for (const ParamInfo& i : transformer_param_layout(c.model)) {
    const bool linear = i.name.rfind("blocks.", 0) == 0 && i.shape.size() == 2;
    if (linear) all += i.numel;
    if (linear && i.name.find(".mlp.") != std::string::npos) mlp += i.numel;
  }
  ASSERT_GT(mlp, 0u);
  c.recipe_yaml = "- slope: {params: ['re:blocks\\..*\\.mlp\\.\\w+\\.weight']}\n";
  for (const std::string device : {"cpu", "cuda"}) {
    const HostMemoryPlan p = host_memory_plan(c, device);
    EXPECT_EQ(p.kinds, uint64_t((device == "cpu" ? 8.25 : 2.25) * double(mlp))) << device;
    EXPECT_EQ(p.total(), host_bytes_for_training(c, device));
  }
  // semi_sparse's pruned copy is made by a CPU forward: none in a GPU run.
  c.recipe_yaml = "- semi_sparse: {params: ['re:blocks\\..*\\.mlp\\.\\w+\\.weight']}\n";
  EXPECT_EQ(host_memory_plan(c, "cpu").kinds, 4 * mlp);
  EXPECT_EQ(host_memory_plan(c, "cuda").kinds, 0u);
  // Masked, then vnm on the same layers: the larger of the two.
  c.recipe_yaml =
      "- gradual_magnitude: {params: ['re:blocks\\..*\\.(attn|mlp)\\.\\w+\\.weight'], mask_type: '2:4', start: 0.0, "
      "end: 0.5, update_every: 1}\n"
      "- kernel_replacement: {params: ['re:blocks\\..*\\.(attn|mlp)\\.\\w+\\.weight'], start: 0.75}\n";
  EXPECT_EQ(host_memory_plan(c, "cuda").kinds, 4 * all);
  EXPECT_TRUE(contains(describe(c, plan_memory(c, "cpu"), {}), "sparse kinds"));
}

// A GPU run stores a slope weight as its kept values (half its elements) in its weights,
// gradients and moments: the plan counts the largest layout the run holds, so a slope layer
// from step 0 on counts half, one that starts later counts whole, and
// the host's moments and master halves of a GPU run follow (docs/memory.md).
TEST(MemoryPlan, AGpuRunCountsTheLargestStoredLayout) {
  TrainConfig c = tiny_config("cuda");
  c.steps = 100;
  const uint64_t params = uint64_t(c.model.num_params());
  uint64_t mlp = 0;
  for (const ParamInfo& i : transformer_param_layout(c.model))
    if (i.name.rfind("blocks.", 0) == 0 && i.shape.size() == 2 && i.name.find(".mlp.") != std::string::npos)
      mlp += i.numel;
  EXPECT_EQ(largest_stored_layout(c).elements, params);
  const std::string slope = "- slope: {params: ['re:blocks\\..*\\.mlp\\.\\w+\\.weight']";
  c.recipe_yaml = slope + "}\n";
  const StoredLayout from_start = largest_stored_layout(c);
  EXPECT_EQ(from_start.elements, params - mlp / 2);
  EXPECT_EQ(from_start.kept_values.size(), size_t(2 * c.model.n_layer));
  EXPECT_TRUE(from_start.kept_values.count("blocks.0.mlp.fc.weight"));
  c.offload = "optimizer+master";
  EXPECT_EQ(host_memory_plan(c, "cuda").moments, 8 * (params - mlp / 2));
  EXPECT_EQ(host_memory_plan(c, "cuda").master_low, 2 * (params - mlp / 2));
  EXPECT_EQ(gpu_model_state(c, 1).elements, params - mlp / 2);
  EXPECT_TRUE(contains(describe(c, plan_memory(c, "cuda"), {}),
                       std::to_string(2 * c.model.n_layer) + " weights are stored as their kept values"));
  EXPECT_EQ(host_memory_plan(c, "cpu").moments, 8 * params);  // the CPU's optimizer: unchanged
  c.recipe_yaml = slope + ", start: 50}\n";  // dense for the first half
  EXPECT_EQ(largest_stored_layout(c).elements, params);
  EXPECT_TRUE(largest_stored_layout(c).kept_values.empty());
  c.recipe_yaml = "- semi_sparse: {params: ['re:blocks\\..*\\.mlp\\.\\w+\\.weight']}\n";
  EXPECT_EQ(largest_stored_layout(c).elements, params);
  // A recipe naming a weight this model lacks (the planner sizes other presets with it): dense.
  c.recipe_yaml = "- slope: {params: ['blocks.99.mlp.fc.weight']}\n";
  EXPECT_EQ(largest_stored_layout(c).elements, params);
}

TEST(MemoryPlan, AConfigThatFitsNeedsNoChange) {
  const TrainConfig c = tiny_config("cpu");
  const auto settings = settings_that_fit(c, "cpu", {0, host_bytes_for_training(c, "cpu")});
  ASSERT_TRUE(settings.has_value());
  EXPECT_TRUE(settings->empty());
}

TEST(MemoryPlan, AHostLimitSuggestsCheckpointingFirst) {
  const TrainConfig c = tiny_config("cpu");
  const uint64_t none = host_bytes_for_training(c, "cpu");
  const uint64_t selective = host_bytes_for_training(with_checkpointing(c, CheckpointMode::selective), "cpu");
  const uint64_t full = host_bytes_for_training(with_checkpointing(c, CheckpointMode::full), "cpu");
  ASSERT_LT(full, selective);
  ASSERT_LT(selective, none);
  auto settings = settings_that_fit(c, "cpu", {0, selective});
  ASSERT_TRUE(settings.has_value());
  EXPECT_EQ(*settings, std::vector<std::string>{"train.checkpointing=selective"});
  settings = settings_that_fit(c, "cpu", {0, full});
  ASSERT_TRUE(settings.has_value());
  EXPECT_EQ(*settings, std::vector<std::string>{"train.checkpointing=full"});
  // Between full and selective: full in fewer blocks, as few as fit.
  const uint64_t between = (full + selective) / 2;
  settings = settings_that_fit(c, "cpu", {0, between});
  ASSERT_TRUE(settings.has_value());
  const TrainConfig s = applied(c, *settings);
  EXPECT_EQ(s.checkpointing.mode, CheckpointMode::full);
  EXPECT_LE(host_bytes_for_training(s, "cpu"), between);
  TrainConfig fewer = s;
  fewer.checkpointing.every = s.checkpointing.every + 1;
  EXPECT_GT(host_bytes_for_training(fewer, "cpu"), between);
}

TEST(MemoryPlan, BelowFullCheckpointingASmallerBatchKeepsTheSequencesPerStep) {
  const TrainConfig c = tiny_config("cpu");
  TrainConfig one = with_checkpointing(c, CheckpointMode::full);
  one.batch_size = 1;
  const uint64_t budget = host_bytes_for_training(one, "cpu");
  ASSERT_LT(budget, host_bytes_for_training(with_checkpointing(c, CheckpointMode::full), "cpu"));
  const auto settings = settings_that_fit(c, "cpu", {0, budget});
  ASSERT_TRUE(settings.has_value());
  const TrainConfig s = applied(c, *settings);
  EXPECT_LT(s.batch_size, c.batch_size);
  EXPECT_EQ(s.batch_size * s.grad_accum, c.batch_size * c.grad_accum);
  EXPECT_LE(host_bytes_for_training(s, "cpu"), budget);
  EXPECT_TRUE(plan_memory(s, "cpu").fits({0, budget}));
}

TEST(MemoryPlan, NothingFitsWhenTheWeightsDoNot) {
  const TrainConfig c = tiny_config("cpu");
  EXPECT_FALSE(settings_that_fit(c, "cpu", {0, uint64_t(c.model.num_params())}).has_value());
  // On the GPU the host keeps weights and moments only: no setting changes that.
  EXPECT_FALSE(settings_that_fit(c, "cuda", {0, uint64_t(c.model.num_params())}).has_value());
}

TEST(MemoryPlan, TheReportNamesEachCategory) {
  const TrainConfig c = tiny_config("cpu");
  const MemoryBudget budget{0, 1, "", "--host-memory"};
  const std::string text = describe(c, plan_memory(c, "cpu"), budget);
  for (const char* category : {"weights", "gradients", "moments", "activations", "total", "does NOT fit"})
    EXPECT_TRUE(contains(text, category)) << category << " in\n" << text;
#ifdef ESPLAG_HAVE_CUDA
  const MemoryPlan gpu = plan_memory(c, "cuda");
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: " << gpu.no_gpu_plan;
  ASSERT_TRUE(gpu.gpu.has_value());
  const std::string gpu_text = describe(c, gpu, {});
  for (const char* category : {"params", "grads", "optimizer", "scratch", "workspace", "fits: unknown"})
    EXPECT_TRUE(contains(gpu_text, category)) << category << " in\n" << gpu_text;
#else
  EXPECT_FALSE(plan_memory(c, "cuda").gpu.has_value());
  EXPECT_TRUE(contains(describe(c, plan_memory(c, "cuda"), {}), "built without the CUDA backend"));
#endif
}

// --- data parallel and ZeRO ------------------------------------------------------------------

// The GPU's ZeRO stage 1 (GpuModelOptions::shard_optimizer) without gradient buckets: chunks
// of ceil(E/N) rounded up to 64 elements, the moments of one chunk per GPU, the weights and
// gradients padded to N chunks.
TEST(MemoryPlanZero, StageOneKeepsTheMomentsOfOneChunkPerGpu) {
  TrainConfig c = tiny_config("cuda");
  c.parallel.zero = 1;
  c.parallel.bucket_mb = 0;
  const uint64_t e = uint64_t(c.model.num_params());
  ASSERT_EQ(e, 372672u);  // the numbers below are tiny's
  const GpuModelState s = gpu_model_state(c, 4);
  EXPECT_TRUE(s.sharded);
  EXPECT_EQ(s.elements, e);
  EXPECT_EQ(s.chunk, 93184u);  // ceil(372672 / 4) = 93168, rounded up to 64
  EXPECT_EQ(s.padded, 4 * 93184u);
  EXPECT_EQ(s.params, s.padded * 4);  // bf16 weights and the master weights' low halves
  EXPECT_EQ(s.grads, s.padded * 4);
  EXPECT_EQ(s.optimizer, 93184u * 8);
  EXPECT_EQ(s.offloaded, 0u);
  EXPECT_EQ(s.checkpoint_moments, s.padded * 8);
  // A chunk that is a multiple of 64 already pads nothing.
  const GpuModelState three = gpu_model_state(c, 3);
  EXPECT_EQ(three.chunk, e / 3);
  EXPECT_EQ(three.padded, e);
  // Stage 0 over several GPUs, and stage 1 on one, keep the whole state: 16 bytes per element.
  for (const auto& [zero, world] : {std::pair{0, 4}, std::pair{1, 1}}) {
    c.parallel.zero = zero;
    const GpuModelState whole = gpu_model_state(c, world);
    EXPECT_FALSE(whole.sharded);
    EXPECT_EQ(whole.chunk, e);
    EXPECT_EQ(whole.padded, e);
    EXPECT_EQ(whole.total(), 16 * e);
    EXPECT_EQ(whole.checkpoint_moments, 0u);
  }
}

namespace {

// The gradient buckets of `c`'s dense layout (train.parallel.bucket_mb), sharded over `ranks`.
ShardedBuckets sharded_buckets(const TrainConfig& c, int ranks, std::vector<GradientBucket>& buckets) {
  std::vector<ParamInfo> layout = transformer_param_layout(c.model);
  const size_t e = layout.back().offset + layout.back().numel;
  buckets = plan_gradient_buckets(layout, c.model.n_layer, e, size_t(c.parallel.bucket_mb * (1 << 20)) / 4);
  return shard_gradient_buckets(layout, buckets, ranks);
}

}  // namespace

// With gradient buckets, a GPU keeps its slice of every bucket: padded per bucket.
TEST(MemoryPlanZero, StageOneInBucketsKeepsASliceOfEveryBucket) {
  TrainConfig c = tiny_config("cuda");
  c.parallel.zero = 1;
  c.parallel.bucket_mb = 0.01;  // a block or two per bucket
  const GpuModelState s = gpu_model_state(c, 4);
  std::vector<GradientBucket> buckets;
  const ShardedBuckets sharded = sharded_buckets(c, 4, buckets);
  ASSERT_GT(buckets.size(), 2u);
  EXPECT_EQ(s.chunk, sharded.per_rank());
  EXPECT_EQ(s.padded, sharded.padded);
  EXPECT_GT(s.padded, s.elements);
  EXPECT_EQ(s.optimizer, s.chunk * 8);
}

TEST(MemoryPlanZero, TheOffloadMovesTheChunkToPinnedHostMemory) {
  TrainConfig c = tiny_config("cuda");
  c.parallel.zero = 1;
  c.parallel.bucket_mb = 0;  // one bucket: the chunk of the test above
  c.offload = "optimizer";
  GpuModelState s = gpu_model_state(c, 4);
  EXPECT_EQ(s.optimizer, 0u);
  EXPECT_EQ(s.offloaded, 93184u * 8);
  // The host holds each rank's chunk of the moments, and every rank holds its own.
  const MemoryPlan p = plan_memory(c, "cuda", 4, 4);
  EXPECT_EQ(p.host.moments, 93184u * 8);
  EXPECT_EQ(p.host_of_local_ranks(), 4 * p.host.total());
  c.offload = "optimizer+master";
  s = gpu_model_state(c, 4);
  EXPECT_EQ(s.params, s.padded * 2);
  EXPECT_EQ(s.offloaded, 93184u * 8 + s.padded * 2);
}

// ZeRO stage 2 on the GPU (GpuModelOptions::shard_gradients): the blocks' gradients in two
// slots of the largest block bucket, the rest's in buffers of their own, and the mean
// gradient of the GPU's slices; the weights and moments as stage 1's. Without block buckets
// the gradients are stage 1's.
TEST(MemoryPlanZero, StageTwoKeepsTwoSlotsTheRestAndTheMeanGradientOfItsSlices) {
  TrainConfig c = tiny_config("cuda");
  c.model.n_layer = 6;
  c.parallel.zero = 2;
  c.parallel.bucket_mb = 0.01;  // a block or two per bucket
  const GpuModelState s = gpu_model_state(c, 4);
  std::vector<GradientBucket> buckets;
  const ShardedBuckets sharded = sharded_buckets(c, 4, buckets);
  size_t largest = 0, rest = 0, blocks = 0;
  for (const GradientBucket& b : buckets) {
    if (b.after_block >= 0) largest = std::max(largest, b.end - b.begin), ++blocks;
    else rest += b.end - b.begin;
  }
  ASSERT_GT(blocks, 2u);
  EXPECT_EQ(s.slots, 2);
  EXPECT_EQ(s.slot_elements, largest);
  EXPECT_EQ(s.chunk, sharded.per_rank());
  EXPECT_EQ(s.gradient_elements, 2 * largest + rest + s.chunk);
  EXPECT_EQ(s.grads, s.gradient_elements * 4);
  EXPECT_LT(s.grads, s.padded * 4);
  c.parallel.zero = 1;
  const GpuModelState one = gpu_model_state(c, 4);
  EXPECT_EQ(one.params, s.params);
  EXPECT_EQ(one.optimizer, s.optimizer);
  EXPECT_EQ(one.grads, one.padded * 4);
  c.parallel.zero = 2;
  c.parallel.bucket_mb = 0;
  const GpuModelState whole = gpu_model_state(c, 4);
  EXPECT_EQ(whole.slots, 0);
  EXPECT_EQ(whole.grads, whole.padded * 4);
  const std::string text = describe(c, plan_memory(c, "cuda", 4), {});
  EXPECT_TRUE(contains(text, "(without gradient buckets, stage 2 keeps the whole gradients, as stage 1)")) << text;
  c.parallel.bucket_mb = 0.01;
  const std::string ring = describe(c, plan_memory(c, "cuda", 4), {});
  EXPECT_TRUE(contains(ring, "per GPU of 4, ZeRO stage 2: each GPU keeps the AdamW moments and the mean gradient of " +
                                 std::to_string(s.chunk) + " of the")) << ring;
  EXPECT_TRUE(contains(ring, "the backward writes the blocks' gradients into 2 slots of " +
                                 std::to_string(largest) + " elements")) << ring;
}

TEST(MemoryPlanZero, StageThreeKeepsTheMasterOfItsSlicesAndTheBlocksWeightsInTheSlots) {
  TrainConfig c = tiny_config("cuda");
  c.model.n_layer = 6;
  c.parallel.zero = 3;
  c.parallel.bucket_mb = 0.01;
  const GpuModelState s = gpu_model_state(c, 4);
  c.parallel.zero = 2;
  const GpuModelState two = gpu_model_state(c, 4);
  ASSERT_EQ(s.slots, 2);
  EXPECT_TRUE(s.sharded_params);
  EXPECT_FALSE(two.sharded_params);
  // The bf16 weights where stage 2 keeps the gradients (but the chunk's mean), and both master halves of the chunk.
  EXPECT_EQ(s.weight_elements, two.gradient_elements - two.chunk);
  EXPECT_EQ(s.params, (s.weight_elements + s.chunk) * 2 + s.chunk * 2);
  EXPECT_EQ(s.grads, two.grads);
  EXPECT_EQ(s.optimizer, two.optimizer);
  EXPECT_LT(s.params, two.params);
  c.offload = "optimizer+master";
  c.parallel.zero = 3;
  const GpuModelState off = gpu_model_state(c, 4);
  EXPECT_EQ(off.params, (off.weight_elements + off.chunk) * 2);
  EXPECT_EQ(off.offloaded, off.chunk * 2 + off.chunk * 8);
  const MemoryPlan pinned = plan_memory(c, "cuda", 4);  // the host pins the chunk's halves and moments only
  EXPECT_EQ(pinned.host.master_low, off.chunk * 2);
  EXPECT_EQ(pinned.host.moments, off.chunk * 8);
  // Without gradient buckets, stage 2's memory.
  c.offload = "none";
  c.parallel.bucket_mb = 0;
  const GpuModelState whole = gpu_model_state(c, 4);
  EXPECT_FALSE(whole.sharded_params);
  EXPECT_EQ(whole.params, whole.padded * 4);
  c.parallel.bucket_mb = 0.01;
  const std::string text = describe(c, plan_memory(c, "cuda", 4), {});
  EXPECT_TRUE(contains(text, "per GPU of 4, ZeRO stage 3: each GPU keeps the master weights, the AdamW moments and "
                             "the mean gradient of " + std::to_string(s.chunk))) << text;
  EXPECT_TRUE(contains(text, "the blocks' bf16 weights are gathered, and their gradients written, into 2 slots of "))
      << text;
}

TEST(MemoryPlanZero, NoRanksIsAnError) {
  TrainConfig c = tiny_config("cuda");
  EXPECT_TRUE(contains(error_of([&] { plan_memory(c, "cuda", 0); }), "the world size must be at least 1, got 0"));
}

// On the CPU (ZeroCpuOptimizer) a rank keeps the moments of its range of the partition, the
// largest ceil(E/N); stage 2 also a buffer of that range's mean gradient.
TEST(MemoryPlanZero, OnTheCpuEachRankKeepsTheMomentsOfItsRange) {
  TrainConfig c = tiny_config("cpu");
  const HostMemoryPlan whole = plan_memory(c, "cpu", 4).host;  // stage 0
  EXPECT_EQ(whole.moments, host_memory_plan(c, "cpu").moments);
  c.parallel.zero = 1;
  HostMemoryPlan p = plan_memory(c, "cpu", 4).host;
  EXPECT_EQ(p.moments, 93168u * 8);
  EXPECT_EQ(p.gradients, whole.gradients);
  c.parallel.zero = 2;
  p = plan_memory(c, "cpu", 4).host;
  EXPECT_EQ(p.moments, 93168u * 8);
  EXPECT_EQ(p.gradients, whole.gradients + 93168u * 4);
  EXPECT_EQ(plan_memory(c, "cpu", 1).host.moments, whole.moments);  // one rank shares nothing
}

TEST(MemoryPlanZero, TheReportSaysWhoseNumbersTheyAre) {
  TrainConfig c = tiny_config("cuda");
  c.parallel.zero = 1;
  c.parallel.bucket_mb = 0;  // one bucket
  const std::string text = describe(c, plan_memory(c, "cuda", 4), {});
  for (const char* line : {"per GPU of 4, ZeRO stage 1: each GPU keeps the AdamW moments of 93184 of the 372672 "
                           "stored elements (1/4 of every gradient bucket",
                           "the weights and gradients padded to 372736",
                           "a checkpoint gathers the whole moments into 2.8 MiB of pinned host memory on rank 0"})
    EXPECT_TRUE(contains(text, line)) << line << " in\n" << text;
  EXPECT_TRUE(contains(describe(c, plan_memory(c, "cuda", 1), {}),
                       "per GPU of 1, ZeRO stage 1: one GPU keeps the whole state (sharding needs several ranks)"));
  c.parallel.zero = 0;
  const std::string stage0 = describe(c, plan_memory(c, "cuda", 2), {});
  EXPECT_TRUE(contains(stage0, "per GPU of 2, ZeRO stage 0: every GPU keeps the whole state")) << stage0;
  EXPECT_FALSE(contains(stage0, "a checkpoint gathers")) << stage0;
  c.parallel.zero = 2;
  EXPECT_TRUE(contains(describe(c, plan_memory(c, "cpu", 4), {}),
                       "per rank of 4, ZeRO stage 2: each rank keeps the AdamW moments and the mean gradient of at "
                       "most 93168 of the 372672 trained elements"));
#ifndef ESPLAG_HAVE_CUDA
  // Without a GPU plan, the model state by category.
  c.parallel.zero = 1;
  const std::string cpu_build = describe(c, plan_memory(c, "cuda", 4), {});
  for (const char* line : {"built without the CUDA backend (the cuda preset); the model state:\n", "  params ",
                           "  grads ", "  optimizer ", "  model state "})
    EXPECT_TRUE(contains(cpu_build, line)) << line << " in\n" << cpu_build;
#endif
}

// --- train.memory --------------------------------------------------------------------------

namespace {

constexpr uint64_t kGiB = uint64_t(1) << 30;

// A stand-in for the GPU plan: 40 GiB of state (24 with the optimizer offloaded, 20 with
// the master too), and per block and sequence 10 GiB of activations without checkpointing, 6
// with selective and 1 with full.
MemoryPlan fake_gpu_plan(const TrainConfig& c) {
  MemoryPlan p;
  p.device = "cuda";
  GpuMemoryBytes g;
  g.params = (c.offload == "optimizer+master" ? 20 : 24) * kGiB;
  g.optimizer = (c.offload == "none" ? 16 : 0) * kGiB;
  for (int l = 0; l < c.model.n_layer; ++l) {
    const CheckpointMode mode = c.checkpointing.checkpoints(l) ? c.checkpointing.mode : CheckpointMode::none;
    const uint64_t per_sequence = mode == CheckpointMode::none ? 10 : mode == CheckpointMode::selective ? 6 : 1;
    g.activations += uint64_t(c.batch_size) * per_sequence * kGiB;
  }
  p.gpu = g;
  return p;
}

// tiny with 4 blocks and micro-batches of 1: none 80 GiB, selective 64, full every 4 (block 0)
// 71, every 3 (blocks 0 and 3) 62, every block 44.
TrainConfig four_blocks(const std::string& memory) {
  TrainConfig c = tiny_config("cuda");
  c.model.n_layer = 4;
  c.batch_size = 1;
  c.memory = memory;
  return c;
}

MemoryBudget gpu_budget(uint64_t gib) { return {gib * kGiB, 0, "free on CUDA device 0", "available now"}; }

}  // namespace

TEST(MemoryAuto, TheChoicesGoFromNoneToFullInEveryBlock) {
  ModelConfig m = tiny_config("cpu").model;
  m.n_layer = 12;
  std::vector<std::string> texts;
  for (const ActivationCheckpointing& c : checkpointing_choices(m))
    texts.push_back(to_string(c.mode) + "/" + std::to_string(c.every));
  // One K per number of checkpointed blocks (1, 2, 3, 4, 6, 12).
  EXPECT_EQ(texts, (std::vector<std::string>{"none/1", "selective/1", "full/12", "full/11", "full/5", "full/3",
                                             "full/2", "full/1"}));
  m.n_layer = 1;
  EXPECT_EQ(checkpointing_choices(m).size(), 3u);
}

TEST(MemoryAuto, ChoosesTheFirstSettingThatFits) {
  const std::vector<std::tuple<uint64_t, CheckpointMode, int>> cases = {
      {100, CheckpointMode::none, 1},      {80, CheckpointMode::none, 1},  {79, CheckpointMode::selective, 1},
      {71, CheckpointMode::selective, 1},  {63, CheckpointMode::full, 3},  {62, CheckpointMode::full, 3},
      {61, CheckpointMode::full, 1},       {44, CheckpointMode::full, 1}};
  for (const auto& [gib, mode, every] : cases) {
    TrainConfig c = four_blocks("auto");
    c.checkpointing = {CheckpointMode::selective, 2};  // what was written: auto replaces it
    apply_train_memory(c, gpu_budget(gib), fake_gpu_plan);
    EXPECT_EQ(c.checkpointing.mode, mode) << gib << " GiB";
    if (mode != CheckpointMode::none) EXPECT_EQ(c.checkpointing.every, every) << gib << " GiB";
    EXPECT_EQ(c.memory, "auto");
  }
  // No budget (the memory at hand unknown): nothing to save.
  TrainConfig c = four_blocks("auto");
  c.checkpointing = {CheckpointMode::full, 1};
  EXPECT_EQ(apply_train_memory(c, {}, fake_gpu_plan),
            "memory auto: train.checkpointing=none (it needs 80.0 GiB of GPU memory, the memory at hand unknown)");
  EXPECT_EQ(c.checkpointing.mode, CheckpointMode::none);
}

TEST(MemoryAuto, TheLineSaysWhatItChoseAndWhy) {
  TrainConfig c = four_blocks("auto");
  EXPECT_EQ(apply_train_memory(c, gpu_budget(63), fake_gpu_plan),
            "memory auto: train.checkpointing=full every 3 (none needs 80.0 GiB of GPU memory, 63.0 GiB free on CUDA "
            "device 0; full every 3 needs 62.0 GiB)");
  c = four_blocks("auto");
  EXPECT_EQ(apply_train_memory(c, gpu_budget(50), fake_gpu_plan),
            "memory auto: train.checkpointing=full (none needs 80.0 GiB of GPU memory, 50.0 GiB free on CUDA device 0; "
            "full needs 44.0 GiB)");
  c = four_blocks("auto");
  EXPECT_EQ(apply_train_memory(c, gpu_budget(90), fake_gpu_plan),
            "memory auto: train.checkpointing=none (it needs 80.0 GiB of GPU memory, 90.0 GiB free on CUDA device 0)");
}

// Offloading the optimizer comes after every checkpointing choice (it costs PCIe traffic in
// every step), the master after the moments; fixed runs name it among the settings that fit.
TEST(MemoryAuto, TheOptimizerOffloadComesAfterEveryCheckpointingChoice) {
  TrainConfig c = four_blocks("auto");
  EXPECT_EQ(apply_train_memory(c, gpu_budget(43), fake_gpu_plan),
            "memory auto: train.checkpointing=full (none needs 80.0 GiB of GPU memory, 43.0 GiB free on CUDA device 0; "
            "full needs 28.0 GiB); train.offload=optimizer (the checkpointing alone does not fit)");
  EXPECT_EQ(c.offload, "optimizer");
  EXPECT_EQ(c.checkpointing.mode, CheckpointMode::full);
  c = four_blocks("auto");
  apply_train_memory(c, gpu_budget(26), fake_gpu_plan);
  EXPECT_EQ(c.offload, "optimizer+master");
  c = four_blocks("auto");
  apply_train_memory(c, gpu_budget(63), fake_gpu_plan);
  EXPECT_EQ(c.offload, "none") << "checkpointing alone fits";
  TrainConfig fixed = four_blocks("fixed");
  const std::string e = error_of([&] { apply_train_memory(fixed, gpu_budget(43), fake_gpu_plan); });
  EXPECT_TRUE(contains(e, "train.offload=optimizer")) << e;
  // A CPU run never offloads (there is nowhere to offload to).
  const TrainConfig cpu = tiny_config("cpu");
  const auto settings = settings_that_fit(cpu, "cpu", {0, host_bytes_for_training(cpu, "cpu") - 1});
  ASSERT_TRUE(settings.has_value());
  for (const std::string& o : *settings) EXPECT_FALSE(contains(o, "offload")) << o;
}

TEST(MemoryAuto, TheChoiceIsWhatTheSavedConfigSays) {
  TrainConfig c = four_blocks("auto");
  apply_train_memory(c, gpu_budget(63), fake_gpu_plan);
  const std::string yaml = to_yaml(c);
  EXPECT_TRUE(contains(yaml, "memory: auto")) << yaml;
  EXPECT_TRUE(contains(yaml, "checkpointing: full")) << yaml;
  EXPECT_TRUE(contains(yaml, "checkpointing_every: 3")) << yaml;
  const TrainConfig back = parse_train_config(yaml, "saved");
  EXPECT_EQ(back.memory, "auto");
  EXPECT_EQ(back.checkpointing.mode, CheckpointMode::full);
  EXPECT_EQ(back.checkpointing.every, 3);
  EXPECT_EQ(parse_train_config(to_yaml(four_blocks("fixed")), "saved").memory, "fixed");
}

TEST(MemoryAuto, NothingFitsIsOneErrorWithThePlanAndWhatWouldFit) {
  TrainConfig c = four_blocks("auto");
  std::string e = error_of([&] { apply_train_memory(c, gpu_budget(19), fake_gpu_plan); });
  EXPECT_TRUE(contains(e, "train.memory auto: the run does not fit, not even with train.checkpointing full in every "
                          "block and train.offload optimizer+master: it needs 24.0 GiB of GPU memory, 19.0 GiB free on "
                          "CUDA device 0\n")) << e;
  EXPECT_TRUE(contains(e, "train.checkpointing full every 1, on cuda\n")) << e;  // the plan of full, by category
  EXPECT_TRUE(contains(e, "activations")) << e;
  EXPECT_TRUE(contains(e, "does NOT fit in 19.0 GiB (free on CUDA device 0)")) << e;
  EXPECT_TRUE(contains(e, "nothing smaller fits either: the run needs a smaller model")) << e;
  // With micro-batches of 4 (full, offloaded: 36 GiB), 2 sequences (28 GiB) fit.
  c = four_blocks("auto");
  c.batch_size = 4;
  e = error_of([&] { apply_train_memory(c, gpu_budget(30), fake_gpu_plan); });
  EXPECT_TRUE(contains(e, "a smaller micro-batch fits (the same sequences per step): --set train.batch_size=2 --set "
                          "train.grad_accum=2")) << e;
}

TEST(MemoryFixed, KeepsTheSettingsAndRefusesAGpuPlanThatDoesNotFit) {
  TrainConfig c = four_blocks("fixed");
  c.checkpointing = {CheckpointMode::selective, 2};
  EXPECT_EQ(apply_train_memory(c, gpu_budget(100), fake_gpu_plan), "");
  EXPECT_EQ(c.checkpointing.mode, CheckpointMode::selective);
  EXPECT_EQ(c.checkpointing.every, 2);
  c.checkpointing = {};
  const std::string e = error_of([&] { apply_train_memory(c, gpu_budget(63), fake_gpu_plan); });
  EXPECT_TRUE(contains(e, "the run does not fit: it needs 80.0 GiB of GPU memory, 63.0 GiB free on CUDA device 0 "
                          "(train.memory fixed: the settings as written)\n")) << e;
  EXPECT_TRUE(contains(e, "does NOT fit in 63.0 GiB (free on CUDA device 0)")) << e;
  EXPECT_TRUE(contains(e, "cheapest settings that fit: --set train.checkpointing=full --set "
                          "train.checkpointing_every=3 (train.memory auto chooses")) << e;
  EXPECT_EQ(c.checkpointing.mode, CheckpointMode::none);
  // The host is check_host_memory's (its message names the largest batch that fits).
  TrainConfig cpu = tiny_config("cpu");
  const auto cpu_plan = [](const TrainConfig& t) { return plan_memory(t, "cpu"); };
  EXPECT_EQ(apply_train_memory(cpu, {0, 1, "", "available now"}, cpu_plan), "");
}

TEST(MemoryAuto, OnTheCpuTheHostPlanChooses) {
  TrainConfig c = tiny_config("cpu");
  c.memory = "auto";
  const uint64_t selective = host_bytes_for_training(with_checkpointing(c, CheckpointMode::selective), "cpu");
  const auto cpu_plan = [](const TrainConfig& t) { return plan_memory(t, "cpu"); };
  const std::string line = apply_train_memory(c, {0, selective, "", "available now"}, cpu_plan);
  EXPECT_EQ(c.checkpointing.mode, CheckpointMode::selective);
  EXPECT_TRUE(contains(line, "memory auto: train.checkpointing=selective (none needs ")) << line;
  EXPECT_TRUE(contains(line, " of host memory, ")) << line;
  // The same choice as the planner's for the config without checkpointing.
  TrainConfig fixed = tiny_config("cpu");
  EXPECT_EQ(settings_that_fit(fixed, "cpu", {0, selective}), std::vector<std::string>{"train.checkpointing=selective"});
}

TEST(MemoryAuto, TheKeyTakesFixedOrAutoOnly) {
  EXPECT_EQ(tiny_config("cpu").memory, "fixed");
  const std::string file = std::string(ESPLAG_SOURCE_DIR) + "/configs/tiny.yaml";
  EXPECT_EQ(load_train_config(file, {"train.memory=auto"}).memory, "auto");
  EXPECT_EQ(error_of([&] { load_train_config(file, {"train.memory=sometimes"}); }),
            "--set train.memory=sometimes: config key 'train.memory' must be fixed or auto, got 'sometimes'");
  EXPECT_EQ(error_of([] { parse_train_config("train: {memory: sometimes}", "run.yaml"); }),
            "run.yaml: config key 'train.memory' must be fixed or auto, got 'sometimes'");
}

#ifdef ESPLAG_HAVE_CUDA
TEST(MemoryPlan, AGpuLimitSuggestsFullCheckpointingOrASmallerBatch) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  TrainConfig c = tiny_config("cuda");
  const uint64_t none = plan_memory(c, "cuda").gpu->total();
  const uint64_t full = plan_memory(with_checkpointing(c, CheckpointMode::full), "cuda").gpu->total();
  ASSERT_LT(full, none);
  const auto settings = settings_that_fit(c, "cuda", {full, 0});
  ASSERT_TRUE(settings.has_value());
  EXPECT_LE(plan_memory(applied(c, *settings), "cuda").gpu->total(), full);
  EXPECT_FALSE(settings_that_fit(c, "cuda", {1, 0}).has_value());
}
#endif
