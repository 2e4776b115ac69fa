// One sparse Linear's training step on the GPU (sparse/cuda/sparse_linear.h) against the
// CPU: for each kind, the forward output, dX and the fp32 dW of several steps, with the
// weight changed between steps as an optimizer would, against fp64 products of the masked
// weights the CPU references define:
//   dense        W
//   semi_sparse  W ⊙ cpu::transposable_mask_greedy(W) of the current W (model/linear_semi_sparse.h)
//   slope        W1 = W ⊙ forward mask, the mask cpu::double_prune_masks chose from the
//                first W (static); dX through W2 = W1 ⊙ cpu::double_prune_backward_mask(W1)
//                (model/linear_slope.h with mask_change_freq = 1)
// dW is dYᵀ·X, unmasked, for every kind. The pruned weights the layer builds (Ws, W1, W2ᵀ)
// must equal the CPU's bit for bit; the products agree within bf16 tolerance. Outputs are
// poisoned (all bits set: NaN) before every step. Sizes are multiples of 16 (cuSPARSELt's
// rule), not all of 32, square and not.
//
// sparse_dw (dW = MVUE(dYᵀ) · X, the 2:4 product of the unbiased estimate): the fp32 dW
// against the fp64 product of the CPU's estimate (cpu::mvue_24_bf16 of dYᵀ with the seed
// the layer derives) by the accuracy rule of the op tests (no worse than twice a CPU
// computation of the same product in fp32 rounded to bf16), = and +=, outputs poisoned;
// the same seed giving the same bits and each backward a new draw; the mean of 32 draws
// approaching the dense dYᵀ · X; its refusals and memory.
//
// The sparse kinds skip (with the reason) when cuSPARSELt cannot be loaded.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/cusparselt_layout.h"
#include "sparse/cuda/sparse_linear.h"
#include "sparse/double_prune.h"
#include "sparse/mvue.h"
#include "sparse/transposable.h"

#include "gpu_test_util.h"

namespace {

using esplag::Rng;
using esplag::gpu::bf16;
using esplag::gpu::SparseLinear;
using esplag::gpu::SparseLinearKind;
using esplag::gpu::SparseLinearOptions;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;

using Bits = std::vector<uint16_t>;
using VF = std::vector<float>;
using VD = std::vector<double>;

bool has_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

using Dev = esplag::gpu_test::DeviceBlock;

Bits random_bf16(size_t n, double scale, Rng& rng) {
  Bits b(n);
  for (auto& x : b) x = esplag::float_to_bf16(static_cast<float>(scale * rng.normal()));
  return b;
}

VF to_float(const Bits& b) {
  VF f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = esplag::bf16_to_float(b[i]);
  return f;
}

void upload(const Dev& d, const Bits& b) {
  CUDA_CHECK(cudaMemcpy(d.p, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
}
Bits download_bits(const void* p, size_t n) {
  Bits b(n);
  CUDA_CHECK(cudaMemcpy(b.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return b;
}
VF download_f32(const float* p, size_t n) {
  VF f(n);
  CUDA_CHECK(cudaMemcpy(f.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return f;
}

using esplag::gpu_test::expect_close_to;
using esplag::gpu_test::matmul_f64;
using esplag::gpu_test::transposed;

VF masked(const VF& w, const cpu::Mask& m) {
  VF o(w.size());
  for (size_t i = 0; i < w.size(); ++i) o[i] = m[i] ? w[i] : 0.f;
  return o;
}

struct Shape {
  int64_t out, in, tokens;
};
const Shape kShapes[] = {{32, 64, 48}, {48, 16, 32}, {80, 48, 112}, {64, 64, 64}};

// Several steps of one kind on one shape. Between steps the weight moves by a random
// amount comparable to itself (an optimizer step, exaggerated so that the greedy and
// row-wise masks of the new weight differ from the old ones).
// dense_products: semi_sparse through use_dense_products (the same function on cuBLASLt);
// bias: the forward adds a bias (cuSPARSELt's or cuBLASLt's epilogue).
void run_kind(SparseLinearKind kind, const Shape& sh, uint64_t seed, bool dense_products = false, bool bias = false) {
  SCOPED_TRACE(gpu::sparse_linear_kind_name(kind) + " out=" + std::to_string(sh.out) + " in=" + std::to_string(sh.in) +
               " tokens=" + std::to_string(sh.tokens));
  const int64_t O = sh.out, I = sh.in, N = sh.tokens;
  Rng rng(seed);
  Bits w = random_bf16(size_t(O * I), 0.5, rng);
  Dev dw_w(size_t(O * I) * 2), dx_(size_t(N * I) * 2), ddy(size_t(N * O) * 2), dy_(size_t(N * O) * 2),
      ddx(size_t(N * I) * 2), ddw(size_t(O * I) * 4);
  upload(dw_w, w);
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreate(&s));
  SparseLinearOptions o;
  o.kind = kind;
  o.bias = bias;
  const Bits b = random_bf16(size_t(O), 1.0, rng);
  Dev db(size_t(O) * 2);
  upload(db, b);
  SparseLinear layer(o, O, I, N, dw_w.bf(), s);
  EXPECT_EQ(layer.sparse(), kind != SparseLinearKind::dense);
  if (dense_products) layer.use_dense_products(true);
  EXPECT_EQ(layer.sparse_products(), kind != SparseLinearKind::dense && !dense_products);
  // slope's static forward mask comes from the weight at construction.
  const VF w0 = to_float(w);
  const cpu::Mask slope_fwd = cpu::double_prune_masks(w0.data(), O, I).forward;

  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Bits x = random_bf16(size_t(N * I), 1.0, rng), dy = random_bf16(size_t(N * O), 1.0, rng);
    upload(dx_, x);
    upload(dy_, dy);
    ddy.poison();
    ddx.poison();
    const bool accumulate = step == 2;
    if (accumulate) {
      const VF ones(size_t(O * I), 1.0f);
      CUDA_CHECK(cudaMemcpy(ddw.p, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
    } else {
      ddw.poison();
    }
    layer.prepare(s);
    layer.forward(ddy.bf(), dx_.bf(), s, bias ? db.bf() : nullptr);
    layer.backward(ddx.bf(), ddw.f32(), dy_.bf(), dx_.bf(), accumulate, s);
    CUDA_CHECK(cudaStreamSynchronize(s));

    const VF wf = to_float(w), xf = to_float(x), dyf = to_float(dy);
    VF w_fwd = wf, w_bwd = wf;
    if (kind == SparseLinearKind::semi_sparse) {
      w_fwd = w_bwd = masked(wf, cpu::transposable_mask_greedy(wf.data(), O, I));
    } else if (kind == SparseLinearKind::slope) {
      w_fwd = masked(wf, slope_fwd);
      w_bwd = masked(w_fwd, cpu::double_prune_backward_mask(w_fwd.data(), slope_fwd.data(), O, I));
    }
    if (kind != SparseLinearKind::dense) {
      // The pruned weights the layer built are the CPU's, bit for bit (values are bf16 of
      // the weight or 0; -0 and +0 both count as 0).
      // (slope keeps W2 there, the weight pruned by both masks.)
      const VF pw = to_float(download_bits(layer.pruned_weight(), size_t(O * I)));
      EXPECT_EQ(pw, kind == SparseLinearKind::slope ? w_bwd : w_fwd) << "pruned weight";
      if (kind == SparseLinearKind::slope) {
        layer.refill_backward_weight_t(s);
        CUDA_CHECK(cudaStreamSynchronize(s));
        const VF pt = to_float(download_bits(layer.backward_weight_t(), size_t(O * I)));
        EXPECT_EQ(pt, transposed(w_bwd, O, I)) << "W2^T";
      }
    }
    VD y_ref = matmul_f64(xf, w_fwd, N, I, O, true);  // X · Wfᵀ (+ b)
    if (bias)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < O; ++j) y_ref[size_t(n * O + j)] += esplag::bf16_to_float(b[size_t(j)]);
    const VD dx_ref = matmul_f64(dyf, w_bwd, N, O, I, false);  // dY · Wb
    VD dw_ref = matmul_f64(transposed(dyf, N, O), xf, O, N, I, false);  // dYᵀ · X
    if (accumulate)
      for (double& v : dw_ref) v += 1.0;
    // bf16 outputs: one rounding (2^-9 relative) plus fp32 accumulation; dW is fp32.
    expect_close_to(to_float(download_bits(ddy.p, size_t(N * O))), y_ref, 8e-3, 2e-3, "Y");
    expect_close_to(to_float(download_bits(ddx.p, size_t(N * I))), dx_ref, 8e-3, 2e-3, "dX");
    expect_close_to(download_f32(ddw.f32(), size_t(O * I)), dw_ref, 1e-4, 1e-5, "dW");

    // The optimizer step: W moves; the next prepare() must follow it.
    const Bits delta = random_bf16(w.size(), 0.5, rng);
    for (size_t i = 0; i < w.size(); ++i)
      w[i] = esplag::float_to_bf16(esplag::bf16_to_float(w[i]) + esplag::bf16_to_float(delta[i]));
    upload(dw_w, w);
  }
  CUDA_CHECK(cudaStreamDestroy(s));
}

TEST(GpuSparseLinear, Dense) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  uint64_t seed = 11;
  for (const Shape& sh : kShapes) run_kind(SparseLinearKind::dense, sh, seed++);
}

TEST(GpuSparseLinear, SemiSparse) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  uint64_t seed = 21;
  for (const Shape& sh : kShapes) run_kind(SparseLinearKind::semi_sparse, sh, seed++);
}

// Per-layer dispatch: the dense products of Ws give the CPU reference's results too, and
// timing both ways keeps the layer's mode and leaves its buffers prepared.
TEST(GpuSparseLinear, SemiSparseDenseProductsAndTiming) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  uint64_t seed = 71;
  for (const Shape& sh : kShapes) run_kind(SparseLinearKind::semi_sparse, sh, seed++, true);
  for (bool dense : {false, true}) run_kind(SparseLinearKind::semi_sparse, kShapes[0], seed++, dense, true);

  const int64_t O = 256, I = 512, N = 128;
  Rng rng(5);
  Dev w(size_t(O * I) * 2);
  upload(w, random_bf16(size_t(O * I), 0.5, rng));
  SparseLinearOptions o;
  o.kind = SparseLinearKind::semi_sparse;
  SparseLinear layer(o, O, I, N, w.bf(), nullptr);
  layer.prepare(nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const Bits before = download_bits(layer.pruned_weight(), size_t(O * I));
  const SparseLinear::ProductTimes t = layer.time_products(nullptr, 3);
  EXPECT_GT(t.sparse_ms, 0);
  EXPECT_GT(t.dense_ms, 0);
  EXPECT_TRUE(layer.sparse_products()) << "the mode before the timing is kept";
  EXPECT_EQ(download_bits(layer.pruned_weight(), size_t(O * I)), before);
  std::printf("  %lldx%lldx%lld: 2:4 %.3f ms, dense %.3f ms\n", static_cast<long long>(O), static_cast<long long>(I),
              static_cast<long long>(N), t.sparse_ms, t.dense_ms);

  // Without a kept Ws (the one-pass preparation writes only the compressed copies): the
  // same products; dense products bring Ws back.
  SparseLinearOptions lean_o = o;
  lean_o.keep_pruned = false;
  SparseLinear lean(lean_o, O, I, N, w.bf(), nullptr);
  lean.prepare(nullptr);
  EXPECT_EQ(lean.pruned_weight(), nullptr);
  Dev x(size_t(N * I) * 2), y_full(size_t(N * O) * 2), y_lean(size_t(N * O) * 2);
  upload(x, random_bf16(size_t(N * I), 1.0, rng));
  layer.forward(y_full.bf(), x.bf(), nullptr);
  lean.forward(y_lean.bf(), x.bf(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(download_bits(y_lean.p, size_t(N * O)), download_bits(y_full.p, size_t(N * O)));
  lean.time_products(nullptr, 2);
  EXPECT_EQ(lean.pruned_weight(), nullptr);
  lean.use_dense_products(true);
  lean.prepare(nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  ASSERT_NE(lean.pruned_weight(), nullptr);
  EXPECT_EQ(download_bits(lean.pruned_weight(), size_t(O * I)), before);

  SparseLinearOptions d;
  SparseLinear dense(d, O, I, N, w.bf(), nullptr);
  EXPECT_THROW(dense.use_dense_products(true), esplag::Error);
  EXPECT_THROW(dense.time_products(nullptr), esplag::Error);
}

TEST(GpuSparseLinear, Slope) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  uint64_t seed = 31;
  for (const Shape& sh : kShapes) run_kind(SparseLinearKind::slope, sh, seed++);
}

// The slope forward mask is static: after the weight changes completely, W1 still keeps
// the positions chosen at construction (a row-wise 2:4 of the new weight would differ).
TEST(GpuSparseLinear, SlopeMaskIsStatic) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  const int64_t O = 32, I = 32, N = 16;
  Rng rng(5);
  const Bits w0 = random_bf16(size_t(O * I), 1.0, rng), w1 = random_bf16(size_t(O * I), 1.0, rng);
  Dev dw(size_t(O * I) * 2);
  upload(dw, w0);
  SparseLinearOptions o;
  o.kind = SparseLinearKind::slope;
  SparseLinear layer(o, O, I, N, dw.bf(), nullptr);
  upload(dw, w1);
  layer.prepare(nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const VF f0 = to_float(w0), f1 = to_float(w1);
  const cpu::Mask m0 = cpu::double_prune_masks(f0.data(), O, I).forward;
  const cpu::Mask m1 = cpu::double_prune_masks(f1.data(), O, I).forward;
  ASSERT_NE(m0, m1) << "the test needs weights whose row-wise masks differ";
  // W2: the new weight under the first forward mask, pruned by the backward mask chosen
  // again from it (prepare refreshes by default).
  const VF w1_kept = masked(f1, m0);
  const cpu::Mask b1 = cpu::double_prune_backward_mask(w1_kept.data(), m0.data(), O, I);
  EXPECT_EQ(to_float(download_bits(layer.pruned_weight(), size_t(O * I))), masked(w1_kept, b1));
  // prepare(s, false) keeps that backward mask for another weight.
  const Bits w2 = random_bf16(size_t(O * I), 1.0, rng);
  const VF f2 = to_float(w2);
  upload(dw, w2);
  layer.prepare(nullptr, false);
  CUDA_CHECK(cudaDeviceSynchronize());
  const VF expect = masked(masked(f2, m0), b1);
  EXPECT_EQ(to_float(download_bits(layer.pruned_weight(), size_t(O * I))), expect);
  EXPECT_EQ(to_float(download_bits(layer.refill_backward_weight_t(nullptr), size_t(O * I))), transposed(expect, O, I));
}

// ---------------------------------------------------------------------------------------
// sparse_dw

// The CPU's estimate S = MVUE(dYᵀ) [out, N] for `seed` (cpu::mvue_24_bf16 on dYᵀ: groups
// of 4 consecutive tokens of one output feature), as floats.
VF mvue_of_dy_t(const Bits& dy, int64_t N, int64_t O, uint64_t seed) {
  Bits t(dy.size()), s(dy.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o) t[size_t(o * N + n)] = dy[size_t(n * O + o)];
  cpu::mvue_24_bf16(t.data(), s.data(), nullptr, O, N, seed, "dY^T");
  return to_float(s);
}

// fp64 S · X [N, I] (the reference) and the same product accumulated in fp32 and rounded
// to bf16 once (the low-precision yardstick: what the 2:4 product's bf16 output carries).
void weight_grad_reference(const VF& s, const VF& x, int64_t O, int64_t N, int64_t I, VD* ref, VF* low) {
  ref->assign(size_t(O * I), 0.0);
  low->assign(size_t(O * I), 0.f);
  for (int64_t o = 0; o < O; ++o)
    for (int64_t i = 0; i < I; ++i) {
      double d = 0;
      float f = 0;
      for (int64_t n = 0; n < N; ++n) {
        d += double(s[size_t(o * N + n)]) * double(x[size_t(n * I + i)]);
        f += s[size_t(o * N + n)] * x[size_t(n * I + i)];
      }
      (*ref)[size_t(o * I + i)] = d;
      (*low)[size_t(o * I + i)] = esplag::gpu_test::round_bf16(f);
    }
}

struct DwShape {
  int64_t out, in, tokens;  // out and tokens multiples of 64 (sparse_dw's rule), in of 16
};
const DwShape kDwShapes[] = {{64, 48, 128}, {128, 80, 64}, {192, 64, 256}};

// Two steps of a sparse-dW layer: dW = the product of the CPU's estimate for the seed the
// layer derives (step 0: =, on a NaN-poisoned dW; step 1: += onto ones). dX is not asked
// for: sparse_dw does not touch it (run_kind checks it).
void run_sparse_dw(SparseLinearKind kind, const DwShape& sh, uint64_t seed) {
  SCOPED_TRACE(gpu::sparse_linear_kind_name(kind) + "+sparse_dw out=" + std::to_string(sh.out) +
               " in=" + std::to_string(sh.in) + " tokens=" + std::to_string(sh.tokens));
  const int64_t O = sh.out, I = sh.in, N = sh.tokens;
  Rng rng(seed);
  const Bits w = random_bf16(size_t(O * I), 0.5, rng);
  Dev dw_w(size_t(O * I) * 2), dx_(size_t(N * I) * 2), dy_(size_t(N * O) * 2), ddw(size_t(O * I) * 4);
  upload(dw_w, w);
  SparseLinearOptions o;
  o.kind = kind;
  o.sparse_dw = true;
  o.dw_seed = seed * 1000 + 7;
  SparseLinear layer(o, O, I, N, dw_w.bf(), nullptr);
  ASSERT_TRUE(layer.sparse_dw());
  EXPECT_EQ(layer.dw_draws(), 0u);
  layer.prepare(nullptr);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const bool accumulate = step == 1;
    const Bits x = random_bf16(size_t(N * I), 1.0, rng), dy = random_bf16(size_t(N * O), 1.0, rng);
    upload(dx_, x);
    upload(dy_, dy);
    if (accumulate) {
      const VF ones(size_t(O * I), 1.0f);
      CUDA_CHECK(cudaMemcpy(ddw.p, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
    } else {
      ddw.poison();
    }
    layer.backward(nullptr, ddw.f32(), dy_.bf(), dx_.bf(), accumulate, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(layer.dw_draws(), uint64_t(step + 1));
    const VF s = mvue_of_dy_t(dy, N, O, gpu::sparse_dw_mvue_seed(o.dw_seed, uint64_t(step)));
    size_t kept = 0;
    for (float v : s) kept += v != 0.f;
    EXPECT_EQ(kept * 2, s.size()) << "random normal dY: the estimate keeps exactly 2 of every 4";
    VD ref;
    VF low;
    weight_grad_reference(s, to_float(x), O, N, I, &ref, &low);
    if (accumulate) {
      for (double& v : ref) v += 1.0;
      for (float& v : low) v += 1.0f;
    }
    esplag::gpu_test::expect_within_low_precision(accumulate ? "dW +=" : "dW =", ref, low,
                                                  download_f32(ddw.f32(), size_t(O * I)), /*bf16_out=*/true);
  }
}

TEST(GpuSparseLinear, SparseDwMatchesTheProductOfTheCpuEstimate) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  uint64_t seed = 81;
  for (const DwShape& sh : kDwShapes)
    for (SparseLinearKind kind : {SparseLinearKind::semi_sparse, SparseLinearKind::slope})
      run_sparse_dw(kind, sh, seed++);
}

// The seed decides the draw: set_dw_seed() restarts the same sequence (the same bits), two
// layers with one base seed agree, and every backward takes a new draw.
TEST(GpuSparseLinear, SparseDwSeeds) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  const int64_t O = 128, I = 64, N = 128;
  Rng rng(17);
  Dev w(size_t(O * I) * 2), x(size_t(N * I) * 2), dy(size_t(N * O) * 2), dw(size_t(O * I) * 4);
  upload(w, random_bf16(size_t(O * I), 0.5, rng));
  upload(x, random_bf16(size_t(N * I), 1.0, rng));
  upload(dy, random_bf16(size_t(N * O), 1.0, rng));
  SparseLinearOptions o;
  o.kind = SparseLinearKind::semi_sparse;
  o.sparse_dw = true;
  o.dw_seed = 5;
  SparseLinear a(o, O, I, N, w.bf(), nullptr), b(o, O, I, N, w.bf(), nullptr);
  auto draw = [&](SparseLinear& l) {
    dw.poison();
    l.backward(nullptr, dw.f32(), dy.bf(), x.bf(), false, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    return download_f32(dw.f32(), size_t(O * I));
  };
  const VF a0 = draw(a), a1 = draw(a), b0 = draw(b);
  EXPECT_EQ(a0, b0) << "one base seed, the same first draw";
  EXPECT_NE(a0, a1) << "the second backward must take a new draw";
  a.set_dw_seed(5);
  EXPECT_EQ(a.dw_draws(), 0u);
  EXPECT_EQ(draw(a), a0) << "set_dw_seed restarts the sequence";
  a.set_dw_seed(6);
  EXPECT_NE(draw(a), a0) << "another base seed, another draw";
  EXPECT_NE(gpu::sparse_dw_mvue_seed(5, 1), gpu::sparse_dw_mvue_seed(6, 0));
}

// A CUDA graph that captures backward() draws anew at every replay (the draw count lives
// in device memory): replays 1 and 2 give the eager layer's draws 1 and 2, bit for bit.
TEST(GpuSparseLinear, SparseDwDrawsAnewAtEveryGraphReplay) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  const int64_t O = 128, I = 64, N = 128;
  Rng rng(29);
  Dev w(size_t(O * I) * 2), x(size_t(N * I) * 2), dy(size_t(N * O) * 2), dw(size_t(O * I) * 4);
  upload(w, random_bf16(size_t(O * I), 0.5, rng));
  upload(x, random_bf16(size_t(N * I), 1.0, rng));
  upload(dy, random_bf16(size_t(N * O), 1.0, rng));
  SparseLinearOptions o;
  o.kind = SparseLinearKind::slope;
  o.sparse_dw = true;
  o.dw_seed = 31;
  SparseLinear eager(o, O, I, N, w.bf(), nullptr), graphed(o, O, I, N, w.bf(), nullptr);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto backward = [&](SparseLinear& l) { l.backward(nullptr, dw.f32(), dy.bf(), x.bf(), false, s); };
  auto result = [&] {
    CUDA_CHECK(cudaStreamSynchronize(s));
    return download_f32(dw.f32(), size_t(O * I));
  };
  std::vector<VF> want;
  for (int k = 0; k < 3; ++k) {
    backward(eager);
    want.push_back(result());
  }
  backward(graphed);  // draw 0, eagerly: the first backward tunes the product (it synchronises)
  EXPECT_EQ(result(), want[0]);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  backward(graphed);
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int k = 1; k < 3; ++k) {
    CUDA_CHECK(cudaMemsetAsync(dw.p, 0xFF, dw.bytes, s));  // NaN until the replay writes dW
    CUDA_CHECK(cudaGraphLaunch(exec, s));
    EXPECT_EQ(result(), want[size_t(k)]) << "replay " << k << " must be draw " << k;
  }
  EXPECT_EQ(graphed.dw_draws(), 3u);
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(s));
}

// Unbiasedness: the mean of 32 draws is much closer to the dense dYᵀ · X than one draw
// (independent draws: about 1/√32 ≈ 0.18 of the single-draw error).
TEST(GpuSparseLinear, SparseDwIsUnbiased) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  const int64_t O = 128, I = 96, N = 256;
  const int draws = 32;
  Rng rng(23);
  const Bits x = random_bf16(size_t(N * I), 1.0, rng), dy = random_bf16(size_t(N * O), 1.0, rng);
  Dev w(size_t(O * I) * 2), dx(size_t(N * I) * 2), ddy(size_t(N * O) * 2), dw(size_t(O * I) * 4);
  upload(w, random_bf16(size_t(O * I), 0.5, rng));
  upload(dx, x);
  upload(ddy, dy);
  const VD dense = matmul_f64(transposed(to_float(dy), N, O), to_float(x), O, N, I, false);  // dYᵀ · X
  SparseLinearOptions o;
  o.kind = SparseLinearKind::slope;
  o.sparse_dw = true;
  o.dw_seed = 99;
  SparseLinear layer(o, O, I, N, w.bf(), nullptr);
  auto rel_err = [&](const VD& got) {
    double num = 0, den = 0;
    for (size_t i = 0; i < dense.size(); ++i) {
      num += (got[i] - dense[i]) * (got[i] - dense[i]);
      den += dense[i] * dense[i];
    }
    return std::sqrt(num / den);
  };
  VD sum(dense.size(), 0.0);
  double single = 0;
  for (int d = 0; d < draws; ++d) {
    dw.poison();
    layer.backward(nullptr, dw.f32(), ddy.bf(), dx.bf(), false, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const VF g = download_f32(dw.f32(), dense.size());
    single += rel_err(VD(g.begin(), g.end())) / draws;
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
  }
  for (double& v : sum) v /= draws;
  const double mean_err = rel_err(sum);
  std::printf("  sparse dW relative error: one draw %.4f (mean over draws), mean of %d draws %.4f\n", single, draws,
              mean_err);
  EXPECT_GT(single, 1e-2) << "one draw should differ clearly from the dense product (else the check is vacuous)";
  EXPECT_LT(mean_err, 0.5 * single);
}

TEST(GpuSparseLinear, SparseDwRefusalsAndMemory) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  Dev w(256 * 256 * 2);
  auto make = [&](SparseLinearKind k, int64_t out, int64_t in, int64_t tokens) {
    SparseLinearOptions o;
    o.kind = k;
    o.sparse_dw = true;
    SparseLinear l(o, out, in, tokens, w.bf(), nullptr);
  };
  auto expect_error = [](const std::function<void()>& f, const std::vector<std::string>& needles) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one containing '" << needles[0] << "'";
    } catch (const esplag::Error& e) {
      for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
  };
  // Checked with or without cuSPARSELt.
  expect_error([&] { make(SparseLinearKind::dense, 64, 64, 64); }, {"sparse_dw", "semi_sparse and slope"});
  expect_error([&] { make(SparseLinearKind::semi_sparse, 48, 64, 64); }, {"sparse_dw", "multiples of 64"});
  expect_error([&] { make(SparseLinearKind::slope, 64, 64, 48); }, {"sparse_dw", "multiples of 64"});
  // in needs only the 2:4 kinds' multiple of 16.
  make(SparseLinearKind::semi_sparse, 64, 48, 64);
  if (!gpu::cusparselt_available()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  // The layer holds S's compressed buffer and the bf16 dW on top of what it needs without.
  const int64_t O = 128, I = 256, N = 192;
  SparseLinearOptions o;
  o.kind = SparseLinearKind::semi_sparse;
  SparseLinear plain(o, O, I, N, w.bf(), nullptr);
  o.sparse_dw = true;
  SparseLinear with_dw(o, O, I, N, w.bf(), nullptr);
  EXPECT_FALSE(plain.sparse_dw());
  EXPECT_TRUE(with_dw.sparse_dw());
  EXPECT_GE(with_dw.device_bytes(), plain.device_bytes() + gpu::cusparselt24_layout_bytes(O, N) + size_t(2 * O * I));
  // dY must be 16-byte aligned (the fused kernel's loads).
  Dev x(size_t(N * I) * 2), dy(size_t(N * O) * 2 + 16), dw(size_t(O * I) * 4);
  expect_error(
      [&] {
        with_dw.backward(nullptr, dw.f32(), reinterpret_cast<const bf16*>(static_cast<char*>(dy.p) + 2), x.bf(), false,
                         nullptr);
      },
      {"16-byte aligned"});
}

TEST(GpuSparseLinear, RefusedShapesAndOptions) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  Dev w(64 * 64 * 2);
  auto make = [&](SparseLinearKind k, int64_t out, int64_t in, int64_t tokens, bool sparse_dw = false) {
    SparseLinearOptions o;
    o.kind = k;
    o.sparse_dw = sparse_dw;
    SparseLinear l(o, out, in, tokens, w.bf(), nullptr);
  };
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
    } catch (const esplag::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { make(SparseLinearKind::semi_sparse, 24, 32, 32); }, "multiples of 16");
  expect_error([&] { make(SparseLinearKind::slope, 32, 32, 40); }, "multiples of 16");
  expect_error([&] { make(SparseLinearKind::dense, 0, 32, 32); }, "sizes must be positive");
  expect_error([&] { make(SparseLinearKind::slope, 32, 32, 32, true); }, "sparse_dw needs out and tokens");
  expect_error([&] { gpu::parse_sparse_linear_kind("sparse"); }, "unknown sparse Linear kind 'sparse'");
  EXPECT_EQ(gpu::parse_sparse_linear_kind("slope"), SparseLinearKind::slope);
  // The dense kind takes sizes that are not multiples of 16.
  make(SparseLinearKind::dense, 24, 20, 7);
}

}  // namespace
