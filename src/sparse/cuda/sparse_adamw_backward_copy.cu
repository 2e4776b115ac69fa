// SLoPe's double-pruned backward copy W2ᵀ from the compressed forward weight W1: the
// periodic refresh (new backward mask) and the per-step refill (new values, same mask).
//
// One block takes a 64 × 64 tile of W (rows o0.., cols c0..): 256 threads read the tile's
// compressed W1 (each thread one metadata word and its 8 values = 4 groups of one row,
// 16-byte loads where the rows are aligned) and expand it into a dense fp32 tile plus a
// forward-kept flag in shared memory. The tile is then read down its columns: each thread
// builds one metadata word of W2ᵀ (row c, 4 groups of 4 W-rows each) and stores its 8 bf16
// values at once. The transpose thus happens in shared memory and both global sides are
// row-major walks.
//
// The ranking inside a column group is the CPU's (sparse/magnitude.h): larger |w| first,
// equal |w| broken by the lower row, NaN as +inf; a value ranks among the forward-kept ones
// only, and is kept when fewer than 2 kept values rank before it, which is what the CPU's
// repeated pick of the best remaining one gives for a strict order.
#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "sparse/cuda/sparse_adamw.h"

namespace esplag::gpu {

namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;  // kTile rows × 4 metadata words of 16 columns
static_assert(kThreads == kTile * kTile / 16, "one thread per metadata word of the tile");

__device__ __forceinline__ float value_at(const float* p) { return *p; }
__device__ __forceinline__ float value_at(const bf16* p) { return __bfloat162float(*p); }

// The 8 values of one metadata word (4 groups) in one or two 16-byte loads.
__device__ __forceinline__ void load8(float (&v)[8], const float* p) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(float (&v)[8], const bf16* p) { detail::load8(v, p); }

__device__ __forceinline__ float magnitude(float x) {
  const float a = fabsf(x);
  return isnan(a) ? __int_as_float(0x7f800000) : a;
}

// a[i] by selects: a dynamically indexed register array would be moved to local memory.
template <typename T>
__device__ __forceinline__ T at(const T (&a)[4], uint32_t i) {
  return i == 0 ? a[0] : (i == 1 ? a[1] : (i == 2 ? a[2] : a[3]));
}

// kRefresh: compute the backward mask and write bwd_meta; otherwise read bwd_meta.
template <typename V, bool kRefresh>
__global__ void __launch_bounds__(kThreads)
    slope_backward_kernel(bf16* __restrict__ bwd_values, uint16_t* __restrict__ bwd_meta_out,
                          const uint16_t* __restrict__ bwd_meta_in, const V* __restrict__ values,
                          const uint16_t* __restrict__ meta, int64_t rows, int64_t cols, bool vec_load,
                          bool vec_store) {
  __shared__ float tile[kTile][kTile + 1];  // [row of W][col of W]; +1 against bank conflicts
  __shared__ uint8_t kept[kTile][kTile + 4];
  const int64_t o0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;

  // Expand W1's tile: thread = (tile row, metadata word of 4 groups = 8 values).
  {
    const int lr = threadIdx.x >> 2, lw = threadIdx.x & 3;
    const int64_t o = o0 + lr, stride = (cols / 4 + 3) / 4, word_idx = c0 / 16 + lw, groups = cols / 4;
    const bool row_ok = o < rows;
    const uint32_t word = (row_ok && word_idx < stride) ? meta[o * stride + word_idx] : 0u;
    const V* src = values + o * (cols / 2) + 8 * word_idx;
    float v[8];
    if (vec_load && row_ok && 4 * word_idx + 3 < groups) {
      load8(v, src);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = (row_ok && 4 * word_idx + j / 2 < groups) ? value_at(src + j) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int lc = 16 * lw + 4 * k;
      const bool ok = row_ok && 4 * word_idx + k < groups;
      const uint32_t nib = (word >> (4 * k)) & 0xFu, i0 = nib & 3u, i1 = nib >> 2;
#pragma unroll
      for (uint32_t i = 0; i < 4; ++i) {
        const bool s0 = ok && i == i0, s1 = ok && i == i1;
        tile[lr][lc + i] = s0 ? v[2 * k] : (s1 ? v[2 * k + 1] : 0.f);
        kept[lr][lc + i] = (s0 || s1) ? 1 : 0;
      }
    }
  }
  __syncthreads();

  // W2ᵀ row c = column c of W; thread = (tile column, metadata word of 4 row groups).
  const int lc = threadIdx.x >> 2, lw = threadIdx.x & 3;
  const int64_t c = c0 + lc, stride = (rows / 4 + 3) / 4, word_idx = o0 / 16 + lw, groups = rows / 4;
  if (c >= cols || word_idx >= stride) return;
  uint32_t word = kRefresh ? 0u : bwd_meta_in[c * stride + word_idx];
  uint32_t packed[4] = {0u, 0u, 0u, 0u};  // the 4 groups' bf16 pairs
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t gq = 4 * word_idx + k;
    if (gq >= groups) break;  // nibbles past the last group stay 0
    const int lo = 16 * lw + 4 * k;
    float x[4];
    bool fk[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = tile[lo + i][lc];
      fk[i] = kept[lo + i][lc] != 0;
    }
    uint32_t i0, i1;
    bool k0, k1;  // whether the slot holds a backward-kept value (else padding: 0)
    if constexpr (kRefresh) {
      float mag[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) mag[i] = magnitude(x[i]);
      uint32_t sel = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        int before = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          before += (j != i && fk[j] && (mag[j] > mag[i] || (mag[j] == mag[i] && j < i))) ? 1 : 0;
        if (fk[i] && before < 2) sel |= 1u << i;
      }
      // Pad to 2 slots with the lowest positions not kept (compress_24_masked).
      uint32_t slots = sel;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (__popc(slots) < 2) slots |= 1u << i;
      i0 = __ffs(slots) - 1;
      i1 = __ffs(slots & ~(1u << i0)) - 1;
      k0 = (sel >> i0) & 1u;
      k1 = (sel >> i1) & 1u;
      word |= (i0 | (i1 << 2)) << (4 * k);
    } else {
      // A padded slot lies outside the forward mask (a group is padded only when it keeps
      // all of its forward-kept values), so the forward flag tells slots from padding.
      const uint32_t nib = (word >> (4 * k)) & 0xFu;
      i0 = nib & 3u;
      i1 = nib >> 2;
      k0 = at(fk, i0);
      k1 = at(fk, i1);
    }
    const __nv_bfloat162 pair =
        __halves2bfloat162(__float2bfloat16_rn(k0 ? at(x, i0) : 0.f), __float2bfloat16_rn(k1 ? at(x, i1) : 0.f));
    packed[k] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  bf16* dst = bwd_values + c * (rows / 2) + 8 * word_idx;
  if (vec_store && 4 * word_idx + 3 < groups) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (4 * word_idx + k < groups) *reinterpret_cast<uint32_t*>(dst + 2 * k) = packed[k];
  }
  if constexpr (kRefresh) bwd_meta_out[c * stride + word_idx] = static_cast<uint16_t>(word);
}

template <typename V, bool kRefresh>
void launch(const char* what, bf16* bwd_values, uint16_t* bwd_meta_out, const uint16_t* bwd_meta_in, const V* values,
            const uint16_t* meta, int64_t rows, int64_t cols, cudaStream_t stream) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && rows % 4 == 0 && cols % 4 == 0, what, ": the SLoPe weight [", rows, ", ",
               cols, "] needs rows and cols that are multiples of 4 (row-wise 2:4 of W, column-wise 2:4 of its "
               "backward copy)");
  if (rows == 0 || cols == 0) return;
  ESPLAG_CHECK(bwd_values && (kRefresh ? bwd_meta_out != nullptr : bwd_meta_in != nullptr) && values && meta, what,
               ": null buffer for the [", rows, ", ", cols, "] weight");
  ESPLAG_CHECK((reinterpret_cast<uintptr_t>(bwd_values) & 3u) == 0, what,
               ": the backward values need 4-byte alignment");
  const int64_t gx = (cols + kTile - 1) / kTile, gy = (rows + kTile - 1) / kTile;
  ESPLAG_CHECK(gx <= 0x7fffffff && gy <= 65535, what, ": [", rows, ", ", cols, "] does not fit one launch");
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  // 16-byte accesses where every row starts 16-byte aligned: W1 rows of (cols/2)·sizeof(V)
  // bytes, W2ᵀ rows of rows/2 bf16.
  const bool vec_load = detail::aligned16(values) && (cols / 2 * int64_t(sizeof(V))) % 16 == 0;
  const bool vec_store = detail::aligned16(bwd_values) && rows % 16 == 0;
  slope_backward_kernel<V, kRefresh><<<grid, kThreads, 0, stream>>>(bwd_values, bwd_meta_out, bwd_meta_in, values,
                                                                    meta, rows, cols, vec_load, vec_store);
  CUDA_CHECK_LAUNCH(what);
}

}  // namespace

void slope_backward_refresh(bf16* bwd_values, uint16_t* bwd_meta, const float* values, const uint16_t* meta,
                            int64_t rows, int64_t cols, cudaStream_t stream) {
  launch<float, true>("slope_backward_refresh", bwd_values, bwd_meta, nullptr, values, meta, rows, cols, stream);
}

void slope_backward_refresh(bf16* bwd_values, uint16_t* bwd_meta, const bf16* values, const uint16_t* meta,
                            int64_t rows, int64_t cols, cudaStream_t stream) {
  launch<bf16, true>("slope_backward_refresh", bwd_values, bwd_meta, nullptr, values, meta, rows, cols, stream);
}

void slope_backward_refill(bf16* bwd_values, const uint16_t* bwd_meta, const float* values, const uint16_t* meta,
                           int64_t rows, int64_t cols, cudaStream_t stream) {
  launch<float, false>("slope_backward_refill", bwd_values, nullptr, bwd_meta, values, meta, rows, cols, stream);
}

void slope_backward_refill(bf16* bwd_values, const uint16_t* bwd_meta, const bf16* values, const uint16_t* meta,
                           int64_t rows, int64_t cols, cudaStream_t stream) {
  launch<bf16, false>("slope_backward_refill", bwd_values, nullptr, bwd_meta, values, meta, rows, cols, stream);
}

}  // namespace esplag::gpu
