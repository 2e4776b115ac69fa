// SLoPe's merged sparse + low-rank inference product on the GPU (sparse/cuda/slope_merged.h)
// against the CPU reference, SlopeLinear::merged_forward (model/linear_slope.h):
//
//   Y = X · W1ᵀ + b + (X · Rᵀ) · Lᵀ     W1 the layer's row-wise 2:4 weight, L [out, r], R [r, in]
//
// The oracle is that formula in fp64 over the CPU layer's own W1, L and R (the CPU layer's
// merged_forward must agree with it to fp32 rounding, so the oracle is the reference's
// function); the GPU must be within twice the error of the same computation done in the
// GPU's precision on the CPU (fp32 sums, X·Rᵀ rounded to bf16 once, Y rounded to bf16).
// Ranks that are and are not multiples of 8 (the padding of the adapter's columns), rank 0,
// with and without bias, sizes that are multiples of 16 but not all of 32; the output and
// the adapter columns of the input buffer are poisoned with NaN first. Then the refusals.
//
// The 2:4 cases skip (with the reason) when cuSPARSELt cannot be loaded; the fallback then
// runs the same product dense on cuBLASLt, which the same comparison checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "gpu_test_util.h"
#include "model/linear_slope.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/slope_merged.h"

namespace {

using esplag::LinearParams;
using esplag::SlopeLinear;
using esplag::gpu::SlopeMergedLinear;
namespace gt = esplag::gpu_test;
using gt::Bits;
using gt::VD;
using gt::VF;

// The bf16 bits of float values that are bf16-representable.
Bits to_bits(const VF& v) {
  Bits b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = esplag::float_to_bf16(v[i]);
  return b;
}

struct Case {
  int out, in, tokens, rank;
  bool bias;
};

std::string name_of(const Case& c) {
  return std::to_string(c.out) + "x" + std::to_string(c.in) + "x" + std::to_string(c.tokens) + " rank " +
         std::to_string(c.rank) + (c.bias ? " bias" : "");
}

void run_case(const Case& c, uint64_t seed) {
  const std::string what = name_of(c);
  SCOPED_TRACE(what);
  const int O = c.out, C = c.in, N = c.tokens, r = c.rank;

  // The CPU layer over bf16-representable parameters (its W1, L and R stay so).
  VF w = gt::random_bf16(size_t(O) * C, seed).f, b = gt::random_bf16(size_t(O), seed + 1, 0.5).f;
  VF dw(w.size()), db(b.size());
  LinearParams<float> p{
      "blocks.0.mlp.fc.weight",    "blocks.0.mlp.fc", 0, C, O, w.data(), c.bias ? b.data() : nullptr, dw.data(),
      c.bias ? db.data() : nullptr};
  SlopeLinear<float> layer(p, 1);
  if (r > 0) {
    layer.enable_lora(r, seed + 2);
    layer.lora_l() = gt::round_bf16(layer.lora_l());
    layer.lora_r() = gt::random_bf16(layer.lora_r().size(), seed + 3, 0.05).f;
  }
  VF w1(size_t(O) * C);
  layer.sparse_weight(w1.data());
  const VF& L = layer.lora_l();
  const VF& R = layer.lora_r();
  const gt::Data x = gt::random_bf16(size_t(N) * C, seed + 4);

  // fp64 oracle, and the GPU's precision emulated on the CPU.
  VD ref(size_t(N) * O);
  VF low(ref.size());
  for (int n = 0; n < N; ++n) {
    std::vector<double> t(r);
    VF t_low(r);
    for (int k = 0; k < r; ++k) {
      double acc = 0;
      float acc_f = 0;
      for (int i = 0; i < C; ++i) {
        acc += x.d[size_t(n) * C + i] * R[size_t(k) * C + i];
        acc_f += x.f[size_t(n) * C + i] * R[size_t(k) * C + i];
      }
      t[k] = acc;
      t_low[k] = gt::round_bf16(acc_f);
    }
    for (int o = 0; o < O; ++o) {
      double acc = c.bias ? b[o] : 0.0;
      float acc_f = c.bias ? b[o] : 0.f;
      for (int i = 0; i < C; ++i) {
        acc += x.d[size_t(n) * C + i] * w1[size_t(o) * C + i];
        acc_f += x.f[size_t(n) * C + i] * w1[size_t(o) * C + i];
      }
      for (int k = 0; k < r; ++k) {
        acc += t[k] * L[size_t(o) * r + k];
        acc_f += t_low[k] * L[size_t(o) * r + k];
      }
      ref[size_t(n) * O + o] = acc;
      low[size_t(n) * O + o] = gt::round_bf16(acc_f);
    }
  }
  // The oracle is the CPU reference's function.
  VF cpu(ref.size());
  layer.merged_forward(cpu.data(), x.f.data(), N);
  const gt::Err cpu_err = gt::error_of(ref, cpu), mag = gt::magnitude(ref);
  ASSERT_LE(cpu_err.rms, 1e-5 * mag.rms) << "the CPU merged_forward disagrees with the fp64 formula";

  gt::DeviceBuffers dev(size_t(64) << 20, "slope merged test");
  const cudaStream_t s = dev.stream();
  gt::bf16* d_w1 = dev.put_bf16(to_bits(w1), "W1");
  gt::bf16* d_l = r > 0 ? dev.put_bf16(to_bits(L), "L") : nullptr;
  gt::bf16* d_r = r > 0 ? dev.put_bf16(to_bits(R), "R") : nullptr;
  gt::bf16* d_b = c.bias ? dev.put_bf16(to_bits(b), "bias") : nullptr;
  SlopeMergedLinear merged(O, C, r, N, c.bias, d_w1, d_l, d_r, s);
  EXPECT_EQ(merged.padded_rank(), (r + 7) / 8 * 8);
  EXPECT_EQ(merged.input_stride(), C + 2 * merged.padded_rank());
  EXPECT_EQ(merged.sparse(), esplag::gpu::cusparselt_available());

  // X into the first C columns of a poisoned wide buffer (the adapter columns stay NaN
  // until forward writes them).
  const int64_t K = merged.input_stride();
  gt::bf16* d_xw = dev.poisoned_bf16(size_t(N) * K, "X wide");
  CUDA_CHECK(cudaMemcpy2D(d_xw, K * sizeof(uint16_t), x.bits.data(), C * sizeof(uint16_t), C * sizeof(uint16_t), N,
                          cudaMemcpyHostToDevice));
  gt::bf16* d_y = dev.poisoned_bf16(size_t(N) * O, "Y");
  // Twice: the first call tunes the product, the second runs the tuned plan.
  for (int call = 0; call < 2; ++call) {
    CUDA_CHECK(cudaMemsetAsync(d_y, 0xFF, size_t(N) * O * sizeof(uint16_t), s));
    merged.forward(d_y, d_xw, d_b, s);
    gt::expect_within_low_precision(what + (call ? " (tuned)" : " (first call)"), ref, low,
                                    dev.get_bf16(d_y, size_t(N) * O), /*bf16_out=*/true);
  }
  EXPECT_GT(merged.device_bytes(), 0u);
}

TEST(GpuSlopeMerged, MatchesTheCpuReference) {
  if (!gt::has_device()) GTEST_SKIP() << "no CUDA device";
  if (!esplag::gpu::cusparselt_available())
    std::printf("cuSPARSELt unavailable (%s): checking the dense fallback\n",
                esplag::gpu::cusparselt_unavailable_reason().c_str());
  const Case cases[] = {
      {64, 64, 32, 8, true},    // rank a multiple of 8
      {48, 80, 16, 5, false},   // rank padded (5 -> 8), no bias, sizes not multiples of 32
      {112, 48, 48, 3, true},   // in narrower than out
      {96, 176, 64, 16, true},  // two padded groups
      {80, 64, 32, 0, true},    // no adapter: W1's product alone
      {32, 32, 16, 32, false},  // full rank
  };
  uint64_t seed = 100;
  for (const Case& c : cases) {
    run_case(c, seed);
    seed += 10;
  }
}

TEST(GpuSlopeMerged, RefusesWhatItCannotRun) {
  if (!gt::has_device()) GTEST_SKIP() << "no CUDA device";
  gt::DeviceBuffers dev(size_t(4) << 20, "slope merged refusals");
  const cudaStream_t s = dev.stream();
  const gt::Data w = gt::random_bf16(64 * 64, 7);  // dense: not 2:4
  gt::bf16* d_w = dev.put_bf16(w.bits, "W");
  gt::bf16* d_l = dev.put_bf16(gt::random_bf16(64 * 4, 8).bits, "L");
  gt::bf16* d_r = dev.put_bf16(gt::random_bf16(4 * 64, 9).bits, "R");
  auto expect_error = [](auto&& make, const std::string& needle) {
    try {
      make();
      ADD_FAILURE() << "expected an Error containing '" << needle << "'";
    } catch (const esplag::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { SlopeMergedLinear(50, 64, 4, 32, false, d_w, d_l, d_r, s); }, "multiples of 16");
  expect_error([&] { SlopeMergedLinear(64, 64, 4, 24, false, d_w, d_l, d_r, s); }, "multiples of 16");
  expect_error([&] { SlopeMergedLinear(64, 64, 65, 32, false, d_w, d_l, d_r, s); }, "adapter rank");
  expect_error([&] { SlopeMergedLinear(64, 64, 4, 32, false, d_w, nullptr, d_r, s); }, "needs W1, and L and R");
  if (esplag::gpu::cusparselt_available())
    expect_error([&] { SlopeMergedLinear(64, 64, 4, 32, false, d_w, d_l, d_r, s); }, "not 2:4 along its rows");

  // forward's own checks: the bias must match the construction.
  Bits pruned = w.bits;
  for (size_t i = 0; i < pruned.size(); i += 4) pruned[i + 1] = pruned[i + 3] = 0;  // keep positions 0 and 2
  gt::bf16* d_w1 = dev.put_bf16(pruned, "W1");
  SlopeMergedLinear layer(64, 64, 4, 32, false, d_w1, d_l, d_r, s);
  gt::bf16* d_xw = dev.poisoned_bf16(size_t(32) * layer.input_stride(), "X wide");
  gt::bf16* d_y = dev.poisoned_bf16(size_t(32) * 64, "Y");
  expect_error([&] { layer.forward(d_y, d_xw, d_w1, s); }, "without a bias");
  expect_error([&] { layer.forward(nullptr, d_xw, nullptr, s); }, "needs y and x_wide");
}

}  // namespace
