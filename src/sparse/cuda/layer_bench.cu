#include "sparse/cuda/layer_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/error.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/bench_summary.h"

namespace esplag {

namespace {

using gpu::bf16;
using gpu::SparseLinearKind;

// One cudaMalloc'ed buffer for the duration of a shape.
class Buffer {
 public:
  Buffer(size_t bytes, const char* what) {
    const cudaError_t err = cudaMalloc(&p_, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      p_ = nullptr;
      fail("bench layer: cannot allocate ", DeviceArena::format_bytes(bytes), " for ", what, " (",
           cudaGetErrorString(err), ")");
    }
  }
  ~Buffer() {
    if (p_) cudaFree(p_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  bf16* bf() const { return static_cast<bf16*>(p_); }
  float* f32() const { return static_cast<float*>(p_); }

 private:
  void* p_ = nullptr;
};

// |x| uniform in [0.1, 1) times scale with a random sign (splitmix64 of the index): never
// zero, so the timings are those of real data.
__global__ void fill_nonzero_kernel(bf16* p, int64_t n, uint64_t seed, float scale) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float mag = 0.1f + 0.9f * static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
  p[i] = __float2bfloat16_rn((z & 1ull) ? -mag * scale : mag * scale);
}

void fill_nonzero(bf16* p, int64_t n, uint64_t seed, float scale, cudaStream_t s) {
  const int threads = 256;
  fill_nonzero_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, s>>>(p, n, seed, scale);
  CUDA_CHECK_LAUNCH("fill_nonzero_kernel");
}

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
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  r.gpu = prop.name;
  r.cusparselt_version = gpu::cusparselt_version();
  if (!gpu::cusparselt_available()) r.cusparselt_unavailable = gpu::cusparselt_unavailable_reason();

  std::vector<SparseLinearKind> kinds = {SparseLinearKind::dense};
  for (SparseLinearKind k : opt.kinds)
    if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) kinds.push_back(k);

  CudaStream stream;
  const cudaStream_t s = stream.s;
  uint64_t seed = 1;
  for (const LayerBenchShape& sh : opt.shapes) {
    ESPLAG_CHECK(sh.out > 0 && sh.in > 0 && sh.tokens > 0, "bench layer: shape ", shape_text(sh),
                 " must have positive sizes");
    const int64_t n_w = sh.out * sh.in, n_x = sh.tokens * sh.in, n_y = sh.tokens * sh.out;
    Buffer w(2 * size_t(n_w), "W"), x(2 * size_t(n_x), "X"), dy(2 * size_t(n_y), "dY"), y(2 * size_t(n_y), "Y"),
        dx(2 * size_t(n_x), "dX"), dw(4 * size_t(n_w), "dW");
    fill_nonzero(w.bf(), n_w, seed++ * 0x1234567ull, 1.0f / std::sqrt(float(sh.in)), s);
    fill_nonzero(x.bf(), n_x, seed++ * 0x1234567ull, 1.0f, s);
    fill_nonzero(dy.bf(), n_y, seed++ * 0x1234567ull, 1.0f, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    double dense_total = 0;
    for (SparseLinearKind kind : kinds) {
      LayerBenchRow row;
      row.shape = sh;
      row.kind = kind;
      try {
        gpu::SparseLinearOptions lo;
        lo.kind = kind;
        lo.sparse_dw = opt.sparse_dw && kind != SparseLinearKind::dense;
        gpu::SparseLinear layer(lo, sh.out, sh.in, sh.tokens, w.bf(), s);
        row.sparse = layer.sparse();
        // The first step tunes the cuSPARSELt products (and may grow the workspace).
        layer.prepare(s);
        layer.forward(y.bf(), x.bf(), s);
        layer.backward(dx.bf(), dw.f32(), dy.bf(), x.bf(), false, s);
        CUDA_CHECK(cudaStreamSynchronize(s));
        row.prep_ms = median_ms([&] { layer.prepare(s); }, opt.warmup, opt.iters, s);
        row.fwd_ms = median_ms([&] { layer.forward(y.bf(), x.bf(), s); }, opt.warmup, opt.iters, s);
        row.bwd_ms = median_ms([&] { layer.backward(dx.bf(), dw.f32(), dy.bf(), x.bf(), false, s); }, opt.warmup,
                               opt.iters, s);
        row.total_ms = median_ms(
            [&] {
              layer.prepare(s);
              layer.forward(y.bf(), x.bf(), s);
              layer.backward(dx.bf(), dw.f32(), dy.bf(), x.bf(), false, s);
            },
            opt.warmup, opt.iters, s);
        row.ran = true;
      } catch (const Error& e) {
        if (kind == SparseLinearKind::dense) throw;
        row.note = e.what();
        cudaStreamSynchronize(s);
        cudaGetLastError();
      }
      if (kind == SparseLinearKind::dense) dense_total = row.total_ms;
      if (row.ran && dense_total > 0) row.speedup = dense_total / row.total_ms;
      r.rows.push_back(row);
    }
  }
  return r;
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
  std::snprintf(buf, sizeof buf, "%-12s %-18s %9s %9s %9s %9s %9s\n", "kind", "out x in x tokens", "prep_ms",
                "fwd_ms", "bwd_ms", "total_ms", "vs_dense");
  o += buf;
  std::vector<std::string> meets;
  size_t compared = 0;
  for (const LayerBenchRow& w : r.rows) {
    const std::string kind = gpu::sparse_linear_kind_name(w.kind) + (w.kind != gpu::SparseLinearKind::dense &&
                                                                             w.ran && !w.sparse
                                                                         ? "*"
                                                                         : "");
    if (!w.ran) {
      std::snprintf(buf, sizeof buf, "%-12s %-18s  did not run: ", kind.c_str(), shape_text(w.shape).c_str());
      o += buf + w.note + "\n";
      continue;
    }
    std::snprintf(buf, sizeof buf, "%-12s %-18s %9.3f %9.3f %9.3f %9.3f %8.2fx\n", kind.c_str(),
                  shape_text(w.shape).c_str(), w.prep_ms, w.fwd_ms, w.bwd_ms, w.total_ms, w.speedup);
    o += buf;
    if (w.kind == gpu::SparseLinearKind::dense || !w.sparse) continue;
    ++compared;
    if (w.speedup >= 1.3) {
      std::snprintf(buf, sizeof buf, "%s %s (%.2fx)", gpu::sparse_linear_kind_name(w.kind).c_str(),
                    shape_text(w.shape).c_str(), w.speedup);
      meets.push_back(buf);
    }
  }
  if (std::any_of(r.rows.begin(), r.rows.end(), [](const LayerBenchRow& w) {
        return w.ran && !w.sparse && w.kind != gpu::SparseLinearKind::dense;
      }))
    o += "* ran dense (no cuSPARSELt)\n";
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
                  gpu::sparse_linear_kind_name(w.kind).c_str(), static_cast<long long>(w.shape.out),
                  static_cast<long long>(w.shape.in), static_cast<long long>(w.shape.tokens), w.ran ? 1 : 0,
                  w.sparse ? 1 : 0, w.prep_ms, w.fwd_ms, w.bwd_ms, w.total_ms, w.speedup, r.warmup, r.iters);
    o += buf + csv_text(w.note) + "\n";
  }
  return o;
}

}  // namespace esplag
