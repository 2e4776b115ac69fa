// Kernels of incremental generation on the GPU (namespace esplag::gpu): the per-position
// pieces that a KV-cached forward needs beyond ops/gpu.h, where every row of a call is one
// position of one sequence, at its own position, and attends over that sequence's cache.
//
// A call's rows are described by two device arrays: seq[r] (the sequence, i.e. the cache
// slot) and pos[r] (its position). A cache is one layer's keys or values,
// [batch][max_len][NKV·HD] bf16; row r's key/value lands at (seq[r], pos[r]) and its query
// sees positions 0..pos[r] of sequence seq[r] (causal). Layouts and conventions are those
// of ops/gpu.h and ops/gpu_attention.h (qkv rows [q (NH·HD) | k (NKV·HD) | v (NKV·HD)],
// query head h reads key/value head h / (NH/NKV)); bf16 in and out, fp32 arithmetic.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "ops/gpu_decode.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

// out[r, :] = wte[tokens[r], :] + (wpe ? wpe[pos[r], :] : 0), summed in fp32 and rounded
// once. A token outside [0, V) gives a row of NaN (callers check ids on the host first).
void embedding_rows(bf16* out, const int32_t* tokens, const int32_t* pos, const bf16* wte, const bf16* wpe, int N,
                    int C, int V, cudaStream_t stream);

// Rotary position embedding (rope_forward's rotate-half, angles in fp64) of every q and k
// head of row r at position pos[r], in place on qkv [N, (NH + 2·NKV)·HD].
void rope_rows(bf16* qkv, const int32_t* pos, int N, int NH, int NKV, int HD, double theta, cudaStream_t stream);

// The k and v parts of every row of qkv into the caches at (seq[r], pos[r]).
void store_kv_rows(bf16* k_cache, bf16* v_cache, const bf16* qkv, const int32_t* seq, const int32_t* pos, int N,
                   int NH, int NKV, int HD, int max_len, cudaStream_t stream);

// Split-K ("flash decoding") attention of every row's queries over its sequence's cache:
// out [N, NH·HD] = softmax(q·kᵀ / sqrt(HD)) v over positions 0..pos[r]. The positions are
// cut into splits of kDecodeSplit; one block per (split, head, row) keeps an online
// softmax in fp32 per warp, the warps and then the splits are merged by their maxima. The
// grid depends on (N, NH, max_len) only, not on the positions (which are read on the
// device), so a captured graph stays valid as the sequences grow. Splits past pos[r] do no
// work. Deterministic: every sum has an order fixed by the sizes. HD <= 256.
constexpr int kDecodeSplit = 128;
size_t decode_attention_workspace_bytes(int N, int NH, int HD, int max_len);
void decode_attention(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache, const int32_t* seq,
                      const int32_t* pos, int N, int NH, int NKV, int HD, int max_len, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

// out[i, :] = in[rows[i], :] for i < A (C columns each).
void gather_rows(bf16* out, const bf16* in, const int32_t* rows, int A, int C, cudaStream_t stream);

}  // namespace esplag::gpu
