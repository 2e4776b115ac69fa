// Timing of full dense training steps on the GPU (forward + backward + AdamW with
// clipping), for `esplag bench train --device cuda`, and where a step's time goes.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "bench/lib/train.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/gpu_transformer.h"

namespace esplag {

// H100 SXM dense bf16 tensor-core peak, TFLOP/s (the MFU denominator by default).
constexpr double kH100DenseBf16Tflops = 989.0;

struct GpuBenchResult {
  std::string model;
  std::string device;  // the GPU's name
  int batch = 0, seq = 0, steps = 0, warmup = 0;
  int64_t params = 0;
  std::vector<double> step_ms;  // every timed step, in order
  double median_ms = 0, min_ms = 0, max_ms = 0;
  double tokens_per_s = 0;
  double tflops = 0;  // achieved, from ModelConfig::train_flops_per_token
  double peak_tflops = 0;
  double mfu = 0;  // tflops / peak_tflops
  size_t arena_capacity_bytes = 0;
  size_t arena_peak_bytes = 0;      // everything the model allocates, cuBLASLt workspace included
  size_t gemm_workspace_bytes = 0;  // the cuBLASLt workspace and bias scratch inside the arena
  size_t device_used_bytes = 0;     // total - free after the run: arena + CUDA context + library state
  double first_loss = 0, last_loss = 0;  // first warm-up step (NaN without warm-up) and last step
  bool cuda_graph = false, recompute = false;  // the GpuModelOptions the run used
  std::string attention;                       // the attention path the step ran
  // With op_profile_steps > 0: per-op times summed over that many extra eager steps
  // (GpuTransformer::set_op_timing), run after the timed ones.
  int op_profile_steps = 0;
  std::vector<GpuOpTime> op_times;
  // The block Linear layers' kinds: "dense", or "KIND N/M (2:4 products for S of D
  // shapes)" (N of the M block linears semi_sparse or slope; how many of their D distinct
  // shapes dispatch chose the 2:4 products for, or "everywhere" without dispatch and for
  // slope), and the device bytes the sparse layers hold outside the arena.
  std::string linears = "dense";
  size_t sparse_bytes = 0;
  std::string dispatch;  // GpuTransformer::sparse_dispatch_summary()
};

// Builds a GpuTransformer for micro-batches B x T (init_weights(1)), runs `warmup`
// untimed and `steps` timed training steps on fixed random tokens, each step timed with
// CUDA events around zero_grad, forward_backward_device and step_adamw (no host
// synchronisation inside a step; with options.cuda_graph, the default, the step replays
// its graphs once warm-up has captured them: give warmup >= 2 to time replays only).
// Then, if op_profile_steps > 0, that many more steps with per-op timing. The block
// linears whose weight name fully matches sparse_regex (ECMAScript; empty: none) are of
// sparse_kind, a kind other than dense that the GPU trains (kinds that take a mask get a
// fixed 2:4 one; GpuTransformer::set_linear_kind, slope with its default mask_change_freq,
// semi_sparse_activation with the pattern `activation`), from the start, with sparse_dw
// when asked (their weight gradients from the MVUE 2:4 of dYᵀ) and, for slope, low-rank
// adapters of lora_rank when > 0 (SLoPe's last phase). Throws Error when the model does not fit or the regex is
// malformed or matches no block linear.
GpuBenchResult bench_train_gpu(const ModelConfig& config, int B, int T, int steps, int warmup,
                               double peak_tflops = kH100DenseBf16Tflops, const GpuModelOptions& options = {},
                               int op_profile_steps = 0, const std::string& sparse_regex = "",
                               const std::string& sparse_kind = "semi_sparse", bool sparse_dw = false,
                               int lora_rank = 0, ActivationSparsity activation = ActivationSparsity::row_24);

// One line comparing a sparse run with its dense baseline (same model and micro-batch,
// timed in the same process): step time and tokens/s ratios, and the model's device
// memory (arena peak + the sparse layers' bytes) as a fraction of the baseline's.
std::string gpu_bench_comparison(const GpuBenchResult& dense, const GpuBenchResult& sparse);

// One human-readable line per result, with a header, and a CSV header / row.
std::string gpu_bench_table_header();
std::string gpu_bench_table_row(const GpuBenchResult& r);
std::string gpu_bench_csv_header();
std::string gpu_bench_csv_row(const GpuBenchResult& r);
// The per-op table of a result with op times: per step, by time, with each op kind's
// share of the profiled step and the TFLOP/s of the matrix products and attention.
std::string gpu_op_profile_table(const GpuBenchResult& r);

}  // namespace esplag
