#include "bench/lib/layer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <utility>

#include "core/device_fill.h"
#include "bench/lib/summary.h"
#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "sparse/cuda/cusparselt.h"

namespace esplag {

namespace {

using gpu::bf16;
using gpu::SparseLinearKind;

// Median of `iters` CUDA-event times of call() after `warmup` untimed calls.
double median_ms(const std::function<void()>& call, int warmup, int iters, cudaStream_t s) {
  return median_event_ms([&](int) { call(); }, warmup, iters, s);
}

std::string shape_text(const LayerBenchShape& s) {
  return std::to_string(s.out) + "x" + std::to_string(s.in) + "x" + std::to_string(s.tokens);
}

std::string version_text(int v) {
  if (v <= 0) return "-";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 100) + "." + std::to_string(v % 100);
}

// CSV-safe: no commas, quotes or line breaks in a free-text field.
std::string csv_text(std::string s) {
  for (char& c : s)
    if (c == ',' || c == '"' || c == '\n' || c == '\r') c = ';';
  return s;
}

}  // namespace

std::vector<LayerBenchShape> default_layer_bench_shapes() {
  return {{5632, 2048, 8192}, {2048, 5632, 8192}, {11008, 4096, 8192}, {4096, 11008, 8192}};
}

LayerBenchResult run_layer_bench(const LayerBenchOptions& opt) {
  ESPLAG_CHECK(opt.warmup >= 0 && opt.iters > 0, "bench layer: --iters must be positive and --warmup not negative");
  ESPLAG_CHECK(!opt.shapes.empty(), "bench layer: no shapes");
  LayerBenchResult r;
  r.warmup = opt.warmup;
  r.iters = opt.iters;
  r.gpu = current_gpu_name();
  r.cusparselt_version = gpu::cusparselt_version();
  if (!gpu::cusparselt_available()) r.cusparselt_unavailable = gpu::cusparselt_unavailable_reason();

  std::vector<SparseLinearKind> kinds = {SparseLinearKind::dense};
  for (SparseLinearKind k : opt.kinds)
    if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) kinds.push_back(k);
  // The layers timed per shape: each kind as it is, each sparse kind again with sparse dW
  // right after it when asked, then semi_sparse_activation's patterns.
  std::vector<LayerBenchRow> variants;
  for (SparseLinearKind k : kinds) {
    variants.push_back({.kind = k});
    if (opt.sparse_dw && k != SparseLinearKind::dense) variants.push_back({.kind = k, .sparse_dw = true});
  }
  for (ActivationSparsity p : opt.activation) variants.push_back({.activation = true, .pattern = p});

  CudaStream stream;
  const cudaStream_t s = stream.s;
  uint64_t seed = 1;
  for (const LayerBenchShape& sh : opt.shapes) {
    ESPLAG_CHECK(sh.out > 0 && sh.in > 0 && sh.tokens > 0, "bench layer: shape ", shape_text(sh),
                 " must have positive sizes");
    const int64_t n_w = sh.out * sh.in, n_x = sh.tokens * sh.in, n_y = sh.tokens * sh.out;
    const char* owner = "bench layer";
    DeviceBuffer w(2 * size_t(n_w), owner, "W"), x(2 * size_t(n_x), owner, "X"), dy(2 * size_t(n_y), owner, "dY"),
        y(2 * size_t(n_y), owner, "Y"), dx(2 * size_t(n_x), owner, "dX"), dw(4 * size_t(n_w), owner, "dW");
    fill_nonzero_bf16(w.bf(), n_w, seed++ * 0x1234567ull, 1.0f / std::sqrt(float(sh.in)), s);
    fill_nonzero_bf16(x.bf(), n_x, seed++ * 0x1234567ull, 1.0f, s);
    fill_nonzero_bf16(dy.bf(), n_y, seed++ * 0x1234567ull, 1.0f, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    double dense_total = 0;
    for (const LayerBenchRow& variant : variants) {
      LayerBenchRow row = variant;
      row.shape = sh;
      const bool baseline = !row.activation && row.kind == SparseLinearKind::dense;
      try {
        // The step's three parts of this row's layer.
        std::unique_ptr<gpu::SparseLinear> layer;
        std::unique_ptr<gpu::SparseActivationLinear> act;
        std::function<void()> prepare = [] {}, forward, backward;
        if (row.activation) {
          act = std::make_unique<gpu::SparseActivationLinear>(
              gpu::SparseActivationLinearOptions{.pattern = row.pattern}, sh.out, sh.in, sh.tokens);
          row.sparse = act->sparse();
          forward = [&] { act->forward(y.bf(), x.bf(), w.bf(), nullptr, sh.tokens, s); };
          backward = [&] { act->backward(dx.bf(), dw.f32(), nullptr, dy.bf(), x.bf(), w.bf(), sh.tokens, false, s); };
        } else {
          gpu::SparseLinearOptions lo;
          lo.kind = row.kind;
          lo.sparse_dw = row.sparse_dw;
          layer = std::make_unique<gpu::SparseLinear>(lo, sh.out, sh.in, sh.tokens, w.bf(), s);
          row.sparse = layer->sparse();
          prepare = [&] { layer->prepare(s); };
          forward = [&] { layer->forward(y.bf(), x.bf(), s); };
          backward = [&] { layer->backward(dx.bf(), dw.f32(), dy.bf(), x.bf(), false, s); };
        }
        // The first step tunes the cuSPARSELt products (and may grow the workspace).
        prepare();
        forward();
        backward();
        CUDA_CHECK(cudaStreamSynchronize(s));
        row.prep_ms = row.activation ? 0.0 : median_ms(prepare, opt.warmup, opt.iters, s);
        row.fwd_ms = median_ms(forward, opt.warmup, opt.iters, s);
        row.bwd_ms = median_ms(backward, opt.warmup, opt.iters, s);
        row.total_ms = median_ms(
            [&] {
              prepare();
              forward();
              backward();
            },
            opt.warmup, opt.iters, s);
        row.ran = true;
      } catch (const Error& e) {
        if (baseline) throw;
        row.note = e.what();
        cudaStreamSynchronize(s);
        cudaGetLastError();
      }
      if (baseline) dense_total = row.total_ms;
      if (row.ran && dense_total > 0) row.speedup = dense_total / row.total_ms;
      r.rows.push_back(row);
    }
  }
  return r;
}

std::string layer_bench_kind_label(const LayerBenchRow& row) {
  if (row.activation) return "activation:" + activation_sparsity_name(row.pattern);
  return gpu::sparse_linear_kind_name(row.kind) + (row.sparse_dw ? "+sparse_dw" : "");
}

std::string layer_bench_table(const LayerBenchResult& r) {
  std::string o;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "Linear training step (prepare + forward + backward dX, dW fp32) on %s, cuSPARSELt %s; "
                "medians of %d steps after %d warm-up\n",
                r.gpu.c_str(), version_text(r.cusparselt_version).c_str(), r.iters, r.warmup);
  o += buf;
  if (r.cusparselt_version == 0)
    o += "cuSPARSELt is not available (" + r.cusparselt_unavailable + "): the sparse kinds run dense\n";
  // The kind column fits "semi_sparse+sparse_dw*" when sparse-dW rows are present.
  const bool any_dw = std::any_of(r.rows.begin(), r.rows.end(), [](const LayerBenchRow& w) { return w.sparse_dw; });
  const int kw = any_dw ? 22 : 19;
  std::snprintf(buf, sizeof buf, "%-*s %-18s %9s %9s %9s %9s %9s\n", kw, "kind", "out x in x tokens", "prep_ms",
                "fwd_ms", "bwd_ms", "total_ms", "vs_dense");
  o += buf;
  std::vector<std::string> meets;
  size_t compared = 0;
  for (const LayerBenchRow& w : r.rows) {
    const bool is_dense = !w.activation && w.kind == gpu::SparseLinearKind::dense;
    const std::string kind = layer_bench_kind_label(w) + (!is_dense && w.ran && !w.sparse ? "*" : "");
    if (!w.ran) {
      std::snprintf(buf, sizeof buf, "%-*s %-18s  did not run: ", kw, kind.c_str(), shape_text(w.shape).c_str());
      o += buf + w.note + "\n";
      continue;
    }
    std::snprintf(buf, sizeof buf, "%-*s %-18s %9.3f %9.3f %9.3f %9.3f %8.2fx\n", kw, kind.c_str(),
                  shape_text(w.shape).c_str(), w.prep_ms, w.fwd_ms, w.bwd_ms, w.total_ms, w.speedup);
    o += buf;
    if (is_dense || !w.sparse) continue;
    ++compared;
    if (w.speedup >= 1.3) {
      std::snprintf(buf, sizeof buf, "%s %s (%.2fx)", layer_bench_kind_label(w).c_str(), shape_text(w.shape).c_str(),
                    w.speedup);
      meets.push_back(buf);
    }
  }
  if (std::any_of(r.rows.begin(), r.rows.end(), [](const LayerBenchRow& w) {
        return w.ran && !w.sparse && (w.activation || w.kind != gpu::SparseLinearKind::dense);
      }))
    o += "* ran dense (no cuSPARSELt)\n";
  if (std::any_of(r.rows.begin(), r.rows.end(), [](const LayerBenchRow& w) { return w.activation; }))
    o += "activation:P = semi_sparse_activation with pattern P (X pruned 2:4 per step, the forward 2:4)\n";
  o += gpu::target_summary(meets, compared, 1.3, "2:4 steps", "", "no 2:4 steps timed");
  return o;
}

std::string layer_bench_csv_header() {
  return "commit,gpu,cusparselt,kind,out,in,tokens,ran,sparse,prep_ms,fwd_ms,bwd_ms,total_ms,speedup_vs_dense,"
         "warmup,iters,note\n";
}

std::string layer_bench_csv_rows(const LayerBenchResult& r, const std::string& commit) {
  std::string o;
  char buf[1024];
  for (const LayerBenchRow& w : r.rows) {
    std::snprintf(buf, sizeof buf, "%s,\"%s\",%s,%s,%lld,%lld,%lld,%d,%d,%.4f,%.4f,%.4f,%.4f,%.3f,%d,%d,",
                  commit.c_str(), r.gpu.c_str(), version_text(r.cusparselt_version).c_str(),
                  layer_bench_kind_label(w).c_str(), static_cast<long long>(w.shape.out),
                  static_cast<long long>(w.shape.in), static_cast<long long>(w.shape.tokens), w.ran ? 1 : 0,
                  w.sparse ? 1 : 0, w.prep_ms, w.fwd_ms, w.bwd_ms, w.total_ms, w.speedup, r.warmup, r.iters);
    o += buf + csv_text(w.note) + "\n";
  }
  return o;
}

}  // namespace esplag
