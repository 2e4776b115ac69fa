// The operands of a Linear layer's product timings (the per-layer dispatch, model/device_linear.h):
// X and dX [tokens, in], Y and dY [tokens, out], X and dY non-zero (no shortcuts).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/device_arena.h"

namespace esplag {

struct TimingOperands {
  DeviceArena arena;
  __nv_bfloat16 *x = nullptr, *dx = nullptr, *y = nullptr, *dy = nullptr;
  TimingOperands(int64_t tokens, int64_t in, int64_t out, cudaStream_t s)
      : arena(2 * sizeof(__nv_bfloat16) * size_t(tokens * (in + out)) + 4 * DeviceArena::kDefaultAlignment,
              "dispatch timing") {
    const size_t nx = size_t(tokens * in), ny = size_t(tokens * out);
    x = arena.allocate_array<__nv_bfloat16>("x", nx);
    dx = arena.allocate_array<__nv_bfloat16>("dx", nx);
    y = arena.allocate_array<__nv_bfloat16>("y", ny);
    dy = arena.allocate_array<__nv_bfloat16>("dy", ny);
    CUDA_CHECK(cudaMemsetAsync(x, 0x3C, sizeof(__nv_bfloat16) * nx, s));
    CUDA_CHECK(cudaMemsetAsync(dy, 0x3B, sizeof(__nv_bfloat16) * ny, s));
  }
};

}  // namespace esplag
