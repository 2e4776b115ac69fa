// V:2:M × dense GEMM on Hopper's sparse warpgroup MMA (wgmma.mma_async.sp.m64n128k32,
// bf16 in, fp32 accumulate), for sm_90a. Like the mma.sp kernel (vnm_gemm.cu) it computes
// D = W · Xᵀ as [out, tokens] tiles, W being the sparse operand A.
//
// Persistent thread blocks (one per SM) walk the tiles of 128 out rows × 128 tokens, block b
// taking tiles b, b + grid, ... (row tiles fastest, so the blocks at work share the tokens);
// each consumer warpgroup's epilogue overlaps its producers' first stages of the next tile.
// Thread block: 384 threads, warp-specialised:
//   warps 0-3   producers: warps 0-1 feed consumer warpgroup 0, warps 2-3 consumer 1;
//   warps 4-7   consumer warpgroup 0: out rows 0-63 of the tile;
//   warps 8-11  consumer warpgroup 1: out rows 64-127.
// Each consumer warpgroup's 64 rows lie in one row block (V is a multiple of 64), so one
// selection of columns serves all of them. Per K step (8 V:2:M blocks = 32 gathered
// columns = 8·M columns of X) its producer warps fill one stage of a kStages-deep ring in
// shared memory:
//   B     the 32 gathered columns × 128 tokens, bf16, MN-major (tokens contiguous) in the
//         no-swizzle canonical layout: core matrices of 8 columns (k) × 8 tokens (16 bytes
//         per k row, 128 bytes each), 128 bytes apart along k (LBO) and 512 apart along the
//         tokens (SBO). Gathered with cp.async from Xᵀ (one 16-byte copy = 8 tokens of one
//         selected column), or through registers from row-major X (8 two-byte loads, one
//         16-byte store; each step's loads issued one step ahead);
//   A     the 4 warps' A fragments of the step (2 KB), and
//   E     their metadata registers (512 B), both by one bulk copy (TMA) each: the converted
//         weight (vnm_prepare_weight) already holds them in wgmma.sp's register order, which
//         for bf16 m64nNk32 is per warp that of mma.sp.m16n8k32 (warp w of the warpgroup
//         owns rows 16w..16w+15: a0..a3 = row g chunk t, row g+8 chunk t, row g chunk t+4,
//         row g+8 chunk t+4; metadata lanes 4g+0/4g+2 chunks 0-3, 4g+1/4g+3 chunks 4-7,
//         low half row g, high half row g+8; sparsity selector 0).
// Completion is tracked by mbarriers: `full` (64 producer arrivals, cp.async arrivals
// included, plus the bulk copies' transaction bytes) and `empty` (128 consumer arrivals).
// A consumer waits on full, loads its A fragment and metadata register from the stage and
// issues one wgmma.sp (A from registers, B by descriptor), keeping it in flight: it waits
// only for the previous step's wgmma (wait_group 1) and then releases that step's stage, so
// a stage is never overwritten while a wgmma still reads it. The epilogue adds the bias in
// fp32 and stores straight from the accumulators.
#include "sparse/cuda/vnm_wgmma.h"

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ESPLAG_VNM_WGMMA_DEVICE 1
#endif

namespace esplag::gpu::vnm_wgmma {

namespace {

constexpr int kThreads = 384;
constexpr int kConsumers = 2;      // consumer warpgroups
constexpr int kWgRows = 64;        // out rows per consumer warpgroup (wgmma M)
constexpr int kBM = kConsumers * kWgRows;
constexpr int kBN = 128;           // tokens per thread block (wgmma N)
constexpr int kProducerThreads = 64;  // per consumer warpgroup
constexpr int kStages = 6;
[[maybe_unused]] constexpr int kStepBlocks = VnmDeviceWeight::kBlocksPerStep;
constexpr int kBBytes = kBN * 32 * 2;    // 8192
constexpr int kABytes = 4 * 32 * 16;     // 4 warps × 32 lanes × 4 registers
constexpr int kEBytes = 4 * 32 * 4;      // 4 warps × 32 lanes × 1 register
constexpr int kStageBytes = kBBytes + kABytes + kEBytes;
constexpr int kBarrierBytes = 2 * kConsumers * kStages * 8;
constexpr int kSmemBytes = kConsumers * kStages * kStageBytes + kBarrierBytes;
[[maybe_unused]] constexpr uint32_t kLbo = 128, kSbo = 512;  // B descriptor strides (bytes), see the top comment
[[maybe_unused]] constexpr uint32_t kFullCount = kProducerThreads + 1;  // + the arrive that sets the transaction bytes
[[maybe_unused]] constexpr uint32_t kEmptyCount = 128;

static_assert(kStageBytes % 128 == 0, "stages keep the alignment of the descriptors and bulk copies");
static_assert(kProducerThreads * 8 == 32 * (kBN / 8), "each producer thread fills 8 core-matrix rows of B");

struct Params {
  const bf16* x = nullptr;  // X [tokens, cols] (ldxt = 0) or Xᵀ [cols, ldxt]
  int64_t ldxt = 0;
  void* out = nullptr;
  const bf16* bias = nullptr;
  const unsigned char* frag = nullptr;
  const unsigned char* meta = nullptr;
  const uint8_t* sel = nullptr;
  int64_t tokens = 0, rows = 0, cols = 0, ksteps = 0, tiles16 = 0, row_blocks = 0;
  int64_t row_tiles = 0, tiles = 0;  // thread-block tiles: along the out rows, in all
  int m = 0, v = 0;
};

#ifdef ESPLAG_VNM_WGMMA_DEVICE

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The arrival fires once this thread's earlier cp.async copies have landed (counted: noinc).
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// Copies the first `bytes` (0..16) of 16 and zero-fills the rest (src is not read for 0).
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// Shared-memory matrix descriptor: no swizzle, start address, LBO and SBO in 16-byte units.
__device__ __forceinline__ uint64_t b_descriptor(uint32_t addr) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | uint64_t(kLbo >> 4) << 16 | uint64_t(kSbo >> 4) << 32;
}

// acc[64] += A (64×32, 2:4 sparse: 4 registers of kept bf16 pairs and one metadata register)
// · B (32×128 bf16, MN-major in shared memory): wgmma.mma_async.sp with A from registers,
// sparsity selector 0, scale-d on, B transposed (imm-trans-b = 1: MN-major).
__device__ __forceinline__ void wgmma_sp(float (&d)[64], const uint4& a, uint64_t desc, uint32_t e) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %70, 0;\n"
      "wgmma.mma_async.sp.sync.aligned.m64n128k32.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, %69, 0, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "l"(desc), "r"(e), "r"(1)
      : "memory");
}

// Orders the compiler's accesses to the accumulators against the wgmma asm statements: the
// registers are written asynchronously, so nothing may read or copy them before the wait.
__device__ __forceinline__ void fence_accumulators(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The selected column (offset inside the K step) of gathered position k for row block rb.
// The sel record is in the mma.sp B-fragment order: position k = 2t + 8i + j at [8t + 2i + j].
__device__ __forceinline__ int selected(const Params& p, int64_t ks, int64_t rb, int k) {
  const int i = k / 8, t = (k % 8) / 2, j = k % 2;
  return p.sel[(ks * p.row_blocks + rb) * 32 + 8 * t + 2 * i + j];
}

// From row-major X: the 64 values producer thread (k, group0) stores for step ks, whose
// gathered position k is column `sel` of the step: tokens n0 + 8·(group0 + 2q) + 2e (+1) at
// v[q][e] (low half, high half); zeros past the tokens and in the padding blocks.
__device__ __forceinline__ void load_x_step(const Params& p, int64_t ks, int sel, int64_t n0, int group0,
                                            uint32_t (&v)[8][4]) {
  const int64_t col = ks * kStepBlocks * p.m + sel;
  const bool col_ok = col < p.cols;
  // Every load is issued (from the tile's first token where out of range, then masked): no
  // branches between the loads, so all 64 are in flight together. Offsets from the tile's
  // first token fit 32 bits (the host checks kBN · cols < 2^31).
  const unsigned short* xt = reinterpret_cast<const unsigned short*>(p.x) + n0 * p.cols + (col_ok ? col : 0);
  const uint32_t cols = uint32_t(p.cols), in_tile = uint32_t(min(int64_t(kBN), p.tokens - n0));
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const uint32_t t = 8 * (group0 + 2 * q);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t t0 = t + 2 * e, t1 = t0 + 1;
      const uint32_t lo = __ldg(xt + (t0 < in_tile ? t0 * cols : 0u));
      const uint32_t hi = __ldg(xt + (t1 < in_tile ? t1 * cols : 0u));
      v[q][e] = (col_ok && t0 < in_tile ? lo : 0u) | (col_ok && t1 < in_tile ? hi : 0u) << 16;
    }
  }
}

// Producer thread lp (0..63) of consumer warpgroup c: gathered position k = lp % 32 of every
// step, token groups (of 8) lp / 32 + 2q, q = 0..7. The ring has carried it0 steps before
// this tile's: its step ks goes to stage (it0 + ks) % kStages, use (it0 + ks) / kStages.
template <bool XT>
__device__ void produce(const Params& p, unsigned char* stages, uint32_t full0, uint32_t empty0, int64_t row0,
                        int64_t n0, int64_t it0, int lp) {
  const int k = lp % 32, group0 = lp / 32;
  const int64_t rb = row0 / p.v, tile = row0 / 16;
  const int step_cols = kStepBlocks * p.m;
  // The selections of the next steps, loaded ahead (their latency would otherwise stall each step).
  int sel0 = selected(p, 0, rb, k);
  int sel1 = p.ksteps > 1 ? selected(p, 1, rb, k) : 0;
  int sel2 = p.ksteps > 2 ? selected(p, 2, rb, k) : 0;
  // X path: the values of the step, loaded one step ahead (right after the previous step's
  // stores) so that their latency overlaps the wait for the stage.
  uint32_t v[8][4];
  if constexpr (!XT) load_x_step(p, 0, sel0, n0, group0, v);
  for (int64_t ks = 0; ks < p.ksteps; ++ks) {
    const int s = int((it0 + ks) % kStages);
    const int64_t use = (it0 + ks) / kStages;
    const uint32_t full = full0 + 8 * s, empty = empty0 + 8 * s;
    const int sel = sel0;
    sel0 = sel1;
    sel1 = sel2;
    if (ks + 3 < p.ksteps) sel2 = selected(p, ks + 3, rb, k);
    if (use > 0) mbar_wait(empty, uint32_t(use - 1) & 1u);
    unsigned char* st = stages + s * kStageBytes;
    if (lp == 0) {
      mbar_arrive_expect_tx(full, kABytes + kEBytes);
      const int64_t first = ks * p.tiles16 + tile;  // the warpgroup's first 16-row tile of the step
      bulk_copy(smem_u32(st + kBBytes), p.frag + first * 512, kABytes, full);
      bulk_copy(smem_u32(st + kBBytes + kABytes), p.meta + first * 128, kEBytes, full);
    }
    const uint32_t row_dst = smem_u32(st) + (k / 8) * kLbo + (k % 8) * 16;
    if constexpr (XT) {
      const int64_t col = ks * step_cols + sel;
      const bool col_ok = col < p.cols;  // padding blocks of the last step: zeros (their A values are zero)
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const int group = group0 + 2 * q;
        const int64_t tok = n0 + 8 * group;
        const int bytes = col_ok ? int(max(int64_t(0), min(int64_t(16), 2 * (p.tokens - tok)))) : 0;
        cp_async16_zfill(row_dst + group * kSbo, bytes ? p.x + col * p.ldxt + tok : p.x, bytes);
      }
      mbar_arrive_cp_async(full);
    } else {
#pragma unroll
      for (int q = 0; q < 8; ++q)
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(row_dst + (group0 + 2 * q) * kSbo),
                     "r"(v[q][0]), "r"(v[q][1]), "r"(v[q][2]), "r"(v[q][3])
                     : "memory");
      mbar_arrive(full);
      if (ks + 1 < p.ksteps) load_x_step(p, ks + 1, sel0, n0, group0, v);
    }
  }
}

template <typename OutT>
__device__ __forceinline__ void store(OutT* out, int64_t i, float v) {
  if constexpr (std::is_same_v<OutT, float>)
    out[i] = v;
  else
    out[i] = __float2bfloat16_rn(v);
}

// Consumer warpgroup: thread ct (0..127) = warp w (16 rows each), lane (g, t); it0 as produce.
template <typename OutT>
__device__ void consume(const Params& p, unsigned char* stages, uint32_t full0, uint32_t empty0, int64_t row0,
                        int64_t n0, int64_t it0, int ct) {
  const int w = ct / 32, lane = ct % 32, g = lane / 4, t = lane % 4;
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  // Not unrolled: the copies of the accumulators between an unrolled loop and its remainder
  // would fall inside the wgmma pipeline (ptxas would then serialise the wgmmas).
#pragma unroll 1
  for (int64_t ks = 0; ks < p.ksteps; ++ks) {
    const int s = int((it0 + ks) % kStages);
    const int64_t use = (it0 + ks) / kStages;
    mbar_wait(full0 + 8 * s, uint32_t(use) & 1u);
    // B reaches the async proxy (wgmma) after generic-proxy writes (st.shared; cp.async).
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const unsigned char* st = stages + s * kStageBytes;
    const uint4 a = *reinterpret_cast<const uint4*>(st + kBBytes + w * 512 + lane * 16);
    const uint32_t e = *reinterpret_cast<const uint32_t*>(st + kBBytes + kABytes + w * 128 + lane * 4);
    fence_accumulators(acc);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    wgmma_sp(acc, a, b_descriptor(smem_u32(st)), e);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    // Keep this step's wgmma in flight; once the previous one is done, its stage goes back.
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    fence_accumulators(acc);
    if (ks > 0) mbar_arrive(empty0 + 8 * int((it0 + ks - 1) % kStages));
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_accumulators(acc);
  mbar_arrive(empty0 + 8 * int((it0 + p.ksteps - 1) % kStages));
  // Accumulator layout (per warp, as mma's m16n8): acc[4j + 2h + e] is row g + 8h, token 8j + 2t + e.
  OutT* out = static_cast<OutT*>(p.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + 16 * w + g + 8 * h;
    const float b = p.bias ? __bfloat162float(p.bias[row]) : 0.f;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t tok = n0 + 8 * j + 2 * t + e;
        if (tok < p.tokens) store(out, tok * p.rows + row, acc[4 * j + 2 * h + e] + b);
      }
  }
}

#endif  // ESPLAG_VNM_WGMMA_DEVICE

template <typename OutT, bool XT>
__global__ void __launch_bounds__(kThreads, 1) vnm_wgmma_kernel(const Params p) {
#ifdef ESPLAG_VNM_WGMMA_DEVICE
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid / 32;
  const uint32_t bars = smem_u32(smem + kConsumers * kStages * kStageBytes);
  if (tid == 0) {
    for (int i = 0; i < kConsumers * kStages; ++i) {
      mbar_init(bars + 8 * i, kFullCount);
      mbar_init(bars + 8 * (kConsumers * kStages + i), kEmptyCount);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Which consumer warpgroup this thread serves (producer warps 0-1 / 2-3, consumers 4-7 / 8-11).
  const int c = warp < 4 ? warp / 2 : warp / 4 - 1;
  unsigned char* stages = smem + c * kStages * kStageBytes;
  const uint32_t full0 = bars + 8 * c * kStages, empty0 = bars + 8 * (kConsumers * kStages + c * kStages);
  // Steps the warpgroup's ring has carried so far; its producers and consumer walk the same tiles.
  int64_t it = 0;
  for (int64_t tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const int64_t row0 = (tile % p.row_tiles) * kBM + c * kWgRows, n0 = (tile / p.row_tiles) * kBN;
    if (row0 >= p.rows) continue;  // out rows are a multiple of 64: a warpgroup's rows are all in or all out
    if (warp < 4)
      produce<XT>(p, stages, full0, empty0, row0, n0, it, tid % kProducerThreads);
    else
      consume<OutT>(p, stages, full0, empty0, row0, n0, it, tid % 128);
    it += p.ksteps;
  }
  // Producers stay until the consumers have taken the last stages: the copies into them have landed.
  if (warp < 4)
    for (int64_t j = it > kStages ? it - kStages : 0; j < it; ++j)
      mbar_wait(empty0 + 8 * int(j % kStages), uint32_t(j / kStages) & 1u);
#endif
}

// Writes 1 when this file's loaded image has the sm_90a code (0 for a plain sm_90 image).
__global__ void probe_kernel(int* has_wgmma) {
#ifdef ESPLAG_VNM_WGMMA_DEVICE
  *has_wgmma = 1;
#else
  *has_wgmma = 0;
#endif
}

bool probe_device() {
  int dev = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0) return false;
  int* flag = nullptr;
  CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
  int has = 0;
  CUDA_CHECK(cudaMemset(flag, 0, sizeof(int)));
  probe_kernel<<<1, 1>>>(flag);
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t copied = cudaMemcpy(&has, flag, sizeof(int), cudaMemcpyDeviceToHost);
  CUDA_CHECK(cudaFree(flag));
  CUDA_CHECK(launched);
  CUDA_CHECK(copied);
  return has == 1;
}

template <typename OutT, bool XT>
void launch(const Params& p, cudaStream_t stream) {
  static const bool configured = [] {
    CUDA_CHECK(cudaFuncSetAttribute(vnm_wgmma_kernel<OutT, XT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kSmemBytes));
    return true;
  }();
  (void)configured;
  int dev = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const unsigned grid = unsigned(std::min<int64_t>(p.tiles, sms));  // one block per SM (kSmemBytes)
  vnm_wgmma_kernel<OutT, XT><<<grid, kThreads, kSmemBytes, stream>>>(p);
  CUDA_CHECK_LAUNCH("vnm_wgmma_kernel");
}

template <typename OutT>
void run(OutT* out, const bf16* x, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
         cudaStream_t stream) {
  ESPLAG_CHECK(ldxt > 0 || int64_t(kBN) * w.cols < (int64_t(1) << 31), "vnm wgmma forward: ", w.cols,
               " in features exceed the kernel's limit for X [tokens, in] of ", ((int64_t(1) << 31) - 1) / kBN);
  Params p;
  p.x = x;
  p.ldxt = ldxt;
  p.out = out;
  p.bias = bias;
  p.frag = reinterpret_cast<const unsigned char*>(w.frag);
  p.meta = reinterpret_cast<const unsigned char*>(w.meta);
  p.sel = w.sel;
  p.tokens = tokens;
  p.rows = w.rows;
  p.cols = w.cols;
  p.ksteps = w.ksteps;
  p.tiles16 = w.row_tiles16;
  p.row_blocks = w.row_blocks;
  p.m = w.m;
  p.v = w.v;
  p.row_tiles = (w.rows + kBM - 1) / kBM;
  p.tiles = p.row_tiles * ((tokens + kBN - 1) / kBN);
  if (ldxt > 0)
    launch<OutT, true>(p, stream);
  else
    launch<OutT, false>(p, stream);
}

}  // namespace

bool available() {
  static std::mutex mutex;
  static std::vector<int> known;  // per device: -1 unknown, 0 no, 1 yes
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mutex);
  if (size_t(dev) >= known.size()) known.resize(size_t(dev) + 1, -1);
  if (known[size_t(dev)] < 0) known[size_t(dev)] = probe_device() ? 1 : 0;
  return known[size_t(dev)] == 1;
}

void forward(bf16* out, const bf16* x, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
             cudaStream_t stream) {
  run(out, x, ldxt, w, bias, tokens, stream);
}

void forward(float* out, const bf16* x, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
             cudaStream_t stream) {
  run(out, x, ldxt, w, bias, tokens, stream);
}

}  // namespace esplag::gpu::vnm_wgmma
