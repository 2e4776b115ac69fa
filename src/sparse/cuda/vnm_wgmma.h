// The V:2:M forward on Hopper's sparse warpgroup MMA (wgmma.mma_async.sp, sm_90a): the
// kernel vnm_linear_forward and vnm_linear_forward_xt (vnm_gemm.h) dispatch to on H100-class
// devices. Internal to sparse/cuda; callers use vnm_gemm.h. vnm_wgmma.cu says how it works.
#pragma once

#include <cstdint>

#include "sparse/cuda/vnm_gemm.h"

namespace esplag::gpu::vnm_wgmma {

// Whether the current device can run the kernel: compute capability 9.0, and the loaded
// binary image of vnm_wgmma.cu is the sm_90a one (checked once per device with a probe
// kernel, since a plain sm_90 image of the same file has no wgmma).
bool available();

// out[tokens, w.rows] = x · Wᵀ (+ bias), as vnm_linear_forward; x is X [tokens, w.cols]
// (ldxt = 0, any 2-byte alignment) or Xᵀ [w.cols, ldxt] (ldxt > 0: a multiple of 8 and
// >= tokens, 16-byte aligned). The caller has checked the weight and the pointers, and
// that tokens > 0.
void forward(bf16* out, const bf16* x, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
             cudaStream_t stream);
void forward(float* out, const bf16* x, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
             cudaStream_t stream);

}  // namespace esplag::gpu::vnm_wgmma
