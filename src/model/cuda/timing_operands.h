// The operands of a Linear layer's product timings (the per-layer dispatch, model/device_linear.h):
// X and dX [tokens, in], Y and dY [tokens, out]; X and dY random and non-zero
// (core/device_fill.h): no shortcuts, and no constant data either, whose low switching power
// would flatter every product alike (constant operands read about 880 TFLOP/s for dense bf16
// forwards on an H100).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/device_arena.h"

namespace esplag {

struct TimingOperands {
  DeviceArena arena;
  __nv_bfloat16 *x = nullptr, *dx = nullptr, *y = nullptr, *dy = nullptr;
  // Asynchronous on `s`.
  TimingOperands(int64_t tokens, int64_t in, int64_t out, cudaStream_t s);
};

}  // namespace esplag
