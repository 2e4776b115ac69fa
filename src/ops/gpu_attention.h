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
// Paths: HD ∈ {32, 64, 128} with 16-byte aligned buffers run tiled tensor-core kernels
// (mma.sync m16n8k16, bf16 operands, fp32 accumulators; the probabilities are rounded
// to bf16 before they multiply V, as in every flash-attention kernel); any other head
// size up to kAttentionMaxHeadDim runs a generic warp-per-row kernel in fp32.
//
// Deterministic: no atomics. Backward runs two kernels, one owning dK and dV per
// (batch, kv head, key block) and looping over the group's query heads and the query
// blocks in a fixed order, one owning dQ per (batch, head, query block) and looping over
// key blocks; every sum has an order fixed by the sizes.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "ops/gpu_attention.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

constexpr int kAttentionMaxHeadDim = 256;

enum class AttentionPath {
  automatic,  // tensor cores where the head size and alignment allow, generic otherwise
  generic,    // always the generic fp32 kernels (tests compare the two)
};

// True when `automatic` would use the tensor-core kernels for this head size (given
// 16-byte aligned buffers).
bool attention_tensor_core_head_dim(int HD);

// out [B, T, NH·HD] (overwritten); lse [B, NH, T] fp32 (overwritten): the natural-log
// log-sum-exp of each query row's scaled scores, which backward needs. Throws Error for
// impossible shapes (NH % NKV != 0, HD > kAttentionMaxHeadDim, ...).
void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HD,
                       cudaStream_t stream, AttentionPath path = AttentionPath::automatic);

// Scratch for attention_backward (one fp32 per query row: Σ_d dout · out).
size_t attention_backward_scratch_bytes(int B, int T, int NH);

// dqkv [B, T, (NH + 2·NKV)·HD] is OVERWRITTEN with the gradient w.r.t. qkv (every element
// is written: q, k and v parts), unlike the CPU reference which adds into it; the model
// feeds it straight into the QKV projection's backward. qkv, out and lse are the
// forward's (out as stored, in bf16). dqkv must not alias the inputs.
void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B,
                        int T, int NH, int NKV, int HD, void* scratch, size_t scratch_bytes, cudaStream_t stream,
                        AttentionPath path = AttentionPath::automatic);

}  // namespace esplag::gpu
