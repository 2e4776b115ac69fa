// Kernels of the fused training step (ops/gpu_fused.h): split master weights, AdamW with
// its hyper-parameters in device memory, and MLP activations whose backward recomputes
// the forward output.
//
// Same expressions and constants as the op kernels they stand beside (ops/cuda/adamw.cu,
// ops/cuda/activation.cu) and the CPU references; every element written by one thread, and
// no floating-point atomics (AdamW's amaxes are integer maxima of bf16 magnitudes, exact).
#include <algorithm>
#include <cmath>

#include "core/device_arena.h"
#include "core/error.h"
#include "ops/cuda/adamw_math.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/fp8_tiles.cuh"
#include "ops/cuda/norm.cuh"
#include "ops/cuda/pending_scale.cuh"
#include "ops/cuda/swiglu_math.cuh"
#include "ops/gpu_fused.h"

namespace esplag::gpu {

namespace {

using detail::kPack;
using detail::load8;
using detail::store8;
using detail::to_bf;
using detail::to_f;

constexpr int kThreads = 256;

// ---------------------------------------------------------------------------------------
// Split master weights

__device__ __forceinline__ float join_bits(uint16_t hi, int16_t lo) {
  return __uint_as_float((static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(lo)));
}
__device__ __forceinline__ void split_bits(float w, uint16_t& hi, int16_t& lo) {
  const uint32_t r = __float_as_uint(w) + 0x8000u;
  hi = static_cast<uint16_t>(r >> 16);
  lo = static_cast<int16_t>(static_cast<int32_t>(r & 0xFFFFu) - 0x8000);
}

__global__ void master_split_kernel(uint16_t* hi, int16_t* lo, const float* w, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) split_bits(w[i], hi[i], lo[i]);
}

__global__ void master_join_kernel(float* w, const uint16_t* hi, const int16_t* lo, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) w[i] = join_bits(hi[i], lo[i]);
}

// ---------------------------------------------------------------------------------------
// AdamW

constexpr int64_t kChunk = int64_t(kThreads) * 4 * 16;  // 16 groups of 4 per thread

struct Chunk {
  int64_t offset;  // in the flat buffers
  int32_t n;
  int8_t decay;
  int8_t mirror;  // 1: also write hi to mirror[offset - mirror_base + i]
  int16_t amax;   // >= 0: raise amax[amax] to the largest finite |hi| written
};
static_assert(sizeof(Chunk) == 16, "one 16-byte load per block");

__global__ void set_params_kernel(AdamWStepParams* dst, AdamWStepParams p) { *dst = p; }

// cpu::adamw_step's update, as adamw.cu's kernel computes it.
__device__ __forceinline__ void adam_one(float& p, float& m, float& v, float g, const AdamWStepParams& h, float wd) {
  detail::adamw_element(p, m, v, g, h.lr, h.beta1, h.beta2, h.eps, h.inv_bias_correction1, h.inv_bias_correction2,
                        wd);
}

__global__ void __launch_bounds__(kThreads)
    adamw_split_kernel(const Chunk* chunks, uint16_t* hi_all, int16_t* lo_all, float* mom1, float* mom2,
                       const float* grad, const AdamWStepParams* params, const float* norm_sq, uint16_t* mirror,
                       int64_t mirror_base, float* amax) {
  const Chunk ch = chunks[blockIdx.x];
  const AdamWStepParams h = *params;
  float scale = h.grad_scale;
  if (norm_sq && h.max_grad_norm > 0.f) scale *= detail::clip_factor(*norm_sq, h.max_grad_norm);
  const float wd = ch.decay ? h.weight_decay : 0.f;
  uint16_t* hi = hi_all + ch.offset;
  int16_t* lo = lo_all + ch.offset;
  float* m = mom1 + ch.offset;
  float* v = mom2 + ch.offset;
  const float* g = grad + ch.offset;
  uint16_t* mir = (ch.mirror && mirror) ? mirror + (ch.offset - mirror_base) : nullptr;
  const auto a8 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; };
  const bool vec = ch.n % 4 == 0 && detail::aligned16(m) && detail::aligned16(v) && detail::aligned16(g) && a8(hi) &&
                   a8(lo) && (!mir || a8(mir));
  unsigned largest = 0;  // of the finite |hi| bits written: their order is the values'
  const auto note = [&](uint16_t h) {
    const unsigned a = h & 0x7FFFu;
    if (a < 0x7F80u) largest = max(largest, a);
  };
  if (vec) {
    for (int i = threadIdx.x * 4; i < ch.n; i += kThreads * 4) {
      float4 mm = *reinterpret_cast<float4*>(m + i);
      float4 vv = *reinterpret_cast<float4*>(v + i);
      const float4 gg = *reinterpret_cast<const float4*>(g + i);
      const ushort4 hh = *reinterpret_cast<const ushort4*>(hi + i);
      const short4 ll = *reinterpret_cast<const short4*>(lo + i);
      float p0 = join_bits(hh.x, ll.x), p1 = join_bits(hh.y, ll.y), p2 = join_bits(hh.z, ll.z),
            p3 = join_bits(hh.w, ll.w);
      adam_one(p0, mm.x, vv.x, gg.x * scale, h, wd);
      adam_one(p1, mm.y, vv.y, gg.y * scale, h, wd);
      adam_one(p2, mm.z, vv.z, gg.z * scale, h, wd);
      adam_one(p3, mm.w, vv.w, gg.w * scale, h, wd);
      ushort4 ho;
      short4 lw;
      split_bits(p0, ho.x, lw.x);
      split_bits(p1, ho.y, lw.y);
      split_bits(p2, ho.z, lw.z);
      split_bits(p3, ho.w, lw.w);
      *reinterpret_cast<float4*>(m + i) = mm;
      *reinterpret_cast<float4*>(v + i) = vv;
      *reinterpret_cast<ushort4*>(hi + i) = ho;
      *reinterpret_cast<short4*>(lo + i) = lw;
      if (mir) *reinterpret_cast<ushort4*>(mir + i) = ho;
      note(ho.x), note(ho.y), note(ho.z), note(ho.w);
    }
  } else {
    for (int i = threadIdx.x; i < ch.n; i += kThreads) {
      float p = join_bits(hi[i], lo[i]), mm = m[i], vv = v[i];
      adam_one(p, mm, vv, g[i] * scale, h, wd);
      uint16_t ho;
      int16_t lw;
      split_bits(p, ho, lw);
      m[i] = mm;
      v[i] = vv;
      hi[i] = ho;
      lo[i] = lw;
      if (mir) mir[i] = ho;
      note(ho);
    }
  }
  if (ch.amax < 0) return;  // the whole block's choice
  __shared__ float scratch[32];
  detail::record_amax(amax + ch.amax, __uint_as_float(largest << 16), scratch);
}

// ---------------------------------------------------------------------------------------
// Activations. The forward value is one device function used by the forward kernels and
// by the backward's recomputation, so the two agree bit for bit.

using detail::swiglu_value;
__device__ __forceinline__ float relu2_value(float x) {
  const float r = x > 0.f ? x : 0.f;
  return r * r;
}

// One thread per eight outputs of a row (kVec: H % 8 == 0 and aligned) or per output.
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(bf16* out, const bf16* inp, PendingScale inp_scale, int64_t N, int H) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int per = kVec ? kPack : 1;
  const int64_t groups = H / per;
  if (t >= N * groups) return;
  const int64_t n = t / groups;
  const int h = static_cast<int>(t % groups) * per;
  const bf16* g = inp + n * 2 * H + h;
  const bf16* u = g + H;
  bf16* o = out + n * H + h;
  const detail::PendingFactor scaled(inp_scale);
  if constexpr (kVec) {
    float vg[kPack], vu[kPack];
    load8(vg, g);
    load8(vu, u);
    scaled.apply(vg);
    scaled.apply(vu);
#pragma unroll
    for (int k = 0; k < kPack; ++k) vg[k] = swiglu_value(vg[k], vu[k]);
    store8(o, vg);
  } else {
    *o = to_bf(swiglu_value(scaled(to_f(*g)), scaled(to_f(*u))));
  }
}

// Every element is read and written by the same thread, reads first, so dinp may alias
// inp and act may alias dout (no __restrict__ on purpose).
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(bf16* dinp, bf16* act, const bf16* inp, PendingScale inp_scale, const bf16* dout,
                      PendingScale dout_scale, int64_t N, int H) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int per = kVec ? kPack : 1;
  const int64_t groups = H / per;
  if (t >= N * groups) return;
  const int64_t n = t / groups;
  const int h = static_cast<int>(t % groups) * per;
  const bf16* g = inp + n * 2 * H + h;
  const bf16* u = g + H;
  const bf16* d = dout + n * H + h;
  bf16* dg = dinp + n * 2 * H + h;
  bf16* du = dg + H;
  bf16* a = act ? act + n * H + h : nullptr;
  const detail::PendingFactor inp_scaled(inp_scale), dout_scaled(dout_scale);
  float vg[kPack], vu[kPack], vd[kPack], og[kPack], ou[kPack], oa[kPack];
  if constexpr (kVec) {
    load8(vg, g);
    load8(vu, u);
    load8(vd, d);
    inp_scaled.apply(vg);
    inp_scaled.apply(vu);
    dout_scaled.apply(vd);
  } else {
    vg[0] = inp_scaled(to_f(*g));
    vu[0] = inp_scaled(to_f(*u));
    vd[0] = dout_scaled(to_f(*d));
  }
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const detail::SwigluBackward b = detail::swiglu_backward_at(vg[k], vu[k], vd[k]);
    og[k] = b.gate;
    ou[k] = b.up;
    oa[k] = b.value;
  }
  if constexpr (kVec) {
    store8(dg, og);
    store8(du, ou);
    if (a) store8(a, oa);
  } else {
    *dg = to_bf(og[0]);
    *du = to_bf(ou[0]);
    if (a) *a = to_bf(oa[0]);
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) relu2_fwd_kernel(bf16* out, const bf16* inp, int64_t n) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kPack;
  if (i >= n) return;
  if (kVec && i + kPack <= n) {
    float v[kPack];
    load8(v, inp + i);
#pragma unroll
    for (int k = 0; k < kPack; ++k) v[k] = relu2_value(v[k]);
    store8(out + i, v);
  } else {
    const int64_t e = min(n, i + kPack);
    for (int64_t j = i; j < e; ++j) out[j] = to_bf(relu2_value(to_f(inp[j])));
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    relu2_bwd_kernel(bf16* dinp, bf16* act, const bf16* inp, const bf16* dout, int64_t n) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kPack;
  if (i >= n) return;
  if (kVec && i + kPack <= n) {
    float x[kPack], d[kPack], a[kPack];
    load8(x, inp + i);
    load8(d, dout + i);
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float r = x[k] > 0.f ? x[k] : 0.f;
      a[k] = relu2_value(x[k]);
      x[k] = 2.f * r * d[k];
    }
    store8(dinp + i, x);
    if (act) store8(act + i, a);
  } else {
    const int64_t e = min(n, i + kPack);
    for (int64_t j = i; j < e; ++j) {
      const float x = to_f(inp[j]), d = to_f(dout[j]);
      const float r = x > 0.f ? x : 0.f;
      dinp[j] = to_bf(2.f * r * d);
      if (act) act[j] = to_bf(relu2_value(x));
    }
  }
}


// ---------------------------------------------------------------------------------------
// Column sums

constexpr int kSumRows = 64;  // rows per partial of column_sum_add

int64_t sum_chunks(int64_t N) { return (N + kSumRows - 1) / kSumRows; }

// Partial column sums of one chunk of rows: one thread per 8 columns (kVec) or per column.
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    colsum_partial_kernel(float* part, const bf16* x, int64_t N, int C, int64_t chunks) {
  const int per = kVec ? kPack : 1;
  const int c = (blockIdx.x * kThreads + threadIdx.x) * per;
  if (c >= C) return;
  for (int64_t g = blockIdx.y; g < chunks; g += gridDim.y) {
    const int64_t r0 = g * kSumRows, r1 = min(N, r0 + kSumRows);
    float acc[kPack] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int64_t r = r0; r < r1; ++r) {
      if constexpr (kVec) {
        float v[kPack];
        load8(v, x + r * C + c);
#pragma unroll
        for (int k = 0; k < kPack; ++k) acc[k] += v[k];
      } else {
        acc[0] += to_f(x[r * C + c]);
      }
    }
#pragma unroll
    for (int k = 0; k < per; ++k) part[g * C + c + k] = acc[k];
  }
}

// out_p[c] += Σ_g part[p][g][c] for up to three outputs whose partial arrays lie `stride`
// floats apart. A block takes 32 columns with 32 threads each: thread y sums the chunks
// of slice y ([y·S, (y+1)·S), S = ⌈chunks / 32⌉) in order, then one thread per column
// adds the 32 slice sums in order. The order depends on the chunk count only, and the
// chains of dependent loads stay short (a thread per column alone is latency-bound).
constexpr int kFinalCols = 32, kFinalSlices = 32;

__global__ void __launch_bounds__(kFinalCols * kFinalSlices)
    partials_final_kernel(float* out0, float* out1, float* out2, const float* part, int64_t chunks, int C,
                          int64_t stride) {
  __shared__ float sh[kFinalSlices][kFinalCols + 1];
  const int x = threadIdx.x % kFinalCols, y = threadIdx.x / kFinalCols;
  const int c = blockIdx.x * kFinalCols + x;
  const int64_t S = (chunks + kFinalSlices - 1) / kFinalSlices;
  const int64_t g0 = min(chunks, y * S), g1 = min(chunks, g0 + S);
  float* outs[3] = {out0, out1, out2};
  for (int p = 0; p < 3; ++p) {
    if (!outs[p]) continue;  // the same for the whole block
    float s = 0.f;
    if (c < C) {
      const float* q = part + p * stride + c;
#pragma unroll 8
      for (int64_t g = g0; g < g1; ++g) s += q[g * C];
    }
    sh[y][x] = s;
    __syncthreads();
    if (y == 0 && c < C) {
      float t = 0.f;
      for (int j = 0; j < kFinalSlices; ++j) t += sh[j][x];
      outs[p][c] += t;
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------
// Fused norm backward. A block owns kNormRows consecutive rows and walks them in groups of
// kNormGroup: phase A, a warp per row, computes the group's row sums exactly as norm.cu's
// backward does; phase B, a thread per 8 columns (and per row lane when C < 2048), writes
// the group's dinp and keeps the column sums in registers. Phase B reads again the rows
// phase A has just read, which the caches still hold (a whole block's rows at once would
// not fit the L2 across the grid: every block is resident). A thread adds its rows in
// increasing order whatever the grouping; the row lanes are then added in order in shared
// memory and the block writes one partial row per output.

constexpr int kNormRows = 32;
constexpr int kNormGroup = kThreads / 32;  // a warp per row in phase A
constexpr int kNormBatch = 4;              // rows whose loads phase B issues before it stores any
static_assert(kNormRows % kNormGroup == 0, "groups tile the block's rows");

template <bool kRms>
__global__ void __launch_bounds__(kThreads)
    norm_bwd_fused_kernel(bf16* dinp, float* part, const bf16* dout, PendingScale dout_scale, const bf16* inp,
                          const bf16* weight, const float* mean, const float* rstd, int N, int C, int64_t stride,
                          bool want_w, bool want_b, bool want_sum) {
  __shared__ float stat_g[kNormGroup], stat_gx[kNormGroup];
  __shared__ float red[3][kFusedNormMaxC];
  const int row0 = blockIdx.x * kNormRows;
  const int rows = min(kNormRows, N - row0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int groups = C / kPack;
  const int lanes = max(1, kThreads / groups);
  const int grp = threadIdx.x % groups, rl = threadIdx.x / groups;
  const bool active = rl < lanes;
  const int c = grp * kPack;
  float w[kPack] = {}, aw[kPack] = {}, ab[kPack] = {}, as[kPack] = {};
  if (active) load8(w, weight + c);
  const detail::PendingFactor dout_scaled(dout_scale);
  int next = rl;  // the next row of this thread's row lane
  for (int g0 = 0; g0 < rows; g0 += kNormGroup) {
    const int g1 = min(rows, g0 + kNormGroup);
    if (g0 + warp < g1) {  // phase A
      const int i = g0 + warp;
      const int64_t off = static_cast<int64_t>(row0 + i) * C;
      const float m = kRms ? 0.f : mean[row0 + i], r = rstd[row0 + i];
      float sg = 0.f, sgx = 0.f;
#pragma unroll
      for (int j = 0; j < kFusedNormMaxC / (32 * kPack); ++j) {
        const int cc = (j * 32 + lane) * kPack;
        if (cc >= C) break;
        float d[kPack], x[kPack], wc[kPack];
        load8(d, dout + off + cc);
        load8(x, inp + off + cc);
        load8(wc, weight + cc);
        dout_scaled.apply(d);
        detail::add_row_sums<kRms>(sg, sgx, d, x, wc, m, r, kPack);
      }
      sgx = detail::warp_sum(sgx);
      if (!kRms) sg = detail::warp_sum(sg);
      if (lane == 0) {
        stat_g[warp] = sg / C;
        stat_gx[warp] = sgx / C;
      }
    }
    __syncthreads();
    // Phase B: this lane's rows of the group, kNormBatch at a time, loads first.
    while (active && next < g1) {
      uint4 d[kNormBatch], x[kNormBatch], o[kNormBatch];
      int n = 0;
#pragma unroll
      for (int b = 0; b < kNormBatch; ++b) {
        const int i = next + b * lanes;
        if (i >= g1) break;
        const int64_t off = static_cast<int64_t>(row0 + i) * C + c;
        d[b] = *reinterpret_cast<const uint4*>(dout + off);
        x[b] = *reinterpret_cast<const uint4*>(inp + off);
        o[b] = *reinterpret_cast<const uint4*>(dinp + off);
        n = b + 1;
      }
#pragma unroll
      for (int b = 0; b < kNormBatch; ++b) {
        if (b >= n) break;
        const int i = next + b * lanes;
        const float m = kRms ? 0.f : mean[row0 + i], r = rstd[row0 + i];
        const float mg = stat_g[i - g0], mgx = stat_gx[i - g0];
        const float kr = r * r * r * mgx;
        float dv[kPack], xv[kPack], ov[kPack];
        detail::unpack8(dv, d[b]);
        dout_scaled.apply(dv);
        detail::unpack8(xv, x[b]);
        detail::unpack8(ov, o[b]);
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          const float g = dv[k] * w[k];
          float dx;
          if constexpr (kRms) {
            dx = r * g - kr * xv[k];
            aw[k] += dv[k] * xv[k] * r;
          } else {
            const float xh = (xv[k] - m) * r;
            dx = r * (g - mg - xh * mgx);
            aw[k] += dv[k] * xh;
            ab[k] += dv[k];
          }
          ov[k] += dx;
        }
        store8(dinp + static_cast<int64_t>(row0 + i) * C + c, ov);
        if (want_sum) {
#pragma unroll
          for (int k = 0; k < kPack; ++k) as[k] += to_f(to_bf(ov[k]));  // what was stored
        }
      }
      next += n * lanes;
    }
    __syncthreads();  // the group's statistics are read before the next group's replace them
  }
  for (int l = 0; l < lanes; ++l) {  // row lanes in order
    __syncthreads();
    if (active && rl == l) {
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        red[0][c + k] = (l ? red[0][c + k] : 0.f) + aw[k];
        red[1][c + k] = (l ? red[1][c + k] : 0.f) + ab[k];
        red[2][c + k] = (l ? red[2][c + k] : 0.f) + as[k];
      }
    }
  }
  __syncthreads();
  const bool want[3] = {want_w, want_b, want_sum};
  for (int p = 0; p < 3; ++p) {
    if (!want[p]) continue;
    float* dst = part + p * stride + static_cast<int64_t>(blockIdx.x) * C;
    for (int j = threadIdx.x; j < C; j += kThreads) dst[j] = red[p][j];
  }
}

// ---------------------------------------------------------------------------------------
// Sum of squares

constexpr int kSqBlocks = 1024;
constexpr int64_t kSqMinPerBlock = 16384;

int sq_blocks(int64_t n) {
  const int64_t g = (n + kSqMinPerBlock - 1) / kSqMinPerBlock;
  return static_cast<int>(g < 1 ? 1 : (g > kSqBlocks ? kSqBlocks : g));
}

__global__ void __launch_bounds__(kThreads)
    sq_partial_kernel(float* partial, const float* x, int64_t n, int64_t per_block) {
  __shared__ float scratch[32];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t end = min(n, start + per_block);
  float a0 = 0.f, a1 = 0.f;
  int64_t i = start + threadIdx.x * 4;
  // Two float4 in flight per iteration; start is a multiple of 4 and x 16-byte aligned.
  for (; i + kThreads * 4 + 3 < end; i += 2 * kThreads * 4) {
    const float4 u = *reinterpret_cast<const float4*>(x + i);
    const float4 v = *reinterpret_cast<const float4*>(x + i + kThreads * 4);
    a0 += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w;
    a1 += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  for (; i < end; i += kThreads * 4)
    for (int64_t j = i; j < min(end, i + 4); ++j) a0 += x[j] * x[j];
  const float acc = detail::block_sum(a0 + a1, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads) sq_final_kernel(float* out, const float* partial, int G) {
  __shared__ double sh[kThreads];
  const double sum = detail::sum_partials_fp64<kThreads>(partial, G, sh);
  if (threadIdx.x == 0) *out = static_cast<float>(sum);
}

}  // namespace

// ---------------------------------------------------------------------------------------

void master_split(bf16* hi, int16_t* lo, const float* w, int64_t n, cudaStream_t stream) {
  ESPLAG_CHECK(n >= 0, "master_split: negative element count ", n);
  if (n == 0) return;
  ESPLAG_CHECK(hi && lo && w, "master_split: null buffer");
  master_split_kernel<<<detail::blocks_for(n, kThreads), kThreads, 0, stream>>>(reinterpret_cast<uint16_t*>(hi), lo,
                                                                                 w, n);
  CUDA_CHECK_LAUNCH("master_split");
}

void master_join(float* w, const bf16* hi, const int16_t* lo, int64_t n, cudaStream_t stream) {
  ESPLAG_CHECK(n >= 0, "master_join: negative element count ", n);
  if (n == 0) return;
  ESPLAG_CHECK(hi && lo && w, "master_join: null buffer");
  master_join_kernel<<<detail::blocks_for(n, kThreads), kThreads, 0, stream>>>(
      w, reinterpret_cast<const uint16_t*>(hi), lo, n);
  CUDA_CHECK_LAUNCH("master_join");
}

AdamWStepParams make_adamw_step_params(const AdamWConfig& cfg) {
  ESPLAG_CHECK(cfg.step >= 1, "AdamW: step is 1-based (the bias corrections divide by 1 - beta^step), got ", cfg.step);
  ESPLAG_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1 && cfg.beta2 >= 0 && cfg.beta2 < 1,
               "AdamW: betas must lie in [0, 1), got beta1=", cfg.beta1, ", beta2=", cfg.beta2);
  ESPLAG_CHECK(cfg.lr >= 0 && cfg.eps >= 0 && cfg.weight_decay >= 0,
               "AdamW: lr, eps and weight_decay must be >= 0, got lr=", cfg.lr, ", eps=", cfg.eps,
               ", weight_decay=", cfg.weight_decay);
  ESPLAG_CHECK(std::isfinite(cfg.grad_scale), "AdamW: grad_scale is ", cfg.grad_scale);
  ESPLAG_CHECK(std::isfinite(cfg.max_grad_norm), "AdamW: max_grad_norm is ", cfg.max_grad_norm);
  AdamWStepParams p;
  p.lr = cfg.lr;
  p.beta1 = cfg.beta1;
  p.beta2 = cfg.beta2;
  p.eps = cfg.eps;
  p.weight_decay = cfg.weight_decay;
  // In fp64 on the host: 1 - β^t loses digits in fp32 for β2 near 1.
  p.inv_bias_correction1 = static_cast<float>(1.0 / (1.0 - std::pow(double(cfg.beta1), double(cfg.step))));
  p.inv_bias_correction2 = static_cast<float>(1.0 / (1.0 - std::pow(double(cfg.beta2), double(cfg.step))));
  p.grad_scale = cfg.grad_scale;
  p.max_grad_norm = cfg.max_grad_norm > 0 ? cfg.max_grad_norm : 0.f;
  return p;
}

void set_adamw_step_params(AdamWStepParams* device, const AdamWStepParams& p, cudaStream_t stream) {
  ESPLAG_CHECK(device, "set_adamw_step_params: null destination");
  set_params_kernel<<<1, 1, 0, stream>>>(device, p);
  CUDA_CHECK_LAUNCH("set_adamw_step_params");
}

size_t SplitAdamWPlan::table_bytes_bound(const std::vector<ParamSegment>& segments) {
  size_t chunks = 0;
  for (const auto& s : segments) chunks += static_cast<size_t>(s.numel / kChunk) + 1;
  const size_t a = DeviceArena::kDefaultAlignment;
  return (chunks * sizeof(Chunk) + a - 1) / a * a;
}

SplitAdamWPlan::SplitAdamWPlan(const std::vector<ParamSegment>& segments, DeviceArena& arena, int mirror_segment) {
  ESPLAG_CHECK(mirror_segment >= -1 && mirror_segment < static_cast<int>(segments.size()),
               "SplitAdamWPlan: mirror segment ", mirror_segment, " outside [-1, ", segments.size(), ")");
  std::vector<Chunk> table;
  for (size_t i = 0; i < segments.size(); ++i) {
    const ParamSegment& s = segments[i];
    ESPLAG_CHECK(s.offset >= 0 && s.numel >= 0, "SplitAdamWPlan: segment ", i, " has offset ", s.offset,
                 " and numel ", s.numel);
    ESPLAG_CHECK(s.amax_slot < 0x8000, "SplitAdamWPlan: segment ", i, " has amax slot ", s.amax_slot,
                 " (at most 32767)");
    const int8_t mirror = static_cast<int>(i) == mirror_segment ? 1 : 0;
    const int16_t amax = int16_t(std::max(-1, s.amax_slot));
    amax_slots_ = std::max(amax_slots_, amax + 1);
    for (int64_t o = 0; o < s.numel; o += kChunk)
      table.push_back(Chunk{s.offset + o, static_cast<int32_t>(std::min(kChunk, s.numel - o)), int8_t(s.decay ? 1 : 0),
                            mirror, amax});
    total_ = std::max(total_, s.offset + s.numel);
  }
  num_chunks_ = static_cast<int64_t>(table.size());
  ESPLAG_CHECK(num_chunks_ <= 0x7fffffff, "SplitAdamWPlan: ", num_chunks_, " chunks do not fit one launch");
  if (table.empty()) return;
  void* d = arena.allocate("adamw.split_chunks", table.size() * sizeof(Chunk), 16);
  CUDA_CHECK(cudaMemcpy(d, table.data(), table.size() * sizeof(Chunk), cudaMemcpyHostToDevice));
  table_ = d;
  if (mirror_segment >= 0) mirror_base_ = segments[static_cast<size_t>(mirror_segment)].offset;
}

void adamw_update_split(const SplitAdamWPlan& plan, bf16* hi, int16_t* lo, float* m, float* v, const float* grad,
                        const AdamWStepParams* params, const float* norm_sq, bf16* mirror, float* amax,
                        cudaStream_t stream) {
  ESPLAG_CHECK(amax || plan.amax_slots() == 0, "adamw_update_split: the plan takes ", plan.amax_slots(),
               " amaxes, and amax is null");
  if (plan.amax_slots() > 0) CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float) * size_t(plan.amax_slots()), stream));
  if (plan.num_chunks() == 0) return;
  ESPLAG_CHECK(hi && lo && m && v && grad && params, "adamw_update_split: null weight, moment, gradient or "
               "parameter buffer");
  adamw_split_kernel<<<static_cast<unsigned>(plan.num_chunks()), kThreads, 0, stream>>>(
      static_cast<const Chunk*>(plan.device_table()), reinterpret_cast<uint16_t*>(hi), lo, m, v, grad, params,
      norm_sq, reinterpret_cast<uint16_t*>(mirror), plan.mirror_base(), amax);
  CUDA_CHECK_LAUNCH("adamw_update_split");
}

// ---------------------------------------------------------------------------------------

namespace {
void check_swiglu(const char* op, int64_t N, int H) {
  ESPLAG_CHECK(N >= 0 && H > 0, op, ": bad size N=", N, ", H=", H);
}
}  // namespace

void fused_swiglu_forward(bf16* out, const bf16* inp, PendingScale inp_scale, int64_t N, int H, cudaStream_t stream) {
  check_swiglu("fused_swiglu_forward", N, H);
  if (N == 0) return;
  ESPLAG_CHECK(out && inp, "fused_swiglu_forward: null buffer");
  const bool vec = H % kPack == 0 && detail::aligned16(out) && detail::aligned16(inp);
  const unsigned grid = detail::blocks_for(N * (vec ? H / kPack : H), kThreads);
  if (vec)
    swiglu_fwd_kernel<true><<<grid, kThreads, 0, stream>>>(out, inp, inp_scale, N, H);
  else
    swiglu_fwd_kernel<false><<<grid, kThreads, 0, stream>>>(out, inp, inp_scale, N, H);
  CUDA_CHECK_LAUNCH("fused_swiglu_forward");
}

void fused_swiglu_backward(bf16* dinp, bf16* act, const bf16* inp, PendingScale inp_scale, const bf16* dout,
                           PendingScale dout_scale, int64_t N, int H, cudaStream_t stream) {
  check_swiglu("fused_swiglu_backward", N, H);
  if (N == 0) return;
  ESPLAG_CHECK(dinp && inp && dout, "fused_swiglu_backward: null buffer");
  const bool vec = H % kPack == 0 && detail::aligned16(dinp) && detail::aligned16(inp) && detail::aligned16(dout) &&
                   (!act || detail::aligned16(act));
  const unsigned grid = detail::blocks_for(N * (vec ? H / kPack : H), kThreads);
  if (vec)
    swiglu_bwd_kernel<true><<<grid, kThreads, 0, stream>>>(dinp, act, inp, inp_scale, dout, dout_scale, N, H);
  else
    swiglu_bwd_kernel<false><<<grid, kThreads, 0, stream>>>(dinp, act, inp, inp_scale, dout, dout_scale, N, H);
  CUDA_CHECK_LAUNCH("fused_swiglu_backward");
}

void fused_relu2_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream) {
  ESPLAG_CHECK(n >= 0, "fused_relu2_forward: negative element count ", n);
  if (n == 0) return;
  ESPLAG_CHECK(out && inp, "fused_relu2_forward: null buffer");
  const unsigned grid = detail::blocks_for(n, int64_t(kThreads) * kPack);
  if (detail::aligned16(out) && detail::aligned16(inp))
    relu2_fwd_kernel<true><<<grid, kThreads, 0, stream>>>(out, inp, n);
  else
    relu2_fwd_kernel<false><<<grid, kThreads, 0, stream>>>(out, inp, n);
  CUDA_CHECK_LAUNCH("fused_relu2_forward");
}

void fused_relu2_backward(bf16* dinp, bf16* act, const bf16* inp, const bf16* dout, int64_t n, cudaStream_t stream) {
  ESPLAG_CHECK(n >= 0, "fused_relu2_backward: negative element count ", n);
  if (n == 0) return;
  ESPLAG_CHECK(dinp && inp && dout, "fused_relu2_backward: null buffer");
  const unsigned grid = detail::blocks_for(n, int64_t(kThreads) * kPack);
  const bool vec = detail::aligned16(dinp) && detail::aligned16(inp) && detail::aligned16(dout) &&
                   (!act || detail::aligned16(act));
  if (vec)
    relu2_bwd_kernel<true><<<grid, kThreads, 0, stream>>>(dinp, act, inp, dout, n);
  else
    relu2_bwd_kernel<false><<<grid, kThreads, 0, stream>>>(dinp, act, inp, dout, n);
  CUDA_CHECK_LAUNCH("fused_relu2_backward");
}

// ---------------------------------------------------------------------------------------

size_t column_sum_scratch_bytes(int64_t N, int C) {
  return sizeof(float) * static_cast<size_t>(std::max<int64_t>(sum_chunks(N), 1)) * static_cast<size_t>(C);
}

void column_sum_add(float* out, const bf16* x, int64_t N, int C, void* scratch, size_t scratch_bytes,
                    cudaStream_t stream) {
  ESPLAG_CHECK(N >= 0 && C > 0, "column_sum_add: bad size N=", N, ", C=", C);
  if (N == 0) return;
  ESPLAG_CHECK(out && x && scratch, "column_sum_add: null buffer");
  ESPLAG_CHECK(scratch_bytes >= column_sum_scratch_bytes(N, C), "column_sum_add: scratch of ", scratch_bytes,
               " bytes, need ", column_sum_scratch_bytes(N, C), " (column_sum_scratch_bytes)");
  const int64_t chunks = sum_chunks(N);
  float* part = static_cast<float*>(scratch);
  const bool vec = C % kPack == 0 && detail::aligned16(x);
  const dim3 grid(detail::blocks_for(vec ? C / kPack : C, kThreads),
                  static_cast<unsigned>(std::min<int64_t>(chunks, 65535)));
  if (vec)
    colsum_partial_kernel<true><<<grid, kThreads, 0, stream>>>(part, x, N, C, chunks);
  else
    colsum_partial_kernel<false><<<grid, kThreads, 0, stream>>>(part, x, N, C, chunks);
  CUDA_CHECK_LAUNCH("column_sum_add (partials)");
  partials_final_kernel<<<detail::blocks_for(C, kFinalCols), kFinalCols * kFinalSlices, 0, stream>>>(
      out, nullptr, nullptr, part, chunks, C, 0);
  CUDA_CHECK_LAUNCH("column_sum_add (total)");
}

bool fused_norm_backward_supported(int C) { return C > 0 && C % kPack == 0 && C <= kFusedNormMaxC; }

size_t fused_norm_backward_scratch_bytes(int N, int C) {
  const int64_t blocks = (static_cast<int64_t>(std::max(N, 1)) + kNormRows - 1) / kNormRows;
  return sizeof(float) * 3 * static_cast<size_t>(blocks) * static_cast<size_t>(std::max(C, 1));
}

namespace {

template <bool kRms>
void launch_fused_norm_backward(bf16* dinp, float* dweight, float* dbias, float* dsum, const bf16* dout,
                                PendingScale dout_scale, const bf16* inp, const bf16* weight, const float* mean,
                                const float* rstd, int N, int C, void* scratch, size_t scratch_bytes,
                                cudaStream_t stream, const char* name) {
  ESPLAG_CHECK(N >= 0 && C > 0, name, ": bad size N=", N, ", C=", C);
  ESPLAG_CHECK(fused_norm_backward_supported(C), name, ": needs C % 8 == 0 and C <= ", kFusedNormMaxC, ", got C=",
               C);
  if (N == 0) return;
  ESPLAG_CHECK(dinp && dout && inp && weight && rstd && (kRms || mean), name,
               ": dinp, dout, inp, weight and the saved statistics must not be null");
  ESPLAG_CHECK(detail::aligned16(dinp) && detail::aligned16(dout) && detail::aligned16(inp) &&
                   detail::aligned16(weight),
               name, ": needs 16-byte aligned buffers");
  ESPLAG_CHECK(scratch && scratch_bytes >= fused_norm_backward_scratch_bytes(N, C), name, ": scratch of ",
               scratch_bytes, " bytes, need ", fused_norm_backward_scratch_bytes(N, C));
  const int64_t blocks = (static_cast<int64_t>(N) + kNormRows - 1) / kNormRows;
  const int64_t stride = blocks * C;
  float* part = static_cast<float*>(scratch);
  norm_bwd_fused_kernel<kRms><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      dinp, part, dout, dout_scale, inp, weight, mean, rstd, N, C, stride, dweight != nullptr, dbias != nullptr,
      dsum != nullptr);
  CUDA_CHECK_LAUNCH(name);
  if (dweight || dbias || dsum) {
    partials_final_kernel<<<detail::blocks_for(C, kFinalCols), kFinalCols * kFinalSlices, 0, stream>>>(
        dweight, dbias, dsum, part, blocks, C, stride);
    CUDA_CHECK_LAUNCH(name);
  }
}

}  // namespace

void fused_layernorm_backward(bf16* dinp, float* dweight, float* dbias, float* dsum, const bf16* dout,
                              PendingScale dout_scale, const bf16* inp, const bf16* weight, const float* mean,
                              const float* rstd, int N, int C, void* scratch, size_t scratch_bytes,
                              cudaStream_t stream) {
  launch_fused_norm_backward<false>(dinp, dweight, dbias, dsum, dout, dout_scale, inp, weight, mean, rstd, N, C,
                                    scratch, scratch_bytes, stream, "fused_layernorm_backward");
}

void fused_rmsnorm_backward(bf16* dinp, float* dweight, float* dsum, const bf16* dout, PendingScale dout_scale,
                            const bf16* inp, const bf16* weight, const float* rstd, int N, int C, void* scratch,
                            size_t scratch_bytes, cudaStream_t stream) {
  launch_fused_norm_backward<true>(dinp, dweight, nullptr, dsum, dout, dout_scale, inp, weight, nullptr, rstd, N, C,
                                   scratch, scratch_bytes, stream, "fused_rmsnorm_backward");
}

size_t sum_squares_scratch_bytes() { return kSqBlocks * sizeof(float); }

void sum_squares(float* out, const float* x, int64_t n, void* scratch, cudaStream_t stream) {
  ESPLAG_CHECK(n >= 0, "sum_squares: negative element count ", n);
  ESPLAG_CHECK(out && scratch && (x || n == 0), "sum_squares: null output, scratch or input");
  ESPLAG_CHECK(n == 0 || detail::aligned16(x), "sum_squares: the buffer must be 16-byte aligned");
  const int G = sq_blocks(n);
  const int64_t per_block = ((n + G - 1) / G + 3) / 4 * 4;  // whole float4s, so every block starts aligned
  float* partial = static_cast<float*>(scratch);
  if (n > 0) {
    sq_partial_kernel<<<G, kThreads, 0, stream>>>(partial, x, n, per_block);
    CUDA_CHECK_LAUNCH("sum_squares (partials)");
  }
  sq_final_kernel<<<1, kThreads, 0, stream>>>(out, partial, n > 0 ? G : 0);
  CUDA_CHECK_LAUNCH("sum_squares (total)");
}

}  // namespace esplag::gpu
