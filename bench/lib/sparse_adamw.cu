#include "bench/lib/sparse_adamw.h"

#include <algorithm>
#include <cstdio>
#include <functional>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/error.h"
#include "ops/gpu.h"
#include "sparse/cuda/sparse_adamw.h"

namespace esplag::gpu {

namespace {

__device__ __forceinline__ float unit_hash(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return (static_cast<float>(x >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1), never 0
}

// lo + (hi - lo) · u: [-a, a] for signed values, (0, a] for second moments.
template <typename T>
__global__ void fill_kernel(T* out, int64_t n, float lo, float hi, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = lo + (hi - lo) * unit_hash(static_cast<uint64_t>(i), seed);
    if constexpr (sizeof(T) == 4)
      out[i] = x;
    else
      out[i] = __float2bfloat16_rn(x);
  }
}

// Random valid 2:4 metadata: one of the 6 nibbles per group, 0 past the last group.
__global__ void fill_meta_kernel(uint16_t* meta, int64_t rows, int64_t cols, uint32_t seed) {
  const int64_t stride = (cols / 4 + 3) / 4, n = rows * stride;
  const uint32_t nibbles[6] = {0x4, 0x8, 0xC, 0x9, 0xD, 0xE};
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t w = i % stride;
    uint32_t word = 0;
    for (int k = 0; k < 4; ++k)
      if (4 * w + k < cols / 4) {
        const int pick = min(5, static_cast<int>(unit_hash(static_cast<uint64_t>(4 * i + k), seed) * 6.0f));
        word |= nibbles[pick] << (4 * k);
      }
    meta[i] = static_cast<uint16_t>(word);
  }
}

template <typename T>
void fill(T* out, int64_t n, float lo, float hi, uint32_t seed, cudaStream_t s) {
  fill_kernel<T><<<1024, 256, 0, s>>>(out, n, lo, hi, seed);
  CUDA_CHECK_LAUNCH("bench fill");
}

SparseAdamWBenchRow time_op(const std::string& op, int64_t rows, int64_t cols, double bytes, int warmup, int iters,
                            cudaStream_t s, const std::function<void()>& launch) {
  const std::vector<double> ms = event_times_ms([&](int) { launch(); }, warmup, iters, s);
  SparseAdamWBenchRow r;
  r.op = op;
  r.rows = rows;
  r.cols = cols;
  r.iters = iters;
  r.warmup = warmup;
  r.median_ms = median_of(ms);
  r.min_ms = *std::min_element(ms.begin(), ms.end());
  r.max_ms = *std::max_element(ms.begin(), ms.end());
  r.bytes = bytes;
  r.gbps = bytes / (r.median_ms * 1e-3) / 1e9;
  return r;
}

}  // namespace

SparseAdamWBenchResult bench_sparse_adamw(const std::vector<std::array<int64_t, 2>>& shapes, int warmup, int iters) {
  ESPLAG_CHECK(iters > 0 && warmup >= 0, "bench_sparse_adamw: iters must be positive and warmup not negative, got ",
               iters, " and ", warmup);
  int64_t largest = 0;
  for (const auto& [rows, cols] : shapes) {
    ESPLAG_CHECK(rows > 0 && cols > 0 && rows % 4 == 0 && cols % 4 == 0, "bench_sparse_adamw: shape [", rows, ", ",
                 cols, "] needs positive multiples of 4");
    largest = std::max(largest, rows * cols);
  }
  SparseAdamWBenchResult result;
  result.device = current_gpu_name();
  if (shapes.empty()) return result;

  // Dense: master, m, v, grad fp32 + bf16 weight (18 B/element); sparse: dW fp32 and bf16,
  // master / m / v / values / W2ᵀ values at half size, dense bf16 W, two metadata arrays
  // (16.25 B/element); plus alignment padding and small scratch.
  DeviceArena arena(size_t(36) * size_t(largest) + (size_t(64) << 20), "sparse adamw bench");
  CudaStream stream;
  const cudaStream_t s = stream.s;
  for (const auto& [O, C] : shapes) {
    const size_t mark = arena.mark();
    const int64_t n = O * C, half = n / 2, stride = (C / 4 + 3) / 4, bstride = (O / 4 + 3) / 4;
    // Dense AdamW state.
    float* d_master = arena.allocate_array<float>("dense.master", n);
    float* d_m = arena.allocate_array<float>("dense.m", n);
    float* d_v = arena.allocate_array<float>("dense.v", n);
    float* d_grad = arena.allocate_array<float>("dense.grad", n);
    bf16* d_weight = arena.allocate_array<bf16>("dense.weight", n);
    // Sparse state.
    float* dw32 = arena.allocate_array<float>("sparse.dw_f32", n);
    bf16* dw16 = arena.allocate_array<bf16>("sparse.dw_bf16", n);
    float* s_master = arena.allocate_array<float>("sparse.master", half);
    float* s_m = arena.allocate_array<float>("sparse.m", half);
    float* s_v = arena.allocate_array<float>("sparse.v", half);
    bf16* s_values = arena.allocate_array<bf16>("sparse.values", half);
    bf16* s_dense = arena.allocate_array<bf16>("sparse.dense_w", n);
    uint16_t* meta = arena.allocate_array<uint16_t>("sparse.meta", size_t(O * stride));
    bf16* b_values = arena.allocate_array<bf16>("sparse.bwd_values", half);
    uint16_t* b_meta = arena.allocate_array<uint16_t>("sparse.bwd_meta", size_t(C * bstride));
    float* scalars = arena.allocate_array<float>("scalars", 4);  // lr, norm² (dense), norm² (sparse)
    int64_t* step = arena.allocate_array<int64_t>("step", 1);
    void* norm_scratch =
        arena.allocate("norm scratch", std::max(global_norm_scratch_bytes(), sparse_grad_norm_scratch_bytes()));

    fill(d_master, n, -0.05f, 0.05f, 1, s);
    fill(d_m, n, -0.01f, 0.01f, 2, s);
    fill(d_v, n, 0.f, 1e-4f, 3, s);
    fill(d_grad, n, -1.f, 1.f, 4, s);
    fill(dw32, n, -1.f, 1.f, 5, s);
    fill(dw16, n, -1.f, 1.f, 6, s);
    fill(s_master, half, -0.05f, 0.05f, 7, s);
    fill(s_m, half, -0.01f, 0.01f, 8, s);
    fill(s_v, half, 0.f, 1e-4f, 9, s);
    fill_meta_kernel<<<1024, 256, 0, s>>>(meta, O, C, 10);
    CUDA_CHECK_LAUNCH("bench fill_meta");
    const float host_scalars[4] = {1e-4f, float(n) / 3.f, float(half) / 3.f, 0.f};
    const int64_t host_step = 10;
    CUDA_CHECK(cudaMemcpyAsync(scalars, host_scalars, sizeof(host_scalars), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(step, &host_step, sizeof(host_step), cudaMemcpyHostToDevice, s));
    // The backward mask every refill uses.
    slope_backward_refresh(b_values, b_meta, s_master, meta, O, C, s);
    CUDA_CHECK(cudaStreamSynchronize(s));  // the host scalars above must outlive their copies

    AdamWPlan plan({ParamSegment{0, n, true}}, arena);
    AdamWConfig dcfg;
    dcfg.lr = 1e-4f;
    dcfg.weight_decay = 0.1f;
    dcfg.step = host_step;
    dcfg.clip_norm_sq = scalars + 1;
    dcfg.max_grad_norm = 1.0f;
    SparseAdamWConfig scfg;
    scfg.lr_device = scalars;
    scfg.step_device = step;
    scfg.weight_decay = 0.1f;
    scfg.clip_norm_sq = scalars + 2;
    scfg.max_grad_norm = 1.0f;

    const double meta_bytes = 2.0 * double(O * stride), bmeta_bytes = 2.0 * double(C * bstride);
    const double state = double(half) * (6 * 4 + 2);  // master, m, v read + written; bf16 values written
    std::vector<SparseAdamWBenchRow> rows;
    rows.push_back(time_op("dense adamw", O, C, 30.0 * double(n), warmup, iters, s, [&] {
      adamw_update(plan, d_master, d_m, d_v, d_grad, d_weight, dcfg, s);
    }));
    rows.push_back(time_op("dense grad norm", O, C, 4.0 * double(n), warmup, iters, s,
                           [&] { global_norm_squared(scalars + 3, d_grad, n, norm_scratch, s); }));
    rows.push_back(time_op("sparse adamw dW=f32", O, C, 4.0 * double(n) + meta_bytes + state, warmup, iters, s, [&] {
      sparse_adamw_update(s_master, s_m, s_v, dw32, meta, O, C, s_values, nullptr, scfg, s);
    }));
    rows.push_back(time_op("sparse adamw dW=f32 +W", O, C, 6.0 * double(n) + meta_bytes + state, warmup, iters, s,
                           [&] { sparse_adamw_update(s_master, s_m, s_v, dw32, meta, O, C, s_values, s_dense, scfg, s); }));
    rows.push_back(time_op("sparse adamw dW=bf16", O, C, 2.0 * double(n) + meta_bytes + state, warmup, iters, s, [&] {
      sparse_adamw_update(s_master, s_m, s_v, dw16, meta, O, C, s_values, nullptr, scfg, s);
    }));
    rows.push_back(time_op("sparse grad norm dW=f32", O, C, 4.0 * double(n) + meta_bytes, warmup, iters, s,
                           [&] { sparse_grad_norm_squared_add(scalars + 3, dw32, meta, O, C, norm_scratch, s); }));
    rows.push_back(time_op("slope refresh (f32 values)", O, C,
                           4.0 * double(half) + meta_bytes + 2.0 * double(half) + bmeta_bytes, warmup, iters, s,
                           [&] { slope_backward_refresh(b_values, b_meta, s_master, meta, O, C, s); }));
    rows.push_back(time_op("slope refill (bf16 values)", O, C,
                           2.0 * double(half) + meta_bytes + bmeta_bytes + 2.0 * double(half), warmup, iters, s,
                           [&] { slope_backward_refill(b_values, b_meta, s_values, meta, O, C, s); }));
    const double dense_ms = rows.front().median_ms;
    for (auto& r : rows) {
      r.vs_dense = dense_ms / r.median_ms;
      result.rows.push_back(r);
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    arena.release_to(mark);
  }
  return result;
}

std::string sparse_adamw_bench_table(const SparseAdamWBenchResult& r) {
  std::string out = "sparse AdamW / SLoPe optimizer kernels on " + r.device + " (CUDA events, median of each op's";
  out += r.rows.empty() ? std::string(" calls)\n")
                        : " " + std::to_string(r.rows.front().iters) + " calls after " +
                              std::to_string(r.rows.front().warmup) + " warm-up)\n";
  char line[256];
  std::snprintf(line, sizeof(line), "%-28s %-12s %10s %10s %10s %10s %9s %14s\n", "op", "shape", "median_ms", "min_ms",
                "max_ms", "MB/call", "GB/s", "dense/this");
  out += line;
  for (const auto& x : r.rows) {
    const std::string shape = std::to_string(x.rows) + "x" + std::to_string(x.cols);
    std::snprintf(line, sizeof(line), "%-28s %-12s %10.4f %10.4f %10.4f %10.1f %9.0f %13.2fx\n", x.op.c_str(),
                  shape.c_str(), x.median_ms, x.min_ms, x.max_ms, x.bytes / 1e6, x.gbps, x.vs_dense);
    out += line;
  }
  return out;
}

std::string sparse_adamw_bench_csv_header() {
  return "device,op,rows,cols,warmup,iters,median_ms,min_ms,max_ms,bytes,gbps,dense_over_this";
}

std::string sparse_adamw_bench_csv_row(const SparseAdamWBenchResult& r, const SparseAdamWBenchRow& x) {
  char line[512];
  std::snprintf(line, sizeof(line), "%s,%s,%lld,%lld,%d,%d,%.5f,%.5f,%.5f,%.0f,%.1f,%.4f", r.device.c_str(),
                x.op.c_str(), static_cast<long long>(x.rows), static_cast<long long>(x.cols), x.warmup, x.iters,
                x.median_ms, x.min_ms, x.max_ms, x.bytes, x.gbps, x.vs_dense);
  return line;
}

}  // namespace esplag::gpu
