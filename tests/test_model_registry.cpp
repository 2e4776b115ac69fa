// The Linear kind registry (model/linear_registry.h): the built-in kinds and their flags,
// the lists and errors made from it, and a kind defined in this file alone ("halves": dense,
// its forward product in two halves of the output features) registered, built by name
// through make_linear, trained inside a Transformer and through a recipe by the trainer,
// step for step equal to dense.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/prepare.h"
#include "model/linear_kinds.h"
#include "model/linear_registry.h"
#include "model/transformer.h"
#include "ops/adamw.h"
#include "ops/matmul.h"
#include "train/trainer.h"

using namespace esplag;

namespace {

// Dense, but the forward product runs as two GEMMs, one per half of the output features.
// Each output element is the same dot product as dense's, so the numbers are exactly equal.
template <typename T>
class HalvesLinear final : public Linear<T> {
 public:
  using Linear<T>::Linear;
  void forward(T* out, const T* inp, int N) override {
    const auto& p = this->params();
    const int half = p.out_features / 2;
    for (int part = 0; part < 2; ++part) {
      const int first = part * half, count = part == 0 ? half : p.out_features - half;
      std::vector<T> y(size_t(N) * count);
      cpu::linear_forward(y.data(), inp, p.weight + size_t(first) * p.in_features, p.bias ? p.bias + first : nullptr,
                          N, p.in_features, count);
      for (int n = 0; n < N; ++n)
        std::copy(y.begin() + size_t(n) * count, y.begin() + size_t(n + 1) * count,
                  out + size_t(n) * p.out_features + first);
    }
  }
  void backward(T* dinp, const T* dout, const T* inp, int N) override { this->dense_backward(dinp, dout, inp, N); }
  std::string kind() const override { return "halves"; }
};

// The registry is per process and keeps what is registered: register once, whichever test
// comes first.
void register_halves() {
  if (lookup_linear_kind("halves")) return;
  LinearKindInfo k;
  k.name = "halves";
  k.description = "dense, its forward product in two halves of the output features";
  k.recipe_modifier = true;
  k.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
    return std::make_unique<HalvesLinear<T>>(b.params);
  });
  register_linear_kind(std::move(k));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

ModelConfig tiny() {
  ModelConfig c = model_preset("tiny");
  c.vocab_size = 11;
  c.max_seq_len = 6;
  c.n_layer = 2;
  c.d_model = 16;
  c.n_head = 2;
  c.n_kv_head = 2;
  c.d_ff = 32;
  return c;
}

// Losses of `steps` AdamW steps on a fixed batch, every block Linear of kind `kind`.
std::vector<double> train_losses(const std::string& kind, int steps) {
  Transformer<float> model(tiny());
  model.init_weights(3);
  for (const auto& name : model.linear_names()) {
    LinearOptions o;
    o.kind = kind;
    model.replace_linear(name, make_linear(model.linear_params(name), o, &model.linear(name)));
    EXPECT_EQ(model.linear(name).kind(), kind);
  }
  const int B = 2, T = 5;
  std::vector<int32_t> x(B * T), y(B * T);
  Rng rng(4);
  for (auto& t : x) t = int32_t(rng.below(11));
  for (auto& t : y) t = int32_t(rng.below(11));
  std::map<std::string, std::vector<float>> m, v;
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    model.on_step_begin(step);
    model.zero_grad();
    losses.push_back(model.forward_backward(x.data(), y.data(), B, T, 1.0));
    for (auto& p : model.trainable_params()) {
      const size_t n = size_t(shape_numel(p.shape));
      if (m[p.name].size() != n) m[p.name].assign(n, 0.f), v[p.name].assign(n, 0.f);
      cpu::adamw_step(p.value, p.grad, m[p.name].data(), v[p.name].data(), int64_t(n), 1e-2, 0.9, 0.95, 1e-8,
                      p.decay ? 0.1 : 0.0, step + 1);
    }
    model.after_optimizer_step();
  }
  return losses;
}

}  // namespace

TEST(LinearRegistry, BuiltInKindsInOrderWithTheirFlags) {
  const auto& kinds = linear_kinds();
  ASSERT_GE(kinds.size(), 6u);
  std::vector<std::string> names, stored, dw, own_adapter, gpu;
  for (size_t i = 0; i < 6; ++i) {
    const LinearKindInfo& k = kinds[i];
    names.push_back(k.name);
    EXPECT_FALSE(k.description.empty()) << k.name;
    if (k.stores_sparse_weight) stored.push_back(k.name);
    if (k.takes_sparse_dw) dw.push_back(k.name);
    if (k.adapter == AdapterStyle::own) own_adapter.push_back(k.name);
    if (k.gpu) gpu.push_back(k.name);
  }
  using V = std::vector<std::string>;
  EXPECT_EQ(names, (V{"dense", "masked", "semi_sparse", "semi_sparse_activation", "slope", "vnm"}));
  EXPECT_EQ(stored, (V{"masked", "slope", "vnm"}));
  EXPECT_EQ(dw, (V{"semi_sparse", "slope"}));
  EXPECT_EQ(own_adapter, (V{"slope"}));
  EXPECT_EQ(gpu, names);
  EXPECT_EQ(dense_linear_kind(), "dense");
  EXPECT_TRUE(find_linear_kind("semi_sparse_activation", "test").takes_activation);
  EXPECT_TRUE(find_linear_kind("masked", "test").host_rechooses_mask);
  EXPECT_FALSE(find_linear_kind("vnm", "test").host_rechooses_mask);  // its mask is frozen
  EXPECT_EQ(base_linear_kind("masked+lora"), "masked");
  EXPECT_EQ(base_linear_kind("slope"), "slope");
}

TEST(LinearRegistry, MessagesAreQueriesOfIt) {
  EXPECT_EQ(gpu_kinds_note(), "the GPU trains dense, masked, semi_sparse, semi_sparse_activation, slope and vnm "
                              "Linear layers only so far");
  EXPECT_EQ(linear_kind_list([](const LinearKindInfo& k) { return k.takes_sparse_dw; }, "or"), "semi_sparse or slope");
  const std::string e = error_of([] { find_linear_kind("sparse_magic", "linear 'w'"); });
  EXPECT_TRUE(contains(e, "linear 'w': unknown kind 'sparse_magic' (known kinds: dense, masked, semi_sparse, "
                          "semi_sparse_activation, slope"))
      << e;
  EXPECT_EQ(lookup_linear_kind("sparse_magic"), nullptr);
  EXPECT_TRUE(gpu_trains_kind("slope"));
  EXPECT_FALSE(gpu_trains_kind("masked+lora"));
  EXPECT_FALSE(gpu_trains_kind("sparse_magic"));
}

TEST(LinearRegistry, TheDocsHaveARowAndASectionForEveryBuiltInKind) {
  std::ifstream in(std::string(ESPLAG_SOURCE_DIR) + "/docs/linear-kinds.md");
  ASSERT_TRUE(in) << "docs/linear-kinds.md";
  std::stringstream text;
  text << in.rdbuf();
  const std::string doc = text.str();
  for (size_t i = 0; i < 6; ++i) {
    const std::string& name = linear_kinds()[i].name;
    EXPECT_TRUE(contains(doc, "\n| `" + name + "` |")) << name << ": no row in the summary table";
    if (name != dense_linear_kind()) EXPECT_TRUE(contains(doc, "\n## " + name + "\n")) << name << ": no section";
  }
}

TEST(LinearRegistry, RegistrationRefusesBadKinds) {
  register_halves();
  LinearKindInfo again;
  again.name = "halves";
  again.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
    return std::make_unique<HalvesLinear<T>>(b.params);
  });
  EXPECT_TRUE(contains(error_of([&] { register_linear_kind(again); }), "kind 'halves' is registered already"));
  again.name = "Halves+lora";
  EXPECT_TRUE(contains(error_of([&] { register_linear_kind(again); }), "'Halves+lora' is not a word"));
  LinearKindInfo no_maker;
  no_maker.name = "no_maker";
  EXPECT_TRUE(contains(error_of([&] { register_linear_kind(no_maker); }), "kind 'no_maker' has no make_cpu"));
  EXPECT_EQ(lookup_linear_kind("no_maker"), nullptr);
}

TEST(LinearRegistry, ARegisteredKindIsBuiltByName) {
  register_halves();
  const auto names = linear_kind_names();
  EXPECT_EQ(names.back(), "halves");
  EXPECT_TRUE(contains(error_of([] { find_linear_kind("nope", "x"); }), "slope, vnm and halves)"));
  EXPECT_FALSE(gpu_trains_kind("halves"));  // no GPU entry: the trainer keeps it on the CPU

  const int N = 3, in = 8, out = 6;
  std::vector<double> w(size_t(out) * in), b(out), dw(w.size()), db(out), x(size_t(N) * in);
  Rng rng(7);
  for (auto* vec : {&w, &b, &x})
    for (auto& e : *vec) e = rng.normal();
  LinearParams<double> p;
  p.name = "blocks.0.mlp.fc.weight";
  p.module = "blocks.0.mlp.fc";
  p.in_features = in;
  p.out_features = out;
  p.weight = w.data();
  p.bias = b.data();
  p.dweight = dw.data();
  p.dbias = db.data();
  LinearOptions o;
  o.kind = "halves";
  auto halves = make_linear(p, o);
  EXPECT_EQ(halves->kind(), "halves");
  o.kind = "dense";
  auto dense = make_linear(p, o);
  std::vector<double> y(size_t(N) * out), want(y.size());
  halves->forward(y.data(), x.data(), N);
  dense->forward(want.data(), x.data(), N);
  EXPECT_EQ(y, want);

  // make_linear's own parts apply to it: the LoRA wrapper, the refusal of sparse_dw.
  o.kind = "halves";
  o.lora_rank = 2;
  o.lora_enabled = true;
  EXPECT_EQ(make_linear(p, o)->kind(), "halves+lora");
  o.lora_enabled = false;
  o.sparse_dw = true;
  const std::string e = error_of([&] { make_linear(p, o); });
  EXPECT_TRUE(contains(e, "sparse_dw (the weight gradient from the MVUE 2:4 of dY^T) is an option of the kinds "
                          "semi_sparse and slope, not of halves"))
      << e;
}

TEST(LinearRegistry, ARegisteredKindTrainsInTheTransformer) {
  register_halves();
  const std::vector<double> halves = train_losses("halves", 5), dense = train_losses("dense", 5);
  ASSERT_EQ(halves.size(), 5u);
  for (double l : halves) ASSERT_TRUE(std::isfinite(l));
  EXPECT_LT(halves.back(), halves.front()) << "training lowers the loss on a fixed batch";
  EXPECT_EQ(halves, dense) << "the halves' products are dense's, element for element";
}

namespace {

// Losses by step of a 6-step run on a small byte-token corpus, with `recipe` (YAML list).
std::map<int64_t, double> run_losses(const std::string& name, const std::string& recipe,
                                     std::vector<std::string>& log) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("esplag_test_registry_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::string text;
  for (int i = 0; i < 300; ++i) text += "In the beginning was the word " + std::to_string(i % 7) + ".\n";
  std::ofstream(dir / "corpus.txt") << text;
  prepare_dataset((dir / "corpus.txt").string(), ByteTokenizer(), (dir / "data").string(), 0.1, 1 << 20);
  const TrainConfig cfg = parse_train_config(R"(
model: {preset: tiny, n_layer: 2, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 32}
train: {batch_size: 4, seq_len: 32, steps: 6, log_every: 1, eval_every: 0, checkpoint_every: 0, device: cpu}
optimizer: {lr: 1.0e-2}
recipe: )" + recipe,
                                             "test", {"data.path=" + (dir / "data").string()});
  Trainer(cfg, (dir / "run").string(), [&](const std::string& line) { log.push_back(line); }).run();
  std::map<int64_t, double> losses;
  std::ifstream in(dir / "run" / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) losses[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  fs::remove_all(dir);
  return losses;
}

}  // namespace

// The kind's own modifier (LinearKindInfo::recipe_modifier) holds the MLP layers as "halves"
// over steps [2, 4), dense after: the trainer builds them by name, and the losses are a
// dense run's, step for step.
TEST(LinearRegistry, ARegisteredKindTrainsThroughARecipe) {
  register_halves();
  std::vector<std::string> log, dense_log;
  const auto halves = run_losses(
      "halves", "[{halves: {params: ['re:blocks\\.\\d+\\.mlp\\..*'], start: 2, until: 4}}]", log);
  const auto dense = run_losses("dense", "[]", dense_log);
  ASSERT_EQ(halves.size(), 6u);
  EXPECT_EQ(halves, dense);
  const auto logged = [&](const std::string& part) {
    return std::count_if(log.begin(), log.end(), [&](const std::string& l) { return contains(l, part); });
  };
  EXPECT_EQ(logged("step 2: blocks.0.mlp.fc.weight -> halves"), 1);
  EXPECT_EQ(logged("-> halves"), 4) << "the 4 MLP layers of 2 blocks";
  EXPECT_EQ(logged("step 4: blocks.1.mlp.proj.weight -> dense"), 1);
  // An unknown modifier's message lists the registered kind's.
  EXPECT_TRUE(contains(error_of([] { (void)Recipe::parse("[{halve: {params: ['x']}}]", "test"); }), "halves"));
}
