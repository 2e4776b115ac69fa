// Causal multi-head self-attention with grouped-query heads, and rotary embeddings.
//
// Layout: the fused QKV projection gives per token [q (NH*HD) | k (NKV*HD) | v (NKV*HD)],
// qkv: [B, T, (NH + 2*NKV) * HD]. Query head h reads key/value head h / (NH / NKV).
// NH must be a multiple of NKV (NKV == NH is plain multi-head attention).
#pragma once

namespace esplag::cpu {

// Scores are q·k / sqrt(HD), masked so that position t sees positions 0..t.
// out: [B, T, NH*HD]; att: [B, NH, T, T] softmax probabilities saved for backward
// (entries above the diagonal are written as 0). Throws Error unless NH % NKV == 0.
template <typename T>
void attention_forward(T* out, T* att, const T* qkv, int B, int Tlen, int NH, int NKV, int HD);

// dqkv += gradient w.r.t. qkv, given the forward's qkv and att.
template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* att, int B, int Tlen, int NH, int NKV,
                        int HD);

// Rotary position embedding (LLaMA / GPT-NeoX "rotate half" convention), applied in place
// to the q and k parts of qkv; v is untouched. Pair i of a head is (x[i], x[i + HD/2]),
// rotated by angle t * theta^(-2i/HD), where row j of every sequence is at position
// t = pos0 + j (position 0 is left unchanged). pos0 > 0 continues sequences whose first
// pos0 positions were rotated before (incremental generation). HD must be even.
template <typename T>
void rope_forward(T* qkv, int B, int Tlen, int NH, int NKV, int HD, double theta, int pos0 = 0);
// Backward of the rotation is the inverse rotation, applied in place to dqkv: unlike
// the other backwards it does not accumulate, it turns the gradient w.r.t. the rotated
// q and k into the gradient w.r.t. the unrotated ones (v's gradient passes unchanged).
template <typename T>
void rope_backward(T* dqkv, int B, int Tlen, int NH, int NKV, int HD, double theta);

}  // namespace esplag::cpu
