// Device helpers shared by the CUDA kernels: bf16 conversion, 16-byte packs,
// deterministic warp and block reductions, launch arithmetic.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"

namespace esplag::gpu::detail {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf(float x) { return __float2bfloat16_rn(x); }

// Eight bf16 values moved as one 16-byte access (a single LDG.128 / STG.128).
constexpr int kPack = 8;
// The eight bf16 values of a 16-byte word.
__device__ __forceinline__ void unpack8(float (&f)[kPack], const uint4& u) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < kPack / 2; ++k) {
    const float2 t = __bfloat1622float2(h[k]);
    f[2 * k] = t.x;
    f[2 * k + 1] = t.y;
  }
}

// Each value rounded to bf16 (round to nearest even), two conversions at a time: the bits
// of to_f(to_bf(x)) for each.
template <int n>
__device__ __forceinline__ void round_to_bf16(float (&f)[n]) {
  static_assert(n % 2 == 0, "round_to_bf16 takes pairs");
#pragma unroll
  for (int k = 0; k < n; k += 2) {
    const float2 t = __bfloat1622float2(__floats2bfloat162_rn(f[k], f[k + 1]));
    f[k] = t.x;
    f[k + 1] = t.y;
  }
}
__device__ __forceinline__ void load8(float (&f)[kPack], const bf16* p) {
  unpack8(f, *reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void store8(bf16* p, const float (&f)[kPack]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < kPack / 2; ++k) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Butterfly (xor) reductions: every lane ends with the same value, and the order of the
// additions is fixed by the lane pattern, so results are reproducible bit for bit.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `scratch` holds 32 floats of shared memory; the call synchronises the block.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

__host__ __device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline unsigned blocks_for(int64_t work, int64_t per_block) {
  return static_cast<unsigned>((work + per_block - 1) / per_block);
}

// Rows per chunk for the two-pass column reductions (weight / bias gradients): the
// number of chunks depends only on N, never on the device, so the summation order and
// hence the result is the same on every GPU.
constexpr int kMaxRowChunks = 128;
constexpr int kMinRowsPerChunk = 64;
inline int row_chunks(int64_t N) {
  const int64_t g = (N + kMinRowsPerChunk - 1) / kMinRowsPerChunk;
  return static_cast<int>(g < 1 ? 1 : (g > kMaxRowChunks ? kMaxRowChunks : g));
}

}  // namespace esplag::gpu::detail
