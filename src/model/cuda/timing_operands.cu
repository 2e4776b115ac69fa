#include "model/cuda/timing_operands.h"

#include "core/cuda_check.h"

namespace esplag {

namespace {

// x[i] = a value in [-1, 1) from a hash of (i, seed): random-looking, and the same every run.
__global__ void fill_hashed_kernel(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ seed;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    x[i] = __float2bfloat16(static_cast<float>(h >> 8) * 0x1p-23f - 1.f);  // 24 bits: exact in float
  }
}

void fill_hashed(__nv_bfloat16* x, size_t n, uint32_t seed, cudaStream_t s) {
  fill_hashed_kernel<<<1024, 256, 0, s>>>(x, n, seed);
  CUDA_CHECK_LAUNCH("TimingOperands");
}

}  // namespace

TimingOperands::TimingOperands(int64_t tokens, int64_t in, int64_t out, cudaStream_t s)
    : arena(2 * sizeof(__nv_bfloat16) * size_t(tokens * (in + out)) + 4 * DeviceArena::kDefaultAlignment,
            "dispatch timing") {
  const size_t nx = size_t(tokens * in), ny = size_t(tokens * out);
  x = arena.allocate_array<__nv_bfloat16>("x", nx);
  dx = arena.allocate_array<__nv_bfloat16>("dx", nx);
  y = arena.allocate_array<__nv_bfloat16>("y", ny);
  dy = arena.allocate_array<__nv_bfloat16>("dy", ny);
  fill_hashed(x, nx, 1u, s);
  fill_hashed(dy, ny, 2u, s);
}

}  // namespace esplag
