// The GPU's fp8 kernels (ops/gpu_fp8.h) against core/fp8.h, the CPU reference.
//
// Casts must give core's codes bit for bit: fp8_encode(float(x) · s) with s =
// fp8_scale(amax), amax = fp8_amax(x) computed on the device and equal to core's, the
// inverse scale exactly 1 / s, the saturated count core's, and the amax a cast records
// (delayed scaling) core's too; the step end of delayed scaling's histories follows core's. Every bf16 value is cast
// once per format at scale 1 (ties, subnormals, the saturation thresholds, ±inf, NaN of
// both signs); random tensors of awkward sizes (1, 17, 4097, 2^20 + 5, and one past a
// round of the grid-stride loops) go through the 16-byte path with and without a tail and,
// shifted by one element, the scalar path. The tiled casts (transposed, and both layouts
// from one read) take matrices around the 64 x 64 tile, tiny and empty ones, inputs and
// outputs off their 16-byte alignment, and every bf16 value laid out in several shapes.
// SwiGLU's fp8 producers give the codes the casts make of the bf16 kernels' values.
// Outputs are poisoned first (0xFF, the code of -NaN, which the random tensors never give;
// the exhaustive test, which does give it, runs twice with two poisons), and the bytes
// after the output are checked to stay poisoned.
//
// GEMMs: against the fp64 product of the dequantised operands (codes · inverse scale, as
// downloaded), each element within 2^-8 |ref| (bf16 rounding; 2^-20 for fp32 outputs) plus
// 2^-10 · Σ_k |a_k b_k| (fp32 and tensor-core accumulation over K, relative to the
// magnitude of the sum's terms), and the relative RMS error within 1e-2. A wrong scale,
// operand order, layout, format, bias or accumulation misses both by far. The products of
// a Linear are also checked end to end against core's fp8_quantize_dequantize of the bf16
// tensors. GEMM tests skip below compute capability 8.9 (no fp8 tensor cores).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/rng.h"
#include "model/fp8_amax_history.h"
#include "ops/gpu.h"
#include "ops/gpu_fp8.h"
#include "ops/gpu_fused.h"

#include "gpu_test_util.h"

namespace {

using esplag::gpu_test::has_fp8_tensor_cores;
using esplag::Fp8Format;
using esplag::Rng;
using esplag::gpu::bf16;
using esplag::gpu_test::Bits;
using esplag::gpu_test::has_device;
using esplag::gpu_test::VD;
using esplag::gpu_test::VF;
namespace gpu = esplag::gpu;
using Codes = std::vector<uint8_t>;

#define REQUIRE_DEVICE() ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"

const Fp8Format kFormats[] = {Fp8Format::e4m3, Fp8Format::e5m2};
constexpr uint8_t kPoison = 0xFF;
constexpr int kGuard = 64;  // bytes after an output that must stay poisoned


#define REQUIRE_FP8_GEMM()                                                                        \
  REQUIRE_DEVICE();                                                                               \
  if (!has_fp8_tensor_cores()) GTEST_SKIP() << "fp8 GEMMs need compute capability 8.9 or newer"

class Dev : public esplag::gpu_test::DeviceBuffers {
 public:
  explicit Dev(size_t bytes = size_t(256) << 20) : DeviceBuffers(bytes) {}
  // n bytes followed by kGuard guard bytes, all `poison`.
  uint8_t* poisoned_codes(size_t n, uint8_t poison = kPoison) {
    auto* p = static_cast<uint8_t*>(scratch(n + kGuard, "codes"));
    CUDA_CHECK(cudaMemset(p, poison, n + kGuard));
    return p;
  }
  float* poisoned_floats(size_t n) { return poisoned<float>(n, "floats"); }
  uint64_t* zeroed_counter() {
    auto* p = static_cast<uint64_t*>(scratch(sizeof(uint64_t), "saturated"));
    CUDA_CHECK(cudaMemset(p, 0, sizeof(uint64_t)));
    return p;
  }
  float get_float(const float* p) { return get(p, 1)[0]; }
  uint64_t get_count(const uint64_t* p) { return get(p, 1)[0]; }
};

float value(uint16_t bits) { return esplag::bf16_to_float(bits); }

// Random bf16 values scale · N(0, 1); `specials` puts two NaNs, +inf and -inf at fixed
// spots. The NaNs are positive, so that no code of a random tensor is the poison 0xFF
// (-NaN's sign is checked by CastEveryBf16ValueBitExact).
Bits random_bits(size_t n, uint64_t seed, double scale, bool specials = false) {
  Rng rng(seed);
  Bits b(n);
  for (auto& x : b) x = esplag::float_to_bf16(static_cast<float>(scale * rng.normal()));
  if (specials && n >= 8) {
    b[n / 7] = 0x7FC0;  // NaN
    b[n / 5] = 0x7F81;  // signalling NaN
    b[n / 3] = 0x7F80;  // +inf
    b[n - 1] = 0xFF80;  // -inf
  }
  return b;
}

// core's codes of the values at scale s, and how many saturated.
struct Expected {
  Codes codes;
  uint64_t saturated = 0;
};

Expected cpu_cast(const Bits& x, size_t first, size_t n, float s, Fp8Format f) {
  Expected e;
  e.codes.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const float v = value(x[first + i]) * s;  // rounded to fp32, as core's emulation does
    bool clipped = false;
    e.codes[i] = esplag::fp8_encode(double(v), f, &clipped);
    e.saturated += clipped;
  }
  return e;
}

float cpu_amax(const Bits& x, size_t first, size_t n) {
  VF v(n);
  for (size_t i = 0; i < n; ++i) v[i] = value(x[first + i]);
  return esplag::fp8_amax(v.data(), int64_t(n));
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// got (with kGuard guard bytes after it) equals want, and the guard is untouched.
void expect_codes(const std::string& what, const Codes& want, const Codes& got_with_guard, uint8_t poison = kPoison) {
  ASSERT_EQ(got_with_guard.size(), want.size() + kGuard) << what;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (got_with_guard[i] != want[i] && ++bad <= 5)
      ADD_FAILURE() << what << ": code[" << i << "] = 0x" << std::hex << int(got_with_guard[i]) << ", core says 0x"
                    << int(want[i]) << std::dec;
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " codes differ";
  for (size_t i = want.size(); i < got_with_guard.size(); ++i)
    ASSERT_EQ(got_with_guard[i], poison) << what << ": wrote past the end, at " << i;
}

// ---------------------------------------------------------------------------------------
// Casts

// Every bf16 bit pattern at scale 1 (amax given as the format's max): the rounding of
// every value, including exact ties and subnormals, finite values past the threshold
// (saturated and counted), infinities (saturated, counted) and NaNs (signed NaN codes).
TEST(GpuFp8, CastEveryBf16ValueBitExact) {
  REQUIRE_DEVICE();
  Bits all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  for (const Fp8Format f : kFormats) {
    // (first element, count): 16-byte path without tail, with a tail, and the scalar path.
    for (const auto& [first, n] : {std::pair<size_t, size_t>{0, 65536}, {0, 65533}, {1, 65535}}) {
      for (const uint8_t poison : {uint8_t(0xFF), uint8_t(0x00)}) {
        Dev dev;
        const std::string what = to_string(f) + " first=" + std::to_string(first) + " n=" + std::to_string(n) +
                                 " poison=" + std::to_string(poison);
        const bf16* x = dev.put_bf16(all) + first;
        const float* amax = dev.put(VF{esplag::fp8_max(f)});
        uint8_t* out = dev.poisoned_codes(n + 1, poison) + first % 2;  // the output shifted with the input
        float* inv = dev.poisoned_floats(1);
        uint64_t* sat = dev.zeroed_counter();
        gpu::fp8_cast(out, inv, x, int64_t(n), amax, f, sat, dev.stream());
        const Expected want = cpu_cast(all, first, n, 1.0f, f);
        Codes got = dev.get(out, n + kGuard);
        expect_codes(what, want.codes, got, poison);
        EXPECT_EQ(dev.get_float(inv), 1.0f) << what;
        EXPECT_EQ(dev.get_count(sat), want.saturated) << what;
        EXPECT_GT(want.saturated, 0u) << what << ": the test must include saturating values";
      }
    }
  }
}

// fp8_amax then fp8_cast of x's n values from `first` (unaligned when odd) against the CPU's
// amax, scale, codes and saturation count (`saturated`, which the test's data must give).
void expect_amax_and_cast(Fp8Format f, const Bits& x, size_t first, size_t n, const std::string& what,
                          uint64_t saturated) {
  Dev dev;
  const bf16* dx = dev.put_bf16(x) + first;
  float* amax = dev.poisoned_floats(1);
  float* inv = dev.poisoned_floats(1);
  uint8_t* out = dev.poisoned_codes(n);
  uint64_t* sat = dev.zeroed_counter();
  float* record = dev.put(VF{0.0f});
  gpu::fp8_amax(amax, dx, int64_t(n), dev.stream());
  gpu::fp8_cast(out, inv, dx, int64_t(n), {amax, record}, f, sat, dev.stream());
  const float want_amax = cpu_amax(x, first, n);
  EXPECT_EQ(float_bits(dev.get_float(record)), float_bits(want_amax)) << what << ": amax the cast recorded";
  const float s = esplag::fp8_scale(want_amax, f);
  const Expected want = cpu_cast(x, first, n, s, f);
  EXPECT_EQ(float_bits(dev.get_float(amax)), float_bits(want_amax)) << what << ": amax";
  EXPECT_EQ(float_bits(dev.get_float(inv)), float_bits(1.0f / s)) << what << ": inverse scale";
  expect_codes(what, want.codes, dev.get(out, n + kGuard));
  EXPECT_EQ(dev.get_count(sat), want.saturated) << what;
  EXPECT_EQ(want.saturated, saturated) << what << ": only the infinities saturate";
}

// amax and scale from the data: random tensors of several sizes and magnitudes, one with
// NaN and infinities (not in amax; NaN codes; infinities saturate and are counted).
TEST(GpuFp8, AmaxScaleAndCastFromData) {
  REQUIRE_DEVICE();
  uint64_t seed = 100;
  for (const Fp8Format f : kFormats)
    for (const size_t n : {size_t(1), size_t(17), size_t(4097), (size_t(1) << 20) + 5})
      for (const double scale : {1e-3, 1.0, 3e4})
        for (const size_t first : {size_t(0), size_t(1)}) {
          const bool specials = n == 4097 && scale == 1.0;
          const Bits x = random_bits(n + first, ++seed, scale, specials);
          expect_amax_and_cast(f, x, first, n,
                               to_string(f) + " n=" + std::to_string(n) + " scale=" + std::to_string(scale) +
                                   " first=" + std::to_string(first),
                               specials ? 2u : 0u);
        }
}

// Tensors past what one round of the grid-stride loops covers (2048 blocks · 256 threads ·
// 4 packs of 8 values in flight per thread: 16M values), so that every pack of a thread's
// round is used and a second round runs; with NaN and infinities, aligned and not.
TEST(GpuFp8, AmaxAndCastOfLargeTensors) {
  REQUIRE_DEVICE();
  const size_t n = (size_t(1) << 24) + (size_t(1) << 22) + 5;
  uint64_t seed = 150;
  for (const Fp8Format f : kFormats)
    for (const size_t first : {size_t(0), size_t(1)}) {
      const Bits x = random_bits(n + first, ++seed, 1.0, true);
      expect_amax_and_cast(f, x, first, n, to_string(f) + " first=" + std::to_string(first), 2u);
    }
}

// The scale's edge rules: all zeros and only non-finite values (amax 0, scale 1), a tiny
// amax (scale FLT_MAX), an empty tensor (amax 0; the cast still writes the scale).
TEST(GpuFp8, ScaleEdgeCases) {
  REQUIRE_DEVICE();
  const uint16_t tiny = esplag::float_to_bf16(1e-38f);  // 448 / 1e-38 overflows fp32
  const std::vector<std::pair<std::string, Bits>> cases = {
      {"zeros", Bits(33, 0x0000)},
      {"negative zeros", Bits(9, 0x8000)},
      {"non-finite only", Bits{0x7FC0, 0xFF80, 0x7F80, 0x7FC1}},
      {"tiny", Bits{tiny, 0x0000, uint16_t(tiny | 0x8000), 0x0001}},
      {"empty", Bits{}},
  };
  for (const Fp8Format f : kFormats)
    for (const auto& [name, x] : cases) {
      Dev dev;
      const std::string what = to_string(f) + " " + name;
      const bf16* dx = x.empty() ? nullptr : dev.put_bf16(x);
      float* amax = dev.poisoned_floats(1);
      float* inv = dev.poisoned_floats(1);
      uint8_t* out = dev.poisoned_codes(x.size());
      gpu::fp8_amax(amax, dx, int64_t(x.size()), dev.stream());
      gpu::fp8_cast(out, inv, dx, int64_t(x.size()), amax, f, nullptr, dev.stream());
      const float want_amax = cpu_amax(x, 0, x.size());
      const float s = esplag::fp8_scale(want_amax, f);
      EXPECT_EQ(float_bits(dev.get_float(amax)), float_bits(want_amax)) << what;
      EXPECT_EQ(float_bits(dev.get_float(inv)), float_bits(1.0f / s)) << what;
      EXPECT_EQ(s, name == "tiny" ? FLT_MAX : 1.0f) << what << ": the rule under test";
      expect_codes(what, cpu_cast(x, 0, x.size(), s, f).codes, dev.get(out, x.size() + kGuard));
    }
}

// The tiled casts of x [rows, cols]: fp8_cast_transpose (out_t only) or fp8_cast_both
// (out and out_t from one read), against core's codes at the tensor's scale: the amax from
// fp8_amax on the device, or `scale_one` (amax given as the format's max: scale 1). x lies
// `first` values into its upload (first 1: x is not 16-byte aligned, the values are read one
// by one), the outputs `shift` bytes into theirs (shift 1: the codes are stored one by one),
// every output poisoned with `poison` first, and the bytes after each must stay so.
struct TiledCase {
  int64_t rows, cols;
  size_t first = 0, shift = 0;
  bool both = true, scale_one = false;
  uint8_t poison = kPoison;
};

void expect_tiled_cast(const Bits& x_all, Fp8Format f, const TiledCase& t) {
  const size_t n = size_t(t.rows * t.cols);
  const std::string what = std::string(t.both ? "fp8_cast_both " : "fp8_cast_transpose ") + to_string(f) + " " +
                           std::to_string(t.rows) + "x" + std::to_string(t.cols) + " first=" + std::to_string(t.first) +
                           " shift=" + std::to_string(t.shift) + " poison=" + std::to_string(t.poison);
  SCOPED_TRACE(what);
  ASSERT_EQ(x_all.size(), n + t.first);
  Dev dev;
  const bf16* x = dev.put_bf16(x_all) + t.first;
  float* amax = t.scale_one ? dev.put(VF{esplag::fp8_max(f)}) : dev.poisoned_floats(1);
  float* inv = dev.poisoned_floats(1);
  uint8_t* out = t.both ? dev.poisoned_codes(n + t.shift, t.poison) + t.shift : nullptr;
  uint8_t* out_t = dev.poisoned_codes(n + t.shift, t.poison) + t.shift;
  uint64_t* sat = dev.zeroed_counter();
  float* record = dev.put(VF{0.0f});
  if (!t.scale_one) gpu::fp8_amax(amax, x, int64_t(n), dev.stream());
  if (t.both)
    gpu::fp8_cast_both(out, out_t, inv, x, t.rows, t.cols, {amax, record}, f, sat, dev.stream());
  else
    gpu::fp8_cast_transpose(out_t, inv, x, t.rows, t.cols, {amax, record}, f, sat, dev.stream());
  EXPECT_EQ(float_bits(dev.get_float(record)), float_bits(cpu_amax(x_all, t.first, n))) << "the recorded amax";
  const float s = t.scale_one ? 1.0f : esplag::fp8_scale(cpu_amax(x_all, t.first, n), f);
  const Expected e = cpu_cast(x_all, t.first, n, s, f);
  Codes want_t(n);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c) want_t[size_t(c * t.rows + r)] = e.codes[size_t(r * t.cols + c)];
  expect_codes(what + " (transposed)", want_t, dev.get(out_t, n + kGuard), t.poison);
  if (t.both) expect_codes(what + " (as it lies)", e.codes, dev.get(out, n + kGuard), t.poison);
  EXPECT_EQ(float_bits(dev.get_float(inv)), float_bits(1.0f / s));
  EXPECT_EQ(dev.get_count(sat), e.saturated) << "each clipped value counted once";
}

// Shapes around the 128 x 64 tile and the vectorised paths (rows a multiple of 16 for the
// transposed stores, cols a multiple of 8 for the loads and the row-major stores), tiny
// ones, one of NaN and infinities (NaN codes; the infinities saturate and are counted).
const std::vector<std::pair<int64_t, int64_t>> kTiledShapes = {
    {1, 1},    {1, 17},   {17, 1},    {17, 33},   {64, 64}, {65, 127}, {128, 96}, {300, 4097}, {4097, 3},
    {48, 80},  {16, 8},   {96, 200},  {130, 72},  {32, 1000}, {1, 64}, {64, 1},   {128, 64},   {127, 63},
    {129, 65}, {256, 136}, {144, 24}, {112, 520}};

void expect_tiled_casts(bool both, uint64_t seed) {
  for (const Fp8Format f : kFormats)
    for (const auto& [rows, cols] : kTiledShapes)
      for (const auto& [first, shift] : {std::pair<size_t, size_t>{0, 0}, {1, 0}, {0, 1}}) {
        const size_t n = size_t(rows * cols);
        const Bits x = random_bits(n + first, ++seed, 2.0, rows == 17 && cols == 33);
        expect_tiled_cast(x, f, {rows, cols, first, shift, both});
      }
}

TEST(GpuFp8, CastTransposeBitExact) {
  REQUIRE_DEVICE();
  expect_tiled_casts(false, 200);
}

TEST(GpuFp8, CastBothBitExact) {
  REQUIRE_DEVICE();
  expect_tiled_casts(true, 250);
}

// Every bf16 bit pattern through both tiled casts at scale 1, laid out as matrices of several
// shapes (full tiles, a partial tile, a single row or column), with two poisons (the codes
// include 0xFF, -NaN's).
TEST(GpuFp8, TiledCastsOfEveryBf16ValueBitExact) {
  REQUIRE_DEVICE();
  Bits all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  for (const Fp8Format f : kFormats)
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{256, 256}, {512, 128}, {1, 65536}, {65536, 1}})
      for (const bool both : {true, false})
        for (const uint8_t poison : {uint8_t(0xFF), uint8_t(0x00)})
          expect_tiled_cast(all, f, {rows, cols, 0, 0, both, true, poison});
}

// Empty tensors: nothing written but the inverse scale (1: amax 0).
TEST(GpuFp8, TiledCastsOfEmptyTensors) {
  REQUIRE_DEVICE();
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{0, 0}, {0, 5}, {7, 0}})
    for (const bool both : {true, false}) expect_tiled_cast(Bits{}, Fp8Format::e4m3, {rows, cols, 0, 0, both});
}

// A scale source at half the amax of values [n]: the casts by it saturate values.
float* half_amax(Dev& dev, const bf16* values, int64_t n) {
  float* a = dev.poisoned_floats(1);
  gpu::fp8_amax(a, values, n, dev.stream());
  const float half = 0.5f * dev.get_float(a);
  CUDA_CHECK(cudaMemcpy(a, &half, sizeof(float), cudaMemcpyHostToDevice));
  return a;
}

// fp8_swiglu_backward's codes, inverse scales, recorded amaxes and saturated counts are those
// of fused_swiglu_backward's bf16 gradient through fp8_cast_both and of fused_swiglu_forward's
// output through fp8_cast_transpose, and fp8_swiglu_forward's those of the output through
// fp8_cast, bit for bit, at scales from half the tensors' amaxes (so that values saturate),
// for shapes around the 128 x 64 tile (H not a multiple of 64: a partial column tile; N off
// 16: the transposed stores one by one), NaN and infinities among the inputs, outputs
// poisoned first. For even N the producers read inp and dout with pending scales (2:4 fp8
// products' outputs), the bf16 kernels them scaled in place first (apply_pending_scale).
TEST(GpuFp8, SwigluCodesAreTheCastsOfItsValues) {
  REQUIRE_DEVICE();
  uint64_t seed = 900;
  for (const Fp8Format f : kFormats)
    for (const auto& [N, H] : {std::pair<int64_t, int>{1, 8}, {17, 8}, {130, 72}, {256, 64}, {300, 136}, {64, 1000}}) {
      SCOPED_TRACE(std::string("fp8 SwiGLU ") + to_string(f) + " N=" + std::to_string(N) + " H=" + std::to_string(H));
      Dev dev;
      const size_t n = size_t(N) * 2 * H;
      const Bits inp_bits = random_bits(n, ++seed, 3.0, N == 130);
      const Bits dout_bits = random_bits(n / 2, ++seed, 0.5, N == 300);
      const bf16* inp = dev.put_bf16(inp_bits);
      const bf16* dout = dev.put_bf16(dout_bits);
      gpu::PendingScale inp_scale, dout_scale;
      bf16* scaled_inp = dev.put_bf16(inp_bits);
      bf16* scaled_dout = dev.put_bf16(dout_bits);
      if (N % 2 == 0) {
        const float* f = dev.put(VF{0.37f, 3.1f, 1.9f, 0.21f});
        inp_scale = {f, f + 1};
        dout_scale = {f + 2, f + 3};
        gpu::apply_pending_scale(scaled_inp, int64_t(n), inp_scale, dev.stream());
        gpu::apply_pending_scale(scaled_dout, int64_t(n / 2), dout_scale, dev.stream());
      }
      bf16* grad = dev.poisoned_bf16(n);
      bf16* act = dev.poisoned_bf16(n / 2);
      gpu::fused_swiglu_backward(grad, nullptr, scaled_inp, {}, scaled_dout, {}, N, H, dev.stream());
      gpu::fused_swiglu_forward(act, scaled_inp, {}, N, H, dev.stream());
      struct Outputs {
        uint8_t *out, *out_t;
        float *scale_from, *inv, *record;
        uint64_t* saturated;
        gpu::Fp8Target target(Fp8Format format) const {
          return {out, out_t, inv, {scale_from, record}, format, saturated};
        }
      };
      // Room and a half-amax scale for values [N, cols] (bf16), as they lie and/or transposed.
      const auto outputs = [&](const bf16* values, int64_t cols, bool rows, bool transposed) {
        const size_t m = size_t(N * cols);
        float* scale_from = half_amax(dev, values, int64_t(m));
        const auto one = [&] {
          return Outputs{rows ? dev.poisoned_codes(m) : nullptr, transposed ? dev.poisoned_codes(m) : nullptr,
                         scale_from, dev.poisoned_floats(1), dev.put(VF{0.0f}), dev.zeroed_counter()};
        };
        return std::pair{one(), one()};  // wanted, got
      };
      const auto [want_g, got_g] = outputs(grad, 2 * int64_t(H), true, true);
      const auto [want_a, got_a] = outputs(act, H, false, true);
      const auto [want_f, got_f] = outputs(act, H, true, false);
      gpu::fp8_cast_both(want_g.out, want_g.out_t, want_g.inv, grad, N, 2 * int64_t(H),
                         {want_g.scale_from, want_g.record}, f, want_g.saturated, dev.stream());
      gpu::fp8_cast_transpose(want_a.out_t, want_a.inv, act, N, H, {want_a.scale_from, want_a.record},
                              Fp8Format::e4m3, want_a.saturated, dev.stream());
      gpu::fp8_cast(want_f.out, want_f.inv, act, N * H, {want_f.scale_from, want_f.record}, Fp8Format::e4m3,
                    want_f.saturated, dev.stream());
      gpu::fp8_swiglu_backward(got_g.target(f), got_a.target(Fp8Format::e4m3), inp, inp_scale, dout, dout_scale, N, H,
                               dev.stream());
      gpu::fp8_swiglu_forward(got_f.target(Fp8Format::e4m3), inp, inp_scale, N, H, dev.stream());
      const auto expect_same = [&](const std::string& which, const Outputs& want, const Outputs& got, size_t m) {
        if (want.out) expect_codes(which + " (as it lies)", dev.get(want.out, m), dev.get(got.out, m + kGuard));
        if (want.out_t) expect_codes(which + " (transposed)", dev.get(want.out_t, m), dev.get(got.out_t, m + kGuard));
        EXPECT_EQ(float_bits(dev.get_float(got.inv)), float_bits(dev.get_float(want.inv))) << which;
        EXPECT_EQ(float_bits(dev.get_float(got.record)), float_bits(dev.get_float(want.record))) << which;
        EXPECT_EQ(dev.get_count(got.saturated), dev.get_count(want.saturated)) << which;
        EXPECT_GT(dev.get_count(want.saturated), 0u) << which << ": the half amax saturates values";
      };
      expect_same("the backward's gradient", want_g, got_g, n);
      expect_same("the backward's output", want_a, got_a, n / 2);
      expect_same("the forward's output", want_f, got_f, n / 2);
    }
}

// The SwiGLU producers refuse what they cannot write: H not a multiple of 8, an input off
// its 16-byte alignment, codes in a layout or format they do not make.
TEST(GpuFp8, SwigluCodesRefuseBadArguments) {
  REQUIRE_DEVICE();
  Dev dev;
  const int64_t N = 32;
  const int H = 16;
  const bf16* inp = dev.put_bf16(random_bits(size_t(N) * 2 * H + 8, 7, 1.0));
  const bf16* dout = dev.put_bf16(random_bits(size_t(N) * H + 8, 8, 1.0));
  float* scale_from = dev.put(VF{1.0f});
  const auto target = [&](bool out, bool out_t, Fp8Format f) {
    const size_t m = size_t(N) * 2 * H;
    return gpu::Fp8Target{out ? dev.poisoned_codes(m) : nullptr, out_t ? dev.poisoned_codes(m) : nullptr,
                          dev.poisoned_floats(1), {scale_from}, f, nullptr};
  };
  const Fp8Format e4m3 = Fp8Format::e4m3, e5m2 = Fp8Format::e5m2;
  const gpu::Fp8Target grad = target(true, true, e4m3), act_t = target(false, true, e4m3);
  const gpu::Fp8Target act = target(true, false, e4m3);
  cudaStream_t s = dev.stream();
  EXPECT_THROW(gpu::fp8_swiglu_forward(act, inp, {}, N, 12, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_swiglu_forward(act, inp + 1, {}, N, H, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_swiglu_forward(target(true, true, e4m3), inp, {}, N, H, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_swiglu_forward(target(true, false, e5m2), inp, {}, N, H, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_swiglu_backward(grad, act_t, inp, {}, dout, {}, N, 12, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_swiglu_backward(grad, act_t, inp, {}, dout + 1, {}, N, H, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_swiglu_backward(grad, act, inp, {}, dout, {}, N, H, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_swiglu_backward(act_t, act_t, inp, {}, dout, {}, N, H, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_swiglu_backward(grad, target(false, true, e5m2), inp, {}, dout, {}, N, H, s), esplag::Error);
  EXPECT_NO_THROW(gpu::fp8_swiglu_backward(grad, act_t, inp, {}, dout, {}, N, H, s));
  EXPECT_NO_THROW(gpu::fp8_swiglu_forward(act, inp, {}, N, H, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
}

// fp8_norm_recompute's codes (as they lie and transposed), inverse scale and saturated count
// are those of the norm's output recomputed in bf16 (layernorm_forward, rmsnorm_forward)
// through fp8_cast_both, bit for bit, from the statistics the forward saved: LayerNorm with
// and without a bias, RMSNorm, rows around the 128-row tile and off 16, columns off the
// 64-column tile, at a scale from half the output's amax (so that values saturate).
TEST(GpuFp8, NormRecomputeCodesAreTheCastsOfItsValues) {
  REQUIRE_DEVICE();
  uint64_t seed = 1200;
  for (const int kind : {0, 1, 2})  // LayerNorm with a bias, without, RMSNorm
    for (const auto& [N, C] : {std::pair<int64_t, int>{1, 8}, {130, 72}, {256, 64}, {300, 136}, {64, 1000}}) {
      const bool rms = kind == 2, with_bias = kind == 0;
      SCOPED_TRACE(std::string(rms ? "RMSNorm" : with_bias ? "LayerNorm" : "LayerNorm without bias") +
                   " N=" + std::to_string(N) + " C=" + std::to_string(C));
      Dev dev;
      const size_t n = size_t(N) * C;
      const bf16* x = dev.put_bf16(random_bits(n, ++seed, 2.0));
      const bf16* w = dev.put_bf16(random_bits(size_t(C), ++seed, 1.5));
      const bf16* b = with_bias ? dev.put_bf16(random_bits(size_t(C), ++seed, 0.5)) : nullptr;
      float* mean = dev.poisoned_floats(size_t(N));
      float* rstd = dev.poisoned_floats(size_t(N));
      bf16* y = dev.poisoned_bf16(n);
      bf16* again = dev.poisoned_bf16(n);
      cudaStream_t s = dev.stream();
      if (rms) {  // the forward saves the statistics; the recomputation, as the backward's, does not
        gpu::rmsnorm_forward(y, rstd, nullptr, x, nullptr, w, int(N), C, s);
        gpu::rmsnorm_forward(again, nullptr, nullptr, x, nullptr, w, int(N), C, s);
      } else {
        gpu::layernorm_forward(y, mean, rstd, nullptr, x, nullptr, w, b, int(N), C, s);
        gpu::layernorm_forward(again, nullptr, nullptr, nullptr, x, nullptr, w, b, int(N), C, s);
      }
      float* scale_from = half_amax(dev, again, int64_t(n));
      struct Outputs {
        uint8_t *out, *out_t;
        float* inv;
        uint64_t* saturated;
      };
      const auto outputs = [&] {
        return Outputs{dev.poisoned_codes(n), dev.poisoned_codes(n), dev.poisoned_floats(1), dev.zeroed_counter()};
      };
      const Outputs want = outputs(), got = outputs();
      gpu::fp8_cast_both(want.out, want.out_t, want.inv, again, N, C, {scale_from}, Fp8Format::e4m3, want.saturated,
                         s);
      gpu::fp8_norm_recompute({got.out, got.out_t, got.inv, {scale_from}, Fp8Format::e4m3, got.saturated}, x, w, b,
                              rms ? nullptr : mean, rstd, N, C, s);
      expect_codes("as it lies", dev.get(want.out, n), dev.get(got.out, n + kGuard));
      expect_codes("transposed", dev.get(want.out_t, n), dev.get(got.out_t, n + kGuard));
      EXPECT_EQ(float_bits(dev.get_float(got.inv)), float_bits(dev.get_float(want.inv)));
      EXPECT_EQ(dev.get_count(got.saturated), dev.get_count(want.saturated));
      EXPECT_GT(dev.get_count(want.saturated), 0u) << "the half amax saturates values";
    }
}

// fp8_layernorm_forward's and fp8_rmsnorm_forward's codes, inverse scale, recorded amax and
// saturated count are those of the bf16 forward's output through fp8_cast, bit for bit, at
// a scale from half the output's amax; their residual sums and statistics are the bf16
// forward's bits. With and without the residual add, C below and above a warp's 256
// columns and off them, outputs poisoned first.
TEST(GpuFp8, NormForwardCodesAreTheCastsOfItsValues) {
  REQUIRE_DEVICE();
  uint64_t seed = 1400;
  for (const int kind : {0, 1, 2})  // LayerNorm with a bias, without, RMSNorm
    for (const bool add : {false, true})
      for (const auto& [N, C] : {std::pair<int, int>{1, 8}, {130, 72}, {9, 1000}, {300, 136}, {64, 2048}}) {
        const bool rms = kind == 2, with_bias = kind == 0;
        SCOPED_TRACE(std::string(rms ? "RMSNorm" : with_bias ? "LayerNorm" : "LayerNorm without bias") +
                     (add ? " with the residual add" : "") + " N=" + std::to_string(N) + " C=" + std::to_string(C));
        Dev dev;
        const size_t n = size_t(N) * C;
        const bf16* a = dev.put_bf16(random_bits(n, ++seed, 2.0, N == 130));
        const Bits b_bits = add ? random_bits(n, ++seed, 1.0) : Bits{};
        const bf16* b = add ? dev.put_bf16(b_bits) : nullptr;
        // b with a pending scale (a 2:4 fp8 product's output) for the producer, scaled in
        // place first (apply_pending_scale) for the bf16 kernel.
        const float* f = dev.put(VF{1.9f, 0.21f});
        const gpu::PendingScale b_scale = add ? gpu::PendingScale{f, f + 1} : gpu::PendingScale{};
        bf16* scaled_b = add ? dev.put_bf16(b_bits) : nullptr;
        gpu::apply_pending_scale(scaled_b, int64_t(add ? n : 0), b_scale, dev.stream());
        const bf16* w = dev.put_bf16(random_bits(size_t(C), ++seed, 1.5));
        const bf16* bias = with_bias ? dev.put_bf16(random_bits(size_t(C), ++seed, 0.5)) : nullptr;
        struct Outputs {
          bf16* res;
          float *mean, *rstd;
        };
        const auto outputs = [&] { return Outputs{dev.poisoned_bf16(n), dev.poisoned_floats(size_t(N)),
                                                  dev.poisoned_floats(size_t(N))}; };
        const Outputs want = outputs(), got = outputs();
        bf16* y = dev.poisoned_bf16(n);
        cudaStream_t s = dev.stream();
        if (rms)
          gpu::rmsnorm_forward(y, want.rstd, want.res, a, scaled_b, w, N, C, s);
        else
          gpu::layernorm_forward(y, want.mean, want.rstd, want.res, a, scaled_b, w, bias, N, C, s);
        float* scale_from = half_amax(dev, y, int64_t(n));
        uint8_t *want_codes = dev.poisoned_codes(n), *got_codes = dev.poisoned_codes(n);
        float *want_inv = dev.poisoned_floats(1), *got_inv = dev.poisoned_floats(1);
        float *want_record = dev.put(VF{0.0f}), *got_record = dev.put(VF{0.0f});
        uint64_t *want_sat = dev.zeroed_counter(), *got_sat = dev.zeroed_counter();
        gpu::fp8_cast(want_codes, want_inv, y, int64_t(n), {scale_from, want_record}, Fp8Format::e4m3, want_sat, s);
        const gpu::Fp8Target to{got_codes, nullptr, got_inv, {scale_from, got_record}, Fp8Format::e4m3, got_sat};
        if (rms)
          gpu::fp8_rmsnorm_forward(to, got.rstd, got.res, a, b, w, N, C, s, 1e-5f, b_scale);
        else
          gpu::fp8_layernorm_forward(to, got.mean, got.rstd, got.res, a, b, w, bias, N, C, s, 1e-5f, b_scale);
        expect_codes("the output", dev.get(want_codes, n), dev.get(got_codes, n + kGuard));
        EXPECT_EQ(float_bits(dev.get_float(got_inv)), float_bits(dev.get_float(want_inv)));
        EXPECT_EQ(float_bits(dev.get_float(got_record)), float_bits(dev.get_float(want_record)));
        EXPECT_EQ(dev.get_count(got_sat), dev.get_count(want_sat));
        EXPECT_GT(dev.get_count(want_sat), 0u) << "the half amax saturates values";
        const auto bits = [&](const float* p) {
          std::vector<uint32_t> r;
          for (const float f : dev.get(p, size_t(N))) r.push_back(float_bits(f));
          return r;
        };
        EXPECT_EQ(bits(got.rstd), bits(want.rstd));
        if (!rms) EXPECT_EQ(bits(got.mean), bits(want.mean));
        if (add) EXPECT_EQ(dev.get_bits(got.res, n), dev.get_bits(want.res, n));
      }
}

// The forward norms' fp8 producers refuse what they cannot write.
TEST(GpuFp8, NormForwardCodesRefuseBadArguments) {
  REQUIRE_DEVICE();
  Dev dev;
  const int N = 16, C = 64;
  const bf16* x = dev.put_bf16(random_bits(size_t(N) * C + 8, 5, 1.0));
  const bf16* w = dev.put_bf16(random_bits(size_t(C) + 8, 6, 1.0));
  float* rstd = dev.poisoned_floats(size_t(N));
  float* scale_from = dev.put(VF{1.0f});
  const auto target = [&](bool out_t, Fp8Format f) {
    const size_t m = size_t(N) * C + 8;
    return gpu::Fp8Target{dev.poisoned_codes(m), out_t ? dev.poisoned_codes(m) : nullptr, dev.poisoned_floats(1),
                          {scale_from}, f, nullptr};
  };
  const gpu::Fp8Target to = target(false, Fp8Format::e4m3);
  gpu::Fp8Target shifted = to;
  shifted.out += 4;
  cudaStream_t s = dev.stream();
  EXPECT_THROW(gpu::fp8_rmsnorm_forward(to, rstd, nullptr, x, nullptr, w, N, 60, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_rmsnorm_forward(to, rstd, nullptr, x + 1, nullptr, w, N, C, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_rmsnorm_forward(shifted, rstd, nullptr, x, nullptr, w, N, C, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_rmsnorm_forward(to, rstd, nullptr, x, x, w, N, C, s), esplag::Error);  // no residual_out
  EXPECT_THROW(gpu::fp8_rmsnorm_forward(target(true, Fp8Format::e4m3), rstd, nullptr, x, nullptr, w, N, C, s),
               esplag::Error);
  EXPECT_THROW(gpu::fp8_layernorm_forward(target(false, Fp8Format::e5m2), nullptr, rstd, nullptr, x, nullptr, w,
                                          nullptr, N, C, s),
               esplag::Error);
  EXPECT_NO_THROW(gpu::fp8_rmsnorm_forward(to, rstd, nullptr, x, nullptr, w, N, C, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
}

// fp8_norm_recompute refuses what it cannot read or write.
TEST(GpuFp8, NormRecomputeRefusesBadArguments) {
  REQUIRE_DEVICE();
  Dev dev;
  const int64_t N = 16;
  const int C = 64;
  const bf16* x = dev.put_bf16(random_bits(size_t(N) * C + 8, 3, 1.0));
  const bf16* w = dev.put_bf16(random_bits(size_t(C) + 8, 4, 1.0));
  float* stats = dev.put(VF(size_t(N), 1.0f));
  float* scale_from = dev.put(VF{1.0f});
  const gpu::Fp8Target to{dev.poisoned_codes(size_t(N) * C), nullptr, dev.poisoned_floats(1), {scale_from},
                          Fp8Format::e4m3, nullptr};
  cudaStream_t s = dev.stream();
  EXPECT_THROW(gpu::fp8_norm_recompute(to, x, w, nullptr, nullptr, stats, N, 60, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_norm_recompute(to, x + 1, w, nullptr, nullptr, stats, N, C, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_norm_recompute(to, x, w + 1, nullptr, nullptr, stats, N, C, s), esplag::Error);
  EXPECT_THROW(gpu::fp8_norm_recompute(to, x, w, w, nullptr, stats, N, C, s), esplag::Error);  // a bias, no mean
  EXPECT_THROW(gpu::fp8_norm_recompute(to, x, w, nullptr, nullptr, nullptr, N, C, s), esplag::Error);
  gpu::Fp8Target none = to;
  none.out = nullptr;
  EXPECT_THROW(gpu::fp8_norm_recompute(none, x, w, nullptr, nullptr, stats, N, C, s), esplag::Error);
  EXPECT_NO_THROW(gpu::fp8_norm_recompute(to, x, w, nullptr, nullptr, stats, N, C, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
}

// Delayed scaling's step end against core's history (model/fp8_amax_history.h): a few
// histories of three steps rolled five times, each step's amaxes random; the scale each
// step's casts read is the largest past amax, the step's amax restarts at 0.
TEST(GpuFp8, RollAmaxHistoriesMatchesTheHostRule) {
  REQUIRE_DEVICE();
  constexpr int kLength = 3, kCount = 5;
  Dev dev;
  float* d = dev.put(VF(size_t(kCount) * (kLength + 2), 0.0f));
  std::vector<esplag::Fp8AmaxHistory> host(kCount, esplag::Fp8AmaxHistory(kLength));
  Rng rng(7);
  for (int step = 0; step < 5; ++step) {
    VF all = dev.get(d, size_t(kCount) * (kLength + 2));
    for (int i = 0; i < kCount; ++i) {
      const float a = static_cast<float>(std::fabs(rng.normal()) * (step + 1));
      all[size_t(i) * (kLength + 2)] = a;  // the step's amax, as the casts record it
      host[size_t(i)].record(esplag::ProductOperand::input, a);
      host[size_t(i)].roll();
    }
    CUDA_CHECK(cudaMemcpy(d, all.data(), sizeof(float) * all.size(), cudaMemcpyHostToDevice));
    gpu::fp8_roll_amax_histories(d, kCount, kLength, dev.stream());
    const VF got = dev.get(d, all.size());
    for (int i = 0; i < kCount; ++i) {
      const float* h = got.data() + size_t(i) * (kLength + 2);
      const std::vector<float> want = host[size_t(i)].values();  // X's: current, then the past
      EXPECT_EQ(h[0], 0.0f) << "step " << step << " history " << i;
      EXPECT_EQ(h[1], host[size_t(i)].scale_amax(esplag::ProductOperand::input)) << "step " << step;
      for (int k = 0; k < kLength; ++k) EXPECT_EQ(h[2 + k], want[size_t(1 + k)]) << "step " << step << " past " << k;
    }
  }
}

// One scale per row: rows of very different magnitudes, a zero row, a row with NaN and
// infinities; aligned and (shifted by one element) unaligned inputs.
TEST(GpuFp8, CastRowsBitExact) {
  REQUIRE_DEVICE();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1}, {3, 17}, {5, 4097}, {64, 64}, {33, 1024}, {7, 8}};
  uint64_t seed = 300;
  for (const Fp8Format f : kFormats)
    for (const auto& [rows, cols] : shapes)
      for (const size_t first : {size_t(0), size_t(1)}) {
        Dev dev;
        const size_t n = size_t(rows * cols);
        Bits x = random_bits(n + first, ++seed, 1.0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            uint16_t& b = x[first + size_t(r * cols + c)];
            b = esplag::float_to_bf16(value(b) * std::ldexp(1.0f, int(r % 9) * 6 - 24));
            if (r == 1) b = 0;                                        // a zero row
            if (r == 2 && c % 5 == 0) b = c % 10 ? 0x7F80 : 0x7FC0;  // +inf and NaN
          }
        const std::string what =
            to_string(f) + " " + std::to_string(rows) + "x" + std::to_string(cols) + " first=" + std::to_string(first);
        const bf16* dx = dev.put_bf16(x) + first;
        float* inv = dev.poisoned_floats(size_t(rows));
        float* amax = dev.poisoned_floats(size_t(rows));
        uint8_t* out = dev.poisoned_codes(n + 1) + first;
        uint64_t* sat = dev.zeroed_counter();
        gpu::fp8_cast_rows(out, inv, amax, dx, rows, cols, f, sat, dev.stream());
        const VF got_inv = dev.get(inv, size_t(rows)), got_amax = dev.get(amax, size_t(rows));
        Codes want;
        uint64_t want_sat = 0;
        for (int64_t r = 0; r < rows; ++r) {
          const size_t row0 = first + size_t(r * cols);
          const float a = cpu_amax(x, row0, size_t(cols));
          const float s = esplag::fp8_scale(a, f);
          const Expected e = cpu_cast(x, row0, size_t(cols), s, f);
          want.insert(want.end(), e.codes.begin(), e.codes.end());
          want_sat += e.saturated;
          EXPECT_EQ(float_bits(got_amax[size_t(r)]), float_bits(a)) << what << ": amax of row " << r;
          EXPECT_EQ(float_bits(got_inv[size_t(r)]), float_bits(1.0f / s)) << what << ": inverse scale of row " << r;
        }
        expect_codes(what, want, dev.get(out, n + kGuard));
        EXPECT_EQ(dev.get_count(sat), want_sat) << what;
      }
}

// ---------------------------------------------------------------------------------------
// GEMMs

// An fp8 operand made on the device from bf16 values by fp8_amax + fp8_cast (or
// fp8_cast_transpose of x [rows, cols] when transposed), and its codes and inverse scale
// brought back for the reference.
struct Operand {
  gpu::Fp8Operand dev;
  Codes codes;
  float inv_scale = 0;
};

Operand make_operand(Dev& dev, const Bits& x, int64_t rows, int64_t cols, Fp8Format f, bool transposed) {
  const size_t n = size_t(rows * cols);
  const bf16* dx = dev.put_bf16(x);
  float* amax = dev.poisoned_floats(1);
  float* inv = dev.poisoned_floats(1);
  uint8_t* out = dev.poisoned_codes(n);
  gpu::fp8_amax(amax, dx, int64_t(n), dev.stream());
  if (transposed)
    gpu::fp8_cast_transpose(out, inv, dx, rows, cols, amax, f, nullptr, dev.stream());
  else
    gpu::fp8_cast(out, inv, dx, int64_t(n), amax, f, nullptr, dev.stream());
  Operand o;
  o.dev = {out, inv, f};
  o.codes = dev.get(out, n);
  o.inv_scale = dev.get_float(inv);
  return o;
}

// The dequantised values of an operand.
VD dequantised(const Operand& o) {
  VD v(o.codes.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = double(esplag::fp8_decode(o.codes[i], o.dev.format)) * o.inv_scale;
  return v;
}

// The reference of D[i, j] = Σ_k a[i, k] b[j, k] (+ c0 + bias[j]) and the magnitude of its terms.
struct RefElem {
  double ref = 0, terms = 0;
};
RefElem ref_elem(const VD& a, const VD& b, int64_t i, int64_t j, int64_t K) {
  RefElem e;
  for (int64_t k = 0; k < K; ++k) {
    const double t = a[size_t(i * K + k)] * b[size_t(j * K + k)];
    e.ref += t;
    e.terms += std::fabs(t);
  }
  return e;
}

// The tolerance rule of the header comment over the listed elements.
struct Check {
  double rel_out;  // 2^-8 (bf16 out) or 2^-20 (fp32 out)
  double ss_err = 0, ss_ref = 0;
  int bad = 0;
  size_t count = 0;
  void add(const std::string& what, size_t idx, double got, double ref, double terms) {
    const double tol = rel_out * std::fabs(ref) + std::ldexp(terms, -10);
    const double err = std::fabs(got - ref);
    ss_err += err * err;
    ss_ref += ref * ref;
    ++count;
    if (!(err <= tol) && ++bad <= 5)
      ADD_FAILURE() << what << ": D[" << idx << "] = " << got << ", reference " << ref << " (tolerance " << tol << ")";
  }
  void finish(const std::string& what) const {
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << count << " elements outside the tolerance";
    EXPECT_GT(ss_ref, 0) << what << ": the reference is all zero";
    EXPECT_LE(std::sqrt(ss_err / ss_ref), 1e-2) << what << ": relative RMS error";
  }
};

struct GemmCase {
  int M, N, K;
  Fp8Format fa, fb;
  bool bias, accumulate, f32_out, fast_accum;
};

std::string case_text(const GemmCase& c) {
  return std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K) + " " + to_string(c.fa) + "*" +
         to_string(c.fb) + (c.bias ? " bias" : "") + (c.accumulate ? " accumulate" : "") +
         (c.f32_out ? " fp32-out" : " bf16-out") + (c.fast_accum ? " fast-accum" : "");
}

// Where a case puts the pointers whose alignment cuBLASLt's heuristic reads (by default
// each in its own 256-byte aligned allocation).
struct PointerLayout {
  bool packed_scales = false;  // both inverse scales in one buffer, 4-byte aligned, as the bench keeps them
  int bias_shift = 0;          // the bias this many elements past a 256-byte boundary
};

// Runs one case with D checked in full, or at `samples` random elements when samples > 0
// (then every element is still checked to be finite), on `shared` (null: a Gemm of its own).
void run_gemm_case(const GemmCase& c, uint64_t seed, size_t arena_bytes, size_t samples = 0,
                   const PointerLayout& layout = {}, gpu::Fp8Gemm* shared = nullptr) {
  Dev dev(arena_bytes);
  const std::string what = case_text(c);
  const Bits a_bits = random_bits(size_t(c.M) * c.K, seed, 1.0);
  const Bits b_bits = random_bits(size_t(c.N) * c.K, seed + 1, 0.05);
  Operand A = make_operand(dev, a_bits, c.M, c.K, c.fa, false);
  Operand B = make_operand(dev, b_bits, c.N, c.K, c.fb, false);
  if (layout.packed_scales) {
    float* scales = dev.poisoned_floats(4);
    CUDA_CHECK(cudaMemcpy(scales + 1, A.dev.inv_scale, sizeof(float), cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaMemcpy(scales + 3, B.dev.inv_scale, sizeof(float), cudaMemcpyDeviceToDevice));
    A.dev.inv_scale = scales + 1;
    B.dev.inv_scale = scales + 3;
  }
  const Bits bias_bits = random_bits(size_t(c.N), seed + 2, 1.0);
  Bits shifted_bias(size_t(layout.bias_shift), 0);
  shifted_bias.insert(shifted_bias.end(), bias_bits.begin(), bias_bits.end());
  const bf16* bias = c.bias ? dev.put_bf16(shifted_bias) + layout.bias_shift : nullptr;
  const size_t nd = size_t(c.M) * c.N;
  // D before the call: random (accumulate) or poisoned.
  const Bits d0_bits = c.accumulate ? random_bits(nd, seed + 3, 1.0) : Bits{};
  VF d0(nd, 0.0f);
  void* D = dev.scratch(nd * 4, "D");
  if (c.accumulate) {
    for (size_t i = 0; i < nd; ++i) d0[i] = value(d0_bits[i]);
    if (c.f32_out)
      CUDA_CHECK(cudaMemcpy(D, d0.data(), nd * 4, cudaMemcpyHostToDevice));
    else
      CUDA_CHECK(cudaMemcpy(D, d0_bits.data(), nd * 2, cudaMemcpyHostToDevice));
  } else {
    CUDA_CHECK(cudaMemset(D, 0xFF, nd * 4));
  }
  std::unique_ptr<gpu::Fp8Gemm> own;
  if (!shared) own = std::make_unique<gpu::Fp8Gemm>(dev.scratch(size_t(32) << 20, "workspace"), size_t(32) << 20);
  gpu::Fp8Gemm& gemm = shared ? *shared : *own;
  gemm.set_fast_accum(c.fast_accum);
  if (c.f32_out)
    gemm.matmul(static_cast<float*>(D), A.dev, B.dev, c.M, c.N, c.K, c.accumulate, dev.stream());
  else
    gemm.matmul(static_cast<bf16*>(D), A.dev, B.dev, bias, c.M, c.N, c.K, c.accumulate, dev.stream());
  VF got;
  if (c.f32_out)
    got = dev.get(static_cast<const float*>(D), nd);
  else
    got = dev.get_bf16(static_cast<const bf16*>(D), nd);
  size_t first_bad = 0;
  ASSERT_EQ(esplag::gpu_test::count_non_finite(got, &first_bad), 0u) << what << ": first at " << first_bad;

  const VD a = dequantised(A), b = dequantised(B);
  Check check{c.f32_out ? std::ldexp(1.0, -20) : std::ldexp(1.0, -8)};
  auto check_elem = [&](int64_t i, int64_t j) {
    RefElem e = ref_elem(a, b, i, j, c.K);
    const size_t idx = size_t(i * c.N + j);
    const double extra = double(d0[idx]) + (c.bias ? double(value(bias_bits[size_t(j)])) : 0.0);
    e.ref += extra;
    e.terms += std::fabs(extra);
    check.add(what, idx, got[idx], e.ref, e.terms);
  };
  if (samples == 0) {
    for (int64_t i = 0; i < c.M; ++i)
      for (int64_t j = 0; j < c.N; ++j) check_elem(i, j);
  } else {
    Rng rng(seed + 4);
    for (size_t s = 0; s < samples; ++s) check_elem(rng.below(uint32_t(c.M)), rng.below(uint32_t(c.N)));
    check_elem(0, 0);
    check_elem(c.M - 1, c.N - 1);
  }
  check.finish(what);
}

TEST(GpuFp8, GemmMatchesDequantizedProduct) {
  REQUIRE_FP8_GEMM();
  const Fp8Format e4 = Fp8Format::e4m3, e5 = Fp8Format::e5m2;
  const std::vector<GemmCase> cases = {
      {48, 80, 64, e4, e4, false, false, false, false},   {48, 80, 64, e5, e4, false, false, false, false},
      {48, 80, 64, e4, e5, false, false, false, false},   {48, 80, 64, e4, e4, true, false, false, false},
      {80, 48, 112, e4, e4, false, true, false, false},   {48, 80, 64, e5, e4, false, false, true, false},
      {64, 48, 80, e4, e5, false, true, true, false},     {48, 80, 64, e4, e4, true, false, false, true},
      {16, 16, 16, e4, e4, false, false, false, false},   {0, 16, 16, e4, e4, false, false, false, false},
  };
  uint64_t seed = 400;
  for (const GemmCase& c : cases) {
    if (c.M == 0) {  // nothing to do, nothing written
      Dev dev(size_t(64) << 20);
      gpu::Fp8Gemm gemm(dev.scratch(size_t(32) << 20), size_t(32) << 20);
      const Operand B = make_operand(dev, random_bits(256, seed, 1.0), 16, 16, c.fb, false);
      bf16* D = dev.poisoned_bf16(16);
      gemm.matmul(D, B.dev, B.dev, nullptr, 0, c.N, c.K, false, dev.stream());
      for (const float v : dev.get_bf16(D, 16)) EXPECT_TRUE(std::isnan(v)) << "M=0 wrote D";
      continue;
    }
    run_gemm_case(c, seed += 10, size_t(128) << 20);
  }
}

// The first product `esplag bench gemm --fp8-dense` times (shape 8192x2048x16384 forward:
// M = 16384 tokens, N = 8192, K = 2048), in both accumulation modes.
TEST(GpuFp8, GemmBenchProblem) {
  REQUIRE_FP8_GEMM();
  for (const bool fast : {false, true})
    run_gemm_case({16384, 8192, 2048, Fp8Format::e4m3, Fp8Format::e4m3, false, false, false, fast}, 520,
                  size_t(800) << 20, 4096);
}

// The heuristic reads the alignment of the bias, so a plan serves only calls whose bias is
// aligned as that of the call that made it; scale pointers that are not 16-byte aligned
// (which cuBLASLt's fp8 kernels refuse) are one Error.
TEST(GpuFp8, GemmPlanPerPointerAlignment) {
  REQUIRE_FP8_GEMM();
  Dev ws(size_t(40) << 20);
  gpu::Fp8Gemm gemm(ws.scratch(size_t(32) << 20), size_t(32) << 20);
  const GemmCase c{48, 80, 64, Fp8Format::e4m3, Fp8Format::e4m3, true, false, false, false};
  run_gemm_case(c, 700, size_t(64) << 20, 0, {}, &gemm);
  EXPECT_EQ(gemm.cached_plans(), 1u);
  run_gemm_case(c, 710, size_t(64) << 20, 0, {}, &gemm);  // aligned as before: the same plan
  EXPECT_EQ(gemm.cached_plans(), 1u);
  run_gemm_case(c, 720, size_t(64) << 20, 0, {.bias_shift = 8}, &gemm);  // a 16-byte aligned bias
  EXPECT_EQ(gemm.cached_plans(), 2u);
  try {
    run_gemm_case(c, 730, size_t(64) << 20, 0, {.packed_scales = true}, &gemm);  // 4-byte aligned scales
    ADD_FAILURE() << "4-byte aligned scale pointers were taken";
  } catch (const esplag::Error& e) {
    EXPECT_NE(std::string(e.what()).find("inverse scales must be 16-byte aligned"), std::string::npos) << e.what();
  }
}

// A large product, the size of an LLM's MLP GEMM, checked at sampled elements.
TEST(GpuFp8, GemmLargeSampled) {
  REQUIRE_FP8_GEMM();
  run_gemm_case({2048, 5632, 8192, Fp8Format::e4m3, Fp8Format::e4m3, true, false, false, false}, 500,
                size_t(640) << 20, 4096);
  run_gemm_case({2048, 5632, 8192, Fp8Format::e5m2, Fp8Format::e4m3, false, false, true, false}, 510,
                size_t(640) << 20, 4096);
}

// The three products of a Linear W [OC, C] on X [N, C] and dY [N, OC], with the operands
// made as fp8 training will make them (transposed casts for the backward), against the
// same products of core's fp8_quantize_dequantize of the bf16 tensors (per-tensor scales):
// the GPU's casts, layout contract and scale pointers together match the CPU emulation.
TEST(GpuFp8, LinearProductsMatchCpuEmulation) {
  REQUIRE_FP8_GEMM();
  const int N = 80, C = 48, OC = 64;
  Dev dev(size_t(128) << 20);
  const Bits x = random_bits(size_t(N) * C, 600, 1.0), w = random_bits(size_t(OC) * C, 601, 0.1),
             dy = random_bits(size_t(N) * OC, 602, 1e-3);
  auto emulated = [](const Bits& bits, Fp8Format f) {
    VF v(bits.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = value(bits[i]);
    EXPECT_EQ(esplag::fp8_quantize_dequantize(v.data(), v.data(), int64_t(v.size()), f), 0);
    return v;
  };
  const Fp8Format g = Fp8Format::e5m2, e4 = Fp8Format::e4m3;
  const VF xq = emulated(x, e4), wq = emulated(w, e4), dyq = emulated(dy, g);
  gpu::Fp8Gemm gemm(dev.scratch(size_t(32) << 20), size_t(32) << 20);

  struct Product {
    std::string name;
    Operand A, B;
    int M, Nn, K;
    VD ref, terms;
  };
  auto product = [&](const std::string& name, const Operand& A, const Operand& B, int M, int Nn, int K,
                     auto&& a_at, auto&& b_at) {
    Product p{name, A, B, M, Nn, K, VD(size_t(M) * Nn), VD(size_t(M) * Nn)};
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < Nn; ++j)
        for (int k = 0; k < K; ++k) {
          const double t = double(a_at(i, k)) * double(b_at(j, k));
          p.ref[size_t(i) * Nn + j] += t;
          p.terms[size_t(i) * Nn + j] += std::fabs(t);
        }
    return p;
  };
  const std::vector<Product> products = {
      // Y [N, OC] = X · Wᵀ
      product("forward", make_operand(dev, x, N, C, e4, false), make_operand(dev, w, OC, C, e4, false), N, OC, C,
              [&](int n, int c) { return xq[size_t(n) * C + c]; }, [&](int o, int c) { return wq[size_t(o) * C + c]; }),
      // dX [N, C] = dY · W, B = Wᵀ [C, OC]
      product("backward data", make_operand(dev, dy, N, OC, g, false), make_operand(dev, w, OC, C, e4, true), N, C,
              OC, [&](int n, int o) { return dyq[size_t(n) * OC + o]; },
              [&](int c, int o) { return wq[size_t(o) * C + c]; }),
      // dW [OC, C] = dYᵀ · X, A = dYᵀ [OC, N], B = Xᵀ [C, N]
      product("backward weight", make_operand(dev, dy, N, OC, g, true), make_operand(dev, x, N, C, e4, true), OC, C,
              N, [&](int o, int n) { return dyq[size_t(n) * OC + o]; },
              [&](int c, int n) { return xq[size_t(n) * C + c]; }),
  };
  for (const Product& p : products) {
    float* D = dev.poisoned_floats(size_t(p.M) * p.Nn);
    gemm.matmul(D, p.A.dev, p.B.dev, p.M, p.Nn, p.K, false, dev.stream());
    const VF got = dev.get(D, size_t(p.M) * p.Nn);
    Check check{std::ldexp(1.0, -20)};
    for (size_t i = 0; i < got.size(); ++i) check.add(p.name, i, got[i], p.ref[i], p.terms[i]);
    check.finish(p.name);
  }
}

TEST(GpuFp8, GemmRefusesUnsupportedProblems) {
  REQUIRE_DEVICE();
  Dev dev(size_t(64) << 20);
  gpu::Fp8Gemm gemm(dev.scratch(size_t(32) << 20), size_t(32) << 20);
  auto* codes = static_cast<uint8_t*>(dev.scratch(4096));
  float* inv = dev.put(VF{1.0f});
  bf16* D = dev.poisoned_bf16(4096);
  const gpu::Fp8Operand e4{codes, inv, Fp8Format::e4m3}, e5{codes, inv, Fp8Format::e5m2};
  auto expect_error = [&](const std::string& what, const std::string& needle, auto&& call) {
    try {
      call();
      ADD_FAILURE() << what << ": no error";
    } catch (const esplag::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  expect_error("K=40", "multiples of 16", [&] { gemm.matmul(D, e4, e4, nullptr, 16, 16, 40, false, dev.stream()); });
  expect_error("N=24", "multiples of 16", [&] { gemm.matmul(D, e4, e4, nullptr, 16, 24, 16, false, dev.stream()); });
  expect_error("M=8", "multiples of 16", [&] { gemm.matmul(D, e4, e4, nullptr, 8, 16, 16, false, dev.stream()); });
  expect_error("e5m2 x e5m2", "e5m2 x e5m2", [&] { gemm.matmul(D, e5, e5, nullptr, 16, 16, 16, false, dev.stream()); });
  const gpu::Fp8Operand shifted{codes + 1, inv, Fp8Format::e4m3};
  expect_error("misaligned A", "16-byte aligned",
               [&] { gemm.matmul(D, shifted, e4, nullptr, 16, 16, 16, false, dev.stream()); });
  const bf16* bias = dev.poisoned_bf16(16);
  expect_error("bias with accumulate", "bias together with accumulate",
               [&] { gemm.matmul(D, e4, e4, bias, 16, 16, 16, true, dev.stream()); });
  EXPECT_EQ(gemm.cached_plans(), 0u);
}

}  // namespace
