// Kernels of the fused dense training step on the GPU (namespace esplag::gpu): the
// pieces GpuTransformer (model/gpu_transformer.h) needs beyond the op launchers of
// ops/gpu.h, for a step that takes less memory and can be replayed as a CUDA graph.
//
// - Split master weights: the fp32 master copy kept as 16 extra bits beside the bf16
//   weights the GEMMs read, so the weights cost 4 bytes per parameter instead of 6, with
//   the fp32 values recovered exactly.
// - AdamW over split master weights whose per-step hyper-parameters (learning rate, bias
//   corrections) are read from device memory, so a captured graph stays valid from step
//   to step; it can also mirror one tensor into a second bf16 buffer (the padded LM head).
// - SwiGLU and ReLU² whose backward recomputes the activation output in the same pass,
//   bit-identical to the forward, so the output need not be kept for backward.
// - LayerNorm / RMSNorm backward in one pass over the rows that also sums the norm's
//   weight (and bias) gradient and, optionally, the bias gradient of the Linear layer
//   whose output gradient the norm's input gradient is; column sums (bias gradients)
//   without a GEMM epilogue; the sum of squares of a gradient buffer (for its norm).
//
// Conventions are those of ops/gpu.h: asynchronous launchers on a stream, launches
// checked, no allocation, deterministic results (no atomics).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "ops/gpu_fused.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops/gpu.h"
#include "ops/gpu_pending_scale.h"

namespace esplag::gpu {

// ---------------------------------------------------------------------------------------
// Split master weights
//
// An fp32 master weight with bit pattern u is stored as
//   hi = the upper 16 bits of u rounded to nearest, ties away from zero: the bf16 weight
//        the forward and backward GEMMs read;
//   lo = u − (hi << 16) as a signed 16-bit integer (always in [−2^15, 2^15), because ties
//        round away from zero), the bits the bf16 value lacks.
// u = (hi << 16) + lo (mod 2^32) recovers the fp32 value exactly, so the optimizer works
// on full fp32 master weights while memory holds 2 + 2 bytes per parameter instead of a
// 4-byte master plus a 2-byte bf16 copy. hi equals __float2bfloat16_rn(w) except at exact
// ties (the low 16 bits of w equal to 0x8000), where it is the neighbour away from zero.

inline uint16_t master_hi_bits(float w) {
  uint32_t u;
  std::memcpy(&u, &w, sizeof u);
  return static_cast<uint16_t>((u + 0x8000u) >> 16);
}
inline int16_t master_lo_bits(float w) {
  uint32_t u;
  std::memcpy(&u, &w, sizeof u);
  return static_cast<int16_t>(static_cast<int32_t>((u + 0x8000u) & 0xFFFFu) - 0x8000);
}
inline float master_join_bits(uint16_t hi, int16_t lo) {
  const uint32_t u = (static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(lo));
  float w;
  std::memcpy(&w, &u, sizeof w);
  return w;
}

// hi, lo [n] from fp32 w [n], and back.
void master_split(bf16* hi, int16_t* lo, const float* w, int64_t n, cudaStream_t stream);
void master_join(float* w, const bf16* hi, const int16_t* lo, int64_t n, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// AdamW over split master weights, hyper-parameters in device memory

// One step's hyper-parameters as the kernel reads them. make_adamw_step_params computes
// them on the host (the bias corrections in fp64, as cpu::adamw_step); write them with
// set_adamw_step_params before the update (or before replaying a graph that holds it).
struct AdamWStepParams {
  float lr = 0;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0;
  float inv_bias_correction1 = 1, inv_bias_correction2 = 1;  // 1 / (1 - beta^step)
  float grad_scale = 1;
  float max_grad_norm = 0;  // > 0: gradients also scaled by min(1, max / (sqrt(norm_sq) + 1e-6))
};

// Validates cfg (as adamw_update does) and fills the step's parameters. cfg.clip_norm_sq
// is ignored: the norm's device pointer is given to adamw_update_split.
AdamWStepParams make_adamw_step_params(const AdamWConfig& cfg);

// Writes p into device memory through a one-thread kernel: the values travel as launch
// arguments, so nothing on the host must outlive the call, and the write is ordered on
// the stream before whatever follows (a graph launch included).
void set_adamw_step_params(AdamWStepParams* device, const AdamWStepParams& p, cudaStream_t stream);

// The device-side chunk table of a set of segments (as AdamWPlan), built once: it
// allocates from the arena and uploads synchronously. `mirror_segment` (index into
// segments, or -1) names a tensor whose updated bf16 values are also written to the
// `mirror` buffer passed to adamw_update_split, at the same offsets within the tensor.
// Segments with an amax_slot have the amax of their updated bf16 values taken (below).
class SplitAdamWPlan {
 public:
  SplitAdamWPlan(const std::vector<ParamSegment>& segments, DeviceArena& arena, int mirror_segment = -1);
  int64_t num_chunks() const { return num_chunks_; }
  int64_t total_numel() const { return total_; }
  const void* device_table() const { return table_; }
  int64_t mirror_base() const { return mirror_base_; }  // flat offset of the mirrored segment
  int amax_slots() const { return amax_slots_; }  // 1 + the largest amax_slot of its segments
  // Upper bound of the table's bytes in the arena, for memory plans.
  static size_t table_bytes_bound(const std::vector<ParamSegment>& segments);

 private:
  const void* table_ = nullptr;
  int64_t num_chunks_ = 0;
  int64_t total_ = 0;
  int64_t mirror_base_ = 0;
  int amax_slots_ = 0;
};

// cpu::adamw_step for every segment on the split master weights (hi, lo), fp32 moments
// m, v and fp32 gradients, with the hyper-parameters read from `params` (device) and,
// when params->max_grad_norm > 0, the clipping factor from *norm_sq (device). The same
// arithmetic as adamw_update. hi is rewritten in the same pass, and mirror (when the plan
// has a mirror segment and mirror is not null) receives that segment's new hi values.
// amax [plan.amax_slots()] (needed when the plan has slots) receives in each slot the largest
// finite |x| of its segments' new hi values, as gpu::fp8_amax would take it (0 for none):
// the amax an fp8 weight cast needs, without a pass over the weights of its own.
void adamw_update_split(const SplitAdamWPlan& plan, bf16* hi, int16_t* lo, float* m, float* v, const float* grad,
                        const AdamWStepParams* params, const float* norm_sq, bf16* mirror, float* amax,
                        cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// MLP activations whose backward recomputes the forward output

// out [N, H] = silu(gate) · up with inp rows [gate (H) | up (H)] (as swiglu_forward), inp
// scaled by inp_scale as it is read (ops/gpu_pending_scale.h: a 2:4 fp8 product's output).
void fused_swiglu_forward(bf16* out, const bf16* inp, PendingScale inp_scale, int64_t N, int H, cudaStream_t stream);
// dinp [N, 2H] = the gradient w.r.t. [gate | up] (overwritten; may alias inp, which lets
// it replace the pre-activation it no longer needs), inp and dout scaled by their pending
// scales as they are read. When act is not null, act [N, H] receives silu(gate) · up,
// bit-identical to fused_swiglu_forward; act may alias dout.
void fused_swiglu_backward(bf16* dinp, bf16* act, const bf16* inp, PendingScale inp_scale, const bf16* dout,
                           PendingScale dout_scale, int64_t N, int H, cudaStream_t stream);

// out [n] = relu(inp)² (as relu2_forward).
void fused_relu2_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream);
// dinp = 2 relu(inp) · dout (overwritten; may alias inp); act (may be null, may alias
// dout) = relu(inp)², bit-identical to fused_relu2_forward.
void fused_relu2_backward(bf16* dinp, bf16* act, const bf16* inp, const bf16* dout, int64_t n, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Column sums, the fused norm backward, the sum of squares
//
// All deterministic without atomics: rows are cut into chunks of a fixed number of rows
// (so the chunks depend on N only), each chunk's partial sums go to scratch, and one
// thread per column adds the partials in chunk order.

// out[c] += Σ_n x[n, c] (fp32 sums of bf16 values): a Linear layer's bias gradient.
// x: [N, C] bf16. Vector loads when C % 8 == 0 and x is 16-byte aligned.
size_t column_sum_scratch_bytes(int64_t N, int C);
void column_sum_add(float* out, const bf16* x, int64_t N, int C, void* scratch, size_t scratch_bytes,
                    cudaStream_t stream);

// The norm backwards of ops/gpu.h (same arithmetic for dinp: dinp += d norm / d inp ·
// dout, dinp may not alias dout or inp here) with the parameter gradients summed in the
// same pass: LayerNorm dweight += Σ_n dout · (inp − mean) · rstd, dbias += Σ_n dout;
// RMSNorm dweight += Σ_n dout · inp · rstd. When dsum is not null, dsum[c] += Σ_n of the
// updated dinp (as stored, in bf16): the bias gradient of the Linear layer whose output
// gradient dinp is. Any of dweight, dbias, dsum may be null. dout is read with its pending
// scale (ops/gpu_pending_scale.h: a 2:4 fp8 product's output). Needs C % 8 == 0,
// C <= kFusedNormMaxC and 16-byte aligned rows (fused_norm_backward_supported); throws
// otherwise.
constexpr int kFusedNormMaxC = 2048;
bool fused_norm_backward_supported(int C);
size_t fused_norm_backward_scratch_bytes(int N, int C);
void fused_layernorm_backward(bf16* dinp, float* dweight, float* dbias, float* dsum, const bf16* dout,
                              PendingScale dout_scale, const bf16* inp, const bf16* weight, const float* mean,
                              const float* rstd, int N, int C, void* scratch, size_t scratch_bytes,
                              cudaStream_t stream);
void fused_rmsnorm_backward(bf16* dinp, float* dweight, float* dsum, const bf16* dout, PendingScale dout_scale,
                            const bf16* inp, const bf16* weight, const float* rstd, int N, int C, void* scratch,
                            size_t scratch_bytes, cudaStream_t stream);

// *out (fp32) = Σ x² over an fp32 buffer: fixed blocks over contiguous ranges summed with
// 16-byte loads, then the partials in order in fp64 (the same contract as
// global_norm_squared, another summation order).
size_t sum_squares_scratch_bytes();
void sum_squares(float* out, const float* x, int64_t n, void* scratch, cudaStream_t stream);

}  // namespace esplag::gpu
