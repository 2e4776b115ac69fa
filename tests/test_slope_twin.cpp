// The slope layer as a GPU run's host twin (model/linear_slope.h): built and used only
// through what the GPU step reads and writes (state, load_state, values, masks, the flat
// weight's refresh), it holds W1 and W2ᵀ's metadata and never the CPU products' state; the
// first CPU product builds that state, and from then on the layer computes what a layer
// that ran its products all along computes, bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "linear_test_util.h"
#include "model/linear_slope.h"
#include "sparse/masks.h"

namespace esplag {
namespace {

using esplag::testing::randv;
template <typename T>
using Buffers = esplag::testing::LayerBuffers<T>;

// What the layer must hold without the CPU products' state: W1's fp32/fp64 values and
// metadata, W2ᵀ's metadata, and the adapter.
template <typename T>
size_t defining_bytes(int64_t out, int64_t in, int rank) {
  const auto meta_stride = [](int64_t cols) { return (cols / 4 + 3) / 4; };
  return sizeof(T) * size_t(out * in / 2 + 2 * rank * (out + in)) +
         sizeof(uint16_t) * size_t(out * meta_stride(in) + in * meta_stride(out));
}

// One step of a layer on the CPU: forward, backward of `dy`, then plain SGD on its owned
// parameters and the hook that rewrites the flat weight. Returns the output, dX and the
// kept values' gradient.
template <typename T>
std::vector<std::vector<T>> cpu_step(SlopeLinear<T>& l, Buffers<T>& f, int64_t step, int N) {
  const int64_t O = f.p.out_features, C = f.p.in_features;
  const auto x = randv<T>(size_t(N * C), 100 + uint64_t(step));
  const auto dy = randv<T>(size_t(N * O), 200 + uint64_t(step));
  l.on_step_begin(step);
  std::fill(f.dw.begin(), f.dw.end(), T(0));
  std::fill(f.db.begin(), f.db.end(), T(0));
  for (auto& op : l.owned_params()) std::fill(op.grad, op.grad + shape_numel(op.shape), T(0));
  std::vector<T> out(size_t(N * O)), dx(size_t(N * C), T(0));
  l.forward(out.data(), x.data(), N);
  l.backward(dx.data(), dy.data(), x.data(), N);
  const auto values = l.owned_params().front();
  std::vector<T> grad(values.grad, values.grad + shape_numel(values.shape));
  for (auto& op : l.owned_params())
    for (int64_t i = 0; i < shape_numel(op.shape); ++i) op.value[i] -= T(0.01) * op.grad[i];
  l.after_optimizer_step();
  return {out, dx, grad};
}

TEST(SlopeTwin, TwinPathsHoldOnlyTheDefiningState) {
  const int out = 64, in = 128;
  Buffers<float> f(out, in, 1);
  SlopeLinear<float> l(f.p, 2);
  EXPECT_FALSE(l.has_cpu_products());
  EXPECT_EQ(l.host_bytes(), defining_bytes<float>(out, in, 0));
  EXPECT_LE(double(l.host_bytes()), 2.25 * out * in);

  // What the GPU step reads (DeviceSlopeLinear::setting_from_twin, moments_from_twin, the
  // teacher's and the export's dense weight) ...
  const std::vector<uint8_t> fwd = l.forward_mask(), bwd = l.backward_mask();
  EXPECT_EQ(l.forward_tiles(), cpu::tile_bits(fwd, out, in));
  EXPECT_EQ(l.backward_tiles(), cpu::tile_bits(bwd, out, in));
  EXPECT_EQ(fwd, cpu::nm_mask(f.w.data(), out, in, 2, 4)) << "the flat weight holds W1, whose mask is its own";
  std::vector<float> dense(f.w.size());
  l.dense_weight(dense.data());
  EXPECT_EQ(dense, f.w);
  const Compressed24 w2t = l.backward_weight();
  EXPECT_EQ(w2t.values.size(), size_t(out * in / 2));
  // ... and what it writes back (DeviceSlopeLinear::to_twin): new values, then the state.
  for (auto& v : l.values()) v *= 1.5f;
  std::map<std::string, Tensor> state = l.state();
  state[f.p.name + ".refresh_step"].data<double>()[0] = 7;
  l.load_state(state);
  EXPECT_EQ(l.refresh_step(), 7);
  EXPECT_EQ(l.forward_mask(), fwd);
  EXPECT_EQ(l.backward_mask(), bwd);
  for (size_t i = 0; i < f.w.size(); ++i) EXPECT_EQ(f.w[i], fwd[i] ? 1.5f * dense[i] : 0.f) << i;
  l.after_optimizer_step();  // a checkpoint's load refreshes the flat weight
  l.enable_lora(4, 11);
  SlopeLinear<float> next(f.p, l, 2);  // a recipe's later slope modifier continues the layer
  for (const SlopeLinear<float>* t : {&l, &next}) {
    EXPECT_FALSE(t->has_cpu_products());
    EXPECT_EQ(t->host_bytes(), defining_bytes<float>(out, in, 4));
  }

  std::vector<float> y(size_t(2 * out));
  l.forward(y.data(), randv<float>(size_t(2 * in), 3).data(), 2);
  EXPECT_TRUE(l.has_cpu_products());
  EXPECT_GT(l.host_bytes(), defining_bytes<float>(out, in, 4) + 3 * size_t(out) * in);  // two slot indices, W2ᵀ
}

// A reference layer runs its CPU products from the first step on; its twin follows it
// through the twin paths only (its values taken over, its state loaded every other step,
// its own mask refreshes in between), then runs the products itself.
template <typename T>
void twin_takes_over(int out, int in) {
  SCOPED_TRACE(std::string(sizeof(T) == 4 ? "float" : "double") + " [" + std::to_string(out) + ", " +
               std::to_string(in) + "]");
  const int N = 8, freq = 2;
  Buffers<T> fr(out, in, 5), ft(out, in, 5);
  SlopeLinear<T> ref(fr.p, freq), twin(ft.p, freq);
  const std::vector<uint16_t> first_backward = ref.backward_tiles();
  int64_t step = 0;
  for (; step < 5; ++step) {
    twin.on_step_begin(step);  // refreshes from the same W1 as the reference's step does
    cpu_step(ref, fr, step, N);
    twin.values() = ref.values();
    if (step % 2 == 1) twin.load_state(ref.state());
    twin.after_optimizer_step();
    ASSERT_EQ(twin.refresh_step(), ref.refresh_step()) << step;
    ASSERT_EQ(twin.backward_tiles(), ref.backward_tiles()) << step;
    ASSERT_EQ(ft.w, fr.w) << step;
  }
  EXPECT_FALSE(twin.has_cpu_products());
  for (; step < 10; ++step) {  // mask refreshes at steps 5, 7 and 9
    const auto r = cpu_step(ref, fr, step, N);
    const auto t = cpu_step(twin, ft, step, N);
    ASSERT_EQ(t[0], r[0]) << "output, step " << step;
    ASSERT_EQ(t[1], r[1]) << "dX, step " << step;
    ASSERT_EQ(t[2], r[2]) << "kept values' gradient, step " << step;
    ASSERT_EQ(ft.db, fr.db) << step;
    ASSERT_EQ(twin.values(), ref.values()) << step;
    ASSERT_EQ(twin.backward_mask(), ref.backward_mask()) << step;
    ASSERT_EQ(ft.w, fr.w) << step;
  }
  EXPECT_TRUE(twin.has_cpu_products());
  EXPECT_NE(ref.backward_tiles(), first_backward) << "no refresh changed the backward mask: the test tests less";
}

TEST(SlopeTwin, CpuProductsAfterTwinUseEqualThoseOfALayerThatRanThemAllAlong) {
  twin_takes_over<float>(32, 64);
  twin_takes_over<float>(20, 36);  // metadata rows with unused nibbles
  twin_takes_over<double>(32, 64);
}

}  // namespace
}  // namespace esplag
