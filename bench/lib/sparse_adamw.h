// Timing of SLoPe's optimizer-side kernels (sparse/cuda/sparse_adamw.h) against the dense
// AdamW (ops/gpu.h) on the same dense weight shape.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "bench/lib/sparse_adamw.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace esplag::gpu {

struct SparseAdamWBenchRow {
  std::string op;  // e.g. "dense adamw", "sparse adamw dW=f32"
  int64_t rows = 0, cols = 0;  // the dense weight shape [out, in]
  int iters = 0, warmup = 0;
  double median_ms = 0, min_ms = 0, max_ms = 0;
  double bytes = 0;     // the bytes one call must move (reads + writes of its operands)
  double gbps = 0;      // bytes / median time, in 1e9 bytes per second
  double vs_dense = 0;  // the dense AdamW's median on this shape / this median
};

struct SparseAdamWBenchResult {
  std::string device;  // the GPU's name
  std::vector<SparseAdamWBenchRow> rows;
};

// For every [rows, cols] (multiples of 4), on random non-zero data made on the device:
//   dense adamw              gpu::adamw_update, one decayed segment of rows·cols, bf16
//                            weight copy, clipping from a device norm
//   dense grad norm          gpu::global_norm_squared over the dense fp32 gradient
//   sparse adamw dW=f32      sparse_adamw_update from an fp32 dW (lr, step and the clip
//                            norm from device memory, as a CUDA graph would replay it)
//   sparse adamw dW=f32 +W   the same, also writing the pruned dense bf16 W
//   sparse adamw dW=bf16     from a bf16 dW
//   sparse grad norm dW=f32  sparse_grad_norm_squared_add
//   slope refresh            slope_backward_refresh from the fp32 master values
//   slope refill             slope_backward_refill from the bf16 values
// Each op runs `warmup` untimed calls, then `iters` calls each timed with its own pair of
// CUDA events on one stream; the medians are reported. Every buffer is far larger than
// L2 at the default shapes, so one input set suffices. Throws Error on bad arguments or
// when the buffers do not fit on the device.
SparseAdamWBenchResult bench_sparse_adamw(const std::vector<std::array<int64_t, 2>>& shapes = {{4096, 11008},
                                                                                               {2048, 5632}},
                                          int warmup = 5, int iters = 50);

// A human-readable table (one line per row, with a header and the device), and CSV.
std::string sparse_adamw_bench_table(const SparseAdamWBenchResult& r);
std::string sparse_adamw_bench_csv_header();
std::string sparse_adamw_bench_csv_row(const SparseAdamWBenchResult& r, const SparseAdamWBenchRow& row);

}  // namespace esplag::gpu
