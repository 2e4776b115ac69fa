#include "bench/lib/gemm.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "core/device_fill.h"
#include "bench/lib/summary.h"
#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "ops/gpu.h"
#include "ops/gpu_fp8.h"

namespace esplag {

namespace {

using gpu::bf16;
using gpu::SparseGemm24;
using gpu::SparseGemm24Problem;
using gpu::SparseProduct;

// out = fp8 e4m3 of in · scale (round to nearest, saturating to the largest finite).
__global__ void to_e4m3_kernel(__nv_fp8_e4m3* out, const bf16* in, int64_t n, float scale) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __nv_fp8_e4m3(__bfloat162float(in[i]) * scale);
}

void to_e4m3(void* out, const bf16* in, int64_t n, float scale, cudaStream_t s) {
  to_e4m3_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(static_cast<__nv_fp8_e4m3*>(out), in, n, scale);
  CUDA_CHECK_LAUNCH("to_e4m3_kernel");
}

std::string version_text(int v) {
  if (v <= 0) return "-";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 100) + "." + std::to_string(v % 100);
}

std::string shape_text(const GemmBenchShape& s) {
  return std::to_string(s.out) + "x" + std::to_string(s.in) + "x" + std::to_string(s.tokens);
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

const char* product_text(SparseProduct p) { return p == SparseProduct::forward ? "fwd" : "bwd-data"; }

size_t l2_cache_bytes() {
  int dev = 0, l2_bytes = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, dev));
  return l2_bytes > 0 ? size_t(l2_bytes) : (size_t(50) << 20);
}

// Operands that fit in twice the L2 rotate over enough copies to fill four L2s.
int rotation_sets(size_t set_bytes, size_t l2) {
  return set_bytes >= 2 * l2 ? 1
                             : static_cast<int>(std::min<size_t>(8, std::max<size_t>(2, (4 * l2) / set_bytes + 1)));
}

void check_int_sizes(const GemmBenchShape& sh) {
  ESPLAG_CHECK(sh.out <= INT32_MAX && sh.in <= INT32_MAX && sh.tokens <= INT32_MAX, "bench gemm: shape ",
               shape_text(sh), " is too large for the dense GEMM's int sizes");
}

}  // namespace

std::vector<GemmBenchShape> default_gemm_bench_shapes() {
  return {{8192, 2048, 16384}, {2048, 8192, 16384}, {11008, 4096, 8192}, {4096, 11008, 8192}, {4096, 4096, 8192}};
}

GemmBenchResult run_gemm_bench(const GemmBenchOptions& opt) {
  ESPLAG_CHECK(opt.warmup >= 0 && opt.iters > 0, "bench gemm: warm-up must not be negative and iterations positive");
  ESPLAG_CHECK(opt.forward || opt.backward_data, "bench gemm: no product selected");
  GemmBenchResult r;
  r.weight_operand = opt.weight_operand;
  r.warmup = opt.warmup;
  r.iters = opt.iters;
  r.gpu = current_gpu_name();
  r.dtype = opt.dtype;
  const bool fp8 = opt.dtype == gpu::SparseDtype::e4m3;
  ESPLAG_CHECK(!fp8 || (!opt.backward_data && opt.weight_operand == gpu::SparseOperand::a),
               "bench gemm: e4m3 runs the forward product with W as operand A only (--products fwd --operand A)");
  const bool have_sparse = gpu::cusparselt_available();
  r.cusparselt_version = gpu::cusparselt_version();
  if (!have_sparse) r.cusparselt_unavailable = gpu::cusparselt_unavailable_reason();

  CudaStream stream;
  const cudaStream_t s = stream.s;
  DeviceArena gemm_arena(gpu::Gemm::kDefaultWorkspaceBytes + gpu::Gemm::kScratchBytes + 4096, "bench gemm");
  gpu::Gemm gemm(gemm_arena);
  const size_t l2 = l2_cache_bytes();

  uint64_t seed = 1;
  for (const GemmBenchShape& sh : opt.shapes) {
    const int64_t out = sh.out, in = sh.in, tok = sh.tokens;
    check_int_sizes(sh);
    const size_t n_w = size_t(out) * in, n_x = size_t(tok) * in, n_y = size_t(tok) * out;
    const size_t set_bytes = 2 * (n_w + 2 * n_x + 2 * n_y);
    const int sets = rotation_sets(set_bytes, l2);
    std::vector<DeviceBuffer> W, X, dY, Y, dX, W8, X8;  // W8, X8: the e4m3 copies
    for (int k = 0; k < sets; ++k) {
      W.emplace_back(2 * n_w, "bench gemm", "W");
      X.emplace_back(2 * n_x, "bench gemm", "X");
      dY.emplace_back(2 * n_y, "bench gemm", "dY");
      Y.emplace_back(2 * n_y, "bench gemm", "Y");
      dX.emplace_back(2 * n_x, "bench gemm", "dX");
      fill_nonzero_bf16(W[k].bf(), int64_t(n_w), seed++ * 0x1234567ull, 1.0f / std::sqrt(float(in)), s);
      fill_nonzero_bf16(X[k].bf(), int64_t(n_x), seed++ * 0x1234567ull, 1.0f, s);
      fill_nonzero_bf16(dY[k].bf(), int64_t(n_y), seed++ * 0x1234567ull, 1.0f, s);
      if (fp8) {  // W scaled back to |w| in [0.1, 1): e4m3 keeps it normal and non-zero
        W8.emplace_back(n_w, "bench gemm", "W (e4m3)");
        X8.emplace_back(n_x, "bench gemm", "X (e4m3)");
        to_e4m3(W8[k].get(), W[k].bf(), int64_t(n_w), std::sqrt(float(in)), s);
        to_e4m3(X8[k].get(), X[k].bf(), int64_t(n_x), 1.0f, s);
      }
    }
    CUDA_CHECK(cudaStreamSynchronize(s));

    for (const SparseProduct product : {SparseProduct::forward, SparseProduct::backward_data}) {
      const bool fwd = product == SparseProduct::forward;
      if ((fwd && !opt.forward) || (!fwd && !opt.backward_data)) continue;
      GemmBenchRow row;
      row.shape = sh;
      row.product = product;
      row.flops = 2.0 * double(out) * double(in) * double(tok);
      // The token-side input and the output of this product, per set.
      auto input = [&](int i) -> const void* {
        return fp8 ? X8[i % sets].get() : fwd ? X[i % sets].bf() : dY[i % sets].bf();
      };
      auto weight = [&](int k) -> const void* { return fp8 ? W8[k].get() : W[k].bf(); };
      auto output = [&](int i) { return fwd ? Y[i % sets].bf() : dX[i % sets].bf(); };

      row.dense_ms = median_event_ms(
          [&](int i) {
            const int k = i % sets;
            if (fwd)
              gemm.forward(Y[k].bf(), X[k].bf(), W[k].bf(), nullptr, int(tok), int(in), int(out), s);
            else
              gemm.backward_input(dX[k].bf(), dY[k].bf(), W[k].bf(), int(tok), int(in), int(out), false, s);
          },
          opt.warmup, opt.iters, s);

      if (have_sparse) {
        try {
          SparseGemm24Problem p =
              fwd ? SparseGemm24Problem::linear_forward(out, in, tok, false, gpu::SparseActivation::none,
                                                        opt.weight_operand)
                  : SparseGemm24Problem::linear_backward_data(out, in, tok, opt.weight_operand);
          p.dtype = opt.dtype;
          SparseGemm24 def(p, SparseGemm24::Algorithm::library_default);
          row.plan_ms = def.plan_build_ms();
          row.default_config = def.config();
          row.max_alg_id = def.max_alg_id();
          // Prune every weight copy (tile rule, along this product's K) and compress it.
          DeviceBuffer pruned(p.element_bytes() * n_w, "bench gemm", "pruned W"),
              scratch(def.compress_scratch_bytes(), "bench gemm", "compress scratch");
          std::vector<DeviceBuffer> C;
          for (int k = 0; k < sets; ++k) {
            def.prune(pruned.get(), weight(k), s);
            if (k == 0)
              ESPLAG_CHECK(def.is_pruned(pruned.get(), s), "cuSPARSELt's pruned weight fails its own 2:4 check");
            C.emplace_back(def.compressed_allocation_bytes(), "bench gemm", "compressed W");
            def.compress(C[k].get(), pruned.get(), scratch.get(), scratch.bytes(), s);
          }
          DeviceBuffer ws(def.workspace_bytes(), "bench gemm", "cuSPARSELt workspace");
          row.default_ms = median_event_ms(
              [&](int i) { def.matmul(output(i), C[i % sets].get(), input(i), nullptr, ws.get(), ws.bytes(), s); },
              opt.warmup, opt.iters, s);

          SparseGemm24 tuned(p, SparseGemm24::Algorithm::tuned);
          if (opt.search) {
            DeviceBuffer sws(tuned.workspace_bytes(), "bench gemm", "cuSPARSELt search workspace");
            tuned.search(output(0), C[0].get(), input(0), nullptr, sws.get(), sws.bytes(), s);
            row.search_ms = tuned.search_ms();
          }
          if (tuned.tuned()) {
            DeviceBuffer tws(tuned.workspace_bytes(), "bench gemm", "cuSPARSELt workspace (searched)");
            row.searched_ms = median_event_ms(
                [&](int i) {
                  tuned.matmul(output(i), C[i % sets].get(), input(i), nullptr, tws.get(), tws.bytes(), s);
                },
                opt.warmup, opt.iters, s);
            row.searched_config = tuned.config();
            row.searched_from_cache = tuned.from_tuning_cache();
          }
          row.sparse = true;
        } catch (const Error& e) {
          row.sparse_error = e.what();
          CUDA_CHECK(cudaStreamSynchronize(s));
        }
      }
      r.rows.push_back(row);
    }
  }
  return r;
}

std::string gemm_bench_table(const GemmBenchResult& r) {
  std::string o;
  char buf[512];
  const char* operand = r.weight_operand == gpu::SparseOperand::a ? "A" : "B";
  std::snprintf(buf, sizeof buf,
                "GEMM fp32 accumulate: cuBLASLt dense bf16 vs cuSPARSELt 2:4 %s in, bf16 out (W as operand %s) "
                "on %s, cuSPARSELt %s; median of %d calls after %d warm-up\n",
                gpu::sparse_dtype_name(r.dtype), operand, r.gpu.c_str(), version_text(r.cusparselt_version).c_str(), r.iters, r.warmup);
  o += buf;
  if (r.cusparselt_version == 0) o += "cuSPARSELt is not available (" + r.cusparselt_unavailable + "): dense only\n";
  std::snprintf(buf, sizeof buf, "%-18s %-8s %9s %8s %11s %12s %8s %8s %12s %8s %9s\n", "out x in x tokens", "product",
                "dense_ms", "TFLOP/s", "2:4_def_ms", "2:4_srch_ms", "x_def", "x_srch", "alg def/srch", "plan_ms",
                "search_ms");
  o += buf;
  std::vector<std::string> meets;
  size_t with_sparse = 0;
  for (const GemmBenchRow& w : r.rows) {
    if (!w.sparse) {
      std::snprintf(buf, sizeof buf, "%-18s %-8s %9.3f %8.1f %s\n", shape_text(w.shape).c_str(),
                    product_text(w.product), w.dense_ms, w.dense_tflops(),
                    w.sparse_error.empty() ? "" : ("  2:4 failed: " + w.sparse_error).c_str());
      o += buf;
      continue;
    }
    ++with_sparse;
    char srch[32] = "-", xs[32] = "-", alg[48], sms[32] = "-";
    if (w.searched_ms > 0) {
      std::snprintf(srch, sizeof srch, "%.3f", w.searched_ms);
      std::snprintf(xs, sizeof xs, "%.2fx", w.speedup_searched());
      std::snprintf(alg, sizeof alg, "%d/%d%s%s", w.default_config.alg_id, w.searched_config.alg_id,
                    w.searched_config.split_k > 1 ? (" k" + std::to_string(w.searched_config.split_k)).c_str() : "",
                    w.searched_from_cache ? " (cache)" : "");
    } else {
      std::snprintf(alg, sizeof alg, "%d/-", w.default_config.alg_id);
    }
    if (w.search_ms > 0) std::snprintf(sms, sizeof sms, "%.0f", w.search_ms);
    std::snprintf(buf, sizeof buf, "%-18s %-8s %9.3f %8.1f %11.3f %12s %7.2fx %8s %12s %8.2f %9s\n",
                  shape_text(w.shape).c_str(), product_text(w.product), w.dense_ms, w.dense_tflops(), w.default_ms,
                  srch, w.speedup_default(), xs, alg, w.plan_ms, sms);
    o += buf;
    const double best = w.searched_ms > 0 ? w.speedup_searched() : w.speedup_default();
    if (best >= 1.5) {
      std::snprintf(buf, sizeof buf, "%s %s (%.2fx)", shape_text(w.shape).c_str(), product_text(w.product), best);
      meets.push_back(buf);
    }
  }
  o += gpu::target_summary(meets, with_sparse, 1.5, "2:4", " problems", "no 2:4 timings");
  return o;
}

std::string gemm_bench_csv_header() {
  return "commit,gpu,cusparselt,weight_operand,product,out,in,tokens,dense_ms,dense_tflops,sparse_default_ms,"
         "sparse_searched_ms,speedup_default,speedup_searched,default_alg,searched_alg,searched_split_k,"
         "searched_split_k_mode,searched_from_cache,max_alg_id,plan_ms,search_ms,warmup,iters,sparse_dtype\n";
}

std::string gemm_bench_csv_rows(const GemmBenchResult& r, const std::string& commit) {
  std::string o;
  char buf[1024];
  for (const GemmBenchRow& w : r.rows) {
    std::snprintf(buf, sizeof buf, "%s,\"%s\",%s,%s,%s,%lld,%lld,%lld,%.4f,%.2f,", commit.c_str(), r.gpu.c_str(),
                  version_text(r.cusparselt_version).c_str(), r.weight_operand == gpu::SparseOperand::a ? "A" : "B",
                  product_text(w.product), static_cast<long long>(w.shape.out), static_cast<long long>(w.shape.in),
                  static_cast<long long>(w.shape.tokens), w.dense_ms, w.dense_tflops());
    o += buf;
    if (w.sparse) {
      const bool s = w.searched_ms > 0;
      std::snprintf(buf, sizeof buf, "%.4f,%s,%.3f,%s,%d,%s,%s,%s,%s,%d,%.3f,%.1f,", w.default_ms,
                    s ? fixed(w.searched_ms, 4).c_str() : "", w.speedup_default(),
                    s ? fixed(w.speedup_searched(), 3).c_str() : "", w.default_config.alg_id,
                    s ? std::to_string(w.searched_config.alg_id).c_str() : "",
                    s ? std::to_string(w.searched_config.split_k).c_str() : "",
                    s ? std::to_string(w.searched_config.split_k_mode).c_str() : "",
                    s ? (w.searched_from_cache ? "1" : "0") : "", w.max_alg_id, w.plan_ms, w.search_ms);
      o += buf;
    } else {
      o += ",,,,,,,,,,,,";
    }
    o += std::to_string(r.warmup) + "," + std::to_string(r.iters) + "," + gpu::sparse_dtype_name(r.dtype) + "\n";
  }
  return o;
}

// ---------------------------------------------------------------------------------------
// --fp8-dense

namespace {

uint8_t* u8(const DeviceBuffer& b) { return static_cast<uint8_t*>(b.get()); }

// One copy of the operands of a shape: bf16 W, X, dY and the outputs Y, dX; the fp8 codes
// of W, Wᵀ, X and dY with their inverse scales (from fp8_amax + the cast, made once).
struct Fp8Set {
  DeviceBuffer W, X, dY, Y, dX, W8, W8t, X8, dY8;
  DeviceBuffer scales;  // [amax, inv_scale] for W, Wᵀ, X, dY

  Fp8Set(int64_t out, int64_t in, int64_t tok, uint64_t& seed, cudaStream_t s) {
    const size_t n_w = size_t(out) * in, n_x = size_t(tok) * in, n_y = size_t(tok) * out;
    const char* who = "bench gemm --fp8-dense";
    W.allocate(2 * n_w, who, "W");
    X.allocate(2 * n_x, who, "X");
    dY.allocate(2 * n_y, who, "dY");
    Y.allocate(2 * n_y, who, "Y");
    dX.allocate(2 * n_x, who, "dX");
    W8.allocate(n_w, who, "W (e4m3)");
    W8t.allocate(n_w, who, "W^T (e4m3)");
    X8.allocate(n_x, who, "X (e4m3)");
    dY8.allocate(n_y, who, "dY (e4m3)");
    scales.allocate(8 * kScaleStride * sizeof(float), who, "scales");
    fill_nonzero_bf16(W.bf(), int64_t(n_w), seed++ * 0x1234567ull, 1.0f / std::sqrt(float(in)), s);
    fill_nonzero_bf16(X.bf(), int64_t(n_x), seed++ * 0x1234567ull, 1.0f, s);
    fill_nonzero_bf16(dY.bf(), int64_t(n_y), seed++ * 0x1234567ull, 1.0f, s);
    const Fp8Format e4 = Fp8Format::e4m3;
    gpu::fp8_amax(amax(0), W.bf(), int64_t(n_w), s);
    gpu::fp8_cast(u8(W8), inv(0), W.bf(), int64_t(n_w), amax(0), e4, nullptr, s);
    gpu::fp8_cast_transpose(u8(W8t), inv(1), W.bf(), out, in, amax(0), e4, nullptr, s);
    gpu::fp8_amax(amax(2), X.bf(), int64_t(n_x), s);
    gpu::fp8_cast(u8(X8), inv(2), X.bf(), int64_t(n_x), amax(2), e4, nullptr, s);
    gpu::fp8_amax(amax(3), dY.bf(), int64_t(n_y), s);
    gpu::fp8_cast(u8(dY8), inv(3), dY.bf(), int64_t(n_y), amax(3), e4, nullptr, s);
  }
  // Each value 256 bytes apart: cuBLASLt's fp8 kernels refuse scale pointers that are not
  // 16-byte aligned.
  static constexpr int kScaleStride = 64;
  float* amax(int i) const { return static_cast<float*>(scales.get()) + kScaleStride * (2 * i); }
  float* inv(int i) const { return static_cast<float*>(scales.get()) + kScaleStride * (2 * i + 1); }
  gpu::Fp8Operand operand(const DeviceBuffer& codes, int i) const { return {u8(codes), inv(i), Fp8Format::e4m3}; }
};

}  // namespace

GemmFp8Result run_gemm_fp8_bench(const GemmBenchOptions& opt) {
  ESPLAG_CHECK(opt.warmup >= 0 && opt.iters > 0, "bench gemm: warm-up must not be negative and iterations positive");
  ESPLAG_CHECK(opt.forward || opt.backward_data, "bench gemm: no product selected");
  GemmFp8Result r;
  r.warmup = opt.warmup;
  r.iters = opt.iters;
  r.gpu = current_gpu_name();

  CudaStream stream;
  const cudaStream_t s = stream.s;
  DeviceArena gemm_arena(gpu::Gemm::kDefaultWorkspaceBytes + gpu::Gemm::kScratchBytes + 4096, "bench gemm");
  gpu::Gemm gemm(gemm_arena);
  DeviceBuffer fp8_ws(gpu::Gemm::kDefaultWorkspaceBytes, "bench gemm --fp8-dense", "fp8 GEMM workspace");
  gpu::Fp8Gemm fp8(fp8_ws.get(), fp8_ws.bytes());
  DeviceBuffer cast_scale(128 * sizeof(float), "bench gemm --fp8-dense", "cast amax and scale");
  float* cast_amax = static_cast<float*>(cast_scale.get());
  const size_t l2 = l2_cache_bytes();
  std::vector<SparseProduct> products;
  if (opt.forward) products.push_back(SparseProduct::forward);
  if (opt.backward_data) products.push_back(SparseProduct::backward_data);

  uint64_t seed = 1;
  for (const GemmBenchShape& sh : opt.shapes) {
    check_int_sizes(sh);
    const int out = int(sh.out), in = int(sh.in), tok = int(sh.tokens);
    const size_t first_row = r.rows.size();
    for (const SparseProduct product : products) {
      GemmFp8Row row;
      row.shape = sh;
      row.product = product;
      row.flops = 2.0 * double(out) * double(in) * double(tok);
      r.rows.push_back(row);
    }
    const size_t set_bytes = size_t(sh.out) * sh.in * 4 + size_t(sh.tokens) * (sh.in + sh.out) * 5;
    const int sets = rotation_sets(set_bytes, l2);
    std::vector<std::unique_ptr<Fp8Set>> set;
    try {
      for (int k = 0; k < sets; ++k) set.push_back(std::make_unique<Fp8Set>(out, in, tok, seed, s));
      CUDA_CHECK(cudaStreamSynchronize(s));
    } catch (const Error& e) {
      set.clear();
      CUDA_CHECK(cudaStreamSynchronize(s));  // a sticky CUDA error ends the bench here
      std::fprintf(stderr, "bench gemm --fp8-dense: %s: the operands failed: %s\n", shape_text(sh).c_str(), e.what());
      for (size_t i = first_row; i < r.rows.size(); ++i)
        r.rows[i].failures.push_back(std::string("operands: ") + e.what());
      continue;
    }

    for (size_t ri = first_row; ri < r.rows.size(); ++ri) {
      GemmFp8Row& row = r.rows[ri];
      const bool fwd = row.product == SparseProduct::forward;
      const std::string where = shape_text(sh) + " " + product_text(row.product);
      std::fprintf(stderr, "bench gemm --fp8-dense: %s (M=%d N=%d K=%d)\n", where.c_str(), tok, fwd ? out : in,
                   fwd ? in : out);
      // Times one call; a failure is printed and recorded in the row, and the bench goes on.
      auto timed = [&](const std::string& what, const std::function<void(int)>& call) {
        try {
          const double ms = median_event_ms(call, opt.warmup, opt.iters, s);
          std::fprintf(stderr, "bench gemm --fp8-dense: %s %s: %.3f ms\n", where.c_str(), what.c_str(), ms);
          return ms;
        } catch (const Error& e) {
          CUDA_CHECK(cudaStreamSynchronize(s));  // a sticky CUDA error ends the bench here
          std::fprintf(stderr, "bench gemm --fp8-dense: %s %s failed: %s\n", where.c_str(), what.c_str(), e.what());
          row.failures.push_back(what + ": " + e.what());
          return 0.0;
        }
      };
      row.bf16_ms = timed("bf16", [&](int i) {
        const Fp8Set& k = *set[size_t(i % sets)];
        if (fwd)
          gemm.forward(k.Y.bf(), k.X.bf(), k.W.bf(), nullptr, tok, in, out, s);
        else
          gemm.backward_input(k.dX.bf(), k.dY.bf(), k.W.bf(), tok, in, out, false, s);
      });
      auto fp8_call = [&](int i) {
        const Fp8Set& k = *set[size_t(i % sets)];
        if (fwd)  // Y [tok, out] = X [tok, in] · W [out, in]ᵀ
          fp8.matmul(k.Y.bf(), k.operand(k.X8, 2), k.operand(k.W8, 0), nullptr, tok, out, in, false, s);
        else  // dX [tok, in] = dY [tok, out] · (Wᵀ [in, out])ᵀ
          fp8.matmul(k.dX.bf(), k.operand(k.dY8, 3), k.operand(k.W8t, 1), nullptr, tok, in, out, false, s);
      };
      fp8.set_fast_accum(false);
      row.fp8_ms = timed("fp8 (accurate accumulation)", fp8_call);
      fp8.set_fast_accum(true);
      row.fp8_fast_ms = timed("fp8 (fast accumulation)", fp8_call);

      // The token-side operand's casts: X [tok, in] (fwd) or dY [tok, out] (bwd-data).
      const int cols = fwd ? in : out;
      row.cast_values = int64_t(tok) * cols;
      auto source = [&](int i) { return fwd ? set[size_t(i % sets)]->X.bf() : set[size_t(i % sets)]->dY.bf(); };
      auto codes = [&](int i) { return fwd ? u8(set[size_t(i % sets)]->X8) : u8(set[size_t(i % sets)]->dY8); };
      const Fp8Format e4 = Fp8Format::e4m3;
      row.amax_ms = timed("fp8_amax", [&](int i) { gpu::fp8_amax(cast_amax, source(i), row.cast_values, s); });
      row.cast_ms = timed("fp8_cast", [&](int i) {
        gpu::fp8_cast(codes(i), cast_amax + 1, source(i), row.cast_values, cast_amax, e4, nullptr, s);
      });
      // Into the codes of the same size (their content is not used afterwards).
      row.cast_transpose_ms = timed("fp8_cast_transpose", [&](int i) {
        gpu::fp8_cast_transpose(codes(i), cast_amax + 1, source(i), tok, cols, cast_amax, e4, nullptr, s);
      });
    }
  }
  return r;
}

namespace {

// v with `digits` decimals, or `none` where its call failed (0) or it derives from one that did.
std::string measured(double v, int digits, const char* none) {
  return v > 0 && std::isfinite(v) ? fixed(v, digits) : none;
}

std::string csv_quoted(const std::string& s) {
  std::string q = "\"";
  for (const char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

}  // namespace

std::string gemm_fp8_bench_table(const GemmFp8Result& r) {
  std::string o;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "GEMM fp32 accumulate, bf16 out: cuBLASLt dense bf16 vs fp8 e4m3 x e4m3 (accurate / fast accumulation) "
                "on %s; casts of the token-side operand; median of %d calls after %d warm-up\n",
                r.gpu.c_str(), r.iters, r.warmup);
  o += buf;
  std::snprintf(buf, sizeof buf, "%-18s %-8s %8s %8s %8s %8s %7s %7s %15s %15s %15s\n", "out x in x tokens", "product",
                "bf16_ms", "TFLOP/s", "fp8_ms", "fast_ms", "x_fp8", "x_fast", "amax ms (GB/s)", "cast ms (GB/s)",
                "castT ms (GB/s)");
  o += buf;
  std::string failures;
  for (const GemmFp8Row& w : r.rows) {
    auto with_rate = [](double ms, double gbps) {
      return ms > 0 ? measured(ms, 3, "-") + " (" + measured(gbps, 0, "-") + ")" : std::string("-");
    };
    auto speedup = [](double x) { return x > 0 ? measured(x, 2, "-") + "x" : std::string("-"); };
    std::snprintf(buf, sizeof buf, "%-18s %-8s %8s %8s %8s %8s %7s %7s %15s %15s %15s\n", shape_text(w.shape).c_str(),
                  product_text(w.product), measured(w.bf16_ms, 3, "-").c_str(),
                  measured(w.flops / (w.bf16_ms * 1e-3) / 1e12, 1, "-").c_str(), measured(w.fp8_ms, 3, "-").c_str(),
                  measured(w.fp8_fast_ms, 3, "-").c_str(), speedup(w.speedup()).c_str(),
                  speedup(w.speedup_fast()).c_str(), with_rate(w.amax_ms, w.amax_gbps()).c_str(),
                  with_rate(w.cast_ms, w.cast_gbps()).c_str(),
                  with_rate(w.cast_transpose_ms, w.cast_transpose_gbps()).c_str());
    o += buf;
    for (const std::string& f : w.failures)
      failures += "  " + shape_text(w.shape) + " " + product_text(w.product) + " " + f + "\n";
  }
  if (!failures.empty()) o += "failed (-):\n" + failures;
  return o;
}

std::string gemm_fp8_bench_csv_header() {
  return "commit,gpu,product,out,in,tokens,bf16_ms,fp8_ms,fp8_fast_ms,speedup,speedup_fast,cast_values,amax_ms,"
         "cast_ms,cast_transpose_ms,amax_gbps,cast_gbps,cast_transpose_gbps,warmup,iters,failures\n";
}

// A failed time, and what derives from it, is an empty field; `failures` says why.
std::string gemm_fp8_bench_csv_rows(const GemmFp8Result& r, const std::string& commit) {
  std::string o;
  for (const GemmFp8Row& w : r.rows) {
    std::string failures;
    for (const std::string& f : w.failures) failures += (failures.empty() ? "" : "; ") + f;
    const std::string fields[] = {commit,
                                  csv_quoted(r.gpu),
                                  product_text(w.product),
                                  std::to_string(w.shape.out),
                                  std::to_string(w.shape.in),
                                  std::to_string(w.shape.tokens),
                                  measured(w.bf16_ms, 4, ""),
                                  measured(w.fp8_ms, 4, ""),
                                  measured(w.fp8_fast_ms, 4, ""),
                                  measured(w.speedup(), 3, ""),
                                  measured(w.speedup_fast(), 3, ""),
                                  std::to_string(w.cast_values),
                                  measured(w.amax_ms, 4, ""),
                                  measured(w.cast_ms, 4, ""),
                                  measured(w.cast_transpose_ms, 4, ""),
                                  measured(w.amax_gbps(), 1, ""),
                                  measured(w.cast_gbps(), 1, ""),
                                  measured(w.cast_transpose_gbps(), 1, ""),
                                  std::to_string(r.warmup),
                                  std::to_string(r.iters),
                                  failures.empty() ? std::string() : csv_quoted(failures)};
    for (size_t i = 0; i < std::size(fields); ++i) o += (i ? "," : "") + fields[i];
    o += "\n";
  }
  return o;
}

}  // namespace esplag
