#include "bench/lib/vnm.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>

#include "core/device_fill.h"
#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/cuda/rows_24_forward.h"
#include "ops/gpu.h"
#include "sparse/cuda/vnm_gemm.h"

namespace esplag::gpu {

namespace {

double median_ms(const std::function<void()>& launch, int warmup, int iters, cudaStream_t s) {
  return median_event_ms([&](int) { launch(); }, warmup, iters, s);
}

// max |gpu - host| / rms(host) over a few token rows of Y = X · Wᵀ; infinite where an output
// is not finite (an unwritten one keeps its NaN poison).
double spot_check(const CompressedVNMBf16& w, const bf16* x, const bf16* y, int64_t tokens, cudaStream_t s) {
  CUDA_CHECK(cudaStreamSynchronize(s));
  const int64_t blocks = w.cols / w.m;
  const int samples = int(std::min<int64_t>(tokens, 4));
  double max_err = 0, ss = 0;
  int64_t count = 0;
  std::vector<uint16_t> xr(w.cols), yr(w.rows);
  for (int k = 0; k < samples; ++k) {
    const int64_t tok = samples == 1 ? 0 : k * (tokens - 1) / (samples - 1);
    CUDA_CHECK(cudaMemcpy(xr.data(), x + tok * w.cols, w.cols * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(yr.data(), y + tok * w.rows, w.rows * 2, cudaMemcpyDeviceToHost));
    for (int64_t r = 0; r < w.rows; ++r) {
      double ref = 0;
      for (int64_t b = 0; b < blocks; ++b)
        for (int j = 0; j < 2; ++j)
          ref += double(bf16_to_float(w.inner.values[r * blocks * 2 + 2 * b + j])) *
                 double(bf16_to_float(xr[w.column(r, b, j)]));
      const double err = std::fabs(double(bf16_to_float(yr[r])) - ref);
      max_err = std::isfinite(err) ? std::max(max_err, err) : INFINITY;
      ss += ref * ref;
      ++count;
    }
  }
  const double rms = count ? std::sqrt(ss / double(count)) : 0.0;
  return rms > 0 ? max_err / rms : max_err;
}

// dst [rows, cols] (device) = w as a dense matrix, zero where pruned.
void upload_dense(bf16* dst, const CompressedVNMBf16& w, cudaStream_t s) {
  const int64_t blocks = w.cols / w.m;
  std::vector<uint16_t> dense(size_t(w.rows * w.cols), 0);
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < 2; ++j) dense[r * w.cols + w.column(r, b, j)] = w.inner.values[r * blocks * 2 + 2 * b + j];
  CUDA_CHECK(cudaMemcpyAsync(dst, dense.data(), 2 * dense.size(), cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaStreamSynchronize(s));  // before `dense` goes
}

}  // namespace

std::vector<VnmBenchShape> vnm_bench_default_shapes() {
  return {{8192, 2048, 16384}, {2048, 8192, 16384}, {11008, 4096, 8192}, {4096, 11008, 8192},
          {4096, 4096, 8192},  {5632, 2048, 8192},  {2048, 5632, 8192}, {13824, 5120, 8192}};
}

std::vector<VnmBenchPattern> vnm_bench_default_patterns() { return {{64, 8}, {128, 8}, {64, 16}, {64, 5}}; }

double vnm_wgmma_sp_peak_tflops() {
  int dev = 0, major = 0, minor = 0, sms = 0, clock_khz = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  if (major != 9 || minor != 0) return 0.0;
  return double(sms) * 4096.0 * double(clock_khz) * 1e3 / 1e12;
}

CompressedVNMBf16 random_vnm_weight(int64_t rows, int64_t cols, int v, int m, uint64_t seed) {
  ESPLAG_CHECK(v > 0 && m >= 4 && m <= 16 && rows > 0 && cols > 0 && rows % v == 0 && cols % m == 0,
               "random_vnm_weight: [", rows, ", ", cols, "] does not fit V:2:M = ", v, ":2:", m);
  Rng rng(seed);
  CompressedVNMBf16 w;
  w.v = v;
  w.m = m;
  w.rows = rows;
  w.cols = cols;
  const int64_t blocks = cols / m;
  w.columns.resize(size_t(rows / v * blocks * 4));
  for (int64_t i = 0; i < rows / v * blocks; ++i) {
    uint8_t perm[16];
    for (int k = 0; k < m; ++k) perm[k] = uint8_t(k);
    for (int k = 0; k < 4; ++k) std::swap(perm[k], perm[k + int(rng.below(uint32_t(m - k)))]);
    std::sort(perm, perm + 4);
    std::copy(perm, perm + 4, w.columns.begin() + i * 4);
  }
  w.inner.rows = rows;
  w.inner.cols = blocks * 4;
  w.inner.values.resize(size_t(rows * blocks * 2));
  w.inner.meta.assign(size_t(rows * w.inner.meta_stride()), 0);
  static constexpr uint8_t kPairs[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const auto& pr = kPairs[rng.below(6)];
      w.inner.meta[r * w.inner.meta_stride() + b / 4] |= uint16_t((pr[0] | pr[1] << 2) << (4 * (b % 4)));
      for (int j = 0; j < 2; ++j) {
        double x = rng.normal();
        if (std::fabs(x) < 1e-3) x = 1e-3;
        w.inner.values[r * blocks * 2 + 2 * b + j] = float_to_bf16(float(x));
      }
    }
  return w;
}

std::vector<VnmBenchResult> vnm_bench(const std::vector<VnmBenchShape>& shapes,
                                      const std::vector<VnmBenchPattern>& patterns, int warmup, int iters,
                                      uint64_t seed) {
  ESPLAG_CHECK(warmup >= 0 && iters > 0, "vnm_bench: need warmup >= 0 and iters > 0");
  std::vector<VnmBenchResult> results;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  try {
    for (const VnmBenchShape& sh : shapes) {
      ESPLAG_CHECK(sh.out > 0 && sh.in > 0 && sh.tokens > 0 && sh.tokens <= INT32_MAX && sh.in <= INT32_MAX &&
                       sh.out <= INT32_MAX,
                   "vnm_bench: bad shape out ", sh.out, " in ", sh.in, " tokens ", sh.tokens);
      size_t vnm_bytes = 0;
      for (const VnmBenchPattern& p : patterns)
        if (sh.out % p.v == 0 && sh.in % p.m == 0)
          vnm_bytes = std::max(vnm_bytes, vnm_device_weight_bytes(sh.out, sh.in, p.v, p.m));
      const size_t x_bytes = size_t(sh.tokens * sh.in) * 2, y_bytes = size_t(sh.tokens * sh.out) * 2,
                   w_bytes = size_t(sh.out * sh.in) * 2;
      // The upload's temporaries: columns, values, metadata of the CPU layout (< 1 B per weight).
      const size_t capacity = 2 * x_bytes + size_t(16 * sh.in) + y_bytes + w_bytes + vnm_bytes + size_t(sh.out * sh.in) +
                              Gemm::kDefaultWorkspaceBytes + Gemm::kScratchBytes + (size_t(64) << 20);
      DeviceArena arena(capacity, "vnm bench");
      bf16* x = arena.allocate_array<bf16>("X", size_t(sh.tokens * sh.in));
      bf16* y = arena.allocate_array<bf16>("Y", size_t(sh.tokens * sh.out));
      bf16* wd = arena.allocate_array<bf16>("W dense", size_t(sh.out * sh.in));
      const int64_t ldxt = vnm_transposed_ld(sh.tokens);
      bf16* xt = arena.allocate_array<bf16>("X transposed", size_t(sh.in * ldxt));
      fill_nonzero_bf16(x, sh.tokens * sh.in, seed * 1000003 + 1, 1.0f, stream);
      fill_nonzero_bf16(wd, sh.out * sh.in, seed * 1000003 + 2, 1.0f, stream);
      Gemm gemm(arena);
      const int N = int(sh.tokens), C = int(sh.in), OC = int(sh.out);
      const double dense_ms =
          median_ms([&] { gemm.forward(y, x, wd, nullptr, N, C, OC, stream); }, warmup, iters, stream);
      const double flops = 2.0 * double(sh.out) * double(sh.in) * double(sh.tokens);
      const bool wgmma = vnm_wgmma_available();
      const double peak = vnm_wgmma_sp_peak_tflops();
      for (const VnmBenchPattern& p : patterns) {
        if (sh.out % p.v != 0 || sh.in % p.m != 0) continue;
        const size_t mark = arena.mark();
        const CompressedVNMBf16 hw = random_vnm_weight(sh.out, sh.in, p.v, p.m, seed * 7919 + uint64_t(p.v * 17 + p.m));
        const VnmDeviceWeight w = vnm_upload_weight(hw, arena, stream);
        VnmBenchResult r;
        r.pattern = p;
        r.shape = sh;
        r.dense_ms = dense_ms;
        // One timed path: median time, then the spot check of its output (poisoned before).
        auto timed = [&](const char* path, const std::function<void()>& launch) {
          CUDA_CHECK(cudaMemsetAsync(y, 0xFF, y_bytes, stream));  // NaN: unwritten outputs would show
          const double ms = median_ms(launch, warmup, iters, stream);
          const double err = spot_check(hw, x, y, sh.tokens, stream);
          if (r.spot_worst_path.empty() || err > r.spot_rel_error) r.spot_rel_error = err, r.spot_worst_path = path;
          return ms;
        };
        constexpr VnmTile kTile = VnmTile::automatic;
        r.transpose_ms =
            median_ms([&] { vnm_transpose_input(xt, x, sh.tokens, sh.in, stream); }, warmup, iters, stream);
        if (wgmma) {
          r.wgmma_ms = timed(
              "wgmma X", [&] { vnm_linear_forward(y, x, w, nullptr, sh.tokens, stream, kTile, VnmKernel::wgmma_sp); });
          r.wgmma_xt_ms = timed("wgmma Xt", [&] {
            vnm_linear_forward_xt(y, xt, ldxt, w, nullptr, sh.tokens, stream, kTile, VnmKernel::wgmma_sp);
          });
          r.speedup = dense_ms / r.wgmma_ms;
          r.speedup_xt = dense_ms / r.wgmma_xt_ms;
        }
        r.vnm_ms =
            timed("mma X", [&] { vnm_linear_forward(y, x, w, nullptr, sh.tokens, stream, kTile, VnmKernel::mma_sp); });
        r.vnm_xt_ms = timed("mma Xt", [&] {
          vnm_linear_forward_xt(y, xt, ldxt, w, nullptr, sh.tokens, stream, kTile, VnmKernel::mma_sp);
        });
        r.speedup_mma = dense_ms / r.vnm_ms;
        if (p.m % 4 == 0 && Rows24Forward::applies(sh.out, sh.in, sh.tokens)) {
          upload_dense(wd, hw, stream);
          Rows24Forward as24("bench", sh.out, sh.in, sh.tokens, false);
          r.as24_compress_ms = median_ms([&] { as24.prepare(wd, stream); }, warmup, iters, stream);
          r.as24_ms = timed("2:4", [&] { as24.forward(y, x, nullptr, stream); });
          r.speedup_24 = dense_ms / r.as24_ms;
        }
        r.dense_tflops = flops / (dense_ms * 1e9);
        const double best_ms = wgmma ? std::min(r.wgmma_ms, r.wgmma_xt_ms) : std::min(r.vnm_ms, r.vnm_xt_ms);
        r.kept_tflops = flops * 2.0 / p.m / (best_ms * 1e9);
        r.peak_fraction = peak > 0 ? r.kept_tflops / peak : 0.0;
        results.push_back(r);
        arena.release_to(mark);
      }
    }
  } catch (...) {
    cudaStreamDestroy(stream);
    throw;
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  return results;
}

std::string vnm_bench_table(const std::vector<VnmBenchResult>& results) {
  std::ostringstream os;
  char line[400];
  std::snprintf(line, sizeof line,
                "%-8s %6s %6s %6s | %8s %6s | %8s %8s %7s %7s | %8s %8s %7s | %8s %8s %7s | %8s | %7s %6s | %8s %s\n",
                "pattern", "out", "in", "tokens", "dense ms", "TF/s", "wgmma X", "wgmma Xt", "ratio", "ratioXt",
                "mma X", "mma Xt", "ratio", "2:4 ms", "comp ms", "ratio", "T ms", "kept TF", "%peak", "spot err",
                "(path)");
  os << line;
  for (const VnmBenchResult& r : results) {
    const std::string pat = std::to_string(r.pattern.v) + ":2:" + std::to_string(r.pattern.m);
    std::snprintf(line, sizeof line,
                  "%-8s %6lld %6lld %6lld | %8.4f %6.1f | %8.4f %8.4f %6.2fx %6.2fx | %8.4f %8.4f %6.2fx | %8.4f %8.4f "
                  "%6.2fx | %8.4f | %7.1f %5.1f%% | %8.2e (%s)\n",
                  pat.c_str(), (long long)r.shape.out, (long long)r.shape.in, (long long)r.shape.tokens, r.dense_ms,
                  r.dense_tflops, r.wgmma_ms, r.wgmma_xt_ms, r.speedup, r.speedup_xt, r.vnm_ms, r.vnm_xt_ms,
                  r.speedup_mma, r.as24_ms, r.as24_compress_ms, r.speedup_24, r.transpose_ms, r.kept_tflops,
                  100.0 * r.peak_fraction, r.spot_rel_error, r.spot_worst_path.c_str());
    os << line;
  }
  os << "wgmma: the wgmma.sp kernel (sm_90a; 0 where not available), mma: the mma.sp kernel; X: input [tokens, in],\n"
        "Xt: input transposed (already there; T ms: the transpose that makes it); 2:4: the weight as a dense W on\n"
        "cuSPARSELt's 2:4 product (M a multiple of 4; comp ms: its compression, once per weight change); ratios:\n"
        "cuBLASLt dense time over ours; kept TF: 2*out*tokens*in*2/M over the fastest V:N:M kernel's time (wgmma.sp\n"
        "where available); %peak: of the wgmma.sp peak of kept products (SMs x 4096 FLOP/cycle x peak clock); shapes\n"
        "a pattern does not divide are skipped\n";
  return os.str();
}

std::string vnm_bench_csv(const std::vector<VnmBenchResult>& results) {
  std::ostringstream os;
  os << "v,m,out,in,tokens,dense_ms,wgmma_ms,wgmma_xt_ms,vnm_ms,vnm_xt_ms,transpose_ms,speedup,speedup_xt,"
        "speedup_mma,dense_tflops,kept_tflops,peak_fraction,spot_rel_error,as24_ms,as24_compress_ms,speedup_24,"
        "spot_worst_path\n";
  for (const VnmBenchResult& r : results)
    os << r.pattern.v << ',' << r.pattern.m << ',' << r.shape.out << ',' << r.shape.in << ',' << r.shape.tokens << ','
       << r.dense_ms << ',' << r.wgmma_ms << ',' << r.wgmma_xt_ms << ',' << r.vnm_ms << ',' << r.vnm_xt_ms << ','
       << r.transpose_ms << ',' << r.speedup << ',' << r.speedup_xt << ',' << r.speedup_mma << ',' << r.dense_tflops
       << ',' << r.kept_tflops << ',' << r.peak_fraction << ',' << r.spot_rel_error << ',' << r.as24_ms << ','
       << r.as24_compress_ms << ',' << r.speedup_24 << ',' << r.spot_worst_path << '\n';
  return os.str();
}

}  // namespace esplag::gpu
