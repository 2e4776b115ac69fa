// FP8 on the GPU (docs/fp8.md, "GPU kernels"): the casts that make fp8 operands from bf16
// tensors with the scaling rule of core/fp8.h, and cuBLASLt's fp8 GEMM. Namespace
// esplag::gpu, conventions of ops/gpu.h (asynchronous launchers on a stream, device
// pointers, deterministic results).
//
// Casts (ops/cuda/fp8_cast.cu). A code is fp8_encode(float(x) · s) of core/fp8.h, bit for
// bit: x · s rounded to fp32, then to the nearest code (ties to even, subnormals exact),
// saturating to ±max (infinities too); NaN gives NaN with x's sign (0x7F / 0xFF). The
// scale s = fp8_scale(amax) is computed on the device from an amax in device memory, so
// nothing waits for the host. Every cast also writes 1 / s (the inverse scale: what the
// GEMM's scale pointer multiplies the codes by) and, when `saturated` is not null, adds
// the number of values it clipped (an infinity, or a finite x · s that rounds past max) to
// that device counter. Codes are bytes (uint8_t): e4m3 (OCP E4M3FN) or e5m2.
//
// GEMM (ops/cuda/gemm_fp8.cu): Fp8Gemm, below.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "ops/gpu_fp8.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/fp8.h"
#include "ops/gpu_pending_scale.h"

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

// *amax (fp32) = the largest finite |x[i]| of the n values, 0 when there is none (core's
// fp8_amax). Exact, so the same whatever the reduction order.
void fp8_amax(float* amax, const bf16* x, int64_t n, cudaStream_t stream);

// Where a cast takes its scale: `scale_from`, the device amax that s = fp8_scale(amax) is
// made from (from fp8_amax, or another rule: delayed scaling's history, values above it then
// saturating); and `record`, null or a device float that the cast raises to the largest
// finite |x| it casts (exact, as fp8_amax: delayed scaling's amax of the step), so that no
// pass of its own reads x for it. Made from a bare `const float*` where nothing is recorded.
struct Fp8CastAmax {
  Fp8CastAmax(const float* scale_from, float* record = nullptr) : scale_from(scale_from), record(record) {}
  const float* scale_from;
  float* record;
};

// out[i] = the code of x[i] with the scale s = fp8_scale(*amax.scale_from, format);
// *inv_scale = 1 / s. out: n bytes.
void fp8_cast(uint8_t* out, float* inv_scale, const bf16* x, int64_t n, Fp8CastAmax amax, Fp8Format format,
              uint64_t* saturated, cudaStream_t stream);

// The same cast written transposed: x [rows, cols] row-major gives out [cols, rows]
// row-major, out[c·rows + r] = code(x[r·cols + c]), with one scale for the tensor (amax of
// x, e.g. from fp8_amax). The backward's fp8 GEMMs take their operands K-major (see
// Fp8Gemm), so they need these transposed copies of W, dY and X. One pass over 128 x 64
// tiles, 16-byte accesses on both sides where the sizes and pointers allow (rows a
// multiple of 16 and out 16-byte aligned; cols a multiple of 8 and x 16-byte aligned).
void fp8_cast_transpose(uint8_t* out, float* inv_scale, const bf16* x, int64_t rows, int64_t cols, Fp8CastAmax amax,
                        Fp8Format format, uint64_t* saturated, cudaStream_t stream);

// Both at once, reading x once: out [rows, cols] as fp8_cast writes it and out_t
// [cols, rows] as fp8_cast_transpose does (for a tensor whose products take it in both
// orientations: dY for dX and dW, W for the forward and dX). Each clipped value is counted
// once. 2 bytes read and 2 written per value, where the two casts move 6.
void fp8_cast_both(uint8_t* out, uint8_t* out_t, float* inv_scale, const bf16* x, int64_t rows, int64_t cols,
                   Fp8CastAmax amax, Fp8Format format, uint64_t* saturated, cudaStream_t stream);

// Where a producer writes an operand's fp8 codes itself instead of the bf16 values that a
// cast would read: as it lies [rows, cols] and transposed [cols, rows] (as fp8_cast_both
// writes them), with the scale that `amax` gives (its inverse into *inv_scale) and the
// saturated values counted into *saturated (may be null).
struct Fp8Target {
  uint8_t* out;
  uint8_t* out_t;
  float* inv_scale;
  Fp8CastAmax amax;
  Fp8Format format;
  uint64_t* saturated;
};

// SwiGLU's output [N, H] (fused_swiglu_forward's from inp [N, 2H] = [gate | up] and its
// pending scale, the same bf16 values) as fp8 codes only: into act.out [N, H] as fp8_cast
// would write them (act.out_t null, act.format e4m3). The forward's producer of the next
// layer's X with delayed scaling (DeviceLinear::fp8_input_target). Needs H % 8 == 0 and inp
// 16-byte aligned.
void fp8_swiglu_forward(const Fp8Target& act, const bf16* inp, PendingScale inp_scale, int64_t N, int H,
                        cudaStream_t stream);

// SwiGLU's backward as fp8 codes only, from one read of inp [N, 2H] = [gate | up] and
// dout [N, H], each with its pending scale (ops/cuda/fp8_swiglu.cu): its input gradient
// [N, 2H] (fused_swiglu_backward's dinp, the same bf16 values) into `grad` as fp8_cast_both
// would write it, and its output [N, H] recomputed (fused_swiglu_forward's values) into
// act.out_t [H, N] as fp8_cast_transpose would (act.out null, act.format e4m3). The producer
// of an fc layer's output gradient and of the next layer's Xᵀ with delayed scaling
// (DeviceLinear::fp8_grad_target, fp8_input_t_target). Needs H % 8 == 0 and inp, dout
// 16-byte aligned.
void fp8_swiglu_backward(const Fp8Target& grad, const Fp8Target& act, const bf16* inp, PendingScale inp_scale,
                         const bf16* dout, PendingScale dout_scale, int64_t N, int H, cudaStream_t stream);

// A norm's forward (layernorm_forward, rmsnorm_forward: the same residual add into
// residual_out, statistics and bf16 values) with its output [N, C] as fp8 codes only, into
// to.out as fp8_cast would write them (to.out_t null, to.format e4m3; b's pending scale as
// there). The forward's producer of a layer's X with delayed scaling (DeviceLinear::
// fp8_input_target), where the output is not kept. Needs C % 8 == 0, the bf16 buffers
// 16-byte aligned, to.out 8-byte.
void fp8_layernorm_forward(const Fp8Target& to, float* mean, float* rstd, bf16* residual_out, const bf16* a,
                           const bf16* b, const bf16* weight, const bf16* bias, int N, int C, cudaStream_t stream,
                           float eps = 1e-5f, PendingScale b_scale = {});
void fp8_rmsnorm_forward(const Fp8Target& to, float* rstd, bf16* residual_out, const bf16* a, const bf16* b,
                         const bf16* weight, int N, int C, cudaStream_t stream, float eps = 1e-5f,
                         PendingScale b_scale = {});

// A norm's output [N, C] recomputed from its saved input x and statistics (layernorm_forward's
// or rmsnorm_forward's values: the same bf16 values from the same x, weight, bias, mean and
// rstd; mean null for RMSNorm) as fp8 codes only, into to.out [N, C] and/or to.out_t [C, N]
// as the casts would write them (ops/cuda/fp8_norm.cu). The backward's producer of a layer's
// Xᵀ with delayed scaling (DeviceLinear::fp8_input_t_target), where the output is not kept.
// Needs C % 8 == 0 and x, weight, bias 16-byte aligned.
void fp8_norm_recompute(const Fp8Target& to, const bf16* x, const bf16* weight, const bf16* bias, const float* mean,
                        const float* rstd, int64_t N, int C, cudaStream_t stream);

// Delayed scaling's step end (model/fp8_amax_history.h) for `count` amax histories of
// `length` past steps each, history i at histories + i · (length + 2): [this step's amax,
// the amax the casts scale by, the past steps' amaxes newest first]. Each takes its step's
// amax as the newest past one (the oldest leaves), scales by the largest past one from
// now on, and starts the next step at 0.
void fp8_roll_amax_histories(float* histories, int64_t count, int length, cudaStream_t stream);

// One scale per row of x [rows, cols] (core's fp8_quantize_dequantize_rows): each row's
// amax (written to row_amax [rows] when not null), its scale, and the cast of the row, in
// one kernel. out [rows, cols]; inv_scale [rows].
void fp8_cast_rows(uint8_t* out, float* inv_scale, float* row_amax, const bf16* x, int64_t rows, int64_t cols,
                   Fp8Format format, uint64_t* saturated, cudaStream_t stream);

// One operand of an fp8 GEMM: codes row-major [rows, K] (K contiguous), and the device
// fp32 that multiplies them back to values (the cast's inv_scale).
struct Fp8Operand {
  const uint8_t* data = nullptr;
  const float* inv_scale = nullptr;
  Fp8Format format = Fp8Format::e4m3;
};

// cuBLASLt's fp8 GEMM (compute capability 8.9 or newer), fp32 accumulation:
//
//   D [M, N] (=, or += when accumulate) (*A.inv_scale · *B.inv_scale) · A [M, K] · B [N, K]ᵀ  (+ bias [N])
//
// Every matrix row-major. Both operands are K-major ("TN", the only layout Hopper's fp8
// GEMMs take), so each product of a Linear W [OC, C] names its operands:
//   forward  Y  [N, OC] = X [N, C] · W [OC, C]ᵀ       A = X,   B = W
//   backward dX [N, C]  = dY [N, OC] · (Wᵀ [C, OC])ᵀ  A = dY,  B = Wᵀ  (transposed cast of W)
//   backward dW [OC, C] = dYᵀ [OC, N] · (Xᵀ [C, N])ᵀ  A = dYᵀ, B = Xᵀ  (transposed casts of dY, X)
// The bias (bf16 output only) is added per column, in fp32 before the output's rounding.
// Formats: e4m3 or e5m2 for either operand, not both e5m2 (cuBLASLt has no such product).
// Requirements, each refused with an Error naming it: M, N, K multiples of 16 (M may be
// 0: nothing to do), every pointer 16-byte aligned (the inverse scales' too: cuBLASLt's
// fp8 kernels refused 4-byte aligned ones on H100), no bias together with accumulate
// (cuBLASLt's fp8 kernels then round an intermediate sum to bf16, see docs/fp8.md; no
// product of a Linear needs both). A call cuBLASLt refuses throws an Error naming the
// problem, the algorithm and cuBLASLt's status.
//
// Accumulation: cuBLASLt's fast fp8 accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM) keeps
// the partial sums in the tensor cores' reduced-precision accumulator; it is off by
// default, so partial sums are promoted to fp32 (the accurate mode, which fp8 training
// recipes use at least for the gradient products); set_fast_accum(true) turns it on.
//
// A plan (descriptor, layouts, the heuristic's first algorithm) is built at the first
// call of a (shape, formats, output type, bias, fast accumulation, alignment of the bias)
// combination and cached; calls are then asynchronous. Results are
// reproducible for a given GPU model and cuBLASLt version, as those of gpu::Gemm.
class Fp8Gemm {
 public:
  // `workspace` (device memory the caller owns and keeps for the Gemm's life; may be
  // shared with other work on the same stream) of `workspace_bytes`; 32 MiB is cuBLAS's
  // advice for Hopper (gpu::Gemm::kDefaultWorkspaceBytes).
  Fp8Gemm(void* workspace, size_t workspace_bytes);
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  // bf16 output, with an optional bf16 bias [N] (null: none).
  void matmul(bf16* D, const Fp8Operand& A, const Fp8Operand& B, const bf16* bias, int M, int N, int K,
              bool accumulate, cudaStream_t stream);
  // fp32 output (e.g. a weight gradient accumulated over micro-batches), no bias.
  void matmul(float* D, const Fp8Operand& A, const Fp8Operand& B, int M, int N, int K, bool accumulate,
              cudaStream_t stream);

  void set_fast_accum(bool on) { fast_accum_ = on; }
  bool fast_accum() const { return fast_accum_; }
  size_t cached_plans() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  bool fast_accum_ = false;
};

}  // namespace esplag::gpu
