// Sparse AdamW on the kept values of a 2:4 weight, fused with the gather of the kept
// gradient entries from the dense dW, and the kept gradient's squared norm.
//
// One thread handles one group of 4 columns: one 16-byte (fp32) or 8-byte (bf16) load of
// dW, the group's metadata nibble, an 8-byte load each of master, m and v; it writes master,
// m, v, the two bf16 values and, when wanted, the group's 4 dense bf16 entries. A block
// covers kGroupsPerThread strided rounds of kThreads groups, so a warp's accesses are
// contiguous and each thread has several groups' loads in flight before it computes. Per
// kept value it moves 2·sizeof(dW) + 24 + 2 bytes (+ 4 with the dense copy) against 30 per
// dense element for the dense AdamW: the dW read is dense because 2 of 4 neighbouring
// values share a 32-byte sector anyway.
//
// The step's scalars (lr, bias corrections, clip factor) may come from device memory; one
// thread per block derives them (the bias corrections in fp64: 1 - β2^t loses digits in
// fp32) while the block's loads are in flight, and shares them through shared memory.
#include <cmath>

#include "core/error.h"
#include "ops/cuda/adamw_math.cuh"
#include "ops/cuda/common.cuh"
#include "sparse/cuda/sparse_adamw.h"

namespace esplag::gpu {

namespace {

using detail::to_bf;

constexpr int kThreads = 256;
constexpr int kGroupsPerThread = 2;
constexpr int64_t kGroupsPerBlock = int64_t(kThreads) * kGroupsPerThread;
constexpr int kMinBlocks = 4;  // caps registers at 64 so that 1024 threads per SM keep loads in flight

struct Hyper {
  float lr, beta1, beta2, eps, wd, grad_scale, max_norm;
  int64_t step;
  const float* lr_dev;
  const int64_t* step_dev;
  const float* norm_sq;
};

// The 4 gradient entries of one group as floats.
__device__ __forceinline__ float4 load_group(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load_group(const bf16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ float pick(const float4& g, uint32_t i) {
  return i == 0 ? g.x : (i == 1 ? g.y : (i == 2 ? g.z : g.w));
}

__device__ __forceinline__ uint32_t group_nibble(const uint16_t* meta, int64_t q, int64_t groups_per_row,
                                                 int64_t meta_stride) {
  const int64_t r = q / groups_per_row, k = q - r * groups_per_row;
  return (static_cast<uint32_t>(meta[r * meta_stride + k / 4]) >> (4 * (k & 3))) & 0xFu;
}

// The step's scalars, shared by the block: lr, 1/(1-β1^t), 1/(1-β2^t), gradient scale.
__device__ __forceinline__ void derive_scalars(const Hyper& h, float* s) {
  const float lr = h.lr_dev ? *h.lr_dev : h.lr;
  const int64_t t = h.step_dev ? *h.step_dev : h.step;
  float scale = h.grad_scale;
  if (h.norm_sq && h.max_norm > 0.f) scale *= detail::clip_factor(*h.norm_sq, h.max_norm);  // clip_scale
  float ibc1 = __int_as_float(0x7fffffff), ibc2 = ibc1;  // NaN for a step below 1
  if (t >= 1) {
    ibc1 = static_cast<float>(1.0 / (1.0 - pow(static_cast<double>(h.beta1), static_cast<double>(t))));
    ibc2 = static_cast<float>(1.0 / (1.0 - pow(static_cast<double>(h.beta2), static_cast<double>(t))));
  }
  s[0] = lr;
  s[1] = ibc1;
  s[2] = ibc2;
  s[3] = scale;
}

// The same per-element arithmetic as gpu::adamw_update.
__device__ __forceinline__ void adam_one(float& p, float& m, float& v, float g, const Hyper& h, float lr, float ibc1,
                                         float ibc2) {
  detail::adamw_element(p, m, v, g, lr, h.beta1, h.beta2, h.eps, ibc1, ibc2, h.wd);
}

template <typename G, bool kDense>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    sparse_adamw_kernel(float* __restrict__ master, float* __restrict__ mom1, float* __restrict__ mom2,
                        const G* __restrict__ grad, const uint16_t* __restrict__ meta, bf16* __restrict__ values,
                        bf16* __restrict__ dense, int64_t groups, int64_t groups_per_row, int64_t meta_stride,
                        Hyper h) {
  __shared__ float scalars[4];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock + threadIdx.x;
  float4 g[kGroupsPerThread];
  float2 p[kGroupsPerThread], m[kGroupsPerThread], v[kGroupsPerThread];
  uint32_t nib[kGroupsPerThread];
#pragma unroll
  for (int k = 0; k < kGroupsPerThread; ++k) {
    const int64_t q = first + int64_t(k) * kThreads;
    if (q >= groups) continue;
    nib[k] = group_nibble(meta, q, groups_per_row, meta_stride);
    g[k] = load_group(grad + 4 * q);
    p[k] = *reinterpret_cast<const float2*>(master + 2 * q);
    m[k] = *reinterpret_cast<const float2*>(mom1 + 2 * q);
    v[k] = *reinterpret_cast<const float2*>(mom2 + 2 * q);
  }
  if (threadIdx.x == 0) derive_scalars(h, scalars);
  __syncthreads();
  const float lr = scalars[0], ibc1 = scalars[1], ibc2 = scalars[2], scale = scalars[3];
#pragma unroll
  for (int k = 0; k < kGroupsPerThread; ++k) {
    const int64_t q = first + int64_t(k) * kThreads;
    if (q >= groups) continue;
    const uint32_t i0 = nib[k] & 3u, i1 = nib[k] >> 2;
    adam_one(p[k].x, m[k].x, v[k].x, pick(g[k], i0) * scale, h, lr, ibc1, ibc2);
    adam_one(p[k].y, m[k].y, v[k].y, pick(g[k], i1) * scale, h, lr, ibc1, ibc2);
    *reinterpret_cast<float2*>(master + 2 * q) = p[k];
    *reinterpret_cast<float2*>(mom1 + 2 * q) = m[k];
    *reinterpret_cast<float2*>(mom2 + 2 * q) = v[k];
    const bf16 b0 = to_bf(p[k].x), b1 = to_bf(p[k].y);
    *reinterpret_cast<__nv_bfloat162*>(values + 2 * q) = __halves2bfloat162(b0, b1);
    if constexpr (kDense) {
      // Selects instead of an indexed local array, which would live in local memory.
      const uint32_t r0 = __bfloat16_as_ushort(b0), r1 = __bfloat16_as_ushort(b1);
      auto at = [&](uint32_t i) -> uint32_t { return i == i0 ? r0 : (i == i1 ? r1 : 0u); };  // 0: +0 in bf16
      uint2 u;
      u.x = at(0) | (at(1) << 16);
      u.y = at(2) | (at(3) << 16);
      *reinterpret_cast<uint2*>(dense + 4 * q) = u;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Squared norm of the kept gradient

constexpr int kNormBlocks = 1024;  // upper bound on the partials
constexpr int64_t kNormMinGroupsPerBlock = int64_t(kThreads) * 8;

int norm_blocks(int64_t groups) {
  const int64_t b = (groups + kNormMinGroupsPerBlock - 1) / kNormMinGroupsPerBlock;
  return static_cast<int>(b < 1 ? 1 : (b > kNormBlocks ? kNormBlocks : b));
}

template <typename G>
__global__ void __launch_bounds__(kThreads)
    kept_squares_partial_kernel(float* partial, const G* __restrict__ grad, const uint16_t* __restrict__ meta,
                                int64_t groups, int64_t groups_per_row, int64_t meta_stride, int64_t per_block) {
  __shared__ float scratch[32];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t end = min(groups, start + per_block);
  // Two groups per round so that two loads are in flight per thread; the order of the
  // additions is still fixed by the sizes alone.
  float acc = 0.f;
  for (int64_t q = start + threadIdx.x; q < end; q += 2 * kThreads) {
    const int64_t q2 = q + kThreads;
    const bool second = q2 < end;
    const uint32_t nib = group_nibble(meta, q, groups_per_row, meta_stride);
    const uint32_t nib2 = second ? group_nibble(meta, q2, groups_per_row, meta_stride) : 0u;
    const float4 g = load_group(grad + 4 * q);
    const float4 g2 = second ? load_group(grad + 4 * q2) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float a = pick(g, nib & 3u), b = pick(g, nib >> 2);
    acc += a * a;
    acc += b * b;
    if (second) {
      const float c = pick(g2, nib2 & 3u), d = pick(g2, nib2 >> 2);
      acc += c * c;
      acc += d * d;
    }
  }
  acc = detail::block_sum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads) add_partials_kernel(float* norm_sq, const float* partial, int count) {
  __shared__ double sh[kThreads];
  const double sum = detail::sum_partials_fp64<kThreads>(partial, count, sh);
  if (threadIdx.x == 0) *norm_sq = static_cast<float>(static_cast<double>(*norm_sq) + sum);
}

// ---------------------------------------------------------------------------------------
// Host side

bool aligned_to(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

void check_shape(const char* what, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && cols % 4 == 0, what, ": a 2:4 weight of shape [", rows, ", ", cols,
               "] needs cols % 4 == 0 (groups of 4 along cols, the reduction dimension)");
}

template <typename G>
void update(float* master, float* m, float* v, const G* dweight, const uint16_t* meta, int64_t rows, int64_t cols,
            bf16* values_bf16, bf16* dense_bf16, const SparseAdamWConfig& cfg, cudaStream_t stream) {
  constexpr const char* what = "sparse_adamw_update";
  check_shape(what, rows, cols);
  if (!cfg.step_device)
    ESPLAG_CHECK(cfg.step >= 1, what, ": step is 1-based (the bias corrections divide by 1 - beta^step), got ",
                 cfg.step);
  ESPLAG_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1 && cfg.beta2 >= 0 && cfg.beta2 < 1, what,
               ": betas must lie in [0, 1), got beta1=", cfg.beta1, ", beta2=", cfg.beta2);
  ESPLAG_CHECK((cfg.lr_device || cfg.lr >= 0) && cfg.eps >= 0 && cfg.weight_decay >= 0, what,
               ": lr, eps and weight_decay must be >= 0, got lr=", cfg.lr, ", eps=", cfg.eps,
               ", weight_decay=", cfg.weight_decay);
  ESPLAG_CHECK(std::isfinite(cfg.grad_scale), what, ": grad_scale is ", cfg.grad_scale);
  const int64_t groups = rows * (cols / 4);
  if (groups == 0) return;
  ESPLAG_CHECK(master && m && v && dweight && meta && values_bf16, what, ": null buffer for the [", rows, ", ", cols,
               "] weight (master, m, v, dweight, meta and values_bf16 are required; dense_bf16 is optional)");
  ESPLAG_CHECK(aligned_to(dweight, 4 * sizeof(G)) && aligned_to(master, 8) && aligned_to(m, 8) && aligned_to(v, 8) &&
                   aligned_to(values_bf16, 4) && (!dense_bf16 || aligned_to(dense_bf16, 8)),
               what, ": misaligned buffer (dweight needs ", 4 * sizeof(G),
               " bytes, master / m / v 8, values_bf16 4, dense_bf16 8)");
  const int64_t blocks = (groups + kGroupsPerBlock - 1) / kGroupsPerBlock;
  ESPLAG_CHECK(blocks <= 0x7fffffff, what, ": ", groups, " groups do not fit one launch");
  Hyper h{};
  h.lr = cfg.lr;
  h.beta1 = cfg.beta1;
  h.beta2 = cfg.beta2;
  h.eps = cfg.eps;
  h.wd = cfg.weight_decay;
  h.grad_scale = cfg.grad_scale;
  h.max_norm = cfg.max_grad_norm;
  h.step = cfg.step;
  h.lr_dev = cfg.lr_device;
  h.step_dev = cfg.step_device;
  h.norm_sq = cfg.clip_norm_sq;
  const int64_t stride = (cols / 4 + 3) / 4;
  if (dense_bf16)
    sparse_adamw_kernel<G, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        master, m, v, dweight, meta, values_bf16, dense_bf16, groups, cols / 4, stride, h);
  else
    sparse_adamw_kernel<G, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        master, m, v, dweight, meta, values_bf16, nullptr, groups, cols / 4, stride, h);
  CUDA_CHECK_LAUNCH(what);
}

template <typename G>
void norm_add(float* norm_sq, const G* dweight, const uint16_t* meta, int64_t rows, int64_t cols, void* scratch,
              cudaStream_t stream) {
  constexpr const char* what = "sparse_grad_norm_squared_add";
  check_shape(what, rows, cols);
  const int64_t groups = rows * (cols / 4);
  if (groups == 0) return;  // adds nothing
  ESPLAG_CHECK(norm_sq && dweight && meta && scratch, what, ": null accumulator, gradient, metadata or scratch");
  ESPLAG_CHECK(aligned_to(dweight, 4 * sizeof(G)) && aligned_to(scratch, alignof(float)), what,
               ": misaligned gradient (needs ", 4 * sizeof(G), " bytes) or scratch");
  const int blocks = norm_blocks(groups);
  const int64_t per_block = (groups + blocks - 1) / blocks;
  float* partial = static_cast<float*>(scratch);
  kept_squares_partial_kernel<G><<<blocks, kThreads, 0, stream>>>(partial, dweight, meta, groups, cols / 4,
                                                                  (cols / 4 + 3) / 4, per_block);
  CUDA_CHECK_LAUNCH("sparse_grad_norm_squared_add (partials)");
  add_partials_kernel<<<1, kThreads, 0, stream>>>(norm_sq, partial, blocks);
  CUDA_CHECK_LAUNCH("sparse_grad_norm_squared_add (total)");
}

}  // namespace

void sparse_adamw_update(float* master, float* m, float* v, const float* dweight, const uint16_t* meta, int64_t rows,
                         int64_t cols, bf16* values_bf16, bf16* dense_bf16, const SparseAdamWConfig& cfg,
                         cudaStream_t stream) {
  update(master, m, v, dweight, meta, rows, cols, values_bf16, dense_bf16, cfg, stream);
}

void sparse_adamw_update(float* master, float* m, float* v, const bf16* dweight, const uint16_t* meta, int64_t rows,
                         int64_t cols, bf16* values_bf16, bf16* dense_bf16, const SparseAdamWConfig& cfg,
                         cudaStream_t stream) {
  update(master, m, v, dweight, meta, rows, cols, values_bf16, dense_bf16, cfg, stream);
}

size_t sparse_grad_norm_scratch_bytes() { return kNormBlocks * sizeof(float); }

void sparse_grad_norm_squared_add(float* norm_sq, const float* dweight, const uint16_t* meta, int64_t rows,
                                  int64_t cols, void* scratch, cudaStream_t stream) {
  norm_add(norm_sq, dweight, meta, rows, cols, scratch, stream);
}

void sparse_grad_norm_squared_add(float* norm_sq, const bf16* dweight, const uint16_t* meta, int64_t rows,
                                  int64_t cols, void* scratch, cudaStream_t stream) {
  norm_add(norm_sq, dweight, meta, rows, cols, scratch, stream);
}

}  // namespace esplag::gpu
