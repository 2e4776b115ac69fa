#include "bench/lib/train.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <regex>
#include <string>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/device_linear.h"
#include "model/linear_registry.h"
#include "ops/gpu.h"
#include "ops/gpu_attention.h"

namespace esplag {

GpuBenchResult bench_train_gpu(const ModelConfig& config, int B, int T, int steps, int warmup, double peak_tflops,
                               const GpuModelOptions& options, int op_profile_steps,
                               const std::string& sparse_regex, const std::string& sparse_kind, bool sparse_dw,
                               int lora_rank, ActivationSparsity activation) {
  ESPLAG_CHECK(steps > 0 && warmup >= 0, "bench_train_gpu: steps must be positive and warmup not negative, got ",
               steps, " and ", warmup);
  ESPLAG_CHECK(op_profile_steps >= 0, "bench_train_gpu: negative op_profile_steps ", op_profile_steps);
  ESPLAG_CHECK(peak_tflops > 0, "bench_train_gpu: peak TFLOP/s must be positive, got ", peak_tflops);
  GpuBenchResult r;
  r.model = config.preset;
  r.batch = B;
  r.seq = T;
  r.steps = steps;
  r.warmup = warmup;
  r.peak_tflops = peak_tflops;
  r.device = current_gpu_name();
  r.cuda_graph = options.cuda_graph;
  r.recompute = options.recompute;
  r.attention = gpu::attention_path_name(
      gpu::attention_resolve_path(B, T, config.n_head, config.n_kv_head, config.head_dim(), options.attention));

  GpuTransformer model(config, B, T, options);
  r.params = static_cast<int64_t>(model.num_params());
  model.init_weights(1);
  auto sparse_gpu_kind = [](const LinearKindInfo& k) { return k.gpu && k.name != dense_linear_kind(); };
  const LinearKindInfo& info = find_linear_kind(sparse_kind, "bench_train_gpu");
  ESPLAG_CHECK(sparse_gpu_kind(info), "bench_train_gpu: sparse kind '", sparse_kind, "' is not ",
               linear_kind_list(sparse_gpu_kind, "or"));
  const DeviceLinearKind& kind = device_linear_kind(sparse_kind, "bench_train_gpu");
  ESPLAG_CHECK(lora_rank == 0 || kind.takes_adapter, "bench_train_gpu: low-rank adapters are for ",
               device_linear_kind_names([](const DeviceLinearKind& k) { return k.takes_adapter; }), " layers");
  if (!sparse_regex.empty()) {
    std::regex re;
    try {
      re = std::regex(sparse_regex);
    } catch (const std::regex_error& e) {
      fail("bench train: malformed regex '", sparse_regex, "' for the ", sparse_kind, " layers: ", e.what());
    }
    int linears = 0, sparse = 0;
    std::vector<GpuTransformer::LinearKindSetting> settings;
    std::vector<std::vector<uint8_t>> masks;  // masked, vnm: a fixed 2:4 pattern (the speed does not depend on it)
    masks.reserve(model.param_infos().size());
    for (const auto& info : model.param_infos()) {
      if (info.shape.size() != 2 || info.name.rfind("blocks.", 0) != 0) continue;
      ++linears;
      if (!std::regex_match(info.name, re)) continue;
      settings.push_back({info.name, {.kind = sparse_kind, .sparse_dw = sparse_dw}});
      settings.back().dw_seed = 1;
      settings.back().lora_rank = lora_rank;
      settings.back().lora_seed = 1;
      settings.back().activation = activation;
      if (kind.takes_mask) {
        std::vector<uint8_t>& m = masks.emplace_back(info.numel);
        for (size_t i = 0; i < m.size(); ++i) m[i] = i % 4 < 2;
        settings.back().mask = &m;
      }
      ++sparse;
    }
    model.set_linear_kinds(settings);
    ESPLAG_CHECK(sparse > 0, "bench train: the regex '", sparse_regex, "' matches none of the ", linears,
                 " block linear weights (e.g. blocks.0.mlp.fc.weight)");
    r.linears = sparse_kind +
                (info.takes_activation ? ":" + activation_sparsity_name(activation) : "") +
                (sparse_dw ? "+sparse_dw" : "") +
                (lora_rank > 0 ? "+lora" + std::to_string(lora_rank) : "") + " " + std::to_string(sparse) + "/" +
                std::to_string(linears);
  }
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  Rng rng(1);
  for (auto& t : x) t = static_cast<int32_t>(rng.below(config.vocab_size));
  for (auto& t : y) t = static_cast<int32_t>(rng.below(config.vocab_size));
  model.upload_batch(x.data(), y.data(), B, T);

  GpuAdamW hyper;
  hyper.lr = 1e-4;
  auto step = [&]() {
    model.zero_grad();
    model.forward_backward_device(model.device_tokens(), model.device_targets(), B, T, 1.0);
    model.step_adamw(hyper);
  };
  r.first_loss = std::numeric_limits<double>::quiet_NaN();
  for (int s = 0; s < warmup; ++s) {
    step();
    if (s == 0) r.first_loss = model.read_loss();
  }
  model.synchronize();

  CudaEvents ev(2 * size_t(steps));
  for (int s = 0; s < steps; ++s) {
    CUDA_CHECK(cudaEventRecord(ev.e[2 * s], model.stream()));
    step();
    CUDA_CHECK(cudaEventRecord(ev.e[2 * s + 1], model.stream()));
  }
  r.last_loss = model.read_loss();  // synchronises
  for (int s = 0; s < steps; ++s) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, ev.e[2 * s], ev.e[2 * s + 1]));
    r.step_ms.push_back(ms);
  }
  std::vector<double> sorted = r.step_ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  r.median_ms = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  r.min_ms = sorted.front();
  r.max_ms = sorted.back();
  const double tokens = double(B) * T;
  r.tokens_per_s = tokens / (r.median_ms * 1e-3);
  r.tflops = config.train_flops_per_token(T) * tokens / (r.median_ms * 1e-3) / 1e12;
  r.mfu = r.tflops / peak_tflops;
  r.arena_capacity_bytes = model.arena().capacity() + model.state_bytes();
  r.arena_peak_bytes = model.arena().peak() + model.state_bytes();
  r.gemm_workspace_bytes = model.plan().workspace;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  r.device_used_bytes = total_b - free_b;
  r.sparse_bytes = model.sparse_device_bytes();
  r.dispatch = model.sparse_dispatch_summary();
  if (!sparse_regex.empty() && !kind.takes_mask) {  // kinds taking a mask (masked, vnm) run dense products
    int sparse_shapes = 0;
    for (const auto& d : model.sparse_dispatch()) sparse_shapes += d.sparse;
    r.linears += options.sparse_dispatch ? " (2:4 products for " + std::to_string(sparse_shapes) + " of " +
                                               std::to_string(model.sparse_dispatch().size()) + " shapes)"
                                         : " (2:4 products everywhere)";
  }

  if (op_profile_steps > 0) {
    model.set_op_timing(true);
    for (int s = 0; s < op_profile_steps; ++s) step();
    model.synchronize();
    r.op_times = model.op_times();
    r.op_profile_steps = op_profile_steps;
    model.set_op_timing(false);
  }
  return r;
}

std::string gpu_op_profile_table(const GpuBenchResult& r) {
  if (r.op_times.empty() || r.op_profile_steps <= 0) return "";
  std::vector<GpuOpTime> ops = r.op_times;
  std::stable_sort(ops.begin(), ops.end(), [](const GpuOpTime& a, const GpuOpTime& b) { return a.ms > b.ms; });
  double total = 0;
  for (const auto& o : ops) total += o.ms;
  const double k = 1.0 / r.op_profile_steps;
  std::string out;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s %dx%d: %.2f ms per step in ops (eager, per-op events; timed step %.2f ms)\n",
                r.model.c_str(), r.batch, r.seq, total * k, r.median_ms);
  out += buf;
  std::snprintf(buf, sizeof buf, "  %-26s %8s %9s %7s %9s\n", "op", "calls", "ms/step", "share", "TFLOP/s");
  out += buf;
  for (const auto& o : ops) {
    char tf[32] = "";
    if (o.flops > 0 && o.ms > 0) std::snprintf(tf, sizeof tf, "%.0f", o.flops / (o.ms * 1e-3) / 1e12);
    std::snprintf(buf, sizeof buf, "  %-26s %8.0f %9.3f %6.1f%% %9s\n", o.op.c_str(), o.calls * k, o.ms * k,
                  100.0 * o.ms / total, tf);
    out += buf;
  }
  return out;
}

std::string gpu_bench_table_header() {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-10s %-6s %6s %6s %10s %9s %11s %8s %6s %10s %10s\n", "model", "device", "batch",
                "seq", "params(M)", "step_ms", "tok/s", "TFLOP/s", "MFU", "arena_GiB", "loss");
  return buf;
}

std::string gpu_bench_comparison(const GpuBenchResult& dense, const GpuBenchResult& sparse) {
  const double dense_bytes = double(dense.arena_peak_bytes + dense.sparse_bytes);
  const double sparse_bytes = double(sparse.arena_peak_bytes + sparse.sparse_bytes);
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "%s vs dense (same process): step %.2f -> %.2f ms (%.3fx), %.0f -> %.0f tok/s (%.3fx), model memory "
                "%.2f -> %.2f GiB (%.3fx; arena peak + 2:4 copies)\n",
                sparse.linears.c_str(), dense.median_ms, sparse.median_ms, dense.median_ms / sparse.median_ms,
                dense.tokens_per_s, sparse.tokens_per_s, sparse.tokens_per_s / dense.tokens_per_s,
                dense_bytes / double(1 << 30), sparse_bytes / double(1 << 30), sparse_bytes / dense_bytes);
  return buf;
}

std::string gpu_bench_table_row(const GpuBenchResult& r) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%-10s %-6s %6d %6d %10.2f %9.2f %11.0f %8.1f %5.1f%% %10.2f %10.4f   (median of %d after %d "
                "warm-up; min %.2f max %.2f ms; %s; device in use %.2f GiB; graph %s, recompute %s, "
                "attention %s; linears %s%s)\n",
                r.model.c_str(), "cuda", r.batch, r.seq, r.params / 1e6, r.median_ms, r.tokens_per_s, r.tflops,
                100.0 * r.mfu, r.arena_peak_bytes / double(1 << 30), r.last_loss, r.steps, r.warmup, r.min_ms,
                r.max_ms, r.device.c_str(), r.device_used_bytes / double(1 << 30), r.cuda_graph ? "on" : "off",
                r.recompute ? "on" : "off", r.attention.c_str(), r.linears.c_str(),
                r.sparse_bytes ? (", " + DeviceArena::format_bytes(r.sparse_bytes) + " in 2:4 copies").c_str() : "");
  return r.dispatch.empty() ? std::string(buf) : buf + ("  " + r.dispatch + "\n");
}

std::string gpu_bench_csv_header() {
  return "model,device,gpu,batch,seq,params,steps,warmup,step_ms_median,step_ms_min,step_ms_max,tokens_per_s,"
         "tflops,peak_tflops,mfu,arena_peak_bytes,arena_capacity_bytes,gemm_workspace_bytes,device_used_bytes,"
         "first_loss,last_loss,cuda_graph,recompute,attention,linears,sparse_bytes\n";
}

std::string gpu_bench_csv_row(const GpuBenchResult& r) {
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "%s,cuda,\"%s\",%d,%d,%lld,%d,%d,%.4f,%.4f,%.4f,%.1f,%.3f,%.1f,%.5f,%zu,%zu,%zu,%zu,%.6f,%.6f,%d,%d,%s,%s,%zu\n",
                r.model.c_str(), r.device.c_str(), r.batch, r.seq, static_cast<long long>(r.params), r.steps,
                r.warmup, r.median_ms, r.min_ms, r.max_ms, r.tokens_per_s, r.tflops, r.peak_tflops, r.mfu,
                r.arena_peak_bytes, r.arena_capacity_bytes, r.gemm_workspace_bytes, r.device_used_bytes,
                r.first_loss, r.last_loss, r.cuda_graph ? 1 : 0, r.recompute ? 1 : 0, r.attention.c_str(),
                r.linears.c_str(), r.sparse_bytes);
  return buf;
}

}  // namespace esplag
