// `esplag bench gemm`: the GEMMs of a Linear layer, dense (cuBLASLt through gpu::Gemm,
// bf16, fp32 accumulation) against 2:4 sparse (cuSPARSELt through SparseGemm24) with the
// default and with the searched algorithm, in the same process on the same inputs.
//
// Timings are medians of CUDA-event times of single calls after warm-up; inputs are
// random and never zero (|x| in [0.1, 1)); shapes whose operands fit in twice the L2
// cache rotate over several copies of every operand so that no call finds its inputs
// cached by the previous one.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "bench/lib/gemm.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cstdint>
#include <string>
#include <vector>

#include "sparse/cuda/cusparselt.h"

namespace esplag {

struct GemmBenchShape {
  int64_t out = 0, in = 0, tokens = 0;  // W [out, in], N = tokens
  friend bool operator==(const GemmBenchShape&, const GemmBenchShape&) = default;
};

// LLM layer shapes: 8192×2048×16384, 2048×8192×16384, 11008×4096×8192, 4096×11008×8192,
// 4096×4096×8192 (out × in × tokens).
std::vector<GemmBenchShape> default_gemm_bench_shapes();

struct GemmBenchOptions {
  std::vector<GemmBenchShape> shapes = default_gemm_bench_shapes();
  bool forward = true;        // Y = X · Wᵀ
  bool backward_data = true;  // dX = dY · W
  gpu::SparseOperand weight_operand = gpu::SparseOperand::a;
  // true: run cusparseLtMatmulSearch for every problem (and record it in the tuning
  // cache); false: the searched column uses the tuning cache's entry when there is one.
  bool search = true;
  // The 2:4 products' input type. e4m3: W and X quantised to fp8 (forward product with W
  // as A only; dimensions multiples of 32), against the same bf16 dense baseline: what an
  // fp8 2:4 inference GEMM gains over the bf16 dense one (cuBLASLt's fp8 dense GEMM is not
  // timed).
  gpu::SparseDtype dtype = gpu::SparseDtype::bf16;
  int warmup = 10;
  int iters = 50;
};

struct GemmBenchRow {
  GemmBenchShape shape;
  gpu::SparseProduct product = gpu::SparseProduct::forward;
  double flops = 0;
  double dense_ms = 0;
  bool sparse = false;            // cuSPARSELt ran
  std::string sparse_error;       // why not, when it did not
  double default_ms = 0;          // cuSPARSELt's default configuration
  double searched_ms = 0;         // 0 when there is no searched configuration
  gpu::SparseGemm24Config default_config, searched_config;
  bool searched_from_cache = false;
  int max_alg_id = 0;
  double plan_ms = 0;    // descriptors + plan of one problem (host)
  double search_ms = 0;  // cusparseLtMatmulSearch (host, synchronised)

  double dense_tflops() const { return flops / (dense_ms * 1e-3) / 1e12; }
  double speedup_default() const { return default_ms > 0 ? dense_ms / default_ms : 0; }
  double speedup_searched() const { return searched_ms > 0 ? dense_ms / searched_ms : 0; }
};

struct GemmBenchResult {
  std::string gpu;
  int cusparselt_version = 0;         // 0: not available
  std::string cusparselt_unavailable;  // the reason, when not available
  gpu::SparseOperand weight_operand = gpu::SparseOperand::a;
  gpu::SparseDtype dtype = gpu::SparseDtype::bf16;
  int warmup = 0, iters = 0;
  std::vector<GemmBenchRow> rows;
};

// Runs every shape and product. Throws Error when a dense GEMM fails or the device runs
// out of memory; a sparse failure is recorded in the row and the bench goes on.
GemmBenchResult run_gemm_bench(const GemmBenchOptions& options);

// The human table; it ends with the problems whose searched (or else default) 2:4 time
// is at least 1.5x faster than dense.
std::string gemm_bench_table(const GemmBenchResult& r);
// CSV with a leading `commit` column.
std::string gemm_bench_csv_header();
std::string gemm_bench_csv_rows(const GemmBenchResult& r, const std::string& commit);

}  // namespace esplag
