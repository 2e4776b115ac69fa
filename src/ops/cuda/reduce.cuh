// Deterministic column reductions over the rows of an [N, C] bf16 matrix: the bias
// gradient (Σ_n dout) and the LayerNorm / RMSNorm weight and bias gradients.
//
// Two passes, no atomics: pass 1 splits the rows into G chunks (G depends on N and the
// scratch size only) and writes one fp32 partial row per chunk; pass 2 has one thread per
// column add the G partials in chunk order into the fp32 gradient. The summation order
// of every element is therefore fixed, whatever the GPU or the launch timing.
#pragma once
#include <cstdint>
#include "ops/cuda/common.cuh"

namespace esplag::gpu::detail {

enum class ColumnMode { bias, layernorm, rmsnorm };

// Scratch (in floats) with which column_reduce uses its full chunk count; with less it
// uses fewer chunks (still deterministic for a given scratch size), with none one pass.
size_t column_reduce_scratch_floats(int64_t N, int C, int outputs);

// dw (and, for LayerNorm, db) += the column reductions of dout [N, C]; either may be null.
//   bias:      dw += Σ_n dout
//   layernorm: dw += Σ_n dout · (inp - mean) · rstd,  db += Σ_n dout
//   rmsnorm:   dw += Σ_n dout · inp · rstd
void column_reduce(ColumnMode mode, float* dw, float* db, const bf16* dout, const bf16* inp, const float* mean,
                   const float* rstd, int64_t N, int C, float* scratch, size_t scratch_floats, cudaStream_t stream);

}  // namespace esplag::gpu::detail
