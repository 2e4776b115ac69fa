// Timing of GPU generation (model/gpu_generate.h) for `esplag bench generate`: prefill
// and decode tokens/s of a model preset with random weights, per batch size, as CUDA-event
// medians after warm-up on the generator's stream. Each timed call returns only when its
// logits are on the host, so the times include the logits' copy but not the sampling.
//
// Dense against 2:4: with prune_24 every block Linear's weight is pruned 2:4 along its
// inputs by magnitude first, and each batch size runs twice on those same weights, once
// with dense products only (GpuSparse::off) and once with the prefill's block products
// through cuSPARSELt (GpuSparse::on, every prefill pass however short; decode steps stay
// dense, as in any 2:4 generator), one generator after the other. The 2:4 row reports its
// tokens/s, their ratios to the dense row's, and the relative L2 difference of its last
// prefill's logits from the dense one's.
//
// Each row also says how many forward passes of one prefill ran flash attention (all of
// them when the prompts fit one pass each; GpuGenerator's "Attention").
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
  int chunk_rows = 0;     // GpuGeneratorOptions::chunk_rows (0: the generator's default)
  bool prune_24 = false;  // prune the weights 2:4 and time dense against 2:4 products (above)
  bool op_times = false;  // one more prefill per row with per-op CUDA-event timing (GpuGenerator::set_op_timing)
  uint64_t seed = 1;
};

struct GenerateBenchRow {
  std::string model;
  std::string products;  // "dense" or "2:4" (the prefill's block products)
  int batch = 0, prompt_len = 0, new_tokens = 0;
  double prefill_ms = 0, prefill_tokens_per_s = 0;     // median prefill of the batch's prompts
  double decode_step_ms = 0, decode_tokens_per_s = 0;  // median step, batch tokens per step
  size_t device_bytes = 0;                             // the generator's arena and compressed weights
  int flash_passes = 0;  // passes of one prefill that ran flash attention (GpuGenerator::flash_prefill_passes)
  // The 2:4 row only (0 otherwise): tokens/s over the dense row's of the same batch, and its
  // last prefill's logits against the dense one's (relative L2 over the whole batch).
  double prefill_speedup = 0, decode_speedup = 0, logits_rel_l2 = 0;
  // With op_times: that prefill's time by op kind, in the order the kinds first ran.
  struct Op {
    std::string op;
    double ms = 0;
  };
  std::vector<Op> prefill_ops;
};

// Throws Error naming the option (model, prompt_len + warmup + new_tokens past the preset's
// max_seq_len, ...) that cannot be run, or why the 2:4 products cannot run (cuSPARSELt
// missing, a shape not a multiple of 16).
std::vector<GenerateBenchRow> bench_generate(const GenerateBenchOptions& options);
std::string format_generate_bench(const std::vector<GenerateBenchRow>& rows);
std::string generate_bench_csv(const std::vector<GenerateBenchRow>& rows);

}  // namespace esplag::gpu
