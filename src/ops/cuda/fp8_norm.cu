// A norm's output written as fp8 codes only (ops/gpu_fp8.h), each value norm_output's
// (ops/cuda/norm.cuh) rounded to bf16 as the bf16 norms store it, so that the codes are
// those of the bf16 output's cast:
// - in the forward (fp8_layernorm_forward, fp8_rmsnorm_forward), the norms' forward kernel
//   (ops/cuda/norm.cuh) with a sink that encodes its rows;
// - recomputed from the saved input and statistics (fp8_norm_recompute), the tiled cast
//   (ops/cuda/fp8_tiles.cuh) with the norm's arithmetic in place of the bf16 load.
#include "core/error.h"
#include "ops/cuda/fp8_tiles.cuh"
#include "ops/cuda/norm.cuh"
#include "ops/gpu_fp8.h"

namespace esplag::gpu {

namespace {

using detail::add_clipped;
using detail::aligned16;
using detail::aligned8;
using detail::Bf16Tiles;
using detail::cast_tiles;
using detail::counter;
using detail::encode8;
using detail::fp8_scale_of;
using detail::kPack;
using detail::record_amax;
using detail::round_to_bf16;
using detail::TilePlace;
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
#pragma unroll
      for (int k = 0; k < kPack; ++k)
        f[i][k] = mean ? detail::norm_output<false>(f[i][k], m, rs, wk[k], bias ? bk[k] : 0.f)
                       : detail::norm_output<true>(f[i][k], m, rs, wk[k], 0.f);
      round_to_bf16(f[i]);  // as the bf16 kernel stores it
    }
  }
};

// The forward's sink: each row's values as e4m3 codes (8 bytes a store), the block's amax
// and saturated count recorded at the end.
struct CodeRows {
  uint8_t* out;
  float* inv_scale;
  const float* scale_from;
  float* record;
  unsigned long long* saturated;
  float s = 1.0f, m = 0.0f;
  int clipped = 0;
  __device__ void begin() {
    s = fp8_scale_of<false>(*scale_from);
    if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = __frcp_rn(s);
  }
  __device__ void put(int64_t off, int c, float (&v)[kPack], int) {
    round_to_bf16(v);  // as the bf16 kernel stores it
    *reinterpret_cast<uint2*>(out + off + c) = encode8<false>(v, s, clipped, m);
  }
  __device__ void finish() {
    __shared__ int scratch[32];
    __shared__ float fscratch[32];
    add_clipped(saturated, clipped, scratch);
    record_amax(record, m, fscratch);
  }
};

template <bool kRms>
void norm_forward_codes(const char* op, const Fp8Target& to, float* mean, float* rstd, bf16* res, const bf16* a,
                        const bf16* b, PendingScale b_scale, const bf16* weight, const bf16* bias, int N, int C,
                        float eps, cudaStream_t stream) {
  ESPLAG_CHECK(N >= 0 && C > 0 && C % kPack == 0, op, ": bad size N=", N, ", C=", C, " (C a multiple of 8)");
  ESPLAG_CHECK(to.inv_scale && to.amax.scale_from, op, ": inv_scale and amax must not be null");
  ESPLAG_CHECK(to.format == Fp8Format::e4m3, op, ": the output's codes are e4m3 (a layer input)");
  ESPLAG_CHECK(N == 0 || (to.out && !to.out_t), op, ": takes out only (out_t null)");
  ESPLAG_CHECK(N == 0 || (a && weight), op, ": input and weight must not be null");
  ESPLAG_CHECK(!b || res, op, ": the fused residual add (b given) needs residual_out");
  ESPLAG_CHECK(aligned8(to.out) && aligned16(a) && aligned16(weight) && aligned16(bias) &&
                   (!b || (aligned16(b) && aligned16(res))),
               op, ": out must be 8-byte aligned, the bf16 buffers 16-byte aligned");
  const CodeRows sink{to.out, to.inv_scale, to.amax.scale_from, to.amax.record, counter(to.saturated)};
  // One block even for N = 0: it writes inv_scale.
  const unsigned grid = std::max(1u, detail::blocks_for(N, detail::kNormRowsPerBlock));
  detail::norm_forward_kernel<true, kRms>
      <<<grid, detail::kNormThreads, 0, stream>>>(sink, mean, rstd, res, a, b, b_scale, weight, bias, N, C, eps);
  CUDA_CHECK_LAUNCH(op);
}

}  // namespace

void fp8_layernorm_forward(const Fp8Target& to, float* mean, float* rstd, bf16* residual_out, const bf16* a,
                           const bf16* b, const bf16* weight, const bf16* bias, int N, int C, cudaStream_t stream,
                           float eps, PendingScale b_scale) {
  norm_forward_codes<false>("fp8_layernorm_forward", to, mean, rstd, residual_out, a, b, b_scale, weight, bias, N, C,
                            eps, stream);
}

void fp8_rmsnorm_forward(const Fp8Target& to, float* rstd, bf16* residual_out, const bf16* a, const bf16* b,
                         const bf16* weight, int N, int C, cudaStream_t stream, float eps, PendingScale b_scale) {
  norm_forward_codes<true>("fp8_rmsnorm_forward", to, nullptr, rstd, residual_out, a, b, b_scale, weight, nullptr, N,
                           C, eps, stream);
}

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
