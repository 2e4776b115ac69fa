// GPU launchers of the ops (namespace esplag::gpu), the CUDA counterparts of the CPU
// references in ops/*.h. Kernels live in ops/cuda/, one op family per file.
//
// Precision: activations, their gradients and the weights the forward pass reads are
// bf16 (__nv_bfloat16); parameter gradients, master weights and optimizer state are
// fp32; everything accumulates in fp32. Layouts are the CPU ones (row-major, N = B*T).
//
// Conventions, as on the CPU:
// - every launcher takes a cudaStream_t, is asynchronous, and checks its launch (a
//   launch failure throws esplag::Error; faults inside a kernel surface at the next
//   checked call);
// - *_forward overwrites its outputs; *_backward ADDS into parameter gradients (fp32)
//   and into the activation gradient where stated (`accumulate`), so a buffer fed by
//   several consumers just accumulates;
// - pointers are device pointers; any gradient output may be null when not wanted;
// - results are deterministic: no floating-point atomics, every sum has a fixed order
//   that depends on the sizes only (not on the GPU model or launch timing). cuBLASLt
//   GEMMs are reproducible for a given GPU model and library version.
// - scratch / workspace buffers come from the caller (normally a DeviceArena); their
//   sizes are given by the matching *_bytes function.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "ops/gpu.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops/gpu_pending_scale.h"

namespace esplag {
class DeviceArena;
}

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------------------------------
// Embedding (ops/embedding.h)

// out[b,t,:] = wte[tokens[b,t],:] + (wpe ? wpe[t,:] : 0).  out: [B*T, C], wte: [V, C],
// wpe: [T, C] or null. A token outside [0, V) gives a row of NaN (a kernel cannot throw;
// the NaN makes the loss non-finite, which the trainer reports).
void embedding_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                       int V, cudaStream_t stream);

// Workspace for embedding_backward (sort buffers and per-segment partial sums).
size_t embedding_backward_workspace_bytes(int B, int T, int C, int V);

// dwte[tokens[b,t],:] += dout[b,t,:];  dwpe[t,:] += Σ_b dout[b,t,:].  dwte: [V, C] and
// dwpe: [T, C] fp32, either may be null. Deterministic without atomics: positions are
// stably sorted by token (cub radix sort), the sorted list is cut into fixed segments,
// each segment sums its pieces in position order, and a run of one token that crosses
// segments is completed by the segment where it starts, adding the others' partials in
// segment order. Tokens outside [0, V) are skipped.
void embedding_backward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int B, int T, int C,
                        int V, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// LayerNorm / RMSNorm fused with the residual add (ops/norm.h; eps: ModelConfig::norm_eps)
//
// Forward: when b is not null, residual_out = a + b (rounded to bf16) and the norm is
// taken of residual_out; when b is null the norm is taken of a and residual_out is
// ignored. residual_out may alias a or b. mean / rstd ([N], fp32) are saved for backward
// (either may be null when backward will not run). b_scale: b's pending scale
// (ops/gpu_pending_scale.h: a 2:4 fp8 product's output), applied as b is read.

void layernorm_forward(bf16* out, float* mean, float* rstd, bf16* residual_out, const bf16* a, const bf16* b,
                       const bf16* weight, const bf16* bias, int N, int C, cudaStream_t stream, float eps = 1e-5f,
                       PendingScale b_scale = {});
void rmsnorm_forward(bf16* out, float* rstd, bf16* residual_out, const bf16* a, const bf16* b,
                     const bf16* weight, int N, int C, cudaStream_t stream, float eps = 1e-5f,
                     PendingScale b_scale = {});

// Scratch for the weight / bias gradients of the norm backwards.
size_t norm_backward_scratch_bytes(int N, int C);

// Backward: dinp += the gradient w.r.t. the norm's input (the residual stream, which is
// why it accumulates: the residual add passes its gradient through unchanged, so the
// residual-stream gradient buffer is dinp itself). inp is what forward normalised
// (residual_out, or a). dweight / dbias (fp32) +=, deterministic two-pass column sums.
// dinp may alias dout.
void layernorm_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, void* scratch,
                        size_t scratch_bytes, cudaStream_t stream);
void rmsnorm_backward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                      const float* rstd, int N, int C, void* scratch, size_t scratch_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Rotary position embedding (ops/attention.h): LLaMA / GPT-NeoX rotate-half, pair
// (i, i + HD/2) of every q and k head rotated by t · theta^(-2i/HD), in place on the
// fused qkv buffer [B, T, (NH + 2·NKV)·HD]; v untouched. Angles are computed in fp64. With
// a pending scale (ops/gpu_pending_scale.h), every value of qkv is scaled first, v's included.
void rope_forward(bf16* qkv, PendingScale qkv_scale, int B, int T, int NH, int NKV, int HD, double theta,
                  cudaStream_t stream);
// The inverse rotation, in place on dqkv.
void rope_backward(bf16* dqkv, int B, int T, int NH, int NKV, int HD, double theta, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Pointwise activations (ops/activation.h). Backward: accumulate = true adds into dinp
// (the CPU convention); accumulate = false overwrites it, and then dinp may alias dout
// (GELU and ReLU², in place), which saves a buffer and the zeroing.

void gelu_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream);  // tanh approximation
void gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n, bool accumulate, cudaStream_t stream);
// inp rows [gate (H) | up (H)]: out[n,h] = silu(gate) · up.  inp: [N, 2H], out: [N, H].
void swiglu_forward(bf16* out, const bf16* inp, int64_t N, int H, cudaStream_t stream);
void swiglu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t N, int H, bool accumulate,
                     cudaStream_t stream);
void relu2_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream);
void relu2_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n, bool accumulate,
                    cudaStream_t stream);
// out = a + b (out may alias a or b).
void residual_forward(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Fused softmax cross-entropy (ops/cross_entropy.h) over a chunk of N rows of logits.
// logits: [N, Vp] bf16 with row stride Vp >= V (columns [V, Vp) are padding, ignored).
// losses[n] (fp32) = logsumexp(logits[n, :V]) - logits[n, targets[n]].
// If write_dlogits, the logits are OVERWRITTEN in place with
// dloss · (softmax(logits[n]) - onehot(targets[n])) (padding columns set to 0), so the LM
// head can run chunk by chunk without ever storing full logits and probabilities.
// A target outside [0, V) gives a NaN loss (and NaN gradient row).
void softmax_cross_entropy(float* losses, bf16* logits, const int32_t* targets, int64_t N, int V, int Vp,
                           float dloss, bool write_dlogits, cudaStream_t stream);

// Distillation's loss (ops/distill.h's cpu::distill_cross_entropy) over a chunk of N rows:
// the student's logits and the teacher's, both [N, Vp] bf16 with row stride Vp (padding
// ignored). ce[n] and kl[n] as on the CPU, losses[n] = (1 - alpha)·ce[n] +
// alpha·temperature²·kl[n]; with write_dlogits the student's logits are OVERWRITTEN with
// dloss · d(losses[n])/d(logits[n]) (padding 0); the teacher's are read only. A target
// outside [0, V) gives NaN ce, loss and gradient row. alpha in [0, 1], temperature > 0, or Error.
void distill_cross_entropy(float* losses, float* ce, float* kl, bf16* logits, const bf16* teacher,
                           const int32_t* targets, int64_t N, int V, int Vp, double alpha, double temperature,
                           float dloss, bool write_dlogits, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Optimizer: AdamW over every parameter in one launch, and the global gradient norm.
//
// Parameters live in flat buffers (as the model keeps them): fp32 master weights, fp32
// first and second moments, fp32 gradients, and the bf16 copy the forward pass reads.
// A segment is one parameter tensor: its range in the flat buffers and whether weight
// decay applies to it.
struct ParamSegment {
  int64_t offset = 0;
  int64_t numel = 0;
  bool decay = false;
  // adamw_update_split only: where in its `amax` array the largest finite |x| of the
  // segment's updated bf16 values goes (-1: nowhere).
  int amax_slot = -1;
};

struct AdamWConfig {
  float lr = 0;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0;
  int64_t step = 1;        // 1-based, for the bias corrections
  float grad_scale = 1.f;  // gradients are multiplied by this (e.g. 1 / accumulation steps)
  // Global-norm clipping without a host round trip: when clip_norm_sq (device, fp32) is
  // given and max_grad_norm > 0, gradients are also multiplied by
  // min(1, max_grad_norm / (sqrt(*clip_norm_sq) + 1e-6)), as cpu::clip_scale.
  const float* clip_norm_sq = nullptr;
  float max_grad_norm = 0;
};

// The device-side table of a set of segments, cut into chunks that one block updates;
// built once (it allocates its table from the arena and uploads it synchronously).
class AdamWPlan {
 public:
  AdamWPlan(const std::vector<ParamSegment>& segments, DeviceArena& arena);
  int64_t num_chunks() const { return num_chunks_; }
  int64_t total_numel() const { return total_; }  // one past the highest offset + numel
  const void* device_table() const { return table_; }

 private:
  const void* table_ = nullptr;
  int64_t num_chunks_ = 0;
  int64_t total_ = 0;
};

// cpu::adamw_step (ops/adamw.h) for every segment, in fp32: g = grad · scale;
// m = β1 m + (1-β1) g; v = β2 v + (1-β2) g²; master -= lr · (m̂ / (√v̂ + eps) + wd · master)
// with wd = weight_decay if the segment decays, else 0 (decoupled decay, applied to the
// weight before the step); weight = bf16(master) in the same pass (weight may be null).
void adamw_update(const AdamWPlan& plan, float* master, float* m, float* v, const float* grad, bf16* weight,
                  const AdamWConfig& cfg, cudaStream_t stream);

// Σ x² over a flat fp32 buffer into *out (device, fp32), deterministic: a fixed number
// of blocks (a function of n) each sum a contiguous range in a fixed order, then one
// block adds the partials in order, in fp64.
size_t global_norm_scratch_bytes();
void global_norm_squared(float* out, const float* x, int64_t n, void* scratch, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Linear layers through cuBLASLt (ops/matmul.h): bf16 operands, fp32 accumulation.
// W is [OC, C] (nn.Linear layout), inp [N, C], out [N, OC].
//
// Matmul descriptors, layouts and the algorithm are cached per shape and operation; the
// workspace is allocated once from the arena. Fused epilogues (bias, GELU with its
// pre-activation saved, GELU gradient, bias gradient) are used where cuBLASLt offers
// them for the shape; otherwise separate kernels do the same work.
//
// Algorithm choice (autotuning, on by default): the first call of a shape asks the
// heuristic for up to kTuneCandidates algorithms, times each on the caller's stream (one
// warm-up and kTuneReps timed runs, median) and keeps the fastest unless it beats the
// heuristic's first pick by less than kTuneMinGain. The first call therefore
// synchronises the stream; later calls of the shape are asynchronous and use the same
// algorithm for the rest of the process (a choice is shared by every Gemm of the process
// with the same workspace size on the same device, so it is timed once). Tuning never
// writes a caller's buffer that the call would not write anyway: accumulating calls
// (beta = 1) and outputs that overlap an input are timed into a device buffer owned by
// the Gemm, grown (cudaMalloc) only when a shape needs more than it holds. A shape first
// seen while the stream is being captured into a CUDA graph runs the heuristic's first
// pick in that graph and is tuned at its first call outside a capture. With autotuning
// off every shape uses the heuristic's first pick (bitwise reproducible across
// processes; a tuned choice depends on timings). A plan built while autotuning is off
// keeps the first pick when it is switched on later.
void set_gemm_autotune(bool on);  // process-wide; initial value: ESPLAG_GEMM_AUTOTUNE (0/off/false: off)
bool gemm_autotune();

class Gemm {
 public:
  static constexpr size_t kDefaultWorkspaceBytes = size_t(32) << 20;  // cuBLAS's advice for Hopper
  static constexpr size_t kScratchBytes = size_t(4) << 20;           // bias-gradient partials
  static constexpr int kTuneCandidates = 8;
  static constexpr int kTuneReps = 3;
  static constexpr float kTuneMinGain = 0.02f;  // keeps the heuristic's pick within timing noise

  explicit Gemm(DeviceArena& arena, size_t workspace_bytes = kDefaultWorkspaceBytes);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  enum class Act { none, gelu };

  // out = act(inp · Wᵀ + bias). bias [OC] may be null. With Act::gelu and pre_gelu not
  // null, pre_gelu [N, OC] receives the pre-activation (for backward).
  void forward(bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C, int OC,
               cudaStream_t stream, Act act = Act::none, bf16* pre_gelu = nullptr);
  // fp32 output (e.g. logits kept in fp32), no bias or activation.
  void forward(float* out, const bf16* inp, const bf16* weight, int N, int C, int OC, cudaStream_t stream);
  // out [N, OC] (= or += when accumulate) inp [N, C] · Wᵀ, with rows ldo and ldi elements
  // apart (ldo >= OC, ldi >= C): for operands that are column ranges of wider matrices, e.g.
  // a product written into the extra columns of its own input's buffer. No bias or
  // activation.
  void forward_strided(bf16* out, int ldo, const bf16* inp, int ldi, const bf16* weight, int N, int C, int OC,
                       bool accumulate, cudaStream_t stream);

  // dinp (=, or += when accumulate) dout · W. With pre_gelu (the [N, C] pre-activation of
  // a GELU whose output fed this layer) the result is multiplied by gelu'(pre_gelu),
  // giving the gradient w.r.t. the pre-activation; that needs accumulate = false.
  void backward_input(bf16* dinp, const bf16* dout, const bf16* weight, int N, int C, int OC, bool accumulate,
                      cudaStream_t stream, const bf16* pre_gelu = nullptr);

  // dweight [OC, C] (fp32) += (or = when !accumulate) doutᵀ · inp;  dbias [OC] (fp32)
  // += Σ_n dout (always accumulates; may be null).
  void backward_weight(float* dweight, float* dbias, const bf16* dout, const bf16* inp, int N, int C, int OC,
                       bool accumulate, cudaStream_t stream);

  // Off: never use fused epilogues (for tests and for comparing timings).
  void set_use_epilogues(bool on) { use_epilogues_ = on; }
  size_t cached_plans() const;
  // How many calls fell back to separate kernels since construction.
  size_t epilogue_fallbacks() const { return fallbacks_; }

  // The algorithm of each cached plan that cuBLASLt supports (for tests and reports).
  struct PlanInfo {
    int m = 0, n = 0, k = 0;  // cuBLASLt's column-major problem (see gemm.cu)
    cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    bool f32_out = false;
    int candidates = 0;  // heuristic results considered (1 when not tuned)
    int chosen = 0;      // index of the algorithm in the heuristic's order; 0 = its first pick
    bool tuned = false;  // chosen by timing
    bool pending = false;  // autotuning on but not tuned yet (first seen inside a capture)
    float first_ms = 0, chosen_ms = 0;  // median times of the first pick and the chosen one, when tuned
    cublasLtMatmulAlgo_t algo{};
  };
  std::vector<PlanInfo> plans() const;
  // The tuning output buffer: its size, and freeing it (synchronises the device; not
  // while capturing). A later tuning that needs it allocates it again.
  size_t tuning_scratch_bytes() const;
  void release_tuning_scratch();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  bool use_epilogues_ = true;
  size_t fallbacks_ = 0;
};

}  // namespace esplag::gpu
