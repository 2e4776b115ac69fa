// Rotary position embedding on the fused qkv buffer (ops/attention.h convention).
//
// One thread per (token, P consecutive pairs i .. i + P - 1): it computes the pairs' angles
// once (ops/cuda/rope.cuh, in fp64) and rotates those pairs of every q and k head of the
// token, loading kHeadsAtOnce heads' pairs before it stores any: the loads of one head would
// otherwise wait for the stores of the one before (the compiler cannot tell they do not
// overlap), a memory round trip per head. P = 4 where the head size is a multiple of 8 (one
// 8-byte load and store per half-head; with P = 1 the kernel issued more memory instructions
// than the SM could keep up with, and ran at a third of the memory's speed), else 1.
// Consecutive threads touch consecutive elements of a head, so the accesses coalesce. Each
// value is computed alike for every P. The forward may take qkv's pending scale (a 2:4 fp8
// product's output): each value is scaled as it is loaded, and then v's heads are scaled too.
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/pending_scale.cuh"
#include "ops/cuda/rope.cuh"
#include "ops/gpu.h"

namespace esplag::gpu {

namespace {

using detail::to_bf;
using detail::to_f;

constexpr int kThreads = 256;
constexpr int kHeadsAtOnce = 8;

// P bf16 values, loaded and stored at once.
template <int P>
struct alignas(P * sizeof(bf16)) Pack {
  bf16 v[P];
};

// Heads [0, rotated_heads) rotated, heads [rotated_heads, heads) only scaled.
template <int P>
__global__ void __launch_bounds__(kThreads) rope_kernel(bf16* x, int64_t rows, int T, int rotated_heads, int heads,
                                                        int64_t C, int HD, double theta, double sign,
                                                        PendingScale scale) {
  using V = Pack<P>;
  static_assert(sizeof(V) == P * sizeof(bf16));
  const int half = HD / 2, groups = half / P;
  const int64_t t_id = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t_id >= rows * groups) return;
  const int64_t r = t_id / groups;
  const int i0 = static_cast<int>(t_id % groups) * P;
  float c[P], s[P];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const float2 cs = detail::rope_cos_sin(static_cast<double>(r % T), i0 + p, HD, theta);
    c[p] = cs.x;
    s[p] = sign < 0 ? -cs.y : cs.y;
  }
  const detail::PendingFactor scaled(scale);
  bf16* row = x + r * C + i0;
  for (int h0 = 0; h0 < heads; h0 += kHeadsAtOnce) {
    V a[kHeadsAtOnce], b[kHeadsAtOnce];
#pragma unroll
    for (int k = 0; k < kHeadsAtOnce; ++k)
      if (h0 + k < heads) {
        const bf16* x1 = row + static_cast<int64_t>(h0 + k) * HD;
        a[k] = *reinterpret_cast<const V*>(x1);
        b[k] = *reinterpret_cast<const V*>(x1 + half);
      }
#pragma unroll
    for (int k = 0; k < kHeadsAtOnce; ++k)
      if (h0 + k < heads) {
        V ya, yb;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const float fa = scaled(to_f(a[k].v[p])), fb = scaled(to_f(b[k].v[p]));
          const float2 y = h0 + k < rotated_heads ? detail::rope_rotate(fa, fb, c[p], s[p]) : make_float2(fa, fb);
          ya.v[p] = to_bf(y.x);
          yb.v[p] = to_bf(y.y);
        }
        bf16* x1 = row + static_cast<int64_t>(h0 + k) * HD;
        *reinterpret_cast<V*>(x1) = ya;
        *reinterpret_cast<V*>(x1 + half) = yb;
      }
  }
}

void launch(bf16* x, int B, int T, int NH, int NKV, int HD, double theta, double sign, PendingScale scale,
            cudaStream_t stream, const char* name) {
  ESPLAG_CHECK(B >= 0 && T > 0 && NH > 0 && NKV > 0 && HD > 0, name, ": bad shape B=", B, ", T=", T, ", NH=", NH,
               ", NKV=", NKV, ", HD=", HD);
  ESPLAG_CHECK(NH % NKV == 0, name, ": NH=", NH, " must be a multiple of NKV=", NKV);
  ESPLAG_CHECK(HD % 2 == 0, name, ": head size HD must be even to pair rotary dimensions, got HD=", HD);
  ESPLAG_CHECK(theta > 0 && std::isfinite(theta), name, ": rotary base theta must be positive and finite, got ",
               theta);
  const int64_t rows = static_cast<int64_t>(B) * T;
  if (rows == 0) return;
  const int64_t C = static_cast<int64_t>(NH + 2 * NKV) * HD;
  const int heads = NH + (scale ? 2 : 1) * NKV;  // v's heads too where they take a scale
  const bool wide = HD % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 8 == 0;  // P = 4
  const unsigned grid = detail::blocks_for(rows * (HD / 2 / (wide ? 4 : 1)), kThreads);
  auto* kernel = wide ? rope_kernel<4> : rope_kernel<1>;
  kernel<<<grid, kThreads, 0, stream>>>(x, rows, T, NH + NKV, heads, C, HD, theta, sign, scale);
  CUDA_CHECK_LAUNCH(name);
}

}  // namespace

void rope_forward(bf16* qkv, PendingScale qkv_scale, int B, int T, int NH, int NKV, int HD, double theta,
                  cudaStream_t stream) {
  launch(qkv, B, T, NH, NKV, HD, theta, 1.0, qkv_scale, stream, "rope_forward");
}

void rope_backward(bf16* dqkv, int B, int T, int NH, int NKV, int HD, double theta, cudaStream_t stream) {
  launch(dqkv, B, T, NH, NKV, HD, theta, -1.0, {}, stream, "rope_backward");
}

}  // namespace esplag::gpu
