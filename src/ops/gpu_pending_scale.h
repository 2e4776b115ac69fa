// gpu::PendingScale: a scale that the op reading a tensor applies as it loads it, and the
// pass that applies it in place (ops/cuda/pending_scale.cu). Only for the CUDA build
// (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "ops/gpu_pending_scale.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace esplag::gpu {

// A tensor stored before its last scaling: its values are the stored ones times *a · *b
// (fp32), each rounded to bf16 again. An fp8 2:4 product leaves its output so where the op
// that reads it applies the scale as it loads (cuSPARSELt cannot scale by a device value:
// model/cuda/device_linear_fp8_sparse.h); else apply_pending_scale scales it in place.
// Null pointers: the values are as stored.
struct PendingScale {
  const float* a = nullptr;
  const float* b = nullptr;
  explicit operator bool() const { return a != nullptr; }
};

// x [n] scaled in place by `scale` (nothing without one): the values the ops that take the
// scale see, bit for bit.
void apply_pending_scale(__nv_bfloat16* x, int64_t n, PendingScale scale, cudaStream_t stream);

}  // namespace esplag::gpu
