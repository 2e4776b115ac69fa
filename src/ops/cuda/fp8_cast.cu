// bf16 -> fp8 casts with core/fp8.h's scaling rule (ops/gpu_fp8.h). Codes and scales as
// ops/cuda/fp8_codes.cuh makes them; the clipped test is core's too (Fp8Format::clips).
//
// amax is an integer atomicMax on the bits of |x| (non-negative floats order like their
// bits), exact and so independent of the order of the blocks (and so is the amax a cast
// records for delayed scaling); the saturation counter is an integer atomicAdd, one per
// block.
//
// Every pass is bandwidth-bound: 16-byte loads of x (several in flight per thread), 8- or
// 16-byte stores of codes. A cast usually follows the amax of the same tensor, which reads
// it from its start to its end; the casts walk it from the end back, so that they begin
// with what the amax read last, which the L2 cache may still hold.
#include <algorithm>

#include "core/error.h"
#include "ops/cuda/fp8_tiles.cuh"
#include "ops/gpu_fp8.h"

namespace esplag::gpu {

namespace {

using detail::add_clipped;
using detail::aligned16;
using detail::aligned8;
using detail::Bf16Tiles;
using detail::block_max;
using detail::blocks_for;
using detail::clips;
using detail::cast_tiles;
using detail::counter;
using detail::encode8;
using detail::finite_abs;
using detail::fp8_encode2;
using detail::fp8_scale_of;
using detail::kPack;
using detail::load8;
using detail::pack_amax;
using detail::record_amax;
using detail::to_f;

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 2048;  // grid-stride beyond this: a cast is bandwidth-bound
constexpr int kUnroll = 4;             // packs of 8 values each thread has in flight per iteration

// One value's code (the tails the packs of 8 leave), counting it when clipped.
template <bool E5M2>
__device__ __forceinline__ uint8_t encode1(float x, float s, int& clipped) {
  clipped += clips<E5M2>(x, s);
  return static_cast<uint8_t>(fp8_encode2<E5M2>(x, 0.0f, s));
}

// ---------------------------------------------------------------------------------------
// amax

__global__ void amax_kernel(unsigned* amax_bits, const bf16* x, int64_t n, int64_t packs) {
  __shared__ float scratch[32];
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  float m = 0.0f;
  for (int64_t p0 = first; p0 < packs; p0 += kUnroll * stride) {
    float f[kUnroll][kPack];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * stride;
      if (p < packs) load8(f[u], x + p * kPack);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (p0 + u * stride < packs) m = fmaxf(m, pack_amax(f[u]));
  }
  for (int64_t i = packs * kPack + first; i < n; i += stride) m = fmaxf(m, finite_abs(to_f(x[i])));
  m = block_max(m, scratch);
  if (threadIdx.x == 0 && m > 0.0f) atomicMax(amax_bits, __float_as_uint(m));
}

// ---------------------------------------------------------------------------------------
// Per-tensor cast

template <bool E5M2>
__global__ void cast_kernel(uint8_t* out, float* inv_scale, const bf16* x, int64_t n, int64_t packs,
                            Fp8CastAmax amax, unsigned long long* saturated) {
  __shared__ int scratch[32];
  __shared__ float fscratch[32];
  const float s = fp8_scale_of<E5M2>(*amax.scale_from);
  float m = 0.0f;  // amax.record's
  if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = __frcp_rn(s);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  int clipped = 0;
  // Pack `packs - 1 - j` for the j-th: from the end of x back (see the top of the file).
  for (int64_t j0 = first; j0 < packs; j0 += kUnroll * stride) {
    float f[kUnroll][kPack];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * stride;
      if (j < packs) load8(f[u], x + (packs - 1 - j) * kPack);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * stride;
      if (j >= packs) continue;
      *reinterpret_cast<uint2*>(out + (packs - 1 - j) * kPack) = encode8<E5M2>(f[u], s, clipped, m);
    }
  }
  for (int64_t i = packs * kPack + first; i < n; i += stride) {
    const float v = to_f(x[i]);
    out[i] = encode1<E5M2>(v, s, clipped);
    m = fmaxf(m, finite_abs(v));
  }
  add_clipped(saturated, clipped, scratch);
  record_amax(amax.record, m, fscratch);
}

// ---------------------------------------------------------------------------------------
// Per-row cast: one block per row, the row read twice (amax, then cast; the second read
// mostly hits the cache).

template <bool E5M2>
__global__ void cast_rows_kernel(uint8_t* out, float* inv_scale, float* row_amax, const bf16* x, int64_t cols,
                                 bool vec, unsigned long long* saturated) {
  __shared__ float fscratch[32];
  __shared__ int iscratch[32];
  const int64_t r = blockIdx.x;
  const bf16* row = x + r * cols;
  uint8_t* dst = out + r * cols;
  const int64_t packs = vec ? cols / kPack : 0;
  float m = 0.0f;
  for (int64_t p = threadIdx.x; p < packs; p += kThreads) {
    float f[kPack];
    load8(f, row + p * kPack);
#pragma unroll
    for (int k = 0; k < kPack; ++k) m = fmaxf(m, finite_abs(f[k]));
  }
  for (int64_t i = packs * kPack + threadIdx.x; i < cols; i += kThreads) m = fmaxf(m, finite_abs(to_f(row[i])));
  m = block_max(m, fscratch);
  const float s = fp8_scale_of<E5M2>(m);
  if (threadIdx.x == 0) {
    inv_scale[r] = __frcp_rn(s);
    if (row_amax) row_amax[r] = m;
  }
  int clipped = 0;
  for (int64_t p = threadIdx.x; p < packs; p += kThreads) {
    float f[kPack];
    load8(f, row + p * kPack);
    *reinterpret_cast<uint2*>(dst + p * kPack) = encode8<E5M2>(f, s, clipped);
  }
  for (int64_t i = packs * kPack + threadIdx.x; i < cols; i += kThreads)
    dst[i] = encode1<E5M2>(to_f(row[i]), s, clipped);
  add_clipped(saturated, clipped, iscratch);
}

// Packs of 8 values when x is 16-byte and out 8-byte aligned (the tail goes value by
// value), none otherwise.
int64_t packs_of(const bf16* x, const uint8_t* out, int64_t n) {
  return aligned16(x) && (!out || aligned8(out)) ? n / kPack : 0;
}

unsigned grid_for(int64_t n) { return std::max(1u, std::min(kMaxBlocks, blocks_for(n, kThreads * kPack))); }

void check_cast(const char* op, const void* out, const void* scale_out, const bf16* x, int64_t n, Fp8CastAmax amax) {
  ESPLAG_CHECK(n >= 0, op, ": negative size ", n);
  ESPLAG_CHECK(n == 0 || (out && x), op, ": out and x must not be null");
  ESPLAG_CHECK(scale_out && amax.scale_from, op, ": inv_scale and amax must not be null");
}

}  // namespace

void fp8_amax(float* amax, const bf16* x, int64_t n, cudaStream_t stream) {
  ESPLAG_CHECK(amax && n >= 0 && (x || n == 0), "fp8_amax: null pointer or negative size ", n);
  CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));  // 0.0f; the kernel only raises it
  if (n == 0) return;
  amax_kernel<<<grid_for(n), kThreads, 0, stream>>>(reinterpret_cast<unsigned*>(amax), x, n,
                                                    packs_of(x, nullptr, n));
  CUDA_CHECK_LAUNCH("fp8_amax");
}

void fp8_cast(uint8_t* out, float* inv_scale, const bf16* x, int64_t n, Fp8CastAmax amax, Fp8Format format,
              uint64_t* saturated, cudaStream_t stream) {
  check_cast("fp8_cast", out, inv_scale, x, n, amax);
  // One block even for n = 0: it writes inv_scale.
  const int64_t packs = packs_of(x, out, n);
  if (format == Fp8Format::e5m2)
    cast_kernel<true><<<grid_for(n), kThreads, 0, stream>>>(out, inv_scale, x, n, packs, amax, counter(saturated));
  else
    cast_kernel<false><<<grid_for(n), kThreads, 0, stream>>>(out, inv_scale, x, n, packs, amax, counter(saturated));
  CUDA_CHECK_LAUNCH("fp8_cast");
}

namespace {

// The tiled cast of x [rows, cols] into out (as it lies; may be null) and out_t
// (transposed; may be null).
void cast_bf16_tiles(const char* op, uint8_t* out, uint8_t* out_t, float* inv_scale, const bf16* x, int64_t rows,
                     int64_t cols, Fp8CastAmax amax, Fp8Format format, uint64_t* saturated, cudaStream_t stream) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0, op, ": negative size ", rows, " x ", cols);
  check_cast(op, out ? out : out_t, inv_scale, x, rows * cols, amax);
  const Bf16Tiles src{x, rows, cols, cols % kPack == 0 && aligned16(x)};
  cast_tiles(op, out, out_t, inv_scale, src, rows, cols, amax, format, saturated, stream);
}

}  // namespace

void fp8_cast_transpose(uint8_t* out, float* inv_scale, const bf16* x, int64_t rows, int64_t cols, Fp8CastAmax amax,
                        Fp8Format format, uint64_t* saturated, cudaStream_t stream) {
  cast_bf16_tiles("fp8_cast_transpose", nullptr, out, inv_scale, x, rows, cols, amax, format, saturated, stream);
}

void fp8_cast_both(uint8_t* out, uint8_t* out_t, float* inv_scale, const bf16* x, int64_t rows, int64_t cols,
                   Fp8CastAmax amax, Fp8Format format, uint64_t* saturated, cudaStream_t stream) {
  ESPLAG_CHECK(rows * cols == 0 || (out && out_t), "fp8_cast_both: out and out_t must not be null");
  cast_bf16_tiles("fp8_cast_both", out, out_t, inv_scale, x, rows, cols, amax, format, saturated, stream);
}

namespace {

__global__ void roll_kernel(float* histories, int64_t count, int length) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float* h = histories + i * (int64_t(length) + 2);
  float* past = h + 2;
  float m = h[0];
  for (int k = length - 1; k > 0; --k) {
    past[k] = past[k - 1];
    m = fmaxf(m, past[k]);
  }
  past[0] = h[0];
  h[1] = m;
  h[0] = 0.0f;
}

}  // namespace

void fp8_roll_amax_histories(float* histories, int64_t count, int length, cudaStream_t stream) {
  ESPLAG_CHECK(count >= 0 && length >= 1 && (histories || count == 0), "fp8_roll_amax_histories: ", count,
               " histories of length ", length);
  if (count == 0) return;
  roll_kernel<<<blocks_for(count, 128), 128, 0, stream>>>(histories, count, length);
  CUDA_CHECK_LAUNCH("fp8_roll_amax_histories");
}

void fp8_cast_rows(uint8_t* out, float* inv_scale, float* row_amax, const bf16* x, int64_t rows, int64_t cols,
                   Fp8Format format, uint64_t* saturated, cudaStream_t stream) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0, "fp8_cast_rows: negative size ", rows, " x ", cols);
  ESPLAG_CHECK(rows <= INT32_MAX, "fp8_cast_rows: ", rows, " rows is too many (one block per row)");
  if (rows == 0) return;
  ESPLAG_CHECK(inv_scale && (cols == 0 || (out && x)), "fp8_cast_rows: null pointer");
  const bool vec = cols % kPack == 0 && aligned16(x) && aligned8(out);
  const unsigned grid = static_cast<unsigned>(rows);
  if (format == Fp8Format::e5m2)
    cast_rows_kernel<true><<<grid, kThreads, 0, stream>>>(out, inv_scale, row_amax, x, cols, vec, counter(saturated));
  else
    cast_rows_kernel<false><<<grid, kThreads, 0, stream>>>(out, inv_scale, row_amax, x, cols, vec,
                                                           counter(saturated));
  CUDA_CHECK_LAUNCH("fp8_cast_rows");
}

}  // namespace esplag::gpu
