#include "bench/lib/generate.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>

#include "core/cuda_timing.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/gpu_generate.h"
#include "model/transformer.h"

namespace esplag::gpu {

std::vector<GenerateBenchRow> bench_generate(const GenerateBenchOptions& o) {
  ModelConfig c = model_preset(o.model);
  if (o.vocab > 0) c.vocab_size = o.vocab;
  if (c.vocab_size == 0) c.vocab_size = 257;
  ESPLAG_CHECK(!o.batches.empty(), "bench generate: --batch lists no batch size");
  ESPLAG_CHECK(o.prompt_len > 0 && o.new_tokens > 0 && o.warmup >= 0 && o.prefill_iters > 0,
               "bench generate: --prompt-len and --new-tokens must be positive");
  const int max_len = o.prompt_len + o.warmup + o.new_tokens;
  ESPLAG_CHECK(max_len <= c.max_seq_len, "bench generate: --prompt-len ", o.prompt_len, " + --new-tokens ", o.new_tokens,
               " + ", o.warmup, " warm-up steps exceed ", o.model, "'s max_seq_len=", c.max_seq_len);
  Transformer<float> model(c);
  model.init_weights(o.seed);
  std::vector<GenerateBenchRow> rows;
  for (const int B : o.batches) {
    ESPLAG_CHECK(B > 0, "bench generate: --batch sizes must be positive, got ", B);
    GpuGenerator gen(model, B, max_len);
    Rng rng(o.seed + B);
    std::vector<std::vector<int32_t>> prompts(B, std::vector<int32_t>(o.prompt_len));
    for (auto& p : prompts)
      for (auto& id : p) id = static_cast<int32_t>(rng.below(c.vocab_size));
    GenerateBenchRow r;
    r.model = o.model;
    r.batch = B;
    r.prompt_len = o.prompt_len;
    r.new_tokens = o.new_tokens;
    r.device_bytes = gen.device_bytes();
    r.prefill_ms = median_of(event_times_ms([&](int) { gen.prefill(prompts); }, o.warmup, o.prefill_iters, gen.stream()));
    r.prefill_tokens_per_s = double(B) * o.prompt_len / (r.prefill_ms * 1e-3);
    // Decode steps from the last prefill on: positions prompt_len .. max_len - 1.
    std::vector<int32_t> next(B);
    for (auto& id : next) id = static_cast<int32_t>(rng.below(c.vocab_size));
    r.decode_step_ms = median_of(event_times_ms([&](int) { gen.decode_step(next); }, o.warmup, o.new_tokens, gen.stream()));
    r.decode_tokens_per_s = double(B) / (r.decode_step_ms * 1e-3);
    rows.push_back(r);
  }
  return rows;
}

std::string format_generate_bench(const std::vector<GenerateBenchRow>& rows) {
  std::ostringstream out;
  char line[256];
  std::snprintf(line, sizeof line, "%-10s %6s %7s %5s %11s %14s %10s %13s %10s\n", "model", "batch", "prompt", "new",
                "prefill_ms", "prefill_tok/s", "decode_ms", "decode_tok/s", "memory_MiB");
  out << line;
  for (const auto& r : rows) {
    std::snprintf(line, sizeof line, "%-10s %6d %7d %5d %11.2f %14.0f %10.3f %13.0f %10.0f\n", r.model.c_str(), r.batch,
                  r.prompt_len, r.new_tokens, r.prefill_ms, r.prefill_tokens_per_s, r.decode_step_ms,
                  r.decode_tokens_per_s, r.device_bytes / 1048576.0);
    out << line;
  }
  out << "decode_ms: the median step (one token per sequence). 2:4 models (semi_sparse, slope) run the same dense\n"
         "products of their pruned weights here, so their tokens/s are these.\n";
  return out.str();
}

std::string generate_bench_csv(const std::vector<GenerateBenchRow>& rows) {
  std::ostringstream out;
  out << "model,batch,prompt_len,new_tokens,prefill_ms,prefill_tokens_per_s,decode_step_ms,decode_tokens_per_s,"
         "device_bytes\n";
  char line[256];
  for (const auto& r : rows) {
    std::snprintf(line, sizeof line, "%s,%d,%d,%d,%.4f,%.1f,%.5f,%.1f,%zu\n", r.model.c_str(), r.batch, r.prompt_len,
                  r.new_tokens, r.prefill_ms, r.prefill_tokens_per_s, r.decode_step_ms, r.decode_tokens_per_s,
                  r.device_bytes);
    out << line;
  }
  return out.str();
}

}  // namespace esplag::gpu
