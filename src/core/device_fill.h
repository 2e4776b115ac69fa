// Random, never-zero bf16 data made on the device, for the benchmarks and the per-layer
// dispatch timings (model/cuda/timing_operands.h): a zero or constant input would let
// hardware or libraries skip work or draw less power, and copying gigabytes from the host
// would dominate a benchmark's start-up.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "core/device_fill.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace esplag {

// p[i] for i < n: |x| uniform in [0.1, 1) times scale, with a random sign, from a counter
// hash (splitmix64) of seed and i, so the same seed gives the same data. Asynchronous.
void fill_nonzero_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream);

}  // namespace esplag
