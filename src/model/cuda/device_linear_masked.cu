#include "model/cuda/device_linear_masked.h"

#include <algorithm>
#include <bit>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/cuda/step_marks.h"
#include "model/cuda/timing_operands.h"
#include "model/linear_masked.h"
#include "sparse/cuda/cusparselt.h"

namespace esplag {

namespace {

constexpr int kThreads = 256;

// Zeroes the entries of x [rows, cols] (and of x2 when given) whose bit is 0 in `bits`
// ([rows, ceil(cols / 32)] words, bit c % 32 of word c / 32 for column c): a masked
// layer's pruned gradients, or its pruned weights (x the master's high halves, x2 the low
// ones). A thread per column, blocks of rows along y: no division per element, a warp's
// 32 columns share one mask word, and only pruned entries are written.
template <typename T, typename U>
__global__ void apply_mask_kernel(T* x, U* x2, const uint32_t* bits, int64_t rows, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  const int64_t words = (cols + 31) / 32;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    if ((bits[r * words + c / 32] >> (c % 32)) & 1u) continue;
    x[r * cols + c] = T{};
    if (x2) x2[r * cols + c] = U{};
  }
}

// Zeroes the values of p[0..8) (16-byte aligned) whose bit is 0 in m, 16 bytes at a time:
// no access where all of them are kept, a store without a load where all are pruned.
template <typename T>
__device__ void mask_8(T* p, unsigned m) {
  constexpr int kLanes = 16 / sizeof(T);  // values per 16 bytes
  constexpr unsigned kAll = (1u << kLanes) - 1;
#pragma unroll
  for (int i = 0; i < 8 / kLanes; ++i) {
    const unsigned keep = (m >> (i * kLanes)) & kAll;
    uint4* v = reinterpret_cast<uint4*>(p + i * kLanes);
    if (keep == kAll) continue;
    if (keep == 0) {
      *v = make_uint4(0, 0, 0, 0);
      continue;
    }
    alignas(16) T vals[kLanes];
    *reinterpret_cast<uint4*>(vals) = *v;
#pragma unroll
    for (int j = 0; j < kLanes; ++j)
      if (!((keep >> j) & 1u)) vals[j] = T{};
    *v = *reinterpret_cast<const uint4*>(vals);
  }
}

// apply_mask_kernel for cols a multiple of 8 and 16-byte aligned rows, a thread per 8
// columns (one byte of the mask): the scalar kernel's partial writes, when most of a
// row's entries are pruned, cost the memory system a read of each sector anyway.
template <typename T, typename U>
__global__ void apply_mask_8_kernel(T* x, U* x2, const uint32_t* bits, int64_t rows, int64_t cols) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;  // columns 8g..8g+7
  if (g >= cols / 8) return;
  const int64_t words = (cols + 31) / 32;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const unsigned m = (bits[r * words + g / 4] >> (g % 4 * 8)) & 0xFFu;
    if (m == 0xFFu) continue;
    mask_8(x + r * cols + 8 * g, m);
    if (x2) mask_8(x2 + r * cols + 8 * g, m);
  }
}

bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Zeroes the pruned entries of x [out, in] (and of x2).
template <typename T, typename U = T>
void apply_mask(T* x, const uint32_t* mask, int64_t out, int64_t in, cudaStream_t s, U* x2 = nullptr) {
  const unsigned rows = static_cast<unsigned>(std::min<int64_t>(out, 65535));
  if (in % 8 == 0 && aligned_16(x) && aligned_16(x2)) {
    const dim3 grid(static_cast<unsigned>((in / 8 + kThreads - 1) / kThreads), rows);
    apply_mask_8_kernel<T, U><<<grid, kThreads, 0, s>>>(x, x2, mask, out, in);
  } else {
    const dim3 grid(static_cast<unsigned>((in + kThreads - 1) / kThreads), rows);
    apply_mask_kernel<T, U><<<grid, kThreads, 0, s>>>(x, x2, mask, out, in);
  }
  CUDA_CHECK_LAUNCH("GpuTransformer (masked layer)");
}

}  // namespace

DeviceMaskedLinear::DeviceMaskedLinear(const DeviceLinearSetup& s, const std::string& kind)
    : DeviceDenseLinear(s, kind), bias_(s.bias) {
  const std::vector<uint8_t>& mask = *s.setting->mask;
  const std::vector<uint32_t> bits = mask_to_bits(mask, out_, in_);
  bits_ = DeviceArena(sizeof(uint32_t) * bits.size() + DeviceArena::kDefaultAlignment, "mask bits");
  uint32_t* dev = bits_.allocate_array<uint32_t>("bits", bits.size());
  CUDA_CHECK(cudaMemcpy(dev, bits.data(), sizeof(uint32_t) * bits.size(), cudaMemcpyHostToDevice));
  mask_ = dev;
  rows_24_ = !ctx_.precision.fp8 && bits_are_rows_24(bits, in_) && Rows24Forward::applies(out_, in_, ctx_.tokens);
}

bool DeviceMaskedLinear::bits_are_rows_24(const std::vector<uint32_t>& bits, int64_t in) {
  // Rows start on a word and a word holds 8 aligned groups of 4 (unused bits are 0).
  if (in % 4 != 0) return false;
  for (uint32_t w : bits)
    for (int g = 0; g < 32; g += 4)
      if (std::popcount((w >> g) & 0xFu) > 2) return false;
  return true;
}

std::vector<uint32_t> DeviceMaskedLinear::mask_to_bits(const std::vector<uint8_t>& mask, int64_t out, int64_t in) {
  const int64_t words = (in + 31) / 32;
  std::vector<uint32_t> bits(size_t(out * words), 0u);
  parallel_for(out, [&](int64_t o0, int64_t o1) {  // rows own their words
    for (int64_t o = o0; o < o1; ++o)
      for (int64_t i = 0; i < in; ++i)
        if (mask[size_t(o * in + i)]) bits[size_t(o * words + i / 32)] |= 1u << (i % 32);
  });
  return bits;
}

std::vector<uint32_t> DeviceMaskedLinear::mask_bits() const {
  std::vector<uint32_t> bits(size_t(out_ * ((in_ + 31) / 32)));
  CUDA_CHECK(cudaMemcpy(bits.data(), mask_, sizeof(uint32_t) * bits.size(), cudaMemcpyDeviceToHost));
  return bits;
}

size_t DeviceMaskedLinear::device_bytes() const {
  return bits_.capacity() + DeviceDenseLinear::device_bytes() + (fwd24_ ? fwd24_->device_bytes() : 0);
}

void DeviceMaskedLinear::attach() {
  zero_pruned_weights();
  if (!rows_24_) return;
  // The 2:4 forward is a speed-up only: where it cannot be set up, the layer stays dense.
  try {
    fwd24_ = std::make_unique<Rows24Forward>(weight_name_, out_, in_, ctx_.tokens, bias_);
    if (ctx_.sparse_dispatch && !ctx_.sparse_is_faster(kind_, weight_name_, out_, in_,
                                                        DeviceLinearContext::GeluPasses::fc,
                                                        [&] { return time_forward(); }))
      fwd24_.reset();
  } catch (const Error& e) {
    fwd24_.reset();
    gpu::warn_cusparselt_fallback_once(weight_name_ + " (" + kind_ + ", 2:4 forward)", e.what());
  }
  if (fwd24_) prepare_24();
}

DeviceLinearContext::ProductTimes DeviceMaskedLinear::time_forward() {
  cudaStream_t s = ctx_.stream;
  const int N = static_cast<int>(ctx_.tokens);
  const TimingOperands o(N, in_, out_, s);
  const StepMarks::Pause unmarked(*ctx_.marks);
  DeviceLinearContext::ProductTimes t;
  t.sparse_ms = median_event_ms(
      [&](int) {
        fwd24_->prepare(p_.weight.w, s);
        fwd24_->forward(o.y, o.x, p_.bias.w, s);
      },
      2, 10, s);
  t.dense_ms = median_event_ms(
      [&](int) { ctx_.gemm->forward(o.y, o.x, p_.weight.w, p_.bias.w, N, int(in_), int(out_), s); }, 2, 10, s);
  return t;
}

void DeviceMaskedLinear::bind(const DeviceLinearParams& p) {
  DeviceDenseLinear::bind(p);
  w24_current_ = false;  // another weight: compressed at the next prepare or forward
}

void DeviceMaskedLinear::prepare_24() {
  fwd24_->prepare(p_.weight.w, ctx_.stream);
  w24_current_ = true;
}

void DeviceMaskedLinear::prepare(bool refresh) {
  // Weights that came otherwise than through a step (set_params, init_weights) may be
  // non-zero where pruned: neither the 2:4 copy nor a layer whose steps keep them at zero
  // may start from them. Only a step's after_optimizer_step, just before, vouches for them.
  if (!stepped_ && (fwd24_ || steps_keep_pruned_zero())) zero_pruned_weights();
  stepped_ = false;
  DeviceDenseLinear::prepare(refresh);
  if (fwd24_) prepare_24();
}

void DeviceMaskedLinear::forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) {
  if (!fwd24_ || N != ctx_.tokens) return DeviceDenseLinear::forward(out, in, N, act, pre_act, op);
  if (!w24_current_) prepare_24();
  forward_24([&](bf16* y) { fwd24_->forward(y, in, p_.bias.w, ctx_.stream); }, out, N, act, pre_act, op);
}

void DeviceMaskedLinear::zero_pruned_weights() {
  apply_mask(p_.weight.w, mask_, out_, in_, ctx_.stream, p_.weight.w_lo);
}

void DeviceMaskedLinear::after_optimizer_step() {
  // Neither weight decay nor moments from before a mask change revive a pruned weight.
  if (!steps_keep_pruned_zero()) zero_pruned_weights();
  stepped_ = true;
}

void DeviceMaskedLinear::backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad,
                                     const char* op) {
  DeviceDenseLinear::backward_dw(dout, inp, N, accumulate, bias_grad, op);
  ctx_.marks->mark(ctx_.stream, "masked grad");  // pruned weights get no gradient
  apply_mask(p_.weight.grad, mask_, out_, in_, ctx_.stream);
}

void DeviceMaskedLinear::setting_from_twin(const Linear<float>& twin, int64_t, bool masks, Setting& s, TwinMasks&) {
  if (masks) s.mask = &twin_as<MaskedLinear>(twin, "masked").mask();
}

}  // namespace esplag
