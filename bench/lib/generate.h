// Timing of GPU generation (model/gpu_generate.h) for `esplag bench generate`: prefill
// and decode tokens/s of a model preset with random weights, per batch size, as CUDA-event
// medians after warm-up on the generator's stream. Each timed call returns only when its
// logits are on the host, so the times include the logits' copy but not the sampling.
//
// 2:4 models (semi_sparse, slope) run the same dense products of their pruned weights in
// GpuGenerator, so their rows would be those of the dense model: they are not timed apart.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "bench/lib/generate.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace esplag::gpu {

struct GenerateBenchOptions {
  std::string model = "llama-1b";  // a model preset
  int vocab = 0;                   // 0: the preset's (257 where it has none)
  std::vector<int> batches = {1, 32};
  int prompt_len = 128;
  int new_tokens = 128;  // timed decode steps per batch (after the warm-up steps)
  int warmup = 3;        // untimed prefills, and untimed decode steps (the graph's capture among them)
  int prefill_iters = 5;
  uint64_t seed = 1;
};

struct GenerateBenchRow {
  std::string model;
  int batch = 0, prompt_len = 0, new_tokens = 0;
  double prefill_ms = 0, prefill_tokens_per_s = 0;     // median prefill of the batch's prompts
  double decode_step_ms = 0, decode_tokens_per_s = 0;  // median step, batch tokens per step
  size_t device_bytes = 0;                             // the generator's arena
};

// Throws Error naming the option (model, prompt_len + warmup + new_tokens past the preset's
// max_seq_len, ...) that cannot be run.
std::vector<GenerateBenchRow> bench_generate(const GenerateBenchOptions& options);
std::string format_generate_bench(const std::vector<GenerateBenchRow>& rows);
std::string generate_bench_csv(const std::vector<GenerateBenchRow>& rows);

}  // namespace esplag::gpu
