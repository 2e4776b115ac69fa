// Gather and scatter of a row-wise 2:4 mask's kept values (sparse/cuda/kept_values.h).

#include <cuda_bf16.h>

#include <type_traits>

#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "sparse/cuda/kept_values.h"

namespace esplag::gpu {

namespace {

using bf16 = __nv_bfloat16;
using detail::blocks_for;
constexpr int kThreads = 256;

// The 4-bit mask of group g of row r (bit j = column 4g + j kept).
__device__ __forceinline__ unsigned group_nibble(const uint16_t* tiles, int64_t r, int64_t g, int64_t groups) {
  return (tiles[(r / 4) * groups + g] >> ((r % 4) * 4)) & 0xFu;
}

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(bf16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T narrow(float x);
template <>
__device__ __forceinline__ float narrow<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 narrow<bf16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
__global__ void gather_kernel(T* __restrict__ values, const T* __restrict__ dense, const uint16_t* __restrict__ tiles,
                              int64_t rows, int64_t groups, bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;  // the group
  if (i >= rows * groups) return;
  unsigned nib = group_nibble(tiles, i / groups, i % groups, groups);
  for (int k = 0; k < 2; ++k) {
    T v = T{};
    if (nib) {
      v = dense[4 * i + __ffs(nib) - 1];
      nib &= nib - 1;  // the next kept position
    }
    values[2 * i + k] = accumulate ? narrow<T>(widen(values[2 * i + k]) + widen(v)) : v;
  }
}

// fp32 with 16-byte aligned dense and 8-byte aligned values (a GEMM's dW and a stored
// gradient): one 16-byte load and one 8-byte store per group.
__global__ void gather_kernel_f32x4(float2* __restrict__ values, const float4* __restrict__ dense,
                                    const uint16_t* __restrict__ tiles, int64_t rows, int64_t groups, bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * groups) return;
  const unsigned nib = group_nibble(tiles, i / groups, i % groups, groups);
  const float4 d = dense[i];
  const float e[4] = {d.x, d.y, d.z, d.w};
  // Selects, not an array indexed by a count (which would live in local memory).
  float k0 = 0.f, k1 = 0.f;
  int n = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if ((nib >> j) & 1u) {
      if (n == 0)
        k0 = e[j];
      else if (n == 1)
        k1 = e[j];
      ++n;
    }
  float2 out = make_float2(k0, k1);
  if (accumulate) {
    const float2 old = values[i];
    out.x += old.x;
    out.y += old.y;
  }
  values[i] = out;
}

template <typename T>
__global__ void scatter_kernel(T* __restrict__ dense, const T* __restrict__ values, const uint16_t* __restrict__ tiles,
                               int64_t rows, int64_t groups) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * groups) return;
  const unsigned nib = group_nibble(tiles, i / groups, i % groups, groups);
  int k = 0;
  for (int j = 0; j < 4; ++j) dense[4 * i + j] = ((nib >> j) & 1u) && k < 2 ? values[2 * i + k++] : T{};
}

void check(const char* what, const void* a, const void* b, const uint16_t* tiles, int64_t rows, int64_t cols,
           size_t align) {
  ESPLAG_CHECK(rows > 0 && cols > 0 && rows % 4 == 0 && cols % 4 == 0, what, ": shape ", rows, "x", cols,
               " is not a positive multiple of 4 in both dimensions");
  ESPLAG_CHECK(a && b && tiles, what, ": null pointer");
  ESPLAG_CHECK(reinterpret_cast<uintptr_t>(a) % align == 0 && reinterpret_cast<uintptr_t>(b) % align == 0 &&
                   reinterpret_cast<uintptr_t>(tiles) % 2 == 0,
               what, ": misaligned buffer");
}

}  // namespace

template <typename T>
void gather_kept_24(T* values, const T* dense, const uint16_t* tiles, int64_t rows, int64_t cols, bool accumulate,
                    cudaStream_t stream) {
  check("gather_kept_24", values, dense, tiles, rows, cols, sizeof(T));
  const int64_t groups = cols / 4;
  const unsigned grid = blocks_for(rows * groups, kThreads);
  if constexpr (std::is_same_v<T, float>) {
    if (reinterpret_cast<uintptr_t>(dense) % 16 == 0 && reinterpret_cast<uintptr_t>(values) % 8 == 0) {
      gather_kernel_f32x4<<<grid, kThreads, 0, stream>>>(
          reinterpret_cast<float2*>(values), reinterpret_cast<const float4*>(dense), tiles, rows, groups, accumulate);
      CUDA_CHECK_LAUNCH("gather_kept_24");
      return;
    }
  }
  gather_kernel<<<grid, kThreads, 0, stream>>>(values, dense, tiles, rows, groups, accumulate);
  CUDA_CHECK_LAUNCH("gather_kept_24");
}

template <typename T>
void scatter_kept_24(T* dense, const T* values, const uint16_t* tiles, int64_t rows, int64_t cols,
                     cudaStream_t stream) {
  check("scatter_kept_24", dense, values, tiles, rows, cols, sizeof(T));
  const int64_t groups = cols / 4;
  scatter_kernel<<<blocks_for(rows * groups, kThreads), kThreads, 0, stream>>>(dense, values, tiles, rows, groups);
  CUDA_CHECK_LAUNCH("scatter_kept_24");
}

template void gather_kept_24<float>(float*, const float*, const uint16_t*, int64_t, int64_t, bool, cudaStream_t);
template void gather_kept_24<__nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, const uint16_t*, int64_t, int64_t,
                                            bool, cudaStream_t);
template void scatter_kept_24<float>(float*, const float*, const uint16_t*, int64_t, int64_t, cudaStream_t);
template void scatter_kept_24<__nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, const uint16_t*, int64_t, int64_t,
                                             cudaStream_t);

}  // namespace esplag::gpu
