#include "bench/lib/sparsify.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "core/device_fill.h"
#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/error.h"
#include "sparse/cuda/cusparselt_layout.h"
#include "sparse/cuda/sparsify.h"
#include "sparse/mvue.h"

namespace esplag {

namespace {

using gpu::bf16;
using gpu::Sparse24Out;

}  // namespace

std::vector<SparsifyShape> default_sparsify_shapes() { return {{4096, 11008}, {11008, 4096}, {2048, 8192}}; }

std::vector<SparsifyTiming> bench_sparsify(const std::vector<SparsifyShape>& shapes, int iters, int warmup) {
  ESPLAG_CHECK(iters > 0 && warmup >= 0, "bench_sparsify: need iters > 0 and warmup >= 0, got ", iters, ", ",
               warmup);
  int64_t n_max = 0, meta_max = 0;
  for (const auto& s : shapes) {
    ESPLAG_CHECK(s.rows > 0 && s.cols > 0 && s.rows % 4 == 0 && s.cols % 4 == 0,
                 "bench_sparsify: shapes must be positive multiples of 4, got [", s.rows, ", ", s.cols, "]");
    n_max = std::max(n_max, s.rows * s.cols);
    meta_max = std::max({meta_max, s.rows * ((s.cols + 15) / 16), s.cols * ((s.rows + 15) / 16)});
  }
  if (shapes.empty()) return {};

  const std::string gpu = current_gpu_name();

  // Two inputs, every output form, and a copy source and destination for the largest
  // traffic (dense + dense_t: 6 bytes per value, copied as 3 + 3).
  const size_t n = size_t(n_max), meta_words = size_t(meta_max);
  const size_t layout_bytes = n + n / 8;  // cuSPARSELt's compressed 2:4 buffer of n values
  DeviceArena arena(2 * 2 * n + 2 * 2 * n + 2 * n + 2 * 2 * meta_words + 2 * 3 * n + 2 * layout_bytes +
                        (size_t(16) << 20),
                    "sparsify bench");
  bf16* in[2] = {arena.allocate_array<bf16>("input 0", n), arena.allocate_array<bf16>("input 1", n)};
  bf16* dense = arena.allocate_array<bf16>("dense", n);
  bf16* dense_t = arena.allocate_array<bf16>("dense_t", n);
  bf16* values = arena.allocate_array<bf16>("values", n / 2);
  bf16* values_t = arena.allocate_array<bf16>("values_t", n / 2);
  uint16_t* meta = arena.allocate_array<uint16_t>("meta", meta_words);
  uint16_t* meta_t = arena.allocate_array<uint16_t>("meta_t", meta_words);
  void* layout = arena.allocate("cuSPARSELt layout", layout_bytes);
  void* layout_t = arena.allocate("cuSPARSELt layout of the transpose", layout_bytes);
  void* copy_src = arena.allocate("copy source", 3 * n);
  void* copy_dst = arena.allocate("copy destination", 3 * n);

  CudaStream stream;
  for (int k = 0; k < 2; ++k) {
    fill_nonzero_bf16(reinterpret_cast<bf16*>(in[k]), int64_t(n), 1234 + k, 1.0f, stream.s);
  }
  CUDA_CHECK(cudaMemsetAsync(copy_src, 0x3c, 3 * n, stream.s));

  std::vector<SparsifyTiming> out;
  std::map<size_t, double> copy_ms;  // by bytes copied
  for (const auto& s : shapes) {
    const int64_t R = s.rows, C = s.cols;
    const double v = double(R) * double(C);
    const double mb = double(R) * double((C / 4 + 3) / 4) * 2, mb_t = double(C) * double((R / 4 + 3) / 4) * 2;
    const Sparse24Out none{};
    const Sparse24Out d{dense, nullptr, nullptr}, dt{dense_t, nullptr, nullptr};
    const Sparse24Out c{nullptr, values, meta}, ct{nullptr, values_t, meta_t};

    struct Case {
      const char* kernel;
      const char* outputs;
      double bytes;
      std::function<void(const bf16*)> run;
    };
    const std::vector<Case> cases = {
        {"transposable_24", "dense+dense_t", 6 * v,
         [&](const bf16* x) { gpu::transposable_24(x, R, C, d, dt, nullptr, stream.s); }},
        {"transposable_24", "compressed+compressed_t", 2 * v + 2 * v + mb + mb_t,
         [&](const bf16* x) { gpu::transposable_24(x, R, C, c, ct, nullptr, stream.s); }},
        // semi_sparse's preparation in the GPU model: both cuSPARSELt buffers, no dense copy
        {"cusparselt24_prune_compress", "cusparselt+cusparselt_t", 2 * v + 2 * (v + v / 8),
         [&](const bf16* x) { gpu::cusparselt24_prune_compress(x, R, C, nullptr, layout, layout_t, stream.s); }},
        {"cusparselt24_prune_compress", "dense+cusparselt+cusparselt_t", 4 * v + 2 * (v + v / 8),
         [&](const bf16* x) { gpu::cusparselt24_prune_compress(x, R, C, dense, layout, layout_t, stream.s); }},
        {"double_prune_24", "compressed+compressed_t", 2 * v + 2 * v + mb + mb_t,
         [&](const bf16* x) { gpu::double_prune_24(x, R, C, c, ct, nullptr, nullptr, stream.s); }},
        {"activation_24_rows", "dense", 4 * v, [&](const bf16* x) { gpu::activation_24_rows(x, R, C, d, stream.s); }},
        {"activation_24_rows", "compressed", 3 * v + mb,
         [&](const bf16* x) { gpu::activation_24_rows(x, R, C, c, stream.s); }},
        {"activation_24_tiles", "dense", 4 * v,
         [&](const bf16* x) { gpu::activation_24_tiles(x, R, C, d, none, stream.s); }},
        {"mvue_24", "dense", 4 * v, [&](const bf16* x) { gpu::mvue_24(x, R, C, 7, d, stream.s); }},
        {"mvue_24", "compressed", 3 * v + mb, [&](const bf16* x) { gpu::mvue_24(x, R, C, 7, c, stream.s); }},
    };
    for (const Case& k : cases) {
      if (std::string(k.kernel).rfind("cusparselt24", 0) == 0 && gpu::cusparselt24_layout_bytes(R, C) == 0)
        continue;  // the layout writer needs multiples of 64
      SparsifyTiming t;
      t.kernel = k.kernel;
      t.outputs = k.outputs;
      t.rows = R;
      t.cols = C;
      t.bytes = k.bytes;
      t.device = gpu;
      t.median_ms = median_event_ms([&](int i) { k.run(in[i % 2]); }, warmup, iters, stream.s);
      const size_t half = (size_t(k.bytes / 2) + 15) / 16 * 16;
      if (!copy_ms.count(half))
        copy_ms[half] = median_event_ms(
            [&](int) { CUDA_CHECK(cudaMemcpyAsync(copy_dst, copy_src, half, cudaMemcpyDeviceToDevice, stream.s)); },
            warmup, iters, stream.s);
      t.copy_median_ms = copy_ms[half];
      t.gbps = t.bytes / (t.median_ms * 1e6);
      t.copy_gbps = 2.0 * double(half) / (t.copy_median_ms * 1e6);
      t.vs_copy = t.copy_median_ms / t.median_ms;
      out.push_back(t);
    }
  }
  return out;
}

std::string sparsify_timing_table(const std::vector<SparsifyTiming>& timings) {
  std::string s;
  char buf[512];
  std::snprintf(buf, sizeof buf, "%-27s %-29s %13s %9s %9s %9s %9s %8s\n", "kernel", "outputs", "shape", "ms",
                "GB/s", "copy ms", "copy GB/s", "vs copy");
  s += buf;
  for (const auto& t : timings) {
    char shape[64];
    std::snprintf(shape, sizeof shape, "%lldx%lld", static_cast<long long>(t.rows), static_cast<long long>(t.cols));
    std::snprintf(buf, sizeof buf, "%-27s %-29s %13s %9.4f %9.0f %9.4f %9.0f %7.0f%%\n", t.kernel.c_str(),
                  t.outputs.c_str(), shape, t.median_ms, t.gbps, t.copy_median_ms, t.copy_gbps, 100.0 * t.vs_copy);
    s += buf;
  }
  if (!timings.empty()) s += "(" + timings.front().device + "; medians of CUDA-event timings after warm-up)\n";
  return s;
}

std::string sparsify_timing_csv(const std::vector<SparsifyTiming>& timings, const std::string& commit) {
  std::string s = "commit,kernel,outputs,rows,cols,bytes,median_ms,gbps,copy_median_ms,copy_gbps,vs_copy,device\n";
  char buf[512];
  for (const auto& t : timings) {
    std::snprintf(buf, sizeof buf, "%s,%s,%s,%lld,%lld,%.0f,%.6f,%.1f,%.6f,%.1f,%.4f,%s\n", commit.c_str(),
                  t.kernel.c_str(), t.outputs.c_str(), static_cast<long long>(t.rows), static_cast<long long>(t.cols),
                  t.bytes, t.median_ms, t.gbps, t.copy_median_ms, t.copy_gbps, t.vs_copy, t.device.c_str());
    s += buf;
  }
  return s;
}

}  // namespace esplag
