// Timing of the GPU attention paths (ops/gpu_attention.h) on training shapes: forward
// and backward of each path, CUDA-event medians after warm-up, on one stream, with the
// workspace each path asks for (attention_workspace_bytes). Every row also says how far
// the path's out and dqkv are from those of the shape's first path that ran (relative
// RMS), so a fast path with wrong results is visible in the table itself.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "bench/lib/attention.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ops/gpu_attention.h"

namespace esplag::gpu {

struct AttentionBenchShape {
  std::string name;
  int B = 0, T = 0, NH = 0, NKV = 0, HD = 0;
};

// The training benchmark's shapes (model presets, batch × sequence of scripts/gpu-check.sh):
// gpt2-124m B16 T1024 NH12 NKV12 HD64, gpt2-350m B8 T1024 NH16 NKV16 HD64,
// llama-1b B4 T2048 NH16 NKV16 HD128.
std::vector<AttentionBenchShape> attention_bench_shapes();

struct AttentionBenchOptions {
  int warmup = 3;  // untimed forward + backward pairs per path
  int iters = 20;  // timed pairs; the medians are reported
  std::vector<AttentionPath> paths = {AttentionPath::native, AttentionPath::cudnn,
                                      AttentionPath::cudnn_nondeterministic};
  uint64_t seed = 1234;
};

struct AttentionBenchRow {
  AttentionBenchShape shape;
  AttentionPath path = AttentionPath::native;  // as asked
  bool ran = false;
  std::string note;  // why the path did not run (ran == false)
  double fwd_ms = 0, bwd_ms = 0;  // medians
  // Causal attention FLOPs (half of the T × T products: 2·B·NH·T²·HD forward, 2.5× that
  // backward) over the median time.
  double fwd_tflops = 0, bwd_tflops = 0;
  size_t workspace_bytes = 0;
  // Relative RMS distance of out and dqkv to the shape's first path that ran; -1 for
  // that path itself.
  double out_rel_diff = -1, dqkv_rel_diff = -1;
};

// Runs on the current device; inputs are seeded uniform values of unit variance. Throws
// Error for impossible shapes; a path that cannot run a shape gives a row with the reason.
std::vector<AttentionBenchRow> bench_attention(const std::vector<AttentionBenchShape>& shapes,
                                               const AttentionBenchOptions& options = {});

// A fixed-width table, one row per (shape, path).
std::string format_attention_bench(const std::vector<AttentionBenchRow>& rows);
// The same as CSV with a header line.
std::string attention_bench_csv(const std::vector<AttentionBenchRow>& rows);

}  // namespace esplag::gpu
