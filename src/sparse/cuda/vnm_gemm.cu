// V:2:M × dense GEMM on the sparse tensor cores (mma.sp.m16n8k32, bf16 in, fp32 accumulate).
//
// D = W · Xᵀ is computed as [out, tokens] tiles, since mma.sp's sparse operand is A: A is
// the compressed weight, B the gathered columns of X, and the epilogue transposes through
// shared memory into Y [tokens, out].
//
// Thread block: 256 threads, tile 256 out × 128 tokens; warp tile 64 out × 64 tokens
// (warps 4 × 2, 4 × 8 mma.sp per K step) or, when V % 128 == 0, 128 × 32 (warps 2 × 4,
// 8 × 4 mma.sp, each gathered B fragment feeding 8 of them). A K step is 8 V:2:M blocks = 32
// gathered columns = 8·M columns of X. Each stage of the cp.async pipeline holds, for one
// K step:
//   X tile   128 token rows × 8·M columns, row stride 272 bytes (the 256 bytes of the
//            largest M plus 16): 272 = 68 words ≡ 4 (mod 32), so the 8 rows a warp reads at
//            once start 4 banks apart;
//   A        16 tiles of 16 rows: the 32 lanes' A fragments (16 B each, one LDS.128);
//   metadata 16 tiles × 32 lanes × 4 B (one LDS.32);
//   columns  the selected column offsets of the (up to 4) row blocks of the tile.
// A warp's 64 rows lie in one row block (V is a multiple of 64), so all its m16 tiles use
// the same selection: the B fragment of each 8-token tile is gathered once (8 LDS.U16 per
// lane) and reused by the 4 mma.sp of the warp's 64 rows.
//
// Loading the full 8·M columns of X (not only the 4/M selected ones) costs no extra DRAM
// or L2 traffic for M <= 16: a block of M bf16 columns is at most one 32-byte sector, so a
// gather from global memory would fetch the same sectors.
//
// Measured (H100 80GB HBM3, bench/results/vnm-gemm-h100.csv; cuBLASLt dense bf16 runs at
// 755-783 TFLOP/s on these shapes), speedup = dense time / ours: 64:2:8 0.55-0.57,
// 128:2:8 (128-row warp tile) 0.60-0.62, 64:2:16 0.89-0.96. Far from the roofline; the
// reasons, from Nsight Compute (8192×2048×16384, 64:2:8):
//   - the ceiling is the tensor pipe: mma.sp.m16n8k32 on sm_90 retires about as many
//     non-zero products per cycle as dense mma.sync (~460 TFLOP/s of kept products, from
//     the measured tensor-pipe activity; about half of what wgmma reaches),
//     so for 2/M density the best possible is about 2.4x (M = 8) over cuBLAS dense. This
//     kernel keeps the tensor pipe only ~22% busy;
//   - with one 256-thread block per SM (225-255 registers, 180 KB of shared memory) there
//     are 2 warps per scheduler, and each K step runs gather, then mma, then a block-wide
//     barrier: stalls are MIO throttle and short scoreboard (waiting on shared loads),
//     barrier and math-pipe throttle in bursts; issue is only ~33% active and shared
//     memory ~53% busy (1.7 wavefronts per gather load from data-dependent bank conflicts);
//   - the Xᵀ variant cuts shared-load wavefronts by 40% (one LDS.128 per selected column)
//     and runs no faster, so the limit is latency and synchronisation, not bandwidth.
// What would close the gap: warp specialisation (producer warps filling, consumer warps
// computing, mbarriers instead of __syncthreads), more warps per SM with smaller
// per-thread state, and on sm_90a the sparse wgmma (wgmma.mma_async.sp) with the gathered
// X tile written to shared memory once per row block.
//
// How far a sparse wgmma could go, from shared-memory bandwidth alone (128 bytes per
// cycle per SM; dense bf16 peak 4096 FLOP per cycle per SM, cuBLASLt at ~80% of it here):
// a wgmma.sp m64nNk32 takes its B operand (32 gathered columns × N tokens, 64·N bytes)
// from shared memory and, at the 2:4 rate, issues every N/2 cycles, so reading B alone
// needs all 128 bytes per cycle (consistent with cuSPARSELt's 2:4 products staying at
// 1.3-1.8x, not 2x). A V:N:M kernel must also write the gathered B tile into shared
// memory (another 64·N bytes per step, at best by cp.async of Xᵀ's selected rows straight
// from L2; a gather from an X tile already in shared memory reads 64·N more): one K step
// (8·M columns of X) then needs 128·N to 192·N bytes, N to 1.5·N cycles, where dense peak
// needs (8·M/16)·(N/2) = M·N/4 cycles for the same columns. For 64:2:8 (M = 8) that is
// 1.3-2x dense peak, about 1.7-2.5x cuBLASLt: the 2.5x target sits at the bound of a
// perfect kernel, with every row block (V = 64 rows) loading its own gathered tile.
#include "sparse/cuda/vnm_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/error.h"
#include "sparse/cuda/vnm_wgmma.h"

namespace esplag::gpu {

namespace {

constexpr int kThreads = 256;
constexpr int kBM = VnmDeviceWeight::kRowTile;  // 256 rows (out) per thread block
constexpr int kBN = 128;                        // tokens per thread block
constexpr int kStepBlocks = VnmDeviceWeight::kBlocksPerStep;
constexpr int kMinWarpRows = 64;  // the smaller warp tile; V must be a multiple of it
constexpr int kXStride = 272;
constexpr int kXBytes = kBN * kXStride;
constexpr int kTiles16 = kBM / 16;
constexpr int kFragBytes = kTiles16 * 32 * 16;
constexpr int kMetaBytes = kTiles16 * 32 * 4;
constexpr int kSelRecord = 32;  // 4 lanes-in-group × 8 column offsets
constexpr int kSelBytes = (kBM / kMinWarpRows) * kSelRecord;
constexpr int kStageBytes = kXBytes + kFragBytes + kMetaBytes + kSelBytes;
// Warp tiles: MI m16 tiles (out) × NJ n8 tiles (tokens), MI·NJ = 32 mma.sp per K step:
// MI = 4 (64 out × 64 tokens, warps 4 × 2) or MI = 8 (128 × 32, warps 2 × 4; V % 128 == 0),
// which reuses each gathered B fragment for 8 instead of 4 mma.sp.
template <int MI>
struct WarpTile {
  static constexpr int kRows = 16 * MI, kNJ = 32 / MI, kTokens = 8 * kNJ;
  static constexpr int kWarpsM = kBM / kRows;
};
// Epilogue: each warp stages its tile as [token][out] with rows padded by 16 bytes.
template <int MI, typename OutT>
__host__ __device__ constexpr int epi_stride() {
  return WarpTile<MI>::kRows * int(sizeof(OutT)) + 16;
}
template <int MI, typename OutT>
constexpr int epi_bytes() {
  return 8 * WarpTile<MI>::kTokens * epi_stride<MI, OutT>();
}
template <int Stages, int MI, typename OutT>
constexpr int smem_bytes() {
  return std::max(Stages * kStageBytes, epi_bytes<MI, OutT>());
}
constexpr uint16_t kPadNibble = 0x4;  // positions 0 and 1: a valid ordered pair for padding

static_assert(kStageBytes % 16 == 0, "stages must keep 16-byte alignment");

// ---------------------------------------------------------------------------------------
// Layout of the converted weight inside its storage.

struct Layout {
  int64_t blocks = 0, ksteps = 0, tiles16 = 0, row_blocks = 0;
  size_t frag_off = 0, meta_off = 0, sel_off = 0, err_off = 0, total = 0;
};

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

void check_shape(int64_t rows, int64_t cols, int v, int m, const char* what) {
  ESPLAG_CHECK(m >= 4 && m <= 16, what, ": V:2:M needs 4 <= M <= 16, got M = ", m);
  ESPLAG_CHECK(v > 0 && v % kMinWarpRows == 0, what, ": V = ", v,
               " is not supported: the kernel needs V to be a multiple of 64 (a warp's 64 rows share one column "
               "selection), e.g. 64 or 128");
  ESPLAG_CHECK(rows > 0 && cols > 0, what, ": weight shape [", rows, ", ", cols, "] must not be empty");
  ESPLAG_CHECK(rows % v == 0, what, ": out features ", rows, " are not a multiple of V = ", v);
  ESPLAG_CHECK(cols % m == 0, what, ": in features ", cols, " are not a multiple of M = ", m);
}

Layout layout_of(int64_t rows, int64_t cols, int v, int m) {
  Layout l;
  const int64_t padded = (rows + kBM - 1) / kBM * kBM;
  l.blocks = cols / m;
  l.ksteps = (l.blocks + kStepBlocks - 1) / kStepBlocks;
  l.tiles16 = padded / 16;
  l.row_blocks = (padded + v - 1) / v;
  l.frag_off = 0;
  l.meta_off = align256(l.frag_off + size_t(l.ksteps * l.tiles16) * 32 * 16);
  l.sel_off = align256(l.meta_off + size_t(l.ksteps * l.tiles16) * 32 * 4);
  l.err_off = align256(l.sel_off + size_t(l.ksteps * l.row_blocks) * kSelRecord);
  l.total = l.err_off + 256;
  return l;
}

// ---------------------------------------------------------------------------------------
// Conversion from the CPU layout (sparse/compressed.h) to the kernel layout.

struct ConvertArgs {
  const uint8_t* columns = nullptr;  // [rows/v, blocks, 4]
  const uint16_t* values = nullptr;  // [rows, blocks·2] bf16 bits
  const uint16_t* meta = nullptr;    // [rows, meta_stride]
  int64_t rows = 0, blocks = 0, ksteps = 0, tiles16 = 0, row_blocks = 0, meta_stride = 0;
  int v = 0, m = 0;
  uint32_t* frag = nullptr;
  uint32_t* meta_out = nullptr;
  uint8_t* sel = nullptr;
  int* errors = nullptr;
};

// The two kept values of row r in block b as one bf16 pair (zero for padding).
__device__ __forceinline__ uint32_t value_pair(const ConvertArgs& a, int64_t r, int64_t b) {
  if (r >= a.rows || b >= a.blocks) return 0u;
  const uint16_t* p = a.values + r * a.blocks * 2 + 2 * b;
  return uint32_t(p[0]) | uint32_t(p[1]) << 16;
}

// 16 bits of metadata: the nibbles of blocks first..first+3 of row r.
__device__ __forceinline__ uint32_t meta_half(const ConvertArgs& a, int64_t r, int64_t first) {
  uint32_t h = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t b = first + j;
    uint32_t nib = kPadNibble;
    if (r < a.rows && b < a.blocks) {
      nib = (a.meta[r * a.meta_stride + b / 4] >> (4 * (b % 4))) & 0xFu;
      if ((nib & 3u) >= (nib >> 2)) {  // mma.sp needs two distinct positions, ascending
        atomicAdd(a.errors, 1);
        nib = kPadNibble;
      }
    }
    h |= nib << (4 * j);
  }
  return h;
}

// One thread per (K step, 16-row tile, lane): the lane's A fragment and metadata register.
__global__ void convert_frag_kernel(const ConvertArgs a, bool values_only) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = a.ksteps * a.tiles16 * 32;
  if (idx >= total) return;
  const int lane = int(idx % 32);
  const int64_t tile = idx / 32 % a.tiles16, ks = idx / 32 / a.tiles16;
  const int g = lane >> 2, t = lane & 3;
  const int64_t r0 = tile * 16 + g, r1 = r0 + 8;
  const int64_t b_lo = ks * kStepBlocks + t, b_hi = b_lo + 4;
  uint4 f;
  f.x = value_pair(a, r0, b_lo);
  f.y = value_pair(a, r1, b_lo);
  f.z = value_pair(a, r0, b_hi);
  f.w = value_pair(a, r1, b_hi);
  reinterpret_cast<uint4*>(a.frag)[idx] = f;
  if (values_only) return;
  // Lanes 4g+0/4g+2 carry chunks 0-3, lanes 4g+1/4g+3 chunks 4-7 (sparsity selector 0
  // reads lanes 4g+0 and 4g+1; the copies in the other two cost nothing).
  const int64_t first = ks * kStepBlocks + 4 * (t & 1);
  a.meta_out[idx] = meta_half(a, r0, first) | meta_half(a, r1, first) << 16;
}

// One thread per (K step, row block, t): the 8 column offsets of the B registers of lanes
// with lane % 4 == t. Register i, element j is gathered position 2t + 8i + j of the step,
// i.e. chunk c = 2i + t/2, position p = 2(t%2) + j.
__global__ void convert_sel_kernel(const ConvertArgs a) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = a.ksteps * a.row_blocks * 4;
  if (idx >= total) return;
  const int t = int(idx % 4);
  const int64_t rb = idx / 4 % a.row_blocks, ks = idx / 4 / a.row_blocks;
  const int64_t real_row_blocks = a.rows / a.v;
  uint8_t out[8];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = 2 * i + (t >> 1), p = 2 * (t & 1) + j;
      const int64_t b = ks * kStepBlocks + c;
      int col = p;
      if (rb < real_row_blocks && b < a.blocks) {
        col = a.columns[(rb * a.blocks + b) * 4 + p];
        if (col >= a.m) {
          atomicAdd(a.errors, 1);
          col = p;
        }
      }
      out[2 * i + j] = uint8_t(a.m * c + col);
    }
  uint2 packed;
  packed.x = uint32_t(out[0]) | uint32_t(out[1]) << 8 | uint32_t(out[2]) << 16 | uint32_t(out[3]) << 24;
  packed.y = uint32_t(out[4]) | uint32_t(out[5]) << 8 | uint32_t(out[6]) << 16 | uint32_t(out[7]) << 24;
  reinterpret_cast<uint2*>(a.sel)[idx] = packed;
}

// One thread per (row, block): the block's m columns of the dense row.
__global__ void decompress_kernel(uint16_t* out, const uint32_t* frag, const uint32_t* meta, const uint8_t* sel,
                                  int64_t rows, int64_t blocks, int64_t tiles16, int64_t row_blocks, int v, int m) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * blocks) return;
  const int64_t r = idx / blocks, b = idx % blocks;
  const int64_t ks = b / kStepBlocks, tile = r / 16;
  const int c = int(b % kStepBlocks), rr = int(r % 16), g = rr % 8, half = rr / 8;
  const int t = c % 4, reg = (c / 4) * 2 + half;
  const uint32_t pair = frag[((ks * tiles16 + tile) * 32 + g * 4 + t) * 4 + reg];
  const uint32_t word = meta[(ks * tiles16 + tile) * 32 + g * 4 + c / 4];
  const uint32_t nib = (word >> (16 * half + 4 * (c % 4))) & 0xFu;
  const uint8_t* s = sel + (ks * row_blocks + r / v) * kSelRecord;
  int col[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) col[p] = int(s[(2 * (c % 2) + p / 2) * 8 + 2 * (c / 2) + p % 2]) - m * c;
  uint16_t* o = out + r * blocks * m + b * m;
  for (int q = 0; q < m; ++q) o[q] = 0;
  o[col[nib & 3u]] = uint16_t(pair & 0xFFFFu);
  o[col[nib >> 2]] = uint16_t(pair >> 16);
}

// ---------------------------------------------------------------------------------------
// The GEMM kernel.

struct GemmParams {
  const bf16* x = nullptr;  // X [tokens, cols], or Xᵀ [cols, ldxt] for the transposed kernel
  int64_t ldxt = 0;
  void* out = nullptr;
  const bf16* bias = nullptr;
  const uint32_t* frag = nullptr;
  const uint32_t* meta = nullptr;
  const uint8_t* sel = nullptr;
  int64_t tokens = 0, rows = 0, cols = 0;
  int64_t ksteps = 0, tiles16 = 0, row_blocks = 0;
  int m = 0, v = 0;
  bool x_async = false;  // 16-byte aligned X rows: cp.async; otherwise element-wise loads
  bool out_vec = false;  // 16-byte aligned output rows: 16-byte stores
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// Copies the first `bytes` (0..16) of 16 and zero-fills the rest (src is not read for 0).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// D += A · B with A 16×32 2:4-sparse (4 registers of kept bf16 pairs plus the metadata
// register e, sparsity selector 0), B 32×8 bf16, D 16×8 fp32. The metadata holds ascending
// pairs, which is what the ordered-metadata form requires.
__device__ __forceinline__ void mma_sp(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4], uint32_t e) {
  asm volatile(
      "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
}

// What one thread copies into each stage of the pipeline: its 16-byte chunks of the weight
// (A fragments, metadata and, for the first threads, the column selections of the tile's row
// blocks; a K step adds a fixed stride to each source) and of X. Row-major X: this thread
// copies 16-byte column chunk xq of token rows xr0 + 16i (tok_ok: which of them exist). Xᵀ:
// token chunk xq (8 tokens) of column rows xr0 + 16i; tok_bytes is how many of those 16 bytes
// hold existing tokens.
struct StageSources {
  const unsigned char* frag_src = nullptr;
  const unsigned char* meta_src = nullptr;
  const unsigned char* sel_src = nullptr;
  int64_t frag_step = 0, meta_step = 0, sel_step = 0;
  bool sel_copier = false;
  int xq = 0, xr0 = 0;
  uint32_t tok_ok = 0;
  int tok_bytes = 0;
  const bf16* xsrc = nullptr;
  int64_t x_row16 = 0;
};

template <bool XT>
__device__ __forceinline__ StageSources stage_sources(const GemmParams& p, int tid, int64_t n0, int64_t tile0,
                                                      int64_t rb_first, int rb_count) {
  StageSources s;
  s.frag_src = reinterpret_cast<const unsigned char*>(p.frag) + tile0 * 512 + tid * 16;
  s.frag_step = p.tiles16 * 512;
  s.meta_src = reinterpret_cast<const unsigned char*>(p.meta) + tile0 * 128 + tid * 16;
  s.meta_step = p.tiles16 * 128;
  s.sel_src = p.sel + rb_first * kSelRecord + tid * 16;
  s.sel_step = p.row_blocks * kSelRecord;
  s.sel_copier = tid < rb_count * (kSelRecord / 16);
  s.xq = tid % 16;
  s.xr0 = tid / 16;
  if constexpr (XT) {
    s.tok_bytes = int(max(int64_t(0), min(int64_t(16), (p.tokens - n0 - 8 * s.xq) * 2)));
    s.xsrc = p.x + int64_t(s.xr0) * p.ldxt + n0 + 8 * s.xq;
    s.x_row16 = 16 * p.ldxt;
  } else {
#pragma unroll
    for (int i = 0; i < kBN / 16; ++i) s.tok_ok |= uint32_t(n0 + s.xr0 + 16 * i < p.tokens) << i;
    s.xsrc = p.x + (n0 + s.xr0) * p.cols + 8 * s.xq;  // only dereferenced for existing rows
    s.x_row16 = 16 * p.cols;
  }
  return s;
}

// Issues this thread's copies of K step ks into pipeline stage `stage` (cp.async, or plain
// loads and stores for X rows that are not 16-byte aligned).
template <bool XT>
__device__ __forceinline__ void load_stage(const GemmParams& p, const StageSources& s, unsigned char* smem, int tid,
                                           int64_t n0, int stage, int64_t ks) {
  const int m = p.m;
  unsigned char* st = smem + stage * kStageBytes;
  const unsigned char* f = s.frag_src + ks * s.frag_step;
  static_assert(kFragBytes == 2 * kThreads * 16, "two A chunks per thread");
  cp_async16(st + kXBytes + tid * 16, f);
  cp_async16(st + kXBytes + kThreads * 16 + tid * 16, f + kThreads * 16);
  if (tid < kMetaBytes / 16) cp_async16(st + kXBytes + kFragBytes + tid * 16, s.meta_src + ks * s.meta_step);
  if (s.sel_copier) cp_async16(st + kXBytes + kFragBytes + kMetaBytes + tid * 16, s.sel_src + ks * s.sel_step);
  const int64_t k0 = ks * kStepBlocks * m;  // first column of X in this step
  if constexpr (XT) {
    const int rows = kStepBlocks * m;  // column rows of this step (<= 128)
#pragma unroll
    for (int i = 0; i < kBN / 16; ++i) {
      const int r = s.xr0 + 16 * i;
      if (r < rows) {
        const int bytes = k0 + r < p.cols ? s.tok_bytes : 0;
        cp_async16_zfill(st + r * kXStride + s.xq * 16, bytes ? s.xsrc + i * s.x_row16 + k0 * p.ldxt : p.x, bytes);
      }
    }
  } else if (p.x_async) {
    if (s.xq < m) {
      const bool col_ok = k0 + 8 * s.xq < p.cols;  // cols % 8 == 0: chunks are all in or all out
#pragma unroll
      for (int i = 0; i < kBN / 16; ++i) {
        const bool ok = col_ok && (s.tok_ok >> i & 1u);
        cp_async16_zfill(st + (s.xr0 + 16 * i) * kXStride + s.xq * 16, ok ? s.xsrc + i * s.x_row16 + k0 : p.x,
                         ok ? 16 : 0);
      }
    }
  } else {
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(p.x);
    for (int c = tid; c < kBN * m; c += kThreads) {
      const int r = c / m, q = c - r * m;
      const int64_t tok = n0 + r, col = k0 + 8 * q;
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t lo = (tok < p.tokens && col + 2 * e < p.cols) ? xs[tok * p.cols + col + 2 * e] : 0u;
        const uint32_t hi = (tok < p.tokens && col + 2 * e + 1 < p.cols) ? xs[tok * p.cols + col + 2 * e + 1] : 0u;
        w[e] = lo | hi << 16;
      }
      *reinterpret_cast<uint4*>(st + r * kXStride + q * 16) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// The warp's MI·NJ mma.sp of one K step from stage st: its A fragments and metadata, and the
// B fragments gathered at the selected columns of its row block (rb_local in the tile).
// XT = false: X [tokens, cols] row-major; the stage holds 128 token rows × 8·M columns,
// and lane (g, t) gathers B register i of n tile nj with two LDS.U16 from token row
// 8·nj + g: 8 loads per n tile.
// XT = true: Xᵀ [cols, ldxt]; the stage holds 8·M column rows × 128 tokens, and the warp's
// n tiles interleave their tokens (n tile nj, column n is token NJ·n + nj), so that one
// LDS.128 (NJ = 8) or LDS.64 (NJ = 4) of gathered column k brings the lane's element of
// all its n tiles at once: 8 shared loads per K step instead of 8 per n tile.
template <int MI, bool XT>
__device__ __forceinline__ void mma_stage(float (&acc)[MI][WarpTile<MI>::kNJ][4], const unsigned char* st,
                                          int warp_m, int warp_n, int lane, int g, int t, int rb_local) {
  using WT = WarpTile<MI>;
  constexpr int NJ = WT::kNJ;
  // Columns (inside the step) of this lane's B registers: register i, element j at 2i + j.
  const uint2 s8 =
      *reinterpret_cast<const uint2*>(st + kXBytes + kFragBytes + kMetaBytes + rb_local * kSelRecord + t * 8);
  uint32_t a[MI][4], e[MI];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    const int tile = warp_m * MI + mi;
    const uint4 av = *reinterpret_cast<const uint4*>(st + kXBytes + (tile * 32 + lane) * 16);
    a[mi][0] = av.x;
    a[mi][1] = av.y;
    a[mi][2] = av.z;
    a[mi][3] = av.w;
    e[mi] = *reinterpret_cast<const uint32_t*>(st + kXBytes + kFragBytes + (tile * 32 + lane) * 4);
  }
  if constexpr (XT) {
    // gathered[k]: the lane's NJ tokens (NJ·g .. NJ·g + NJ-1 of the warp) of column k.
    uint32_t gathered[8][NJ / 2];
    const unsigned char* base = st + (warp_n * WT::kTokens + NJ * g) * 2;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t word = k < 4 ? s8.x : s8.y;
      const unsigned char* src = base + ((word >> (8 * (k % 4))) & 0xFFu) * kXStride;
      static_assert(NJ == 8 || NJ == 4, "warp tiles of 8 or 4 n tiles");
      if constexpr (NJ == 8) {
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        gathered[k][0] = v.x;
        gathered[k][1] = v.y;
        gathered[k][2 % (NJ / 2)] = v.z;
        gathered[k][3 % (NJ / 2)] = v.w;
      } else {
        const uint2 v = *reinterpret_cast<const uint2*>(src);
        gathered[k][0] = v.x;
        gathered[k][1] = v.y;
      }
    }
#pragma unroll
    for (int nj = 0; nj < NJ; ++nj) {
      uint32_t b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)  // element j of register i: the nj-th token of column 2i + j
        b[i] = __byte_perm(gathered[2 * i][nj / 2], gathered[2 * i + 1][nj / 2], (nj & 1) ? 0x7632 : 0x5410);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) mma_sp(acc[mi][nj], a[mi], b, e[mi]);
    }
  } else {
    const unsigned char* xrow = st + (warp_n * WT::kTokens + g) * kXStride;
    const unsigned char* src[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t word = k < 4 ? s8.x : s8.y;
      src[k] = xrow + 2 * ((word >> (8 * (k % 4))) & 0xFFu);
    }
#pragma unroll
    for (int nj = 0; nj < NJ; ++nj) {
      uint32_t b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t lo = *reinterpret_cast<const uint16_t*>(src[2 * i] + nj * 8 * kXStride);
        const uint32_t hi = *reinterpret_cast<const uint16_t*>(src[2 * i + 1] + nj * 8 * kXStride);
        b[i] = lo | hi << 16;
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) mma_sp(acc[mi][nj], a[mi], b, e[mi]);
    }
  }
}

// Epilogue: the warp's accumulators (+ bias) -> its [tokens][out] tile in shared memory ->
// Y rows (16-byte chunks). The warp covers out rows m0 + warp_m·kRows.. and tokens
// n0 + warp_n·kTokens.. of the thread block's tile.
template <int MI, typename OutT, bool XT>
__device__ __forceinline__ void store_warp_tile(const GemmParams& p, const float (&acc)[MI][WarpTile<MI>::kNJ][4],
                                                unsigned char* smem, int warp, int warp_m, int warp_n, int lane, int g,
                                                int t, int64_t m0, int64_t n0) {
  using WT = WarpTile<MI>;
  constexpr int NJ = WT::kNJ;
  constexpr int kStride = epi_stride<MI, OutT>();
  unsigned char* tile = smem + warp * WT::kTokens * kStride;
  const int64_t row0 = m0 + warp_m * WT::kRows;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    float bias_lo = 0.f, bias_hi = 0.f;
    if (p.bias) {
      bias_lo = __bfloat162float(p.bias[row0 + mi * 16 + g]);
      bias_hi = __bfloat162float(p.bias[row0 + mi * 16 + g + 8]);
    }
#pragma unroll
    for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = 2 * t + (c & 1);  // column of the n tile
        const int tok = XT ? n * NJ + nj : nj * 8 + n, col = mi * 16 + g + 8 * (c >> 1);
        const float v = acc[mi][nj][c] + ((c >> 1) ? bias_hi : bias_lo);
        if constexpr (std::is_same_v<OutT, float>)
          *reinterpret_cast<float*>(tile + tok * kStride + col * 4) = v;
        else
          *reinterpret_cast<bf16*>(tile + tok * kStride + col * 2) = __float2bfloat16_rn(v);
      }
  }
  __syncwarp();
  constexpr int kRowChunks = WT::kRows * int(sizeof(OutT)) / 16;  // 16-byte chunks per token row
  OutT* out = static_cast<OutT*>(p.out);
  const int64_t tok0 = n0 + warp_n * WT::kTokens;
#pragma unroll 4
  for (int c = lane; c < WT::kTokens * kRowChunks; c += 32) {
    const int r = c / kRowChunks, q = c % kRowChunks;
    const int64_t tok = tok0 + r;
    if (tok >= p.tokens) continue;
    const unsigned char* s = tile + r * kStride + q * 16;
    OutT* d = out + tok * p.rows + row0 + q * (16 / int(sizeof(OutT)));
    if (p.out_vec) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
    } else {
#pragma unroll
      for (int k = 0; k < 16 / int(sizeof(OutT)); ++k) d[k] = reinterpret_cast<const OutT*>(s)[k];
    }
  }
}

// One thread block: a kBM × kBN tile of D = W · Xᵀ through a Stages-deep cp.async pipeline
// of K steps (XT: X given transposed, see mma_stage).
template <int Stages, int MI, typename OutT, bool XT>
__global__ void __launch_bounds__(kThreads, 1) vnm_gemm_kernel(const GemmParams p) {
  using WT = WarpTile<MI>;
  constexpr int NJ = WT::kNJ;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp % WT::kWarpsM, warp_n = warp / WT::kWarpsM;
  const int g = lane >> 2, t = lane & 3;
  const int64_t m0 = int64_t(blockIdx.x) * kBM;  // first out row of the tile
  const int64_t n0 = int64_t(blockIdx.y) * kBN;  // first token of the tile
  const int64_t tile0 = m0 / 16;
  const int64_t rb_first = m0 / p.v;
  const int rb_count = int((m0 + kBM - 1) / p.v - rb_first + 1);
  const StageSources sources = stage_sources<XT>(p, tid, n0, tile0, rb_first, rb_count);

  float acc[MI][NJ][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.f;

  // out is a multiple of V, hence of the warp's rows: they are all inside or all outside.
  const bool active = m0 + warp_m * WT::kRows < p.rows;
  const int rb_local = int((m0 + warp_m * WT::kRows) / p.v - rb_first);

#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) {
    if (s < p.ksteps) load_stage<XT>(p, sources, smem, tid, n0, s, s);
    cp_async_commit();
  }

  for (int64_t ks = 0; ks < p.ksteps; ++ks) {
    cp_async_wait<Stages - 2>();
    __syncthreads();  // stage ks is complete for everyone, and stage ks-1 is no longer read
    {
      const int64_t next = ks + Stages - 1;
      if (next < p.ksteps) load_stage<XT>(p, sources, smem, tid, n0, int(next % Stages), next);
      cp_async_commit();
    }
    if (!active) continue;
    mma_stage<MI, XT>(acc, smem + int(ks % Stages) * kStageBytes, warp_m, warp_n, lane, g, t, rb_local);
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory becomes the epilogue's
  if (!active) return;
  store_warp_tile<MI, OutT, XT>(p, acc, smem, warp, warp_m, warp_n, lane, g, t, m0, n0);
}

// Xᵀ [cols, ldxt] = X [tokens, cols]ᵀ through 64 × 64 shared-memory tiles (coalesced both
// ways). Columns [tokens, ldxt) of Xᵀ are not written.
__global__ void transpose_kernel(uint16_t* xt, const uint16_t* x, int64_t tokens, int64_t cols, int64_t ldxt) {
  __shared__ uint16_t tile[64][66];
  const int64_t t0 = int64_t(blockIdx.y) * 64, c0 = int64_t(blockIdx.x) * 64;
  const int tx = threadIdx.x % 64, ty = threadIdx.x / 64;  // 256 threads: 4 rows at a time
  for (int r = ty; r < 64; r += 4) {
    const int64_t tok = t0 + r, col = c0 + tx;
    tile[r][tx] = (tok < tokens && col < cols) ? x[tok * cols + col] : uint16_t(0);
  }
  __syncthreads();
  for (int r = ty; r < 64; r += 4) {
    const int64_t col = c0 + r, tok = t0 + tx;
    if (col < cols && tok < tokens) xt[col * ldxt + tok] = tile[tx][r];
  }
}

// ---------------------------------------------------------------------------------------
// Launch

int stages_for_device() {
  int dev = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return optin >= std::max(smem_bytes<4, 4, float>(), smem_bytes<4, 8, float>()) ? 4 : 3;
}

template <int Stages, int MI, typename OutT, bool XT>
void launch_gemm(const GemmParams& p, cudaStream_t stream) {
  constexpr int smem = smem_bytes<Stages, MI, OutT>();
  static const bool configured = [] {
    CUDA_CHECK(cudaFuncSetAttribute(vnm_gemm_kernel<Stages, MI, OutT, XT>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(p.tiles16 * 16 / kBM), unsigned((p.tokens + kBN - 1) / kBN));
  vnm_gemm_kernel<Stages, MI, OutT, XT><<<grid, kThreads, smem, stream>>>(p);
  CUDA_CHECK_LAUNCH("vnm_gemm_kernel");
}

template <typename OutT, bool XT>
void launch_for(const GemmParams& p, bool rows128, cudaStream_t stream) {
  static const int stages = stages_for_device();
  if (stages == 4)
    rows128 ? launch_gemm<4, 8, OutT, XT>(p, stream) : launch_gemm<4, 4, OutT, XT>(p, stream);
  else
    rows128 ? launch_gemm<3, 8, OutT, XT>(p, stream) : launch_gemm<3, 4, OutT, XT>(p, stream);
}

void check_weight(const VnmDeviceWeight& w, const char* what) {
  ESPLAG_CHECK(w.frag && w.meta && w.sel, what, ": the weight has not been prepared (vnm_prepare_weight)");
  check_shape(w.rows, w.cols, w.v, w.m, what);
  const Layout l = layout_of(w.rows, w.cols, w.v, w.m);
  ESPLAG_CHECK(l.ksteps == w.ksteps && l.tiles16 == w.row_tiles16 && l.row_blocks == w.row_blocks &&
                   l.blocks == w.blocks,
               what, ": the weight's layout fields do not match its shape [", w.rows, ", ", w.cols, "]");
}

// x is X [tokens, cols] (ldxt = 0) or Xᵀ [cols, ldxt].
template <typename OutT>
void forward(OutT* out, const bf16* x, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
             cudaStream_t stream, VnmTile tile, VnmKernel kernel, const char* what) {
  check_weight(w, what);
  ESPLAG_CHECK(tile != VnmTile::rows128 || w.v % 128 == 0, what,
               ": the 128-row warp tile needs V to be a multiple of 128, got V = ", w.v);
  ESPLAG_CHECK(tokens >= 0, what, ": tokens = ", tokens, " must not be negative");
  if (tokens == 0) return;
  ESPLAG_CHECK(out && x, what, ": null ", out ? "input" : "output", " pointer");
  ESPLAG_CHECK((tokens + kBN - 1) / kBN <= 65535, what, ": ", tokens, " tokens exceed the grid limit of ",
               int64_t(65535) * kBN);
  ESPLAG_CHECK(reinterpret_cast<uintptr_t>(x) % 2 == 0 && reinterpret_cast<uintptr_t>(out) % sizeof(OutT) == 0, what,
               ": input or output pointer is not aligned to its element size");
  const bool xt = ldxt > 0;
  if (xt)
    ESPLAG_CHECK(ldxt >= tokens && ldxt % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0, what,
                 ": the transposed input needs a 16-byte aligned pointer and a leading dimension that is a multiple "
                 "of 8 and at least tokens (got ",
                 ldxt, " for ", tokens, " tokens)");
  GemmParams p;
  p.x = x;
  p.ldxt = ldxt;
  p.out = out;
  p.bias = bias;
  p.frag = w.frag;
  p.meta = w.meta;
  p.sel = w.sel;
  p.tokens = tokens;
  p.rows = w.rows;
  p.cols = w.cols;
  p.ksteps = w.ksteps;
  p.tiles16 = w.row_tiles16;
  p.row_blocks = w.row_blocks;
  p.m = w.m;
  p.v = w.v;
  p.x_async = reinterpret_cast<uintptr_t>(x) % 16 == 0 && w.cols % 8 == 0;
  // rows % 64 == 0, so every output row is 16-byte aligned when the base is.
  p.out_vec = reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (vnm_resolve_kernel(kernel) == VnmKernel::wgmma_sp) {
    vnm_wgmma::forward(out, x, ldxt, w, bias, tokens, stream);
    return;
  }
  const bool rows128 = tile == VnmTile::rows128 || (tile == VnmTile::automatic && w.v % 128 == 0);
  if (xt)
    launch_for<OutT, true>(p, rows128, stream);
  else
    launch_for<OutT, false>(p, rows128, stream);
}

ConvertArgs convert_args(const VnmDeviceWeight& w) {
  ConvertArgs a;
  a.rows = w.rows;
  a.blocks = w.blocks;
  a.ksteps = w.ksteps;
  a.tiles16 = w.row_tiles16;
  a.row_blocks = w.row_blocks;
  a.meta_stride = (w.blocks * 4 + 15) / 16;
  a.v = w.v;
  a.m = w.m;
  a.frag = w.frag;
  a.meta_out = w.meta;
  a.sel = w.sel;
  return a;
}

unsigned grid_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

}  // namespace

bool vnm_wgmma_available() { return vnm_wgmma::available(); }

VnmKernel vnm_resolve_kernel(VnmKernel requested) {
  if (requested == VnmKernel::automatic) {
    const char* env = std::getenv("ESPLAG_VNM_KERNEL");
    if (env && *env && std::strcmp(env, "automatic") != 0) {
      ESPLAG_CHECK(std::strcmp(env, "wgmma_sp") == 0 || std::strcmp(env, "mma_sp") == 0,
                   "environment variable ESPLAG_VNM_KERNEL: unknown V:N:M kernel '", env,
                   "' (automatic, wgmma_sp or mma_sp)");
      requested = std::strcmp(env, "wgmma_sp") == 0 ? VnmKernel::wgmma_sp : VnmKernel::mma_sp;
    } else {
      return VnmKernel::mma_sp;  // the faster of the two as measured (vnm_gemm.h)
    }
  }
  ESPLAG_CHECK(requested != VnmKernel::wgmma_sp || vnm_wgmma_available(),
               "the wgmma.sp V:N:M kernel needs a compute-capability 9.0 device (H100/H200) and a build with the "
               "sm_90a target");
  return requested;
}

size_t vnm_device_weight_bytes(int64_t rows, int64_t cols, int v, int m) {
  check_shape(rows, cols, v, m, "vnm_device_weight_bytes");
  return layout_of(rows, cols, v, m).total;
}

VnmDeviceWeight vnm_prepare_weight(void* storage, size_t storage_bytes, const uint8_t* columns, const bf16* values,
                                   const uint16_t* meta, int64_t rows, int64_t cols, int v, int m,
                                   cudaStream_t stream) {
  check_shape(rows, cols, v, m, "vnm_prepare_weight");
  const Layout l = layout_of(rows, cols, v, m);
  ESPLAG_CHECK(storage && storage_bytes >= l.total, "vnm_prepare_weight: storage of ", storage_bytes,
               " bytes is too small, a [", rows, ", ", cols, "] ", v, ":2:", m, " weight needs ", l.total);
  ESPLAG_CHECK(reinterpret_cast<uintptr_t>(storage) % 256 == 0, "vnm_prepare_weight: storage must be 256-byte aligned");
  ESPLAG_CHECK(columns && values && meta, "vnm_prepare_weight: null columns, values or metadata pointer");
  unsigned char* base = static_cast<unsigned char*>(storage);
  VnmDeviceWeight w;
  w.v = v;
  w.m = m;
  w.rows = rows;
  w.cols = cols;
  w.blocks = l.blocks;
  w.ksteps = l.ksteps;
  w.row_tiles16 = l.tiles16;
  w.row_blocks = l.row_blocks;
  w.frag = reinterpret_cast<uint32_t*>(base + l.frag_off);
  w.meta = reinterpret_cast<uint32_t*>(base + l.meta_off);
  w.sel = base + l.sel_off;
  int* errors = reinterpret_cast<int*>(base + l.err_off);

  ConvertArgs a = convert_args(w);
  a.columns = columns;
  a.values = reinterpret_cast<const uint16_t*>(values);
  a.meta = meta;
  a.errors = errors;
  CUDA_CHECK(cudaMemsetAsync(errors, 0, sizeof(int), stream));
  const int64_t nfrag = l.ksteps * l.tiles16 * 32, nsel = l.ksteps * l.row_blocks * 4;
  convert_frag_kernel<<<grid_for(nfrag, 256), 256, 0, stream>>>(a, false);
  CUDA_CHECK_LAUNCH("convert_frag_kernel");
  convert_sel_kernel<<<grid_for(nsel, 256), 256, 0, stream>>>(a);
  CUDA_CHECK_LAUNCH("convert_sel_kernel");
  int host_errors = 0;
  CUDA_CHECK(cudaMemcpyAsync(&host_errors, errors, sizeof(int), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  ESPLAG_CHECK(host_errors == 0, "vnm_prepare_weight: [", rows, ", ", cols, "] ", v, ":2:", m, " weight has ",
               host_errors,
               " invalid indices (a selected column >= M, or a metadata nibble that is not two ascending "
               "positions)");
  return w;
}

VnmDeviceWeight vnm_upload_weight(const CompressedVNMBf16& w, DeviceArena& arena, cudaStream_t stream) {
  check_shape(w.rows, w.cols, w.v, w.m, "vnm_upload_weight");
  const int64_t blocks = w.cols / w.m;
  ESPLAG_CHECK(int64_t(w.columns.size()) == w.rows / w.v * blocks * 4 && w.inner.rows == w.rows &&
                   w.inner.cols == blocks * 4 && int64_t(w.inner.values.size()) == w.rows * blocks * 2 &&
                   int64_t(w.inner.meta.size()) == w.rows * w.inner.meta_stride(),
               "vnm_upload_weight: the compressed [", w.rows, ", ", w.cols, "] ", w.v, ":2:", w.m,
               " weight's arrays have inconsistent sizes");
  const size_t bytes = vnm_device_weight_bytes(w.rows, w.cols, w.v, w.m);
  void* storage = arena.allocate("vnm weight", bytes);
  const size_t mark = arena.mark();
  uint8_t* cols = arena.allocate_array<uint8_t>("vnm upload columns", w.columns.size());
  uint16_t* vals = arena.allocate_array<uint16_t>("vnm upload values", w.inner.values.size());
  uint16_t* meta = arena.allocate_array<uint16_t>("vnm upload meta", w.inner.meta.size());
  CUDA_CHECK(cudaMemcpyAsync(cols, w.columns.data(), w.columns.size(), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(vals, w.inner.values.data(), w.inner.values.size() * 2, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(meta, w.inner.meta.data(), w.inner.meta.size() * 2, cudaMemcpyHostToDevice, stream));
  VnmDeviceWeight dw;
  try {
    dw = vnm_prepare_weight(storage, bytes, cols, reinterpret_cast<const bf16*>(vals), meta, w.rows, w.cols, w.v,
                            w.m, stream);
  } catch (...) {
    arena.release_to(mark);
    throw;
  }
  arena.release_to(mark);  // prepare synchronised the stream: the temporaries are no longer read
  return dw;
}

void vnm_update_values(const VnmDeviceWeight& w, const bf16* values, cudaStream_t stream) {
  check_weight(w, "vnm_update_values");
  ESPLAG_CHECK(values, "vnm_update_values: null values pointer");
  ConvertArgs a = convert_args(w);
  a.values = reinterpret_cast<const uint16_t*>(values);
  const int64_t n = w.ksteps * w.row_tiles16 * 32;
  convert_frag_kernel<<<grid_for(n, 256), 256, 0, stream>>>(a, true);
  CUDA_CHECK_LAUNCH("convert_frag_kernel (values)");
}

void vnm_decompress(bf16* out, const VnmDeviceWeight& w, cudaStream_t stream) {
  check_weight(w, "vnm_decompress");
  ESPLAG_CHECK(out, "vnm_decompress: null output pointer");
  const int64_t n = w.rows * w.blocks;
  decompress_kernel<<<grid_for(n, 256), 256, 0, stream>>>(reinterpret_cast<uint16_t*>(out), w.frag, w.meta, w.sel,
                                                          w.rows, w.blocks, w.row_tiles16, w.row_blocks, w.v, w.m);
  CUDA_CHECK_LAUNCH("vnm decompress_kernel");
}

void vnm_linear_forward(bf16* out, const bf16* x, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
                        cudaStream_t stream, VnmTile tile, VnmKernel kernel) {
  forward(out, x, 0, w, bias, tokens, stream, tile, kernel, "vnm_linear_forward");
}

void vnm_linear_forward(float* out, const bf16* x, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
                        cudaStream_t stream, VnmTile tile, VnmKernel kernel) {
  forward(out, x, 0, w, bias, tokens, stream, tile, kernel, "vnm_linear_forward");
}

int64_t vnm_transposed_ld(int64_t tokens) { return (tokens + 7) / 8 * 8; }

size_t vnm_transposed_input_bytes(int64_t tokens, int64_t cols) {
  ESPLAG_CHECK(tokens >= 0 && cols >= 0, "vnm_transposed_input_bytes: negative size");
  return size_t(cols * vnm_transposed_ld(tokens)) * sizeof(bf16);
}

void vnm_transpose_input(bf16* xt, const bf16* x, int64_t tokens, int64_t cols, cudaStream_t stream) {
  ESPLAG_CHECK(tokens >= 0 && cols > 0, "vnm_transpose_input: bad shape [", tokens, ", ", cols, "]");
  if (tokens == 0) return;
  ESPLAG_CHECK(xt && x, "vnm_transpose_input: null pointer");
  ESPLAG_CHECK((tokens + 63) / 64 <= 65535, "vnm_transpose_input: ", tokens, " tokens exceed the grid limit");
  const dim3 grid(unsigned((cols + 63) / 64), unsigned((tokens + 63) / 64));
  transpose_kernel<<<grid, 256, 0, stream>>>(reinterpret_cast<uint16_t*>(xt), reinterpret_cast<const uint16_t*>(x),
                                             tokens, cols, vnm_transposed_ld(tokens));
  CUDA_CHECK_LAUNCH("vnm transpose_kernel");
}

void vnm_linear_forward_xt(bf16* out, const bf16* xt, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias,
                           int64_t tokens, cudaStream_t stream, VnmTile tile, VnmKernel kernel) {
  ESPLAG_CHECK(ldxt > 0, "vnm_linear_forward_xt: leading dimension ", ldxt, " must be positive");
  forward(out, xt, ldxt, w, bias, tokens, stream, tile, kernel, "vnm_linear_forward_xt");
}

void vnm_linear_forward_xt(float* out, const bf16* xt, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias,
                           int64_t tokens, cudaStream_t stream, VnmTile tile, VnmKernel kernel) {
  ESPLAG_CHECK(ldxt > 0, "vnm_linear_forward_xt: leading dimension ", ldxt, " must be positive");
  forward(out, xt, ldxt, w, bias, tokens, stream, tile, kernel, "vnm_linear_forward_xt");
}

}  // namespace esplag::gpu
