#include "core/device_fill.h"

#include "core/cuda_check.h"

namespace esplag {

namespace {

__global__ void fill_nonzero_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float mag = 0.1f + 0.9f * static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
  p[i] = __float2bfloat16_rn((z & 1ull) ? -mag * scale : mag * scale);
}

}  // namespace

void fill_nonzero_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  fill_nonzero_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p, n, seed, scale);
  CUDA_CHECK_LAUNCH("fill_nonzero_bf16");
}

}  // namespace esplag
