// Timing of SLoPe's merged sparse + low-rank inference product (sparse/cuda/slope_merged.h)
// against the dense cuBLASLt GEMM and against the adapter added in separate passes, in one
// process on the same data (`esplag bench slope-merged`).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "bench/lib/slope_merged.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace esplag::gpu {

struct SlopeMergedBenchRow {
  int64_t out = 0, in = 0, tokens = 0;
  int rank = 0;
  double dense_ms = 0;     // cuBLASLt Y = X·Wᵀ + b, W dense [out, in] (what a dense layer runs)
  double sparse_ms = 0;    // the 2:4 product of W1 alone (+ b), no adapter
  double two_pass_ms = 0;  // 2:4 product, then T = X·Rᵀ and Y += T·Lᵀ on cuBLASLt
  double merged_ms = 0;    // SlopeMergedLinear: T̃ = X·R̃ᵀ, then one 2:4 product over [X | T̃]
  bool sparse = false;     // the 2:4 products ran (false: cuSPARSELt missing, all dense)
  // ‖Y_merged − Y_two_pass‖ / ‖Y_two_pass‖ over the first token rows: both compute the
  // same function, so this is bf16 rounding (a sanity check, not a test).
  double rel_diff = 0;
};

struct SlopeMergedBenchResult {
  std::string device;
  int cusparselt_version = 0;  // 0: not available
  int warmup = 0, iters = 0;
  std::vector<SlopeMergedBenchRow> rows;
};

// Default shapes (out, in, tokens): the llama-1b and llama-7b MLP at 8192 tokens; default
// ranks: 16 and 64 (SLoPe's adapters are about 1-3% of the hidden size).
std::vector<std::array<int64_t, 3>> slope_merged_bench_default_shapes();
std::vector<int> slope_merged_bench_default_ranks();

// For every shape and rank: random non-zero X, bias, L and R, a random row-wise 2:4 W1;
// each variant runs `warmup` untimed calls (the first tunes the 2:4 products), then the
// median of `iters` CUDA-event timed calls. Throws Error for sizes that are not multiples
// of 16 or ranks outside [1, min(out, in)].
SlopeMergedBenchResult bench_slope_merged(const std::vector<std::array<int64_t, 3>>& shapes,
                                          const std::vector<int>& ranks, int warmup = 5, int iters = 20);

std::string slope_merged_bench_table(const SlopeMergedBenchResult& r);
std::string slope_merged_bench_csv_header();
std::string slope_merged_bench_csv_rows(const SlopeMergedBenchResult& r, const std::string& commit);

}  // namespace esplag::gpu
