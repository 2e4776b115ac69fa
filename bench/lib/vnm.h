// Timing of the V:2:M sparse-tensor-core GEMM (sparse/cuda/vnm_gemm.h) against the dense
// bf16 cuBLASLt GEMM (gpu::Gemm::forward) on the same shapes, both computing the forward
// of a Linear Y[tokens, out] = X[tokens, in] · Wᵀ with bf16 output.
//
// Per shape, fresh random data (never zeros): X on the device, the dense weight fully
// random for the cuBLASLt baseline, and a random valid V:2:M weight per pattern, converted
// once (outside the timing). Each GEMM is timed alone with CUDA events after warm-up; the
// result is the median. A spot check compares a few output rows of the sparse GEMM with a
// host computation, so a fast but wrong kernel shows in the table.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "bench/lib/vnm.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cstdint>
#include <string>
#include <vector>

#include "sparse/compressed.h"

namespace esplag::gpu {

struct VnmBenchShape {
  int64_t out = 0, in = 0, tokens = 0;  // W [out, in], X [tokens, in]
};

struct VnmBenchPattern {
  int v = 0, m = 0;  // V:2:M
};

struct VnmBenchResult {
  VnmBenchPattern pattern;
  VnmBenchShape shape;
  double dense_ms = 0;      // median, cuBLASLt dense bf16
  double wgmma_ms = 0;      // median, wgmma.sp kernel on X [tokens, in] (0: not available on this device)
  double wgmma_xt_ms = 0;   // median, wgmma.sp kernel on Xᵀ [in, tokens] (0: not available)
  double vnm_ms = 0;        // median, mma.sp kernel (the fallback) on X [tokens, in]
  double vnm_xt_ms = 0;     // median, mma.sp kernel on Xᵀ
  double transpose_ms = 0;  // median, vnm_transpose_input (what the Xᵀ paths add when X is [tokens, in])
  double speedup = 0;       // dense_ms / wgmma_ms (0 without wgmma.sp)
  double speedup_xt = 0;    // dense_ms / wgmma_xt_ms (Xᵀ already there; 0 without wgmma.sp)
  double speedup_mma = 0;   // dense_ms / vnm_ms
  double dense_tflops = 0;  // 2·out·in·tokens / dense time
  double kept_tflops = 0;   // 2·out·tokens·(in·2/M) (kept weights only) / fastest wgmma.sp time (mma.sp without it)
  double peak_fraction = 0; // kept_tflops / the wgmma.sp peak of kept products (0 where unknown)
  double spot_rel_error = 0;  // max |gpu - host| / rms(host) over the checked rows, all paths (inf: not finite)
  std::string spot_worst_path;  // the path with that error: "wgmma X", "wgmma Xt", "mma X", "mma Xt", "2:4"
  // The same weight as a dense W that is 2:4 along its rows (M a multiple of 4), on
  // cuSPARSELt's 2:4 product (model/cuda/rows_24_forward.h, what masked and vnm layers run):
  // median product time, its compression from W (once per weight change), dense_ms over the
  // product. 0 where it does not apply.
  double as24_ms = 0, as24_compress_ms = 0, speedup_24 = 0;
};

// The wgmma.sp peak in TFLOP/s of kept products on the current device: a 2:4 sparse wgmma
// does k32 in the time of a dense k16, so kept products run at the dense bf16 rate, 4096
// FLOP per cycle per SM on sm_90 at the peak clock. 0 on other devices.
double vnm_wgmma_sp_peak_tflops();

// The benchmark shapes of llama-1b/7b GEMMs (out, in, tokens): 8192×2048×16384, 2048×8192×16384,
// 11008×4096×8192, 4096×11008×8192, 4096×4096×8192 (11008 = 64·172 = 256·43, so every
// pattern divides it without padding), llama-1b's MLP at 4 × 2048 tokens, 5632×2048×8192
// and 2048×5632×8192, and llama-13b's fc, 13824×5120×8192 (the one 64:2:5 divides: in 5120).
std::vector<VnmBenchShape> vnm_bench_default_shapes();
// 64:2:8, 128:2:8, 64:2:16, 64:2:5 (vnm_bench skips a pattern on shapes it does not divide).
std::vector<VnmBenchPattern> vnm_bench_default_patterns();

// Runs every pattern on every shape it divides (out % V, in % M) on the current device: the
// wgmma.sp kernel where available, the mma.sp kernel (warp tile automatic), each chosen
// explicitly (ESPLAG_VNM_KERNEL does not apply), and the 2:4 route where it applies. Throws
// esplag::Error when the device lacks memory.
std::vector<VnmBenchResult> vnm_bench(const std::vector<VnmBenchShape>& shapes,
                                      const std::vector<VnmBenchPattern>& patterns, int warmup = 5, int iters = 20,
                                      uint64_t seed = 1);

// A fixed-width table, one line per result, with a header (what a CLI prints).
std::string vnm_bench_table(const std::vector<VnmBenchResult>& results);
// CSV with a header line: v,m,out,in,tokens,dense_ms,wgmma_ms,wgmma_xt_ms,vnm_ms,vnm_xt_ms,...
std::string vnm_bench_csv(const std::vector<VnmBenchResult>& results);

// A random valid V:2:M weight in the CPU compressed layout (bf16 values, never zero):
// random selected columns per block, random 2-of-4 choice per row. Fast (no dense pass).
CompressedVNMBf16 random_vnm_weight(int64_t rows, int64_t cols, int v, int m, uint64_t seed);

}  // namespace esplag::gpu
