// Helpers shared by the GPU tests (tests/gpu_*.cu): the device check, seeded
// bf16-representable inputs, bf16 conversions, device buffers from one arena per test
// (uploads, outputs poisoned with NaN, downloads) and the error metrics of the accuracy
// rule (docs/architecture.md): the GPU's error against an fp64 CPU reference next to the error of
// the same computation done on the CPU in low precision.
#pragma once
#include <cuda_runtime.h>
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
#include "model/config.h"
#include "model/device_linear.h"
#include "model/gpu_transformer.h"
#include "model/linear_kinds.h"
#include "model/linear_slope.h"
#include "model/transformer.h"
#include "ops/adamw.h"
#include "ops/gpu.h"

namespace esplag::gpu_test {

using Bits = std::vector<uint16_t>;
using VF = std::vector<float>;
using VD = std::vector<double>;
using esplag::gpu::bf16;

inline bool has_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Whether the current device has fp8 tensor cores (compute capability 8.9 and up).
inline bool has_fp8_tensor_cores() {
  int dev = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return major * 10 + minor >= 89;
}

// The sparse GPU tests' LLaMA flavour (RMSNorm, RoPE, SwiGLU, GQA, untied, no bias), every
// Linear dimension a multiple of 32 (cuSPARSELt's rule for 8-bit operands): d_model 128,
// qkv 256, d_ff 352.
inline ModelConfig sparse_llama_config() {
  ModelConfig c = model_preset("llama-tiny");
  c.vocab_size = 384;
  c.n_layer = 2;
  c.d_model = 128;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.d_ff = 352;
  return c;
}

// ---------------------------------------------------------------------------------------
// Host data

inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }
inline VF round_bf16(VF v) {
  for (float& x : v) x = round_bf16(x);
  return v;
}

inline VF bits_to_float(const Bits& b) {
  VF v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = bf16_to_float(b[i]);
  return v;
}

inline VD to_double(const VF& v) { return VD(v.begin(), v.end()); }

// bf16-representable random values, in the three forms the tests need.
struct Data {
  Bits bits;
  VF f;
  VD d;
};

// One normal draw per element, in order: mean + scale * N(0, 1), rounded to bf16.
// (Rng::normal is never exactly zero, so mean 0 and scale 1 leave the draw unchanged.)
inline Data random_bf16(size_t n, uint64_t seed, double scale = 1.0, double mean = 0.0) {
  Rng rng(seed);
  Data out;
  out.bits.resize(n);
  out.f.resize(n);
  out.d.resize(n);
  for (size_t i = 0; i < n; ++i) {
    out.bits[i] = float_to_bf16(static_cast<float>(mean + scale * rng.normal()));
    out.f[i] = bf16_to_float(out.bits[i]);
    out.d[i] = out.f[i];
  }
  return out;
}

inline VF random_f32(size_t n, uint64_t seed, double scale = 1.0, double mean = 0.0) {
  Rng rng(seed);
  VF v(n);
  for (float& x : v) x = static_cast<float>(mean + scale * rng.normal());
  return v;
}

// ---------------------------------------------------------------------------------------
// One device block freed on scope exit, for tests whose buffers change from step to step.
struct DeviceBlock {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBlock(size_t b) : bytes(b) { CUDA_CHECK(cudaMalloc(&p, b)); }
  ~DeviceBlock() { cudaFree(p); }
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;
  bf16* bf() const { return static_cast<bf16*>(p); }
  float* f32() const { return static_cast<float*>(p); }
  void poison() const { CUDA_CHECK(cudaMemset(p, 0xFF, bytes)); }  // NaN as bf16 and as fp32
  void put(const void* host) const { CUDA_CHECK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice)); }
  template <typename T>
  std::vector<T> get() const {
    std::vector<T> v(bytes / sizeof(T));
    CUDA_CHECK(cudaMemcpy(v.data(), p, bytes, cudaMemcpyDeviceToHost));
    return v;
  }
};

// Device buffers, all from one arena per test, and the test's stream. Tests with other
// layouts (guard elements, misaligned pointers) derive and replace put / poisoned / get.

class DeviceBuffers {
 public:
  explicit DeviceBuffers(size_t bytes, const char* name = "test") : arena_(bytes, name) {
    CUDA_CHECK(cudaStreamCreate(&stream_));
  }
  ~DeviceBuffers() { cudaStreamDestroy(stream_); }
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  cudaStream_t stream() const { return stream_; }
  DeviceArena& arena() { return arena_; }

  template <typename T>
  T* put(const std::vector<T>& h, const char* name = "input") {
    T* d = arena_.allocate_array<T>(name, std::max<size_t>(h.size(), 1));
    CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  bf16* put_bf16(const Bits& h, const char* name = "input") { return reinterpret_cast<bf16*>(put(h, name)); }
  // All bytes 0xFF: NaN as bf16 and as fp32.
  template <typename T>
  T* poisoned(size_t n, const char* name = "output") {
    T* d = arena_.allocate_array<T>(name, std::max<size_t>(n, 1));
    CUDA_CHECK(cudaMemset(d, 0xFF, n * sizeof(T)));
    return d;
  }
  bf16* poisoned_bf16(size_t n, const char* name = "output") {
    return reinterpret_cast<bf16*>(poisoned<uint16_t>(n, name));
  }
  // Waits for the stream, then copies n values back.
  template <typename T>
  std::vector<T> get(const T* d, size_t n) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<T> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  Bits get_bits(const bf16* d, size_t n) { return get(reinterpret_cast<const uint16_t*>(d), n); }
  VF get_bf16(const bf16* d, size_t n) { return bits_to_float(get_bits(d, n)); }
  void* scratch(size_t bytes, const char* name = "scratch") {
    return arena_.allocate(name, std::max<size_t>(bytes, 1));
  }

 private:
  DeviceArena arena_;
  cudaStream_t stream_ = nullptr;
};

// ---------------------------------------------------------------------------------------
// Error metrics

struct Err {
  double rms = 0, max = 0;
};

// RMS and max of |x - ref| over ref's elements.
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

inline Err magnitude(const VD& ref) { return error_of(ref, VD(ref.size(), 0.0)); }

// The number of non-finite values in got (unwritten poison or NaN), and the first one's index.
inline size_t count_non_finite(const VF& got, size_t* first) {
  size_t bad = 0;
  *first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!std::isfinite(got[i]) && bad++ == 0) *first = i;
  return bad;
}

// C [M, Nn] = A [M, K] · B in fp64, with B given as [Nn, K] (transposed) when bt, else [K, Nn].
inline VD matmul_f64(const VF& a, const VF& b, int64_t M, int64_t K, int64_t Nn, bool bt) {
  VD c(size_t(M * Nn), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < Nn; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(a[i * K + k]) * double(bt ? b[j * K + k] : b[k * Nn + j]);
      c[i * Nn + j] = s;
    }
  return c;
}

inline VF transposed(const VF& a, int64_t rows, int64_t cols) {
  VF t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

// Every element within rel·|ref| + abs_frac·max|ref| (NaN fails; the first three misses
// are named), and the reference not all zero (the check would be vacuous).
inline void expect_close_to(const VF& got, const VD& ref, double rel, double abs_frac, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  double mx = 0;
  for (double r : ref) mx = std::max(mx, std::fabs(r));
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double tol = rel * std::fabs(ref[i]) + abs_frac * mx;
    if (!(std::fabs(double(got[i]) - ref[i]) <= tol) && ++bad <= 3)
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << ref[i] << " (tol " << tol << ")";
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " outside tolerance";
  EXPECT_GT(mx, 0) << what << ": the reference is all zero, the check would be vacuous";
}

// The accuracy rule of the op tests: against the fp64 reference, the GPU's RMS and max
// errors are within twice those of the CPU low-precision result `low`, with floors of 1e-6
// relative RMS (bf16 outputs; max: one bf16 ulp at the largest value) or 1e-5 (fp32
// outputs); bf16 outputs must also be within 1e-2 relative RMS.
inline void expect_within_low_precision(const std::string& what, const VD& ref, const VF& low, const VF& got,
                                        bool bf16_out, const char* low_name = "CPU low-precision") {
  ASSERT_EQ(ref.size(), got.size()) << what;
  ASSERT_EQ(ref.size(), low.size()) << what;
  size_t first_bad = 0;
  const size_t bad = count_non_finite(got, &first_bad);
  ASSERT_EQ(bad, 0u) << what << ": " << bad << " non-finite outputs (unwritten or NaN), first at " << first_bad;
  const Err eg = error_of(ref, got), el = error_of(ref, low), mag = magnitude(ref);
  const double floor_rms = (bf16_out ? 1e-6 : 1e-5) * mag.rms;
  const double floor_max = bf16_out ? mag.max / 256.0 : 1e-5 * mag.max;
  EXPECT_LE(eg.rms, std::max(2 * el.rms, floor_rms))
      << what << ": RMS error " << eg.rms << " vs " << low_name << " " << el.rms << " (|ref| rms " << mag.rms << ")";
  EXPECT_LE(eg.max, std::max(2 * el.max, floor_max))
      << what << ": max error " << eg.max << " vs " << low_name << " " << el.max << " (|ref| max " << mag.max << ")";
  if (bf16_out) EXPECT_LE(eg.rms, 1e-2 * mag.rms + 1e-30) << what << ": relative RMS error above 1e-2";
}

// The attention rule: bf16 output `got` against the fp64 reference, `low` the fp32 CPU
// result (rounded to bf16 here): relative RMS error at most 1e-2, max error at most 3x that
// of the rounded CPU result plus 2% of the largest value. The absolute floor covers
// gradients that are exactly 0 (a single position), which the kernels reproduce up to
// fp32 rounding of dP - delta. `width` pads the label in the printed line.
inline void expect_bf16_close(const std::string& what, const VD& ref, const VF& low, const VF& got, int width) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  size_t first_bad = 0;
  const size_t bad = count_non_finite(got, &first_bad);
  ASSERT_EQ(bad, 0u) << what << ": " << bad << " non-finite outputs (unwritten or NaN), first at " << first_bad;
  VF low_bf(low.size());
  for (size_t i = 0; i < low.size(); ++i) low_bf[i] = round_bf16(low[i]);
  const Err eg = error_of(ref, got), el = error_of(ref, low_bf), mag = magnitude(ref);
  std::printf("  %-*s rel rms %.2e (bf16-rounded CPU %.2e), max %.2e (CPU %.2e, |ref| max %.2e)\n", width,
              what.c_str(), eg.rms / (mag.rms + 1e-300), el.rms / (mag.rms + 1e-300), eg.max, el.max, mag.max);
  EXPECT_LE(eg.rms, 1e-2 * mag.rms + 1e-6) << what << ": relative RMS error above 1e-2";
  EXPECT_LE(eg.max, 3 * el.max + 2e-2 * mag.max + 1e-6) << what << ": max error " << eg.max;
}

// ---------------------------------------------------------------------------------------
// Model tests

// ‖a − ref‖₂ / ‖ref‖₂ over n values (fp64 sums).
inline double rel_l2(const float* a, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = double(a[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The relative L2 error of a GPU model's gradient of flat tensor `info` (g: grads_to_host, in
// the flat layout) against its CPU twin's: a slope layer's (whose twin trains
// "<weight>.values") as the dense dW at the kept slots against the kept values' gradient.
inline double flat_grad_error(Transformer<float>& cm, const std::vector<float>& g, const ParamInfo& info) {
  for (const auto& p : cm.trainable_params())
    if (p.name == info.name + ".values") {
      auto& l = dynamic_cast<SlopeLinear<float>&>(cm.linear(info.name));
      std::vector<float> kept(l.values().size());
      linear_detail::gather(kept.data(), linear_detail::slot_index(l.forward_weight()), g.data() + info.offset,
                            nullptr);
      return rel_l2(kept.data(), p.grad, kept.size());
    }
  return rel_l2(g.data() + info.offset, cm.grads() + info.offset, info.numel);
}

// Token ids uniform in [0, V), seeded.
inline void random_tokens(std::vector<int32_t>& v, int V, uint64_t seed) {
  Rng rng(seed);
  for (auto& t : v) t = static_cast<int32_t>(rng.below(V));
}

// One micro-batch of random tokens on a CPU model and its GPU twin (the GPU one with per-op
// timing, op_times() then covering it): the losses agree within 2%; returns the GPU's
// gradients (grads_to_host).
inline std::vector<float> micro_batch_on_both(Transformer<float>& cm, GpuTransformer& gm, int B, int T,
                                              const std::string& label) {
  const int vocab = cm.config().vocab_size;
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  random_tokens(x, vocab, 11);
  random_tokens(y, vocab, 12);
  cm.zero_grad();
  const double lc = cm.forward_backward(x.data(), y.data(), B, T, 1.0);
  gm.set_op_timing(true);
  gm.zero_grad();
  const double lg = gm.forward_backward(x.data(), y.data(), B, T, 1.0);
  gm.set_op_timing(false);
  std::printf("%s: loss cpu %.6f gpu %.6f\n", label.c_str(), lc, lg);
  EXPECT_NEAR(lg, lc, 2e-2 * lc);
  return gm.grads_to_host();
}

// A CPU model's initial weights (seed 5), rounded to bf16 (the GPU model's weights) so that
// a GPU model given them starts equal; returns them.
inline std::vector<float> initial_params(Transformer<float>& cm) {
  cm.init_weights(5);
  for (size_t i = 0; i < cm.num_params(); ++i) cm.params()[i] = round_bf16(cm.params()[i]);
  return std::vector<float>(cm.params(), cm.params() + cm.num_params());
}

// A micro-batch of random tokens, seeded.
struct TokenBatch {
  std::vector<int32_t> x, y;
  int B, T;
};
inline TokenBatch random_batch(const ModelConfig& cfg, int B, int T, uint64_t seed) {
  TokenBatch b{std::vector<int32_t>(size_t(B) * T), std::vector<int32_t>(size_t(B) * T), B, T};
  random_tokens(b.x, cfg.vocab_size, seed);
  random_tokens(b.y, cfg.vocab_size, seed + 1);
  return b;
}

// A GPU model's loss and gradients after one micro-batch.
struct StepResult {
  double loss;
  std::vector<float> grads;
};
inline StepResult micro_batch(GpuTransformer& gm, const TokenBatch& b) {
  gm.zero_grad();
  const double loss = gm.forward_backward(b.x.data(), b.y.data(), b.B, b.T, 1.0);
  return {loss, gm.grads_to_host()};
}
inline void expect_same_bits(const StepResult& got, const StepResult& want, const std::string& what) {
  EXPECT_EQ(got.loss, want.loss) << what << ": loss";
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  EXPECT_EQ(std::memcmp(got.grads.data(), want.grads.data(), sizeof(float) * got.grads.size()), 0)
      << what << ": gradients";
}

// fp8 with delayed scaling: models `with` the producers and `without` them, from the same
// weights, through three AdamW steps. From the first roll of the histories on, every block
// Linear (`linears`) of `with` takes produced codes (so the test is not vacuous), and at
// every step both give the same losses and gradients bit for bit at both micro-batches.
inline void expect_producers_give_the_casts_bits(const std::vector<std::string>& linears, GpuTransformer& with,
                                                 GpuTransformer& without, const TokenBatch& full,
                                                 const TokenBatch& smaller) {
  for (int step = 0; step < 3; ++step) {  // step 0: the histories are cold, the casts scale by the amaxes
    const std::string what = "step " + std::to_string(step);
    for (const std::string& name : linears)
      EXPECT_EQ(with.linear(name).takes_produced_fp8(), step > 0) << name << ", " << what;
    expect_same_bits(micro_batch(with, full), micro_batch(without, full), what + ", full micro-batch");
    expect_same_bits(micro_batch(with, smaller), micro_batch(without, smaller), what + ", smaller micro-batch");
    with.step_adamw(GpuAdamW{});
    without.step_adamw(GpuAdamW{});
  }
}

// Sequences that follow x[t+1] = (a · x[t] + c) mod V from a random start: learnable, so
// the loss falls quickly and the two curves are compared where they move.
inline void structured_batch(std::vector<int32_t>& x, std::vector<int32_t>& y, int B, int T, int V, Rng& rng) {
  for (int b = 0; b < B; ++b) {
    int32_t tok = static_cast<int32_t>(rng.below(V));
    for (int t = 0; t < T; ++t) {
      x[size_t(b) * T + t] = tok;
      tok = static_cast<int32_t>((5 * tok + 3) % V);
      y[size_t(b) * T + t] = tok;
    }
  }
}

// The CPU reference of GpuTransformer::step_adamw on a CPU model (Transformer<float>):
// global-norm clipping and AdamW at step `step` (1-based) with the moments m, v; returns
// the gradient norm before clipping.
template <class Model, class Hyper>
double cpu_adamw_step(Model& cm, std::vector<float>& m, std::vector<float>& v, const Hyper& hyper, int64_t step) {
  const double norm = std::sqrt(cpu::global_grad_norm_squared(cm.grads(), int64_t(cm.num_params())));
  const double clip = cpu::clip_scale(norm, hyper.grad_clip);
  for (const auto& info : cm.param_infos())
    cpu::adamw_step(cm.params() + info.offset, cm.grads() + info.offset, m.data() + info.offset,
                    v.data() + info.offset, int64_t(info.numel), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                    info.decay ? hyper.weight_decay : 0.0, step, clip);
  return norm;
}

}  // namespace esplag::gpu_test
