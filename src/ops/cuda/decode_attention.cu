// Kernels of incremental generation (ops/gpu_decode.h): embeddings and RoPE at per-row
// positions, the KV-cache writes and split-K attention over the cache. Plain scalar
// kernels: at decode time they move a few rows, and the attention reads each cached key and
// value once per query head, which is what bounds it.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/rope.cuh"
#include "ops/gpu_attention.h"
#include "ops/gpu_decode.h"

namespace esplag::gpu {

namespace {

using detail::to_bf;
using detail::to_f;
using detail::warp_sum;

constexpr int kThreads = 256;
constexpr int kWarps = 4;                               // per attention block
constexpr int kPerLane = kAttentionMaxHeadDim / 32;     // head dimensions a lane holds
constexpr int kPartStride = 2;                          // (max, sum) before a split's HD values

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

__global__ void embedding_rows_kernel(bf16* out, const int32_t* tokens, const int32_t* pos, const bf16* wte,
                                      const bf16* wpe, int N, int C, int V) {
  const int64_t t_id = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t_id >= int64_t(N) * C) return;
  const int64_t r = t_id / C;
  const int c = static_cast<int>(t_id % C);
  const int tok = tokens[r];
  float v = __int_as_float(0x7fffffff);  // NaN: a bad id must not pass silently
  if (tok >= 0 && tok < V) {
    v = to_f(wte[int64_t(tok) * C + c]);
    if (wpe) v += to_f(wpe[int64_t(pos[r]) * C + c]);
  }
  out[t_id] = to_bf(v);
}

// One thread per (row, pair i), as rope.cu's kernel with the row's own position.
__global__ void rope_rows_kernel(bf16* qkv, const int32_t* pos, int N, int rotated_heads, int64_t Q, int HD,
                                 double theta) {
  const int half = HD / 2;
  const int64_t t_id = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t_id >= int64_t(N) * half) return;
  const int64_t r = t_id / half;
  const int i = static_cast<int>(t_id % half);
  const float2 cs = detail::rope_cos_sin(static_cast<double>(pos[r]), i, HD, theta);
  bf16* row = qkv + r * Q;
  for (int h = 0; h < rotated_heads; ++h) {
    bf16* x1 = row + static_cast<int64_t>(h) * HD + i;
    bf16* x2 = x1 + half;
    const float2 y = detail::rope_rotate(to_f(*x1), to_f(*x2), cs.x, cs.y);
    *x1 = to_bf(y.x);
    *x2 = to_bf(y.y);
  }
}

__global__ void store_kv_rows_kernel(bf16* k_cache, bf16* v_cache, const bf16* qkv, const int32_t* seq,
                                     const int32_t* pos, int N, int64_t Q, int64_t q_width, int KVR, int max_len) {
  const int64_t t_id = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t_id >= int64_t(N) * KVR) return;
  const int64_t r = t_id / KVR;
  const int c = static_cast<int>(t_id % KVR);
  const int64_t slot = (int64_t(seq[r]) * max_len + pos[r]) * KVR + c;
  const bf16* k = qkv + r * Q + q_width;
  k_cache[slot] = k[c];
  v_cache[slot] = k[KVR + c];
}

// Block (split s, head h, row r): positions [s·kDecodeSplit, min(+kDecodeSplit, pos[r]+1)),
// warp w taking every kWarps-th of them with an online softmax, lane holding dimensions
// lane, lane+32, ...; then the warps merged into part[r, h, s] = (max, sum, acc[HD]) with
// acc unnormalised (Σ exp(score - max) · v).
__global__ void __launch_bounds__(kWarps * 32)
    decode_attention_split_kernel(float* part, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                                  const int32_t* seq, const int32_t* pos, int NH, int NKV, int HD, int max_len,
                                  int splits, float scale) {
  const int s = blockIdx.x, h = blockIdx.y, r = blockIdx.z;
  const int p = pos[r];
  const int begin = s * kDecodeSplit;
  if (begin > p) return;  // the merge reads splits up to pos[r] only
  const int end = min(begin + kDecodeSplit, p + 1);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int KVR = NKV * HD;
  const int64_t Q = int64_t(NH + 2 * NKV) * HD;
  const bf16* qr = qkv + r * Q + int64_t(h) * HD;
  const int64_t base = int64_t(seq[r]) * max_len * KVR + int64_t(h / (NH / NKV)) * HD;

  float q[kPerLane], acc[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int d = lane + 32 * k;
    q[k] = d < HD ? to_f(qr[d]) : 0.0f;
    acc[k] = 0.0f;
  }
  float m = neg_inf(), l = 0.0f;
  for (int j = begin + w; j < end; j += kWarps) {
    const bf16* kr = k_cache + base + int64_t(j) * KVR;
    const bf16* vr = v_cache + base + int64_t(j) * KVR;
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int d = lane + 32 * k;
      if (d < HD) dot += q[k] * to_f(kr[d]);
    }
    const float score = warp_sum(dot) * scale;
    const float m_new = fmaxf(m, score);
    const float corr = expf(m - m_new);  // 0 for the first position (m = -inf)
    const float e = expf(score - m_new);
    l = l * corr + e;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int d = lane + 32 * k;
      if (d < HD) acc[k] = acc[k] * corr + e * to_f(vr[d]);
    }
    m = m_new;
  }

  __shared__ float sm_m[kWarps], sm_l[kWarps], sm_acc[kWarps][kAttentionMaxHeadDim];
  if (lane == 0) sm_m[w] = m, sm_l[w] = l;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int d = lane + 32 * k;
    if (d < HD) sm_acc[w][d] = acc[k];
  }
  __syncthreads();
  float M = neg_inf();
  for (int i = 0; i < kWarps; ++i) M = fmaxf(M, sm_m[i]);  // finite: position begin is in the split
  float* out = part + ((int64_t(r) * NH + h) * splits + s) * (kPartStride + HD);
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float a = 0.0f;
    for (int i = 0; i < kWarps; ++i)
      if (sm_m[i] != neg_inf()) a += expf(sm_m[i] - M) * sm_acc[i][d];  // a warp without positions adds nothing
    out[kPartStride + d] = a;
  }
  if (threadIdx.x == 0) {
    float L = 0.0f;
    for (int i = 0; i < kWarps; ++i)
      if (sm_m[i] != neg_inf()) L += expf(sm_m[i] - M) * sm_l[i];
    out[0] = M;
    out[1] = L;
  }
}

// Block (head h, row r): the splits 0..pos[r]/kDecodeSplit merged, one thread per dimension.
__global__ void decode_attention_merge_kernel(bf16* out, const float* part, const int32_t* pos, int NH, int HD,
                                              int splits) {
  const int h = blockIdx.x, r = blockIdx.y;
  const int used = pos[r] / kDecodeSplit + 1;
  const float* pr = part + (int64_t(r) * NH + h) * splits * (kPartStride + HD);
  float M = neg_inf();
  for (int s = 0; s < used; ++s) M = fmaxf(M, pr[int64_t(s) * (kPartStride + HD)]);
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float a = 0.0f, L = 0.0f;
    for (int s = 0; s < used; ++s) {
      const float* ps = pr + int64_t(s) * (kPartStride + HD);
      const float f = expf(ps[0] - M);
      L += f * ps[1];
      a += f * ps[kPartStride + d];
    }
    out[int64_t(r) * NH * HD + int64_t(h) * HD + d] = to_bf(a / L);
  }
}

__global__ void gather_rows_kernel(bf16* out, const bf16* in, const int32_t* rows, int A, int C) {
  const int64_t t_id = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t_id >= int64_t(A) * C) return;
  const int64_t i = t_id / C;
  const int c = static_cast<int>(t_id % C);
  out[t_id] = in[int64_t(rows[i]) * C + c];
}

void check_heads(const char* name, int NH, int NKV, int HD) {
  ESPLAG_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0 && HD > 0, name, ": bad heads NH=", NH, ", NKV=", NKV, ", HD=", HD);
}

int num_splits(int max_len) { return (max_len + kDecodeSplit - 1) / kDecodeSplit; }

}  // namespace

void embedding_rows(bf16* out, const int32_t* tokens, const int32_t* pos, const bf16* wte, const bf16* wpe, int N,
                    int C, int V, cudaStream_t stream) {
  ESPLAG_CHECK(N >= 0 && C > 0 && V > 0, "embedding_rows: bad shape N=", N, ", C=", C, ", V=", V);
  if (N == 0) return;
  embedding_rows_kernel<<<detail::blocks_for(int64_t(N) * C, kThreads), kThreads, 0, stream>>>(out, tokens, pos, wte,
                                                                                                wpe, N, C, V);
  CUDA_CHECK_LAUNCH("embedding_rows");
}

void rope_rows(bf16* qkv, const int32_t* pos, int N, int NH, int NKV, int HD, double theta, cudaStream_t stream) {
  check_heads("rope_rows", NH, NKV, HD);
  ESPLAG_CHECK(HD % 2 == 0, "rope_rows: head size HD must be even, got ", HD);
  ESPLAG_CHECK(theta > 0 && std::isfinite(theta), "rope_rows: theta must be positive and finite, got ", theta);
  if (N <= 0) return;
  const int64_t Q = int64_t(NH + 2 * NKV) * HD;
  rope_rows_kernel<<<detail::blocks_for(int64_t(N) * (HD / 2), kThreads), kThreads, 0, stream>>>(qkv, pos, N, NH + NKV,
                                                                                                 Q, HD, theta);
  CUDA_CHECK_LAUNCH("rope_rows");
}

void store_kv_rows(bf16* k_cache, bf16* v_cache, const bf16* qkv, const int32_t* seq, const int32_t* pos, int N,
                   int NH, int NKV, int HD, int max_len, cudaStream_t stream) {
  check_heads("store_kv_rows", NH, NKV, HD);
  if (N <= 0) return;
  const int KVR = NKV * HD;
  store_kv_rows_kernel<<<detail::blocks_for(int64_t(N) * KVR, kThreads), kThreads, 0, stream>>>(
      k_cache, v_cache, qkv, seq, pos, N, int64_t(NH + 2 * NKV) * HD, int64_t(NH) * HD, KVR, max_len);
  CUDA_CHECK_LAUNCH("store_kv_rows");
}

size_t decode_attention_workspace_bytes(int N, int NH, int HD, int max_len) {
  return size_t(N) * NH * num_splits(max_len) * (kPartStride + HD) * sizeof(float);
}

void decode_attention(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache, const int32_t* seq,
                      const int32_t* pos, int N, int NH, int NKV, int HD, int max_len, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  check_heads("decode_attention", NH, NKV, HD);
  ESPLAG_CHECK(HD <= kAttentionMaxHeadDim, "decode_attention: head size HD=", HD, " above ", kAttentionMaxHeadDim);
  ESPLAG_CHECK(max_len > 0 && N <= 65535, "decode_attention: bad max_len=", max_len, " or N=", N, " (at most 65535)");
  ESPLAG_CHECK(workspace_bytes >= decode_attention_workspace_bytes(N, NH, HD, max_len),
               "decode_attention: workspace of ", workspace_bytes, " bytes, needs ",
               decode_attention_workspace_bytes(N, NH, HD, max_len));
  if (N <= 0) return;
  const int splits = num_splits(max_len);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(HD)));
  float* part = static_cast<float*>(workspace);
  decode_attention_split_kernel<<<dim3(splits, NH, N), kWarps * 32, 0, stream>>>(part, qkv, k_cache, v_cache, seq, pos,
                                                                                NH, NKV, HD, max_len, splits, scale);
  CUDA_CHECK_LAUNCH("decode_attention (splits)");
  const int threads = std::min(256, (HD + 31) / 32 * 32);
  decode_attention_merge_kernel<<<dim3(NH, N), threads, 0, stream>>>(out, part, pos, NH, HD, splits);
  CUDA_CHECK_LAUNCH("decode_attention (merge)");
}

void gather_rows(bf16* out, const bf16* in, const int32_t* rows, int A, int C, cudaStream_t stream) {
  if (A <= 0) return;
  gather_rows_kernel<<<detail::blocks_for(int64_t(A) * C, kThreads), kThreads, 0, stream>>>(out, in, rows, A, C);
  CUDA_CHECK_LAUNCH("gather_rows");
}

}  // namespace esplag::gpu
