#include "bench/lib/slope_merged.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <functional>

#include "core/device_fill.h"
#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/device_buffer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "ops/gpu.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/slope_merged.h"

namespace esplag::gpu {

namespace {

// Zeroes 2 of every 4 values along each row (a random pair per group, from a hash of the
// group's index): W becomes row-wise 2:4, as SLoPe's W1.
__global__ void keep_random_pairs_kernel(bf16* w, int64_t groups, uint64_t seed) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  constexpr uint8_t kPairs[6] = {0x3, 0x5, 0x9, 0x6, 0xA, 0xC};  // bit i: position i kept
  uint64_t z = seed ^ (uint64_t(g) * 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
  const uint8_t keep = kPairs[(z >> 33) % 6];
  for (int i = 0; i < 4; ++i)
    if (!(keep >> i & 1)) w[4 * g + i] = __float2bfloat16_rn(0.f);
}

double timed(const std::function<void()>& launch, int warmup, int iters, cudaStream_t s) {
  return median_event_ms([&](int) { launch(); }, warmup, iters, s);
}

// ‖a − b‖ / ‖b‖ over the first n values of two device bf16 arrays.
double relative_difference(const bf16* a, const bf16* b, size_t n, cudaStream_t s) {
  std::vector<uint16_t> ha(n), hb(n);
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaMemcpy(ha.data(), a, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(hb.data(), b, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = bf16_to_float(ha[i]), y = bf16_to_float(hb[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

std::vector<std::array<int64_t, 3>> slope_merged_bench_default_shapes() {
  return {{5632, 2048, 8192}, {2048, 5632, 8192}, {11008, 4096, 8192}, {4096, 11008, 8192}};
}

std::vector<int> slope_merged_bench_default_ranks() { return {16, 64}; }

SlopeMergedBenchResult bench_slope_merged(const std::vector<std::array<int64_t, 3>>& shapes,
                                          const std::vector<int>& ranks, int warmup, int iters) {
  ESPLAG_CHECK(iters > 0 && warmup >= 1, "bench slope-merged: iters must be positive and warmup at least 1 (the first ",
               "call tunes the 2:4 products), got ", iters, " and ", warmup);
  for (const auto& [out, in, tokens] : shapes) {
    ESPLAG_CHECK(out > 0 && in > 0 && tokens > 0 && out % 16 == 0 && in % 16 == 0 && tokens % 16 == 0 &&
                     out <= INT_MAX && in <= INT_MAX && tokens <= INT_MAX,
                 "bench slope-merged: shape ", out, "x", in, "x", tokens,
                 " needs out, in and tokens to be positive multiples of 16");
    for (int r : ranks)
      ESPLAG_CHECK(r >= 1 && r <= std::min(out, in), "bench slope-merged: rank ", r,
                   " is outside [1, min(out, in) = ", std::min(out, in), "] for ", out, "x", in);
  }
  SlopeMergedBenchResult result;
  result.device = current_gpu_name();
  result.cusparselt_version = cusparselt_version();
  result.warmup = warmup;
  result.iters = iters;

  CudaStream stream;
  const cudaStream_t s = stream.s;
  DeviceArena gemm_arena(Gemm::kDefaultWorkspaceBytes + Gemm::kScratchBytes + 4096, "slope merged bench gemm");
  Gemm gemm(gemm_arena);
  const char* owner = "bench slope-merged";
  uint64_t seed = 1;
  for (const auto& [O, C, N] : shapes) {
    const float w_scale = 1.0f / std::sqrt(float(C));
    DeviceBuffer x(size_t(N) * C * 2, owner, "X"), w1(size_t(O) * C * 2, owner, "W1"),
        bias(size_t(O) * 2, owner, "bias");
    DeviceBuffer y_dense(size_t(N) * O * 2, owner, "Y (dense)"), y_sparse(size_t(N) * O * 2, owner, "Y (2:4)");
    fill_nonzero_bf16(x.bf(), N * C, seed++ * 0x1234567ull, 1.0f, s);
    fill_nonzero_bf16(w1.bf(), O * C, seed++ * 0x1234567ull, w_scale, s);
    fill_nonzero_bf16(bias.bf(), O, seed++ * 0x1234567ull, 0.1f, s);
    // The dense baseline multiplies W before its 2:4 pattern is applied: a dense layer.
    const int n = int(N), c = int(C), o = int(O);
    const double dense_ms =
        timed([&] { gemm.forward(y_dense.bf(), x.bf(), w1.bf(), bias.bf(), n, c, o, s); }, warmup, iters, s);
    keep_random_pairs_kernel<<<unsigned((O * C / 4 + 255) / 256), 256, 0, s>>>(w1.bf(), O * C / 4, seed++);
    CUDA_CHECK_LAUNCH("keep_random_pairs_kernel");

    SlopeMergedLinear alone(O, C, 0, N, true, w1.bf(), nullptr, nullptr, s);
    const double sparse_ms = timed([&] { alone.forward(y_sparse.bf(), x.bf(), bias.bf(), s); }, warmup, iters, s);

    for (int r : ranks) {
      DeviceBuffer l(size_t(O) * r * 2, owner, "L"), rr(size_t(r) * C * 2, owner, "R"),
          t(size_t(N) * r * 2, owner, "T");
      DeviceBuffer y_two(size_t(N) * O * 2, owner, "Y (two passes)"), y_merged(size_t(N) * O * 2, owner, "Y (merged)");
      fill_nonzero_bf16(l.bf(), O * r, seed++ * 0x1234567ull, 1.0f / std::sqrt(float(r)), s);
      fill_nonzero_bf16(rr.bf(), int64_t(r) * C, seed++ * 0x1234567ull, 0.1f * w_scale, s);
      SlopeMergedLinear merged(O, C, r, N, true, w1.bf(), l.bf(), rr.bf(), s);
      const int64_t K = merged.input_stride();
      DeviceBuffer xw(size_t(N) * K * 2, owner, "[X | T~]");
      CUDA_CHECK(cudaMemcpy2DAsync(xw.bf(), K * 2, x.bf(), C * 2, C * 2, N, cudaMemcpyDeviceToDevice, s));

      SlopeMergedBenchRow row;
      row.out = O;
      row.in = C;
      row.tokens = N;
      row.rank = r;
      row.sparse = merged.sparse();
      row.dense_ms = dense_ms;
      row.sparse_ms = sparse_ms;
      row.two_pass_ms = timed(
          [&] {
            alone.forward(y_two.bf(), x.bf(), bias.bf(), s);
            gemm.forward(t.bf(), x.bf(), rr.bf(), nullptr, n, c, r, s);                // T = X·Rᵀ
            gemm.forward_strided(y_two.bf(), o, t.bf(), r, l.bf(), n, r, o, true, s);  // Y += T·Lᵀ
          },
          warmup, iters, s);
      row.merged_ms = timed([&] { merged.forward(y_merged.bf(), xw.bf(), bias.bf(), s); }, warmup, iters, s);
      row.rel_diff =
          relative_difference(y_merged.bf(), y_two.bf(), std::min<size_t>(size_t(N) * O, size_t(1) << 20), s);
      result.rows.push_back(row);
    }
    CUDA_CHECK(cudaStreamSynchronize(s));  // before the buffers of this shape are freed
  }
  return result;
}

std::string slope_merged_bench_table(const SlopeMergedBenchResult& r) {
  std::string out = "SLoPe merged sparse + low-rank inference on " + r.device + " (cuSPARSELt " +
                    (r.cusparselt_version > 0 ? std::to_string(r.cusparselt_version) : std::string("missing: dense")) +
                    "; CUDA-event medians of " + std::to_string(r.iters) + " calls after " + std::to_string(r.warmup) +
                    " warm-up)\n";
  char line[320];
  std::snprintf(line, sizeof line, "%-18s %5s %9s %9s %11s %10s %13s %14s %9s\n", "out x in x tokens", "rank",
                "dense ms", "2:4 ms", "2-pass ms", "merged ms", "merged/dense", "merged/2-pass", "rel diff");
  out += line;
  for (const auto& x : r.rows) {
    const std::string shape = std::to_string(x.out) + "x" + std::to_string(x.in) + "x" + std::to_string(x.tokens);
    std::snprintf(line, sizeof line, "%-18s %5d %9.3f %9.3f %11.3f %10.3f %12.2fx %13.2fx %9.1e\n", shape.c_str(),
                  x.rank, x.dense_ms, x.sparse_ms, x.two_pass_ms, x.merged_ms, x.dense_ms / x.merged_ms,
                  x.two_pass_ms / x.merged_ms, x.rel_diff);
    out += line;
  }
  out += "merged/dense and merged/2-pass are speed-ups (the other's time / the merged product's)\n";
  return out;
}

std::string slope_merged_bench_csv_header() {
  return "commit,gpu,cusparselt,out,in,tokens,rank,sparse,dense_ms,sparse_ms,two_pass_ms,merged_ms,"
         "speedup_vs_dense,speedup_vs_two_pass,rel_diff\n";
}

std::string slope_merged_bench_csv_rows(const SlopeMergedBenchResult& r, const std::string& commit) {
  std::string rows;
  char line[512];
  for (const auto& x : r.rows) {
    std::snprintf(line, sizeof line, "%s,\"%s\",%d,%lld,%lld,%lld,%d,%d,%.5f,%.5f,%.5f,%.5f,%.4f,%.4f,%.3e\n",
                  commit.c_str(), r.device.c_str(), r.cusparselt_version, static_cast<long long>(x.out),
                  static_cast<long long>(x.in), static_cast<long long>(x.tokens), x.rank, x.sparse ? 1 : 0, x.dense_ms,
                  x.sparse_ms, x.two_pass_ms, x.merged_ms, x.dense_ms / x.merged_ms, x.two_pass_ms / x.merged_ms,
                  x.rel_diff);
    rows += line;
  }
  return rows;
}

}  // namespace esplag::gpu
