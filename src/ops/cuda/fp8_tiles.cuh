// Device pieces the fp8 casts share (ops/cuda/fp8_cast.cu, fp8_swiglu.cu, fp8_norm.cu; AdamW's
// weight amax in fused_step.cu takes record_amax):
// codes of eight values at a time with the clipped ones counted, the block's amax and
// clipped count into device memory, the 128 x 64 tiles of the transposed casts with their
// 4 x 8 byte transpose, and the tiled cast itself, generic over what it reads. Codes and
// scales as ops/cuda/fp8_codes.cuh makes them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "ops/cuda/common.cuh"
#include "ops/cuda/fp8_codes.cuh"
#include "ops/gpu_fp8.h"

namespace esplag::gpu::detail {

// 1 when x · s saturates (never for NaN).
template <bool E5M2>
__device__ __forceinline__ int clips(float x, float s) {
  return Fp8Format<E5M2>::clips(fabsf(x * s));
}

// The largest |x| of eight values, infinities included, NaN left out.
__device__ __forceinline__ float pack_top(const float (&f)[kPack]) {
  float top = 0.0f;
#pragma unroll
  for (int k = 0; k < kPack; ++k) top = fmaxf(top, fabsf(f[k]));
  return top;
}

// Eight values as eight codes (little-endian: value 0 in the lowest byte), counting the
// clipped ones. |x · s| grows with |x|, so only a pack whose top clips is counted value by
// value (rare: a value past the scale's amax, or infinite).
template <bool E5M2>
__device__ __forceinline__ uint2 encode8_top(const float (&f)[kPack], float top, float s, int& clipped) {
  if (clips<E5M2>(top, s)) {
#pragma unroll
    for (int k = 0; k < kPack; ++k) clipped += clips<E5M2>(f[k], s);
  }
  return {fp8_encode4<E5M2>(f[0], f[1], f[2], f[3], s), fp8_encode4<E5M2>(f[4], f[5], f[6], f[7], s)};
}
template <bool E5M2>
__device__ __forceinline__ uint2 encode8(const float (&f)[kPack], float s, int& clipped) {
  return encode8_top<E5M2>(f, pack_top(f), s, clipped);
}

// Code k of the eight encode8 gives.
__device__ __forceinline__ uint8_t code_byte(uint2 codes, int k) {
  return static_cast<uint8_t>((k < 4 ? codes.x : codes.y) >> (8 * (k % 4)));
}

// Block-wide max of non-negative values (blockDim.x a multiple of 32); every thread gets it.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  return warp_max(v);
}

// Adds the block's clipped count to *saturated (thread 0); the call synchronises the block.
__device__ __forceinline__ void add_clipped(unsigned long long* saturated, int clipped, int* scratch) {
  if (!saturated) return;
  int v = clipped;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) total += unsigned(scratch[w]);
    if (total) atomicAdd(saturated, total);
  }
}

__device__ __forceinline__ float finite_abs(float x) { return isfinite(x) ? fabsf(x) : 0.0f; }

__device__ __forceinline__ float pack_amax(const float (&f)[kPack]) {
  float m = 0.0f;
#pragma unroll
  for (int k = 0; k < kPack; ++k) m = fmaxf(m, finite_abs(f[k]));
  return m;
}

// encode8, and m raised to the values' largest finite |x| (pack_amax's): their top where it
// is finite, which is all but always.
template <bool E5M2>
__device__ __forceinline__ uint2 encode8(const float (&f)[kPack], float s, int& clipped, float& m) {
  const float top = pack_top(f);
  if (isfinite(top))
    m = fmaxf(m, top);
  else
    m = fmaxf(m, pack_amax(f));
  return encode8_top<E5M2>(f, top, s, clipped);
}

// Raises *record (when not null) to the block's largest m; the call synchronises the block.
__device__ __forceinline__ void record_amax(float* record, float m, float* scratch) {
  if (!record) return;
  m = block_max(m, scratch);
  if (threadIdx.x == 0 && m > 0.0f) atomicMax(reinterpret_cast<unsigned*>(record), __float_as_uint(m));
}

// ---------------------------------------------------------------------------------------
// Tiles of the transposed casts: 128 rows x 64 columns, thread (g, h) of 256 holding rows
// 4g .. 4g + 3 of columns 8h .. 8h + 7, its 4 x 8 codes byte-transposed into a shared
// tile [column][row / 4] whose rows are 33 words apart (no bank met twice by a warp).

constexpr int kTileRows = 128, kTileCols = 64;
constexpr int kTileWords = kTileRows / 4 + 1;  // one transposed row (a column of x) and a pad word

// Word k of the eight whose byte i is code k of rows[i]: column k's codes of the four rows.
__device__ __forceinline__ void transpose4x8(const uint2 (&rows)[4], uint32_t (&words)[8]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint32_t w[4] = {half ? rows[0].y : rows[0].x, half ? rows[1].y : rows[1].x, half ? rows[2].y : rows[2].x,
                     half ? rows[3].y : rows[3].x};
    transpose4x4(w);
#pragma unroll
    for (int k = 0; k < 4; ++k) words[4 * half + k] = w[k];
  }
}

constexpr int kTileThreads = (kTileRows / 4) * (kTileCols / kPack);  // 256

// This thread's place in a tile: rows 4·tile_g() .. + 3, columns 8·tile_h() .. + 7, laid out
// so that a warp's stores to the shared tile (put_tile) meet no bank twice.
__device__ __forceinline__ int tile_g() { return (threadIdx.x & 7) | (threadIdx.x >> 5 & 3) << 3; }
__device__ __forceinline__ int tile_h() { return (threadIdx.x >> 3 & 3) | (threadIdx.x >> 7) << 2; }

// Where tile t's rows and this thread's columns begin (row tiles outer, column tiles inner).
struct TilePlace {
  int64_t r0, c;
  __device__ TilePlace(int64_t t, int64_t col_tiles, int h)
      : r0(t / col_tiles * kTileRows), c(t % col_tiles * kTileCols + h * kPack) {}
};

// Row r's 8 codes at columns c .. c + 7 of out [rows, cols] (rows ld codes apart), those
// inside it; vec: one 8-byte store (ld % 8 == 0 and out 8-byte aligned).
__device__ __forceinline__ void store_row_codes(uint8_t* out, int64_t ld, uint2 codes, int64_t r, int64_t c,
                                                int64_t rows, int64_t cols, bool vec) {
  if (r >= rows) return;
  if (vec && c < cols) {
    *reinterpret_cast<uint2*>(out + r * ld + c) = codes;
  } else {
    for (int k = 0; k < kPack && c + k < cols; ++k) out[r * ld + c + k] = code_byte(codes, k);
  }
}

// This thread's 4 x 8 codes (its rows' packs) into the shared tile, transposed.
__device__ __forceinline__ void put_tile(uint32_t (*tile)[kTileWords], const uint2 (&codes)[4], int g, int h) {
  uint32_t words[kPack];
  transpose4x8(codes, words);
#pragma unroll
  for (int k = 0; k < kPack; ++k) tile[h * kPack + k][g] = words[k];
}

// The shared tile of rows r0 .. + 127, columns c0 .. + 63 of x [rows, cols] into out_t
// [cols, rows], those inside it: each warp stores four rows of out_t per pass, eight
// 16-byte chunks of each (vec: rows % 16 == 0 and out_t 16-byte aligned; else byte by byte).
__device__ __forceinline__ void store_tile_t(uint8_t* out_t, const uint32_t (*tile)[kTileWords], int64_t r0,
                                             int64_t c0, int64_t rows, int64_t cols, bool vec) {
  constexpr int kChunks = kTileRows / 16;
#pragma unroll
  for (int pass = 0; pass < kTileCols * kChunks / kTileThreads; ++pass) {
    const int cc = threadIdx.x / kChunks + pass * (kTileThreads / kChunks), j = threadIdx.x % kChunks;
    const int64_t ct = c0 + cc, r = r0 + 16 * j;
    if (ct >= cols || r >= rows) continue;
    const uint32_t* src = &tile[cc][4 * j];
    uint8_t* dst = out_t + ct * rows + r;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(src[0], src[1], src[2], src[3]);
    } else {
      for (int k = 0; k < 16 && r + k < rows; ++k) dst[k] = static_cast<uint8_t>(src[k / 4] >> (8 * (k % 4)));
    }
  }
}

inline bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

__host__ __device__ inline unsigned long long* counter(uint64_t* p) {
  static_assert(sizeof(uint64_t) == sizeof(unsigned long long));
  return reinterpret_cast<unsigned long long*>(p);
}

// Blocks of `threads` threads of Kernel the device holds at once: a persistent grid's size.
// Asked once per kernel and device, not at every launch.
template <auto Kernel>
int64_t resident_blocks(int threads) {
  constexpr int kDevices = 64;
  static std::atomic<int64_t> known[kDevices] = {};  // 0 until asked
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (device < kDevices && known[device].load() > 0) return known[device].load();
  int sms = 0, per_sm = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, 0));
  const int64_t blocks = int64_t(sms) * std::max(1, per_sm);
  if (device < kDevices) known[device].store(blocks);
  return blocks;
}

// The persistent grid of a tiled kernel over [rows, cols]: tiles of kTileRows × kTileCols
// (at least one, whose block writes the inverse scale even for an empty tensor), walked by
// as many blocks as the device holds at once, or by one per tile where there are fewer.
// E5m2 and E4m3: the kernel's instantiations for the two formats, `e5m2` choosing.
template <auto E5m2, auto E4m3>
struct TileGrid {
  int64_t col_tiles, tiles;
  unsigned blocks;
  decltype(E5m2) kernel;
  TileGrid(int64_t rows, int64_t cols, bool e5m2)
      : col_tiles(std::max<int64_t>(1, (cols + kTileCols - 1) / kTileCols)),
        tiles(std::max<int64_t>(1, (rows + kTileRows - 1) / kTileRows) * col_tiles),
        blocks(unsigned(
            std::min(tiles, e5m2 ? resident_blocks<E5m2>(kTileThreads) : resident_blocks<E4m3>(kTileThreads)))),
        kernel(e5m2 ? E5m2 : E4m3) {}
};

// ---------------------------------------------------------------------------------------
// The tiled cast, as it lies and/or transposed, over tiles of what a source reads [rows,
// cols] (row tiles outer, column tiles inner). Persistent: block b takes tiles tiles - 1 - b,
// then every gridDim.x-th one below (from the end back), and loads its next tile while it
// encodes and stores the current one, so that an SM's loads do not wait for its stores.
// Thread (g, h) makes four rows of eight values, writes each row's codes to out [rows, cols]
// where asked, and puts them transposed into the shared tile, from which each row of out_t
// [cols, rows] takes 128 contiguous codes. Values past rows or cols must read as 0 (never
// clipped) and are not written. vec_out: cols % 8 == 0 and out 8-byte aligned; vec_t: rows
// % 16 == 0 and out_t 16-byte aligned.
//
// A source (Tiles) has load(Raw&, const TilePlace&, int g), which fetches this thread's part
// of a tile (issued before the previous tile is encoded: the loads are in flight meanwhile),
// and values(float (&)[4][8], const Raw&, const TilePlace&, int g), which makes its four rows.

// A bf16 tensor x [rows, cols]: the plain cast's source.
struct Bf16Tiles {
  const bf16* x;
  int64_t rows, cols;
  bool vec;  // cols % 8 == 0 and x 16-byte aligned (else the values one by one)
  struct Raw {
    uint4 v[4];
  };
  __device__ void load(Raw& raw, const TilePlace& at, int g) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = at.r0 + 4 * g + i;
      if (vec && r < rows && at.c < cols) {
        raw.v[i] = *reinterpret_cast<const uint4*>(x + r * cols + at.c);
      } else {
        __align__(16) bf16 v[kPack];
#pragma unroll
        for (int k = 0; k < kPack; ++k) v[k] = r < rows && at.c + k < cols ? x[r * cols + at.c + k] : bf16(0.0f);
        raw.v[i] = *reinterpret_cast<const uint4*>(v);
      }
    }
  }
  __device__ void values(float (&f)[4][kPack], const Raw& raw, const TilePlace&, int) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) unpack8(f[i], raw.v[i]);
  }
};

template <bool E5M2, class Tiles>
__global__ void __launch_bounds__(kTileThreads)
    cast_tiles_kernel(uint8_t* out, uint8_t* out_t, float* inv_scale, Tiles src, int64_t rows, int64_t cols,
                      int64_t col_tiles, int64_t tiles, gpu::Fp8CastAmax amax, unsigned long long* saturated,
                      bool vec_out, bool vec_t) {
  __shared__ uint32_t tile[kTileCols][kTileWords];  // [column][row / 4] of the tile's codes
  __shared__ int scratch[32];
  __shared__ float fscratch[32];
  const int g = tile_g(), h = tile_h();
  int64_t t = tiles - 1 - blockIdx.x;
  typename Tiles::Raw raw;
  src.load(raw, TilePlace(t, col_tiles, h), g);  // before the scale: independent of it
  const float s = fp8_scale_of<E5M2>(*amax.scale_from);
  if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = __frcp_rn(s);
  int clipped = 0;
  float m = 0.0f;  // amax.record's (values past the edges read as 0)
  for (; t >= 0; t -= gridDim.x) {
    const TilePlace at(t, col_tiles, h);
    float f[4][kPack];
    src.values(f, raw, at, g);
    if (t - int64_t(gridDim.x) >= 0) src.load(raw, TilePlace(t - gridDim.x, col_tiles, h), g);  // the next tile's
    uint2 code[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      code[i] = encode8<E5M2>(f[i], s, clipped, m);
      if (out) store_row_codes(out, cols, code[i], at.r0 + 4 * g + i, at.c, rows, cols, vec_out);
    }
    if (!out_t) continue;
    __syncthreads();  // the previous tile's stores have read `tile`
    put_tile(tile, code, g, h);
    __syncthreads();
    store_tile_t(out_t, tile, at.r0, at.c - h * kPack, rows, cols, vec_t);
  }
  add_clipped(saturated, clipped, scratch);
  record_amax(amax.record, m, fscratch);
}

// The tiled cast of what `src` reads, [rows, cols], into out (as it lies; may be null) and
// out_t (transposed; may be null). One block even for an empty tensor: it writes inv_scale.
template <class Tiles>
void cast_tiles(const char* op, uint8_t* out, uint8_t* out_t, float* inv_scale, const Tiles& src, int64_t rows,
                int64_t cols, gpu::Fp8CastAmax amax, esplag::Fp8Format format, uint64_t* saturated,
                cudaStream_t stream) {
  const bool vec_out = cols % kPack == 0 && aligned8(out);
  const bool vec_t = rows % 16 == 0 && aligned16(out_t);
  const TileGrid<cast_tiles_kernel<true, Tiles>, cast_tiles_kernel<false, Tiles>> g(
      rows, cols, format == esplag::Fp8Format::e5m2);
  g.kernel<<<g.blocks, kTileThreads, 0, stream>>>(out, out_t, inv_scale, src, rows, cols, g.col_tiles, g.tiles, amax,
                                                  counter(saturated), vec_out, vec_t);
  CUDA_CHECK_LAUNCH(op);
}

}  // namespace esplag::gpu::detail
