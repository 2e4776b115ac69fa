// Multi-tensor AdamW and the global gradient norm.
//
// AdamW: every parameter segment is cut into chunks of at most kChunk elements that never
// straddle segments; one block updates one chunk, so one launch covers the whole model
// and each block knows its segment's decay flag from a small device table. Per element
// it reads master, m, v, grad (16 bytes) and writes master, m, v and the bf16 weight
// (14 bytes), with 16-byte accesses when the chunk is aligned.
//
// Global norm: G blocks (G a function of n only) sum the squares of contiguous ranges in
// a fixed order, then one block adds the G partials in order in fp64. No atomics, so
// the result is bit-identical run to run and GPU to GPU.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/device_arena.h"
#include "core/error.h"
#include "ops/cuda/adamw_math.cuh"
#include "ops/cuda/common.cuh"
#include "ops/gpu.h"

namespace esplag::gpu {

namespace {

using detail::to_bf;

constexpr int kThreads = 256;
constexpr int64_t kChunk = int64_t(kThreads) * 4 * 16;  // 16 float4 per thread

struct Chunk {
  int64_t offset;
  int32_t n;
  int32_t decay;
};

struct Hyper {
  float lr, beta1, beta2, eps, wd, inv_bc1, inv_bc2, grad_scale, max_norm;
  const float* norm_sq;
};

__device__ __forceinline__ void adam_one(float& p, float& m, float& v, float g, const Hyper& h, float wd) {
  detail::adamw_element(p, m, v, g, h.lr, h.beta1, h.beta2, h.eps, h.inv_bc1, h.inv_bc2, wd);
}

__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const Chunk* chunks, float* master, float* mom1, float* mom2, const float* grad, bf16* weight,
                 Hyper h) {
  const Chunk ch = chunks[blockIdx.x];
  float scale = h.grad_scale;
  if (h.norm_sq && h.max_norm > 0.f) scale *= detail::clip_factor(*h.norm_sq, h.max_norm);
  const float wd = ch.decay ? h.wd : 0.f;
  float* p = master + ch.offset;
  float* m = mom1 + ch.offset;
  float* v = mom2 + ch.offset;
  const float* g = grad + ch.offset;
  bf16* w = weight ? weight + ch.offset : nullptr;
  // Vector path when every buffer is 16-byte aligned at this chunk (the bf16 copy needs
  // only 8) and the chunk is whole float4s.
  const bool vec = (ch.n % 4 == 0) && detail::aligned16(p) && detail::aligned16(m) && detail::aligned16(v) &&
                   detail::aligned16(g) && (!w || (reinterpret_cast<uintptr_t>(w) & 7u) == 0);
  if (vec) {
    for (int i = threadIdx.x * 4; i < ch.n; i += kThreads * 4) {
      float4 pp = *reinterpret_cast<float4*>(p + i);
      float4 mm = *reinterpret_cast<float4*>(m + i);
      float4 vv = *reinterpret_cast<float4*>(v + i);
      const float4 gg = *reinterpret_cast<const float4*>(g + i);
      adam_one(pp.x, mm.x, vv.x, gg.x * scale, h, wd);
      adam_one(pp.y, mm.y, vv.y, gg.y * scale, h, wd);
      adam_one(pp.z, mm.z, vv.z, gg.z * scale, h, wd);
      adam_one(pp.w, mm.w, vv.w, gg.w * scale, h, wd);
      *reinterpret_cast<float4*>(p + i) = pp;
      *reinterpret_cast<float4*>(m + i) = mm;
      *reinterpret_cast<float4*>(v + i) = vv;
      if (w) {
        __nv_bfloat162 lo = __floats2bfloat162_rn(pp.x, pp.y), hi = __floats2bfloat162_rn(pp.z, pp.w);
        uint2 u;
        u.x = *reinterpret_cast<uint32_t*>(&lo);
        u.y = *reinterpret_cast<uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(w + i) = u;
      }
    }
  } else {
    for (int i = threadIdx.x; i < ch.n; i += kThreads) {
      float pp = p[i], mm = m[i], vv = v[i];
      adam_one(pp, mm, vv, g[i] * scale, h, wd);
      p[i] = pp;
      m[i] = mm;
      v[i] = vv;
      if (w) w[i] = to_bf(pp);
    }
  }
}

constexpr int kNormBlocks = 1024;  // upper bound on the partials
constexpr int64_t kNormMinPerBlock = int64_t(kThreads) * 16;

int norm_blocks(int64_t n) {
  const int64_t g = (n + kNormMinPerBlock - 1) / kNormMinPerBlock;
  return static_cast<int>(g < 1 ? 1 : (g > kNormBlocks ? kNormBlocks : g));
}

__global__ void __launch_bounds__(kThreads)
    sum_squares_partial_kernel(float* partial, const float* x, int64_t n, int64_t per_block) {
  __shared__ float scratch[32];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t end = min(n, start + per_block);
  float acc = 0.f;
  for (int64_t i = start + threadIdx.x; i < end; i += kThreads) acc += x[i] * x[i];
  acc = detail::block_sum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads) sum_partials_kernel(float* out, const float* partial, int G) {
  __shared__ double sh[kThreads];
  const double sum = detail::sum_partials_fp64<kThreads>(partial, G, sh);
  if (threadIdx.x == 0) *out = static_cast<float>(sum);
}

}  // namespace

AdamWPlan::AdamWPlan(const std::vector<ParamSegment>& segments, DeviceArena& arena) {
  std::vector<Chunk> table;
  for (size_t i = 0; i < segments.size(); ++i) {
    const ParamSegment& s = segments[i];
    ESPLAG_CHECK(s.offset >= 0 && s.numel >= 0, "AdamWPlan: segment ", i, " has offset ", s.offset, " and numel ",
                 s.numel);
    ESPLAG_CHECK(s.amax_slot < 0, "AdamWPlan: segment ", i, " asks for its amax (adamw_update_split only)");
    for (int64_t o = 0; o < s.numel; o += kChunk)
      table.push_back(Chunk{s.offset + o, static_cast<int32_t>(std::min(kChunk, s.numel - o)), s.decay ? 1 : 0});
    total_ = std::max(total_, s.offset + s.numel);
  }
  num_chunks_ = static_cast<int64_t>(table.size());
  ESPLAG_CHECK(num_chunks_ <= 0x7fffffff, "AdamWPlan: ", num_chunks_, " chunks do not fit one launch");
  if (table.empty()) return;
  void* d = arena.allocate("adamw.chunks", table.size() * sizeof(Chunk), alignof(Chunk) < 16 ? 16 : alignof(Chunk));
  CUDA_CHECK(cudaMemcpy(d, table.data(), table.size() * sizeof(Chunk), cudaMemcpyHostToDevice));
  table_ = d;
}

void adamw_update(const AdamWPlan& plan, float* master, float* m, float* v, const float* grad, bf16* weight,
                  const AdamWConfig& cfg, cudaStream_t stream) {
  ESPLAG_CHECK(cfg.step >= 1, "adamw_update: step is 1-based (the bias corrections divide by 1 - beta^step), got ",
               cfg.step);
  ESPLAG_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1 && cfg.beta2 >= 0 && cfg.beta2 < 1,
               "adamw_update: betas must lie in [0, 1), got beta1=", cfg.beta1, ", beta2=", cfg.beta2);
  ESPLAG_CHECK(cfg.lr >= 0 && cfg.eps >= 0 && cfg.weight_decay >= 0,
               "adamw_update: lr, eps and weight_decay must be >= 0, got lr=", cfg.lr, ", eps=", cfg.eps,
               ", weight_decay=", cfg.weight_decay);
  ESPLAG_CHECK(std::isfinite(cfg.grad_scale), "adamw_update: grad_scale is ", cfg.grad_scale);
  if (plan.num_chunks() == 0) return;
  ESPLAG_CHECK(master && m && v && grad, "adamw_update: null parameter, moment or gradient buffer");
  Hyper h{};
  h.lr = cfg.lr;
  h.beta1 = cfg.beta1;
  h.beta2 = cfg.beta2;
  h.eps = cfg.eps;
  h.wd = cfg.weight_decay;
  // Bias corrections in fp64 on the host: 1 - β^t loses digits in fp32 for β2 near 1.
  h.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(double(cfg.beta1), double(cfg.step))));
  h.inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(double(cfg.beta2), double(cfg.step))));
  h.grad_scale = cfg.grad_scale;
  h.max_norm = cfg.max_grad_norm;
  h.norm_sq = cfg.clip_norm_sq;
  adamw_kernel<<<static_cast<unsigned>(plan.num_chunks()), kThreads, 0, stream>>>(
      static_cast<const Chunk*>(plan.device_table()), master, m, v, grad, weight, h);
  CUDA_CHECK_LAUNCH("adamw_update");
}

size_t global_norm_scratch_bytes() { return kNormBlocks * sizeof(float); }

void global_norm_squared(float* out, const float* x, int64_t n, void* scratch, cudaStream_t stream) {
  ESPLAG_CHECK(n >= 0, "global_norm_squared: negative element count ", n);
  ESPLAG_CHECK(out && scratch && (x || n == 0), "global_norm_squared: null output, scratch or input");
  const int G = norm_blocks(n);
  const int64_t per_block = (n + G - 1) / G;
  float* partial = static_cast<float*>(scratch);
  if (n > 0) {
    sum_squares_partial_kernel<<<G, kThreads, 0, stream>>>(partial, x, n, per_block);
    CUDA_CHECK_LAUNCH("global_norm_squared (partials)");
  }
  sum_partials_kernel<<<1, kThreads, 0, stream>>>(out, partial, n > 0 ? G : 0);
  CUDA_CHECK_LAUNCH("global_norm_squared (total)");
}

}  // namespace esplag::gpu
