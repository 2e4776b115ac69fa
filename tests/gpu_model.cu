// The GPU attention kernels and the GPU transformer against the CPU references.
//
// Attention: gpu::attention_forward / attention_backward against cpu::attention_forward /
// attention_backward in fp64 on seeded bf16-representable inputs, at sizes that are not
// multiples of the tiles (T = 37, 130, 200), head sizes on the tensor-core path (32, 64,
// 128) and off it (24, 16, 40), grouped-query heads, outputs poisoned with NaN first.
// Both paths must be within bf16 accuracy of the reference: relative RMS error at most
// 1e-2 and a max error at most 3x that of the fp32 CPU result rounded to bf16 plus 2% of
// the largest value (the tensor-core kernels also round the probabilities and dS to bf16
// before their products, which the CPU computation does not).
//
// Model: the same initial weights in Transformer<float> and GpuTransformer, one
// forward_backward on the same batch; the loss within 2e-2 relative and every
// parameter's gradient within 3e-2 relative L2 error (bf16 activations against fp32).
// Then 30 training steps of the tiny model on structured tokens, CPU and GPU, whose
// loss curves must agree within bf16 tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "model/gpu_transformer.h"
#include "model/transformer.h"
#include "ops/adamw.h"
#include "ops/attention.h"
#include "ops/gpu_attention.h"

namespace {

using esplag::DeviceArena;
using esplag::GpuModelOptions;
using esplag::GpuTransformer;
using esplag::ModelConfig;
using esplag::Rng;
using esplag::Transformer;
using esplag::gpu::AttentionPath;
using esplag::gpu::bf16;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;

using Bits = std::vector<uint16_t>;
using VF = std::vector<float>;
using VD = std::vector<double>;

bool has_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define REQUIRE_DEVICE() ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"

float round_bf16(float x) { return esplag::bf16_to_float(esplag::float_to_bf16(x)); }

struct Data {
  Bits bits;
  VF f;
  VD d;
};

Data random_bf16(size_t n, uint64_t seed, double scale) {
  Rng rng(seed);
  Data out;
  out.bits.resize(n);
  out.f.resize(n);
  out.d.resize(n);
  for (size_t i = 0; i < n; ++i) {
    out.bits[i] = esplag::float_to_bf16(static_cast<float>(scale * rng.normal()));
    out.f[i] = esplag::bf16_to_float(out.bits[i]);
    out.d[i] = out.f[i];
  }
  return out;
}

class Dev {
 public:
  Dev() : arena_(size_t(64) << 20, "test") { CUDA_CHECK(cudaStreamCreate(&stream_)); }
  ~Dev() { cudaStreamDestroy(stream_); }
  cudaStream_t stream() const { return stream_; }
  template <typename T>
  T* put(const std::vector<T>& h) {
    T* d = arena_.allocate_array<T>("input", std::max<size_t>(h.size(), 1));
    CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  template <typename T>
  T* poisoned(size_t n) {
    T* d = arena_.allocate_array<T>("output", std::max<size_t>(n, 1));
    CUDA_CHECK(cudaMemset(d, 0xFF, n * sizeof(T)));  // NaN as bf16 and as fp32
    return d;
  }
  template <typename T>
  std::vector<T> get(const T* d, size_t n) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<T> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  VF get_bf16(const bf16* d, size_t n) {
    const auto b = get(reinterpret_cast<const uint16_t*>(d), n);
    VF v(n);
    for (size_t i = 0; i < n; ++i) v[i] = esplag::bf16_to_float(b[i]);
    return v;
  }
  void* scratch(size_t bytes) { return arena_.allocate("scratch", std::max<size_t>(bytes, 1)); }

 private:
  DeviceArena arena_;
  cudaStream_t stream_ = nullptr;
};

struct Err {
  double rms = 0, max = 0;
};

template <typename V>
Err error_of(const VD& ref, const V& x) {
  Err e;
  double ss = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(static_cast<double>(x[i]) - ref[i]);
    ss += d * d;
    e.max = std::max(e.max, d);
  }
  e.rms = ref.empty() ? 0 : std::sqrt(ss / ref.size());
  return e;
}

// bf16 output `got` against the fp64 reference; `low` is the fp32 CPU result.
void expect_bf16_close(const std::string& what, const VD& ref, const VF& low, const VF& got) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!std::isfinite(got[i]) && bad++ == 0) first_bad = i;
  ASSERT_EQ(bad, 0u) << what << ": " << bad << " non-finite outputs (unwritten or NaN), first at " << first_bad;
  VF low_bf(low.size());
  for (size_t i = 0; i < low.size(); ++i) low_bf[i] = round_bf16(low[i]);
  const Err eg = error_of(ref, got), el = error_of(ref, low_bf), mag = error_of(ref, VD(ref.size(), 0.0));
  std::printf("  %-40s rel rms %.2e (bf16-rounded CPU %.2e), max %.2e (CPU %.2e, |ref| max %.2e)\n", what.c_str(),
              eg.rms / (mag.rms + 1e-300), el.rms / (mag.rms + 1e-300), eg.max, el.max, mag.max);
  // The absolute floor covers gradients that are exactly 0 (a single position), which
  // the kernels reproduce up to fp32 rounding of dP - delta.
  EXPECT_LE(eg.rms, 1e-2 * mag.rms + 1e-6) << what << ": relative RMS error above 1e-2";
  EXPECT_LE(eg.max, 3 * el.max + 2e-2 * mag.max + 1e-6) << what << ": max error " << eg.max;
}

// ---------------------------------------------------------------------------------------
// Attention kernels

const char* path_name(AttentionPath p) { return p == AttentionPath::generic ? "generic" : "auto"; }

void run_attention(int B, int T, int NH, int NKV, int HD, AttentionPath path, double qk_scale, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " HD=" << HD
                                    << " path=" << path_name(path) << " scale=" << qk_scale);
  std::printf("attention B=%d T=%d NH=%d NKV=%d HD=%d path=%s%s scale=%.1f\n", B, T, NH, NKV, HD, path_name(path),
              path == AttentionPath::automatic && gpu::attention_tensor_core_head_dim(HD) ? " (tensor cores)" : "",
              qk_scale);
  Dev dev;
  const size_t C = size_t(NH + 2 * NKV) * HD, nq = size_t(B) * T * C, no = size_t(B) * T * NH * HD;
  const size_t ns = size_t(B) * NH * T;
  const Data qkv = random_bf16(nq, seed, qk_scale);
  const Data dout = random_bf16(no, seed + 1, 1.0);

  bf16* d_qkv = reinterpret_cast<bf16*>(dev.put(qkv.bits));
  bf16* d_dout = reinterpret_cast<bf16*>(dev.put(dout.bits));
  bf16* d_out = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(no));
  float* d_lse = dev.poisoned<float>(ns);
  bf16* d_dqkv = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(nq));
  const size_t sb = gpu::attention_backward_scratch_bytes(B, T, NH);
  void* scratch = dev.scratch(sb);
  gpu::attention_forward(d_out, d_lse, d_qkv, B, T, NH, NKV, HD, dev.stream(), path);
  gpu::attention_backward(d_dqkv, d_dout, d_qkv, d_out, d_lse, B, T, NH, NKV, HD, scratch, sb, dev.stream(), path);
  const VF out = dev.get_bf16(d_out, no), dqkv = dev.get_bf16(d_dqkv, nq);
  const VF lse = dev.get(d_lse, ns);

  // References: fp64 and fp32.
  VD ref_out(no), ref_att(size_t(B) * NH * T * T), ref_dqkv(nq, 0.0);
  cpu::attention_forward(ref_out.data(), ref_att.data(), qkv.d.data(), B, T, NH, NKV, HD);
  cpu::attention_backward(ref_dqkv.data(), dout.d.data(), qkv.d.data(), ref_att.data(), B, T, NH, NKV, HD);
  VF low_out(no), low_att(size_t(B) * NH * T * T), low_dqkv(nq, 0.f);
  cpu::attention_forward(low_out.data(), low_att.data(), qkv.f.data(), B, T, NH, NKV, HD);
  cpu::attention_backward(low_dqkv.data(), dout.f.data(), qkv.f.data(), low_att.data(), B, T, NH, NKV, HD);

  expect_bf16_close("out", ref_out, low_out, out);
  // dqkv by part: q, k and v gradients have different magnitudes.
  const int parts[4] = {0, NH * HD, (NH + NKV) * HD, (NH + 2 * NKV) * HD};
  const char* names[3] = {"dq", "dk", "dv"};
  for (int p = 0; p < 3; ++p) {
    VD r;
    VF l, g;
    for (size_t row = 0; row < size_t(B) * T; ++row)
      for (int c = parts[p]; c < parts[p + 1]; ++c) {
        r.push_back(ref_dqkv[row * C + c]);
        l.push_back(low_dqkv[row * C + c]);
        g.push_back(dqkv[row * C + c]);
      }
    expect_bf16_close(names[p], r, l, g);
  }

  // The log-sum-exp of each row's scaled scores, in fp64.
  const int group = NH / NKV;
  const double scale = 1.0 / std::sqrt(double(HD));
  double worst = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        const double* q = qkv.d.data() + (size_t(b) * T + t) * C + size_t(h) * HD;
        std::vector<double> s(t + 1);
        double mx = -std::numeric_limits<double>::infinity();
        for (int j = 0; j <= t; ++j) {
          const double* k = qkv.d.data() + (size_t(b) * T + j) * C + size_t(NH + h / group) * HD;
          double dot = 0;
          for (int d = 0; d < HD; ++d) dot += q[d] * k[d];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (double x : s) sum += std::exp(x - mx);
        const double ref = mx + std::log(sum);
        const double got = lse[(size_t(b) * NH + h) * T + t];
        ASSERT_TRUE(std::isfinite(got)) << "lse (" << b << ", " << h << ", " << t << ") not written";
        worst = std::max(worst, std::fabs(got - ref) / (1.0 + std::fabs(ref)));
      }
  std::printf("  %-40s max rel error %.2e\n", "lse", worst);
  EXPECT_LE(worst, 1e-4) << "log-sum-exp";

  // Deterministic: a second backward gives the same bits.
  bf16* d_dqkv2 = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(nq));
  gpu::attention_backward(d_dqkv2, d_dout, d_qkv, d_out, d_lse, B, T, NH, NKV, HD, scratch, sb, dev.stream(), path);
  const auto a = dev.get(reinterpret_cast<const uint16_t*>(d_dqkv), nq);
  const auto b2 = dev.get(reinterpret_cast<const uint16_t*>(d_dqkv2), nq);
  EXPECT_EQ(std::memcmp(a.data(), b2.data(), nq * sizeof(uint16_t)), 0) << "backward differs between runs";
}

class GpuAttention : public ::testing::Test {
 protected:
  void SetUp() override { REQUIRE_DEVICE(); }
};

TEST_F(GpuAttention, GenericHeadSizes) {
  run_attention(2, 37, 6, 2, 24, AttentionPath::automatic, 1.0, 11);  // HD 24: not a tensor-core size
  run_attention(1, 37, 4, 4, 16, AttentionPath::automatic, 1.0, 12);
  run_attention(2, 70, 3, 1, 40, AttentionPath::automatic, 2.0, 13);
  run_attention(1, 1, 2, 1, 24, AttentionPath::automatic, 1.0, 14);  // a single position
}

TEST_F(GpuAttention, TensorCoreHeadSizes) {
  run_attention(2, 37, 6, 2, 64, AttentionPath::automatic, 1.0, 21);   // one partial tile
  run_attention(2, 130, 4, 1, 32, AttentionPath::automatic, 1.0, 22);  // three tiles, the last of 2 rows
  run_attention(1, 130, 4, 2, 128, AttentionPath::automatic, 1.0, 23);
  run_attention(1, 200, 2, 2, 64, AttentionPath::automatic, 3.0, 24);  // peaked softmax: online rescaling
  run_attention(1, 1, 2, 2, 64, AttentionPath::automatic, 1.0, 25);
  run_attention(1, 64, 2, 1, 128, AttentionPath::automatic, 1.0, 26);  // exactly one tile
}

TEST_F(GpuAttention, GenericPathAtTensorCoreHeadSizes) {
  run_attention(2, 37, 6, 2, 64, AttentionPath::generic, 1.0, 31);
  run_attention(1, 130, 4, 2, 128, AttentionPath::generic, 1.0, 32);
  run_attention(2, 70, 4, 1, 32, AttentionPath::generic, 1.0, 33);
}

TEST_F(GpuAttention, RejectsBadShapes) {
  Dev dev;
  bf16* x = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(1024));
  float* l = dev.poisoned<float>(64);
  EXPECT_THROW(gpu::attention_forward(x, l, x, 1, 4, 3, 2, 8, dev.stream()), esplag::Error);    // NH % NKV
  EXPECT_THROW(gpu::attention_forward(x, l, x, 1, 1, 1, 1, 512, dev.stream()), esplag::Error);  // HD too large
  EXPECT_THROW(gpu::attention_backward(x, x, x, x, l, 1, 4, 2, 2, 8, dev.scratch(4), 4, dev.stream()),
               esplag::Error);  // scratch too small
}

// ---------------------------------------------------------------------------------------
// Model

ModelConfig tiny_config() {
  ModelConfig c = esplag::model_preset("tiny");
  c.vocab_size = 257;
  return c;
}

// LLaMA flavour (RMSNorm, RoPE, SwiGLU, GQA, untied, no bias), head size 32.
ModelConfig llama_config() {
  ModelConfig c = esplag::model_preset("llama-tiny");
  c.vocab_size = 384;  // a multiple of 64: the LM head runs unpadded (257 elsewhere: padded)
  c.n_layer = 2;
  c.d_model = 128;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.d_ff = 344;
  return c;
}

// GPT-2 flavour with ReLU², head size 64 (tensor cores), untied.
ModelConfig relu2_config() {
  ModelConfig c = tiny_config();
  c.n_layer = 2;
  c.d_model = 128;
  c.n_head = 2;
  c.n_kv_head = 2;
  c.d_ff = 256;
  c.mlp = esplag::MlpKind::relu2;
  c.tie_embeddings = false;
  return c;
}

double rel_l2(const float* a, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = double(a[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void random_tokens(std::vector<int32_t>& v, int V, uint64_t seed) {
  Rng rng(seed);
  for (auto& t : v) t = static_cast<int32_t>(rng.below(V));
}

void compare_model(const std::string& label, const ModelConfig& cfg, int maxB, int maxT, int B, int T,
                   const GpuModelOptions& opt) {
  SCOPED_TRACE(label);
  std::printf("model %s: B=%d T=%d (sized %d x %d)\n", label.c_str(), B, T, maxB, maxT);
  Transformer<float> cpu_model(cfg);
  cpu_model.init_weights(5);
  GpuTransformer gpu_model(cfg, maxB, maxT, opt);

  // Same layout as the CPU model.
  const auto& ci = cpu_model.param_infos();
  const auto& gi = gpu_model.param_infos();
  ASSERT_EQ(ci.size(), gi.size());
  for (size_t i = 0; i < ci.size(); ++i) {
    EXPECT_EQ(ci[i].name, gi[i].name);
    EXPECT_EQ(ci[i].offset, gi[i].offset) << ci[i].name;
    EXPECT_EQ(ci[i].shape, gi[i].shape) << ci[i].name;
    EXPECT_EQ(ci[i].decay, gi[i].decay) << ci[i].name;
  }
  ASSERT_EQ(cpu_model.num_params(), gpu_model.num_params());
  gpu_model.set_params(cpu_model.params(), cpu_model.num_params());
  const auto back = gpu_model.params_to_host();
  ASSERT_EQ(std::memcmp(back.data(), cpu_model.params(), back.size() * sizeof(float)), 0);

  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  random_tokens(x, cfg.vocab_size, 101);
  random_tokens(y, cfg.vocab_size, 102);
  const double loss_scale = 0.5;
  cpu_model.zero_grad();
  const double lc = cpu_model.forward_backward(x.data(), y.data(), B, T, loss_scale);
  gpu_model.zero_grad();
  const double lg = gpu_model.forward_backward(x.data(), y.data(), B, T, loss_scale);
  std::printf("  loss cpu %.6f gpu %.6f (rel %.2e)\n", lc, lg, std::fabs(lg - lc) / lc);
  EXPECT_NEAR(lg, lc, 2e-2 * lc);

  const auto g = gpu_model.grads_to_host();
  double worst = 0;
  std::string worst_name;
  for (const auto& info : ci) {
    const double e = rel_l2(g.data() + info.offset, cpu_model.grads() + info.offset, info.numel);
    EXPECT_LT(e, 3e-2) << "gradient of " << info.name;
    if (!(e <= worst)) worst = e, worst_name = info.name;
  }
  std::printf("  worst gradient rel L2 error %.2e (%s)\n", worst, worst_name.c_str());

  // forward_loss recomputes the same forward: the same bits.
  EXPECT_EQ(gpu_model.forward_loss(x.data(), y.data(), B, T), lg);
  // Deterministic: the same step again gives the same gradients bit for bit.
  gpu_model.zero_grad();
  EXPECT_EQ(gpu_model.forward_backward(x.data(), y.data(), B, T, loss_scale), lg);
  const auto g2 = gpu_model.grads_to_host();
  EXPECT_EQ(std::memcmp(g.data(), g2.data(), g.size() * sizeof(float)), 0) << "gradients differ between runs";
  // Gradients accumulate: a second micro-batch without zero_grad doubles them (up to
  // fp32 rounding: a gradient summed over several LM-head chunks adds in another order).
  gpu_model.forward_backward(x.data(), y.data(), B, T, loss_scale);
  const auto g3 = gpu_model.grads_to_host();
  std::vector<float> twice(g.size());
  for (size_t i = 0; i < g.size(); ++i) twice[i] = 2 * g[i];
  for (const auto& info : gi)
    EXPECT_LT(rel_l2(g3.data() + info.offset, twice.data() + info.offset, info.numel), 1e-5)
        << "accumulated gradient of " << info.name << " is not twice the single one";
}

class GpuModel : public ::testing::Test {
 protected:
  void SetUp() override { REQUIRE_DEVICE(); }
};

TEST_F(GpuModel, ParamLayoutMatchesCpu) {
  for (const ModelConfig& c : {tiny_config(), llama_config(), relu2_config()}) {
    Transformer<float> m(c);
    const auto g = GpuTransformer::param_layout(c);
    ASSERT_EQ(g.size(), m.param_infos().size());
    for (size_t i = 0; i < g.size(); ++i) {
      EXPECT_EQ(g[i].name, m.param_infos()[i].name);
      EXPECT_EQ(g[i].offset, m.param_infos()[i].offset);
      EXPECT_EQ(g[i].numel, m.param_infos()[i].numel);
    }
  }
}

TEST_F(GpuModel, TinyMatchesCpu) {
  GpuModelOptions o;
  o.head_chunk_rows = 100;  // 256 rows: chunks of 100, 100 and 56
  compare_model("tiny (LayerNorm, learned positions, GELU, tied, HD 24)", tiny_config(), 4, 64, 4, 64, o);
}

TEST_F(GpuModel, LlamaMatchesCpu) {
  compare_model("llama (RMSNorm, RoPE, SwiGLU, GQA, untied, HD 32)", llama_config(), 2, 96, 2, 96, {});
  GpuModelOptions o;
  o.attention = AttentionPath::generic;
  compare_model("llama, generic attention", llama_config(), 2, 96, 2, 96, o);
}

TEST_F(GpuModel, Relu2NoEpiloguesSmallerBatchThanSized) {
  GpuModelOptions o;
  o.gemm_epilogues = false;
  o.head_chunk_rows = 64;
  compare_model("relu2 (HD 64, untied, separate epilogue kernels)", relu2_config(), 4, 100, 3, 77, o);
}

TEST_F(GpuModel, MemoryPlanAndOutOfMemory) {
  const ModelConfig c = tiny_config();
  const auto plan = GpuTransformer::memory_plan(c, 4, 64);
  const size_t P = size_t(c.num_params());
  EXPECT_GE(plan.grads, P * 4);
  EXPECT_GT(plan.activations, 0u);
  GpuTransformer m(c, 4, 64);
  EXPECT_LE(m.arena().peak(), plan.total());
  EXPECT_EQ(m.arena().capacity(), plan.total());
  // A 7B model at a large batch does not fit: a clear error before any allocation.
  ModelConfig big = esplag::model_preset("llama-7b");
  try {
    GpuTransformer huge(big, 64, 4096);
    FAIL() << "expected an out-of-memory error";
  } catch (const esplag::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("needs"), std::string::npos) << msg;
    EXPECT_NE(msg.find("activations"), std::string::npos) << msg;
  }
  // Sizes outside what the model was built for are refused.
  std::vector<int32_t> x(5 * 64, 1);
  EXPECT_THROW(m.forward_loss(x.data(), x.data(), 5, 64), esplag::Error);
  x[3] = 257;
  EXPECT_THROW(m.forward_loss(x.data(), x.data(), 4, 64), esplag::Error);
}

// Sequences that follow x[t+1] = (a · x[t] + c) mod V from a random start: learnable, so
// the loss falls quickly and the two curves are compared where they move.
void structured_batch(std::vector<int32_t>& x, std::vector<int32_t>& y, int B, int T, int V, Rng& rng) {
  for (int b = 0; b < B; ++b) {
    int32_t tok = static_cast<int32_t>(rng.below(V));
    for (int t = 0; t < T; ++t) {
      x[size_t(b) * T + t] = tok;
      tok = static_cast<int32_t>((5 * tok + 3) % V);
      y[size_t(b) * T + t] = tok;
    }
  }
}

TEST_F(GpuModel, TrainingCurveMatchesCpu) {
  const ModelConfig c = tiny_config();
  const int B = 4, T = 32, steps = 30;
  Transformer<float> cm(c);
  cm.init_weights(9);
  GpuTransformer gm(c, B, T);
  gm.set_params(cm.params(), cm.num_params());
  esplag::GpuAdamW hyper;
  hyper.lr = 3e-3;
  hyper.weight_decay = 0.1;
  hyper.grad_clip = 1.0;
  std::vector<float> m(cm.num_params()), v(cm.num_params());
  std::vector<int32_t> x(B * T), y(B * T);
  Rng rng(77);
  std::vector<double> lc, lg;
  for (int s = 0; s < steps; ++s) {
    structured_batch(x, y, B, T, c.vocab_size, rng);
    cm.zero_grad();
    lc.push_back(cm.forward_backward(x.data(), y.data(), B, T, 1.0));
    const double norm = std::sqrt(cpu::global_grad_norm_squared(cm.grads(), int64_t(cm.num_params())));
    const double clip = cpu::clip_scale(norm, hyper.grad_clip);
    for (const auto& info : cm.param_infos())
      cpu::adamw_step(cm.params() + info.offset, cm.grads() + info.offset, m.data() + info.offset,
                      v.data() + info.offset, int64_t(info.numel), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                      info.decay ? hyper.weight_decay : 0.0, s + 1, clip);
    gm.zero_grad();
    lg.push_back(gm.forward_backward(x.data(), y.data(), B, T, 1.0));
    gm.step_adamw(hyper);
    const double gnorm = gm.last_grad_norm();
    std::printf("  step %2d loss cpu %.5f gpu %.5f  grad norm cpu %.4f gpu %.4f\n", s + 1, lc.back(), lg.back(), norm,
                gnorm);
    // Same weights at step 1: the norms agree to bf16 accuracy. Later the two runs have
    // drifted apart by bf16 noise, and the norm (dominated by few large entries) is the
    // noisiest statistic of a step, so only gross disagreement fails.
    EXPECT_NEAR(gnorm, norm, (s == 0 ? 1e-2 : 0.25) * norm) << "step " << s + 1;
  }
  for (int s = 0; s < steps; ++s) EXPECT_NEAR(lg[s], lc[s], 2e-2 * lc[s]) << "step " << s + 1;
  EXPECT_LT(lc.back(), 0.7 * lc.front()) << "the CPU run did not learn";
  EXPECT_LT(lg.back(), 0.7 * lg.front()) << "the GPU run did not learn";
  EXPECT_EQ(gm.optimizer_steps(), steps);
  const auto gp = gm.params_to_host();
  // Reported, not asserted: AdamW normalises each gradient, so weights whose gradient is
  // near the bf16 noise move by up to lr per step either way.
  const double e = rel_l2(gp.data(), cm.params(), gp.size());
  std::printf("  parameters after %d steps: rel L2 difference %.2e\n", steps, e);
}

TEST_F(GpuModel, InitWeightsFollowsTheCpuRules) {
  const ModelConfig c = llama_config();
  GpuTransformer gm(c, 1, 8);
  gm.init_weights(3);
  const auto p = gm.params_to_host();
  for (const auto& info : gm.param_infos()) {
    const float* w = p.data() + info.offset;
    if (info.name.find("norm") != std::string::npos) {
      for (size_t i = 0; i < info.numel; ++i) ASSERT_EQ(w[i], 1.f) << info.name;
      continue;
    }
    double s = 0, ss = 0;
    for (size_t i = 0; i < info.numel; ++i) s += w[i], ss += double(w[i]) * w[i];
    const double mean = s / info.numel, sd = std::sqrt(ss / info.numel - mean * mean);
    const bool residual = info.name.find("proj.weight") != std::string::npos;
    const double want = c.init_std * (residual ? 1.0 / std::sqrt(2.0 * c.n_layer) : 1.0);
    EXPECT_NEAR(sd, want, 0.05 * want) << info.name;
    EXPECT_NEAR(mean, 0.0, 5.0 * want / std::sqrt(double(info.numel))) << info.name;
  }
  GpuTransformer again(c, 1, 8);
  again.init_weights(3);
  const auto p2 = again.params_to_host();
  EXPECT_EQ(std::memcmp(p.data(), p2.data(), p.size() * sizeof(float)), 0) << "init is not deterministic";
}

}  // namespace
