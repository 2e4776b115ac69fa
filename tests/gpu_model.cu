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
//
// The fused step (ops/gpu_fused.h): split master weights round-trip exactly; the fused
// SwiGLU / ReLU² match the CPU references and their backward's recomputed activation is
// the forward's bits, in place or not; AdamW over split master weights matches
// cpu::adamw_step with its hyper-parameters read from device memory. And the model's
// options: recompute on and off give the same loss and gradient bits, graph-replayed
// steps the same bits as eager ones, and the memory plan of llama-1b at 4 x 2048 stays
// within the budget that leaves the device use under 22 GiB. Activation checkpointing
// (full, selective) gives the bits of none, eager and replayed, and full shrinks the plan's
// activations to a block's input per block and one shared set.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cfloat>
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
#include "ops/activation.h"
#include "ops/norm.h"
#include "ops/gpu_fused.h"
#include "ops/gpu_pending_scale.h"
#include "bench/lib/train.h"

#include "gpu_test_util.h"

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

using esplag::gpu_test::Bits;
using esplag::gpu_test::Data;
using esplag::gpu_test::Err;
using esplag::gpu_test::error_of;
using esplag::gpu_test::cpu_adamw_step;
using esplag::gpu_test::has_device;
using esplag::gpu_test::random_bf16;
using esplag::gpu_test::random_tokens;
using esplag::gpu_test::rel_l2;
using esplag::gpu_test::round_bf16;
using esplag::gpu_test::structured_batch;
using esplag::gpu_test::VD;
using esplag::gpu_test::VF;
#define REQUIRE_DEVICE() ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"

class Dev : public esplag::gpu_test::DeviceBuffers {
 public:
  Dev() : DeviceBuffers(size_t(64) << 20) {}
};

// bf16 output `got` against the fp64 reference; `low` is the fp32 CPU result.
void expect_bf16_close(const std::string& what, const VD& ref, const VF& low, const VF& got) {
  esplag::gpu_test::expect_bf16_close(what, ref, low, got, 40);
}

// ---------------------------------------------------------------------------------------
// Attention kernels

const char* path_name(AttentionPath p) { return p == AttentionPath::generic ? "generic" : "native"; }

void run_attention(int B, int T, int NH, int NKV, int HD, AttentionPath path, double qk_scale, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " HD=" << HD
                                    << " path=" << path_name(path) << " scale=" << qk_scale);
  std::printf("attention B=%d T=%d NH=%d NKV=%d HD=%d path=%s%s scale=%.1f\n", B, T, NH, NKV, HD, path_name(path),
              path == AttentionPath::native && gpu::attention_tensor_core_head_dim(HD) ? " (tensor cores)" : "",
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
  run_attention(2, 37, 6, 2, 24, AttentionPath::native, 1.0, 11);  // HD 24: not a tensor-core size
  run_attention(1, 37, 4, 4, 16, AttentionPath::native, 1.0, 12);
  run_attention(2, 70, 3, 1, 40, AttentionPath::native, 2.0, 13);
  run_attention(1, 1, 2, 1, 24, AttentionPath::native, 1.0, 14);  // a single position
}

TEST_F(GpuAttention, TensorCoreHeadSizes) {
  run_attention(2, 37, 6, 2, 64, AttentionPath::native, 1.0, 21);   // one partial tile
  run_attention(2, 130, 4, 1, 32, AttentionPath::native, 1.0, 22);  // three tiles, the last of 2 rows
  run_attention(1, 130, 4, 2, 128, AttentionPath::native, 1.0, 23);
  run_attention(1, 200, 2, 2, 64, AttentionPath::native, 3.0, 24);  // peaked softmax: online rescaling
  run_attention(1, 1, 2, 2, 64, AttentionPath::native, 1.0, 25);
  run_attention(1, 64, 2, 1, 128, AttentionPath::native, 1.0, 26);  // exactly one tile
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
  o.fused_norm_backward = false;  // the op kernels' norm backward, bias gradients in the GEMM epilogue
  o.recompute = false;
  compare_model("tiny, separate norm kernels, no recompute", tiny_config(), 4, 64, 4, 64, o);
  // d_model 100: no 16-byte rows, so the fused norm backward is not used (HD 25, generic attention).
  ModelConfig odd = tiny_config();
  odd.d_model = 100;
  odd.d_ff = 300;
  compare_model("tiny with d_model 100", odd, 3, 50, 3, 50, {});
}

TEST_F(GpuModel, LlamaMatchesCpu) {
  compare_model("llama (RMSNorm, RoPE, SwiGLU, GQA, untied, HD 32)", llama_config(), 2, 96, 2, 96, {});
  GpuModelOptions o;
  o.attention = AttentionPath::generic;
  compare_model("llama, generic attention", llama_config(), 2, 96, 2, 96, o);
  o = {};
  o.fused_norm_backward = false;
  o.cuda_graph = false;
  compare_model("llama, separate norm kernels, eager", llama_config(), 2, 96, 2, 96, o);
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
  EXPECT_LE(m.arena().peak() + m.state_bytes(), plan.total());
  EXPECT_EQ(m.arena().capacity() + m.state_bytes(), plan.total());
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
    const double norm = cpu_adamw_step(cm, m, v, hyper, s + 1);
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

// ---------------------------------------------------------------------------------------
// The fused step's kernels (ops/gpu_fused.h)

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

template <typename T>
std::vector<T> get_raw(Dev& dev, const void* d, size_t n) {
  return dev.get(reinterpret_cast<const T*>(d), n);
}

// fp32 output against the fp64 reference: no worse than twice the fp32 CPU computation,
// with a floor of 1e-6 relative.
void expect_f32_close(const std::string& what, const VD& ref, const VF& low, const VF& got) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << what << ": non-finite at " << i;
  const Err eg = error_of(ref, got), el = error_of(ref, low), mag = error_of(ref, VD(ref.size(), 0.0));
  std::printf("  %-40s rel rms %.2e (fp32 CPU %.2e), max %.2e (CPU %.2e)\n", what.c_str(),
              eg.rms / (mag.rms + 1e-300), el.rms / (mag.rms + 1e-300), eg.max, el.max);
  EXPECT_LE(eg.rms, 2 * el.rms + 1e-6 * mag.rms) << what;
  EXPECT_LE(eg.max, 2 * el.max + 1e-6 * mag.max) << what;
}

TEST(GpuFused, MasterSplitRoundTripsExactly) {
  REQUIRE_DEVICE();
  std::vector<float> w = {0.f, -0.f, 1.f, -1.f, 1e-30f, -3.4e38f, 3.4028235e38f, 1.17549435e-38f, 1e-45f, 0.1f, -0.1f};
  // Exact ties (low half 0x8000) above even and odd high halves, both signs.
  for (uint32_t u : {0x3F808000u, 0x3F818000u, 0xBF808000u, 0xBF818000u, 0x7F7F8000u, 0x00008000u}) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    w.push_back(f);
  }
  Rng rng(7);
  for (int i = 0; i < 200000; ++i) w.push_back(static_cast<float>(rng.normal() * std::pow(10.0, 8 * rng.uniform() - 4)));
  for (float x : w) {
    const uint16_t hi = gpu::master_hi_bits(x);
    const int16_t lo = gpu::master_lo_bits(x);
    ASSERT_EQ(bits_of(gpu::master_join_bits(hi, lo)), bits_of(x)) << x;
    if ((bits_of(x) & 0xFFFFu) != 0x8000u)
      ASSERT_EQ(hi, esplag::float_to_bf16(x)) << "not round to nearest: " << x;
    else
      ASSERT_EQ(hi, static_cast<uint16_t>((bits_of(x) >> 16) + 1)) << "tie not away from zero: " << x;
  }
  Dev dev;
  const size_t n = w.size();
  const float* dw = dev.put(w);
  bf16* hi = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(n));
  int16_t* lo = dev.poisoned<int16_t>(n);
  float* back = dev.poisoned<float>(n);
  gpu::master_split(hi, lo, dw, int64_t(n), dev.stream());
  gpu::master_join(back, hi, lo, int64_t(n), dev.stream());
  const auto h = get_raw<uint16_t>(dev, hi, n);
  const auto l = get_raw<int16_t>(dev, lo, n);
  const VF b = dev.get(back, n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(h[i], gpu::master_hi_bits(w[i])) << i;
    ASSERT_EQ(l[i], gpu::master_lo_bits(w[i])) << i;
    ASSERT_EQ(bits_of(b[i]), bits_of(w[i])) << i;
  }
}

void run_fused_swiglu(int64_t N, int H, uint64_t seed) {
  SCOPED_TRACE("swiglu N=" + std::to_string(N) + " H=" + std::to_string(H));
  Dev dev;
  const size_t ni = size_t(N) * 2 * H, no = size_t(N) * H;
  const Data x = random_bf16(ni, seed, 1.5), d = random_bf16(no, seed + 1, 1.0);
  const bf16* dx = reinterpret_cast<bf16*>(dev.put(x.bits));
  const bf16* dd = reinterpret_cast<bf16*>(dev.put(d.bits));
  bf16* out = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(no));
  gpu::fused_swiglu_forward(out, dx, {}, N, H, dev.stream());
  VD ref(no);
  VF low(no);
  cpu::swiglu_forward(ref.data(), x.d.data(), N, H);
  cpu::swiglu_forward(low.data(), x.f.data(), N, H);
  expect_bf16_close("fused swiglu forward", ref, low, dev.get_bf16(out, no));

  bf16* dinp = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(ni));
  bf16* act = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(no));
  gpu::fused_swiglu_backward(dinp, act, dx, {}, dd, {}, N, H, dev.stream());
  VD refb(ni, 0.0);
  VF lowb(ni, 0.f);
  cpu::swiglu_backward(refb.data(), x.d.data(), d.d.data(), N, H);
  cpu::swiglu_backward(lowb.data(), x.f.data(), d.f.data(), N, H);
  expect_bf16_close("fused swiglu backward", refb, lowb, dev.get_bf16(dinp, ni));
  const auto fwd_bits = get_raw<uint16_t>(dev, out, no), grad_bits = get_raw<uint16_t>(dev, dinp, ni);
  EXPECT_EQ(get_raw<uint16_t>(dev, act, no), fwd_bits) << "recomputed activation differs from the forward";
  // In place: the gradient over the input, the activation over dout; then no activation.
  bf16* x2 = reinterpret_cast<bf16*>(dev.put(x.bits));
  bf16* d2 = reinterpret_cast<bf16*>(dev.put(d.bits));
  gpu::fused_swiglu_backward(x2, d2, x2, {}, d2, {}, N, H, dev.stream());
  EXPECT_EQ(get_raw<uint16_t>(dev, x2, ni), grad_bits) << "in-place gradient";
  EXPECT_EQ(get_raw<uint16_t>(dev, d2, no), fwd_bits) << "in-place activation";
  bf16* dinp3 = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(ni));
  gpu::fused_swiglu_backward(dinp3, nullptr, dx, {}, dd, {}, N, H, dev.stream());
  EXPECT_EQ(get_raw<uint16_t>(dev, dinp3, ni), grad_bits) << "gradient without the activation";

  // Inputs with pending scales (a 2:4 fp8 product's outputs): the bits of the kernels on the
  // inputs scaled in place first (apply_pending_scale, the pass those products run otherwise).
  const float* f = dev.put(VF{0.37f, 3.1f, 1.9f, 0.21f});
  const gpu::PendingScale xs{f, f + 1}, ds{f + 2, f + 3};
  bf16* xsc = reinterpret_cast<bf16*>(dev.put(x.bits));
  bf16* dsc = reinterpret_cast<bf16*>(dev.put(d.bits));
  gpu::apply_pending_scale(xsc, int64_t(ni), xs, dev.stream());
  gpu::apply_pending_scale(dsc, int64_t(no), ds, dev.stream());
  const auto outputs = [&] {
    return std::array<bf16*, 3>{reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(no)),
                                reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(ni)),
                                reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(no))};  // forward, dinp, act
  };
  const auto want = outputs(), got = outputs();
  gpu::fused_swiglu_forward(want[0], xsc, {}, N, H, dev.stream());
  gpu::fused_swiglu_backward(want[1], want[2], xsc, {}, dsc, {}, N, H, dev.stream());
  gpu::fused_swiglu_forward(got[0], dx, xs, N, H, dev.stream());
  gpu::fused_swiglu_backward(got[1], got[2], dx, xs, dd, ds, N, H, dev.stream());
  const size_t sizes[3] = {no, ni, no};
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(get_raw<uint16_t>(dev, got[i], sizes[i]), get_raw<uint16_t>(dev, want[i], sizes[i]))
        << "pending scales, output " << i << " (forward, gradient, activation)";
  EXPECT_NE(get_raw<uint16_t>(dev, want[0], no), fwd_bits) << "the scales change the values";
}

void run_fused_relu2(int64_t n, uint64_t seed) {
  SCOPED_TRACE("relu2 n=" + std::to_string(n));
  Dev dev;
  const Data x = random_bf16(size_t(n), seed, 1.0), d = random_bf16(size_t(n), seed + 1, 1.0);
  const bf16* dx = reinterpret_cast<bf16*>(dev.put(x.bits));
  const bf16* dd = reinterpret_cast<bf16*>(dev.put(d.bits));
  bf16* out = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(n));
  gpu::fused_relu2_forward(out, dx, n, dev.stream());
  VD ref(n);
  VF low(n);
  cpu::relu2_forward(ref.data(), x.d.data(), n);
  cpu::relu2_forward(low.data(), x.f.data(), n);
  expect_bf16_close("fused relu2 forward", ref, low, dev.get_bf16(out, n));
  bf16* dinp = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(n));
  bf16* act = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(n));
  gpu::fused_relu2_backward(dinp, act, dx, dd, n, dev.stream());
  VD refb(n, 0.0);
  VF lowb(n, 0.f);
  cpu::relu2_backward(refb.data(), x.d.data(), d.d.data(), n);
  cpu::relu2_backward(lowb.data(), x.f.data(), d.f.data(), n);
  expect_bf16_close("fused relu2 backward", refb, lowb, dev.get_bf16(dinp, n));
  const auto fwd_bits = get_raw<uint16_t>(dev, out, n), grad_bits = get_raw<uint16_t>(dev, dinp, n);
  EXPECT_EQ(get_raw<uint16_t>(dev, act, n), fwd_bits) << "recomputed activation differs from the forward";
  bf16* x2 = reinterpret_cast<bf16*>(dev.put(x.bits));
  bf16* d2 = reinterpret_cast<bf16*>(dev.put(d.bits));
  gpu::fused_relu2_backward(x2, d2, x2, d2, n, dev.stream());
  EXPECT_EQ(get_raw<uint16_t>(dev, x2, n), grad_bits) << "in-place gradient";
  EXPECT_EQ(get_raw<uint16_t>(dev, d2, n), fwd_bits) << "in-place activation";
}

TEST(GpuFused, SwigluAndRelu2RecomputeTheForwardBits) {
  REQUIRE_DEVICE();
  run_fused_swiglu(37, 771, 301);  // scalar path
  run_fused_swiglu(64, 344, 302);  // 16-byte path
  run_fused_swiglu(1, 8, 303);
  run_fused_relu2(37 * 771, 311);
  run_fused_relu2(4096 + 3, 312);  // vector path with a scalar tail
}

// The largest finite |x| of the bf16 values at the segments of each amax slot (0 for none), as
// gpu::fp8_amax takes it.
std::vector<float> host_amaxes(const std::vector<uint16_t>& hi, const std::vector<gpu::ParamSegment>& segs, int slots) {
  std::vector<float> a(size_t(slots), 0.0f);
  for (const auto& sg : segs)
    for (int64_t i = sg.offset; sg.amax_slot >= 0 && i < sg.offset + sg.numel; ++i) {
      const float x = esplag::bf16_to_float(hi[size_t(i)]);
      if (std::isfinite(x)) a[size_t(sg.amax_slot)] = std::max(a[size_t(sg.amax_slot)], std::fabs(x));
    }
  return a;
}

// adamw_update_split's amaxes after the steps above are those of the weights it wrote; then,
// at lr 0 (the weights stay as they are), with masters of ±FLT_MAX (whose bf16 halves round
// to ±inf), -0 and NaN (a NaN master's high half wraps to -0) among them, the largest finite
// magnitude still, and 0 for a segment of no finite value.
void expect_split_adamw_amaxes(Dev& dev, const gpu::SplitAdamWPlan& plan, const std::vector<gpu::ParamSegment>& segs,
                               bf16* dhi, int16_t* dlo, float* dm, float* dv, const float* dg,
                               gpu::AdamWStepParams* params, const float* norm_sq, float* amax) {
  const int64_t total = plan.total_numel();
  EXPECT_EQ(dev.get(amax, 4), host_amaxes(get_raw<uint16_t>(dev, dhi, total), segs, 4)) << "after the two steps";
  std::vector<uint16_t> hi = get_raw<uint16_t>(dev, dhi, total);
  std::vector<int16_t> lo = get_raw<int16_t>(dev, dlo, total);
  const auto set = [&](int64_t i, float w) {
    hi[size_t(i)] = gpu::master_hi_bits(w);
    lo[size_t(i)] = gpu::master_lo_bits(w);
  };
  const float specials[] = {FLT_MAX, -FLT_MAX, -0.0f, std::numeric_limits<float>::quiet_NaN()};
  for (int k = 0; k < 4; ++k) set(1037 + 4000 * k, specials[k]);  // in segment 2's chunks
  set(999, 30.0f);  // the largest of segment 0
  for (int64_t i = 21871; i < total; ++i) set(i, i % 2 ? FLT_MAX : -FLT_MAX);  // segment 5: none finite
  CUDA_CHECK(cudaMemcpy(dhi, hi.data(), hi.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dlo, lo.data(), lo.size() * sizeof(int16_t), cudaMemcpyHostToDevice));
  gpu::AdamWConfig still;
  still.step = 9;
  gpu::set_adamw_step_params(params, gpu::make_adamw_step_params(still), dev.stream());
  gpu::adamw_update_split(plan, dhi, dlo, dm, dv, dg, params, norm_sq, nullptr, amax, dev.stream());
  const std::vector<uint16_t> after = get_raw<uint16_t>(dev, dhi, total);
  ASSERT_EQ(after[1037], 0x7F80) << "FLT_MAX's high half";
  ASSERT_EQ(after[5037], 0xFF80) << "-FLT_MAX's high half";
  const std::vector<float> want = host_amaxes(after, segs, 4);
  EXPECT_EQ(dev.get(amax, 4), want) << "with infinities, -0 and NaN";
  EXPECT_EQ(want[0], 30.0f);
  EXPECT_EQ(want[1], 0.0f);
  EXPECT_THROW(
      gpu::adamw_update_split(plan, dhi, dlo, dm, dv, dg, params, norm_sq, nullptr, nullptr, dev.stream()),
      esplag::Error);
}

TEST(GpuFused, SplitAdamWMatchesCpuWithDeviceHyperParameters) {
  REQUIRE_DEVICE();
  Dev dev;
  // As in the AdamW op test: odd offsets (scalar path), a segment longer than a chunk, a
  // gap that must stay untouched, decay on and off; segment 4 mirrored. Amaxes: segments 2
  // and 3 into slot 3, 0 into 0, 5 into 1; slot 2 has none.
  const std::vector<gpu::ParamSegment> segs = {{0, 1000, true, 0},    {1000, 37, false},     {1037, 20000, true, 3},
                                               {21037, 3, false, 3}, {21100, 771, true}, {21871, 4096, false, 1}};
  const int64_t total = 21871 + 4096;
  Rng rng(401);
  VF master(total), m(total), v(total), g(total);
  for (int64_t i = 0; i < total; ++i) {
    master[i] = static_cast<float>(0.05 * rng.normal());
    m[i] = static_cast<float>(0.01 * rng.normal());
    v[i] = static_cast<float>(std::fabs(1e-4 * rng.normal()));
    g[i] = static_cast<float>(rng.normal());
  }
  std::vector<uint16_t> hi(total);
  std::vector<int16_t> lo(total);
  for (int64_t i = 0; i < total; ++i) hi[i] = gpu::master_hi_bits(master[i]), lo[i] = gpu::master_lo_bits(master[i]);
  bf16* dhi = reinterpret_cast<bf16*>(dev.put(hi));
  int16_t* dlo = dev.put(lo);
  float* dm = dev.put(m);
  float* dv = dev.put(v);
  const float* dg = dev.put(g);
  float* norm_sq = dev.put(VF{9.0f});  // a norm of 3, as if measured on the device
  auto* params = reinterpret_cast<gpu::AdamWStepParams*>(dev.scratch(sizeof(gpu::AdamWStepParams)));
  bf16* mirror = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(771));
  gpu::SplitAdamWPlan plan(segs, dev.arena(), 4);
  EXPECT_EQ(plan.total_numel(), total);
  EXPECT_EQ(plan.amax_slots(), 4);
  float* amax = dev.poisoned<float>(4);

  // Two steps with different hyper-parameters, written to the device before each update;
  // the second clips.
  gpu::AdamWConfig c1;
  c1.lr = 3e-3f;
  c1.weight_decay = 0.1f;
  c1.step = 7;
  c1.grad_scale = 0.5f;
  gpu::AdamWConfig c2 = c1;
  c2.lr = 1e-3f;
  c2.step = 8;
  c2.max_grad_norm = 1.0f;
  for (const auto& c : {c1, c2}) {
    gpu::set_adamw_step_params(params, gpu::make_adamw_step_params(c), dev.stream());
    gpu::adamw_update_split(plan, dhi, dlo, dm, dv, dg, params, norm_sq, mirror, amax, dev.stream());
  }
  const auto ghi = get_raw<uint16_t>(dev, dhi, total);
  const auto glo = get_raw<int16_t>(dev, dlo, total);
  const VF gm = dev.get(dm, total), gv = dev.get(dv, total);
  VF gp(total);
  for (int64_t i = 0; i < total; ++i) gp[i] = gpu::master_join_bits(ghi[i], glo[i]);

  VD rp(master.begin(), master.end()), rm(m.begin(), m.end()), rv(v.begin(), v.end()), gd(g.begin(), g.end());
  VF lp = master, lm = m, lv = v;
  for (const auto& c : {c1, c2}) {
    const double scale = double(c.grad_scale) * cpu::clip_scale(3.0, c.max_grad_norm);
    for (const auto& sg : segs) {
      const double wd = sg.decay ? c.weight_decay : 0.0;
      cpu::adamw_step(rp.data() + sg.offset, gd.data() + sg.offset, rm.data() + sg.offset, rv.data() + sg.offset,
                      sg.numel, double(c.lr), double(c.beta1), double(c.beta2), double(c.eps), wd, c.step, scale);
      cpu::adamw_step(lp.data() + sg.offset, g.data() + sg.offset, lm.data() + sg.offset, lv.data() + sg.offset,
                      sg.numel, double(c.lr), double(c.beta1), double(c.beta2), double(c.eps), wd, c.step, scale);
    }
  }
  expect_f32_close("split master", rp, lp, gp);
  expect_f32_close("m", rm, lm, gm);
  expect_f32_close("v", rv, lv, gv);
  for (int64_t i = 21040; i < 21100; ++i) {  // the gap
    ASSERT_EQ(ghi[i], hi[i]) << i;
    ASSERT_EQ(glo[i], lo[i]) << i;
  }
  const auto mir = get_raw<uint16_t>(dev, mirror, 771);
  for (int i = 0; i < 771; ++i) ASSERT_EQ(mir[i], ghi[21100 + i]) << "mirror at " << i;
  expect_split_adamw_amaxes(dev, plan, segs, dhi, dlo, dm, dv, dg, params, norm_sq, amax);
  // Bad hyper-parameters are refused on the host, before anything runs.
  gpu::AdamWConfig bad = c1;
  bad.beta2 = 1.0f;
  EXPECT_THROW(gpu::make_adamw_step_params(bad), esplag::Error);
  bad = c1;
  bad.step = 0;
  EXPECT_THROW(gpu::make_adamw_step_params(bad), esplag::Error);
}

TEST(GpuFused, ColumnSumsMatchCpu) {
  REQUIRE_DEVICE();
  const std::pair<int, int> sizes[] = {{37, 771}, {1000, 2304}, {130, 8}, {1, 16}, {4097, 96}};
  uint64_t seed = 501;
  for (const auto& [N, C] : sizes) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    Dev dev;
    const Data x = random_bf16(size_t(N) * C, seed++, 1.0);
    Rng rng(seed++);
    VF pre(C);
    for (float& v : pre) v = static_cast<float>(rng.normal());
    VD ref(pre.begin(), pre.end());
    VF low = pre;
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c) {
        ref[c] += x.d[size_t(n) * C + c];
        low[c] += x.f[size_t(n) * C + c];
      }
    const bf16* dx = reinterpret_cast<bf16*>(dev.put(x.bits));
    const size_t sb = gpu::column_sum_scratch_bytes(N, C);
    void* scratch = dev.scratch(sb);
    float* out = dev.put(pre);
    gpu::column_sum_add(out, dx, N, C, scratch, sb, dev.stream());
    const VF got = dev.get(out, C);
    expect_f32_close("column sums", ref, low, got);
    float* again = dev.put(pre);
    gpu::column_sum_add(again, dx, N, C, scratch, sb, dev.stream());
    EXPECT_EQ(dev.get(again, C), got) << "column sums differ between runs";
    EXPECT_THROW(gpu::column_sum_add(out, dx, N, C, scratch, sb - 4, dev.stream()), esplag::Error);
  }
}

void run_fused_norm(bool rms, int N, int C, uint64_t seed) {
  SCOPED_TRACE(std::string(rms ? "rmsnorm" : "layernorm") + " N=" + std::to_string(N) + " C=" + std::to_string(C));
  Dev dev;
  const size_t n = size_t(N) * C;
  const Data inp = random_bf16(n, seed, 1.0), dout = random_bf16(n, seed + 1, 1.0), pre = random_bf16(n, seed + 2, 0.5);
  Data w = random_bf16(C, seed + 3, 0.3), b = random_bf16(C, seed + 4, 0.3);
  for (size_t c = 0; c < size_t(C); ++c) {  // weights around 1
    w.bits[c] = esplag::float_to_bf16(1.f + w.f[c]);
    w.f[c] = esplag::bf16_to_float(w.bits[c]);
    w.d[c] = w.f[c];
  }
  // Statistics as forward saves them: fp32 (computed in fp64 here).
  VD out_d(n), mean_d(N), rstd_d(N);
  if (rms)
    cpu::rmsnorm_forward(out_d.data(), rstd_d.data(), inp.d.data(), w.d.data(), N, C);
  else
    cpu::layernorm_forward(out_d.data(), mean_d.data(), rstd_d.data(), inp.d.data(), w.d.data(), b.d.data(), N, C);
  VF mean_f(mean_d.begin(), mean_d.end()), rstd_f(rstd_d.begin(), rstd_d.end());
  VD mean_r(mean_f.begin(), mean_f.end()), rstd_r(rstd_f.begin(), rstd_f.end());
  Rng rng(seed + 5);
  VF dw0(C), db0(C), ds0(C);
  for (int c = 0; c < C; ++c) {
    dw0[c] = static_cast<float>(rng.normal());
    db0[c] = static_cast<float>(rng.normal());
    ds0[c] = static_cast<float>(rng.normal());
  }
  bf16* ddinp = reinterpret_cast<bf16*>(dev.put(pre.bits));
  float* ddw = dev.put(dw0);
  float* ddb = dev.put(db0);
  float* dds = dev.put(ds0);
  const size_t sb = gpu::fused_norm_backward_scratch_bytes(N, C);
  void* scratch = dev.scratch(sb);
  const bf16* ddout = reinterpret_cast<bf16*>(dev.put(dout.bits));
  const bf16* dinp_in = reinterpret_cast<bf16*>(dev.put(inp.bits));
  const bf16* dwt = reinterpret_cast<bf16*>(dev.put(w.bits));
  const float* dmean = dev.put(mean_f);
  const float* drstd = dev.put(rstd_f);
  if (rms)
    gpu::fused_rmsnorm_backward(ddinp, ddw, dds, ddout, {}, dinp_in, dwt, drstd, N, C, scratch, sb, dev.stream());
  else
    gpu::fused_layernorm_backward(ddinp, ddw, ddb, dds, ddout, {}, dinp_in, dwt, dmean, drstd, N, C, scratch, sb,
                                  dev.stream());
  const VF got_dinp = dev.get_bf16(ddinp, n), got_dw = dev.get(ddw, C), got_db = dev.get(ddb, C),
           got_ds = dev.get(dds, C);

  VD ref_dinp(pre.d), ref_dw(dw0.begin(), dw0.end()), ref_db(db0.begin(), db0.end());
  VF low_dinp(pre.f), low_dw = dw0, low_db = db0;
  if (rms) {
    cpu::rmsnorm_backward(ref_dinp.data(), ref_dw.data(), dout.d.data(), inp.d.data(), w.d.data(), rstd_r.data(), N, C);
    cpu::rmsnorm_backward(low_dinp.data(), low_dw.data(), dout.f.data(), inp.f.data(), w.f.data(), rstd_f.data(), N,
                          C);
  } else {
    cpu::layernorm_backward(ref_dinp.data(), ref_dw.data(), ref_db.data(), dout.d.data(), inp.d.data(), w.d.data(),
                            mean_r.data(), rstd_r.data(), N, C);
    cpu::layernorm_backward(low_dinp.data(), low_dw.data(), low_db.data(), dout.f.data(), inp.f.data(), w.f.data(),
                            mean_f.data(), rstd_f.data(), N, C);
  }
  expect_bf16_close("fused norm backward dinp", ref_dinp, low_dinp, got_dinp);
  expect_f32_close("fused norm backward dweight", ref_dw, low_dw, got_dw);
  if (rms)
    EXPECT_EQ(got_db, db0) << "RMSNorm has no bias";
  else
    expect_f32_close("fused norm backward dbias", ref_db, low_db, got_db);
  // dsum: the column sums of the dinp just written (as stored).
  VD ref_ds(ds0.begin(), ds0.end());
  VF low_ds = ds0;
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) {
      ref_ds[c] += got_dinp[size_t(r) * C + c];
      low_ds[c] += got_dinp[size_t(r) * C + c];
    }
  expect_f32_close("fused norm backward dsum", ref_ds, low_ds, got_ds);

  // dout with a pending scale (a 2:4 fp8 product's output): the bits of dout scaled in place
  // first (apply_pending_scale), in dinp and every sum.
  const float* f = dev.put(VF{1.9f, 0.21f});
  const gpu::PendingScale scale{f, f + 1};
  bf16* scaled_dout = reinterpret_cast<bf16*>(dev.put(dout.bits));
  gpu::apply_pending_scale(scaled_dout, int64_t(n), scale, dev.stream());
  const auto run = [&](const bf16* d, gpu::PendingScale s) {
    bf16* di = reinterpret_cast<bf16*>(dev.put(pre.bits));
    float *dw = dev.put(dw0), *db = dev.put(db0), *ds = dev.put(ds0);
    if (rms)
      gpu::fused_rmsnorm_backward(di, dw, ds, d, s, dinp_in, dwt, drstd, N, C, scratch, sb, dev.stream());
    else
      gpu::fused_layernorm_backward(di, dw, db, ds, d, s, dinp_in, dwt, dmean, drstd, N, C, scratch, sb, dev.stream());
    return std::pair{get_raw<uint16_t>(dev, di, n), std::vector<std::vector<uint32_t>>{get_raw<uint32_t>(dev, dw, C),
                                                                                        get_raw<uint32_t>(dev, db, C),
                                                                                        get_raw<uint32_t>(dev, ds, C)}};
  };
  const auto want = run(scaled_dout, {}), got = run(ddout, scale);
  EXPECT_EQ(got.first, want.first) << "dinp with a pending scale";
  EXPECT_EQ(got.second, want.second) << "dweight, dbias, dsum with a pending scale";
  EXPECT_NE(want.first, run(ddout, {}).first) << "the scale changes the gradient";
}

TEST(GpuFused, NormBackwardSumsTheGradientsInOnePass) {
  REQUIRE_DEVICE();
  uint64_t seed = 601;
  for (bool rms : {false, true})
    for (const auto& [N, C] : std::vector<std::pair<int, int>>{{37, 768}, {300, 128}, {17, 2048}, {33, 8}, {16, 256}})
      run_fused_norm(rms, N, C, seed += 10);
  EXPECT_FALSE(gpu::fused_norm_backward_supported(12));
  EXPECT_FALSE(gpu::fused_norm_backward_supported(4096));
  EXPECT_TRUE(gpu::fused_norm_backward_supported(768));
  Dev dev;
  bf16* x = reinterpret_cast<bf16*>(dev.poisoned<uint16_t>(64 * 12));
  float* f = dev.poisoned<float>(64);
  void* scratch = dev.scratch(gpu::fused_norm_backward_scratch_bytes(4, 12));
  EXPECT_THROW(gpu::fused_rmsnorm_backward(x, f, nullptr, x, {}, x, x, f, 4, 12, scratch,
                                           gpu::fused_norm_backward_scratch_bytes(4, 12), dev.stream()),
               esplag::Error);
}

TEST(GpuFused, SumOfSquaresMatchesCpu) {
  REQUIRE_DEVICE();
  for (int64_t n : {int64_t(1234567), int64_t(4097), int64_t(1000), int64_t(3), int64_t(1), int64_t(0)}) {
    Dev dev;
    Rng rng(700 + n);
    VF g(n);
    for (float& v : g) v = static_cast<float>(0.01 * rng.normal());
    float* out = dev.poisoned<float>(1);
    void* scratch = dev.scratch(gpu::sum_squares_scratch_bytes());
    const float* dg = dev.put(g);
    gpu::sum_squares(out, dg, n, scratch, dev.stream());
    const VF got = dev.get(out, 1);
    const VD gd(g.begin(), g.end());
    const double ref = cpu::global_grad_norm_squared(gd.data(), n);
    EXPECT_NEAR(got[0], ref, 1e-5 * ref + 1e-30) << "n=" << n;
    gpu::sum_squares(out, dg, n, scratch, dev.stream());
    EXPECT_EQ(dev.get(out, 1), got) << "n=" << n;
  }
}

// ---------------------------------------------------------------------------------------
// Model options: recompute, CUDA graphs, memory, op timing

// Two models with options a and b from the same weights, `steps` training steps on the
// same batches with a learning rate that changes every step: the loss, the gradients, the
// weights and the AdamW moments must agree bit for bit after every step.
void expect_same_bits(const std::string& label, const ModelConfig& cfg, int B, int T, const GpuModelOptions& a,
                      const GpuModelOptions& b, int steps) {
  SCOPED_TRACE(label);
  std::printf("same bits: %s\n", label.c_str());
  Transformer<float> cm(cfg);
  cm.init_weights(11);
  GpuTransformer ga(cfg, B, T, a), gb(cfg, B, T, b);
  ga.set_params(cm.params(), cm.num_params());
  gb.set_params(cm.params(), cm.num_params());
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  esplag::GpuAdamW hyper;
  hyper.weight_decay = 0.1;
  hyper.grad_clip = 1.0;
  for (int s = 0; s < steps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s + 1));
    random_tokens(x, cfg.vocab_size, 500 + s);
    random_tokens(y, cfg.vocab_size, 600 + s);
    hyper.lr = 1e-3 * (s + 1);
    double loss[2];
    GpuTransformer* models[2] = {&ga, &gb};
    for (int k = 0; k < 2; ++k) {
      GpuTransformer& g = *models[k];
      g.zero_grad();
      g.upload_batch(x.data(), y.data(), B, T);
      g.forward_backward_device(g.device_tokens(), g.device_targets(), B, T, 0.5);
      loss[k] = g.read_loss();
    }
    ASSERT_TRUE(std::isfinite(loss[0]));
    EXPECT_EQ(loss[0], loss[1]) << "loss";
    const auto g0 = ga.grads_to_host(), g1 = gb.grads_to_host();
    for (const auto& info : ga.param_infos())
      EXPECT_EQ(std::memcmp(g0.data() + info.offset, g1.data() + info.offset, info.numel * sizeof(float)), 0)
          << "gradient of " << info.name;
    ga.step_adamw(hyper);
    gb.step_adamw(hyper);
    EXPECT_EQ(ga.last_grad_norm(), gb.last_grad_norm()) << "gradient norm";
  }
  const auto p0 = ga.params_to_host(), p1 = gb.params_to_host();
  EXPECT_EQ(std::memcmp(p0.data(), p1.data(), p0.size() * sizeof(float)), 0) << "weights";
  std::vector<float> m0, v0, m1, v1;
  ga.optimizer_state_to_host(m0, v0);
  gb.optimizer_state_to_host(m1, v1);
  EXPECT_EQ(std::memcmp(m0.data(), m1.data(), m0.size() * sizeof(float)), 0) << "first moments";
  EXPECT_EQ(std::memcmp(v0.data(), v1.data(), v0.size() * sizeof(float)), 0) << "second moments";
  // The weights moved: the comparison is not between two untouched copies.
  EXPECT_NE(std::memcmp(p0.data(), cm.params(), p0.size() * sizeof(float)), 0);
}

TEST_F(GpuModel, RecomputeGivesTheSameBits) {
  GpuModelOptions on, off;
  on.cuda_graph = off.cuda_graph = false;
  on.recompute = true;
  off.recompute = false;
  on.head_chunk_rows = off.head_chunk_rows = 100;  // several LM-head chunks
  expect_same_bits("tiny (LayerNorm, GELU, padded vocabulary): recompute on / off", tiny_config(), 4, 64, on, off, 2);
  expect_same_bits("llama (RMSNorm, RoPE, SwiGLU): recompute on / off", llama_config(), 2, 96, on, off, 2);
  expect_same_bits("relu2: recompute on / off", relu2_config(), 3, 77, on, off, 2);
  on.gemm_epilogues = off.gemm_epilogues = false;
  expect_same_bits("tiny, separate epilogue kernels: recompute on / off", tiny_config(), 4, 64, on, off, 1);
}

TEST_F(GpuModel, GraphReplayGivesTheSameBitsAsEagerSteps) {
  GpuModelOptions graph, eager;
  graph.cuda_graph = true;
  eager.cuda_graph = false;
  graph.head_chunk_rows = eager.head_chunk_rows = 100;
  const int steps = 5;
  for (const ModelConfig& c : {tiny_config(), llama_config()}) {
    expect_same_bits(c.preset + ": graph / eager", c, 4, 64, graph, eager, steps);
  }
  // Every call after the first of each graph replays it: steps - 1 forward-backward and
  // steps - 1 AdamW launches.
  const ModelConfig c = llama_config();
  GpuTransformer g(c, 2, 32, graph);
  g.init_weights(1);
  std::vector<int32_t> x(64);
  random_tokens(x, c.vocab_size, 9);
  esplag::GpuAdamW hyper;
  for (int s = 0; s < steps; ++s) {
    g.zero_grad();
    g.upload_batch(x.data(), x.data(), 2, 32);
    g.forward_backward_device(g.device_tokens(), g.device_targets(), 2, 32, 1.0);
    g.step_adamw(hyper);
  }
  EXPECT_EQ(g.graph_launches(), 2 * (steps - 1));
  EXPECT_EQ(g.optimizer_steps(), steps);
  EXPECT_TRUE(std::isfinite(g.read_loss()));
}

size_t aligned256(size_t bytes) { return (bytes + 255) / 256 * 256; }

TEST_F(GpuModel, RecomputeAndSharedBuffersShrinkTheMemoryPlan) {
  const ModelConfig c = llama_config();
  GpuModelOptions on, off;
  off.recompute = false;
  const int B = 2, T = 96;
  const size_t N = size_t(B) * T;
  const auto pr = GpuTransformer::memory_plan(c, B, T, on), pn = GpuTransformer::memory_plan(c, B, T, off);
  // Both norm outputs and the SwiGLU output per layer are no longer saved.
  EXPECT_EQ(pn.activations - pr.activations,
            size_t(c.n_layer) * (2 * aligned256(2 * N * c.d_model) + aligned256(2 * N * c.d_ff)));
  // Master weights as low halves: 4 bytes per parameter with the bf16 weights.
  EXPECT_EQ(pr.params, aligned256(2 * size_t(c.num_params())) + aligned256(2 * size_t(c.num_params())));
  // The memory target: llama-1b at 4 x 2048 within 21 GiB of arena, which keeps the
  // device's use (with the CUDA context and library state, ~0.6 GiB) under 22 GiB.
  const ModelConfig big = esplag::model_preset("llama-1b");
  const auto p1b = GpuTransformer::memory_plan(big, 4, 2048);
  std::printf("  llama-1b 4 x 2048: %.2f GiB (%s)\n", p1b.total() / double(size_t(1) << 30), p1b.describe().c_str());
  EXPECT_LE(p1b.total(), size_t(21) << 30);
  const auto p1b_off = GpuTransformer::memory_plan(big, 4, 2048, off);
  std::printf("  llama-1b 4 x 2048 without recompute: %.2f GiB\n", p1b_off.total() / double(size_t(1) << 30));
  EXPECT_LT(p1b.total(), p1b_off.total());
}

// Activation checkpointing: the same loss, gradient, weight and moment bits as none, for
// both modes, every block or every other one (3 blocks: 0 and 2 checkpointed, 1 not), eager
// and graph-replayed (3 steps: eager, captured, replayed), with recompute on and off.
TEST_F(GpuModel, CheckpointingGivesTheSameBits) {
  using esplag::CheckpointMode;
  ModelConfig llama = llama_config();
  llama.n_layer = 3;
  ModelConfig gpt = tiny_config();  // 3 blocks
  ModelConfig relu2 = relu2_config();
  relu2.n_layer = 3;
  for (bool recompute : {true, false}) {
    GpuModelOptions none;
    none.cuda_graph = false;
    none.recompute = recompute;
    none.head_chunk_rows = 100;  // several LM-head chunks
    for (const ModelConfig& c : {gpt, llama, relu2})
      for (CheckpointMode mode : {CheckpointMode::full, CheckpointMode::selective})
        for (int every : {1, 2})
          for (bool graph : {false, true}) {
            GpuModelOptions o = none;
            o.checkpointing = {mode, every};
            o.cuda_graph = graph;
            expect_same_bits(c.preset + (c.mlp == esplag::MlpKind::relu2 ? " relu2" : "") + ", recompute " +
                                 (recompute ? "on" : "off") + ": none / " + esplag::to_string(mode) + " every " +
                                 std::to_string(every) + (graph ? ", graph" : ""),
                             c, 2, 64, none, o, 3);
          }
  }
  // forward_loss (evaluation) of a checkpointed model gives the same bits too.
  GpuModelOptions full;
  full.checkpointing = {CheckpointMode::full, 1};
  GpuTransformer a(llama, 2, 64), b(llama, 2, 64, full);
  a.init_weights(3);
  b.init_weights(3);
  std::vector<int32_t> x(128), y(128);
  random_tokens(x, llama.vocab_size, 7);
  random_tokens(y, llama.vocab_size, 8);
  EXPECT_EQ(a.forward_loss(x.data(), y.data(), 2, 64), b.forward_loss(x.data(), y.data(), 2, 64));
}

// Full checkpointing keeps a block's input per checkpointed block and one set of the rest
// for all of them; selective saves what recompute saves; nothing else changes. llama-1b at
// T = 2048 fits at least 4x the micro-batch in the memory of an H100.
TEST_F(GpuModel, CheckpointingShrinksTheActivations) {
  using esplag::CheckpointMode;
  const int B = 2, T = 96;
  const size_t N = size_t(B) * T;
  ModelConfig c4 = llama_config(), c8 = llama_config();
  c4.n_layer = 4;
  c8.n_layer = 8;
  GpuModelOptions none, full, full2, selective_off, none_off;
  full.checkpointing = {CheckpointMode::full, 1};
  full2.checkpointing = {CheckpointMode::full, 2};
  none_off.recompute = false;
  selective_off.recompute = false;
  selective_off.checkpointing = {CheckpointMode::selective, 1};
  auto plan = [&](const ModelConfig& c, const GpuModelOptions& o) { return GpuTransformer::memory_plan(c, B, T, o); };
  const size_t input = aligned256(2 * N * c4.d_model);
  EXPECT_EQ(plan(c8, full).activations - plan(c4, full).activations, 4 * input) << "a block adds its input only";
  const size_t block = (plan(c8, none).activations - plan(c4, none).activations) / 4;  // all a block saves
  ASSERT_GT(block, 4 * input);
  EXPECT_EQ(plan(c8, none).activations - plan(c8, full).activations, 7 * (block - input));
  EXPECT_EQ(plan(c8, none).activations - plan(c8, full2).activations, 3 * (block - input)) << "blocks 0, 2, 4, 6";
  for (const GpuModelOptions& o : {full, full2}) {
    const auto p = plan(c8, o), n = plan(c8, none);
    EXPECT_EQ(p.params, n.params);
    EXPECT_EQ(p.grads, n.grads);
    EXPECT_EQ(p.optimizer, n.optimizer);
    EXPECT_EQ(p.scratch, n.scratch);
    EXPECT_EQ(p.workspace, n.workspace);
  }
  // selective: what recompute on keeps (the GPU's attention keeps no probabilities).
  EXPECT_EQ(plan(c8, selective_off).total(), plan(c8, none).total());
  EXPECT_LT(plan(c8, selective_off).activations, plan(c8, none_off).activations);

  const ModelConfig big = esplag::model_preset("llama-1b");
  const size_t budget = size_t(76) << 30;  // an H100's 80 GB less the CUDA context and libraries
  auto largest = [&](const GpuModelOptions& o) {
    int b = 0;
    for (int step = 512; step > 0; step /= 2)
      if (GpuTransformer::memory_plan(big, b + step, 2048, o).total() <= budget) b += step;
    return b;
  };
  const int b_none = largest(none), b_full = largest(full);
  ASSERT_GT(b_none, 0);
  const auto p_none = GpuTransformer::memory_plan(big, 4, 2048, none);
  const auto p_full = GpuTransformer::memory_plan(big, 4, 2048, full);
  std::printf("  llama-1b 4 x 2048 activations: none %.2f GiB, full %.2f GiB; largest micro-batch in 76 GiB: %d / %d\n",
              p_none.activations / double(size_t(1) << 30), p_full.activations / double(size_t(1) << 30), b_none,
              b_full);
  EXPECT_GE(b_full, 4 * b_none);
}

TEST_F(GpuModel, OpTimingCoversTheStepAndChangesNoResult) {
  const ModelConfig c = llama_config();
  const int B = 2, T = 64;
  GpuTransformer timed(c, B, T), plain(c, B, T);
  timed.init_weights(2);
  plain.init_weights(2);
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  random_tokens(x, c.vocab_size, 21);
  random_tokens(y, c.vocab_size, 22);
  timed.set_op_timing(true);
  esplag::GpuAdamW hyper;
  for (GpuTransformer* g : {&timed, &plain}) {
    g->zero_grad();
    g->forward_backward(x.data(), y.data(), B, T, 1.0);
    g->step_adamw(hyper);
  }
  const auto ops = timed.op_times();
  timed.set_op_timing(false);
  auto find = [&](const std::string& name) -> const esplag::GpuOpTime* {
    for (const auto& o : ops)
      if (o.op == name) return &o;
    return nullptr;
  };
  double total = 0;
  for (const auto& o : ops) {
    EXPECT_GE(o.ms, 0.0) << o.op;
    total += o.ms;
  }
  EXPECT_GT(total, 0.0);
  for (const char* name : {"gemm qkv fwd", "attention fwd", "attention bwd", "gemm fc dW", "swiglu bwd", "rope bwd"}) {
    const auto* o = find(name);
    ASSERT_NE(o, nullptr) << name;
    EXPECT_EQ(o->calls, c.n_layer) << name;
  }
  ASSERT_NE(find("adamw"), nullptr);
  EXPECT_EQ(find("adamw")->calls, 1);
  ASSERT_NE(find("cross-entropy"), nullptr);
  EXPECT_GT(find("gemm qkv fwd")->flops, 0.0);
  EXPECT_EQ(timed.graph_launches(), 0);  // timing runs eagerly
  const auto a = timed.params_to_host(), b = plain.params_to_host();
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "timing changed the step";
  // zero_grad leaves the large gradients for the next backward to overwrite; read before
  // that, every gradient is zero.
  const auto before = plain.grads_to_host();
  EXPECT_NE(std::count(before.begin(), before.end(), 0.f), std::ptrdiff_t(before.size()));
  plain.zero_grad();
  const auto zeroed = plain.grads_to_host();
  EXPECT_EQ(std::count(zeroed.begin(), zeroed.end(), 0.f), std::ptrdiff_t(zeroed.size()));
}

// ---------------------------------------------------------------------------------------
// Measurement harness, not a test (disabled): the benchmark shapes with per-op timing and
// the cost of each option, and how far cuBLASLt's first heuristic choice is from the best
// of its candidates for the step's GEMM shapes. Run with
//   gpu_model --gtest_also_run_disabled_tests --gtest_filter='GpuModelBench.*'

struct BenchShape {
  const char* model;
  int B, T;
};
const BenchShape kBenchShapes[] = {{"gpt2-124m", 16, 1024}, {"gpt2-350m", 8, 1024}, {"llama-1b", 4, 2048}};

TEST(GpuModelBench, DISABLED_ProfileBenchShapes) {
  REQUIRE_DEVICE();
  for (const auto& sh : kBenchShapes) {
    const ModelConfig c = esplag::model_preset(sh.model);
    const auto r = esplag::bench_train_gpu(c, sh.B, sh.T, 10, 3, esplag::kH100DenseBf16Tflops, {}, 2);
    std::printf("%s%s%s", esplag::gpu_bench_table_header().c_str(), esplag::gpu_bench_table_row(r).c_str(),
                esplag::gpu_op_profile_table(r).c_str());
    GpuModelOptions o;
    o.recompute = false;
    std::printf("%s", esplag::gpu_bench_table_row(esplag::bench_train_gpu(c, sh.B, sh.T, 10, 3, 989, o)).c_str());
    o = {};
    o.cuda_graph = false;
    std::printf("%s", esplag::gpu_bench_table_row(esplag::bench_train_gpu(c, sh.B, sh.T, 10, 3, 989, o)).c_str());
    o = {};
    o.fused_norm_backward = false;
    std::printf("%s", esplag::gpu_bench_table_row(esplag::bench_train_gpu(c, sh.B, sh.T, 10, 3, 989, o)).c_str());
    o = {};
    o.attention = AttentionPath::native;
    const auto rn = esplag::bench_train_gpu(c, sh.B, sh.T, 10, 3, 989, o, 1);
    std::printf("%s%s", esplag::gpu_bench_table_row(rn).c_str(), esplag::gpu_op_profile_table(rn).c_str());
    std::fflush(stdout);
  }
}

__global__ void fill_bf16_kernel(bf16* p, size_t n, uint32_t seed) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  p[i] = __float2bfloat16_rn((static_cast<float>(h & 0xFFFF) / 32768.f - 1.f) * 0.5f);
}

struct SweepGemm {
  std::string name;
  bool ta, tb;
  int m, n, k, lda, ldb, ldd;
  bool f32_out;
  float beta;
};

// Times every heuristic candidate (up to 16) of one GEMM laid out as gpu::Gemm lays it.
void sweep_one(cublasLtHandle_t handle, void* ws, size_t ws_bytes, const void* A, const void* B, void* D,
               const SweepGemm& g, cudaStream_t s, double& heur_ms_total, double& best_ms_total) {
  cublasLtMatmulDesc_t desc;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  cublasLtMatrixLayout_t la, lb, ld;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, g.ta ? g.k : g.m, g.ta ? g.m : g.k, g.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, g.tb ? g.n : g.k, g.tb ? g.k : g.n, g.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, g.f32_out ? CUDA_R_32F : CUDA_R_16BF, g.m, g.n, g.ldd));
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t wsb = ws_bytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
  cublasLtMatmulHeuristicResult_t res[16];
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 16, res, &found));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  const float alpha = 1.f;
  std::vector<double> med(found, 1e30);
  for (int a = 0; a < found; ++a) {
    std::vector<float> t;
    bool ok = true;
    for (int rep = 0; rep < 12 && ok; ++rep) {
      CUDA_CHECK(cudaEventRecord(e0, s));
      ok = cublasLtMatmul(handle, desc, &alpha, A, la, B, lb, &g.beta, D, ld, D, ld, &res[a].algo, ws, ws_bytes, s) ==
           CUBLAS_STATUS_SUCCESS;
      CUDA_CHECK(cudaEventRecord(e1, s));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (rep >= 2) t.push_back(ms);
    }
    if (!ok) continue;
    std::sort(t.begin(), t.end());
    med[a] = t[t.size() / 2];
  }
  const int best = static_cast<int>(std::min_element(med.begin(), med.end()) - med.begin());
  const double fl = 2.0 * g.m * g.n * g.k;
  if (found > 0) {
    std::printf("  %-22s m=%6d n=%6d k=%6d  heuristic %7.3f ms %4.0f TF/s | best #%-2d %7.3f ms %4.0f TF/s (%+5.1f%%) of %d\n",
                g.name.c_str(), g.m, g.n, g.k, med[0], fl / med[0] / 1e9, best, med[best], fl / med[best] / 1e9,
                100.0 * (med[best] - med[0]) / med[0], found);
    heur_ms_total += med[0];
    best_ms_total += med[best];
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
}

TEST(GpuModelBench, DISABLED_GemmAlgorithmSweep) {
  REQUIRE_DEVICE();
  cublasLtHandle_t handle;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreate(&s));
  const size_t ws_bytes = size_t(32) << 20;
  void* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  for (const auto& sh : kBenchShapes) {
    const ModelConfig c = esplag::model_preset(sh.model);
    const int N = sh.B * sh.T, C = c.d_model, Q = c.qkv_dim(), F = c.fc_dim(), H = c.d_ff;
    const int AC = c.n_head * c.head_dim();
    const int Vp = c.vocab_size % 64 == 0 ? c.vocab_size : (c.vocab_size + 127) / 128 * 128;
    const int hr = std::min(N, int((size_t(256) << 20) / (2 * size_t(Vp)) / 128 * 128));
    struct Lin {
      const char* name;
      int rows, in, out;
    };
    const Lin lins[] = {{"qkv", N, C, Q}, {"proj", N, AC, C}, {"fc", N, C, F}, {"mproj", N, H, C}, {"head", hr, C, Vp}};
    std::vector<SweepGemm> gemms;
    for (const auto& l : lins) {
      gemms.push_back({std::string(l.name) + " fwd", true, false, l.out, l.rows, l.in, l.in, l.in, l.out, false, 0.f});
      gemms.push_back({std::string(l.name) + " dX", false, false, l.in, l.rows, l.out, l.in, l.out, l.in, false, 0.f});
      gemms.push_back({std::string(l.name) + " dW", false, true, l.in, l.out, l.rows, l.in, l.out, l.in, true, 1.f});
    }
    size_t maxa = 0, maxd = 0;
    for (const auto& g : gemms) {
      maxa = std::max({maxa, size_t(g.m) * g.k, size_t(g.n) * g.k});
      maxd = std::max(maxd, size_t(g.m) * g.n * (g.f32_out ? 4 : 2));
    }
    bf16 *A = nullptr, *B = nullptr;
    void* D = nullptr;
    CUDA_CHECK(cudaMalloc(&A, maxa * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&B, maxa * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&D, maxd));
    fill_bf16_kernel<<<unsigned((maxa + 255) / 256), 256, 0, s>>>(A, maxa, 1);
    fill_bf16_kernel<<<unsigned((maxa + 255) / 256), 256, 0, s>>>(B, maxa, 2);
    CUDA_CHECK(cudaMemsetAsync(D, 0, maxd, s));
    std::printf("%s %dx%d: cuBLASLt candidates per GEMM of the step (median of 10)\n", sh.model, sh.B, sh.T);
    double heur = 0, best = 0;
    for (const auto& g : gemms) sweep_one(handle, ws, ws_bytes, A, B, D, g, s, heur, best);
    std::printf("  one of each: heuristic %.3f ms, best %.3f ms (%+.1f%%)\n", heur, best, 100.0 * (best - heur) / heur);
    std::fflush(stdout);
    cudaFree(A);
    cudaFree(B);
    cudaFree(D);
  }
  cudaFree(ws);
  cudaStreamDestroy(s);
  cublasLtDestroy(handle);
}

}  // namespace
