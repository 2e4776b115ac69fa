// SLoPe's optimizer side on the GPU (model/linear_slope.h is the CPU reference): sparse
// AdamW on the kept values of a static 2:4 weight, the kept gradient's share of the
// global gradient norm, and the double-pruned backward copy.
//
// The weight W [rows = out, cols = in] is stored in the compressed 2:4 form of
// sparse/compressed.h: kept values [rows, cols/2] (fp32 master, and the bf16 copy the
// forward GEMM reads) and metadata [rows, ceil(cols/16)] u16, one nibble per group of 4
// columns (bits 0-1 first kept index, bits 2-3 second). Every slot of the forward weight is
// a kept value (the forward mask keeps exactly 2 of every 4), so every slot is trained.
// Moments m, v exist for the kept values only ([rows, cols/2] fp32).
//
// Per step, on one stream (all launches asynchronous, no host synchronisation):
//   1. dW [rows, cols] dense, from the dW GEMM (fp32 or bf16)
//   2. sparse_grad_norm_squared_add(norm_sq, dW, meta, ...)   for every sparse layer,
//      after the dense parameters' gpu::global_norm_squared wrote norm_sq
//   3. sparse_adamw_update(..., cfg with clip_norm_sq = norm_sq)   gathers the kept
//      gradients, clips, updates master / m / v, writes the bf16 values (and optionally
//      the pruned dense bf16 W) in one pass
//   4. slope_backward_refill(...)  the backward copy's values from the new W1, or, every
//      mask_change_freq steps, slope_backward_refresh(...) (new backward mask as well)
//
// Arithmetic is fp32 (as gpu::adamw_update); the masks are bit-identical to the CPU's.
// Deterministic: no floating-point atomics, every sum has a fixed order that depends on
// the sizes only. Pointers are device pointers; shapes that the 2:4 layout cannot hold,
// null buffers and misaligned buffers throw esplag::Error naming the call.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "sparse/cuda/sparse_adamw.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

// Hyper-parameters of one sparse AdamW step. lr and step can live in device memory, so
// that a captured CUDA graph replays the update with the schedule's current values; the
// host fields are used when the device pointers are null.
struct SparseAdamWConfig {
  float lr = 0;
  const float* lr_device = nullptr;      // device fp32, read by the kernel when not null
  int64_t step = 1;                      // 1-based, for the bias corrections
  const int64_t* step_device = nullptr;  // device int64, read by the kernel when not null;
                                         // a value below 1 makes the update NaN (a kernel
                                         // cannot throw; the loss then reports it)
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0;  // decoupled (PyTorch's AdamW); 0 for a layer without decay
  float grad_scale = 1.f;  // gradients are multiplied by this (e.g. 1 / accumulation steps)
  // Global-norm clipping without a host round trip: when clip_norm_sq (device fp32, the
  // squared norm of all gradients) is given and max_grad_norm > 0, gradients are also
  // multiplied by min(1, max_grad_norm / (sqrt(*clip_norm_sq) + 1e-6)) (cpu::clip_scale).
  const float* clip_norm_sq = nullptr;
  float max_grad_norm = 0;
};

// One fused pass over a 2:4 weight of [rows, cols] (cols % 4 == 0):
//   g = dweight[r, 4k + idx_j] · scale     for the 2 kept slots j of every group k
//   m = β1 m + (1-β1) g;  v = β2 v + (1-β2) g²
//   master -= lr · (m̂ / (√v̂ + eps) + weight_decay · master)   (cpu::adamw_step, in fp32)
//   values_bf16 = bf16(master)                   [rows, cols/2], the forward GEMM's operand
//   dense_bf16[r, c] = bf16(master) at kept c, 0 elsewhere   [rows, cols]; may be null
// Pruned entries of dweight are never read into the result. master, m, v are updated in
// place. Alignment: dweight 16 bytes (fp32) or 8 (bf16), master / m / v 8, values_bf16 4,
// dense_bf16 8 (what cudaMalloc and DeviceArena give; offsets into flat buffers keep it
// when every earlier tensor has cols % 4 == 0).
void sparse_adamw_update(float* master, float* m, float* v, const float* dweight, const uint16_t* meta,
                         int64_t rows, int64_t cols, bf16* values_bf16, bf16* dense_bf16,
                         const SparseAdamWConfig& cfg, cudaStream_t stream);
void sparse_adamw_update(float* master, float* m, float* v, const bf16* dweight, const uint16_t* meta,
                         int64_t rows, int64_t cols, bf16* values_bf16, bf16* dense_bf16,
                         const SparseAdamWConfig& cfg, cudaStream_t stream);

// *norm_sq (device fp32) += Σ dweight² over the kept positions (the gradient of the kept
// values, as the CPU trainer's norm over the `.values` parameter; unscaled). Deterministic:
// a fixed number of blocks (a function of the size) each sum a contiguous range of groups
// in a fixed order, then one block adds the partials in order in fp64 and adds the total
// to *norm_sq, rounding once. `scratch` holds sparse_grad_norm_scratch_bytes().
size_t sparse_grad_norm_scratch_bytes();
void sparse_grad_norm_squared_add(float* norm_sq, const float* dweight, const uint16_t* meta, int64_t rows,
                                  int64_t cols, void* scratch, cudaStream_t stream);
void sparse_grad_norm_squared_add(float* norm_sq, const bf16* dweight, const uint16_t* meta, int64_t rows,
                                  int64_t cols, void* scratch, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// The double-pruned backward copy (sparse/double_prune.h, SlopeLinear::refresh_backward_mask)
//
// dX [N, cols] = dY [N, rows] · W2 reduces over rows, so W2 must be 2:4 along rows. It is
// produced as W2ᵀ, row-major [cols, rows], compressed 2:4 along its own columns (W's rows):
// bwd_values [cols, rows/2] bf16 and bwd_meta [cols, ceil(rows/16)] u16 in the layout of
// sparse/compressed.h. That is the CPU's backward_weight() layout, and it makes dX the same
// x·Wᵀ form as the forward (x = dY, W = W2ᵀ) with the compressed operand 2:4 along its
// reduction dimension, row-major: the structured operand a 2:4 GEMM (mma.sp, cuSPARSELt)
// takes, so the backward-data GEMM reuses the forward's sparse GEMM unchanged. (The other
// choice, W2 [rows, cols], would put the 2:4 groups down the columns of a row-major
// matrix, which no sparse tensor-core operand layout reads.)
//
// refresh: the backward mask from the current W1 (values [rows, cols/2] + meta): in every
// column of W, of each group of 4 consecutive rows keep the 2 forward-kept values of
// largest |w| (ties: lower row; NaN ranks as +inf), fewer when fewer are forward-kept, the
// slots then padded with the lowest positions not kept (value 0), exactly as
// cpu::double_prune_backward_mask + compress_24_masked do. Ranking on the fp32 master
// values gives the CPU's SlopeLinear<float> masks bit for bit; the bf16 overload ranks the
// bf16 values (the CPU's on the same bf16-rounded numbers). rows % 4 == 0 and
// cols % 4 == 0. bwd_meta is fully overwritten (nibbles past the last group 0).
void slope_backward_refresh(bf16* bwd_values, uint16_t* bwd_meta, const float* values, const uint16_t* meta,
                            int64_t rows, int64_t cols, cudaStream_t stream);
void slope_backward_refresh(bf16* bwd_values, uint16_t* bwd_meta, const bf16* values, const uint16_t* meta,
                            int64_t rows, int64_t cols, cudaStream_t stream);

// refill: the backward copy's values for an unchanged backward mask (bwd_meta, as refresh
// wrote it) from the current W1, after every optimizer step (SlopeLinear::sync): each slot
// gets bf16(W1) at its position, 0 at padded slots (which lie outside the forward mask).
void slope_backward_refill(bf16* bwd_values, const uint16_t* bwd_meta, const float* values, const uint16_t* meta,
                           int64_t rows, int64_t cols, cudaStream_t stream);
void slope_backward_refill(bf16* bwd_values, const uint16_t* bwd_meta, const bf16* values, const uint16_t* meta,
                           int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace esplag::gpu
