// Activation checkpointing of the CPU Transformer (model/activation_checkpointing.h): with
// full or selective checkpoints of every block or every K-th, the loss, every gradient
// (the flat buffer and what Linear kinds own) and every kind's state (masks, sparse_dw's
// draw count) are bit-identical to keeping all activations, for every Linear kind the CPU
// has, over steps; the activations actually allocated shrink and equal the estimate the
// host-memory check uses; the config keys and the device rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/prepare.h"
#include "data/tokenizer.h"
#include "model/linear_kinds.h"
#include "model/transformer.h"
#include "test_util.h"
#include "train/config.h"
#include "train/host_memory.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

using namespace esplag;
using esplag::testing::contains;
using esplag::testing::error_of;
using esplag::testing::TempDir;

namespace {

constexpr int kB = 2, kT = 8;  // 16 tokens: a multiple of 4, as sparse_dw's MVUE needs

ModelConfig model_config(NormKind norm, PosKind pos, MlpKind mlp) {
  ModelConfig c = model_preset("tiny");
  c.vocab_size = 37;
  c.max_seq_len = 16;
  c.n_layer = 3;  // with every 2: blocks 0 and 2 checkpointed, block 1 not
  c.n_head = 4;
  c.n_kv_head = pos == PosKind::rope ? 2 : 4;
  c.d_model = 32;
  c.d_ff = 64;
  c.norm = norm;
  c.pos = pos;
  c.mlp = mlp;
  return c;
}

// How every block Linear of a model is built: a kind and its options.
struct KindSetup {
  std::string label;
  LinearOptions options;
};

std::vector<KindSetup> every_cpu_kind() {
  std::vector<KindSetup> kinds;
  auto add = [&](const std::string& label, const std::string& kind, auto&& tweak) {
    LinearOptions o;
    o.kind = kind;
    o.seed = 99;
    tweak(o);
    kinds.push_back({label, o});
  };
  add("dense", "dense", [](LinearOptions&) {});
  add("dense+lora", "dense", [](LinearOptions& o) { o.lora_rank = 4, o.lora_enabled = true; });
  add("masked 2:4", "masked", [](LinearOptions& o) { o.pattern = SparsityPattern::nm(2, 4); });
  add("masked unstructured", "masked", [](LinearOptions& o) { o.pattern = SparsityPattern::unstructured(0.6); });
  add("semi_sparse", "semi_sparse", [](LinearOptions&) {});
  add("semi_sparse sparse_dw", "semi_sparse", [](LinearOptions& o) { o.sparse_dw = true; });
  add("semi_sparse_activation row_24", "semi_sparse_activation",
      [](LinearOptions& o) { o.activation = ActivationSparsity::row_24; });
  add("semi_sparse_activation tile_24", "semi_sparse_activation",
      [](LinearOptions& o) { o.activation = ActivationSparsity::tile_24; });
  add("slope sparse_dw with adapter", "slope", [](LinearOptions& o) {
    o.sparse_dw = true, o.mask_change_freq = 1, o.lora_rank = 4, o.lora_enabled = true;
  });
  add("vnm 16:2:8", "vnm", [](LinearOptions& o) { o.pattern = SparsityPattern::vnm(16, 2, 8); });
  return kinds;
}

std::unique_ptr<Transformer<float>> make_model(const ModelConfig& c, const KindSetup& kind,
                                               const ActivationCheckpointing& ckpt) {
  auto m = std::make_unique<Transformer<float>>(c);
  m->init_weights(7);
  for (const auto& name : m->linear_names())
    m->replace_linear(name, make_linear(m->linear_params(name), kind.options, &m->linear(name)));
  // Non-zero adapters, so that their products matter in the forward.
  for (auto& p : m->trainable_params())
    if (contains(p.name, "lora")) {
      Rng rng(std::hash<std::string>{}(p.name));
      for (int64_t i = 0; i < shape_numel(p.shape); ++i) p.value[i] = float(0.1 * rng.normal());
    }
  m->set_checkpointing(ckpt);
  return m;
}

std::vector<int32_t> tokens(int n, uint64_t seed, int vocab) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng.next_u64() % uint64_t(vocab));
  return t;
}

// Everything a step produces that the optimizer or a checkpoint reads, as bytes per name.
std::map<std::string, std::vector<char>> step_results(Transformer<float>& m) {
  std::map<std::string, std::vector<char>> out;
  auto bytes = [](const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    return std::vector<char>(c, c + n);
  };
  out["flat gradients"] = bytes(m.grads(), m.num_params() * sizeof(float));
  for (auto& p : m.trainable_params()) out[p.name + " (grad)"] = bytes(p.grad, shape_numel(p.shape) * sizeof(float));
  for (const auto& name : m.linear_names())
    for (const auto& [key, t] : m.linear(name).state()) out[key + " (state)"] = bytes(t.raw(), t.nbytes());
  return out;
}

// Three steps of two micro-batches each (no optimizer step: the weights stay, so only a
// change in what the layers do, e.g. an extra sparse_dw draw, could make them differ).
std::vector<std::map<std::string, std::vector<char>>> run_steps(Transformer<float>& m, std::vector<double>& losses) {
  std::vector<std::map<std::string, std::vector<char>>> per_step;
  const int V = m.config().vocab_size;
  for (int step = 0; step < 3; ++step) {
    m.on_step_begin(step);
    m.zero_grad();
    for (int micro = 0; micro < 2; ++micro) {
      const auto x = tokens(kB * kT, 100 + 10 * step + micro, V), y = tokens(kB * kT, 200 + 10 * step + micro, V);
      losses.push_back(m.forward_backward(x.data(), y.data(), kB, kT, 0.5));
    }
    per_step.push_back(step_results(m));
  }
  return per_step;
}

std::string describe(const ActivationCheckpointing& c) {
  return to_string(c.mode) + " every " + std::to_string(c.every);
}

const ActivationCheckpointing kModes[] = {
    {CheckpointMode::full, 1}, {CheckpointMode::selective, 1}, {CheckpointMode::full, 2},
    {CheckpointMode::selective, 2}, {CheckpointMode::full, 5}};

}  // namespace

TEST(ActivationCheckpointing, GradientsAndStateAreBitIdenticalForEveryKind) {
  const ModelConfig configs[] = {model_config(NormKind::layernorm, PosKind::learned, MlpKind::gelu),
                                 model_config(NormKind::rmsnorm, PosKind::rope, MlpKind::swiglu),
                                 model_config(NormKind::rmsnorm, PosKind::rope, MlpKind::relu2)};
  for (const ModelConfig& c : configs) {
    for (const KindSetup& kind : every_cpu_kind()) {
      SCOPED_TRACE(kind.label + ", " + to_string(c.norm) + " " + to_string(c.pos) + " " + to_string(c.mlp));
      auto reference = make_model(c, kind, {});
      std::vector<double> ref_losses;
      const auto ref = run_steps(*reference, ref_losses);
      ASSERT_GT(ref[0].size(), 1u);
      for (const ActivationCheckpointing& mode : kModes) {
        SCOPED_TRACE(describe(mode));
        auto m = make_model(c, kind, mode);
        std::vector<double> losses;
        const auto got = run_steps(*m, losses);
        EXPECT_EQ(losses, ref_losses);
        for (size_t s = 0; s < ref.size(); ++s) {
          ASSERT_EQ(got[s].size(), ref[s].size());
          for (const auto& [name, bytes] : ref[s]) {
            ASSERT_TRUE(got[s].count(name)) << name;
            EXPECT_TRUE(got[s].at(name) == bytes) << "step " << s << ": " << name << " differs";
          }
        }
      }
    }
  }
}

TEST(ActivationCheckpointing, SparseDwDrawsOnlyInTheBackward) {
  // One draw per backward, checkpointed or not: the recomputed forward draws nothing.
  const ModelConfig c = model_config(NormKind::layernorm, PosKind::learned, MlpKind::gelu);
  for (const KindSetup& kind : every_cpu_kind()) {
    if (!kind.options.sparse_dw) continue;
    auto m = make_model(c, kind, {CheckpointMode::full, 1});
    std::vector<double> losses;
    run_steps(*m, losses);
    const auto state = m->linear("blocks.0.mlp.fc.weight").state();
    const auto it = state.find("blocks.0.mlp.fc.weight.sparse_dw_draws");
    ASSERT_NE(it, state.end()) << kind.label;
    EXPECT_EQ(it->second.data<double>()[0], double(losses.size())) << kind.label;
  }
}

TEST(ActivationCheckpointing, EvaluationAndLogitsDoNotChange) {
  const ModelConfig c = model_config(NormKind::rmsnorm, PosKind::rope, MlpKind::swiglu);
  const KindSetup dense{"dense", {}};
  auto reference = make_model(c, dense, {});
  const auto x = tokens(kB * kT, 1, c.vocab_size), y = tokens(kB * kT, 2, c.vocab_size);
  std::vector<float> ref_logits(size_t(kB) * c.vocab_size), logits(ref_logits.size());
  reference->forward_last_logits(x.data(), kB, kT, ref_logits.data());
  for (const ActivationCheckpointing& mode : kModes) {
    auto m = make_model(c, dense, mode);
    EXPECT_EQ(m->forward_loss(x.data(), y.data(), kB, kT), reference->forward_loss(x.data(), y.data(), kB, kT));
    m->forward_last_logits(x.data(), kB, kT, logits.data());
    EXPECT_EQ(logits, ref_logits) << describe(mode);
  }
}

TEST(ActivationCheckpointing, KeepsLessAndTheEstimateIsWhatIsAllocated) {
  const ModelConfig c = model_config(NormKind::layernorm, PosKind::learned, MlpKind::gelu);
  const auto x = tokens(kB * kT, 1, c.vocab_size), y = tokens(kB * kT, 2, c.vocab_size);
  auto allocated = [&](const ActivationCheckpointing& mode) {
    auto m = make_model(c, {"dense", {}}, mode);
    EXPECT_EQ(m->activation_elements(), 0u);
    m->forward_backward(x.data(), y.data(), kB, kT, 1.0);
    const size_t n = m->activation_elements();
    EXPECT_EQ(n, transformer_activation_elements(c, kB, kT, mode)) << describe(mode);
    return n;
  };
  const size_t none = allocated({}), full = allocated({CheckpointMode::full, 1}),
               selective = allocated({CheckpointMode::selective, 1}), full2 = allocated({CheckpointMode::full, 2}),
               selective2 = allocated({CheckpointMode::selective, 2});
  EXPECT_LT(full, selective);
  EXPECT_LT(selective, none);
  EXPECT_LT(full, full2);
  EXPECT_LT(full2, none);
  EXPECT_LT(selective, selective2);
  EXPECT_LT(selective2, none);

  // Changing the mode reallocates on the next forward.
  auto m = make_model(c, {"dense", {}}, {});
  m->forward_backward(x.data(), y.data(), kB, kT, 1.0);
  m->set_checkpointing({CheckpointMode::full, 1});
  EXPECT_EQ(m->activation_elements(), 0u);
  m->forward_backward(x.data(), y.data(), kB, kT, 1.0);
  EXPECT_EQ(m->activation_elements(), full);
  EXPECT_TRUE(contains(error_of([&] { m->set_checkpointing({CheckpointMode::full, 0}); }), "at least 1"));
}

TEST(ActivationCheckpointing, HostActivationBytesOfThePresets) {
  // What each mode keeps on the host (fp32) for presets at their usual micro-batches; the
  // host-memory check of a CPU run adds it to the weights, gradients and moments.
  const std::pair<const char*, std::pair<int, int>> runs[] = {{"gpt2-124m", {4, 1024}}, {"llama-1b", {4, 2048}}};
  for (const auto& [preset, bt] : runs) {
    ModelConfig c = model_preset(preset);
    const auto [B, T] = bt;
    const double gib = 1024.0 * 1024 * 1024;
    const double none = transformer_activation_elements(c, B, T) * 4.0 / gib;
    const double full = transformer_activation_elements(c, B, T, {CheckpointMode::full, 1}) * 4.0 / gib;
    const double sel = transformer_activation_elements(c, B, T, {CheckpointMode::selective, 1}) * 4.0 / gib;
    const double full2 = transformer_activation_elements(c, B, T, {CheckpointMode::full, 2}) * 4.0 / gib;
    std::printf("%s %dx%d host activations: none %.2f GiB, selective %.2f GiB, full %.2f GiB, full every 2 %.2f GiB\n",
                preset, B, T, none, sel, full, full2);
    EXPECT_LT(full, sel);
    EXPECT_LT(sel, none);
    EXPECT_LT(full, 0.25 * none) << preset;  // the attention probabilities dominate what is saved

    TrainConfig tc;
    tc.model = c;
    tc.batch_size = B;
    tc.seq_len = T;
    const uint64_t keep_all = host_bytes_for_training(tc, "cpu");
    tc.checkpointing = {CheckpointMode::full, 1};
    EXPECT_EQ(keep_all - host_bytes_for_training(tc, "cpu"), uint64_t(std::llround((none - full) * gib)));
    EXPECT_EQ(host_bytes_for_training(tc, "cuda"), uint64_t(c.num_params()) * 3 * 4) << "the GPU's host part";
  }
}

TEST(ActivationCheckpointing, TheHostMemoryCheckSuggestsIt) {
  TrainConfig cfg;
  cfg.model = model_config(NormKind::layernorm, PosKind::learned, MlpKind::gelu);
  cfg.batch_size = 16;
  cfg.seq_len = 16;
  TrainConfig full = cfg;
  full.checkpointing = {CheckpointMode::full, 1};
  const uint64_t available = host_bytes_for_training(full, "cpu");
  ASSERT_LT(available, host_bytes_for_training(cfg, "cpu"));
  const std::string e = error_of([&] { check_host_memory(cfg, "cpu", available); });
  EXPECT_TRUE(contains(e, "would fit (with train.grad_accum for the same tokens per step), and so would "
                          "train.checkpointing full with this batch size")) << e;
  EXPECT_NO_THROW(check_host_memory(full, "cpu", available));
  const std::string less = error_of([&] { check_host_memory(cfg, "cpu", available - 1); });
  EXPECT_FALSE(contains(less, "train.checkpointing")) << less;
}

TEST(ActivationCheckpointing, ConfigKeys) {
  const TrainConfig c =
      parse_train_config("train: {checkpointing: selective, checkpointing_every: 2}", "run.yaml");
  EXPECT_EQ(c.checkpointing.mode, CheckpointMode::selective);
  EXPECT_EQ(c.checkpointing.every, 2);
  const TrainConfig back = parse_train_config(to_yaml(c), "config.yaml");
  EXPECT_EQ(back.checkpointing.mode, CheckpointMode::selective);
  EXPECT_EQ(back.checkpointing.every, 2);
  const TrainConfig defaults = parse_train_config("train: {steps: 10}", "run.yaml");
  EXPECT_EQ(defaults.checkpointing.mode, CheckpointMode::none);
  EXPECT_EQ(defaults.checkpointing.every, 1);
  EXPECT_EQ(parse_train_config("", "run.yaml", {"train.checkpointing=full"}).checkpointing.mode, CheckpointMode::full);

  EXPECT_EQ(error_of([] { parse_train_config("train: {checkpointing: fast}", "run.yaml"); }),
            "run.yaml: train.checkpointing must be none, full or selective, got 'fast'");
  EXPECT_EQ(error_of([] { parse_train_config("train: {checkpointing_every: 0}", "run.yaml"); }),
            "run.yaml: config key 'train.checkpointing_every' must be an integer in [1, 2147483647], got 0");
  EXPECT_EQ(error_of([] { parse_train_config("", "run.yaml", {"train.checkpointing=yes"}); }),
            "--set train.checkpointing=yes: train.checkpointing must be none, full or selective, got 'yes'");
}

TEST(ActivationCheckpointing, CpuRunTrainsTheSameAndCudaTakesIt) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "In the beginning God created the heaven and the earth. " + std::to_string(i) + "\n";
  esplag::testing::write_text(dir.file("corpus.txt"), text);
  prepare_dataset(dir.file("corpus.txt"), ByteTokenizer(), dir.file("data"), 0.1, 1 << 20);
  auto config = [&](const std::string& device, const std::string& mode) {
    return parse_train_config(R"(
model: {preset: tiny, n_layer: 2, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 16}
train: {batch_size: 2, seq_len: 16, steps: 3, grad_accum: 2, log_every: 1, eval_every: 0, eval_batches: 1, checkpoint_every: 0}
)",
                              "test",
                              {"data.path=" + dir.file("data"), "train.device=" + device, "train.checkpointing=" + mode});
  };
  auto quiet = [](const std::string&) {};

  // The GPU has activation checkpointing too: cuda is refused only where any run is (a build
  // without CUDA, no device), never for the mode.
  const std::string e = error_of([&] { Trainer(config("cuda", "selective"), dir.file("run_cuda"), quiet); });
  EXPECT_FALSE(contains(e, "checkpointing")) << e;
#ifndef ESPLAG_HAVE_CUDA
  EXPECT_TRUE(contains(e, "train.device=cuda: this esplag was built without the CUDA backend")) << e;
#endif

  Trainer plain(config("cpu", "none"), dir.file("run_none"), quiet);
  plain.run();
  Trainer checkpointed(config("cpu", "full"), dir.file("run_full"), quiet);
  EXPECT_EQ(checkpointed.device(), "cpu");
  checkpointed.run();
  EXPECT_EQ(checkpointed.model().checkpointing().mode, CheckpointMode::full);
  ASSERT_EQ(plain.model().num_params(), checkpointed.model().num_params());
  EXPECT_EQ(std::memcmp(plain.model().params(), checkpointed.model().params(),
                        plain.model().num_params() * sizeof(float)),
            0)
      << "three AdamW steps with checkpointing end at the same weights";

  // A resumed run keeps the mode (it is in config.yaml).
  auto resumed = Trainer::resume(dir.file("run_full"), quiet, 4, "cpu");
  EXPECT_EQ(resumed->config().checkpointing.mode, CheckpointMode::full);
  EXPECT_EQ(resumed->run().steps, 4);
  EXPECT_EQ(resumed->model().checkpointing().mode, CheckpointMode::full);
}
