// Every CUDA op against the CPU reference (esplag::cpu, ops/*.h).
//
// Inputs are fresh seeded random values rounded to bf16 (so the GPU and the CPU see the
// same numbers); outputs that the op overwrites are poisoned with NaN first, outputs it
// accumulates into are pre-filled with random values. Sizes are deliberately awkward
// (C = 771, N = 37, ...) next to aligned ones, so both the scalar and the 16-byte paths run.
//
// Accuracy rule (docs/architecture.md): against the fp64 CPU reference, the GPU's error must be no
// worse than twice the error of the same computation done on the CPU in fp32 with the
// same bf16 roundings ("low"), in RMS and in max norm, with a floor of 1e-6 relative RMS
// (bf16 outputs; max: one bf16 ulp at the largest value) or 1e-5 (fp32 outputs) for
// computations whose low-precision error is near zero; bf16 outputs must also be within
// 1e-2 relative RMS.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "ops/activation.h"
#include "ops/adamw.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/gpu.h"
#include "ops/matmul.h"
#include "ops/norm.h"

#include "gpu_test_util.h"

namespace {

using esplag::DeviceArena;
using esplag::Rng;
using esplag::gpu::bf16;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;

using esplag::gpu_test::bits_to_float;
using esplag::gpu_test::Bits;
using esplag::gpu_test::Data;
using esplag::gpu_test::Err;
using esplag::gpu_test::error_of;
using esplag::gpu_test::has_device;
using esplag::gpu_test::magnitude;
using esplag::gpu_test::random_bf16;
using esplag::gpu_test::random_f32;
using esplag::gpu_test::round_bf16;
using esplag::gpu_test::to_double;
using esplag::gpu_test::VD;
using esplag::gpu_test::VF;
#define REQUIRE_DEVICE() ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"

// Device buffers, all from one arena per test.
class Dev : public esplag::gpu_test::DeviceBuffers {
 public:
  Dev() : DeviceBuffers(size_t(256) << 20) {}
};

// ---------------------------------------------------------------------------------------
// Comparison

enum class Out { bf16, f32 };

void expect_matches(const std::string& what, const VD& ref, const VF& low, const VF& got, Out kind) {
  esplag::gpu_test::expect_within_low_precision(what, ref, low, got, kind == Out::bf16);
}

// Element-wise equality of device results from two runs (determinism).
template <typename T>
void expect_bitwise_equal(const std::string& what, const std::vector<T>& a, const std::vector<T>& b) {
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)), 0) << what << ": results differ between runs";
}

class GpuOps : public ::testing::Test {
 protected:
  void SetUp() override { REQUIRE_DEVICE(); }
};

// ---------------------------------------------------------------------------------------
// Embedding

void run_embedding_forward(int B, int T, int C, int V, bool with_wpe, uint64_t seed) {
  SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C));
  Dev dev;
  const int64_t N = int64_t(B) * T;
  Rng rng(seed);
  std::vector<int32_t> tok(N);
  for (auto& t : tok) t = static_cast<int32_t>(rng.below(V));
  const Data wte = random_bf16(size_t(V) * C, seed + 1), wpe = random_bf16(size_t(T) * C, seed + 2);
  bf16* out = dev.poisoned_bf16(N * C);
  gpu::embedding_forward(out, dev.put(tok), dev.put_bf16(wte.bits), with_wpe ? dev.put_bf16(wpe.bits) : nullptr, B,
                         T, C, V, dev.stream());
  const VF got = dev.get_bf16(out, N * C);
  VD ref(N * C);
  VF low(N * C);
  cpu::embedding_forward(ref.data(), tok.data(), wte.d.data(), with_wpe ? wpe.d.data() : nullptr, B, T, C);
  cpu::embedding_forward(low.data(), tok.data(), wte.f.data(), with_wpe ? wpe.f.data() : nullptr, B, T, C);
  expect_matches("embedding out", ref, round_bf16(low), got, Out::bf16);
}

TEST_F(GpuOps, EmbeddingForward) {
  run_embedding_forward(3, 37, 771, 131, true, 11);
  run_embedding_forward(2, 40, 768, 300, true, 12);
  run_embedding_forward(2, 19, 64, 50, false, 13);
}

TEST_F(GpuOps, EmbeddingForwardBadTokenGivesNaN) {
  Dev dev;
  const int B = 1, T = 3, C = 16, V = 10;
  const std::vector<int32_t> tok = {1, 10, -2};
  const Data wte = random_bf16(V * C, 5);
  bf16* out = dev.poisoned_bf16(T * C);
  CUDA_CHECK(cudaMemset(out, 0, T * C * sizeof(bf16)));
  gpu::embedding_forward(out, dev.put(tok), dev.put_bf16(wte.bits), nullptr, B, T, C, V, dev.stream());
  const VF got = dev.get_bf16(out, T * C);
  for (int c = 0; c < C; ++c) {
    EXPECT_EQ(got[c], wte.f[1 * C + c]);
    EXPECT_TRUE(std::isnan(got[C + c]));
    EXPECT_TRUE(std::isnan(got[2 * C + c]));
  }
}

void run_embedding_backward(int B, int T, int C, int V, double skew, uint64_t seed) {
  SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C) +
               " V=" + std::to_string(V));
  Dev dev;
  const int64_t N = int64_t(B) * T;
  Rng rng(seed);
  // A skewed distribution: one very frequent token makes runs that cross many segments.
  std::vector<int32_t> tok(N);
  const int32_t frequent = std::min(3, V - 1);
  for (auto& t : tok) t = rng.uniform() < skew ? frequent : static_cast<int32_t>(rng.below(V));
  const Data dout = random_bf16(N * C, seed + 1);
  const VF dwte0 = random_f32(size_t(V) * C, seed + 2), dwpe0 = random_f32(size_t(T) * C, seed + 3);
  float* dwte = dev.put(dwte0, "dwte");
  float* dwpe = dev.put(dwpe0, "dwpe");
  const size_t ws_bytes = gpu::embedding_backward_workspace_bytes(B, T, C, V);
  void* ws = dev.scratch(ws_bytes, "embedding workspace");
  const int32_t* dtok = dev.put(tok);
  const bf16* ddout = dev.put_bf16(dout.bits);
  gpu::embedding_backward(dwte, dwpe, ddout, dtok, B, T, C, V, ws, ws_bytes, dev.stream());
  const VF got_wte = dev.get(dwte, dwte0.size()), got_wpe = dev.get(dwpe, dwpe0.size());

  VD ref_wte = to_double(dwte0), ref_wpe = to_double(dwpe0);
  VF low_wte = dwte0, low_wpe = dwpe0;
  cpu::embedding_backward(ref_wte.data(), ref_wpe.data(), dout.d.data(), tok.data(), B, T, C);
  cpu::embedding_backward(low_wte.data(), low_wpe.data(), dout.f.data(), tok.data(), B, T, C);
  expect_matches("dwte", ref_wte, low_wte, got_wte, Out::f32);
  expect_matches("dwpe", ref_wpe, low_wpe, got_wpe, Out::f32);

  // Same inputs, same bits.
  CUDA_CHECK(cudaMemcpy(dwte, dwte0.data(), dwte0.size() * sizeof(float), cudaMemcpyHostToDevice));
  gpu::embedding_backward(dwte, nullptr, ddout, dtok, B, T, C, V, ws, ws_bytes, dev.stream());
  expect_bitwise_equal("dwte", got_wte, dev.get(dwte, dwte0.size()));
}

TEST_F(GpuOps, EmbeddingBackward) {
  run_embedding_backward(4, 300, 771, 97, 0.4, 21);   // runs crossing many segments
  run_embedding_backward(3, 37, 768, 1000, 0.0, 22);  // mostly singletons
  run_embedding_backward(1, 64, 40, 5, 0.9, 23);      // exactly one segment
  run_embedding_backward(2, 65, 33, 2, 0.5, 24);      // two tokens, tiny vocabulary
}

// ---------------------------------------------------------------------------------------
// Norms

void run_norm_forward(bool rms, int N, int C, bool residual, bool alias, uint64_t seed) {
  SCOPED_TRACE(std::string(rms ? "rmsnorm" : "layernorm") + " N=" + std::to_string(N) + " C=" + std::to_string(C) +
               (residual ? " residual" : "") + (alias ? " in-place" : ""));
  Dev dev;
  const size_t n = size_t(N) * C;
  const Data a = random_bf16(n, seed, 1.0, 0.3), b = random_bf16(n, seed + 1, 0.5),
             w = random_bf16(C, seed + 2, 0.2, 1.0), bias = random_bf16(C, seed + 3, 0.1);
  bf16* da = dev.put_bf16(a.bits, "a");
  bf16* db = residual ? dev.put_bf16(b.bits, "b") : nullptr;
  bf16* res = residual ? (alias ? da : dev.poisoned_bf16(n, "residual")) : nullptr;
  bf16* out = dev.poisoned_bf16(n);
  float* mean = dev.poisoned<float>(N, "mean");
  float* rstd = dev.poisoned<float>(N, "rstd");
  if (rms)
    gpu::rmsnorm_forward(out, rstd, res, da, db, dev.put_bf16(w.bits), N, C, dev.stream());
  else
    gpu::layernorm_forward(out, mean, rstd, res, da, db, dev.put_bf16(w.bits), dev.put_bf16(bias.bits), N, C,
                           dev.stream());
  // Reference: the exact sum in fp64; low: the sum rounded to bf16 as stored, then fp32.
  VD xd = a.d;
  VF xf = a.f;
  if (residual) {
    for (size_t i = 0; i < n; ++i) {
      xd[i] = a.d[i] + b.d[i];
      xf[i] = round_bf16(a.f[i] + b.f[i]);
    }
    expect_matches("residual_out", xd, xf, dev.get_bf16(res, n), Out::bf16);
  }
  VD od(n), md(N), rd(N);
  VF of(n), mf(N), rf(N);
  if (rms) {
    cpu::rmsnorm_forward(od.data(), rd.data(), xd.data(), w.d.data(), N, C);
    cpu::rmsnorm_forward(of.data(), rf.data(), xf.data(), w.f.data(), N, C);
  } else {
    cpu::layernorm_forward(od.data(), md.data(), rd.data(), xd.data(), w.d.data(), bias.d.data(), N, C);
    cpu::layernorm_forward(of.data(), mf.data(), rf.data(), xf.data(), w.f.data(), bias.f.data(), N, C);
    expect_matches("mean", md, mf, dev.get(mean, N), Out::f32);
  }
  expect_matches("out", od, round_bf16(of), dev.get_bf16(out, n), Out::bf16);
  expect_matches("rstd", rd, rf, dev.get(rstd, N), Out::f32);
  if (!residual || alias) return;
  // b with a pending scale (a 2:4 fp8 product's output): the bits of b scaled in place first.
  const float* f = dev.put(VF{1.9f, 0.21f});
  const gpu::PendingScale scale{f, f + 1};
  bf16* scaled_b = dev.put_bf16(b.bits);
  gpu::apply_pending_scale(scaled_b, int64_t(n), scale, dev.stream());
  const auto run = [&](const bf16* bb, gpu::PendingScale s) {
    bf16* o = dev.poisoned_bf16(n);
    if (rms)
      gpu::rmsnorm_forward(o, rstd, res, da, bb, dev.put_bf16(w.bits), N, C, dev.stream(), 1e-5f, s);
    else
      gpu::layernorm_forward(o, mean, rstd, res, da, bb, dev.put_bf16(w.bits), dev.put_bf16(bias.bits), N, C,
                             dev.stream(), 1e-5f, s);
    const auto bits = [&](const bf16* p) { return dev.get(reinterpret_cast<const uint16_t*>(p), n); };
    return std::pair{bits(o), bits(res)};
  };
  EXPECT_EQ(run(db, scale), run(scaled_b, {})) << "the norm's output and residual_out with a pending scale";
}

TEST_F(GpuOps, LayerNormForward) {
  run_norm_forward(false, 37, 771, true, false, 31);
  run_norm_forward(false, 64, 768, true, false, 32);
  run_norm_forward(false, 64, 768, true, true, 33);
  run_norm_forward(false, 5, 3000, false, false, 34);
  run_norm_forward(false, 9, 8, true, false, 35);
}

TEST_F(GpuOps, RmsNormForward) {
  run_norm_forward(true, 37, 771, true, false, 41);
  run_norm_forward(true, 64, 768, true, true, 42);
  run_norm_forward(true, 5, 3000, false, false, 43);
}

void run_norm_backward(bool rms, int N, int C, uint64_t seed) {
  SCOPED_TRACE(std::string(rms ? "rmsnorm" : "layernorm") + " N=" + std::to_string(N) + " C=" + std::to_string(C));
  Dev dev;
  const size_t n = size_t(N) * C;
  const Data x = random_bf16(n, seed, 1.0, 0.2), dout = random_bf16(n, seed + 1),
             w = random_bf16(C, seed + 2, 0.2, 1.0), dinp0 = random_bf16(n, seed + 3, 0.5);
  const VF dw0 = random_f32(C, seed + 4), db0 = random_f32(C, seed + 5);
  // Saved statistics as forward would store them (fp32), fed to all three computations.
  VF mean(N), rstd(N);
  for (int r = 0; r < N; ++r) {
    double s = 0, ss = 0, v = 0;
    for (int c = 0; c < C; ++c) {
      s += x.d[size_t(r) * C + c];
      ss += x.d[size_t(r) * C + c] * x.d[size_t(r) * C + c];
    }
    const double m = s / C;
    for (int c = 0; c < C; ++c) v += (x.d[size_t(r) * C + c] - m) * (x.d[size_t(r) * C + c] - m);
    mean[r] = static_cast<float>(m);
    rstd[r] = static_cast<float>(1.0 / std::sqrt((rms ? ss : v) / C + cpu::kNormEps));
  }
  bf16* dinp = dev.put_bf16(dinp0.bits, "dinp");
  float* dw = dev.put(dw0, "dweight");
  float* db = dev.put(db0, "dbias");
  const size_t sb = gpu::norm_backward_scratch_bytes(N, C);
  void* scratch = dev.scratch(sb);
  const bf16* ddout = dev.put_bf16(dout.bits);
  const bf16* dx = dev.put_bf16(x.bits);
  const bf16* dwt = dev.put_bf16(w.bits);
  const float* dmean = dev.put(mean);
  const float* drstd = dev.put(rstd);
  auto run = [&] {
    if (rms)
      gpu::rmsnorm_backward(dinp, dw, ddout, dx, dwt, drstd, N, C, scratch, sb, dev.stream());
    else
      gpu::layernorm_backward(dinp, dw, db, ddout, dx, dwt, dmean, drstd, N, C, scratch, sb, dev.stream());
  };
  run();
  const VF got_dinp = dev.get_bf16(dinp, n), got_dw = dev.get(dw, C), got_db = dev.get(db, C);
  const Bits got_dinp_bits = dev.get(reinterpret_cast<const uint16_t*>(dinp), n);

  VD ref_dinp = dinp0.d, ref_dw = to_double(dw0), ref_db = to_double(db0);
  VF low_dinp = dinp0.f, low_dw = dw0, low_db = db0;
  const VD mean_d = to_double(mean), rstd_d = to_double(rstd);
  if (rms) {
    cpu::rmsnorm_backward(ref_dinp.data(), ref_dw.data(), dout.d.data(), x.d.data(), w.d.data(), rstd_d.data(), N, C);
    cpu::rmsnorm_backward(low_dinp.data(), low_dw.data(), dout.f.data(), x.f.data(), w.f.data(), rstd.data(), N, C);
  } else {
    cpu::layernorm_backward(ref_dinp.data(), ref_dw.data(), ref_db.data(), dout.d.data(), x.d.data(), w.d.data(),
                            mean_d.data(), rstd_d.data(), N, C);
    cpu::layernorm_backward(low_dinp.data(), low_dw.data(), low_db.data(), dout.f.data(), x.f.data(), w.f.data(),
                            mean.data(), rstd.data(), N, C);
    expect_matches("dbias", ref_db, low_db, got_db, Out::f32);
  }
  expect_matches("dinp", ref_dinp, round_bf16(low_dinp), got_dinp, Out::bf16);
  expect_matches("dweight", ref_dw, low_dw, got_dw, Out::f32);

  // Determinism of the weight gradient (two-pass column sums).
  CUDA_CHECK(cudaMemcpy(dinp, dinp0.bits.data(), n * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dw, dw0.data(), C * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(db, db0.data(), C * sizeof(float), cudaMemcpyHostToDevice));
  run();
  expect_bitwise_equal("dweight", got_dw, dev.get(dw, C));
  if (!rms) expect_bitwise_equal("dbias", got_db, dev.get(db, C));
  expect_bitwise_equal("dinp", got_dinp_bits, dev.get(reinterpret_cast<const uint16_t*>(dinp), n));
}

TEST_F(GpuOps, LayerNormBackward) {
  run_norm_backward(false, 37, 771, 51);
  run_norm_backward(false, 300, 256, 52);   // several row chunks
  run_norm_backward(false, 1000, 40, 53);   // many row chunks, narrow rows
  run_norm_backward(false, 3, 3000, 54);
}

TEST_F(GpuOps, RmsNormBackward) {
  run_norm_backward(true, 37, 771, 61);
  run_norm_backward(true, 300, 256, 62);
  run_norm_backward(true, 1000, 40, 63);
}

// ---------------------------------------------------------------------------------------
// RoPE

void run_rope(bool backward, int B, int T, int NH, int NKV, int HD, double theta, uint64_t seed) {
  SCOPED_TRACE(std::string(backward ? "backward" : "forward") + " T=" + std::to_string(T) +
               " NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV) + " HD=" + std::to_string(HD));
  Dev dev;
  const size_t n = size_t(B) * T * (NH + 2 * NKV) * HD;
  const Data x = random_bf16(n, seed);
  bf16* d = dev.put_bf16(x.bits);
  VD ref = x.d;
  VF low = x.f;
  if (backward) {
    gpu::rope_backward(d, B, T, NH, NKV, HD, theta, dev.stream());
    cpu::rope_backward(ref.data(), B, T, NH, NKV, HD, theta);
    cpu::rope_backward(low.data(), B, T, NH, NKV, HD, theta);
  } else {
    gpu::rope_forward(d, {}, B, T, NH, NKV, HD, theta, dev.stream());
    cpu::rope_forward(ref.data(), B, T, NH, NKV, HD, theta);
    cpu::rope_forward(low.data(), B, T, NH, NKV, HD, theta);
  }
  const VF got = dev.get_bf16(d, n);
  expect_matches("qkv", ref, round_bf16(low), got, Out::bf16);
  // v is untouched, bit for bit.
  const int64_t Ctot = int64_t(NH + 2 * NKV) * HD, v0 = int64_t(NH + NKV) * HD;
  for (int64_t r = 0; r < int64_t(B) * T; ++r)
    for (int64_t c = v0; c < Ctot; ++c) ASSERT_EQ(got[r * Ctot + c], x.f[r * Ctot + c]);
  if (backward) return;
  // With a pending scale (a 2:4 fp8 product's output): the bits of the scale applied in place
  // first (apply_pending_scale), then the rotation; v scaled too.
  const float* f = dev.put(VF{0.37f, 3.1f});
  const gpu::PendingScale scale{f, f + 1};
  bf16* want = dev.put_bf16(x.bits);
  bf16* scaled = dev.put_bf16(x.bits);
  gpu::apply_pending_scale(want, int64_t(n), scale, dev.stream());
  gpu::rope_forward(want, {}, B, T, NH, NKV, HD, theta, dev.stream());
  gpu::rope_forward(scaled, scale, B, T, NH, NKV, HD, theta, dev.stream());
  const auto bits = [&](const bf16* p) { return dev.get(reinterpret_cast<const uint16_t*>(p), n); };
  EXPECT_EQ(bits(scaled), bits(want)) << "rope_forward with a pending scale";
  EXPECT_NE(bits(want), bits(d)) << "the scale changes the values";
}

TEST_F(GpuOps, Rope) {
  run_rope(false, 2, 37, 6, 2, 18, 10000.0, 71);
  run_rope(true, 2, 37, 6, 2, 18, 10000.0, 72);
  run_rope(false, 1, 2048, 4, 4, 64, 500000.0, 73);  // long positions: angles in fp64
  run_rope(true, 3, 5, 3, 1, 2, 10000.0, 74);
  run_rope(true, 2, 19, 12, 3, 8, 10000.0, 75);  // 15 rotated heads: the kernel's batches of 8 and a partial one
}

// ---------------------------------------------------------------------------------------
// Pointwise activations

enum class Act { gelu, relu2 };

void run_unary(Act act, int64_t n, int offset, uint64_t seed) {
  SCOPED_TRACE(std::string(act == Act::gelu ? "gelu" : "relu2") + " n=" + std::to_string(n) +
               " offset=" + std::to_string(offset));
  Dev dev;
  // offset shifts every pointer by that many elements, which breaks 16-byte alignment.
  const Data x = random_bf16(n + offset, seed, 2.0), dout = random_bf16(n + offset, seed + 1),
             dinp0 = random_bf16(n + offset, seed + 2, 0.3);
  const bf16* dx = dev.put_bf16(x.bits) + offset;
  const bf16* dd = dev.put_bf16(dout.bits) + offset;
  bf16* out = dev.poisoned_bf16(n + offset) + offset;
  act == Act::gelu ? gpu::gelu_forward(out, dx, n, dev.stream()) : gpu::relu2_forward(out, dx, n, dev.stream());
  const VD xd(x.d.begin() + offset, x.d.end()), dd_d(dout.d.begin() + offset, dout.d.end());
  const VF xf(x.f.begin() + offset, x.f.end()), df(dout.f.begin() + offset, dout.f.end());
  VD ref(n);
  VF low(n);
  if (act == Act::gelu) {
    cpu::gelu_forward(ref.data(), xd.data(), n);
    cpu::gelu_forward(low.data(), xf.data(), n);
  } else {
    cpu::relu2_forward(ref.data(), xd.data(), n);
    cpu::relu2_forward(low.data(), xf.data(), n);
  }
  expect_matches("forward", ref, round_bf16(low), dev.get_bf16(out, n), Out::bf16);

  // Backward, accumulating into a pre-filled dinp.
  bf16* dinp = dev.put_bf16(dinp0.bits) + offset;
  act == Act::gelu ? gpu::gelu_backward(dinp, dx, dd, n, true, dev.stream())
                   : gpu::relu2_backward(dinp, dx, dd, n, true, dev.stream());
  VD ref_b(dinp0.d.begin() + offset, dinp0.d.end());
  VF low_b(dinp0.f.begin() + offset, dinp0.f.end());
  if (act == Act::gelu) {
    cpu::gelu_backward(ref_b.data(), xd.data(), dd_d.data(), n);
    cpu::gelu_backward(low_b.data(), xf.data(), df.data(), n);
  } else {
    cpu::relu2_backward(ref_b.data(), xd.data(), dd_d.data(), n);
    cpu::relu2_backward(low_b.data(), xf.data(), df.data(), n);
  }
  expect_matches("backward (accumulate)", ref_b, round_bf16(low_b), dev.get_bf16(dinp, n), Out::bf16);

  // Backward overwriting, in place on dout.
  bf16* inplace = dev.put_bf16(dout.bits) + offset;
  act == Act::gelu ? gpu::gelu_backward(inplace, dx, inplace, n, false, dev.stream())
                   : gpu::relu2_backward(inplace, dx, inplace, n, false, dev.stream());
  VD ref_o(n, 0.0);
  VF low_o(n, 0.f);
  if (act == Act::gelu) {
    cpu::gelu_backward(ref_o.data(), xd.data(), dd_d.data(), n);
    cpu::gelu_backward(low_o.data(), xf.data(), df.data(), n);
  } else {
    cpu::relu2_backward(ref_o.data(), xd.data(), dd_d.data(), n);
    cpu::relu2_backward(low_o.data(), xf.data(), df.data(), n);
  }
  expect_matches("backward (in place)", ref_o, round_bf16(low_o), dev.get_bf16(inplace, n), Out::bf16);
}

TEST_F(GpuOps, Gelu) {
  run_unary(Act::gelu, 12345, 0, 81);
  run_unary(Act::gelu, 12345, 1, 82);
  run_unary(Act::gelu, 8 * 1000, 0, 83);
  run_unary(Act::gelu, 7, 0, 84);
}

TEST_F(GpuOps, Relu2) {
  run_unary(Act::relu2, 12345, 0, 91);
  run_unary(Act::relu2, 12345, 3, 92);
}

void run_swiglu(int64_t N, int H, uint64_t seed) {
  SCOPED_TRACE("N=" + std::to_string(N) + " H=" + std::to_string(H));
  Dev dev;
  const size_t ni = size_t(N) * 2 * H, no = size_t(N) * H;
  const Data x = random_bf16(ni, seed, 2.0), dout = random_bf16(no, seed + 1), dinp0 = random_bf16(ni, seed + 2, 0.3);
  const bf16* dx = dev.put_bf16(x.bits);
  bf16* out = dev.poisoned_bf16(no);
  gpu::swiglu_forward(out, dx, N, H, dev.stream());
  VD ref(no);
  VF low(no);
  cpu::swiglu_forward(ref.data(), x.d.data(), N, H);
  cpu::swiglu_forward(low.data(), x.f.data(), N, H);
  expect_matches("swiglu forward", ref, round_bf16(low), dev.get_bf16(out, no), Out::bf16);

  for (bool acc : {true, false}) {
    bf16* dinp = acc ? dev.put_bf16(dinp0.bits) : dev.poisoned_bf16(ni);
    gpu::swiglu_backward(dinp, dx, dev.put_bf16(dout.bits), N, H, acc, dev.stream());
    VD ref_b = acc ? dinp0.d : VD(ni, 0.0);
    VF low_b = acc ? dinp0.f : VF(ni, 0.f);
    cpu::swiglu_backward(ref_b.data(), x.d.data(), dout.d.data(), N, H);
    cpu::swiglu_backward(low_b.data(), x.f.data(), dout.f.data(), N, H);
    expect_matches(acc ? "swiglu backward (accumulate)" : "swiglu backward", ref_b, round_bf16(low_b),
                   dev.get_bf16(dinp, ni), Out::bf16);
  }
}

TEST_F(GpuOps, SwiGlu) {
  run_swiglu(37, 771, 101);
  run_swiglu(16, 256, 102);
  run_swiglu(3, 1, 103);
}

TEST_F(GpuOps, Residual) {
  for (int64_t n : {int64_t(12347), int64_t(4096)}) {
    Dev dev;
    const Data a = random_bf16(n, 111), b = random_bf16(n, 112);
    bf16* out = dev.poisoned_bf16(n);
    gpu::residual_forward(out, dev.put_bf16(a.bits), dev.put_bf16(b.bits), n, dev.stream());
    VD ref(n);
    VF low(n);
    cpu::residual_forward(ref.data(), a.d.data(), b.d.data(), n);
    cpu::residual_forward(low.data(), a.f.data(), b.f.data(), n);
    expect_matches("residual", ref, round_bf16(low), dev.get_bf16(out, n), Out::bf16);
  }
}

// ---------------------------------------------------------------------------------------
// Cross-entropy

void run_cross_entropy(int64_t N, int V, int Vp, uint64_t seed) {
  SCOPED_TRACE("N=" + std::to_string(N) + " V=" + std::to_string(V) + " Vp=" + std::to_string(Vp));
  Dev dev;
  Rng rng(seed);
  std::vector<int32_t> tgt(N);
  for (auto& t : tgt) t = static_cast<int32_t>(rng.below(V));
  // Padded rows: the padding holds garbage (here large values) that must be ignored.
  const Data logits = random_bf16(size_t(N) * Vp, seed + 1, 3.0);
  Bits padded = logits.bits;
  for (int64_t r = 0; r < N; ++r)
    for (int c = V; c < Vp; ++c) padded[r * Vp + c] = esplag::float_to_bf16(1e4f);
  VD xd(size_t(N) * V);
  VF xf(size_t(N) * V);
  for (int64_t r = 0; r < N; ++r)
    for (int c = 0; c < V; ++c) {
      xd[r * V + c] = logits.d[r * Vp + c];
      xf[r * V + c] = logits.f[r * Vp + c];
    }
  const float dloss = 1.0f / static_cast<float>(N);
  bf16* dl = dev.put_bf16(padded, "logits");
  float* losses = dev.poisoned<float>(N, "losses");
  gpu::softmax_cross_entropy(losses, dl, dev.put(tgt), N, V, Vp, dloss, true, dev.stream());
  const VF got_loss = dev.get(losses, N), got_all = dev.get_bf16(dl, size_t(N) * Vp);
  VD ref_loss(N), ref_d(size_t(N) * V);
  VF low_loss(N), low_d(size_t(N) * V);
  cpu::softmax_cross_entropy(ref_loss.data(), ref_d.data(), xd.data(), tgt.data(), N, V, double(dloss));
  cpu::softmax_cross_entropy(low_loss.data(), low_d.data(), xf.data(), tgt.data(), N, V, dloss);
  VF got_d(size_t(N) * V);
  for (int64_t r = 0; r < N; ++r) {
    for (int c = 0; c < V; ++c) got_d[r * V + c] = got_all[r * Vp + c];
    for (int c = V; c < Vp; ++c) ASSERT_EQ(got_all[r * Vp + c], 0.f) << "padding column " << c << " of row " << r;
  }
  expect_matches("losses", ref_loss, low_loss, got_loss, Out::f32);
  expect_matches("dlogits", ref_d, round_bf16(low_d), got_d, Out::bf16);

  // Loss only: the logits stay as they were.
  bf16* dl2 = dev.put_bf16(padded, "logits2");
  float* losses2 = dev.poisoned<float>(N, "losses2");
  gpu::softmax_cross_entropy(losses2, dl2, dev.put(tgt), N, V, Vp, dloss, false, dev.stream());
  expect_bitwise_equal("losses without gradient", got_loss, dev.get(losses2, N));
  expect_bitwise_equal("untouched logits", padded, dev.get(reinterpret_cast<uint16_t*>(dl2), padded.size()));
}

TEST_F(GpuOps, CrossEntropy) {
  run_cross_entropy(37, 1031, 1031, 121);  // scalar path
  run_cross_entropy(37, 1031, 1040, 122);  // vector path with padding
  run_cross_entropy(8, 50257, 50304, 123); // GPT-2 vocabulary
  run_cross_entropy(5, 3, 3, 124);
}

TEST_F(GpuOps, CrossEntropyBadTargetGivesNaN) {
  Dev dev;
  const int N = 2, V = 16;
  const Data logits = random_bf16(N * V, 131);
  const std::vector<int32_t> tgt = {4, 16};
  float* losses = dev.poisoned<float>(N);
  gpu::softmax_cross_entropy(losses, dev.put_bf16(logits.bits), dev.put(tgt), N, V, V, 1.f, true, dev.stream());
  const VF l = dev.get(losses, N);
  EXPECT_TRUE(std::isfinite(l[0]));
  EXPECT_TRUE(std::isnan(l[1]));
}

// ---------------------------------------------------------------------------------------
// AdamW and the global norm

void run_adamw(bool device_clip, uint64_t seed) {
  Dev dev;
  // Awkward segments: odd offsets (scalar path), one longer than a chunk, a gap that
  // must stay untouched, decay on and off.
  const std::vector<gpu::ParamSegment> segs = {
      {0, 1000, true},    {1000, 37, false},   {1037, 20000, true},
      {21037, 3, false},  {21100, 771, true},  {21871, 4096, false}};
  const int64_t total = 21871 + 4096;
  VF master = random_f32(total, seed, 0.05), m = random_f32(total, seed + 1, 0.01), g = random_f32(total, seed + 3);
  VF v = random_f32(total, seed + 2, 1e-4);
  for (float& x : v) x = std::fabs(x);
  gpu::AdamWConfig cfg;
  cfg.lr = 3e-3f;
  cfg.beta1 = 0.9f;
  cfg.beta2 = 0.95f;
  cfg.eps = 1e-8f;
  cfg.weight_decay = 0.1f;
  cfg.step = 7;
  cfg.grad_scale = 0.5f;
  double host_scale = 0.5;
  float* norm_sq = nullptr;
  if (device_clip) {
    // A norm of 3 as if measured on the device (9 and its root are exact in fp32).
    norm_sq = dev.put(VF{9.0f}, "norm_sq");
    cfg.clip_norm_sq = norm_sq;
    cfg.max_grad_norm = 1.0f;
    host_scale *= cpu::clip_scale(3.0, 1.0);
  }
  float* dp = dev.put(master, "master");
  float* dm = dev.put(m, "m");
  float* dv = dev.put(v, "v");
  bf16* dw = dev.poisoned_bf16(total, "weight");
  gpu::AdamWPlan plan(segs, dev.arena());
  EXPECT_EQ(plan.total_numel(), total);
  gpu::adamw_update(plan, dp, dm, dv, dev.put(g, "grad"), dw, cfg, dev.stream());
  const VF gp = dev.get(dp, total), gm = dev.get(dm, total), gv = dev.get(dv, total);
  const Bits gw = dev.get(reinterpret_cast<uint16_t*>(dw), total);

  VD rp = to_double(master), rm = to_double(m), rv = to_double(v);
  VF lp = master, lm = m, lv = v;
  const VD gd = to_double(g);
  for (const auto& s : segs) {
    const double wd = s.decay ? cfg.weight_decay : 0.0;
    cpu::adamw_step(rp.data() + s.offset, gd.data() + s.offset, rm.data() + s.offset, rv.data() + s.offset, s.numel,
                    double(cfg.lr), double(cfg.beta1), double(cfg.beta2), double(cfg.eps), wd, cfg.step, host_scale);
    cpu::adamw_step(lp.data() + s.offset, g.data() + s.offset, lm.data() + s.offset, lv.data() + s.offset, s.numel,
                    double(cfg.lr), double(cfg.beta1), double(cfg.beta2), double(cfg.eps), wd, cfg.step, host_scale);
  }
  expect_matches("master", rp, lp, gp, Out::f32);
  expect_matches("m", rm, lm, gm, Out::f32);
  expect_matches("v", rv, lv, gv, Out::f32);
  // The bf16 copy is the master rounded, in the same pass; the gap is untouched.
  for (int64_t i = 0; i < total; ++i) {
    const bool in_gap = i >= 21040 && i < 21100;
    if (in_gap) {
      ASSERT_EQ(gp[i], master[i]) << i;
      ASSERT_EQ(gw[i], 0xFFFF) << i;
    } else {
      ASSERT_EQ(gw[i], esplag::float_to_bf16(gp[i])) << "weight copy at " << i;
    }
  }
}

TEST_F(GpuOps, AdamW) { run_adamw(false, 141); }
TEST_F(GpuOps, AdamWDeviceClip) { run_adamw(true, 142); }

TEST_F(GpuOps, GlobalNormSquared) {
  for (int64_t n : {int64_t(1234567), int64_t(1000), int64_t(1), int64_t(0)}) {
    Dev dev;
    const VF g = random_f32(n, 151 + n, 0.01);
    float* out = dev.poisoned<float>(1);
    void* scratch = dev.scratch(gpu::global_norm_scratch_bytes());
    const float* dg = dev.put(g);
    gpu::global_norm_squared(out, dg, n, scratch, dev.stream());
    const VF got = dev.get(out, 1);
    const VD gd = to_double(g);
    const double ref = cpu::global_grad_norm_squared(gd.data(), n);
    EXPECT_NEAR(got[0], ref, 1e-5 * ref + 1e-30) << "n=" << n;
    gpu::global_norm_squared(out, dg, n, scratch, dev.stream());
    expect_bitwise_equal("norm", got, dev.get(out, 1));
  }
}

// ---------------------------------------------------------------------------------------
// GEMM (cuBLASLt) against cpu::linear_forward / linear_backward

void run_gemm(int N, int C, int OC, bool epilogues, uint64_t seed) {
  SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C) + " OC=" + std::to_string(OC) +
               (epilogues ? " epilogues" : " separate kernels"));
  Dev dev;
  gpu::Gemm gemm(dev.arena());
  gemm.set_use_epilogues(epilogues);
  const Data inp = random_bf16(size_t(N) * C, seed), w = random_bf16(size_t(OC) * C, seed + 1, 0.05),
             bias = random_bf16(OC, seed + 2, 0.5), dout = random_bf16(size_t(N) * OC, seed + 3);
  const bf16* di = dev.put_bf16(inp.bits);
  const bf16* dw = dev.put_bf16(w.bits);
  const bf16* db = dev.put_bf16(bias.bits);
  const bf16* dd = dev.put_bf16(dout.bits);
  const size_t no = size_t(N) * OC, ni = size_t(N) * C;

  // Forward: no bias, bias, bias + GELU (pre-activation saved), GELU without saving.
  VD ref_lin(no), ref_lin_b(no);
  VF low_lin(no), low_lin_b(no);
  cpu::linear_forward(ref_lin.data(), inp.d.data(), w.d.data(), static_cast<const double*>(nullptr), N, C, OC);
  cpu::linear_forward(low_lin.data(), inp.f.data(), w.f.data(), static_cast<const float*>(nullptr), N, C, OC);
  cpu::linear_forward(ref_lin_b.data(), inp.d.data(), w.d.data(), bias.d.data(), N, C, OC);
  cpu::linear_forward(low_lin_b.data(), inp.f.data(), w.f.data(), bias.f.data(), N, C, OC);
  {
    bf16* out = dev.poisoned_bf16(no);
    gemm.forward(out, di, dw, nullptr, N, C, OC, dev.stream());
    expect_matches("forward", ref_lin, round_bf16(low_lin), dev.get_bf16(out, no), Out::bf16);
    gemm.forward(out, di, dw, db, N, C, OC, dev.stream());
    expect_matches("forward + bias", ref_lin_b, round_bf16(low_lin_b), dev.get_bf16(out, no), Out::bf16);
    float* out32 = dev.poisoned<float>(no);
    gemm.forward(out32, di, dw, N, C, OC, dev.stream());
    expect_matches("forward fp32", ref_lin, low_lin, dev.get(out32, no), Out::f32);
  }
  {
    // GELU: low precision rounds the pre-activation before the GELU, as the separate
    // kernels do (the fused epilogue rounds only once, so it is at least as accurate).
    VD ref_act(no);
    cpu::gelu_forward(ref_act.data(), ref_lin_b.data(), int64_t(no));
    const VF pre_low = round_bf16(low_lin_b);
    VF low_act(no);
    cpu::gelu_forward(low_act.data(), pre_low.data(), int64_t(no));
    bf16* out = dev.poisoned_bf16(no);
    bf16* pre = dev.poisoned_bf16(no, "pre_gelu");
    gemm.forward(out, di, dw, db, N, C, OC, dev.stream(), gpu::Gemm::Act::gelu, pre);
    expect_matches("forward + bias + gelu", ref_act, round_bf16(low_act), dev.get_bf16(out, no), Out::bf16);
    expect_matches("pre_gelu", ref_lin_b, pre_low, dev.get_bf16(pre, no), Out::bf16);
    bf16* out2 = dev.poisoned_bf16(no);
    gemm.forward(out2, di, dw, db, N, C, OC, dev.stream(), gpu::Gemm::Act::gelu, nullptr);
    expect_matches("forward + bias + gelu (no aux)", ref_act, round_bf16(low_act), dev.get_bf16(out2, no),
                   Out::bf16);
  }

  // dinp = dout · W (overwrite), += (accumulate), and through gelu'(pre).
  VD ref_dinp(ni, 0.0);
  VF low_dinp(ni, 0.f);
  cpu::linear_backward(ref_dinp.data(), static_cast<double*>(nullptr), static_cast<double*>(nullptr), dout.d.data(),
                       inp.d.data(), w.d.data(), N, C, OC);
  cpu::linear_backward(low_dinp.data(), static_cast<float*>(nullptr), static_cast<float*>(nullptr), dout.f.data(),
                       inp.f.data(), w.f.data(), N, C, OC);
  {
    bf16* dinp = dev.poisoned_bf16(ni);
    gemm.backward_input(dinp, dd, dw, N, C, OC, false, dev.stream());
    expect_matches("dinp", ref_dinp, round_bf16(low_dinp), dev.get_bf16(dinp, ni), Out::bf16);

    const Data dinp0 = random_bf16(ni, seed + 4, 0.5);
    bf16* acc = dev.put_bf16(dinp0.bits);
    gemm.backward_input(acc, dd, dw, N, C, OC, true, dev.stream());
    VD ref_acc = dinp0.d;
    VF low_acc = dinp0.f;
    for (size_t i = 0; i < ni; ++i) {
      ref_acc[i] += ref_dinp[i];
      low_acc[i] += low_dinp[i];
    }
    expect_matches("dinp (accumulate)", ref_acc, round_bf16(low_acc), dev.get_bf16(acc, ni), Out::bf16);

    // The gradient through a GELU whose pre-activation (shape [N, C]) is `inp`.
    VD ref_g(ni, 0.0);
    cpu::gelu_backward(ref_g.data(), inp.d.data(), ref_dinp.data(), int64_t(ni));
    const VF tmp_low = round_bf16(low_dinp);
    VF low_g(ni, 0.f);
    cpu::gelu_backward(low_g.data(), inp.f.data(), tmp_low.data(), int64_t(ni));
    bf16* dg = dev.poisoned_bf16(ni);
    gemm.backward_input(dg, dd, dw, N, C, OC, false, dev.stream(), di);
    expect_matches("dinp through gelu", ref_g, round_bf16(low_g), dev.get_bf16(dg, ni), Out::bf16);
    EXPECT_THROW(gemm.backward_input(dg, dd, dw, N, C, OC, true, dev.stream(), di), esplag::Error);
  }

  // dW += doutᵀ · inp, dbias += Σ dout (fp32), and dW = ... with accumulate = false.
  {
    const VF dw0 = random_f32(size_t(OC) * C, seed + 5), db0 = random_f32(OC, seed + 6);
    float* gw = dev.put(dw0, "dweight");
    float* gb = dev.put(db0, "dbias");
    gemm.backward_weight(gw, gb, dd, di, N, C, OC, true, dev.stream());
    VD ref_w = to_double(dw0), ref_b = to_double(db0);
    VF low_w = dw0, low_b = db0;
    cpu::linear_backward(static_cast<double*>(nullptr), ref_w.data(), ref_b.data(), dout.d.data(), inp.d.data(),
                         w.d.data(), N, C, OC);
    cpu::linear_backward(static_cast<float*>(nullptr), low_w.data(), low_b.data(), dout.f.data(), inp.f.data(),
                         w.f.data(), N, C, OC);
    expect_matches("dweight (accumulate)", ref_w, low_w, dev.get(gw, dw0.size()), Out::f32);
    expect_matches("dbias (accumulate)", ref_b, low_b, dev.get(gb, OC), Out::f32);

    float* gw2 = dev.poisoned<float>(dw0.size(), "dweight2");
    gemm.backward_weight(gw2, nullptr, dd, di, N, C, OC, false, dev.stream());
    VD ref_w2(dw0.size(), 0.0);
    VF low_w2(dw0.size(), 0.f);
    cpu::linear_backward(static_cast<double*>(nullptr), ref_w2.data(), static_cast<double*>(nullptr), dout.d.data(),
                         inp.d.data(), w.d.data(), N, C, OC);
    cpu::linear_backward(static_cast<float*>(nullptr), low_w2.data(), static_cast<float*>(nullptr), dout.f.data(),
                         inp.f.data(), w.f.data(), N, C, OC);
    expect_matches("dweight", ref_w2, low_w2, dev.get(gw2, dw0.size()), Out::f32);

    // Bias gradient alone (no dW).
    float* gb2 = dev.put(db0, "dbias2");
    gemm.backward_weight(nullptr, gb2, dd, nullptr, N, C, OC, true, dev.stream());
    expect_matches("dbias alone", ref_b, low_b, dev.get(gb2, OC), Out::f32);
  }
  const size_t plans = gemm.cached_plans();
  EXPECT_GT(plans, 0u);
  bf16* again = dev.poisoned_bf16(no);
  gemm.forward(again, di, dw, nullptr, N, C, OC, dev.stream());
  EXPECT_EQ(gemm.cached_plans(), plans) << "a repeated shape must reuse its cached plan";
  if (!epilogues) {
    EXPECT_GT(gemm.epilogue_fallbacks(), 0u);
  }
  std::printf("[ gemm     ] N=%d C=%d OC=%d epilogues=%d: %zu plans, %zu calls on separate kernels\n", N, C, OC,
              int(epilogues), gemm.cached_plans(), gemm.epilogue_fallbacks());
}

TEST_F(GpuOps, GemmAwkwardSizes) {
  run_gemm(37, 771, 259, true, 161);
  run_gemm(37, 771, 259, false, 162);
}

TEST_F(GpuOps, GemmAlignedSizes) {
  run_gemm(64, 256, 192, true, 171);
  run_gemm(64, 256, 192, false, 172);
  run_gemm(200, 128, 512, true, 173);
}

}  // namespace
