// bf16 -> fp8 casts with core/fp8.h's scaling rule (ops/gpu_fp8.h). Codes and scales as
// ops/cuda/fp8_codes.cuh makes them; the clipped test is core's too (Fp8Format::clips).
//
// amax is an integer atomicMax on the bits of |x| (non-negative floats order like their
// bits), exact and so independent of the order of the blocks (and so is the amax a cast
// records for delayed scaling); the saturation counter is an integer atomicAdd, one per
// block.
//
// Every pass is bandwidth-bound: 16-byte loads of x (several in flight per thread), 8- or
// 16-byte stores of codes. A cast usually follows the amax of the same tensor, which reads
// it from its start to its end; the casts walk it from the end back, so that they begin
// with what the amax read last, which the L2 cache may still hold.
#include <algorithm>
#include <atomic>

#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/fp8_codes.cuh"
#include "ops/gpu_fp8.h"

namespace esplag::gpu {

namespace {

using detail::kPack;
using detail::load8;
using detail::unpack8;
using detail::to_f;

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 2048;  // grid-stride beyond this: a cast is bandwidth-bound
constexpr int kUnroll = 4;             // packs of 8 values each thread has in flight per iteration

using detail::fp8_encode2;
using detail::fp8_scale_of;
template <bool E5M2>
using Format = detail::Fp8Format<E5M2>;

// 1 when x · s saturates (never for NaN).
template <bool E5M2>
__device__ __forceinline__ int clips(float x, float s) {
  return Format<E5M2>::clips(fabsf(x * s));
}

// Eight values as eight codes (little-endian: value 0 in the lowest byte), counting the
// clipped ones.
template <bool E5M2>
__device__ __forceinline__ uint2 encode8(const float (&f)[kPack], float s, int& clipped) {
#pragma unroll
  for (int k = 0; k < kPack; ++k) clipped += clips<E5M2>(f[k], s);
  uint2 c;
  c.x = fp8_encode2<E5M2>(f[0], f[1], s) | fp8_encode2<E5M2>(f[2], f[3], s) << 16;
  c.y = fp8_encode2<E5M2>(f[4], f[5], s) | fp8_encode2<E5M2>(f[6], f[7], s) << 16;
  return c;
}

// Code k of the eight encode8 gives.
__device__ __forceinline__ uint8_t code_byte(uint2 codes, int k) {
  return static_cast<uint8_t>((k < 4 ? codes.x : codes.y) >> (8 * (k % 4)));
}

template <bool E5M2>
__device__ __forceinline__ uint8_t encode1(float x, float s, int& clipped) {
  clipped += clips<E5M2>(x, s);
  return static_cast<uint8_t>(fp8_encode2<E5M2>(x, 0.0f, s));
}

// Block-wide max of non-negative values (blockDim.x == kThreads); every thread gets it.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = detail::warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? scratch[lane] : 0.0f;
  return detail::warp_max(v);
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
    for (int w = 0; w < kThreads / 32; ++w) total += unsigned(scratch[w]);
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

// Raises *record (when not null) to the block's largest m; the call synchronises the block.
__device__ __forceinline__ void record_amax(float* record, float m, float* scratch) {
  if (!record) return;
  m = block_max(m, scratch);
  if (threadIdx.x == 0 && m > 0.0f) atomicMax(reinterpret_cast<unsigned*>(record), __float_as_uint(m));
}

// ---------------------------------------------------------------------------------------
// amax

__global__ void amax_kernel(unsigned* amax_bits, const bf16* x, int64_t n, int64_t packs) {
  __shared__ float scratch[32];
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  float m = 0.0f;
  for (int64_t p0 = first; p0 < packs; p0 += kUnroll * stride) {
    float f[kUnroll][kPack];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * stride;
      if (p < packs) load8(f[u], x + p * kPack);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (p0 + u * stride < packs) m = fmaxf(m, pack_amax(f[u]));
  }
  for (int64_t i = packs * kPack + first; i < n; i += stride) m = fmaxf(m, finite_abs(to_f(x[i])));
  m = block_max(m, scratch);
  if (threadIdx.x == 0 && m > 0.0f) atomicMax(amax_bits, __float_as_uint(m));
}

// ---------------------------------------------------------------------------------------
// Per-tensor cast

template <bool E5M2>
__global__ void cast_kernel(uint8_t* out, float* inv_scale, const bf16* x, int64_t n, int64_t packs,
                            Fp8CastAmax amax, unsigned long long* saturated) {
  __shared__ int scratch[32];
  __shared__ float fscratch[32];
  const float s = fp8_scale_of<E5M2>(*amax.scale_from);
  float m = 0.0f;  // amax.record's
  if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = __frcp_rn(s);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  int clipped = 0;
  // Pack `packs - 1 - j` for the j-th: from the end of x back (see the top of the file).
  for (int64_t j0 = first; j0 < packs; j0 += kUnroll * stride) {
    float f[kUnroll][kPack];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * stride;
      if (j < packs) load8(f[u], x + (packs - 1 - j) * kPack);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * stride;
      if (j >= packs) continue;
      *reinterpret_cast<uint2*>(out + (packs - 1 - j) * kPack) = encode8<E5M2>(f[u], s, clipped);
      m = fmaxf(m, pack_amax(f[u]));
    }
  }
  for (int64_t i = packs * kPack + first; i < n; i += stride) {
    const float v = to_f(x[i]);
    out[i] = encode1<E5M2>(v, s, clipped);
    m = fmaxf(m, finite_abs(v));
  }
  add_clipped(saturated, clipped, scratch);
  record_amax(amax.record, m, fscratch);
}

// ---------------------------------------------------------------------------------------
// Tiled cast, as it lies and/or transposed, over tiles x[128·tr .. +128, 64·tc .. +64] (row
// tiles outer, column tiles inner). Persistent: block b takes tiles tiles - 1 - b, then every
// gridDim.x-th one below (from the end of x back), and loads its next tile while it encodes
// and stores the current one, so that an SM's loads do not wait for its stores. Thread
// (g, h) loads the four rows 4g .. 4g + 3 of a tile's columns 8h .. 8h + 7 (four 16-byte
// loads), writes each row's 8 codes to out [rows, cols] where asked, and byte-permutes the
// 4 x 8 codes into 8 words, column k's four rows in each, which it stores to the transposed
// tile in shared memory. Then each row of out_t [cols, rows] takes 128 contiguous codes in
// 16-byte stores. Lanes are laid out so that a warp's shared-memory stores and loads meet no
// bank twice (the tile's rows are 33 words apart). Parts of a tile past rows or cols read as
// 0 (never clipped) and are not written. The vectorised accesses need:
//   vec_x    cols % 8 == 0 and x 16-byte aligned (else the values one by one)
//   vec_out  cols % 8 == 0 and out 8-byte aligned
//   vec_t    rows % 16 == 0 and out_t 16-byte aligned

constexpr int kTileRows = 128, kTileCols = 64;
constexpr int kTileWords = kTileRows / 4 + 1;  // one transposed row (a column of x) and a pad word

// Word k of the eight whose byte i is code k of rows[i]: column k's codes of the four rows.
__device__ __forceinline__ void transpose4x8(const uint2 (&rows)[4], uint32_t (&words)[8]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t a = half ? rows[0].y : rows[0].x, b = half ? rows[1].y : rows[1].x;
    const uint32_t c = half ? rows[2].y : rows[2].x, d = half ? rows[3].y : rows[3].x;
    const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);  // a0 b0 a1 b1, a2 b2 a3 b3
    const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
    words[4 * half + 0] = __byte_perm(ab_lo, cd_lo, 0x5410);
    words[4 * half + 1] = __byte_perm(ab_lo, cd_lo, 0x7632);
    words[4 * half + 2] = __byte_perm(ab_hi, cd_hi, 0x5410);
    words[4 * half + 3] = __byte_perm(ab_hi, cd_hi, 0x7632);
  }
}

// Where tile t's rows and this thread's columns begin.
struct TilePlace {
  int64_t r0, c;
  __device__ TilePlace(int64_t t, int64_t col_tiles, int h)
      : r0(t / col_tiles * kTileRows), c(t % col_tiles * kTileCols + h * kPack) {}
};

// This thread's four rows of a tile as bf16 bits (0 past the edges).
__device__ __forceinline__ void load_tile(uint4 (&raw)[4], const bf16* x, int64_t rows, int64_t cols,
                                          const TilePlace& at, int g, bool vec_x) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = at.r0 + 4 * g + i;
    if (vec_x && r < rows && at.c < cols) {
      raw[i] = *reinterpret_cast<const uint4*>(x + r * cols + at.c);
    } else {
      __align__(16) bf16 v[kPack];
#pragma unroll
      for (int k = 0; k < kPack; ++k) v[k] = r < rows && at.c + k < cols ? x[r * cols + at.c + k] : bf16(0.0f);
      raw[i] = *reinterpret_cast<const uint4*>(v);
    }
  }
}

template <bool E5M2>
__global__ void __launch_bounds__(kThreads) cast_tiles_kernel(uint8_t* out, uint8_t* out_t, float* inv_scale,
                                                              const bf16* x, int64_t rows, int64_t cols,
                                                              int64_t col_tiles, int64_t tiles, Fp8CastAmax amax,
                                                              unsigned long long* saturated, bool vec_x,
                                                              bool vec_out, bool vec_t) {
  static_assert(kThreads == (kTileRows / 4) * (kTileCols / kPack), "one thread per 4 rows x 8 columns");
  __shared__ uint32_t tile[kTileCols][kTileWords];  // [column][row / 4] of the tile's codes
  __shared__ int scratch[32];
  __shared__ float fscratch[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = (lane & 7) | (warp & 3) << 3, h = lane >> 3 | (warp >> 2) << 2;
  int64_t t = tiles - 1 - blockIdx.x;
  uint4 raw[4];
  load_tile(raw, x, rows, cols, TilePlace(t, col_tiles, h), g, vec_x);  // before the scale: independent of it
  const float s = fp8_scale_of<E5M2>(*amax.scale_from);
  if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = __frcp_rn(s);
  int clipped = 0;
  float m = 0.0f;  // amax.record's (values past the edges read as 0)
  for (; t >= 0; t -= gridDim.x) {
    const TilePlace at(t, col_tiles, h);
    float f[4][kPack];
#pragma unroll
    for (int i = 0; i < 4; ++i) unpack8(f[i], raw[i]);
    if (t - int64_t(gridDim.x) >= 0)
      load_tile(raw, x, rows, cols, TilePlace(t - gridDim.x, col_tiles, h), g, vec_x);  // the next tile's, in flight
    uint2 code[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = at.r0 + 4 * g + i;
      code[i] = encode8<E5M2>(f[i], s, clipped);
      m = fmaxf(m, pack_amax(f[i]));
      if (out && r < rows) {
        if (vec_out && at.c < cols) {
          *reinterpret_cast<uint2*>(out + r * cols + at.c) = code[i];
        } else {
          for (int k = 0; k < kPack && at.c + k < cols; ++k) out[r * cols + at.c + k] = code_byte(code[i], k);
        }
      }
    }
    if (!out_t) continue;
    uint32_t words[kPack];
    transpose4x8(code, words);
    __syncthreads();  // the previous tile's stores have read `tile`
#pragma unroll
    for (int k = 0; k < kPack; ++k) tile[h * kPack + k][g] = words[k];
    __syncthreads();
    // Each warp stores four rows of out_t, eight 16-byte chunks of each, per pass.
    constexpr int kChunks = kTileRows / 16;
    const int64_t c0 = at.c - h * kPack;
#pragma unroll
    for (int pass = 0; pass < kTileCols * kChunks / kThreads; ++pass) {
      const int cc = threadIdx.x / kChunks + pass * (kThreads / kChunks), j = threadIdx.x % kChunks;
      const int64_t ct = c0 + cc, r = at.r0 + 16 * j;
      if (ct >= cols || r >= rows) continue;
      const uint32_t* src = &tile[cc][4 * j];
      uint8_t* dst = out_t + ct * rows + r;
      if (vec_t) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(src[0], src[1], src[2], src[3]);
      } else {
        for (int k = 0; k < 16 && r + k < rows; ++k) dst[k] = static_cast<uint8_t>(src[k / 4] >> (8 * (k % 4)));
      }
    }
  }
  add_clipped(saturated, clipped, scratch);
  record_amax(amax.record, m, fscratch);
}

// ---------------------------------------------------------------------------------------
// Per-row cast: one block per row, the row read twice (amax, then cast; the second read
// mostly hits the cache).

template <bool E5M2>
__global__ void cast_rows_kernel(uint8_t* out, float* inv_scale, float* row_amax, const bf16* x, int64_t cols,
                                 bool vec, unsigned long long* saturated) {
  __shared__ float fscratch[32];
  __shared__ int iscratch[32];
  const int64_t r = blockIdx.x;
  const bf16* row = x + r * cols;
  uint8_t* dst = out + r * cols;
  const int64_t packs = vec ? cols / kPack : 0;
  float m = 0.0f;
  for (int64_t p = threadIdx.x; p < packs; p += kThreads) {
    float f[kPack];
    load8(f, row + p * kPack);
#pragma unroll
    for (int k = 0; k < kPack; ++k) m = fmaxf(m, finite_abs(f[k]));
  }
  for (int64_t i = packs * kPack + threadIdx.x; i < cols; i += kThreads) m = fmaxf(m, finite_abs(to_f(row[i])));
  m = block_max(m, fscratch);
  const float s = fp8_scale_of<E5M2>(m);
  if (threadIdx.x == 0) {
    inv_scale[r] = __frcp_rn(s);
    if (row_amax) row_amax[r] = m;
  }
  int clipped = 0;
  for (int64_t p = threadIdx.x; p < packs; p += kThreads) {
    float f[kPack];
    load8(f, row + p * kPack);
    *reinterpret_cast<uint2*>(dst + p * kPack) = encode8<E5M2>(f, s, clipped);
  }
  for (int64_t i = packs * kPack + threadIdx.x; i < cols; i += kThreads)
    dst[i] = encode1<E5M2>(to_f(row[i]), s, clipped);
  add_clipped(saturated, clipped, iscratch);
}

bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

unsigned long long* counter(uint64_t* p) {
  static_assert(sizeof(uint64_t) == sizeof(unsigned long long));
  return reinterpret_cast<unsigned long long*>(p);
}

// Packs of 8 values when x is 16-byte and out 8-byte aligned (the tail goes value by
// value), none otherwise.
int64_t packs_of(const bf16* x, const uint8_t* out, int64_t n) {
  return detail::aligned16(x) && (!out || aligned8(out)) ? n / kPack : 0;
}

unsigned grid_for(int64_t n) { return std::max(1u, std::min(kMaxBlocks, detail::blocks_for(n, kThreads * kPack))); }

void check_cast(const char* op, const void* out, const void* scale_out, const bf16* x, int64_t n, Fp8CastAmax amax) {
  ESPLAG_CHECK(n >= 0, op, ": negative size ", n);
  ESPLAG_CHECK(n == 0 || (out && x), op, ": out and x must not be null");
  ESPLAG_CHECK(scale_out && amax.scale_from, op, ": inv_scale and amax must not be null");
}

}  // namespace

void fp8_amax(float* amax, const bf16* x, int64_t n, cudaStream_t stream) {
  ESPLAG_CHECK(amax && n >= 0 && (x || n == 0), "fp8_amax: null pointer or negative size ", n);
  CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));  // 0.0f; the kernel only raises it
  if (n == 0) return;
  amax_kernel<<<grid_for(n), kThreads, 0, stream>>>(reinterpret_cast<unsigned*>(amax), x, n,
                                                    packs_of(x, nullptr, n));
  CUDA_CHECK_LAUNCH("fp8_amax");
}

void fp8_cast(uint8_t* out, float* inv_scale, const bf16* x, int64_t n, Fp8CastAmax amax, Fp8Format format,
              uint64_t* saturated, cudaStream_t stream) {
  check_cast("fp8_cast", out, inv_scale, x, n, amax);
  // One block even for n = 0: it writes inv_scale.
  const int64_t packs = packs_of(x, out, n);
  if (format == Fp8Format::e5m2)
    cast_kernel<true><<<grid_for(n), kThreads, 0, stream>>>(out, inv_scale, x, n, packs, amax, counter(saturated));
  else
    cast_kernel<false><<<grid_for(n), kThreads, 0, stream>>>(out, inv_scale, x, n, packs, amax, counter(saturated));
  CUDA_CHECK_LAUNCH("fp8_cast");
}

namespace {

// Blocks of the tiled cast (kThreads threads) the device holds at once: a persistent grid.
// Asked once per format and device, not at every cast.
template <bool E5M2>
int64_t resident_blocks() {
  constexpr int kDevices = 64;
  static std::atomic<int64_t> known[kDevices] = {};  // 0 until asked
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (device < kDevices && known[device].load() > 0) return known[device].load();
  int sms = 0, per_sm = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, cast_tiles_kernel<E5M2>, kThreads, 0));
  const int64_t blocks = int64_t(sms) * std::max(1, per_sm);
  if (device < kDevices) known[device].store(blocks);
  return blocks;
}

// The tiled cast of x [rows, cols] into out (as it lies; may be null) and out_t
// (transposed; may be null). One block even for an empty x: it writes inv_scale.
void cast_tiles(const char* op, uint8_t* out, uint8_t* out_t, float* inv_scale, const bf16* x, int64_t rows,
                int64_t cols, Fp8CastAmax amax, Fp8Format format, uint64_t* saturated, cudaStream_t stream) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0, op, ": negative size ", rows, " x ", cols);
  check_cast(op, out ? out : out_t, inv_scale, x, rows * cols, amax);
  const int64_t col_tiles = std::max<int64_t>(1, (cols + kTileCols - 1) / kTileCols);
  const int64_t tiles = std::max<int64_t>(1, (rows + kTileRows - 1) / kTileRows) * col_tiles;
  const bool vec_x = cols % kPack == 0 && detail::aligned16(x);
  const bool vec_out = cols % kPack == 0 && aligned8(out);
  const bool vec_t = rows % 16 == 0 && detail::aligned16(out_t);
  const bool e5m2 = format == Fp8Format::e5m2;
  auto kernel = e5m2 ? cast_tiles_kernel<true> : cast_tiles_kernel<false>;
  const int64_t resident = e5m2 ? resident_blocks<true>() : resident_blocks<false>();
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, resident));
  kernel<<<grid, kThreads, 0, stream>>>(out, out_t, inv_scale, x, rows, cols, col_tiles, tiles, amax,
                                        counter(saturated), vec_x, vec_out, vec_t);
  CUDA_CHECK_LAUNCH(op);
}

}  // namespace

void fp8_cast_transpose(uint8_t* out, float* inv_scale, const bf16* x, int64_t rows, int64_t cols, Fp8CastAmax amax,
                        Fp8Format format, uint64_t* saturated, cudaStream_t stream) {
  cast_tiles("fp8_cast_transpose", nullptr, out, inv_scale, x, rows, cols, amax, format, saturated, stream);
}

void fp8_cast_both(uint8_t* out, uint8_t* out_t, float* inv_scale, const bf16* x, int64_t rows, int64_t cols,
                   Fp8CastAmax amax, Fp8Format format, uint64_t* saturated, cudaStream_t stream) {
  ESPLAG_CHECK(rows * cols == 0 || (out && out_t), "fp8_cast_both: out and out_t must not be null");
  cast_tiles("fp8_cast_both", out, out_t, inv_scale, x, rows, cols, amax, format, saturated, stream);
}

namespace {

__global__ void roll_kernel(float* histories, int64_t count, int length) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float* h = histories + i * (int64_t(length) + 2);
  float* past = h + 2;
  float m = h[0];
  for (int k = length - 1; k > 0; --k) {
    past[k] = past[k - 1];
    m = fmaxf(m, past[k]);
  }
  past[0] = h[0];
  h[1] = m;
  h[0] = 0.0f;
}

}  // namespace

void fp8_roll_amax_histories(float* histories, int64_t count, int length, cudaStream_t stream) {
  ESPLAG_CHECK(count >= 0 && length >= 1 && (histories || count == 0), "fp8_roll_amax_histories: ", count,
               " histories of length ", length);
  if (count == 0) return;
  roll_kernel<<<detail::blocks_for(count, 128), 128, 0, stream>>>(histories, count, length);
  CUDA_CHECK_LAUNCH("fp8_roll_amax_histories");
}

void fp8_cast_rows(uint8_t* out, float* inv_scale, float* row_amax, const bf16* x, int64_t rows, int64_t cols,
                   Fp8Format format, uint64_t* saturated, cudaStream_t stream) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0, "fp8_cast_rows: negative size ", rows, " x ", cols);
  ESPLAG_CHECK(rows <= INT32_MAX, "fp8_cast_rows: ", rows, " rows is too many (one block per row)");
  if (rows == 0) return;
  ESPLAG_CHECK(inv_scale && (cols == 0 || (out && x)), "fp8_cast_rows: null pointer");
  const bool vec = cols % kPack == 0 && detail::aligned16(x) && aligned8(out);
  const unsigned grid = static_cast<unsigned>(rows);
  if (format == Fp8Format::e5m2)
    cast_rows_kernel<true><<<grid, kThreads, 0, stream>>>(out, inv_scale, row_amax, x, cols, vec, counter(saturated));
  else
    cast_rows_kernel<false><<<grid, kThreads, 0, stream>>>(out, inv_scale, row_amax, x, cols, vec,
                                                           counter(saturated));
  CUDA_CHECK_LAUNCH("fp8_cast_rows");
}

}  // namespace esplag::gpu
