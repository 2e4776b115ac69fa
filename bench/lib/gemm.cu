#include "bench/lib/gemm.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>

#include "bench/lib/fill.h"
#include "bench/lib/summary.h"
#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "ops/gpu.h"

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
  int dev = 0, l2_bytes = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, dev));
  const size_t l2 = l2_bytes > 0 ? size_t(l2_bytes) : (size_t(50) << 20);

  uint64_t seed = 1;
  for (const GemmBenchShape& sh : opt.shapes) {
    const int64_t out = sh.out, in = sh.in, tok = sh.tokens;
    ESPLAG_CHECK(out <= INT32_MAX && in <= INT32_MAX && tok <= INT32_MAX, "bench gemm: shape ", shape_text(sh),
                 " is too large for the dense GEMM's int sizes");
    const size_t n_w = size_t(out) * in, n_x = size_t(tok) * in, n_y = size_t(tok) * out;
    const size_t set_bytes = 2 * (n_w + 2 * n_x + 2 * n_y);
    // Operands that fit in twice the L2 rotate over enough copies to fill four L2s.
    const int sets =
        set_bytes >= 2 * l2 ? 1 : static_cast<int>(std::min<size_t>(8, std::max<size_t>(2, (4 * l2) / set_bytes + 1)));
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

}  // namespace esplag
