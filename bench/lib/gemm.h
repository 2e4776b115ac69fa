// `esplag bench gemm`: the GEMMs of a Linear layer, dense (cuBLASLt through gpu::Gemm,
// bf16, fp32 accumulation) against 2:4 sparse (cuSPARSELt through SparseGemm24) with the
// default and with the searched algorithm, in the same process on the same inputs.
//
// Timings are medians of CUDA-event times of single calls after warm-up; inputs are
// random and never zero (|x| in [0.1, 1)); shapes whose operands fit in twice the L2
// cache rotate over several copies of every operand so that no call finds its inputs
// cached by the previous one.
//
// `esplag bench gemm --fp8-dense` instead times cuBLASLt's fp8 dense GEMM (gpu::Fp8Gemm,
// e4m3 x e4m3 -> bf16, per-tensor scales) against its bf16 one (gpu::Gemm) for the same
// products, and the kernels that make the fp8 operands (ops/gpu_fp8.h); see
// run_gemm_fp8_bench.
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

// --fp8-dense: per shape and product, the bf16 dense GEMM, the fp8 one with fp32
// accumulation promoted (gpu::Fp8Gemm's default) and with fast accumulation, and the casts
// of the product's token-side operand (X [tokens, in] for fwd, dY [tokens, out] for
// bwd-data): fp8_amax, fp8_cast and fp8_cast_transpose, each timed alone. The fp8 forward
// multiplies X and W in e4m3; the fp8 bwd-data dY (e4m3) and Wᵀ (the transposed cast of
// W), as fp8 training will. Every dimension must be a multiple of 16. A time is 0 when its
// call failed; `failures` then says which call and why (e.g. cuBLASLt's status).
struct GemmFp8Row {
  GemmBenchShape shape;
  gpu::SparseProduct product = gpu::SparseProduct::forward;
  double flops = 0;
  double bf16_ms = 0, fp8_ms = 0, fp8_fast_ms = 0;
  int64_t cast_values = 0;  // of the token-side operand
  double amax_ms = 0, cast_ms = 0, cast_transpose_ms = 0;
  std::vector<std::string> failures;  // "what: message", one per failed call

  double speedup() const { return fp8_ms > 0 ? bf16_ms / fp8_ms : 0; }
  double speedup_fast() const { return fp8_fast_ms > 0 ? bf16_ms / fp8_fast_ms : 0; }
  // Bytes moved per second: amax reads 2 bytes a value, a cast reads 2 and writes 1.
  double amax_gbps() const { return amax_ms > 0 ? 2.0 * double(cast_values) / (amax_ms * 1e6) : 0; }
  double cast_gbps() const { return cast_ms > 0 ? 3.0 * double(cast_values) / (cast_ms * 1e6) : 0; }
  double cast_transpose_gbps() const {
    return cast_transpose_ms > 0 ? 3.0 * double(cast_values) / (cast_transpose_ms * 1e6) : 0;
  }
};

struct GemmFp8Result {
  std::string gpu;
  int warmup = 0, iters = 0;
  std::vector<GemmFp8Row> rows;
};

// Uses the options' shapes, products, warm-up and iterations, and prints each shape, product
// and time to stderr as it goes. A call that fails with an Error (cuBLASLt refusing a GEMM, a
// dimension not a multiple of 16, a GPU without fp8 tensor cores, no device memory for a
// shape's operands) is printed and recorded in its row, and the bench goes on; only an error
// that leaves the device unusable (a sticky CUDA error) ends it.
GemmFp8Result run_gemm_fp8_bench(const GemmBenchOptions& options);
std::string gemm_fp8_bench_table(const GemmFp8Result& r);
std::string gemm_fp8_bench_csv_header();
std::string gemm_fp8_bench_csv_rows(const GemmFp8Result& r, const std::string& commit);

}  // namespace esplag
