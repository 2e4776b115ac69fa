// RoPE's backward written as fp8 codes only (ops/gpu_fp8.h): the tiled cast
// (ops/cuda/fp8_tiles.cuh) of dqkv with the inverse rotation in place of the bf16 load, each
// value rounded to bf16 as rope_backward stores it, so that the codes are those of its
// output's cast. A q or k column's value needs its pair's other half, HD / 2 columns away
// (in the next or previous column tile when HD > 64): each thread also loads those eight
// columns of its rows, which another block reads as its own at about the same time (the
// persistent grid walks neighbouring tiles together), so they come mostly from L2. The
// angles come from rope_table's cosines and sines, not from fp64 sincos per value.
#include "core/error.h"
#include "ops/cuda/fp8_tiles.cuh"
#include "ops/cuda/rope.cuh"
#include "ops/gpu.h"
#include "ops/gpu_fp8.h"

namespace esplag::gpu {

namespace {

using detail::aligned16;
using detail::Bf16Tiles;
using detail::kPack;
using detail::TilePlace;
using detail::to_bf;
using detail::to_f;

// dqkv [rows, cols] with the q and k heads' columns (the first `rotated`) turned back by
// their positions' angles (row r at position r % T), v's as they are. HD % 16 == 0: a
// thread's eight columns lie in one half of one head.
struct RopeGradTiles {
  Bf16Tiles x;  // dqkv (vec)
  const float2* cos_sin;
  int T, HD;
  int64_t rotated;
  struct Raw {
    Bf16Tiles::Raw own, other;  // the thread's columns, and their pairs' other halves
  };
  __device__ TilePlace other_half(const TilePlace& at) const {
    TilePlace p = at;
    p.c += at.c % HD < HD / 2 ? HD / 2 : -HD / 2;
    return p;
  }
  __device__ void load(Raw& raw, const TilePlace& at, int g) const {
    x.load(raw.own, at, g);
    if (at.c < rotated) x.load(raw.other, other_half(at), g);
  }
  __device__ void values(float (&f)[4][kPack], const Raw& raw, const TilePlace& at, int g) const {
    x.values(f, raw.own, at, g);
    if (at.c >= rotated) return;
    float o[4][kPack];
    x.values(o, raw.other, at, g);
    const int half = HD / 2, j = static_cast<int>(at.c % HD);
    const bool first = j < half;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = at.r0 + 4 * g + i;
      if (r >= x.rows) continue;  // zeros, as the source reads past the edge
      const float4* cs = reinterpret_cast<const float4*>(cos_sin + (r % T) * half + (first ? j : j - half));
#pragma unroll
      for (int k = 0; k < kPack; k += 2) {
        const float4 q = cs[k / 2];  // pairs k and k + 1: cos, sin, cos, sin
        const float2 y0 = first ? detail::rope_rotate(f[i][k], o[i][k], q.x, -q.y)
                                : detail::rope_rotate(o[i][k], f[i][k], q.x, -q.y);
        const float2 y1 = first ? detail::rope_rotate(f[i][k + 1], o[i][k + 1], q.z, -q.w)
                                : detail::rope_rotate(o[i][k + 1], f[i][k + 1], q.z, -q.w);
        f[i][k] = to_f(to_bf(first ? y0.x : y0.y));
        f[i][k + 1] = to_f(to_bf(first ? y1.x : y1.y));
      }
    }
  }
};

}  // namespace

void fp8_rope_backward(const Fp8Target& grad, const bf16* dqkv, const RopeTable& table, int B, int T, int NH, int NKV,
                       int HD, cudaStream_t stream) {
  constexpr const char* op = "fp8_rope_backward";
  ESPLAG_CHECK(B >= 0 && T > 0 && NH > 0 && NKV > 0 && NH % NKV == 0, op, ": bad shape B=", B, ", T=", T, ", NH=",
               NH, ", NKV=", NKV, " (NH a multiple of NKV)");
  ESPLAG_CHECK(HD > 0 && HD % 16 == 0, op, ": head size HD=", HD, " must be a multiple of 16");
  ESPLAG_CHECK(table.cos_sin && T <= table.positions && HD == table.head_dim, op, ": the table (",
               table.positions, " positions, head size ", table.head_dim, ") does not hold T=", T, ", HD=", HD);
  ESPLAG_CHECK(grad.inv_scale && grad.amax.scale_from, op, ": inv_scale and amax must not be null");
  const int64_t rows = int64_t(B) * T, cols = int64_t(NH + 2 * NKV) * HD;
  ESPLAG_CHECK(rows == 0 || (grad.out && grad.out_t && dqkv), op, ": dqkv and both layouts' codes must not be null");
  ESPLAG_CHECK(aligned16(dqkv) && aligned16(table.cos_sin), op, ": dqkv and the table must be 16-byte aligned");
  const RopeGradTiles src{{dqkv, rows, cols, true}, table.cos_sin, T, HD, int64_t(NH + NKV) * HD};
  detail::cast_tiles(op, grad.out, grad.out_t, grad.inv_scale, src, rows, cols, grad.amax, grad.format,
                     grad.saturated, stream);
}

}  // namespace esplag::gpu
