#include "bench/lib/generate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>

#include "core/cuda_timing.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/gpu_generate.h"
#include "model/transformer.h"
#include "sparse/masks.h"

namespace esplag::gpu {

namespace {

// Every block Linear's weight keeps the 2 largest magnitudes of each 4 consecutive inputs.
void prune_24(Transformer<float>& model) {
  for (const std::string& name : model.linear_names()) {
    const LinearParams<float> p = model.linear_params(name);
    const cpu::Mask mask = cpu::nm_mask(p.weight, p.out_features, p.in_features, 2, 4);
    cpu::apply_mask(p.weight, mask.data(), int64_t(p.out_features) * p.in_features);
  }
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    ref += double(want[i]) * want[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

}  // namespace

std::vector<GenerateBenchRow> bench_generate(const GenerateBenchOptions& o) {
  ModelConfig c = model_preset(o.model);
  if (o.vocab > 0) c.vocab_size = o.vocab;
  if (c.vocab_size == 0) c.vocab_size = 257;
  ESPLAG_CHECK(!o.batches.empty(), "bench generate: --batch lists no batch size");
  ESPLAG_CHECK(o.prompt_len > 0 && o.new_tokens > 0 && o.warmup >= 0 && o.prefill_iters > 0,
               "bench generate: --prompt-len and --new-tokens must be positive");
  ESPLAG_CHECK(o.chunk_rows >= 0, "bench generate: --chunk-rows must not be negative, got ", o.chunk_rows);
  const int max_len = o.prompt_len + o.warmup + o.new_tokens;
  ESPLAG_CHECK(max_len <= c.max_seq_len, "bench generate: --prompt-len ", o.prompt_len, " + --new-tokens ", o.new_tokens,
               " + ", o.warmup, " warm-up steps exceed ", o.model, "'s max_seq_len=", c.max_seq_len);
  Transformer<float> model(c);
  model.init_weights(o.seed);
  if (o.prune_24) prune_24(model);
  std::vector<GpuSparse> runs = {GpuSparse::off};
  if (o.prune_24) runs.push_back(GpuSparse::on);
  std::vector<GenerateBenchRow> rows;
  for (const int B : o.batches) {
    ESPLAG_CHECK(B > 0, "bench generate: --batch sizes must be positive, got ", B);
    Rng rng(o.seed + B);
    std::vector<std::vector<int32_t>> prompts(B, std::vector<int32_t>(o.prompt_len));
    for (auto& p : prompts)
      for (auto& id : p) id = static_cast<int32_t>(rng.below(c.vocab_size));
    std::vector<int32_t> next(B);
    for (auto& id : next) id = static_cast<int32_t>(rng.below(c.vocab_size));
    std::vector<float> dense_logits;
    for (const GpuSparse sparse : runs) {
      GpuGeneratorOptions go;
      go.chunk_rows = o.chunk_rows;
      go.sparse = sparse;
      go.sparse_min_rows = 1;  // the 2:4 run's every prefill pass sparse, however short
      GpuGenerator gen(model, B, max_len, go);
      GenerateBenchRow r;
      r.model = o.model;
      r.products = sparse == GpuSparse::on ? "2:4" : "dense";
      r.batch = B;
      r.prompt_len = o.prompt_len;
      r.new_tokens = o.new_tokens;
      r.device_bytes = gen.device_bytes();
      std::vector<float> logits;
      r.prefill_ms =
          median_of(event_times_ms([&](int) { logits = gen.prefill(prompts); }, o.warmup, o.prefill_iters,
                                   gen.stream()));
      r.prefill_tokens_per_s = double(B) * o.prompt_len / (r.prefill_ms * 1e-3);
      r.flash_passes = static_cast<int>(gen.flash_prefill_passes() / (o.warmup + o.prefill_iters));
      // Decode steps from the last prefill on: positions prompt_len .. max_len - 1.
      r.decode_step_ms =
          median_of(event_times_ms([&](int) { gen.decode_step(next); }, o.warmup, o.new_tokens, gen.stream()));
      r.decode_tokens_per_s = double(B) / (r.decode_step_ms * 1e-3);
      if (o.op_times) {
        gen.set_op_timing(true);
        gen.prefill(prompts);
        for (const GpuOpTime& t : gen.op_times()) r.prefill_ops.push_back({t.op, t.ms});
        gen.set_op_timing(false);
      }
      if (sparse == GpuSparse::off) {
        dense_logits = std::move(logits);
      } else {
        const GenerateBenchRow& dense = rows.back();
        r.prefill_speedup = r.prefill_tokens_per_s / dense.prefill_tokens_per_s;
        r.decode_speedup = r.decode_tokens_per_s / dense.decode_tokens_per_s;
        r.logits_rel_l2 = rel_l2(logits, dense_logits);
      }
      rows.push_back(r);
    }
  }
  return rows;
}

std::string format_generate_bench(const std::vector<GenerateBenchRow>& rows) {
  std::ostringstream out;
  char line[320];
  std::snprintf(line, sizeof line, "%-10s %-8s %6s %7s %5s %11s %6s %14s %10s %13s %10s\n", "model", "products",
                "batch", "prompt", "new", "prefill_ms", "flash", "prefill_tok/s", "decode_ms", "decode_tok/s",
                "memory_MiB");
  out << line;
  bool compared = false;
  for (const auto& r : rows) {
    std::snprintf(line, sizeof line, "%-10s %-8s %6d %7d %5d %11.2f %6d %14.0f %10.3f %13.0f %10.0f\n",
                  r.model.c_str(), r.products.c_str(), r.batch, r.prompt_len, r.new_tokens, r.prefill_ms,
                  r.flash_passes, r.prefill_tokens_per_s, r.decode_step_ms, r.decode_tokens_per_s,
                  r.device_bytes / 1048576.0);
    out << line;
    compared = compared || r.products == "2:4";
  }
  for (const auto& r : rows)
    if (r.products == "2:4") {
      std::snprintf(line, sizeof line,
                    "batch %d: 2:4 over dense: prefill x%.2f, decode x%.2f; prefill logits' relative L2 difference "
                    "%.2e\n",
                    r.batch, r.prefill_speedup, r.decode_speedup, r.logits_rel_l2);
      out << line;
    }
  for (const auto& r : rows) {
    if (r.prefill_ops.empty()) continue;
    double total = 0;
    for (const auto& op : r.prefill_ops) total += op.ms;
    std::snprintf(line, sizeof line, "prefill of batch %d, %s products, by op (%.2f ms with per-op events):\n",
                  r.batch, r.products.c_str(), total);
    out << line;
    for (const auto& op : r.prefill_ops) {
      std::snprintf(line, sizeof line, "  %-36s %9.2f ms %5.1f%%\n", op.op.c_str(), op.ms,
                    total > 0 ? 100 * op.ms / total : 0.0);
      out << line;
    }
  }
  out << "flash: the prefill's forward passes that ran flash attention (the others attend over the KV cache).\n"
         "decode_ms: the median step (one token per sequence).";
  if (compared)
    out << " Both rows of a batch run the same 2:4-pruned weights; 2:4 runs the\n"
           "prefill's block products through cuSPARSELt, its decode steps stay dense.\n";
  else
    out << " --prune-24 adds the 2:4 prefill (cuSPARSELt) on the same weights pruned 2:4.\n";
  return out.str();
}

std::string generate_bench_csv(const std::vector<GenerateBenchRow>& rows) {
  std::ostringstream out;
  out << "model,products,batch,prompt_len,new_tokens,prefill_ms,prefill_tokens_per_s,decode_step_ms,"
         "decode_tokens_per_s,device_bytes,prefill_speedup,decode_speedup,logits_rel_l2,flash_passes\n";
  char line[320];
  for (const auto& r : rows) {
    std::snprintf(line, sizeof line, "%s,%s,%d,%d,%d,%.4f,%.1f,%.5f,%.1f,%zu,%.4f,%.4f,%.3e,%d\n", r.model.c_str(),
                  r.products.c_str(), r.batch, r.prompt_len, r.new_tokens, r.prefill_ms, r.prefill_tokens_per_s,
                  r.decode_step_ms, r.decode_tokens_per_s, r.device_bytes, r.prefill_speedup, r.decode_speedup,
                  r.logits_rel_l2, r.flash_passes);
    out << line;
  }
  return out.str();
}

}  // namespace esplag::gpu
