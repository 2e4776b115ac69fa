#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "core/error.h"
#include "model/transformer.h"
#include "train/config.h"
#include "train/layer_kinds.h"
#include "train/recipe.h"
#include "train/trainer.h"
#include "test_util.h"

using namespace esplag;
using esplag::testing::error_of;

namespace {

#define EXPECT_ERROR(stmt, text)                                             \
  do {                                                                       \
    const std::string err_ = error_of([&] { stmt; });                        \
    EXPECT_NE(err_.find(text), std::string::npos) << "error was: " << err_; \
  } while (0)

// A GPT-2-style model with 2 layers, d_model 64, d_ff 256 (qkv = 3·64).
LinearShapes small_shapes() {
  LinearShapes s;
  for (int l = 0; l < 2; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    s[b + "attn.qkv.weight"] = {192, 64};
    s[b + "attn.proj.weight"] = {64, 64};
    s[b + "mlp.fc.weight"] = {256, 64};
    s[b + "mlp.proj.weight"] = {64, 256};
  }
  return s;
}

Recipe make(const std::string& yaml, int64_t total = 200, const LinearShapes& shapes = small_shapes()) {
  Recipe r = Recipe::parse(yaml, "r.yaml");
  r.validate(shapes, total);
  return r;
}

// The GMP plan of one weight at every step in [0, total): the pattern text per step.
std::vector<std::string> patterns(const Recipe& r, const std::string& name, int64_t total) {
  std::vector<std::string> out;
  for (int64_t s = 0; s < total; ++s) out.push_back(r.plan_at(s).at(name).pattern.to_string());
  return out;
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

const std::string kFc0 = "blocks.0.mlp.fc.weight";

}  // namespace

// ---------------------------------------------------------------------------------------
// The GPU configs (configs/gpu): their models are too large to build here, so the block
// linears' shapes come from the config (linear_shapes(ModelConfig), checked against a
// model's below).

TEST(Recipe, GpuConfigsParseAndTheirRecipesValidate) {
  const std::filesystem::path dir = std::filesystem::path(ESPLAG_SOURCE_DIR) / "configs" / "gpu";
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    SCOPED_TRACE(entry.path().string());
    ++files;
    const TrainConfig c = load_train_config(entry.path().string());
    EXPECT_EQ(c.device, "cuda");
    EXPECT_EQ(gpu_training_blocker(c), "") << "the config would not run on the GPU";
    if (c.recipe_yaml.empty()) continue;
    const LinearShapes shapes = linear_shapes(c.model);
    Recipe r = Recipe::parse(c.recipe_yaml, entry.path().string());
    r.validate(shapes, c.steps);
    for (int64_t step : {int64_t(0), c.steps - 1}) {
      const auto plan = r.plan_at(step);
      EXPECT_EQ(plan.size(), shapes.size()) << "step " << step;
      for (const auto& [name, p] : plan) EXPECT_TRUE(gpu_trains_kind(p.kind)) << name << ": " << p.kind;
    }
  }
  EXPECT_GE(files, 3);
}

// ---------------------------------------------------------------------------------------
// The shipped recipes, validated against the real model their config builds.

TEST(Recipe, ShippedRecipesValidateAgainstTheirModels) {
  const std::filesystem::path dir = std::filesystem::path(ESPLAG_SOURCE_DIR) / "configs" / "recipes";
  const std::set<std::string> expected = {"gmp-unstructured.yaml", "gmp-2to4.yaml",          "venom-64-2-8.yaml",
                                          "semi-sparse.yaml",      "semi-sparse-activation.yaml", "slope.yaml",
                                          "slope-sparse-dw.yaml"};
  std::set<std::string> seen;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    SCOPED_TRACE(file);
    ASSERT_TRUE(expected.count(file)) << "a recipe this test does not know: " << file;
    seen.insert(file);
    TrainConfig c = load_train_config(entry.path().string());
    ASSERT_FALSE(c.recipe_yaml.empty());
    if (c.model.vocab_size == 0) c.model.vocab_size = 257;  // the byte tokenizer's vocabulary
    const Transformer<float> model(c.model);
    LinearShapes shapes;
    for (const auto& n : model.linear_names()) {
      const Shape& sh = model.param_info(n).shape;
      shapes[n] = {static_cast<int>(sh[0]), static_cast<int>(sh[1])};
    }
    Recipe r = Recipe::parse(c.recipe_yaml, entry.path().string());
    r.validate(shapes, c.steps);
    const int64_t last = c.steps - 1;
    const auto end_plan = r.plan_at(last);

    if (file == "gmp-unstructured.yaml") {
      EXPECT_EQ(end_plan.size(), shapes.size());
      for (const auto& [n, p] : end_plan) {
        EXPECT_EQ(p.kind, "masked");
        EXPECT_EQ(p.pattern, SparsityPattern::unstructured(0.8));
      }
      EXPECT_EQ(r.plan_at(59).at(kFc0).kind, "dense");
      EXPECT_NEAR(r.plan_at(60).at(kFc0).sparsity, 0.05, 1e-12);
    } else if (file == "gmp-2to4.yaml") {
      EXPECT_EQ(end_plan.size(), shapes.size());
      for (const auto& [n, p] : end_plan) EXPECT_EQ(p.pattern, SparsityPattern::nm(2, 4));
      EXPECT_NE(r.describe().find("masks dense -> 3:4 -> 2:4"), std::string::npos) << r.describe();
    } else if (file == "venom-64-2-8.yaml") {
      EXPECT_EQ(end_plan.size(), shapes.size());
      for (const auto& [n, p] : end_plan) {
        EXPECT_EQ(p.kind, "vnm");
        EXPECT_EQ(p.pattern, SparsityPattern::vnm(64, 2, 8));
      }
      EXPECT_EQ(r.plan_at(419).at(kFc0).kind, "masked");
      EXPECT_EQ(r.plan_at(420).at(kFc0).kind, "vnm");
      EXPECT_NE(r.describe().find("masks dense -> 64:2:4 -> 64:2:8"), std::string::npos) << r.describe();
    } else if (file == "semi-sparse.yaml") {
      EXPECT_EQ(end_plan.size(), 6u);  // fc and proj of 3 blocks
      EXPECT_EQ(r.plan_at(419).at(kFc0).kind, "semi_sparse");
      EXPECT_EQ(end_plan.at(kFc0).kind, "dense");
      EXPECT_EQ(r.changed_at(420).size(), 6u);
    } else if (file == "semi-sparse-activation.yaml") {
      EXPECT_EQ(c.model.mlp, MlpKind::relu2);
      EXPECT_EQ(end_plan.size(), 3u);
      for (const auto& [n, p] : end_plan) {
        EXPECT_NE(n.find("mlp.proj"), std::string::npos);
        EXPECT_EQ(p.kind, "semi_sparse_activation");
      }
    } else if (file == "slope.yaml" || file == "slope-sparse-dw.yaml") {
      // slope-sparse-dw.yaml is slope.yaml with sparse_dw on.
      EXPECT_EQ(c.model.preset, "llama-tiny");
      EXPECT_EQ(end_plan.size(), 6u);  // qkv, attn.proj, mlp.proj of 2 blocks; not mlp.fc
      EXPECT_FALSE(end_plan.count(kFc0));
      for (const auto& [n, p] : end_plan) {
        EXPECT_EQ(p.kind, "slope");
        EXPECT_EQ(p.lora_rank, 4);
        EXPECT_EQ(p.mask_change_freq, 100);
        EXPECT_TRUE(p.lora_enabled);
        EXPECT_EQ(p.sparse_dw, file == "slope-sparse-dw.yaml");
      }
      EXPECT_FALSE(r.plan_at(593).at("blocks.0.attn.qkv.weight").lora_enabled);
      EXPECT_TRUE(r.plan_at(594).at("blocks.0.attn.qkv.weight").lora_enabled);
    }
  }
  EXPECT_EQ(seen, expected);
}

// ---------------------------------------------------------------------------------------
// Schedules

TEST(Recipe, CubicScheduleAtUpdateSteps) {
  const Recipe r = make(R"(
- gradual_magnitude: {params: ['re:.*'], init_sparsity: 0.1, final_sparsity: 0.9, start: 10, end: 110, update_every: 10}
)");
  auto plan = [&](int64_t s) { return r.plan_at(s).at(kFc0); };
  EXPECT_EQ(plan(9).kind, "dense");
  EXPECT_EQ(plan(9).modifier, -1);
  EXPECT_EQ(plan(10).kind, "masked");
  EXPECT_EQ(plan(10).modifier, 0);
  EXPECT_DOUBLE_EQ(plan(10).sparsity, 0.1);
  EXPECT_DOUBLE_EQ(plan(19).sparsity, 0.1);
  // s(30) = 0.9 + (0.1 - 0.9)·(1 - 20/100)^3 = 0.9 - 0.8·0.512; held until the next update.
  EXPECT_NEAR(plan(30).sparsity, 0.4904, 1e-12);
  EXPECT_NEAR(plan(35).sparsity, 0.4904, 1e-12);
  EXPECT_NEAR(plan(60).sparsity, 0.8, 1e-12);    // 0.9 - 0.8·0.5^3
  EXPECT_NEAR(plan(109).sparsity, 0.8992, 1e-12);  // update 100: 0.9 - 0.8·0.1^3
  EXPECT_DOUBLE_EQ(plan(110).sparsity, 0.9);
  EXPECT_DOUBLE_EQ(plan(199).sparsity, 0.9);
  EXPECT_EQ(plan(60).pattern.kind, SparsityPattern::Kind::unstructured);
  EXPECT_DOUBLE_EQ(plan(60).pattern.sparsity, plan(60).sparsity);
  EXPECT_EQ(r.plan_at(60).size(), 8u);
}

TEST(Recipe, UpdateEveryBoundaries) {
  // Updates at 0, 20, 40 and at end = 50 (which is not a multiple of 20).
  const Recipe r = make(R"(
- gradual_magnitude: {params: ['re:.*mlp.*'], final_sparsity: 0.5, start: 0, end: 50, update_every: 20}
)",
                        100);
  std::vector<int64_t> updates;
  for (int64_t s = 0; s < 100; ++s)
    if (r.is_update_step(s)) updates.push_back(s);
  // Step 0 is no update: init_sparsity 0 keeps the layer dense.
  EXPECT_EQ(updates, (std::vector<int64_t>{20, 40, 50}));
  EXPECT_EQ(r.plan_at(0).at(kFc0).kind, "dense");
  EXPECT_EQ(r.plan_at(0).at(kFc0).modifier, 0);
  EXPECT_NEAR(r.plan_at(39).at(kFc0).sparsity, 0.5 - 0.5 * 0.216, 1e-12);
  EXPECT_NEAR(r.plan_at(49).at(kFc0).sparsity, 0.5 - 0.5 * 0.008, 1e-12);
  EXPECT_DOUBLE_EQ(r.plan_at(50).at(kFc0).sparsity, 0.5);
  EXPECT_EQ(r.changed_at(20), (std::vector<std::string>{"blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight",
                                                         "blocks.1.mlp.fc.weight", "blocks.1.mlp.proj.weight"}));

  const Recipe with_init = make(R"(
- gradual_magnitude: {params: ['re:.*mlp.*'], init_sparsity: 0.1, final_sparsity: 0.5, start: 0, end: 50, update_every: 20}
)",
                                100);
  EXPECT_TRUE(with_init.is_update_step(0));
  EXPECT_FALSE(with_init.is_update_step(1));

  // start == end: one-shot pruning at start.
  const Recipe one_shot = make(R"(
- gradual_magnitude: {params: ['re:.*mlp.*'], final_sparsity: 0.5, start: 30, end: 30, update_every: 5}
)",
                               100);
  EXPECT_EQ(one_shot.plan_at(29).at(kFc0).kind, "dense");
  EXPECT_DOUBLE_EQ(one_shot.plan_at(30).at(kFc0).sparsity, 0.5);
  EXPECT_TRUE(one_shot.is_update_step(30));
}

TEST(Recipe, StructuredRampNm) {
  // Target 2:8 (density 0.25). Density wanted at update u: 0.25 + 0.75·(1 - u/100)^3 =
  // 1, .79675, .634, .50725, .412, .34375, .298, .27025, ... -> nearest n/8 (never denser).
  const Recipe r = make(R"(
- gradual_magnitude: {params: ['blocks.0.mlp.fc.weight'], mask_type: "2:8", start: 0, end: 100, update_every: 10}
)");
  const auto seq = patterns(r, kFc0, 200);
  const std::vector<std::string> at_updates = {"dense", "6:8", "5:8", "4:8", "3:8", "3:8",
                                               "2:8",   "2:8", "2:8", "2:8", "2:8"};
  for (int k = 0; k <= 10; ++k) {
    EXPECT_EQ(seq[k * 10], at_updates[k]) << "update at step " << k * 10;
    if (k < 10) EXPECT_EQ(seq[k * 10 + 9], at_updates[k]) << "held until step " << k * 10 + 9;
  }
  EXPECT_EQ(r.plan_at(0).at(kFc0).kind, "dense");
  EXPECT_EQ(r.plan_at(10).at(kFc0).kind, "masked");
  EXPECT_DOUBLE_EQ(r.plan_at(10).at(kFc0).sparsity, 0.25);
  EXPECT_DOUBLE_EQ(r.plan_at(150).at(kFc0).sparsity, 0.75);
  // 3:8 holds from 40 through 59: step 50 is a GMP update but changes nothing.
  EXPECT_TRUE(r.is_update_step(40));
  EXPECT_FALSE(r.is_update_step(50));
  EXPECT_TRUE(r.is_update_step(60));
  // Density never rises.
  double prev = 1.0;
  for (int64_t s = 0; s < 200; ++s) {
    const double d = r.plan_at(s).at(kFc0).pattern.density();
    EXPECT_LE(d, prev);
    prev = d;
  }

  // init_sparsity 0.3 with 2:4: density 0.7 at start is nearest to 3:4.
  const Recipe init = make(R"(
- gradual_magnitude: {params: ['blocks.0.mlp.fc.weight'], mask_type: "2:4", init_sparsity: 0.3, start: 0, end: 100, update_every: 10}
)");
  EXPECT_EQ(init.plan_at(0).at(kFc0).pattern, SparsityPattern::nm(3, 4));
}

TEST(Recipe, StructuredRampVnm) {
  // Target 64:2:8; levels dense (1), 64:2:4 (0.5), 64:2:8 (0.25); wanted densities as above.
  const Recipe r = make(R"(
- gradual_magnitude: {params: ['re:.*'], mask_type: "64:2:8", start: 0, end: 100, update_every: 10}
)");
  const auto seq = patterns(r, kFc0, 120);
  const std::vector<std::string> at_updates = {"dense",  "dense",  "64:2:4", "64:2:4", "64:2:4", "64:2:8",
                                               "64:2:8", "64:2:8", "64:2:8", "64:2:8", "64:2:8"};
  for (int k = 0; k <= 10; ++k) EXPECT_EQ(seq[k * 10], at_updates[k]) << "update at step " << k * 10;
  EXPECT_EQ(r.plan_at(25).at(kFc0).kind, "masked");
  EXPECT_DOUBLE_EQ(r.plan_at(119).at(kFc0).sparsity, 0.75);

  // 16:2:16 ramps through the divisors of 16 that are >= 4: 4, 8, 16.
  const Recipe r16 = make(R"(
- gradual_magnitude: {params: ['re:.*'], mask_type: "16:2:16", start: 0, end: 1000, update_every: 1}
)",
                          1000);
  std::vector<std::string> distinct;
  for (int64_t s = 0; s < 1000; s += 1) {
    const std::string t = r16.plan_at(s).at(kFc0).pattern.to_string();
    if (distinct.empty() || distinct.back() != t) distinct.push_back(t);
  }
  EXPECT_EQ(distinct, (std::vector<std::string>{"dense", "16:2:4", "16:2:8", "16:2:16"}));
}

TEST(Recipe, SparseThenDenseWithUntil) {
  // 0.25 and 0.75 of 200 steps: semi_sparse over [50, 150), dense from 150 on.
  const Recipe r = make(R"(
- semi_sparse: {params: ['re:blocks\.\d+\.mlp\.fc\.weight'], start: 0.25, until: 0.75}
)");
  EXPECT_EQ(r.plan_at(0).size(), 2u);
  EXPECT_EQ(r.plan_at(49).at(kFc0).kind, "dense");
  EXPECT_EQ(r.plan_at(49).at(kFc0).modifier, -1);
  const LayerPlan p = r.plan_at(50).at(kFc0);
  EXPECT_EQ(p.kind, "semi_sparse");
  EXPECT_EQ(p.pattern, SparsityPattern::nm(2, 4));
  EXPECT_DOUBLE_EQ(p.sparsity, 0.5);
  EXPECT_EQ(r.plan_at(149).at(kFc0).kind, "semi_sparse");
  EXPECT_EQ(r.plan_at(150).at(kFc0).kind, "dense");
  EXPECT_EQ(r.changed_at(50).size(), 2u);
  EXPECT_EQ(r.changed_at(150).size(), 2u);
  EXPECT_TRUE(r.changed_at(151).empty());
  EXPECT_TRUE(r.reads_weights_at(50));
  EXPECT_TRUE(r.reads_weights_at(150));
  EXPECT_FALSE(r.reads_weights_at(151));

  // A weight may move from one method to another once the first one has let go of it.
  const Recipe seq = make(R"(
- semi_sparse_activation: {params: ['blocks.0.mlp.proj.weight'], until: 100}
- slope: {params: ['blocks.0.mlp.proj.weight'], start: 100}
)");
  EXPECT_EQ(seq.plan_at(0).at("blocks.0.mlp.proj.weight").kind, "semi_sparse_activation");
  EXPECT_EQ(seq.plan_at(100).at("blocks.0.mlp.proj.weight").kind, "slope");
  EXPECT_EQ(seq.plan_at(100).at("blocks.0.mlp.proj.weight").modifier, 1);
}

TEST(Recipe, SlopeLoraStart) {
  const Recipe r = make("- slope: {params: ['re:.*attn.*'], lora_rank: 4}", 600);
  const std::string q = "blocks.0.attn.qkv.weight";
  EXPECT_EQ(r.plan_at(0).at(q).kind, "slope");
  EXPECT_EQ(r.plan_at(0).at(q).mask_change_freq, 100);
  EXPECT_EQ(r.plan_at(0).at(q).pattern, SparsityPattern::nm(2, 4));
  EXPECT_FALSE(r.plan_at(593).at(q).lora_enabled);  // default lora_start 0.99 of 600 = 594
  EXPECT_TRUE(r.plan_at(594).at(q).lora_enabled);
  EXPECT_EQ(r.changed_at(594).size(), 4u);
  EXPECT_TRUE(r.changed_at(593).empty());
  // Slope's masks at its start come from the weights; its adapter reads none of them.
  EXPECT_TRUE(r.reads_weights_at(0));
  EXPECT_FALSE(r.reads_weights_at(594));
  EXPECT_FALSE(r.reads_weights_at(593));

  const Recipe steps = make("- slope: {params: ['re:.*attn.*'], lora_rank: 2, lora_start: 150, mask_change_freq: 7}");
  EXPECT_FALSE(steps.plan_at(149).at(q).lora_enabled);
  EXPECT_TRUE(steps.plan_at(150).at(q).lora_enabled);
  EXPECT_EQ(steps.plan_at(150).at(q).mask_change_freq, 7);

  // 0.5 of 201 steps is 100.5: rounded to the nearest step, halves away from zero.
  const Recipe half = make("- slope: {params: ['re:.*attn.*'], lora_rank: 2, lora_start: 0.5}", 201);
  EXPECT_FALSE(half.plan_at(100).at(q).lora_enabled);
  EXPECT_TRUE(half.plan_at(101).at(q).lora_enabled);

  // Without adapters the default lora_start (step 594) may precede a late start.
  EXPECT_NO_THROW(make("- slope: {params: ['re:.*attn.*'], start: 0.995}", 600));
  const Recipe no_rank = make("- slope: {params: ['re:.*attn.*']}", 600);
  EXPECT_FALSE(no_rank.plan_at(599).at(q).lora_enabled);
  EXPECT_TRUE(no_rank.changed_at(594).empty());
}

TEST(Recipe, KernelReplacementHandOff) {
  const Recipe r = make(R"(
- gradual_magnitude: {params: ['re:.*'], mask_type: "64:2:8", start: 0, end: 100, update_every: 10}
- kernel_replacement: {params: ['re:.*'], start: 120}
)");
  EXPECT_EQ(r.plan_at(110).at(kFc0).kind, "masked");
  EXPECT_EQ(r.plan_at(110).at(kFc0).modifier, 0);
  EXPECT_TRUE(r.changed_at(100).empty());  // 64:2:8 was reached at step 50
  const LayerPlan p = r.plan_at(120).at(kFc0);
  EXPECT_EQ(p.kind, "vnm");
  EXPECT_EQ(p.pattern, SparsityPattern::vnm(64, 2, 8));
  EXPECT_DOUBLE_EQ(p.sparsity, 0.75);
  EXPECT_EQ(p.modifier, 1);
  EXPECT_EQ(r.changed_at(120).size(), 8u);
  EXPECT_EQ(r.plan_at(199).at(kFc0).kind, "vnm");

  // 2:4 hands over too; kernel_replacement may come first in the list and start at `end`.
  const Recipe r24 = make(R"(
- kernel_replacement: {params: ['re:.*mlp.*'], start: 100}
- gradual_magnitude: {params: ['re:.*mlp.*'], mask_type: "2:4", start: 0, end: 100, update_every: 10}
)");
  EXPECT_EQ(r24.plan_at(99).at(kFc0).kind, "masked");
  EXPECT_EQ(r24.plan_at(100).at(kFc0).kind, "vnm");
  EXPECT_EQ(r24.plan_at(100).at(kFc0).pattern, SparsityPattern::nm(2, 4));
  EXPECT_EQ(r24.plan_at(100).at(kFc0).modifier, 0);
}

TEST(Recipe, SparseDwOnSemiSparseAndSlope) {
  const Recipe r = make(R"(
- semi_sparse: {params: ['blocks.0.mlp.fc.weight'], until: 100, sparse_dw: true}
- slope: {params: ['blocks.0.mlp.fc.weight'], start: 100}
- slope: {params: ['re:blocks\.1\..*'], sparse_dw: false}
- semi_sparse: {params: ['re:blocks\.0\.attn\..*'], sparse_dw: yes}
)");
  EXPECT_TRUE(r.modifiers()[0].sparse_dw);
  EXPECT_FALSE(r.modifiers()[1].sparse_dw);  // the default
  EXPECT_FALSE(r.modifiers()[2].sparse_dw);
  EXPECT_TRUE(r.modifiers()[3].sparse_dw);  // a YAML boolean, as the config's keys
  EXPECT_TRUE(r.plan_at(0).at(kFc0).sparse_dw);
  EXPECT_TRUE(r.plan_at(0).at("blocks.0.attn.qkv.weight").sparse_dw);
  EXPECT_FALSE(r.plan_at(0).at("blocks.1.mlp.fc.weight").sparse_dw);
  EXPECT_EQ(r.plan_at(100).at(kFc0).kind, "slope");
  EXPECT_FALSE(r.plan_at(100).at(kFc0).sparse_dw);
  // The option is part of a plan's effect: the trainer rebuilds a layer when it changes.
  LayerPlan a = r.plan_at(0).at(kFc0), b = a;
  b.sparse_dw = false;
  EXPECT_FALSE(a.same_effect(b));

  const std::string d = r.describe();
  EXPECT_NE(d.find("[0] semi_sparse on 1 weight: 2:4 steps [0, 100), dense after, sparse dW (MVUE 2:4 of dYᵀ)"),
            std::string::npos) << d;
  EXPECT_NE(d.find("[2] slope on 4 weights: 2:4 from step 0, Wᵀ mask refreshed every 100 steps, no adapters\n"),
            std::string::npos) << d;

  // to_yaml writes the key for both types, on or off, and reads back to the same recipe.
  const std::string text = r.to_yaml();
  EXPECT_NE(text.find("sparse_dw: true"), std::string::npos) << text;
  EXPECT_NE(text.find("sparse_dw: false"), std::string::npos) << text;
  const Recipe back = make(text);
  EXPECT_EQ(back.to_yaml(), text);
  for (int64_t s : {0, 99, 100, 199}) EXPECT_EQ(back.plan_at(s), r.plan_at(s)) << s;
  for (size_t i = 0; i < r.modifiers().size(); ++i)
    EXPECT_EQ(back.modifiers()[i].sparse_dw, r.modifiers()[i].sparse_dw) << "recipe[" << i << "]";
  EXPECT_EQ(make("- semi_sparse_activation: {params: ['re:.*mlp.*']}").to_yaml().find("sparse_dw"), std::string::npos);
}

// semi_sparse_activation's `activation` (row_24 by default, or tile_24) reaches the plans,
// the description and the YAML it writes; a change of pattern is a change of plan.
TEST(Recipe, SemiSparseActivationPattern) {
  const Recipe r = make(R"(
- semi_sparse_activation: {params: ['blocks.0.mlp.proj.weight'], until: 100}
- semi_sparse_activation: {params: ['blocks.0.mlp.proj.weight'], start: 100, activation: tile_24}
)");
  const std::string w = "blocks.0.mlp.proj.weight";
  EXPECT_EQ(r.plan_at(0).at(w).activation, ActivationSparsity::row_24);
  EXPECT_EQ(r.plan_at(100).at(w).activation, ActivationSparsity::tile_24);
  EXPECT_EQ(r.plan_at(100).at(w).kind, "semi_sparse_activation");
  EXPECT_EQ(r.changed_at(100), std::vector<std::string>{w});
  const std::string d = r.describe();
  EXPECT_NE(d.find("(tile_24 of the input)"), std::string::npos) << d;
  EXPECT_NE(d.find("(row_24 of the input)"), std::string::npos) << d;
  const std::string text = r.to_yaml();
  EXPECT_NE(text.find("activation: tile_24"), std::string::npos) << text;
  const Recipe back = make(text);
  EXPECT_EQ(back.to_yaml(), text);
  for (int64_t s : {0, 99, 100, 199}) EXPECT_EQ(back.plan_at(s), r.plan_at(s)) << s;
}

// ---------------------------------------------------------------------------------------
// Errors

TEST(Recipe, SyntaxErrors) {
  EXPECT_ERROR(Recipe::parse("- magnitude_pruning: {params: [x]}", "r.yaml"),
               "r.yaml: recipe[0]: unknown modifier type 'magnitude_pruning' (known: gradual_magnitude,");
  EXPECT_ERROR(Recipe::parse(R"(
- semi_sparse: {params: ['re:.*']}
- gradual_magnitude: {params: ['re:.*'], final_sparsity: 0.5, start: 0, end: 10, update_evry: 2}
)",
                             "r.yaml"),
               "r.yaml: recipe[1] (gradual_magnitude): unknown key 'update_evry' (known: params, mask_type,");
  EXPECT_ERROR(Recipe::parse("- gradual_magnitude: {params: ['re:.*'], final_sparsity: 0.5, start: 0, update_every: 2}",
                             "r.yaml"),
               "r.yaml: recipe[0] (gradual_magnitude): missing required key 'end'");
  EXPECT_ERROR(Recipe::parse("- gradual_magnitude: {params: ['re:.*'], start: 0, end: 9, update_every: 2}", "r.yaml"),
               "missing required key 'final_sparsity'");
  EXPECT_ERROR(Recipe::parse("- slope: {start: 3}", "r.yaml"), "recipe[0] (slope): missing required key 'params'");
  EXPECT_ERROR(Recipe::parse("- slope: {params: []}", "r.yaml"), "key 'params' must be a non-empty list");
  EXPECT_ERROR(Recipe::parse("- slope: {params: ['re:.*'], mask_change_freq: 0}", "r.yaml"),
               "key 'mask_change_freq' must be in [1, 2147483647], got 0");
  EXPECT_ERROR(Recipe::parse("- slope: {params: ['re:.*'], lora_rank: four}", "r.yaml"),
               "key 'lora_rank' must be an integer, got 'four'");
  EXPECT_ERROR(Recipe::parse("- slope: {params: ['re:.*'], start: [1]}", "r.yaml"), "key 'start' must be a single value");
  EXPECT_ERROR(Recipe::parse("slope: {params: ['re:.*']}", "r.yaml"), "r.yaml: `recipe` must be a list of modifiers");
  EXPECT_ERROR(Recipe::parse("- slope: {params: ['re:.*']}\n  semi_sparse: {params: ['re:.*']}", "r.yaml"),
               "recipe[0] must be a mapping with one key, the modifier type");
  EXPECT_ERROR(Recipe::parse("- [1, 2", "r.yaml"), "r.yaml: recipe: invalid YAML");
}

TEST(Recipe, MaskTypeErrorsReuseThePatternParser) {
  const std::string head = "- gradual_magnitude: {params: ['re:.*'], start: 0, end: 10, update_every: 2, mask_type: ";
  EXPECT_ERROR(Recipe::parse(head + "\"64:2:3\"}", "r.yaml"),
               "r.yaml: recipe[0] (gradual_magnitude): key 'mask_type': sparsity pattern \"64:2:3\" (V:N:M): M must be "
               "in 4..16");
  EXPECT_ERROR(Recipe::parse(head + "\"3:2\"}", "r.yaml"),
               "key 'mask_type': sparsity pattern \"3:2\" (N:M): N must be smaller than M, got N = 3 >= M = 2");
  EXPECT_ERROR(Recipe::parse(head + "dense}", "r.yaml"), "key 'mask_type': 'dense' prunes nothing");
  EXPECT_ERROR(Recipe::parse(head + "\"2:4\", final_sparsity: 0.6}", "r.yaml"),
               "key 'final_sparsity': 0.6 conflicts with mask_type 2:4, which implies 0.5");
  EXPECT_NO_THROW(Recipe::parse(head + "\"2:4\", final_sparsity: 0.5}", "r.yaml"));
  EXPECT_NO_THROW(Recipe::parse(head + "\"64:2:8\", final_sparsity: 0.75}", "r.yaml"));
}

TEST(Recipe, ValueErrors) {
  const std::string g = "- gradual_magnitude: {params: ['re:.*'], ";
  EXPECT_ERROR(Recipe::parse(g + "init_sparsity: 0.6, final_sparsity: 0.5, start: 0, end: 9, update_every: 1}", "r"),
               "key 'init_sparsity' (0.6) is larger than the final sparsity (0.5)");
  EXPECT_ERROR(Recipe::parse(g + "final_sparsity: 1.0, start: 0, end: 9, update_every: 1}", "r"),
               "key 'final_sparsity' must be in [0, 1), got 1.0");
  EXPECT_ERROR(Recipe::parse(g + "init_sparsity: -0.1, final_sparsity: 0.5, start: 0, end: 9, update_every: 1}", "r"),
               "key 'init_sparsity' must be in [0, 1), got -0.1");
  EXPECT_ERROR(Recipe::parse(g + "final_sparsity: 0.5, start: 0, end: 9, update_every: 0}", "r"),
               "key 'update_every' must be positive, got 0");
  EXPECT_ERROR(Recipe::parse(g + "final_sparsity: 0.5, start: 1.5, end: 9, update_every: 1}", "r"),
               "key 'start': 1.5 is read as a fraction of train.steps");
  EXPECT_ERROR(Recipe::parse(g + "final_sparsity: 0.5, start: -3, end: 9, update_every: 1}", "r"),
               "key 'start' must not be negative, got -3");
  EXPECT_ERROR(Recipe::parse(g + "final_sparsity: 0.5, start: soon, end: 9, update_every: 1}", "r"),
               "key 'start' must be a step (an integer) or a fraction of train.steps");
  EXPECT_ERROR(make(g + "final_sparsity: 0.5, start: 100, end: 50, update_every: 1}"),
               "r.yaml: recipe[0] (gradual_magnitude): start (100) is after end (50)");
  EXPECT_ERROR(make(g + "final_sparsity: 0.5, start: 0.5, end: 50, update_every: 1}"),
               "start (100 (0.5 of train.steps)) is after end (50)");
  EXPECT_ERROR(make(g + "final_sparsity: 0.5, start: 0, end: 50, update_every: 0.001}"),
               "key 'update_every': 0.001 of train.steps (200) is 0 steps; it must be positive");
  EXPECT_ERROR(make(g + "final_sparsity: 0.5, start: 0, end: 300, update_every: 1}"),
               "key 'end': step 300 is beyond the end of training (train.steps = 200)");
  EXPECT_ERROR(make("- semi_sparse: {params: ['re:.*'], start: 50, until: 50}"), "until (50) must be after start (50)");
  EXPECT_ERROR(make("- slope: {params: ['re:.*'], start: 50, lora_rank: 2, lora_start: 10}"),
               "lora_start (10) is before start (50)");
  EXPECT_ERROR(make("- slope: {params: ['re:.*'], lora_rank: 65}"),
               "key 'lora_rank': 65 exceeds min(rows, cols) of 'blocks.0.attn.proj.weight' of shape [64, 64]");
  EXPECT_ERROR(Recipe::parse("- slope: {params: ['re:.*'], sparse_dw: maybe}", "r.yaml"),
               "r.yaml: recipe[0] (slope): key 'sparse_dw' must be true or false, got 'maybe'");
  EXPECT_ERROR(Recipe::parse("- semi_sparse: {params: ['re:.*'], sparse_dw: 1.5}", "r.yaml"),
               "r.yaml: recipe[0] (semi_sparse): key 'sparse_dw' must be true or false, got '1.5'");
  EXPECT_ERROR(Recipe::parse("- slope: {params: ['re:.*'], sparse_dw: [true]}", "r.yaml"),
               "key 'sparse_dw' must be a single value");
  // Only the kinds with a 2:4 weight know it.
  EXPECT_ERROR(Recipe::parse("- semi_sparse_activation: {params: ['re:.*'], sparse_dw: true}", "r.yaml"),
               "r.yaml: recipe[0] (semi_sparse_activation): unknown key 'sparse_dw' (known: params, start, until, "
               "activation)");
  EXPECT_ERROR(Recipe::parse("- semi_sparse_activation: {params: ['re:.*'], activation: rows}", "r.yaml"),
               "r.yaml: recipe[0] (semi_sparse_activation): key 'activation' must be row_24");
  EXPECT_ERROR(Recipe::parse("- semi_sparse: {params: ['re:.*'], activation: tile_24}", "r.yaml"),
               "recipe[0] (semi_sparse): unknown key 'activation'");
  EXPECT_ERROR(Recipe::parse("- kernel_replacement: {params: ['re:.*'], start: 5, sparse_dw: true}", "r.yaml"),
               "recipe[0] (kernel_replacement): unknown key 'sparse_dw'");
}

TEST(Recipe, ParamErrors) {
  EXPECT_ERROR(make("- semi_sparse: {params: ['re:blocks\\.9\\..*']}"),
               "r.yaml: recipe[0] (semi_sparse): key 'params': 're:blocks\\.9\\..*' matches no linear weight");
  EXPECT_ERROR(make("- semi_sparse: {params: ['re:mlp']}"), "the regex must match the whole name");
  EXPECT_ERROR(Recipe::parse("- semi_sparse: {params: ['re:blocks.(']}", "r.yaml"),
               "r.yaml: recipe[0] (semi_sparse): key 'params': invalid regex 'blocks.('");
  EXPECT_ERROR(make("- semi_sparse: {params: ['blocks.7.mlp.fc.weight']}"),
               "key 'params': 'blocks.7.mlp.fc.weight' is not a linear weight of the model");
  // Divisibility, naming the weight and its shape.
  const std::string g = "- gradual_magnitude: {params: ['re:.*'], start: 0, end: 50, update_every: 5, mask_type: ";
  EXPECT_ERROR(make(g + "\"128:2:8\"}"),
               "r.yaml: recipe[0] (gradual_magnitude): tensor 'blocks.0.attn.proj.weight' of shape [64, 64]: rows (64) "
               "is not a multiple of V = 128");
  EXPECT_ERROR(make(g + "\"2:12\"}"), "cols (64) is not a multiple of M = 12");
  LinearShapes odd = small_shapes();
  odd["blocks.0.odd.weight"] = {6, 8};
  EXPECT_ERROR(make("- semi_sparse: {params: ['re:.*odd.*']}", 200, odd),
               "'blocks.0.odd.weight' of shape [6, 8]: semi_sparse needs rows and cols that are multiples of 4");
  EXPECT_ERROR(make("- slope: {params: ['re:.*odd.*']}", 200, odd), "slope needs rows and cols that are multiples of 4");
  odd["blocks.0.odd.weight"] = {6, 10};
  EXPECT_ERROR(make("- semi_sparse_activation: {params: ['re:.*odd.*']}", 200, odd),
               "semi_sparse_activation needs cols (in features) that are a multiple of 4");
  odd["blocks.0.odd.weight"] = {6, 8};  // rows do not matter for activation sparsity
  EXPECT_NO_THROW(make("- semi_sparse_activation: {params: ['re:.*odd.*']}", 200, odd));
}

TEST(Recipe, ClashErrors) {
  EXPECT_ERROR(make(R"(
- semi_sparse: {params: ['blocks.0.mlp.fc.weight']}
- slope: {params: ['re:.*mlp.*'], start: 50}
)"),
               "r.yaml: recipe[0] (semi_sparse) and recipe[1] (slope) both claim 'blocks.0.mlp.fc.weight' at step 50 "
               "(from step 0 on and from step 50 on overlap)");
  EXPECT_ERROR(make(R"(
- semi_sparse: {params: ['re:.*mlp.*'], until: 100}
- slope: {params: ['re:.*mlp.*'], start: 99}
)"),
               "steps [0, 100) and from step 99 on overlap");
  EXPECT_ERROR(make(R"(
- gradual_magnitude: {params: ['re:.*'], final_sparsity: 0.5, start: 0, end: 50, update_every: 5}
- gradual_magnitude: {params: ['re:.*mlp.*'], final_sparsity: 0.7, start: 60, end: 90, update_every: 5}
)"),
               "recipe[0] (gradual_magnitude) and recipe[1] (gradual_magnitude) both claim 'blocks.0.mlp.fc.weight'");
  // A pruned weight keeps its mask: nothing else may follow gradual_magnitude but kernel_replacement.
  EXPECT_ERROR(make(R"(
- gradual_magnitude: {params: ['re:.*'], mask_type: "2:4", start: 0, end: 50, update_every: 5}
- semi_sparse: {params: ['re:.*mlp.*'], start: 100}
)"),
               "both claim");
  EXPECT_ERROR(make(R"(
- gradual_magnitude: {params: ['re:.*'], mask_type: "2:4", start: 0, end: 50, update_every: 5}
- kernel_replacement: {params: ['re:.*mlp.*'], start: 100}
- kernel_replacement: {params: ['blocks.0.mlp.fc.weight'], start: 150}
)"),
               "recipe[1] (kernel_replacement) and recipe[2] (kernel_replacement) both claim 'blocks.0.mlp.fc.weight'");
}

TEST(Recipe, KernelReplacementErrors) {
  EXPECT_ERROR(make("- kernel_replacement: {params: ['re:.*mlp.*'], start: 10}"),
               "r.yaml: recipe[0] (kernel_replacement): 'blocks.0.mlp.fc.weight' is not pruned by any "
               "gradual_magnitude modifier");
  EXPECT_ERROR(make(R"(
- gradual_magnitude: {params: ['re:.*mlp.*'], final_sparsity: 0.5, start: 0, end: 50, update_every: 5}
- kernel_replacement: {params: ['re:.*mlp.*'], start: 60}
)"),
               "recipe[1] (kernel_replacement): 'blocks.0.mlp.fc.weight' is pruned by recipe[0] (gradual_magnitude) "
               "with mask_type unstructured; kernel_replacement needs a V:N:M or 2:4 mask");
  EXPECT_ERROR(make(R"(
- gradual_magnitude: {params: ['re:.*mlp.*'], mask_type: "2:8", start: 0, end: 50, update_every: 5}
- kernel_replacement: {params: ['re:.*mlp.*'], start: 60}
)"),
               "with mask_type 2:8; kernel_replacement needs a V:N:M or 2:4 mask");
  EXPECT_ERROR(make(R"(
- gradual_magnitude: {params: ['re:.*mlp.*'], mask_type: "64:2:8", start: 0, end: 50, update_every: 5}
- kernel_replacement: {params: ['re:.*mlp.*'], start: 40}
)"),
               "'blocks.0.mlp.fc.weight' is still being pruned by recipe[0] (gradual_magnitude) until step 50; "
               "kernel_replacement must start at or after it, not at step 40");
}

TEST(Recipe, PlanBeforeValidateIsAnError) {
  const Recipe r = Recipe::parse("- semi_sparse: {params: ['re:.*']}", "r.yaml");
  EXPECT_FALSE(r.validated());
  EXPECT_ERROR(r.plan_at(0), "r.yaml: recipe: plan_at called before validate");
}

// ---------------------------------------------------------------------------------------
// Purity, round trip, empty

TEST(Recipe, PlanIsAPureFunctionOfTheStep) {
  const std::string yaml = R"(
- gradual_magnitude: {params: ['re:.*attn.*'], mask_type: "2:8", start: 0.1, end: 0.6, update_every: 7}
- semi_sparse: {params: ['blocks.0.mlp.fc.weight'], until: 0.5}
- slope: {params: ['re:blocks\.1\.mlp\..*'], lora_rank: 2, lora_start: 0.9}
)";
  const Recipe r = make(yaml, 150);
  std::vector<std::map<std::string, LayerPlan>> forward;
  for (int64_t s = 0; s < 150; ++s) forward.push_back(r.plan_at(s));
  for (int64_t s = 149; s >= 0; --s) EXPECT_EQ(r.plan_at(s), forward[s]) << "step " << s;
  // A fresh recipe asked only for a late step (a resumed run) agrees.
  const Recipe resumed = make(yaml, 150);
  EXPECT_EQ(resumed.plan_at(97), forward[97]);
  EXPECT_EQ(resumed.changed_at(97), r.changed_at(97));
  // changed_at is exactly where the effect differs from the previous step.
  for (int64_t s = 1; s < 150; ++s) {
    std::vector<std::string> diff;
    for (const auto& [n, p] : forward[s])
      if (!p.same_effect(forward[s - 1].at(n))) diff.push_back(n);
    EXPECT_EQ(r.changed_at(s), diff) << "step " << s;
  }
}

TEST(Recipe, ToYamlRoundTripsAndNodeOverload) {
  const std::string yaml = R"(
- gradual_magnitude: {params: ['re:blocks\.\d+\.(attn|mlp)\.\w+\.weight'], mask_type: "64:2:8", start: 0.1, end: 120, update_every: 5}
- kernel_replacement: {params: ['re:blocks\.\d+\.(attn|mlp)\.\w+\.weight'], start: 0.7}
)";
  const Recipe a = make(yaml);
  const std::string text = a.to_yaml();
  const Recipe b = make(text);
  EXPECT_EQ(b.to_yaml(), text);
  for (int64_t s : {0, 19, 20, 60, 119, 120, 139, 140, 199}) EXPECT_EQ(a.plan_at(s), b.plan_at(s)) << s;
  EXPECT_NE(text.find("final_sparsity: 0.75"), std::string::npos) << text;
  EXPECT_NE(text.find("start: 0.1"), std::string::npos) << text;

  const std::string slope = "- slope: {params: [blocks.0.mlp.fc.weight]}\n- semi_sparse: {params: ['re:.*attn.*'], until: 9}";
  const Recipe c = make(slope);
  EXPECT_EQ(make(c.to_yaml()).to_yaml(), c.to_yaml());
  EXPECT_NE(c.to_yaml().find("lora_start: 0.99"), std::string::npos) << c.to_yaml();
  EXPECT_NE(c.to_yaml().find("mask_change_freq: 100"), std::string::npos) << c.to_yaml();

  Recipe d = Recipe::parse(YAML::Load(slope), "node");
  d.validate(small_shapes(), 200);
  EXPECT_EQ(d.plan_at(5), c.plan_at(5));
  EXPECT_EQ(d.source(), "node");

  // The recipe kept by the run config parses the same.
  const TrainConfig cfg =
      parse_train_config("model: {preset: tiny, n_layer: 2, d_model: 64, d_ff: 256}\nrecipe:\n" + yaml, "cfg.yaml");
  EXPECT_EQ(make(cfg.recipe_yaml).to_yaml(), text);
}

TEST(Recipe, EmptyRecipe) {
  for (const char* text : {"", "[]", "~"}) {
    Recipe r = Recipe::parse(text, "r.yaml");
    EXPECT_TRUE(r.empty());
    r.validate(small_shapes(), 10);
    EXPECT_TRUE(r.plan_at(3).empty());
    EXPECT_FALSE(r.is_update_step(0));
  }
  EXPECT_NE(Recipe::parse("", "r").describe().find("none"), std::string::npos);
}

TEST(Recipe, DescribeNamesEveryModifier) {
  const Recipe r = make(R"(
- gradual_magnitude: {params: ['re:.*attn.*'], final_sparsity: 0.5, start: 0, end: 100, update_every: 10}
- semi_sparse: {params: ['blocks.0.mlp.fc.weight'], until: 0.5}
- slope: {params: ['re:blocks\.1\.mlp\..*'], lora_rank: 2, lora_start: 0.9}
)");
  const std::string d = r.describe();
  EXPECT_NE(d.find("[0] gradual_magnitude on 4 weights: unstructured, sparsity 0 -> 0.5"), std::string::npos) << d;
  EXPECT_NE(d.find("[1] semi_sparse on 1 weight: 2:4 steps [0, 100), dense after"), std::string::npos) << d;
  EXPECT_NE(d.find("[2] slope on 2 weights: 2:4 from step 0"), std::string::npos) << d;
  EXPECT_NE(d.find("rank-2 adapters from step 180"), std::string::npos) << d;
}

TEST(Recipe, LinearShapesOfAConfigAreThoseOfItsModel) {
  for (const char* preset : {"tiny", "llama-tiny"}) {
    ModelConfig c = model_preset(preset);
    c.vocab_size = 257;
    Transformer<float> model(c);
    EXPECT_EQ(linear_shapes(c), linear_shapes(model)) << preset;
  }
}

TEST(Recipe, IntegerKeysAreRangeChecked) {
  // 2^32 + 1 used to become rank 1.
  EXPECT_ERROR(Recipe::parse("- slope: {params: ['re:.*'], lora_rank: 4294967297}", "r.yaml"),
               "r.yaml: recipe[0] (slope): key 'lora_rank' must be in [0, 2147483647], got 4294967297");
  EXPECT_ERROR(Recipe::parse("- slope: {params: ['re:.*'], mask_change_freq: 99999999999999999999}", "r.yaml"),
               "key 'mask_change_freq' must be in [1, 2147483647], got 99999999999999999999");
}

// docs/recipes.md shows the messages a config file's recipe errors print, with the file's
// name as their prefix.
TEST(Recipe, DocsShowTheMessagesTheCodePrints) {
  const std::string docs = slurp(std::filesystem::path(ESPLAG_SOURCE_DIR) / "docs" / "recipes.md");
  auto load = [](const std::string& recipe, const std::vector<std::string>& set = {}) {
    return error_of([&] { parse_train_config("model: {preset: tiny}\ntrain: {steps: 600}\nrecipe:\n" + recipe, "run.yaml", set); });
  };
  const std::string prefix = "run.yaml: recipe[0] (gradual_magnitude): ";
  EXPECT_NE(docs.find("(after `" + prefix + "`)"), std::string::npos);
  const std::string gmp = "  - gradual_magnitude: {params: [blocks.0.mlp.fc.weight], final_sparsity: 0.5, start: 0, ";
  for (const std::string& err : {load(gmp + "end: 700, update_every: 10}"), load(gmp + "end: 70, update_every: 0}")}) {
    ASSERT_EQ(err.rfind(prefix, 0), 0u) << err;
    EXPECT_NE(docs.find("`" + err.substr(prefix.size()) + "`"), std::string::npos) << err;
  }
  const std::string type = load("  - magnitude_pruning: {params: [x]}");
  EXPECT_NE(docs.find("`" + type.substr(0, type.find("(known: ") + 8) + "...)`"), std::string::npos) << type;
  const std::string overlap = load("  - semi_sparse: {params: [blocks.0.mlp.fc.weight]}\n"
                                   "  - slope: {params: [blocks.0.mlp.fc.weight], start: 50}");
  EXPECT_NE(docs.find("`" + overlap + "`"), std::string::npos) << overlap;
  const std::string slope = "  - slope: {params: [blocks.0.mlp.fc.weight], lora_rank: 4294967297}";
  const std::string rank = load(slope);
  ASSERT_EQ(rank.rfind("run.yaml: recipe[0] (slope): ", 0), 0u) << rank;
  EXPECT_NE(docs.find("`" + rank.substr(29) + "`"), std::string::npos) << rank;
  const std::string two = gmp + "end: 70, update_every: 10}\n  - semi_sparse: {params: [blocks.0.attn.proj.weight]}";
  for (const char* set : {"recipe.0.slope.start=3", "recipe.0.gradual_magnitude.endd=3", "recipe.2.semi_sparse.start=3"}) {
    const std::string err = load(two, {set});
    EXPECT_NE(docs.find("    " + err + "\n"), std::string::npos) << err;
  }
}

// Found by fuzzing: libstdc++'s regex compiler overflows on counts of many digits.
TEST(Recipe, RegexWithHugeNumbersIsRefused) {
  EXPECT_ERROR(Recipe::parse("- semi_sparse: {params: ['re:a{11111111111111111111}']}", "r.yaml"),
               "holds a number of 10 or more digits");
}

// Found by fuzzing: bytes that are not UTF-8 in a regex did not survive to_yaml (the
// checkpoint's copy of the recipe), so a resumed run would have followed another recipe.
TEST(Recipe, TextThatIsNotUtf8IsRefused) {
  EXPECT_ERROR(Recipe::parse("- semi_sparse: {params: ['re:blocks\\.\xff.*']}", "r.yaml"),
               "r.yaml: recipe: not UTF-8 text (byte 37)");
  EXPECT_NE(esplag::testing::error_of([] { parse_train_config("train: {steps: 4}\n# \xfe\n", "c.yaml"); })
                .find("c.yaml: not UTF-8 text (byte 20)"),
            std::string::npos);
}

// Found by fuzzing: 're:blocks\.\d+\***...' made std::regex backtrack for minutes. A
// repetition of something already quantified is refused; the patterns recipes use pass.
TEST(Recipe, NestedRepetitionInARegexIsRefused) {
  for (const char* rx : {"a**", "blocks\\.\\d+\\*+*x", "(a+)*", "(?:b(a*))+", "x{2}*", "(a?)+"}) {
    SCOPED_TRACE(rx);
    EXPECT_ERROR(Recipe::parse(std::string("- semi_sparse: {params: ['re:") + rx + "']}", "r.yaml"),
                 "whose matching can take exponential time");
  }
  for (const char* rx : {"blocks\\.\\d+\\.mlp\\..*", "blocks\\.(0|1)\\.attn\\.(qkv|proj)\\.weight", "(ab)+c*", "a*?b",
                         "[*+]+x", "(a)?b+", "a\\**"}) {
    SCOPED_TRACE(rx);
    EXPECT_NO_THROW(Recipe::parse(std::string("- semi_sparse: {params: ['re:") + rx + "']}", "r.yaml"));
  }
}
