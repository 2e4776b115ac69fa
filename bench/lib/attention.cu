// Timing of the attention paths (see bench/lib/attention.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "bench/lib/attention.h"
#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/dtype.h"
#include "core/error.h"
#include "ops/cuda/common.cuh"

namespace esplag::gpu {

namespace {

// Uniform in [-sqrt(3), sqrt(3)) (unit variance) from a counter hash, so inputs are
// seeded, never zero, and need no host copy.
__global__ void fill_uniform_kernel(bf16* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = float(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    x[i] = __float2bfloat16_rn((2.f * u - 1.f) * 1.7320508f);
  }
}

void fill_uniform(bf16* x, size_t n, uint64_t seed, cudaStream_t stream) {
  fill_uniform_kernel<<<1024, 256, 0, stream>>>(x, n, seed);
  CUDA_CHECK_LAUNCH("attention bench fill");
}

std::vector<float> to_host(const bf16* d, size_t n, cudaStream_t stream) {
  std::vector<uint16_t> bits(n);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaMemcpy(bits.data(), d, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = bf16_to_float(bits[i]);
  return f;
}

double rel_rms(const std::vector<float>& x, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(x[i]) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (double(v[n / 2 - 1]) + v[n / 2]);
}

}  // namespace

std::vector<AttentionBenchShape> attention_bench_shapes() {
  return {{"gpt2-124m", 16, 1024, 12, 12, 64}, {"gpt2-350m", 8, 1024, 16, 16, 64}, {"llama-1b", 4, 2048, 16, 16, 128}};
}

std::vector<AttentionBenchRow> bench_attention(const std::vector<AttentionBenchShape>& shapes,
                                               const AttentionBenchOptions& options) {
  ESPLAG_CHECK(options.iters > 0 && options.warmup >= 0, "bench_attention: iters must be positive and warmup ",
               "non-negative, got iters=", options.iters, " warmup=", options.warmup);
  std::vector<AttentionBenchRow> rows;
  CudaStream stream;
  const cudaStream_t s = stream.s;
  for (const AttentionBenchShape& shape : shapes) {
    const int B = shape.B, T = shape.T, NH = shape.NH, NKV = shape.NKV, HD = shape.HD;
    ESPLAG_CHECK(B > 0 && T > 0, "bench_attention: shape ", shape.name, " needs B and T positive");
    const size_t C = size_t(NH + 2 * NKV) * HD, nq = size_t(B) * T * C, no = size_t(B) * T * NH * HD;
    const size_t ns = size_t(B) * NH * T;

    // Per path: whether it runs and with how much workspace (this also builds cuDNN's plans).
    std::vector<AttentionBenchRow> shape_rows;
    size_t workspace = 0;
    for (AttentionPath path : options.paths) {
      AttentionBenchRow row;
      row.shape = shape;
      row.path = path;
      try {
        row.workspace_bytes = attention_workspace_bytes(B, T, NH, NKV, HD, path);
        row.ran = true;
        workspace = std::max(workspace, row.workspace_bytes);
      } catch (const Error& e) {
        row.note = e.what();
      }
      shape_rows.push_back(row);
    }

    const size_t slack = 8 * DeviceArena::kDefaultAlignment;
    DeviceArena arena(2 * nq * sizeof(bf16) + 2 * no * sizeof(bf16) + ns * sizeof(float) + workspace + slack,
                      "attention bench");
    bf16* qkv = arena.allocate_array<bf16>("qkv", nq);
    bf16* dqkv = arena.allocate_array<bf16>("dqkv", nq);
    bf16* out = arena.allocate_array<bf16>("out", no);
    bf16* dout = arena.allocate_array<bf16>("dout", no);
    float* lse = arena.allocate_array<float>("lse", ns);
    void* ws = workspace ? arena.allocate("workspace", workspace) : nullptr;
    fill_uniform(qkv, nq, options.seed, s);
    fill_uniform(dout, no, options.seed + 1, s);

    const double fwd_flop = 2.0 * B * NH * double(T) * T * HD;  // 4·T²·HD per head, halved by the mask
    std::vector<float> ref_out, ref_dqkv;
    for (AttentionBenchRow& row : shape_rows) {
      if (!row.ran) {
        rows.push_back(row);
        continue;
      }
      const AttentionPath path = row.path;
      auto fwd = [&] { attention_forward(out, lse, qkv, B, T, NH, NKV, HD, ws, workspace, s, path); };
      auto bwd = [&] {
        attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HD, ws, workspace, s, path);
      };
      try {
        for (int i = 0; i < options.warmup; ++i) {
          fwd();
          bwd();
        }
        CudaEvents ev(3 * size_t(options.iters));
        for (int i = 0; i < options.iters; ++i) {
          CUDA_CHECK(cudaEventRecord(ev.e[3 * i], s));
          fwd();
          CUDA_CHECK(cudaEventRecord(ev.e[3 * i + 1], s));
          bwd();
          CUDA_CHECK(cudaEventRecord(ev.e[3 * i + 2], s));
        }
        CUDA_CHECK(cudaStreamSynchronize(s));
        std::vector<float> f(options.iters), b(options.iters);
        for (int i = 0; i < options.iters; ++i) {
          CUDA_CHECK(cudaEventElapsedTime(&f[i], ev.e[3 * i], ev.e[3 * i + 1]));
          CUDA_CHECK(cudaEventElapsedTime(&b[i], ev.e[3 * i + 1], ev.e[3 * i + 2]));
        }
        row.fwd_ms = median(f);
        row.bwd_ms = median(b);
        row.fwd_tflops = fwd_flop / (row.fwd_ms * 1e-3) / 1e12;
        row.bwd_tflops = 2.5 * fwd_flop / (row.bwd_ms * 1e-3) / 1e12;
        std::vector<float> o = to_host(out, no, s), d = to_host(dqkv, nq, s);
        if (ref_out.empty()) {
          ref_out = std::move(o);
          ref_dqkv = std::move(d);
        } else {
          row.out_rel_diff = rel_rms(o, ref_out);
          row.dqkv_rel_diff = rel_rms(d, ref_dqkv);
        }
      } catch (const Error& e) {
        row.ran = false;
        row.note = e.what();
      }
      rows.push_back(row);
    }
  }
  return rows;
}

std::string format_attention_bench(const std::vector<AttentionBenchRow>& rows) {
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line, "%-10s %3s %5s %3s %3s %3s  %-22s %8s %8s %7s %7s %10s %9s %9s\n", "shape", "B", "T",
                "NH", "NKV", "HD", "path", "fwd ms", "bwd ms", "fwd TF", "bwd TF", "ws MiB", "d(out)", "d(dqkv)");
  os << line;
  for (const AttentionBenchRow& r : rows) {
    const AttentionBenchShape& s = r.shape;
    if (!r.ran) {
      std::snprintf(line, sizeof line, "%-10s %3d %5d %3d %3d %3d  %-22s not run: %s\n", s.name.c_str(), s.B, s.T,
                    s.NH, s.NKV, s.HD, attention_path_name(r.path), r.note.c_str());
      os << line;
      continue;
    }
    char d1[32] = "-", d2[32] = "-";
    if (r.out_rel_diff >= 0) std::snprintf(d1, sizeof d1, "%.2e", r.out_rel_diff);
    if (r.dqkv_rel_diff >= 0) std::snprintf(d2, sizeof d2, "%.2e", r.dqkv_rel_diff);
    std::snprintf(line, sizeof line, "%-10s %3d %5d %3d %3d %3d  %-22s %8.3f %8.3f %7.1f %7.1f %10.1f %9s %9s\n",
                  s.name.c_str(), s.B, s.T, s.NH, s.NKV, s.HD, attention_path_name(r.path), r.fwd_ms, r.bwd_ms,
                  r.fwd_tflops, r.bwd_tflops, double(r.workspace_bytes) / (1 << 20), d1, d2);
    os << line;
  }
  return os.str();
}

std::string attention_bench_csv(const std::vector<AttentionBenchRow>& rows) {
  std::ostringstream os;
  os << "shape,B,T,NH,NKV,HD,path,ran,fwd_ms,bwd_ms,fwd_tflops,bwd_tflops,workspace_bytes,out_rel_diff,"
        "dqkv_rel_diff\n";
  for (const AttentionBenchRow& r : rows) {
    const AttentionBenchShape& s = r.shape;
    os << s.name << ',' << s.B << ',' << s.T << ',' << s.NH << ',' << s.NKV << ',' << s.HD << ','
       << attention_path_name(r.path) << ',' << (r.ran ? 1 : 0) << ',' << r.fwd_ms << ',' << r.bwd_ms << ','
       << r.fwd_tflops << ',' << r.bwd_tflops << ',' << r.workspace_bytes << ',' << r.out_rel_diff << ','
       << r.dqkv_rel_diff << '\n';
  }
  return os.str();
}

}  // namespace esplag::gpu
