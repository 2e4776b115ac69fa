// The memory planner (train/memory_plan.h): the host breakdown and its sum, the settings it
// suggests when a budget is too small, and its report.
#include <gtest/gtest.h>

#include "model/transformer.h"
#include "test_util.h"
#include "train/memory_plan.h"
#ifdef ESPLAG_HAVE_CUDA
#include "train/gpu_step.h"
#endif

using namespace esplag;
using esplag::testing::contains;

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
  settings = settings_that_fit(c, "cpu", {0, (full + selective) / 2});
  ASSERT_TRUE(settings.has_value());
  EXPECT_EQ(*settings, std::vector<std::string>{"train.checkpointing=full"});
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
