#include "ops/cuda/pending_scale.cuh"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"

namespace esplag::gpu {

namespace {

using detail::bf16;
using detail::kPack;

// 8 values per thread (16-byte accesses when `vec`: x 16-byte aligned), a grid-stride loop.
__global__ void apply_pending_scale_kernel(bf16* x, int64_t n, PendingScale scale, bool vec) {
  const detail::PendingFactor f(scale);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i * kPack < n; i += stride) {
    bf16* p = x + kPack * i;
    if (vec && (i + 1) * kPack <= n) {
      float v[kPack];
      detail::load8(v, p);
      f.apply(v);
      detail::store8(p, v);
      continue;
    }
    for (int64_t j = 0; j < kPack && kPack * i + j < n; ++j) p[j] = detail::to_bf(f(detail::to_f(p[j])));
  }
}

}  // namespace

void apply_pending_scale(bf16* x, int64_t n, PendingScale scale, cudaStream_t stream) {
  ESPLAG_CHECK(n >= 0, "apply_pending_scale: negative size ", n);
  if (!scale || n == 0) return;
  ESPLAG_CHECK(scale.b, "apply_pending_scale: the scale has its first factor and not its second");
  ESPLAG_CHECK(x, "apply_pending_scale: null buffer");
  const int64_t packs = (n + kPack - 1) / kPack;
  apply_pending_scale_kernel<<<unsigned(std::min<int64_t>((packs + 255) / 256, 4096)), 256, 0, stream>>>(
      x, n, scale, reinterpret_cast<uintptr_t>(x) % 16 == 0);
  CUDA_CHECK_LAUNCH("apply_pending_scale");
}

}  // namespace esplag::gpu
