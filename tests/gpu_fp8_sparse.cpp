// fp8 training of the 2:4 kinds on the GPU (docs/fp8.md, "2:4 kinds") against the CPU's
// emulation, the reference:
// - cuSPARSELt's e4m3 2:4 product scaled by the product of the inverse scales
//   (SparseGemm24::matmul_scaled) against the fp64 product of
//   core's fp8_quantize_dequantize of the pruned weight and of the input, in the forward's
//   shape and in the input gradient's (Wᵀ [in, out] structured);
// - slope layers of the GPU model in fp8 (GpuModelOptions::precision) against the CPU model
//   with the same layers in fp8 (Transformer::set_linear_precision): the loss and every
//   gradient after one micro-batch, the 2:4 products on the path (the op timings), and a
//   micro-batch of another size (the dense fp8 products of the pruned weights);
// - semi_sparse layers the same way (Ws and Wsᵀ from the transposable prune);
// - the refusal of train.fp8_grad e5m2 (cuSPARSELt's fp8 products take e4m3 only);
// - the run log's dispatch summary naming the fp8 ways' decisions (host code only).
// Skips without cuSPARSELt, and below compute capability 8.9 (no fp8 tensor cores).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "model/device_linear.h"
#include "model/gpu_transformer.h"
#include "model/linear_slope.h"
#include "model/transformer.h"
#include "ops/gpu_fp8.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/masks.h"
#include "train/layer_kinds.h"

#include "gpu_test_util.h"

namespace {

using esplag::gpu_test::has_fp8_tensor_cores;
using esplag::gpu_test::sparse_llama_config;
using esplag::Fp8Format;
using esplag::GpuModelOptions;
using esplag::GpuTransformer;
using esplag::LinearPrecision;
using esplag::ModelConfig;
using esplag::Transformer;
using esplag::gpu_test::rel_l2;
namespace gpu = esplag::gpu;


class GpuFp8Sparse : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
    if (!gpu::cusparselt_available()) GTEST_SKIP() << gpu::cusparselt_unavailable_reason();
    if (!has_fp8_tensor_cores()) GTEST_SKIP() << "fp8 products need compute capability 8.9 or newer";
  }
};

// W [rows, cols] pruned 2:4 along each row: the 2 largest |w| of every 4 kept.
std::vector<float> pruned_rows(std::vector<float> w, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += 4) {
      float* g = &w[size_t(r * cols + c)];
      int order[4] = {0, 1, 2, 3};
      std::sort(order, order + 4, [&](int a, int b) { return std::fabs(g[a]) > std::fabs(g[b]); });
      g[order[2]] = g[order[3]] = 0.f;
    }
  return w;
}

// Y [N, out] = X [N, in] · Wᵀ on the e4m3 2:4 product scaled by 1 / (s_x · s_w), against
// the fp64 product of core's quantised and dequantised operands. (out, in) = (features of
// the output, of the input): the forward's [out, in] or the input gradient's [in, out].
void expect_scaled_product(int64_t out, int64_t in, int64_t N) {
  SCOPED_TRACE("out " + std::to_string(out) + " in " + std::to_string(in) + " tokens " + std::to_string(N));
  const std::vector<float> wf = pruned_rows(esplag::gpu_test::random_bf16(size_t(out * in), 3, 0.02).f, out, in);
  std::vector<uint16_t> wbits(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) wbits[i] = esplag::float_to_bf16(wf[i]);  // exact: wf is bf16
  const auto x = esplag::gpu_test::random_bf16(size_t(N * in), 4, 3.0);

  gpu::SparseGemm24Problem p = gpu::SparseGemm24Problem::linear_forward(out, in, N);
  p.dtype = gpu::SparseDtype::e4m3;
  p.device_scale = true;
  gpu::SparseGemm24 g(p);
  esplag::gpu_test::DeviceBuffers d(size_t(64) << 20);
  cudaStream_t s = d.stream();
  gpu::bf16* dw = d.put_bf16(wbits, "W");
  gpu::bf16* dx = d.put_bf16(x.bits, "X");
  float* scales = d.poisoned<float>(256, "scales");  // amax, inv: W at 0 / 64, X at 128 / 192
  uint8_t* w8 = d.poisoned<uint8_t>(size_t(out * in), "W e4m3");
  uint8_t* x8 = d.poisoned<uint8_t>(size_t(N * in), "X e4m3");
  void* comp = d.arena().allocate("compressed", g.compressed_allocation_bytes());
  void* cs = d.arena().allocate("compress scratch", std::max<size_t>(g.compress_scratch_bytes(), 1));
  void* ws = d.arena().allocate("workspace", std::max<size_t>(g.workspace_bytes(), 1));
  gpu::bf16* y = d.poisoned<gpu::bf16>(size_t(N * out), "Y");
  gpu::fp8_amax(scales, dw, out * in, s);
  gpu::fp8_cast(w8, scales + 64, dw, out * in, scales, Fp8Format::e4m3, nullptr, s);
  g.compress(comp, w8, cs, g.compress_scratch_bytes(), s);
  gpu::fp8_amax(scales + 128, dx, N * in, s);
  gpu::fp8_cast(x8, scales + 192, dx, N * in, scales + 128, Fp8Format::e4m3, nullptr, s);
  g.matmul_scaled(y, comp, x8, scales + 192, scales + 64, ws, g.workspace_bytes(), s);
  CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<uint16_t> ybits(size_t(N * out));
  CUDA_CHECK(cudaMemcpy(ybits.data(), y, ybits.size() * 2, cudaMemcpyDeviceToHost));

  std::vector<float> wq(wf.size()), xq(x.f.size());
  esplag::fp8_quantize_dequantize(wq.data(), wf.data(), int64_t(wf.size()), Fp8Format::e4m3);
  esplag::fp8_quantize_dequantize(xq.data(), x.f.data(), int64_t(xq.size()), Fp8Format::e4m3);
  std::vector<float> ref(ybits.size()), got(ybits.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t k = 0; k < in; ++k) acc += double(xq[size_t(n * in + k)]) * wq[size_t(o * in + k)];
      ref[size_t(n * out + o)] = float(acc);
      got[size_t(n * out + o)] = esplag::bf16_to_float(ybits[size_t(n * out + o)]);
    }
  // bf16 output rounding (2^-9 relative) and fp32 accumulation: far below a wrong scale
  // (a factor of 2^k), layout or operand.
  EXPECT_LT(rel_l2(got.data(), ref.data(), ref.size()), 5e-3);
}

TEST_F(GpuFp8Sparse, ScaledE4m3ProductMatchesTheQuantisedOperands) {
  expect_scaled_product(96, 64, 128);  // the forward: W [out, in]
  expect_scaled_product(64, 96, 128);  // the input gradient: Wᵀ [in, out] as the structured operand
}


const LinearPrecision kFp8{true, Fp8Format::e4m3};

// Every block linear of both models of `kind` (slope, with the CPU's masks; semi_sparse).
void make_kind(Transformer<float>& cm, GpuTransformer& gm, const std::string& kind) {
  esplag::LayerPlan plan;
  plan.kind = kind;
  plan.pattern = esplag::SparsityPattern::nm(2, 4);
  plan.sparsity = 0.5;
  plan.mask_change_freq = 100;
  for (const auto& name : cm.linear_names()) esplag::apply_layer_plan(cm, name, plan, 1);
  gm.set_params(cm.params(), cm.num_params());
  for (const auto& name : cm.linear_names()) {
    if (kind != "slope") {
      gm.set_linear_kind(name, kind);
      continue;
    }
    auto& l = dynamic_cast<esplag::SlopeLinear<float>&>(cm.linear(name));
    const int64_t rows = l.forward_weight().rows, cols = l.forward_weight().cols;
    GpuTransformer::SlopeState st;
    st.forward_tiles = esplag::cpu::tile_bits(l.forward_mask(), rows, cols);
    st.backward_tiles = esplag::cpu::tile_bits(l.backward_mask(), rows, cols);
    st.refresh_step = std::max<int64_t>(l.refresh_step(), 0);
    gm.set_linear_kind(name, kind, 100, &st);
  }
}

// One micro-batch of B x T (the GPU model sized for maxB x maxT) on both models in fp8:
// the losses within 2%, every gradient within 6% (the GPU casts bf16 activations, the CPU
// fp32 ones: a few codes differ by one step), and the 2:4 products on the path for a
// full-size micro-batch: for every layer without `dispatch`, with it for the layers whose
// shape the timed dispatch gave the 2:4 way.
void compare_fp8_step(const std::string& kind, int maxB, int maxT, int B, int T, bool dispatch = false) {
  SCOPED_TRACE(kind + " " + std::to_string(B) + "x" + std::to_string(T) + (dispatch ? " dispatched" : ""));
  const ModelConfig cfg = sparse_llama_config();
  Transformer<float> cm(cfg);
  esplag::gpu_test::initial_params(cm);
  GpuModelOptions o;
  o.sparse_dispatch = dispatch;
  o.precision = kFp8;
  GpuTransformer gm(cfg, maxB, maxT, o);
  make_kind(cm, gm, kind);
  cm.set_linear_precision(kFp8);

  const std::vector<float> g = esplag::gpu_test::micro_batch_on_both(cm, gm, B, T, kind);
  double worst = 0;
  for (const auto& info : cm.param_infos()) {
    const double e = esplag::gpu_test::flat_grad_error(cm, g, info);
    EXPECT_LT(e, 6e-2) << "gradient of " << info.name;
    worst = std::max(worst, e);
  }
  std::printf("  worst gradient rel L2 error %.2e\n", worst);
  int sparse_ops = 0;
  for (const auto& op : gm.op_times()) sparse_ops += op.op.rfind("sparse gemm", 0) == 0;
  std::set<std::string> sparse_roles;  // op_times sums a role's products over the blocks
  for (const std::string& name : cm.linear_names()) {
    const auto& w = cm.linear(name).params();
    bool sparse = true;
    for (const auto& d : gm.sparse_dispatch()) {
      EXPECT_EQ(d.kind, kind + " fp8");
      EXPECT_GT(d.sparse_ms, 0.0);
      EXPECT_GT(d.dense_ms, 0.0);
      if (d.out == w.out_features && d.in == w.in_features) sparse = d.sparse;
    }
    if (sparse) sparse_roles.insert(name.substr(name.find('.', name.find('.') + 1) + 1));
  }
  EXPECT_EQ(gm.sparse_dispatch().empty(), !dispatch) << "a decision per shape, when dispatched";
  EXPECT_EQ(sparse_ops, B * T == maxB * maxT ? 2 * int(sparse_roles.size()) : 0)
      << "forward and dX of the 2:4 Linear roles";
}

// The first block Linear of a GPU model in `precision` made `kind`: an Error holding `want`
// (and the layer's name).
void expect_refused(const LinearPrecision& precision, const std::string& kind, const std::string& want) {
  GpuModelOptions o;
  o.sparse_dispatch = false;
  o.precision = precision;
  const ModelConfig cfg = sparse_llama_config();
  Transformer<float> cm(cfg);
  cm.init_weights(5);
  GpuTransformer gm(cfg, 2, 96, o);
  gm.set_params(cm.params(), cm.num_params());
  const std::string name = cm.linear_names().front();
  try {
    gm.set_linear_kind(name, kind);
    ADD_FAILURE() << kind << " took " << (precision.grad == Fp8Format::e5m2 ? "e5m2 gradients" : "fp8");
  } catch (const esplag::Error& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
  }
}

TEST_F(GpuFp8Sparse, SlopeTracksTheCpuEmulation) {
  compare_fp8_step("slope", 2, 96, 2, 96);
  compare_fp8_step("slope", 2, 96, 1, 64);  // the dense fp8 products of W1 and W2ᵀ
}

// With the timed per-layer dispatch: each shape takes the faster way (it may be either on
// this tiny model), and the gradients follow the emulation either way.
TEST_F(GpuFp8Sparse, DispatchedSlopeTracksTheCpuEmulation) { compare_fp8_step("slope", 2, 96, 2, 96, true); }

// semi_sparse: Ws and Wsᵀ from the transposable prune, one scale (the emulation quantises Ws
// once for both products).
TEST_F(GpuFp8Sparse, SemiSparseTracksTheCpuEmulation) {
  compare_fp8_step("semi_sparse", 2, 96, 2, 96);
  compare_fp8_step("semi_sparse", 2, 96, 1, 64);  // the dense fp8 products of Ws and Wsᵀ
  compare_fp8_step("semi_sparse", 2, 96, 2, 96, true);
}

// With delayed scaling, once the histories are warm, SwiGLU's forward and backward and the
// norms (forward and recomputed) write the 2:4 layers' X, Xᵀ and dY codes themselves
// (GpuModelOptions::fp8_producers), as they do the dense layers', and from the first step
// SwiGLU's kernels apply the scales of fc's and mproj's 2:4 outputs: a model with them and
// one without, of the same weights and masks, give the same losses and gradients bit for
// bit, through micro-batches of the full size (the 2:4 products) and another (the dense fp8
// products) and AdamW steps.
TEST_F(GpuFp8Sparse, ProducersGiveTheCastsBits) {
  for (const std::string kind : {"slope", "semi_sparse"}) {
    SCOPED_TRACE(kind);
    const ModelConfig cfg = sparse_llama_config();
    GpuModelOptions with;
    with.sparse_dispatch = false;
    with.precision = kFp8;
    with.precision.scaling = esplag::Fp8Scaling::delayed;
    GpuModelOptions without = with;
    without.fp8_producers = false;
    Transformer<float> ca(cfg), cb(cfg);
    GpuTransformer a(cfg, 2, 96, with), b(cfg, 2, 96, without);
    esplag::gpu_test::initial_params(ca);
    esplag::gpu_test::initial_params(cb);
    make_kind(ca, a, kind);
    make_kind(cb, b, kind);
    esplag::gpu_test::expect_producers_give_the_casts_bits(ca.linear_names(), a, b,
                                                           esplag::gpu_test::random_batch(cfg, 2, 96, 41),
                                                           esplag::gpu_test::random_batch(cfg, 1, 64, 43));
  }
}

TEST_F(GpuFp8Sparse, E5m2GradientsAreRefused) {
  expect_refused({true, Fp8Format::e5m2}, "slope", "set train.fp8_grad: e4m3");
}

// The dispatch records the fp8 ways as "slope fp8" / "semi_sparse fp8", names the kind table
// does not hold: the summary (the run log's line after the kinds change) still says each
// kind's decisions, with what its kind's entry times. Host code only.
TEST(GpuFp8SparseDispatch, TheSummaryNamesTheFp8Ways) {
  using Decision = GpuTransformer::SparseDispatch;
  const std::vector<Decision> decisions = {
      {.kind = "slope fp8", .out = 6144, .in = 2048, .sparse_ms = 0.25, .dense_ms = 0.5, .sparse = true},
      {.kind = "semi_sparse_activation", .out = 11264, .in = 2048, .sparse_ms = 0.6, .dense_ms = 0.5, .sparse = false},
      {.kind = "slope fp8", .out = 2048, .in = 5632, .sparse_ms = 0.125, .dense_ms = 0.375, .sparse = true}};
  EXPECT_EQ(esplag::sparse_dispatch_summary(decisions),
            "slope fp8 products by layer shape (prepare + forward + dX per step): "
            "6144x2048: 2:4 (2:4 0.250 ms, dense 0.500 ms); 2048x5632: 2:4 (2:4 0.125 ms, dense 0.375 ms) | "
            "semi_sparse_activation products by layer shape (input pruning + forward per step): "
            "11264x2048: dense (2:4 0.600 ms, dense 0.500 ms)");
  EXPECT_EQ(esplag::sparse_dispatch_summary({}), "");
}

}  // namespace
