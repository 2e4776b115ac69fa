// semi_sparse_activation's Linear on the GPU (sparse/cuda/sparse_activation_linear.h)
// against the CPU layer SemiSparseActivationLinear<float> (model/linear_semi_sparse.h):
// - the pruned input Xs of both patterns equals the CPU layer's sparsify_input bit for bit,
//   on awkward token counts (tile_24 pads them) and widths; the fused pruning + compression
//   of row_24 writes exactly the layout of the CPU-pruned Xs;
// - forward (2:4 on cuSPARSELt where the shape allows, cuBLASLt of Xs elsewhere and with
//   dense products), dX = dY·W and dW = dYᵀ·Xs (= and +=) and the bias gradient against
//   fp64 products of the CPU's Xs, several steps with new inputs and a moving weight,
//   outputs poisoned (NaN) before each call; tile_24's dW as the 2:4 product of Xsᵀ where
//   the shape allows it;
// - timing both ways keeps the mode; refused shapes and arguments name the layer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/linear_semi_sparse.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/cusparselt_layout.h"
#include "sparse/cuda/sparse_activation_linear.h"

#include "gpu_test_util.h"

namespace {

using namespace esplag::gpu_test;
namespace gpu = esplag::gpu;
using esplag::ActivationSparsity;

using Dev = esplag::gpu_test::DeviceBlock;

// The CPU layer's Xs for x [rows, in] (its weight plays no part in the pruning).
VF cpu_pruned(ActivationSparsity pattern, const VF& x, int64_t rows, int64_t in) {
  VF w(size_t(4 * in), 0.f);
  esplag::LinearParams<float> p;
  p.name = "blocks.0.mlp.fc.weight";
  p.module = "blocks.0.mlp.fc";
  p.in_features = in;
  p.out_features = 4;
  p.weight = w.data();
  esplag::SemiSparseActivationLinear<float> layer(p, pattern);
  VF xs(x.size());
  layer.sparsify_input(xs.data(), x.data(), int(rows));
  return xs;
}

const ActivationSparsity kPatterns[] = {ActivationSparsity::row_24, ActivationSparsity::tile_24};

TEST(GpuSparseActivationLinear, PruningMatchesTheCpuLayer) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  const std::pair<int64_t, int64_t> shapes[] = {{1, 4}, {7, 12}, {33, 48}, {64, 128}, {130, 20}};
  uint64_t seed = 5;
  for (ActivationSparsity pattern : kPatterns)
    for (const auto& [rows, in] : shapes) {
      SCOPED_TRACE(esplag::activation_sparsity_name(pattern) + " rows=" + std::to_string(rows) +
                   " in=" + std::to_string(in));
      const Data x = random_bf16(size_t(rows * in), seed++);
      Dev dx(x.bits.size() * 2), dxs(x.bits.size() * 2);
      dx.put(x.bits.data());
      dxs.poison();
      gpu::prune_activation(pattern, dxs.bf(), dx.bf(), rows, in, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(bits_to_float(dxs.get<uint16_t>()), cpu_pruned(pattern, x.f, rows, in));
    }
}

// The fused row-wise pruning + compression: the pruned X and the layout of exactly the
// CPU-pruned X (cusparselt24_compress_host, the reference the layout tests check against
// the library).
TEST(GpuSparseActivationLinear, RowPruningCompressesInOnePass) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  const int64_t rows = 128, in = 192;
  const Data x = random_bf16(size_t(rows * in), 41);
  const VF xs = cpu_pruned(ActivationSparsity::row_24, x.f, rows, in);
  Bits xs_bits(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) xs_bits[i] = esplag::float_to_bf16(xs[i]);
  const size_t bytes = gpu::cusparselt24_layout_bytes(rows, in);
  std::vector<uint8_t> want(bytes);
  gpu::cusparselt24_compress_host(xs_bits.data(), rows, in, false, want.data());
  Dev dx(x.bits.size() * 2), dxs(x.bits.size() * 2), dc(bytes);
  dx.put(x.bits.data());
  dxs.poison();
  dc.poison();
  gpu::cusparselt24_prune_rows_compress(dx.bf(), rows, in, dxs.bf(), dc.p, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(bits_to_float(dxs.get<uint16_t>()), xs);
  EXPECT_TRUE(dc.get<uint8_t>() == want) << "the compressed layout differs from the host reference's";
  EXPECT_THROW(gpu::cusparselt24_prune_rows_compress(dx.bf(), rows, 100, nullptr, dc.p, nullptr), esplag::Error);
}

// Inputs full of equal magnitudes (bf16 activations often are: a GELU or a norm output
// rounds many values alike): the fused pruning + compression kernels keep exactly what
// prune_activation and the CPU layer keep, ties broken the same way, and the compressed
// forward operand gives the product of those values.
TEST(GpuSparseActivationLinear, TiesPruneAlikeInEveryKernel) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  const int64_t rows = 128, in = 256;
  esplag::Rng rng(77);
  const float levels[] = {0.f, 0.5f, -0.5f, 1.f, -1.f, 2.f, -0.f};
  Bits xb(size_t(rows * in));
  VF xf(xb.size());
  for (size_t i = 0; i < xb.size(); ++i) {
    xf[i] = levels[rng.below(7)];
    xb[i] = esplag::float_to_bf16(xf[i]);
  }
  Dev dx(xb.size() * 2), a(xb.size() * 2), b(xb.size() * 2), c(gpu::cusparselt24_layout_bytes(rows, in));
  dx.put(xb.data());
  for (ActivationSparsity pattern : kPatterns) {
    SCOPED_TRACE(esplag::activation_sparsity_name(pattern));
    a.poison();
    b.poison();
    gpu::prune_activation(pattern, a.bf(), dx.bf(), rows, in, nullptr);
    if (pattern == ActivationSparsity::row_24)
      gpu::cusparselt24_prune_rows_compress(dx.bf(), rows, in, b.bf(), c.p, nullptr);
    else
      gpu::cusparselt24_prune_compress(dx.bf(), rows, in, b.bf(), c.p, nullptr, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const VF want = cpu_pruned(pattern, xf, rows, in);
    EXPECT_EQ(bits_to_float(a.get<uint16_t>()), want) << "prune_activation";
    EXPECT_EQ(bits_to_float(b.get<uint16_t>()), want) << "the fused pruning";
  }
}

struct Shape {
  int64_t out, in, tokens;
};

// Three steps of one layer; between steps the weight moves as an optimizer's would.
void run_layer(ActivationSparsity pattern, const Shape& sh, uint64_t seed, bool bias, bool dense_products) {
  SCOPED_TRACE(esplag::activation_sparsity_name(pattern) + " out=" + std::to_string(sh.out) + " in=" +
               std::to_string(sh.in) + " tokens=" + std::to_string(sh.tokens) + (bias ? " bias" : "") +
               (dense_products ? " dense products" : ""));
  const int64_t O = sh.out, I = sh.in, N = sh.tokens;
  gpu::SparseActivationLinearOptions o;
  o.pattern = pattern;
  o.bias = bias;
  gpu::SparseActivationLinear layer(o, O, I, N);
  const bool can_be_sparse = gpu::cusparselt_available() && O % 16 == 0 && I % 16 == 0 && N % 16 == 0;
  EXPECT_EQ(layer.sparse(), can_be_sparse);
  layer.use_dense_products(dense_products);
  EXPECT_EQ(layer.sparse_products(), can_be_sparse && !dense_products);
  // tile_24's dW as the 2:4 product of Xsᵀ: where the fused writer's 64×64 tiles fit (and
  // its layout is the library's, as it is wherever the forward uses it).
  const bool dw_sparse = pattern == ActivationSparsity::tile_24 && layer.own_layout() && I % 64 == 0 && N % 64 == 0;
  EXPECT_EQ(layer.sparse_weight_grad(), dw_sparse);
  // ... which the backward takes unless it computes the bias gradient too.
  const bool dw_bf16 = dw_sparse && !dense_products && !bias;
  Data w = random_bf16(size_t(O * I), seed, 0.5);
  const Data b = random_bf16(size_t(O), seed + 1);
  Dev dw_w(size_t(O * I) * 2), dbias(size_t(O) * 2), dx_(size_t(N * I) * 2), ddy(size_t(N * O) * 2),
      dy_(size_t(N * O) * 2), ddx(size_t(N * I) * 2), ddw(size_t(O * I) * 4), ddb(size_t(O) * 4);
  dbias.put(b.bits.data());
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Data x = random_bf16(size_t(N * I), seed + 10 + step), dy = random_bf16(size_t(N * O), seed + 20 + step);
    dw_w.put(w.bits.data());
    dx_.put(x.bits.data());
    dy_.put(dy.bits.data());
    ddy.poison();
    ddx.poison();
    const bool accumulate = step == 2;
    const VF ones(size_t(O * I), 1.f), zeros(size_t(O), 0.f);
    if (accumulate)
      ddw.put(ones.data());
    else
      ddw.poison();
    ddb.put(zeros.data());
    layer.forward(ddy.bf(), dx_.bf(), dw_w.bf(), bias ? dbias.bf() : nullptr, N, nullptr);
    layer.backward(ddx.bf(), ddw.f32(), bias ? ddb.f32() : nullptr, dy_.bf(), dx_.bf(), dw_w.bf(), N, accumulate,
                   nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());

    const VF xs = cpu_pruned(pattern, x.f, N, I);
    VD y_ref = matmul_f64(xs, w.f, N, I, O, true);
    if (bias)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < O; ++j) y_ref[size_t(n * O + j)] += b.f[size_t(j)];
    VD dw_ref = matmul_f64(transposed(dy.f, N, O), xs, O, N, I, false);
    if (accumulate)
      for (double& v : dw_ref) v += 1.0;
    // bf16 outputs (the sparse path's bias is a second rounding), fp32 dW (rounded to bf16
    // once by the 2:4 product).
    expect_close_to(bits_to_float(ddy.get<uint16_t>()), y_ref, 1.2e-2, 3e-3, "Y");
    expect_close_to(bits_to_float(ddx.get<uint16_t>()), matmul_f64(dy.f, w.f, N, O, I, false), 8e-3, 2e-3, "dX");
    expect_close_to(ddw.get<float>(), dw_ref, dw_bf16 ? 8e-3 : 1e-4, dw_bf16 ? 2e-3 : 1e-5, "dW");
    if (bias) {
      VD db_ref(size_t(O), 0.0);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < O; ++j) db_ref[size_t(j)] += dy.f[size_t(n * O + j)];
      expect_close_to(ddb.get<float>(), db_ref, 1e-4, 1e-5, "db");
    }
    w = random_bf16(w.f.size(), seed + 30 + step, 0.5);
  }
}

const Shape kShapes[] = {{32, 64, 48}, {48, 16, 32}, {80, 48, 112}, {64, 64, 64}, {64, 128, 128}, {48, 192, 64},
                         {24, 20, 7}};

TEST(GpuSparseActivationLinear, MatchesTheCpuLayer) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  uint64_t seed = 100;
  for (ActivationSparsity pattern : kPatterns)
    for (const Shape& sh : kShapes) {
      run_layer(pattern, sh, seed, false, false);
      seed += 50;
    }
}

TEST(GpuSparseActivationLinear, BiasAndDenseProducts) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  uint64_t seed = 900;
  for (ActivationSparsity pattern : kPatterns)
    for (const Shape& sh : {Shape{32, 64, 48}, Shape{64, 128, 128}}) {
      run_layer(pattern, sh, seed, true, false);
      run_layer(pattern, sh, seed + 1, false, true);
      seed += 50;
    }
}

// A micro-batch of fewer rows than the layer's tokens runs the dense product of Xs.
TEST(GpuSparseActivationLinear, FewerRowsRunDense) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  const int64_t O = 32, I = 64, N = 64, rows = 20;
  gpu::SparseActivationLinear layer({}, O, I, N);
  const Data w = random_bf16(size_t(O * I), 3), x = random_bf16(size_t(rows * I), 4);
  Dev dw(w.bits.size() * 2), dx(x.bits.size() * 2), dy(size_t(rows * O) * 2);
  dw.put(w.bits.data());
  dx.put(x.bits.data());
  dy.poison();
  layer.forward(dy.bf(), dx.bf(), dw.bf(), nullptr, rows, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  expect_close_to(bits_to_float(dy.get<uint16_t>()),
               matmul_f64(cpu_pruned(ActivationSparsity::row_24, x.f, rows, I), w.f, rows, I, O, true), 8e-3, 2e-3, "Y");
}

TEST(GpuSparseActivationLinear, TimingKeepsTheModeAndRefusals) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  EXPECT_THROW(gpu::SparseActivationLinear({}, 32, 18, 64), esplag::Error);  // in % 4
  EXPECT_THROW(gpu::SparseActivationLinear({}, 0, 16, 64), esplag::Error);
  EXPECT_THROW(esplag::parse_activation_sparsity("rows"), esplag::Error);
  gpu::SparseActivationLinear layer({}, 64, 64, 64);
  Dev w(64 * 64 * 2), x(64 * 64 * 2), y(64 * 64 * 2);
  CUDA_CHECK(cudaMemset(w.p, 0, w.bytes));
  EXPECT_THROW(layer.forward(y.bf(), x.bf(), w.bf(), nullptr, 65, nullptr), esplag::Error);  // rows > tokens
  EXPECT_THROW(layer.forward(y.bf(), x.bf(), w.bf(), w.bf(), 64, nullptr), esplag::Error);   // bias not built
  if (!layer.sparse()) GTEST_SKIP() << "cuSPARSELt not available: " << gpu::cusparselt_unavailable_reason();
  layer.use_dense_products(true);
  const auto t = layer.time_products(w.bf(), nullptr, 3);
  EXPECT_GT(t.sparse_ms, 0);
  EXPECT_GT(t.dense_ms, 0);
  EXPECT_FALSE(layer.sparse_products());
}

}  // namespace
