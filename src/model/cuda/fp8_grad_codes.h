// dY's fp8 codes shared by a layer's two backward products (dX takes dY [N, out], dW takes
// dYᵀ [out, N]): one amax and one pass writing both layouts (gpu::fp8_cast_both) by whichever
// product of the layer runs first; the other takes them over. Part of the scratch that the
// fp8 layers of a model share (device_linear_dense.cu, device_linear_fp8_sparse.cu).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "model/cuda/fp8_histories.h"
#include "ops/gpu_fp8.h"

namespace esplag {

struct Fp8GradCodes {
  uint8_t* dy = nullptr;   // [N, out], room for the largest layer's
  uint8_t* dyt = nullptr;  // [out, N]

  // dY's codes (scaled as `amax` says, its inverse scale into *inv; the values the cast
  // saturated added to *saturated when given) unless `owner`'s other product of this same dY
  // (pointer and rows) cast them last: then they are taken over, and a third product would
  // cast again.
  void take(const void* owner, const gpu::bf16* grad, int N, int64_t out, const Fp8OperandAmax& amax, float* inv,
            Fp8Format format, uint64_t* saturated, cudaStream_t s) {
    if (owner_ == owner && of_ == grad && rows_ == N) {
      owner_ = nullptr;
      return;
    }
    gpu::fp8_cast_both(dy, dyt, inv, grad, N, out, amax.before_cast(grad, int64_t(N) * out, s), format, saturated,
                       s);
    owner_ = owner;
    of_ = grad;
    rows_ = N;
  }
  // At a new backward nothing is taken over (the same pointers hold another dY).
  void forget() { owner_ = nullptr; }

 private:
  const void* owner_ = nullptr;
  const gpu::bf16* of_ = nullptr;
  int rows_ = 0;
};

}  // namespace esplag
