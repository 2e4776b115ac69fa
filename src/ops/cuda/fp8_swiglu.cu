// SwiGLU written as fp8 codes (ops/gpu_fp8.h: fp8_swiglu_forward, fp8_swiglu_backward): the
// codes the casts (ops/cuda/fp8_cast.cu) would make of fused_swiglu_forward's output and of
// fused_swiglu_backward's input gradient, bit for bit, without either existing in bf16.
//
// The backward: the thread that reads a value's gate, up and dout makes its gate and up
// gradients and its output (one sigmoid), over tiles of 128 rows x 64 columns of the
// output's H columns (4 rows x 8 columns a thread). Each tile gives three transposed tiles
// (d gate, d up, output) besides the gradient's codes as they lie. Persistent, as the tiled
// cast: a block loads its next tile's rows while it computes and stores the current one.
#include "core/error.h"
#include "ops/cuda/fp8_tiles.cuh"
#include "ops/cuda/pending_scale.cuh"
#include "ops/cuda/swiglu_math.cuh"
#include "ops/gpu_fp8.h"

namespace esplag::gpu {

namespace {

using detail::add_clipped;
using detail::aligned16;
using detail::aligned8;
using detail::counter;
using detail::encode8;
using detail::fp8_scale_of;
using detail::kPack;
using detail::kTileCols;
using detail::kTileRows;
using detail::kTileThreads;
using detail::kTileWords;
using detail::PendingFactor;
using detail::put_tile;
using detail::record_amax;
using detail::round_to_bf16;
using detail::TileGrid;
using detail::store_row_codes;
using detail::store_tile_t;
using detail::swiglu_backward_at;
using detail::swiglu_value;
using detail::SwigluBackward;
using detail::tile_g;
using detail::tile_h;
using detail::TilePlace;
using detail::unpack8;

// ---------------------------------------------------------------------------------------
// Forward: kUnroll packs of 8 outputs per thread, their loads in flight together, one block
// per kUnroll · kThreads packs (as the bf16 kernel: no loop, many warps to hide the loads).
// Pack p is row p / (H / 8), in 32 bits (fp8_swiglu_forward checks that the packs fit).

constexpr int kThreads = 256;
constexpr int kUnroll = 2;

__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(Fp8Target act, const bf16* inp, PendingScale inp_scale, int64_t N, int H, bool vec_out) {
  __shared__ int scratch[32];
  __shared__ float fscratch[32];
  const float s = fp8_scale_of<false>(*act.amax.scale_from);
  if (blockIdx.x == 0 && threadIdx.x == 0) *act.inv_scale = __frcp_rn(s);
  const uint32_t per_row = H / kPack, packs = uint32_t(N) * per_row;
  const uint32_t p0 = blockIdx.x * (kUnroll * kThreads) + threadIdx.x;
  uint4 gate[kUnroll], up[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint32_t p = p0 + u * kThreads;
    if (p >= packs) continue;
    const bf16* row = inp + int64_t(p / per_row) * 2 * H + p % per_row * kPack;
    gate[u] = *reinterpret_cast<const uint4*>(row);
    up[u] = *reinterpret_cast<const uint4*>(row + H);
  }
  int clipped = 0;
  float m = 0.0f;
  const PendingFactor scaled(inp_scale);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint32_t p = p0 + u * kThreads;
    if (p >= packs) continue;
    float fg[kPack], fu[kPack], va[kPack];
    unpack8(fg, gate[u]);
    unpack8(fu, up[u]);
    scaled.apply(fg);
    scaled.apply(fu);
#pragma unroll
    for (int k = 0; k < kPack; ++k) va[k] = swiglu_value(fg[k], fu[k]);
    round_to_bf16(va);  // as the bf16 kernel stores it
    store_row_codes(act.out, H, encode8<false>(va, s, clipped, m), p / per_row, p % per_row * kPack, N, H, vec_out);
  }
  add_clipped(counter(act.saturated), clipped, scratch);
  record_amax(act.amax.record, m, fscratch);
}

// ---------------------------------------------------------------------------------------
// Backward: thread (g, h) of a tile holds rows 4g .. 4g + 3 of its columns 8h .. 8h + 7.

struct Packs {  // gate, up and dout bf16 bits of the four rows (0 past N or H)
  uint4 gate[4], up[4], dout[4];
};

// Row i of this thread's four (g) in the tile at `at`.
__device__ __forceinline__ void load_row(Packs& p, int i, const bf16* inp, const bf16* dout, int64_t N, int H,
                                         const TilePlace& at, int g) {
  const int64_t r = at.r0 + 4 * g + i;
  p.gate[i] = p.up[i] = p.dout[i] = make_uint4(0, 0, 0, 0);
  if (r >= N || at.c >= H) return;
  const bf16* row = inp + r * 2 * H + at.c;
  p.gate[i] = *reinterpret_cast<const uint4*>(row);
  p.up[i] = *reinterpret_cast<const uint4*>(row + H);
  p.dout[i] = *reinterpret_cast<const uint4*>(dout + r * H + at.c);
}

// Two blocks per SM (128 registers a thread, no spills on sm_90): one alone leaves the SM's
// loads idle while it computes.
template <bool GradE5M2>
__global__ void __launch_bounds__(kTileThreads, 2)
    swiglu_backward_kernel(Fp8Target grad, Fp8Target act, const bf16* inp, PendingScale inp_scale, const bf16* dout,
                           PendingScale dout_scale, int64_t N, int H, int64_t col_tiles, int64_t tiles, bool vec_out,
                           bool vec_t) {
  __shared__ uint32_t tile[3][kTileCols][kTileWords];  // d gate, d up, output: [column][row / 4] of the codes
  __shared__ int scratch[32];
  __shared__ float fscratch[32];
  const int g = tile_g(), h = tile_h();
  int64_t t = tiles - 1 - blockIdx.x;
  Packs p;
#pragma unroll
  for (int i = 0; i < 4; ++i) load_row(p, i, inp, dout, N, H, TilePlace(t, col_tiles, h), g);  // before the scales
  const float sg = fp8_scale_of<GradE5M2>(*grad.amax.scale_from), sa = fp8_scale_of<false>(*act.amax.scale_from);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *grad.inv_scale = __frcp_rn(sg);
    *act.inv_scale = __frcp_rn(sa);
  }
  const PendingFactor inp_scaled(inp_scale), dout_scaled(dout_scale);
  int clipped_g = 0, clipped_a = 0;
  float mg = 0.0f, ma = 0.0f;  // the amaxes recorded (values past the edges are 0)
  const int64_t ld = 2 * int64_t(H);
  for (; t >= 0; t -= gridDim.x) {
    const TilePlace at(t, col_tiles, h), next(t - gridDim.x, col_tiles, h);
    const bool more = t - int64_t(gridDim.x) >= 0;
    uint2 dgate[4], dup[4], out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float fg[kPack], fu[kPack], fd[kPack], vg[kPack], vu[kPack], va[kPack];
      unpack8(fg, p.gate[i]);
      unpack8(fu, p.up[i]);
      unpack8(fd, p.dout[i]);
      inp_scaled.apply(fg);
      inp_scaled.apply(fu);
      dout_scaled.apply(fd);
      if (more) load_row(p, i, inp, dout, N, H, next, g);  // the next tile's row, in flight meanwhile
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        const SwigluBackward b = swiglu_backward_at(fg[k], fu[k], fd[k]);
        vg[k] = b.gate;
        vu[k] = b.up;
        va[k] = b.value;
      }
      round_to_bf16(vg);  // each as the bf16 kernels store it
      round_to_bf16(vu);
      round_to_bf16(va);
      dgate[i] = encode8<GradE5M2>(vg, sg, clipped_g, mg);
      dup[i] = encode8<GradE5M2>(vu, sg, clipped_g, mg);
      out[i] = encode8<false>(va, sa, clipped_a, ma);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = at.r0 + 4 * g + i;
      store_row_codes(grad.out, ld, dgate[i], r, at.c, N, H, vec_out);
      store_row_codes(grad.out + H, ld, dup[i], r, at.c, N, H, vec_out);
    }
    __syncthreads();  // the previous tile's stores have read `tile`
    put_tile(tile[0], dgate, g, h);
    put_tile(tile[1], dup, g, h);
    put_tile(tile[2], out, g, h);
    __syncthreads();
    const int64_t c0 = at.c - h * kPack;
    store_tile_t(grad.out_t, tile[0], at.r0, c0, N, H, vec_t);
    store_tile_t(grad.out_t + int64_t(H) * N, tile[1], at.r0, c0, N, H, vec_t);
    store_tile_t(act.out_t, tile[2], at.r0, c0, N, H, vec_t);
  }
  add_clipped(counter(grad.saturated), clipped_g, scratch);
  add_clipped(counter(act.saturated), clipped_a, scratch);
  record_amax(grad.amax.record, mg, fscratch);
  record_amax(act.amax.record, ma, fscratch);
}

// `op`'s checks of its sizes, of `inp` and of a target for `which` that takes codes as they
// lie (out) and/or transposed (out_t), and no others.
void check(const char* op, int64_t N, int H, const bf16* inp, const Fp8Target& to, const char* which, bool out,
           bool out_t) {
  ESPLAG_CHECK(N >= 0 && H > 0 && H % kPack == 0, op, ": bad size N=", N, ", H=", H, " (H a multiple of 8)");
  ESPLAG_CHECK(N == 0 || (inp && aligned16(inp)), op, ": inp must be a 16-byte aligned device buffer");
  ESPLAG_CHECK(to.inv_scale && to.amax.scale_from, op, ": ", which, "'s inv_scale and amax must not be null");
  const char* takes = out && out_t ? "out and out_t" : out ? "out only (out_t null)" : "out_t only (out null)";
  ESPLAG_CHECK(N == 0 || ((to.out != nullptr) == out && (to.out_t != nullptr) == out_t), op, ": ", which, " takes ",
               takes);
}

}  // namespace

void fp8_swiglu_forward(const Fp8Target& act, const bf16* inp, PendingScale inp_scale, int64_t N, int H,
                        cudaStream_t stream) {
  constexpr const char* op = "fp8_swiglu_forward";
  check(op, N, H, inp, act, "the output", true, false);
  ESPLAG_CHECK(act.format == Fp8Format::e4m3, op, ": the output's codes are e4m3 (a layer input)");
  const int64_t packs = N * (H / kPack);
  ESPLAG_CHECK(packs <= INT32_MAX, op, ": ", N, " x ", H, " outputs are too many for its 32-bit indices");
  // One block even for N = 0: it writes inv_scale.
  const int64_t grid = std::max<int64_t>(1, (packs + kUnroll * kThreads - 1) / (kUnroll * kThreads));
  swiglu_forward_kernel<<<unsigned(grid), kThreads, 0, stream>>>(act, inp, inp_scale, N, H, aligned8(act.out));
  CUDA_CHECK_LAUNCH(op);
}

void fp8_swiglu_backward(const Fp8Target& grad, const Fp8Target& act, const bf16* inp, PendingScale inp_scale,
                         const bf16* dout, PendingScale dout_scale, int64_t N, int H, cudaStream_t stream) {
  constexpr const char* op = "fp8_swiglu_backward";
  check(op, N, H, inp, grad, "the gradient", true, true);
  check(op, N, H, inp, act, "the output", false, true);
  ESPLAG_CHECK(act.format == Fp8Format::e4m3, op, ": the output's codes are e4m3 (a layer input)");
  ESPLAG_CHECK(N == 0 || (dout && aligned16(dout)), op, ": dout must be a 16-byte aligned device buffer");
  const bool vec_out = aligned8(grad.out);
  const bool vec_t = N % 16 == 0 && aligned16(grad.out_t) && aligned16(act.out_t);
  const TileGrid<swiglu_backward_kernel<true>, swiglu_backward_kernel<false>> g(N, H, grad.format == Fp8Format::e5m2);
  g.kernel<<<g.blocks, kTileThreads, 0, stream>>>(grad, act, inp, inp_scale, dout, dout_scale, N, H, g.col_tiles,
                                                  g.tiles, vec_out, vec_t);
  CUDA_CHECK_LAUNCH(op);
}

}  // namespace esplag::gpu
