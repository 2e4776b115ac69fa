// Timing of the 2:4 sparsification kernels (sparse/cuda/sparsify.h) against a plain
// device-to-device copy moving the same number of bytes, measured in the same process:
// for `esplag bench sparsify`.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "bench/lib/sparsify.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cstdint>
#include <string>
#include <vector>

namespace esplag {

struct SparsifyShape {
  int64_t rows = 0, cols = 0;  // both multiples of 4
};

// 4096×11008, 11008×4096 (LLaMA-7B's MLP weights) and 2048×8192.
std::vector<SparsifyShape> default_sparsify_shapes();

struct SparsifyTiming {
  std::string kernel;   // "transposable_24", "double_prune_24", "activation_24_rows", ...
  std::string outputs;  // what was written: "dense+dense_t", "compressed+compressed_t", ...
  int64_t rows = 0, cols = 0;
  double bytes = 0;           // bytes the kernel must read and write (input once, each output once)
  double median_ms = 0;       // median of the timed launches
  double gbps = 0;            // bytes / median (1 GB = 1e9 bytes)
  double copy_median_ms = 0;  // cudaMemcpyAsync device to device of bytes/2: the same traffic
  double copy_gbps = 0;
  double vs_copy = 0;         // copy_median_ms / median_ms (1 = as fast as a copy)
  std::string device;         // the GPU's name
};

// For every shape, times each kernel and output combination: `warmup` untimed launches,
// then `iters` launches each between its own pair of CUDA events, alternating between two
// random bf16 inputs (so that no input stays in L2 across launches); the median is kept.
// The copy baseline is timed the same way. Allocates its buffers (about 17 bytes per
// value of the largest shape) in its own DeviceArena; throws Error when they do not fit or
// a shape is not a multiple of 4.
std::vector<SparsifyTiming> bench_sparsify(const std::vector<SparsifyShape>& shapes = default_sparsify_shapes(),
                                           int iters = 50, int warmup = 10);

// One human-readable line per timing, with a header; and a CSV (header line + one line each,
// the commit measured first).
std::string sparsify_timing_table(const std::vector<SparsifyTiming>& timings);
std::string sparsify_timing_csv(const std::vector<SparsifyTiming>& timings, const std::string& commit);

}  // namespace esplag
