#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <utility>
#include <vector>

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

// ---------------------------------------------------------------------------------------
// Ranges and model shape, checked at load, naming the file or --set, the key, the value and the range

TEST(TrainConfig, NumericKeysAreRangeChecked) {
  const std::pair<const char*, const char*> cases[] = {
      {"model.vocab_size=99999999999", "config key 'model.vocab_size' must be an integer in [0, 2147483647], got 99999999999"},
      {"model.n_layer=4294967297", "config key 'model.n_layer' must be an integer in [1, 2147483647], got 4294967297"},
      {"train.batch_size=0", "config key 'train.batch_size' must be an integer in [1, 2147483647], got 0"},
      {"train.eval_batches=4294967298", "config key 'train.eval_batches' must be an integer in [1, 2147483647], got 4294967298"},
      {"train.steps=-3", "config key 'train.steps' must be an integer in [1, 9223372036854775807], got -3"},
      {"train.seed=-1", "config key 'train.seed' must be an integer in [0, 18446744073709551615], got -1"},
      {"train.keep_checkpoints=2.5", "config key 'train.keep_checkpoints' must be an integer in [0, 2147483647], got '2.5'"},
      {"optimizer.lr=.nan", "config key 'optimizer.lr' must be a number in (0, inf), got .nan"},
      {"optimizer.lr=.inf", "config key 'optimizer.lr' must be a number in (0, inf), got .inf"},
      {"optimizer.beta1=1", "config key 'optimizer.beta1' must be a number in [0, 1), got 1"},
      {"schedule.min_lr_ratio=1.5", "config key 'schedule.min_lr_ratio' must be a number in [0, 1], got 1.5"},
      {"model.norm_eps=0", "config key 'model.norm_eps' must be a number in (0, 0.01], got 0"},
      {"model.norm_eps=0.02", "config key 'model.norm_eps' must be a number in (0, 0.01], got 0.02"},
      {"train.device=gpu", "config key 'train.device' must be auto, cpu or cuda, got 'gpu'"},
      {"parallel.bucket_mb=-1", "config key 'parallel.bucket_mb' must be a number in [0, 1048576], got -1"},
  };
  for (const auto& [set, message] : cases) {
    const std::string err = error_of([&] { parse_train_config("", "run.yaml", {set}); });
    EXPECT_NE(err.find(std::string("--set ") + set + ": " + message), std::string::npos) << err;
  }
  // From the file: the file is named.
  EXPECT_EQ(error_of([] { parse_train_config("train: {batch_size: 99999999999}", "run.yaml"); }),
            "run.yaml: config key 'train.batch_size' must be an integer in [1, 2147483647], got 99999999999");
  // A config built in code is checked against the same ranges.
  TrainConfig c;
  c.eval_batches = -3;
  EXPECT_EQ(error_of([&] { c.validate(); }),
            "config key 'train.eval_batches' must be an integer in [1, 2147483647], got -3");
}

TEST(TrainConfig, GradientBucketsDefaultTo25MiBAndZeroTurnsThemOff) {
  EXPECT_EQ(parse_train_config("", "t").parallel.bucket_mb, 25.0);
  EXPECT_EQ(parse_train_config("parallel: {bucket_mb: 0}", "t").parallel.bucket_mb, 0.0);
  EXPECT_EQ(parse_train_config("", "t", {"parallel.bucket_mb=0.5"}).parallel.bucket_mb, 0.5);
}

TEST(TrainConfig, SparseDispatchMeasuresByDefaultOrPinsThe24Products) {
  EXPECT_EQ(parse_train_config("", "t").sparse_dispatch, "measure");
  EXPECT_EQ(parse_train_config("train: {sparse_dispatch: sparse}", "t").sparse_dispatch, "sparse");
  const std::string e = error_of([] { parse_train_config("", "t", {"train.sparse_dispatch=dense"}); });
  EXPECT_NE(e.find("train.sparse_dispatch"), std::string::npos) << e;
  EXPECT_NE(e.find("measure"), std::string::npos) << e;
}

TEST(TrainConfig, EveryNumericKeyHasARange) {
  // A number beyond every type is refused by every numeric key with the key's range.
  int numeric = 0;
  for (const auto& [key, value] : flatten(TrainConfig{})) {
    if (value.empty() || !(std::isdigit(static_cast<unsigned char>(value[0])) || value[0] == '-')) continue;
    ++numeric;
    const std::string err = error_of([k = key] { parse_train_config("", "run.yaml", {k + "=-1e999999"}); });
    EXPECT_NE(err.find("config key '" + key + "' must be "), std::string::npos) << err;
    EXPECT_TRUE(err.find(" in [") != std::string::npos || err.find(" in (") != std::string::npos) << err;
  }
  EXPECT_EQ(numeric, 32);
}

TEST(TrainConfig, NormEpsHasADefaultAndRoundTrips) {
  EXPECT_DOUBLE_EQ(parse_train_config("model: {preset: llama-tiny}", "t").model.norm_eps, 1e-5);
  const TrainConfig c = parse_train_config("model: {preset: llama-tiny, norm_eps: 1.0e-6}", "t");
  EXPECT_EQ(c.model.norm_eps, 1e-6);
  EXPECT_EQ(parse_train_config(to_yaml(c), "resolved").model.norm_eps, 1e-6);
  EXPECT_EQ(parse_train_config("", "t", {"model.norm_eps=0.01"}).model.norm_eps, 0.01);
}

TEST(TrainConfig, EmptyConfigFileIsAnError) {
  esplag::testing::TempDir dir;
  for (const char* text : {"", "# nothing but a comment\n", "{}\n"}) {
    esplag::testing::write_text(dir.file("empty.yaml"), text);
    EXPECT_EQ(error_of([&] { load_train_config(dir.file("empty.yaml")); }),
              "config file '" + dir.file("empty.yaml") +
                  "' is empty: give at least the data and the model to train (see configs/tiny.yaml and docs/config.md)");
  }
  EXPECT_EQ(error_of([&] { load_train_config(dir.str()); }), "config file '" + dir.str() + "' is a directory");
}

TEST(TrainConfig, WarmupLongerThanTheRunIsAnError) {
  EXPECT_EQ(error_of([] { parse_train_config("train: {steps: 10}\nschedule: {warmup_steps: 11}", "run.yaml"); }),
            "run.yaml: schedule.warmup_steps (11) is larger than train.steps (10): the run would end before the "
            "learning rate is reached");
  EXPECT_NO_THROW(parse_train_config("train: {steps: 10}\nschedule: {warmup_steps: 10}", "run.yaml"));
}

TEST(TrainConfig, ModelShapeIsCheckedAtLoadEvenWithTheDatasetsVocabulary) {
  // vocab_size 0 (from the dataset) used to skip the whole model check.
  const std::pair<const char*, const char*> cases[] = {
      {"model: {d_model: 0}", "run.yaml: config key 'model.d_model' must be an integer in [1, 2147483647], got 0"},
      {"model: {n_head: 0}", "run.yaml: config key 'model.n_head' must be an integer in [1, 2147483647], got 0"},
      {"model: {d_model: 100, n_head: 3, n_kv_head: 3}",
       "run.yaml: model.d_model (100) must be a multiple of model.n_head (3): the head size is d_model / n_head"},
      {"model: {n_head: 4, n_kv_head: 3}", "run.yaml: model.n_head (4) must be a multiple of model.n_kv_head (3)"},
      {"model: {pos: rope, d_model: 12, n_head: 4, n_kv_head: 4}",
       "run.yaml: model.pos rope needs an even head size (model.d_model / model.n_head), got 12 / 4 = 3"},
      {"model: {mlp: swiglu, d_ff: 2000000000}",
       "run.yaml: model.d_ff (2000000000) gives an MLP width of 4000000000, more than 2147483647"},
      {"model: {max_seq_len: 0}", "run.yaml: config key 'model.max_seq_len' must be an integer in [1, 2147483647], got 0"},
  };
  for (const auto& [yaml, message] : cases) EXPECT_EQ(error_of([&] { parse_train_config(yaml, "run.yaml"); }), message);
  TrainConfig c;  // built in code: validate() checks the shape too
  c.model.d_model = 0;
  EXPECT_NE(error_of([&] { c.validate(); }).find("'model.d_model'"), std::string::npos);
}

// ---------------------------------------------------------------------------------------
// The recipe: validated at load against the model and train.steps, its keys settable with --set

namespace {

const char* const kGmpConfig = R"(model: {preset: tiny}
train: {steps: 100}
recipe:
  - gradual_magnitude: {params: ['re:blocks\.\d+\.mlp\.fc\.weight'], final_sparsity: 0.5, start: 10, end: 80, update_every: 10}
  - semi_sparse: {params: [blocks.0.attn.proj.weight], until: 0.5}
)";

}  // namespace

TEST(TrainConfig, RecipeKeysCanBeSet) {
  for (const char* key : {"recipe.0.gradual_magnitude.end", "recipe[0].gradual_magnitude.end"}) {
    const TrainConfig c = parse_train_config(kGmpConfig, "run.yaml", {std::string(key) + "=30"});
    EXPECT_EQ(c.recipe().modifiers()[0].end.steps, 30) << key;
    EXPECT_EQ(c.recipe().modifiers()[0].start.steps, 10) << key;
  }
  const TrainConfig p = parse_train_config(
      kGmpConfig, "run.yaml", {"recipe.1.semi_sparse.params=[blocks.1.attn.proj.weight]", "recipe.1.semi_sparse.until=0.25"});
  EXPECT_EQ(p.recipe().modifiers()[1].params, std::vector<std::string>{"blocks.1.attn.proj.weight"});
  EXPECT_EQ(p.recipe().modifiers()[1].until.text, "0.25");

  auto err = [](const std::string& set) {
    return error_of([&] { parse_train_config(kGmpConfig, "run.yaml", {set}); });
  };
  EXPECT_EQ(err("recipe.0.gradual_magnitude.endd=30"),
            "--set recipe.0.gradual_magnitude.endd=30: unknown key 'endd' of gradual_magnitude (known: params, mask_type, "
            "init_sparsity, final_sparsity, start, end, update_every)");
  EXPECT_EQ(err("recipe.0.slope.start=3"),
            "--set recipe.0.slope.start=3: recipe[0] is a 'gradual_magnitude' modifier, not 'slope'");
  EXPECT_EQ(err("recipe.2.semi_sparse.start=3"),
            "--set recipe.2.semi_sparse.start=3: the config's recipe has 2 modifiers (recipe.0 to recipe.1)");
  EXPECT_EQ(err("recipe.0.end=3"),
            "--set recipe.0.end=3: a recipe key is recipe.<index>.<modifier>.<key>, e.g. recipe.0.gradual_magnitude.end=0.8");
  EXPECT_EQ(error_of([] { parse_train_config("", "run.yaml", {"recipe.0.slope.start=1"}); }),
            "--set recipe.0.slope.start=1: the config's recipe has 0 modifiers");
  // The value is validated like the file's.
  EXPECT_EQ(err("recipe.0.gradual_magnitude.end=soon"),
            "run.yaml: recipe[0] (gradual_magnitude): key 'end' must be a step (an integer) or a fraction of train.steps "
            "(a number with a '.', in [0, 1]), got 'soon'");
}

TEST(TrainConfig, ShorterRunsSayWhyAbsoluteRecipeStepsBreak) {
  EXPECT_EQ(error_of([] { parse_train_config(kGmpConfig, "run.yaml", {"train.steps=50"}); }),
            "run.yaml: recipe[0] (gradual_magnitude): key 'end': step 80 is beyond the end of training (train.steps = "
            "50); a step number does not scale with train.steps: write the recipe's steps as fractions of train.steps "
            "(e.g. 0.8) for a recipe that fits any run length");
  // Written as fractions, the same recipe fits the shorter run.
  const TrainConfig c = parse_train_config(kGmpConfig, "run.yaml",
                                           {"train.steps=50", "recipe.0.gradual_magnitude.start=0.1",
                                            "recipe.0.gradual_magnitude.end=0.8", "recipe.0.gradual_magnitude.update_every=0.1"});
  EXPECT_EQ(c.steps, 50);
}

TEST(TrainConfig, RecipeErrorsAndSummaryNameTheConfigFile) {
  esplag::testing::TempDir dir;
  const std::string path = dir.file("run.yaml");
  esplag::testing::write_text(path, "model: {preset: tiny}\nrecipe:\n  - semi_sparse: {params: [blocks.9.mlp.fc.weight]}\n");
  const std::string err = error_of([&] { load_train_config(path); });
  EXPECT_EQ(err.rfind(path + ": recipe[0] (semi_sparse): key 'params': 'blocks.9.mlp.fc.weight' is not a linear weight", 0),
            0u)
      << err;
  esplag::testing::write_text(path, "model: {preset: tiny}\nrecipe:\n  - semi_sparse: {params: [blocks.0.mlp.fc.weight]}\n");
  const std::string summary = load_train_config(path).recipe().describe();
  EXPECT_EQ(summary.rfind("recipe (" + path + "): 1 modifier\n", 0), 0u) << summary;
}

// Found by fuzzing: a key that is not a plain word escaped as yaml-cpp's "bad conversion".
TEST(TrainConfig, KeysThatAreNotWordsAreAnError) {
  EXPECT_NE(error_of([] { parse_train_config("[a]: b\n", "k.yaml"); }).find("k.yaml: a config section name"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_train_config("train: {[steps]: 4}\n", "k.yaml"); })
                .find("a key of config section 'train' must be a plain word"),
            std::string::npos);
}
