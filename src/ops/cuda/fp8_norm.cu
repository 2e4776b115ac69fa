// A norm's output recomputed from its saved input and statistics, written as fp8 codes only
// (ops/gpu_fp8.h: fp8_norm_recompute): the tiled cast (ops/cuda/fp8_tiles.cuh) with the
// norm's arithmetic in place of the bf16 load, each value rounded to bf16 exactly as the
// norm kernels (ops/cuda/norm.cu) store it, so that the codes are those of the recomputed
// bf16 output's cast.
#include "core/error.h"
#include "ops/cuda/fp8_tiles.cuh"
#include "ops/gpu_fp8.h"

namespace esplag::gpu {

namespace {

using detail::aligned16;
using detail::Bf16Tiles;
using detail::cast_tiles;
using detail::kPack;
using detail::TilePlace;
using detail::to_bf;
using detail::to_f;
using detail::unpack8;

// RMSNorm y = x·rstd·w, LayerNorm y = (x − mean)·rstd·w + bias, of x [rows, cols] with the
// rows' saved statistics (cols % 8 == 0; x, w and bias 16-byte aligned).
struct NormTiles {
  Bf16Tiles x;               // the saved input (vec)
  const bf16 *w, *bias;      // bias may be null
  const float *mean, *rstd;  // mean null: RMSNorm
  using Raw = Bf16Tiles::Raw;
  __device__ void load(Raw& raw, const TilePlace& at, int g) const { x.load(raw, at, g); }
  __device__ void values(float (&f)[4][kPack], const Raw& raw, const TilePlace& at, int g) const {
    x.values(f, raw, at, g);
    float wk[kPack], bk[kPack];
    const bool inside = at.c < x.cols;
    unpack8(wk, inside ? *reinterpret_cast<const uint4*>(w + at.c) : make_uint4(0, 0, 0, 0));
    unpack8(bk, inside && bias ? *reinterpret_cast<const uint4*>(bias + at.c) : make_uint4(0, 0, 0, 0));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = at.r0 + 4 * g + i;
      if (r >= x.rows || !inside) {
#pragma unroll
        for (int k = 0; k < kPack; ++k) f[i][k] = 0.0f;
        continue;
      }
      const float m = mean ? mean[r] : 0.0f, rs = rstd[r];
      // The expressions of norm.cu's forward kernel, term for term.
#pragma unroll
      for (int k = 0; k < kPack; ++k)
        f[i][k] = to_f(to_bf(mean ? (f[i][k] - m) * rs * wk[k] + (bias ? bk[k] : 0.f) : f[i][k] * rs * wk[k]));
    }
  }
};

}  // namespace

void fp8_norm_recompute(const Fp8Target& to, const bf16* x, const bf16* weight, const bf16* bias, const float* mean,
                        const float* rstd, int64_t N, int C, cudaStream_t stream) {
  constexpr const char* op = "fp8_norm_recompute";
  ESPLAG_CHECK(N >= 0 && C > 0 && C % kPack == 0, op, ": bad size N=", N, ", C=", C, " (C a multiple of 8)");
  ESPLAG_CHECK(to.inv_scale && to.amax.scale_from, op, ": inv_scale and amax must not be null");
  ESPLAG_CHECK(N == 0 || (to.out || to.out_t), op, ": no codes asked for (out and out_t null)");
  ESPLAG_CHECK(N == 0 || (x && weight && rstd), op, ": x, weight and rstd must not be null");
  ESPLAG_CHECK(aligned16(x) && aligned16(weight) && aligned16(bias), op,
               ": x, weight and bias must be 16-byte aligned");
  ESPLAG_CHECK(!bias || mean, op, ": a bias needs LayerNorm's mean (RMSNorm has none)");
  const NormTiles src{{x, N, C, true}, weight, bias, mean, rstd};
  cast_tiles(op, to.out, to.out_t, to.inv_scale, src, N, C, to.amax, to.format, to.saturated, stream);
}

}  // namespace esplag::gpu
