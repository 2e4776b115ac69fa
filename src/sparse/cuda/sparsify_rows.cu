// The row-wise 2:4 kernels: activations (the 2 largest |x| of every group of 4) and the
// MVUE 2:4 of a gradient (sparse/mvue.h, the same per-group function as the CPU). One
// thread per metadata word, i.e. 16 consecutive values (4 groups) of a row: it reads them
// as two 16-byte loads (8-byte loads per group where the row length or the pointers do not
// allow 16 bytes; the last word of a row may hold fewer groups), and writes 32 bytes of pruned values, 16 bytes of compressed values and one
// metadata word; consecutive threads cover consecutive words, so every access is coalesced.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "sparse/cuda/sparsify.h"
#include "sparse/cuda/sparsify_device.h"
#include "sparse/mvue.h"

namespace esplag::gpu {

namespace {

using namespace sparsify_detail;

constexpr int kRowThreads = 256;

enum class RowRule { top2, mvue };

struct RowArgs {
  const uint16_t* in = nullptr;
  int64_t rows = 0, cols = 0;
  Sparse24Out o;
  uint64_t seed = 0;
  bool vec16 = false;     // cols % 8 == 0 and the input and dense 16-byte aligned: whole words move as 16 bytes
  bool values16 = false;  // cols % 16 == 0 and values 16-byte aligned: a word's 8 stored values as 16 bytes
};

template <RowRule Rule>
__global__ void __launch_bounds__(kRowThreads) row_sparsify_kernel(RowArgs p) {
  const int64_t groups = p.cols / 4, words = (groups + 3) / 4;
  const int64_t idx = int64_t(blockIdx.x) * kRowThreads + threadIdx.x;
  if (idx >= p.rows * words) return;
  const int64_t row = idx / words, word = idx % words, g0 = 4 * word;
  const int ng = groups - g0 < 4 ? static_cast<int>(groups - g0) : 4;
  const bool full16 = p.vec16 && ng == 4;
  const int64_t base = row * p.cols + 4 * g0;

  uint32_t v[16];
  if (full16) {
    const uint4 x0 = *reinterpret_cast<const uint4*>(p.in + base);
    const uint4 x1 = *reinterpret_cast<const uint4*>(p.in + base + 8);
    const uint32_t w[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) v[2 * k] = w[k] & 0xffffu, v[2 * k + 1] = w[k] >> 16;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint2 x = make_uint2(0u, 0u);
      if (k < ng) x = *reinterpret_cast<const uint2*>(p.in + base + 4 * k);
      v[4 * k] = x.x & 0xffffu, v[4 * k + 1] = x.x >> 16, v[4 * k + 2] = x.y & 0xffffu, v[4 * k + 3] = x.y >> 16;
    }
  }

  uint32_t out[16], pair[4], meta = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t* vk = v + 4 * k;
    uint32_t keep;
    if constexpr (Rule == RowRule::top2) {
      keep = top2_of4(magnitude_key(vk[0]), magnitude_key(vk[1]), magnitude_key(vk[2]), magnitude_key(vk[3]));
#pragma unroll
      for (int i = 0; i < 4; ++i) out[4 * k + i] = (keep >> i & 1u) ? vk[i] : 0u;
    } else {
      const float a[4] = {__uint_as_float(vk[0] << 16), __uint_as_float(vk[1] << 16), __uint_as_float(vk[2] << 16),
                          __uint_as_float(vk[3] << 16)};
      const uint64_t group = static_cast<uint64_t>(row * groups + g0 + k);
      const sparse_detail::Mvue24Group g =
          sparse_detail::mvue_24_group(a, sparse_detail::mvue_uniform24(p.seed, group));
      keep = g.keep;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        out[4 * k + i] = !(keep >> i & 1u) ? 0u
                         : g.scaled       ? static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(g.out[i])))
                                          : vk[i];
    }
    const uint32_t nib = slot_nibble(keep);
    pair[k] = slot_values(out[4 * k] | out[4 * k + 1] << 16, out[4 * k + 2] | out[4 * k + 3] << 16, nib);
    if (k < ng) meta |= nib << (4 * k);
  }

  if (p.o.dense) {
    uint16_t* d = reinterpret_cast<uint16_t*>(p.o.dense) + base;
    if (full16) {
      *reinterpret_cast<uint4*>(d) = make_uint4(out[0] | out[1] << 16, out[2] | out[3] << 16, out[4] | out[5] << 16,
                                                out[6] | out[7] << 16);
      *reinterpret_cast<uint4*>(d + 8) = make_uint4(out[8] | out[9] << 16, out[10] | out[11] << 16,
                                                    out[12] | out[13] << 16, out[14] | out[15] << 16);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (k < ng)
          *reinterpret_cast<uint2*>(d + 4 * k) =
              make_uint2(out[4 * k] | out[4 * k + 1] << 16, out[4 * k + 2] | out[4 * k + 3] << 16);
    }
  }
  if (p.o.values) {
    uint16_t* d = reinterpret_cast<uint16_t*>(p.o.values) + row * (p.cols / 2) + 2 * g0;
    if (p.values16) {
      *reinterpret_cast<uint4*>(d) = make_uint4(pair[0], pair[1], pair[2], pair[3]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (k < ng) *reinterpret_cast<uint32_t*>(d + 2 * k) = pair[k];
    }
  }
  if (p.o.meta) p.o.meta[row * words + word] = static_cast<uint16_t>(meta);
}

template <RowRule Rule>
void launch_rows(const char* fn, const bf16* in, int64_t rows, int64_t cols, const Sparse24Out& o, uint64_t seed,
                 cudaStream_t stream) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && cols % 4 == 0, fn, ": tensor [", rows, ", ", cols,
               "]: need rows >= 0 and cols a multiple of 4 (groups of 4 along a row)");
  check_input(fn, in, rows, cols);
  check_out(fn, "out", o);
  if (rows == 0 || cols == 0) return;
  RowArgs p;
  p.in = reinterpret_cast<const uint16_t*>(in);
  p.rows = rows;
  p.cols = cols;
  p.o = o;
  p.seed = seed;
  p.vec16 = cols % 8 == 0 && aligned_to(in, 16) && aligned_to(o.dense, 16);
  p.values16 = cols % 16 == 0 && aligned_to(o.values, 16);
  const int64_t threads = rows * ((cols / 4 + 3) / 4);
  const int64_t blocks = (threads + kRowThreads - 1) / kRowThreads;
  ESPLAG_CHECK(blocks <= 0x7fffffff, fn, ": tensor [", rows, ", ", cols, "] is too large for one launch");
  row_sparsify_kernel<Rule><<<unsigned(blocks), kRowThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH(fn);
}

}  // namespace

void activation_24_rows(const bf16* x, int64_t N, int64_t C, const Sparse24Out& out, cudaStream_t stream) {
  launch_rows<RowRule::top2>("gpu::activation_24_rows", x, N, C, out, 0, stream);
}

void mvue_24(const bf16* g, int64_t rows, int64_t cols, uint64_t seed, const Sparse24Out& out, cudaStream_t stream) {
  launch_rows<RowRule::mvue>("gpu::mvue_24", g, rows, cols, out, seed, stream);
}

}  // namespace esplag::gpu
