// SLoPe's optimizer side on the GPU (sparse/cuda/sparse_adamw.h) against the CPU references:
// cpu::adamw_step restricted to the kept values, cpu::global_grad_norm_squared over them,
// and the double pruning of sparse/double_prune.h + SlopeLinear (model/linear_slope.h).
//
// Inputs are fresh seeded random values; outputs the kernels overwrite are poisoned with
// NaN (all bytes 0xFF) first; the gradient is NaN at every pruned position, so a kernel that
// reads a pruned entry into its result fails. Shapes include the smallest legal ones,
// non-square ones and cols not a multiple of 16 (a partly used metadata word per row).
//
// Tolerances, stated:
// - AdamW state (master, m, v) against cpu::adamw_step in fp64 on the same inputs: the
//   kernel computes in fp32, so per element |gpu - ref| <= 2^-18 |ref| + 2^-20 max|ref|
//   (64 fp32 ulps of the value, plus 16 ulps of the tensor's largest value for m, whose
//   update can cancel). A wrong term (weight decay, bias correction, clip factor, a wrong
//   slot) is off by 1e-4 relative or more.
// - bf16 outputs: bit-exact bf16(master) of the GPU's own master (rounded in the same pass).
// - Gradient-norm contribution: |gpu - ref| <= 1e-5 ref (fp32 sums of short ranges, added
//   in fp64), and bit-identical between two runs.
// - Backward copy (refresh / refill): metadata and bf16 values bit-identical to the CPU's.
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
#include "model/linear_kinds.h"
#include "model/linear_slope.h"
#include "ops/adamw.h"
#include "sparse/compressed.h"
#include "sparse/cuda/sparse_adamw.h"
#include "bench/lib/sparse_adamw.h"
#include "sparse/double_prune.h"
#include "sparse/masks.h"

#include "gpu_test_util.h"

namespace {

using esplag::Compressed24;
using esplag::DeviceArena;
using esplag::Rng;
using esplag::gpu::bf16;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;
namespace ld = esplag::linear_detail;

using esplag::gpu_test::Bits;
using esplag::gpu_test::has_device;
using esplag::gpu_test::round_bf16;
using esplag::gpu_test::to_double;
using esplag::gpu_test::VD;
using esplag::gpu_test::VF;

class GpuSparseAdamW : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"; }
};

// ---------------------------------------------------------------------------------------
// Device buffers, all from one arena per test

class Dev : public esplag::gpu_test::DeviceBuffers {
 public:
  Dev() : DeviceBuffers(size_t(256) << 20) {}
  // Overwrites a buffer once the stream's work is done. (Poisoned outputs are all bytes
  // 0xFF: NaN as bf16 and fp32, 0xFFFF as metadata, not a valid nibble anywhere.)
  template <typename T>
  void set(T* d, const std::vector<T>& h) {
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
};

// ---------------------------------------------------------------------------------------
// Host data

VF normal(size_t n, uint64_t seed, double scale) { return esplag::gpu_test::random_f32(n, seed, scale); }

Bits to_bits(const VF& v) {
  Bits b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = esplag::float_to_bf16(v[i]);
  return b;
}

// A SLoPe forward weight: W pruned row-wise 2:4 and compressed as SlopeLinear does.
struct Forward {
  std::vector<uint8_t> mask;  // [rows, cols]
  Compressed24 w1;            // values [rows, cols/2], meta [rows, ceil(cols/16)]
};

Forward make_forward(const VF& w, int64_t rows, int64_t cols) {
  Forward f;
  f.mask = cpu::nm_mask(w.data(), rows, cols, 2, 4);
  f.w1 = ld::compress_24_masked(w.data(), f.mask.data(), rows, cols, "test.weight");
  return f;
}

// The kept entries of a dense [rows, cols] matrix in the compressed order of c.
VF kept_of(const VF& dense, const Compressed24& c) {
  VF out(size_t(c.rows * c.cols / 2));
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t g = 0; g < c.cols / 4; ++g)
      for (int j = 0; j < 2; ++j) out[r * c.cols / 2 + 2 * g + j] = dense[r * c.cols + c.column(r, g, j)];
  return out;
}

// A dense gradient whose pruned entries are NaN.
VF gradient_with_nan_outside(const std::vector<uint8_t>& mask, uint64_t seed) {
  VF g = normal(mask.size(), seed, 1.0);
  for (size_t i = 0; i < g.size(); ++i)
    if (!mask[i]) g[i] = std::nanf("");
  return g;
}

// ---------------------------------------------------------------------------------------
// Comparison

constexpr double kRel = 1.0 / (1 << 18), kAbs = 1.0 / (1 << 20);

void expect_close_fp32(const std::string& what, const VD& ref, const VF& got) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  double maxabs = 0;
  for (double r : ref) maxabs = std::max(maxabs, std::fabs(r));
  size_t bad = 0, first = 0;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(double(got[i]) - ref[i]), tol = kRel * std::fabs(ref[i]) + kAbs * maxabs;
    const double ratio = std::isfinite(got[i]) ? d / std::max(tol, 1e-300) : INFINITY;
    worst = std::max(worst, ratio);
    if (!(ratio <= 1.0) && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << ref.size() << " elements off, first at " << first
                     << ": gpu " << got[first] << " vs ref " << ref[first] << " (worst error / tolerance " << worst
                     << ")";
}

// bf16 bits equal, NaN matching any NaN (the host and the device spell NaN differently).
void expect_same_bf16(const std::string& what, const Bits& ref, const Bits& got) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  auto is_nan = [](uint16_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x7Fu) != 0; };
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (ref[i] != got[i] && !(is_nan(ref[i]) && is_nan(got[i])) && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << ref.size() << " differ, first at " << first << ": gpu 0x"
                     << std::hex << got[first] << " vs cpu 0x" << ref[first];
}

void expect_same_meta(const std::string& what, const std::vector<uint16_t>& ref, const std::vector<uint16_t>& got) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (ref[i] != got[i] && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << ref.size() << " metadata words differ, first at " << first
                     << ": gpu 0x" << std::hex << got[first] << " vs cpu 0x" << ref[first];
}

// The bf16 copies an update writes: values = bf16(master) bit for bit; the dense copy holds
// them at the kept columns and +0 elsewhere.
void expect_bf16_copies(const Compressed24& c, const VF& master, const Bits& values, const Bits* dense) {
  const Bits want = to_bits(master);
  EXPECT_EQ(values, want) << "values_bf16 is not bf16(master)";
  if (!dense) return;
  Bits want_dense(size_t(c.rows * c.cols), 0);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t g = 0; g < c.cols / 4; ++g)
      for (int j = 0; j < 2; ++j) want_dense[r * c.cols + c.column(r, g, j)] = want[r * c.cols / 2 + 2 * g + j];
  EXPECT_EQ(*dense, want_dense) << "dense_bf16 is not the pruned bf16 weight";
}

// ---------------------------------------------------------------------------------------
// Fused sparse AdamW and the norm contribution, several steps

struct UpdateCase {
  int64_t rows, cols;
  bool bf16_grad, dense_out, device_scalars;
};

void run_update(const UpdateCase& k, uint64_t seed) {
  const int64_t R = k.rows, C = k.cols, n = R * C, h = n / 2;
  SCOPED_TRACE("[" + std::to_string(R) + ", " + std::to_string(C) + "] dW " + (k.bf16_grad ? "bf16" : "f32") +
               (k.dense_out ? " +dense" : "") + (k.device_scalars ? " lr/step on device" : " lr/step on host"));
  Dev dev;
  const Forward f = make_forward(normal(size_t(n), seed, 0.05), R, C);
  VF m0 = normal(size_t(h), seed + 1, 0.01), v0 = normal(size_t(h), seed + 2, 1e-4);
  for (float& x : v0) x = std::fabs(x);
  float* master = dev.put(f.w1.values, "master");
  float* m = dev.put(m0, "m");
  float* v = dev.put(v0, "v");
  const uint16_t* meta = dev.put(f.w1.meta, "meta");
  float* norm_sq = dev.poisoned<float>(1, "norm_sq");
  float* lr_dev = dev.poisoned<float>(1, "lr");
  int64_t* step_dev = dev.poisoned<int64_t>(1, "step");
  void* scratch = dev.scratch(gpu::sparse_grad_norm_scratch_bytes());
  float* dw32 = dev.poisoned<float>(size_t(n), "dW f32");
  bf16* dw16 = dev.poisoned_bf16(size_t(n), "dW bf16");

  VD rp = to_double(f.w1.values), rm = to_double(m0), rv = to_double(v0);
  const float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.5f;
  const float lrs[3] = {3e-3f, 1e-3f, 2e-3f};
  const int64_t first_step = 4;
  for (int s = 0; s < 3; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    VF g = gradient_with_nan_outside(f.mask, seed + 10 + s);
    if (k.bf16_grad) {
      g = round_bf16(g);
      dev.set(reinterpret_cast<uint16_t*>(dw16), to_bits(g));
    } else {
      dev.set(dw32, g);
    }
    const VF kept = kept_of(g, f.w1);
    const VD kept_d = to_double(kept);

    // Norm: other parameters' share already in the accumulator, this layer's added.
    const float base = 0.75f;
    dev.set(norm_sq, VF{base});
    if (k.bf16_grad)
      gpu::sparse_grad_norm_squared_add(norm_sq, dw16, meta, R, C, scratch, dev.stream());
    else
      gpu::sparse_grad_norm_squared_add(norm_sq, dw32, meta, R, C, scratch, dev.stream());
    const float norm_f = dev.get(norm_sq, 1)[0];
    const double norm_ref = double(base) + cpu::global_grad_norm_squared(kept_d.data(), h);
    EXPECT_NEAR(norm_f, norm_ref, 1e-5 * norm_ref);

    // Clipping active, inactive, disabled.
    const double norm = std::sqrt(double(norm_f));
    const float max_norm = s == 0 ? float(0.5 * norm) : (s == 1 ? float(10 * norm) : 0.f);
    gpu::SparseAdamWConfig cfg;
    cfg.beta1 = beta1;
    cfg.beta2 = beta2;
    cfg.eps = eps;
    cfg.weight_decay = wd;
    cfg.grad_scale = grad_scale;
    cfg.clip_norm_sq = norm_sq;
    cfg.max_grad_norm = max_norm;
    const int64_t t = first_step + s;
    if (k.device_scalars) {
      dev.set(lr_dev, VF{lrs[s]});
      dev.set(step_dev, std::vector<int64_t>{t});
      cfg.lr = -1.f;  // must be ignored
      cfg.step = 0;
      cfg.lr_device = lr_dev;
      cfg.step_device = step_dev;
    } else {
      cfg.lr = lrs[s];
      cfg.step = t;
    }
    bf16* values = dev.poisoned_bf16(size_t(h), "values_bf16");
    bf16* dense = k.dense_out ? dev.poisoned_bf16(size_t(n), "dense_bf16") : nullptr;
    if (k.bf16_grad)
      gpu::sparse_adamw_update(master, m, v, dw16, meta, R, C, values, dense, cfg, dev.stream());
    else
      gpu::sparse_adamw_update(master, m, v, dw32, meta, R, C, values, dense, cfg, dev.stream());

    const double scale = double(grad_scale) * cpu::clip_scale(norm, double(max_norm));
    cpu::adamw_step(rp.data(), kept_d.data(), rm.data(), rv.data(), h, double(lrs[s]), double(beta1), double(beta2),
                    double(eps), double(wd), t, scale);
    const VF gp = dev.get(master, size_t(h));
    expect_close_fp32("master", rp, gp);
    expect_close_fp32("m", rm, dev.get(m, size_t(h)));
    expect_close_fp32("v", rv, dev.get(v, size_t(h)));
    const Bits dense_bits = k.dense_out ? dev.get_bits(dense, size_t(n)) : Bits{};
    expect_bf16_copies(f.w1, gp, dev.get_bits(values, size_t(h)), k.dense_out ? &dense_bits : nullptr);
  }
}

TEST_F(GpuSparseAdamW, UpdateMatchesCpuSeveralSteps) {
  const std::vector<UpdateCase> cases = {
      {1, 4, false, false, false},   {4, 4, true, true, true},       {3, 20, false, true, true},
      {7, 36, true, false, false},   {37, 772, false, true, false},  {64, 1024, true, true, true},
      {130, 4100, false, false, true}, {260, 1028, false, true, true},
  };
  uint64_t seed = 1000;
  for (const auto& k : cases) run_update(k, seed += 100);
}

TEST_F(GpuSparseAdamW, NormMatchesCpuAndIsDeterministic) {
  // Up to several thousand groups per partial block and the full 1024 partials.
  const std::vector<std::array<int64_t, 2>> shapes = {{1, 4}, {3, 20}, {37, 772}, {1000, 1028}, {4096, 2052}};
  uint64_t seed = 5000;
  for (const auto& [R, C] : shapes)
    for (bool b16 : {false, true}) {
      SCOPED_TRACE("[" + std::to_string(R) + ", " + std::to_string(C) + "] " + (b16 ? "bf16" : "f32"));
      Dev dev;
      const Forward f = make_forward(normal(size_t(R * C), ++seed, 1.0), R, C);
      VF g = gradient_with_nan_outside(f.mask, ++seed);
      if (b16) g = round_bf16(g);
      const uint16_t* meta = dev.put(f.w1.meta, "meta");
      const float* dw32 = dev.put(g, "dW");
      const bf16* dw16 = reinterpret_cast<const bf16*>(dev.put(to_bits(g), "dW bf16"));
      void* scratch = dev.scratch(gpu::sparse_grad_norm_scratch_bytes());
      float* acc = dev.poisoned<float>(2, "norm_sq");
      const float base = 2.5f;
      dev.set(acc, VF{base, base});
      for (int run = 0; run < 2; ++run) {
        if (b16)
          gpu::sparse_grad_norm_squared_add(acc + run, dw16, meta, R, C, scratch, dev.stream());
        else
          gpu::sparse_grad_norm_squared_add(acc + run, dw32, meta, R, C, scratch, dev.stream());
      }
      const VF got = dev.get(acc, 2);
      const VD kept = to_double(kept_of(g, f.w1));
      const double ref = double(base) + cpu::global_grad_norm_squared(kept.data(), int64_t(kept.size()));
      EXPECT_NEAR(got[0], ref, 1e-5 * ref);
      uint32_t b0, b1;
      std::memcpy(&b0, &got[0], 4);
      std::memcpy(&b1, &got[1], 4);
      EXPECT_EQ(b0, b1) << "two runs on the same input differ";
      // Empty weight: adds nothing, touches nothing.
      gpu::sparse_grad_norm_squared_add(acc, dw32, meta, 0, C, scratch, dev.stream());
      EXPECT_EQ(dev.get(acc, 1)[0], got[0]);
    }
}

// A captured graph reads lr and step at replay: replays with new values written to device
// memory give the same bits as direct calls with those values.
TEST_F(GpuSparseAdamW, GraphReplayReadsLrAndStepFromDevice) {
  const int64_t R = 64, C = 96, h = R * C / 2;
  Dev dev;
  const Forward f = make_forward(normal(size_t(R * C), 71, 0.05), R, C);
  const VF g = gradient_with_nan_outside(f.mask, 72);
  const uint16_t* meta = dev.put(f.w1.meta, "meta");
  const float* dw = dev.put(g, "dW");
  const VF zeros(size_t(h), 0.f);
  float *pa = dev.put(f.w1.values), *ma = dev.put(zeros), *va = dev.put(zeros);
  float *pb = dev.put(f.w1.values), *mb = dev.put(zeros), *vb = dev.put(zeros);
  bf16* wa = dev.poisoned_bf16(size_t(h));
  bf16* wb = dev.poisoned_bf16(size_t(h));
  float* lr = dev.poisoned<float>(1);
  int64_t* step = dev.poisoned<int64_t>(1);
  gpu::SparseAdamWConfig cfg;
  cfg.weight_decay = 0.1f;
  cfg.lr_device = lr;
  cfg.step_device = step;

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(dev.stream(), cudaStreamCaptureModeThreadLocal));
  gpu::sparse_adamw_update(pa, ma, va, dw, meta, R, C, wa, nullptr, cfg, dev.stream());
  CUDA_CHECK(cudaStreamEndCapture(dev.stream(), &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int s = 1; s <= 3; ++s) {
    const float lr_s = 1e-3f * float(s);
    dev.set(lr, VF{lr_s});
    dev.set(step, std::vector<int64_t>{s});
    CUDA_CHECK(cudaGraphLaunch(exec, dev.stream()));
    gpu::SparseAdamWConfig direct = cfg;
    direct.lr_device = nullptr;
    direct.step_device = nullptr;
    direct.lr = lr_s;
    direct.step = s;
    gpu::sparse_adamw_update(pb, mb, vb, dw, meta, R, C, wb, nullptr, direct, dev.stream());
    EXPECT_EQ(dev.get(pa, size_t(h)), dev.get(pb, size_t(h))) << "step " << s;
    EXPECT_EQ(dev.get_bits(wa, size_t(h)), dev.get_bits(wb, size_t(h))) << "step " << s;
  }
  EXPECT_NE(dev.get(pa, size_t(h)), f.w1.values);  // the replays did update
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(GpuSparseAdamW, DeviceStepBelowOneGivesNaN) {
  const int64_t R = 4, C = 8, h = R * C / 2;
  Dev dev;
  const Forward f = make_forward(normal(size_t(R * C), 81, 0.05), R, C);
  float* p = dev.put(f.w1.values);
  float* m = dev.put(VF(size_t(h), 0.f));
  float* v = dev.put(VF(size_t(h), 0.f));
  int64_t* step = dev.put(std::vector<int64_t>{0});
  gpu::SparseAdamWConfig cfg;
  cfg.lr = 1e-3f;
  cfg.step_device = step;
  gpu::sparse_adamw_update(p, m, v, dev.put(normal(size_t(R * C), 82, 1.0)), dev.put(f.w1.meta), R, C,
                           dev.poisoned_bf16(size_t(h)), nullptr, cfg, dev.stream());
  for (float x : dev.get(p, size_t(h))) EXPECT_TRUE(std::isnan(x));
}

TEST_F(GpuSparseAdamW, BadArgumentsThrow) {
  using esplag::Error;
  Dev dev;
  float* buf = dev.put(VF(64, 1.f));
  const uint16_t* meta = dev.put(std::vector<uint16_t>(16, 0x44));
  bf16* out = dev.poisoned_bf16(64);
  void* scratch = dev.scratch(gpu::sparse_grad_norm_scratch_bytes());
  gpu::SparseAdamWConfig cfg;
  cfg.lr = 1e-3f;
  auto msg = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  auto has = [](const std::string& s, const char* w) { return s.find(w) != std::string::npos; };
  EXPECT_TRUE(has(msg([&] { gpu::sparse_adamw_update(buf, buf, buf, buf, meta, 2, 6, out, nullptr, cfg, 0); }),
                  "cols % 4 == 0"));
  EXPECT_TRUE(has(msg([&] { gpu::sparse_adamw_update(buf, buf, buf, buf, nullptr, 2, 8, out, nullptr, cfg, 0); }),
                  "null buffer"));
  EXPECT_TRUE(has(msg([&] { gpu::sparse_adamw_update(buf, buf, buf, buf + 1, meta, 2, 8, out, nullptr, cfg, 0); }),
                  "misaligned"));
  gpu::SparseAdamWConfig bad = cfg;
  bad.step = 0;
  EXPECT_TRUE(has(msg([&] { gpu::sparse_adamw_update(buf, buf, buf, buf, meta, 2, 8, out, nullptr, bad, 0); }),
                  "1-based"));
  EXPECT_TRUE(has(msg([&] { gpu::sparse_grad_norm_squared_add(buf, buf, meta, 2, 10, scratch, 0); }),
                  "cols % 4 == 0"));
  EXPECT_TRUE(has(msg([&] { gpu::slope_backward_refresh(out, const_cast<uint16_t*>(meta), buf, meta, 6, 8, 0); }),
                  "multiples of 4"));
  EXPECT_TRUE(has(msg([&] { gpu::slope_backward_refill(out, nullptr, buf, meta, 4, 8, 0); }), "null buffer"));
}

// ---------------------------------------------------------------------------------------
// Double pruning: refresh and refill against the CPU

std::vector<uint8_t> transpose(const std::vector<uint8_t>& a, int64_t rows, int64_t cols) {
  std::vector<uint8_t> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}
VF transpose(const VF& a, int64_t rows, int64_t cols) {
  VF t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

// The CPU's backward copy of W1 (SlopeLinear::refresh_backward_mask / rebuild_backward_weight):
// W2ᵀ compressed [cols, rows], float values, and the backward mask [rows, cols].
struct Backward {
  Compressed24 w2t;
  std::vector<uint8_t> mask;
};

Backward cpu_backward(const Compressed24& w1, const std::vector<uint8_t>& fwd_mask) {
  const int64_t R = w1.rows, C = w1.cols;
  VF dense(size_t(R * C));
  ld::scatter(dense.data(), ld::slot_index(w1), w1.values.data());
  Backward b;
  b.mask = cpu::double_prune_backward_mask(dense.data(), fwd_mask.data(), R, C);
  b.w2t = ld::compress_24_masked(transpose(dense, R, C).data(), transpose(b.mask, R, C).data(), C, R, "test (backward)");
  return b;
}

// Values with many equal magnitudes (ties), zeros, and optionally NaN / ±inf.
VF awkward_values(size_t n, uint64_t seed, bool ties, bool specials) {
  Rng rng(seed);
  VF v(n);
  const float levels[5] = {0.f, 0.5f, 1.f, 2.f, 0.25f};
  for (float& x : v) {
    x = ties ? levels[rng.below(5)] * (rng.below(2) ? 1.f : -1.f) : static_cast<float>(rng.normal());
    if (specials) {
      const uint32_t u = rng.below(64);
      if (u == 0) x = std::nanf("");
      if (u == 1) x = INFINITY;
      if (u == 2) x = -INFINITY;
    }
  }
  return v;
}

void run_refresh(int64_t R, int64_t C, bool ties, bool specials, bool from_bf16, uint64_t seed) {
  SCOPED_TRACE("[" + std::to_string(R) + ", " + std::to_string(C) + "]" + (ties ? " ties" : "") +
               (specials ? " nan/inf" : "") + (from_bf16 ? " from bf16" : " from f32"));
  Dev dev;
  Forward f = make_forward(awkward_values(size_t(R * C), seed, ties, specials), R, C);
  if (from_bf16) f.w1.values = round_bf16(f.w1.values);  // the CPU ranks the same bf16 numbers
  const Backward ref = cpu_backward(f.w1, f.mask);
  const int64_t bstride = (R / 4 + 3) / 4;
  ASSERT_EQ(ref.w2t.meta.size(), size_t(C * bstride));
  const uint16_t* meta = dev.put(f.w1.meta, "meta");
  bf16* bvals = dev.poisoned_bf16(size_t(R * C / 2), "bwd values");
  uint16_t* bmeta = dev.poisoned<uint16_t>(size_t(C * bstride), "bwd meta");
  if (from_bf16)
    gpu::slope_backward_refresh(bvals, bmeta, reinterpret_cast<const bf16*>(dev.put(to_bits(f.w1.values))), meta, R,
                                C, dev.stream());
  else
    gpu::slope_backward_refresh(bvals, bmeta, dev.put(f.w1.values), meta, R, C, dev.stream());
  const std::vector<uint16_t> got_meta = dev.get(bmeta, ref.w2t.meta.size());
  expect_same_meta("refresh metadata", ref.w2t.meta, got_meta);
  expect_same_bf16("refresh values", to_bits(ref.w2t.values), dev.get_bits(bvals, size_t(R * C / 2)));

  // Refill: new W1 values under the same masks, the backward mask kept (SlopeLinear::sync).
  Compressed24 w1b = f.w1;
  w1b.values = normal(w1b.values.size(), seed + 1, 1.0);
  if (from_bf16) w1b.values = round_bf16(w1b.values);
  VF dense(size_t(R * C)), want(ref.w2t.values.size());
  ld::scatter(dense.data(), ld::slot_index(w1b), w1b.values.data());
  ld::gather(want.data(), ld::slot_index(ref.w2t), transpose(dense, R, C).data(), transpose(ref.mask, R, C).data());
  bf16* rvals = dev.poisoned_bf16(size_t(R * C / 2), "refill values");
  if (from_bf16)
    gpu::slope_backward_refill(rvals, bmeta, reinterpret_cast<const bf16*>(dev.put(to_bits(w1b.values))), meta, R, C,
                               dev.stream());
  else
    gpu::slope_backward_refill(rvals, bmeta, dev.put(w1b.values), meta, R, C, dev.stream());
  expect_same_bf16("refill values", to_bits(want), dev.get_bits(rvals, size_t(R * C / 2)));
  EXPECT_EQ(dev.get(bmeta, got_meta.size()), got_meta) << "refill changed the backward metadata";
}

TEST_F(GpuSparseAdamW, RefreshAndRefillBitIdenticalToCpu) {
  const std::vector<std::array<int64_t, 2>> shapes = {{4, 4},   {4, 8},    {8, 4},    {12, 20},  {20, 12},
                                                      {64, 64}, {68, 132}, {100, 772}, {772, 100}, {256, 512},
                                                      {80, 40}, {48, 200}};
  uint64_t seed = 9000;
  for (const auto& [R, C] : shapes) {
    run_refresh(R, C, false, false, false, ++seed);
    run_refresh(R, C, true, false, false, ++seed);
    run_refresh(R, C, false, true, false, ++seed);
    run_refresh(R, C, true, false, true, ++seed);
    run_refresh(R, C, false, false, true, ++seed);
  }
}

// ---------------------------------------------------------------------------------------
// The whole optimizer side of a SLoPe layer for several steps against SlopeLinear<float>:
// norm, fused AdamW (with the dense copy), and the backward copy refilled every step and
// refreshed every second step, as the CPU layer does with mask_change_freq = 2.

void run_slope_loop(int out, int in, uint64_t seed) {
  SCOPED_TRACE("slope [" + std::to_string(out) + ", " + std::to_string(in) + "]");
  const int64_t R = out, C = in, n = R * C, h = n / 2, bstride = (R / 4 + 3) / 4;
  VF weight = normal(size_t(n), seed, 0.05), dweight(size_t(n), 0.f);
  esplag::LinearParams<float> p;
  p.name = "blocks.0.mlp.fc.weight";
  p.module = "blocks.0.mlp.fc";
  p.layer = 0;
  p.in_features = in;
  p.out_features = out;
  p.weight = weight.data();
  p.dweight = dweight.data();
  esplag::SlopeLinear<float> layer(p, 2);
  const Compressed24& w1 = layer.forward_weight();
  const std::vector<uint8_t> fwd_mask = layer.forward_mask();

  Dev dev;
  float* master = dev.put(layer.values(), "master");
  float* m = dev.put(VF(size_t(h), 0.f), "m");
  float* v = dev.put(VF(size_t(h), 0.f), "v");
  const uint16_t* meta = dev.put(w1.meta, "meta");
  float* dw = dev.poisoned<float>(size_t(n), "dW");
  float* norm_sq = dev.poisoned<float>(1, "norm_sq");
  float* lr = dev.poisoned<float>(1, "lr");
  int64_t* step = dev.poisoned<int64_t>(1, "step");
  void* scratch = dev.scratch(gpu::sparse_grad_norm_scratch_bytes());
  bf16* bvals = dev.poisoned_bf16(size_t(h), "bwd values");
  uint16_t* bmeta = dev.poisoned<uint16_t>(size_t(C * bstride), "bwd meta");

  auto expect_backward_matches = [&](const std::string& what) {
    const auto& w2t = layer.backward_weight();
    expect_same_meta(what + " metadata", w2t.meta, dev.get(bmeta, w2t.meta.size()));
    expect_same_bf16(what + " values", to_bits(w2t.values), dev.get_bits(bvals, size_t(h)));
  };
  gpu::slope_backward_refresh(bvals, bmeta, master, meta, R, C, dev.stream());
  expect_backward_matches("initial backward copy");

  VD rp = to_double(layer.values()), rm(size_t(h), 0.0), rv(size_t(h), 0.0);
  gpu::SparseAdamWConfig cfg;
  cfg.weight_decay = 0.1f;
  cfg.clip_norm_sq = norm_sq;
  cfg.max_grad_norm = 1.0f;
  cfg.lr_device = lr;
  cfg.step_device = step;
  for (int s = 1; s <= 6; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const float lr_s = 2e-3f / float(s);
    dev.set(lr, VF{lr_s});
    dev.set(step, std::vector<int64_t>{s});
    const VF g = normal(size_t(n), seed + 100 + s, s == 3 ? 1e-4 : 1.0);  // step 3: below the clip norm
    dev.set(dw, g);
    CUDA_CHECK(cudaMemsetAsync(norm_sq, 0, sizeof(float), dev.stream()));
    gpu::sparse_grad_norm_squared_add(norm_sq, dw, meta, R, C, scratch, dev.stream());
    bf16* values = dev.poisoned_bf16(size_t(h), "values");
    bf16* dense = dev.poisoned_bf16(size_t(n), "dense");
    gpu::sparse_adamw_update(master, m, v, dw, meta, R, C, values, dense, cfg, dev.stream());

    const VD kept = to_double(kept_of(g, w1));
    const float norm_f = dev.get(norm_sq, 1)[0];
    const double norm_ref = cpu::global_grad_norm_squared(kept.data(), h);
    EXPECT_NEAR(norm_f, norm_ref, 1e-5 * norm_ref);
    cpu::adamw_step(rp.data(), kept.data(), rm.data(), rv.data(), h, double(lr_s), double(0.9f), double(0.95f), double(1e-8f),
                    double(0.1f), s, cpu::clip_scale(std::sqrt(double(norm_f)), 1.0));
    const VF gp = dev.get(master, size_t(h));
    expect_close_fp32("master", rp, gp);
    expect_close_fp32("m", rm, dev.get(m, size_t(h)));
    expect_close_fp32("v", rv, dev.get(v, size_t(h)));

    // The CPU layer continues from the GPU's values, so that its masks are computed from
    // the same numbers and must agree bit for bit.
    std::copy(gp.begin(), gp.end(), layer.values().begin());
    layer.on_step_begin(s);  // refresh when 2 steps have passed since the last one
    const bool refresh = s >= 2 && layer.refresh_step() == s;
    layer.after_optimizer_step();  // flat weight = W1, backward values from W1
    if (refresh)
      gpu::slope_backward_refresh(bvals, bmeta, master, meta, R, C, dev.stream());
    else
      gpu::slope_backward_refill(bvals, bmeta, values, meta, R, C, dev.stream());
    expect_backward_matches(refresh ? "refreshed backward copy" : "refilled backward copy");
    EXPECT_EQ(dev.get_bits(dense, size_t(n)), to_bits(weight)) << "dense bf16 W is not the CPU's flat weight";
    const std::vector<uint8_t> mask_now = layer.forward_mask();
    EXPECT_EQ(mask_now, fwd_mask) << "the forward mask must never change";
  }
}

TEST_F(GpuSparseAdamW, SlopeLayerSeveralSteps) {
  run_slope_loop(4, 4, 301);
  run_slope_loop(24, 40, 302);
  run_slope_loop(68, 100, 303);
  run_slope_loop(128, 64, 304);
}

// ---------------------------------------------------------------------------------------
// Timing (prints; no assertions on time)

TEST_F(GpuSparseAdamW, Timing) {
  const gpu::SparseAdamWBenchResult r = gpu::bench_sparse_adamw({{4096, 11008}, {2048, 5632}}, 5, 50);
  std::printf("%s", gpu::sparse_adamw_bench_table(r).c_str());
  std::printf("%s\n", gpu::sparse_adamw_bench_csv_header().c_str());
  for (const auto& row : r.rows) std::printf("%s\n", gpu::sparse_adamw_bench_csv_row(r, row).c_str());
  ASSERT_EQ(r.rows.size(), 16u);
  for (const auto& row : r.rows) EXPECT_TRUE(row.median_ms > 0 && std::isfinite(row.median_ms)) << row.op;
}

}  // namespace
