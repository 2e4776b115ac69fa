// LayerNorm and RMSNorm, forward fused with the residual add (its kernel in
// norm.cuh, with a bf16 sink here), backward accumulating into the residual-stream
// gradient: one warp per row as the forward (see there). The weight / bias gradients are
// deterministic two-pass column sums (reduce.cuh).
#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/norm.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/gpu.h"

namespace esplag::gpu {

namespace {

using detail::kPack;
using detail::load_n;
using detail::store_n;
using detail::warp_sum;

constexpr int kRowsPerBlock = detail::kNormRowsPerBlock;
constexpr int kThreads = detail::kNormThreads;

// The forward's sink: the output in bf16.
template <bool kVec>
struct Bf16Rows {
  bf16* out;
  __device__ void begin() {}
  __device__ void put(int64_t off, int c, const float (&v)[kPack], int) { store_n<kVec>(out + off, c, v); }
  __device__ void finish() {}
};

// dinp += d(norm)/d(inp) · dout, per row.
//   LayerNorm: dx = rstd (g - mean(g) - x̂ mean(g x̂)),  g = dout w, x̂ = (x - mean) rstd
//   RMSNorm:   dx = rstd g - rstd³ x mean(g x)
template <bool kVec, bool kRms>
__global__ void __launch_bounds__(kThreads)
    norm_backward_kernel(bf16* dinp, const bf16* dout, const bf16* inp, const bf16* weight, const float* mean,
                         const float* rstd, int N, int C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const int64_t off = row * C;
  const int first = kVec ? lane * kPack : lane, step = kVec ? 32 * kPack : 32;
  const float m = kRms ? 0.f : mean[row], r = rstd[row];
  float sg = 0.f, sgx = 0.f;
  for (int c = first; c < C; c += step) {
    float d[kPack], x[kPack], w[kPack];
    const int n = load_n<kVec>(d, dout + off, c, C);
    load_n<kVec>(x, inp + off, c, C);
    load_n<kVec>(w, weight, c, C);
    detail::add_row_sums<kRms>(sg, sgx, d, x, w, m, r, n);
  }
  sgx = warp_sum(sgx);
  if (!kRms) sg = warp_sum(sg);
  const float mg = sg / C, mgx = sgx / C;
  const float kr = r * r * r * mgx;
  for (int c = first; c < C; c += step) {
    float d[kPack], x[kPack], w[kPack], o[kPack];
    const int n = load_n<kVec>(d, dout + off, c, C);
    load_n<kVec>(x, inp + off, c, C);
    load_n<kVec>(w, weight, c, C);
    load_n<kVec>(o, dinp + off, c, C);
    for (int k = 0; k < n; ++k) {
      const float g = d[k] * w[k];
      float dx;
      if constexpr (kRms)
        dx = r * g - kr * x[k];
      else
        dx = r * (g - mg - ((x[k] - m) * r) * mgx);
      o[k] += dx;
    }
    store_n<kVec>(dinp + off, c, o);
  }
}

template <bool kRms>
void launch_forward(bf16* out, float* mean, float* rstd, bf16* res, const bf16* a, const bf16* b,
                    PendingScale b_scale, const bf16* weight, const bf16* bias, int N, int C, float eps,
                    cudaStream_t stream, const char* name) {
  ESPLAG_CHECK(N >= 0 && C > 0, name, ": bad size N=", N, ", C=", C);
  ESPLAG_CHECK(out && a && weight, name, ": out, input and weight must not be null");
  ESPLAG_CHECK(!b || res, name, ": the fused residual add (b given) needs residual_out");
  if (N == 0) return;
  const bool vec = C % kPack == 0 && detail::aligned16(out) && detail::aligned16(a) && detail::aligned16(weight) &&
                   (!b || (detail::aligned16(b) && detail::aligned16(res))) && (!bias || detail::aligned16(bias));
  const unsigned grid = detail::blocks_for(N, kRowsPerBlock);
  if (vec)
    detail::norm_forward_kernel<true, kRms>
        <<<grid, kThreads, 0, stream>>>(Bf16Rows<true>{out}, mean, rstd, res, a, b, b_scale, weight, bias, N, C, eps);
  else
    detail::norm_forward_kernel<false, kRms>
        <<<grid, kThreads, 0, stream>>>(Bf16Rows<false>{out}, mean, rstd, res, a, b, b_scale, weight, bias, N, C, eps);
  CUDA_CHECK_LAUNCH(name);
}

template <bool kRms>
void launch_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                     const bf16* weight, const float* mean, const float* rstd, int N, int C, void* scratch,
                     size_t scratch_bytes, cudaStream_t stream, const char* name) {
  ESPLAG_CHECK(N >= 0 && C > 0, name, ": bad size N=", N, ", C=", C);
  ESPLAG_CHECK(dout && inp && rstd && (kRms || mean), name, ": dout, inp and the saved statistics must not be null");
  if (N == 0) return;
  if (dinp) {
    ESPLAG_CHECK(weight, name, ": weight must not be null when dinp is wanted");
    const bool vec = C % kPack == 0 && detail::aligned16(dinp) && detail::aligned16(dout) &&
                     detail::aligned16(inp) && detail::aligned16(weight);
    const unsigned grid = detail::blocks_for(N, kRowsPerBlock);
    if (vec)
      norm_backward_kernel<true, kRms><<<grid, kThreads, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
    else
      norm_backward_kernel<false, kRms><<<grid, kThreads, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
    CUDA_CHECK_LAUNCH(name);
  }
  if (dweight || dbias) {
    ESPLAG_CHECK(scratch_bytes >= norm_backward_scratch_bytes(N, C), name, ": scratch of ", scratch_bytes,
                 " bytes is smaller than norm_backward_scratch_bytes(", N, ", ", C, ") = ",
                 norm_backward_scratch_bytes(N, C));
    detail::column_reduce(kRms ? detail::ColumnMode::rmsnorm : detail::ColumnMode::layernorm, dweight, dbias, dout,
                          inp, mean, rstd, N, C, static_cast<float*>(scratch), scratch_bytes / sizeof(float),
                          stream);
  }
}

}  // namespace

void layernorm_forward(bf16* out, float* mean, float* rstd, bf16* residual_out, const bf16* a, const bf16* b,
                       const bf16* weight, const bf16* bias, int N, int C, cudaStream_t stream, float eps,
                       PendingScale b_scale) {
  launch_forward<false>(out, mean, rstd, residual_out, a, b, b_scale, weight, bias, N, C, eps, stream,
                        "layernorm_forward");
}

void rmsnorm_forward(bf16* out, float* rstd, bf16* residual_out, const bf16* a, const bf16* b,
                     const bf16* weight, int N, int C, cudaStream_t stream, float eps, PendingScale b_scale) {
  launch_forward<true>(out, nullptr, rstd, residual_out, a, b, b_scale, weight, nullptr, N, C, eps, stream,
                       "rmsnorm_forward");
}

size_t norm_backward_scratch_bytes(int N, int C) {
  return detail::column_reduce_scratch_floats(N, C, 2) * sizeof(float);
}

void layernorm_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, void* scratch,
                        size_t scratch_bytes, cudaStream_t stream) {
  launch_backward<false>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, scratch, scratch_bytes, stream,
                         "layernorm_backward");
}

void rmsnorm_backward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                      const float* rstd, int N, int C, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  launch_backward<true>(dinp, dweight, nullptr, dout, inp, weight, nullptr, rstd, N, C, scratch, scratch_bytes,
                        stream, "rmsnorm_backward");
}

}  // namespace esplag::gpu
