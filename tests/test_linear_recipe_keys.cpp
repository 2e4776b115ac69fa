// A kind's recipe keys come from its registry entry (LinearKindInfo::recipe_keys): the
// built-in kinds' modifiers, and a kind defined here whose modifier takes sparse_dw and
// until, parsed into the LinearOptions its layers get; and the registry refuses keys a
// recipe cannot set for the kind.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/linear_registry.h"
#include "train/recipe.h"
#include "test_util.h"

using namespace esplag;
using esplag::testing::error_of;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

LinearKindInfo dense_kind(const std::string& name) {
  LinearKindInfo k;
  k.name = name;
  k.description = "dense products";
  k.recipe_modifier = true;
  k.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
    return std::make_unique<DenseLinear<T>>(b.params);
  });
  return k;
}

// "sparse_dense": a kind whose modifier takes sparse_dw and until (registered once).
void register_sparse_dense() {
  if (lookup_linear_kind("sparse_dense")) return;
  LinearKindInfo k = dense_kind("sparse_dense");
  k.takes_sparse_dw = true;
  k.recipe_keys = {"until", "sparse_dw"};
  register_linear_kind(std::move(k));
}

std::vector<std::string> with_params_start(const std::vector<std::string>& keys) {
  std::vector<std::string> out{"params", "start"};
  out.insert(out.end(), keys.begin(), keys.end());
  return out;
}

}  // namespace

TEST(LinearRecipeKeys, TheBuiltInKindsModifiersHaveTheKeysOfTheirRegistryEntries) {
  for (const char* kind : {"semi_sparse", "semi_sparse_activation", "slope"}) {
    const LinearKindInfo* k = lookup_linear_kind(kind);
    ASSERT_TRUE(k && k->recipe_modifier) << kind;
    EXPECT_EQ(Recipe::modifier_keys(kind), with_params_start(k->recipe_keys)) << kind;
  }
  EXPECT_EQ(Recipe::modifier_keys("slope"), (std::vector<std::string>{"params", "start", "mask_change_freq", "lora_rank",
                                                                      "lora_start", "sparse_dw"}));
  // masked and vnm are reached through gradual_magnitude and kernel_replacement.
  EXPECT_TRUE(Recipe::modifier_keys("masked").empty());
  EXPECT_TRUE(Recipe::modifier_keys("vnm").empty());
  EXPECT_EQ(Recipe::modifier_keys("kernel_replacement"),
            (std::vector<std::string>{"params", "start", "lora_rank", "lora_start"}));
}

TEST(LinearRecipeKeys, ARegisteredKindsModifierTakesTheKeysItsEntryLists) {
  register_sparse_dense();
  EXPECT_EQ(Recipe::modifier_keys("sparse_dense"),
            (std::vector<std::string>{"params", "start", "until", "sparse_dw"}));
  Recipe r = Recipe::parse(
      "- sparse_dense: {params: [blocks.0.mlp.fc.weight], start: 2, until: 6, sparse_dw: true}\n", "r.yaml");
  r.validate({{"blocks.0.mlp.fc.weight", {256, 64}}}, 10);
  const LayerPlan p = r.plan_at(3).at("blocks.0.mlp.fc.weight");
  EXPECT_EQ(p.kind, "sparse_dense");
  EXPECT_TRUE(p.sparse_dw);
  EXPECT_EQ(r.plan_at(6).at("blocks.0.mlp.fc.weight").kind, "dense");
  EXPECT_TRUE(contains(r.to_yaml(), "sparse_dw: true")) << r.to_yaml();
  EXPECT_EQ(Recipe::parse(r.to_yaml(), "r.yaml").to_yaml(), r.to_yaml());

  const std::string err = error_of([] {
    Recipe::parse("- sparse_dense: {params: [blocks.0.mlp.fc.weight], lora_rank: 4}\n", "r.yaml");
  });
  EXPECT_TRUE(contains(err, "r.yaml: recipe[0] (sparse_dense): unknown key 'lora_rank' (known: params, start, until, "
                            "sparse_dw)"))
      << err;
}

TEST(LinearRecipeKeys, RegistrationRefusesKeysARecipeCannotSetForTheKind) {
  auto refused = [](const std::string& name, std::vector<std::string> keys) {
    LinearKindInfo k = dense_kind(name);
    k.recipe_keys = std::move(keys);
    return error_of([&] { register_linear_kind(k); });
  };
  std::string err = refused("bad_key", {"until", "rank"});
  EXPECT_TRUE(contains(err, "kind 'bad_key': recipe key 'rank' is not one a recipe knows (until, lora_start, "
                            "activation, mask_change_freq, lora_rank, sparse_dw)"))
      << err;
  err = refused("twice", {"until", "until"});
  EXPECT_TRUE(contains(err, "kind 'twice': recipe key 'until' is listed twice")) << err;
  err = refused("no_dw", {"sparse_dw"});
  EXPECT_TRUE(contains(err, "kind 'no_dw': recipe key 'sparse_dw' needs takes_sparse_dw")) << err;
  err = refused("no_act", {"activation"});
  EXPECT_TRUE(contains(err, "kind 'no_act': recipe key 'activation' needs takes_activation")) << err;
  err = refused("half_lora", {"lora_rank"});
  EXPECT_TRUE(contains(err, "kind 'half_lora': recipe keys 'lora_rank' and 'lora_start' go together")) << err;
  for (const char* name : {"bad_key", "twice", "no_dw", "no_act", "half_lora"})
    EXPECT_EQ(lookup_linear_kind(name), nullptr) << name << " was registered";
}
