// Causal grouped-query attention on the GPU (the CUDA counterpart of
// cpu::attention_forward / attention_backward in ops/attention.h), flash-attention style:
// the [T, T] probabilities are never stored. Forward keeps an online softmax per query
// row and saves only the row's log-sum-exp; backward recomputes the scores from q, k
// and that log-sum-exp.
//
// Layouts are the CPU ones: qkv [B, T, (NH + 2·NKV)·HD] with per token
// [q (NH·HD) | k (NKV·HD) | v (NKV·HD)], query head h reads key/value head h / (NH/NKV),
// out [B, T, NH·HD]; scores are q·k / sqrt(HD), position t sees positions 0..t.
// bf16 in and out, every product and sum in fp32.
//
// Paths (AttentionPath):
// - native: our kernels. HD ∈ {32, 64, 128} with 16-byte aligned buffers run tiled
//   tensor-core kernels (mma.sync m16n8k16, bf16 operands, fp32 accumulators; the
//   probabilities are rounded to bf16 before they multiply V, as in every flash-attention
//   kernel); any other head size up to kAttentionMaxHeadDim runs a generic warp-per-row
//   kernel in fp32. Deterministic: no atomics. Backward runs two kernels, one owning dK
//   and dV per (batch, kv head, key block) and looping over the group's query heads and
//   the query blocks in a fixed order, one owning dQ per (batch, head, query block) and
//   looping over key blocks; every sum has an order fixed by the sizes.
// - generic: always our generic fp32 kernels (tests compare the two).
// - cudnn: cuDNN's fused SDPA (graph API through the cuDNN frontend,
//   ops/cuda/attention_cudnn.cu), libcudnn.so.9 opened at run time. Q, K, V, dQ, dK, dV
//   are strided views into qkv / dqkv (no copies), GQA is native. The backward runs
//   cuDNN's deterministic algorithm (bitwise reproducible; it needs a workspace of
//   B·NH·T·T bf16, rounded up to tiles). Throws Error when cuDNN cannot run the call.
// - cudnn_nondeterministic: cuDNN with its default backward, which accumulates dQ with
//   fp32 atomics: faster, less workspace, but the last bits vary between runs. Never
//   chosen by `automatic`; for measurements.
// - automatic: cudnn where cuDNN loads, HD is a multiple of 8 up to 256, cuDNN builds
//   both graphs for the shape, the buffers are 16-byte aligned and the workspace passed
//   is large enough (attention_workspace_bytes); native otherwise. A shape cuDNN was
//   expected to run but could not (library missing, graph unsupported, workspace too
//   small, execution failed) falls back with a warning on stderr, once per reason.
//
// Both paths save the same log-sum-exp (natural log of Σ exp(scaled score), fp32,
// [B, NH, T]), so a backward may consume the lse of either forward; automatic resolves
// forward and backward of one shape the same way unless the backward's extra buffers
// (dout, dqkv, workspace) rule cuDNN out, and the tests check both crossings.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "ops/gpu_attention.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

constexpr int kAttentionMaxHeadDim = 256;

enum class AttentionPath {
  automatic,               // cudnn when it can run the call, native otherwise (see above)
  generic,                 // always our generic fp32 kernels (tests compare the two)
  native,                  // our kernels: tensor cores where HD and alignment allow, else generic
  cudnn,                   // cuDNN fused SDPA, deterministic backward; Error if it cannot run
  cudnn_nondeterministic,  // cuDNN fused SDPA, atomic (faster, not reproducible) backward
};

const char* attention_path_name(AttentionPath path);

// Whether libcudnn.so.9 could be opened and, either way, a line saying which version or
// why not. The environment variable ESPLAG_CUDNN_LIBRARY names the file to open (when it
// is not on the loader's path) or, set to "off", turns cuDNN off for the process.
bool attention_cudnn_available();
std::string attention_cudnn_status();

// The path a call with 16-byte aligned buffers and attention_workspace_bytes of workspace
// runs: native, generic or one of the cudnn ones (builds and caches the cuDNN graphs of
// the shape when a cudnn path is asked for or considered). Throws Error for impossible
// shapes, and for the cudnn paths when cuDNN cannot run the shape (saying why).
AttentionPath attention_resolve_path(int B, int T, int NH, int NKV, int HD,
                                     AttentionPath path = AttentionPath::automatic);

// Bytes of workspace that let forward and backward of this shape run on `path` as
// resolved above: at least attention_backward_scratch_bytes, plus whatever cuDNN's plans
// need. Pass it to the workspace overload of attention_forward and to attention_backward.
size_t attention_workspace_bytes(int B, int T, int NH, int NKV, int HD,
                                 AttentionPath path = AttentionPath::automatic);

// True when our kernels (`native`, and `automatic` when it does not take cuDNN) use the
// tensor-core kernels for this head size (given 16-byte aligned buffers).
bool attention_tensor_core_head_dim(int HD);

// out [B, T, NH·HD] (overwritten); lse [B, NH, T] fp32 (overwritten): the natural-log
// log-sum-exp of each query row's scaled scores, which backward needs. Throws Error for
// impossible shapes (NH % NKV != 0, HD > kAttentionMaxHeadDim, ...).
void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HD,
                       cudaStream_t stream, AttentionPath path = AttentionPath::automatic);
// The same with a workspace (attention_workspace_bytes); without one (the overload above)
// the cudnn path runs only if its forward plan needs none.
void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HD, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream, AttentionPath path = AttentionPath::automatic);

// Scratch our backward needs (one fp32 per query row: Σ_d dout · out); the least
// attention_backward accepts. The cudnn path needs attention_workspace_bytes.
size_t attention_backward_scratch_bytes(int B, int T, int NH);

// dqkv [B, T, (NH + 2·NKV)·HD] is OVERWRITTEN with the gradient w.r.t. qkv (every element
// is written: q, k and v parts), unlike the CPU reference which adds into it; the model
// feeds it straight into the QKV projection's backward. qkv, out and lse are the
// forward's (out as stored, in bf16). dqkv must not alias the inputs. `scratch` is also
// the cudnn path's workspace.
void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B,
                        int T, int NH, int NKV, int HD, void* scratch, size_t scratch_bytes, cudaStream_t stream,
                        AttentionPath path = AttentionPath::automatic);

namespace detail {

// The cuDNN side (ops/cuda/attention_cudnn.cu), reached from the dispatch in
// ops/cuda/attention.cu. Graphs are built once per (device, B, T, NH, NKV, HD[,
// deterministic]) and cached with their workspace sizes.

// Empty when cuDNN runs this shape (forward and the chosen backward), else why not.
// Fills the plans' workspace sizes when it returns empty.
std::string cudnn_attention_support(int B, int T, int NH, int NKV, int HD, bool deterministic, size_t* fwd_workspace,
                                    size_t* bwd_workspace);

// Run the cached plans; throw Error on failure (the caller decides whether to fall back).
void cudnn_attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HD,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);
void cudnn_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B,
                              int T, int NH, int NKV, int HD, bool deterministic, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);

}  // namespace detail

}  // namespace esplag::gpu
