#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "train/config.h"
#include "train/schedule.h"
#include "test_util.h"

using namespace esplag;
using esplag::testing::error_of;

TEST(TrainConfig, PresetThenOverridesThenSet) {
  const TrainConfig c = parse_train_config(R"(
model:
  preset: llama-1b
  n_layer: 2
train:
  batch_size: 4
optimizer:
  lr: 1.0e-4
)",
                                           "test.yaml", {"train.steps=7", "model.d_ff=128"});
  EXPECT_EQ(c.model.d_model, 2048);
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_EQ(c.model.d_ff, 128);
  EXPECT_EQ(c.model.norm, NormKind::rmsnorm);
  EXPECT_EQ(c.batch_size, 4);
  EXPECT_EQ(c.steps, 7);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-4);
  EXPECT_DOUBLE_EQ(c.schedule.lr, 1e-4);
  EXPECT_EQ(c.schedule.total_steps, 7);
}

TEST(TrainConfig, ResolvedYamlRoundTrips) {
  const TrainConfig c = parse_train_config("model: {preset: tiny, vocab_size: 300}\nschedule: {decay: linear}\n", "t",
                                           {"optimizer.beta2=0.99"});
  const TrainConfig d = parse_train_config(to_yaml(c), "resolved");
  EXPECT_EQ(flatten(c), flatten(d));
  EXPECT_EQ(d.schedule.decay, DecayKind::linear);
  EXPECT_DOUBLE_EQ(d.optimizer.beta2, 0.99);
}

TEST(TrainConfig, ErrorsNameTheKey) {
  EXPECT_NE(error_of([] { parse_train_config("train: {batchsize: 4}", "x.yaml"); }).find("unknown config key 'train.batchsize'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_train_config("trian: {steps: 4}", "x.yaml"); }).find("'trian.steps'"), std::string::npos);
  EXPECT_NE(error_of([] { parse_train_config("train: {steps: many}", "x.yaml"); }).find("'train.steps' must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_train_config("", "x", {"optimizer.lrr=1"}); }).find("unknown config key 'optimizer.lrr'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_train_config("", "x", {"nonsense"}); }).find("key=value"), std::string::npos);
  EXPECT_NE(error_of([] { parse_train_config("model: {norm: batchnorm}", "x"); }).find("layernorm or rmsnorm"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_train_config("model: {preset: gpt9}", "x"); }).find("unknown model preset 'gpt9'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_train_config("train: {seq_len: 4096}", "x"); }).find("max_seq_len"), std::string::npos);
  EXPECT_NE(error_of([] { parse_train_config("train: [1, 2", "x.yaml"); }).find("invalid YAML"), std::string::npos);
  EXPECT_NE(error_of([] { load_train_config("/nonexistent/config.yaml"); }).find("cannot read config file"),
            std::string::npos);
}

TEST(Schedule, WarmupCosineLinearConstant) {
  LrSchedule s;
  s.lr = 1.0;
  s.warmup_steps = 10;
  s.total_steps = 110;
  s.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(109), 0.1, 1e-12);
  // Halfway through the decay the cosine is at the midpoint of lr and min_lr.
  const int64_t mid = 10 + (109 - 10) / 2;
  EXPECT_NEAR(s.at(mid), 0.55, 0.02);
  s.decay = DecayKind::linear;
  EXPECT_NEAR(s.at(10 + 99 / 3), 1.0 - 0.9 * (33.0 / 99.0), 1e-12);
  s.decay = DecayKind::constant;
  EXPECT_DOUBLE_EQ(s.at(100), 1.0);
  EXPECT_THROW(decay_kind_from("exp"), Error);
}

TEST(TrainConfig, RecipeListIsKeptAndRoundTrips) {
  const TrainConfig c = parse_train_config(R"(
model: {preset: tiny}
recipe:
  - slope: {params: ["re:blocks\\..*\\.mlp\\..*"], mask_change_freq: 50}
)",
                                           "r.yaml");
  ASSERT_FALSE(c.recipe_yaml.empty());
  EXPECT_NE(c.recipe_yaml.find("mask_change_freq"), std::string::npos);
  const TrainConfig d = parse_train_config(to_yaml(c), "resolved");
  EXPECT_EQ(d.recipe_yaml, c.recipe_yaml);
  EXPECT_NE(error_of([] { parse_train_config("recipe: {slope: 1}", "r.yaml"); }).find("list of modifiers"),
            std::string::npos);
}
