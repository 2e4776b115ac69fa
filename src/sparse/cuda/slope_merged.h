// SLoPe's inference product with its low-rank adapter merged into the 2:4 GEMM: the GPU
// counterpart of SlopeLinear::merged_forward (model/linear_slope.h),
//
//   Y [N, out] = X · W1ᵀ + b + (X · Rᵀ) · Lᵀ        W1 [out, in] 2:4 along rows,
//                                                   L [out, r], R [r, in]
//
// computed as ONE cuSPARSELt 2:4 product over concatenations along the reduction:
//
//   Y = [X | T̃] · [W1 | L̃]ᵀ + b,     T̃ = X · R̃ᵀ  [N, 2p]
//
// with p = r rounded up to a multiple of 8. L̃ [out, 2p] holds the adapter's columns two per
// group of four (L̃[:, 4g + j] = L[:, 2g + j] for j < 2, zero at 4g + 2 and 4g + 3; zero
// past r), so [W1 | L̃] is 2:4 along its rows and compresses as one weight; R̃ [2p, in] holds
// R's rows at the same positions (zero rows elsewhere), so T̃'s columns line up with L̃'s
// kept slots. The adapter's terms are then summed by the sparse kernel in the same fp32
// accumulator as W1's and Y is written once, with the bias in the epilogue: no second pass
// reading and writing Y. What it costs: the product's K grows by 2p (of which p are kept
// values), and T̃ is one dense GEMM of N × 2p × in. T̃ is bf16, so the adapter's terms see
// X·Rᵀ rounded to bf16 once (as any bf16 two-pass form would).
//
// The input lives in a buffer whose rows are input_stride() = in + 2p elements: the caller
// writes X into the first `in` columns (a producer can write it there directly with that
// row stride); forward() writes T̃ into the remaining 2p columns, then runs the product.
//
// Sizes: out, in and tokens multiples of 16 (cuSPARSELt), 0 <= r <= min(out, in) (r = 0:
// W1's 2:4 product alone, input_stride() = in). tokens is fixed at construction (the plan
// is per problem). W1 must be 2:4 along its rows (checked at construction where cuSPARSELt
// runs; construction synchronises the stream). Without cuSPARSELt the same concatenated product runs dense
// on cuBLASLt (one warning on stderr; sparse() is false).
//
// The first forward tunes the product (SparseGemm24::tune: one cusparseLtMatmulSearch per
// problem and process, or the tuning cache's entry) and synchronises; later calls are
// asynchronous on the given stream. Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "sparse/cuda/slope_merged.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

class SlopeMergedLinear {
 public:
  // w1 [out, in], lora_l [out, rank], lora_r [rank, in]: device bf16, row-major, read here
  // only (the layer keeps its own compressed [W1 | L̃] and R̃; both adapter pointers may be
  // null when rank is 0). Throws Error for sizes it cannot run and for a W1 that is not
  // 2:4 along its rows.
  SlopeMergedLinear(int64_t out, int64_t in, int rank, int64_t tokens, bool bias, const bf16* w1, const bf16* lora_l,
                    const bf16* lora_r, cudaStream_t stream);
  ~SlopeMergedLinear();
  SlopeMergedLinear(const SlopeMergedLinear&) = delete;
  SlopeMergedLinear& operator=(const SlopeMergedLinear&) = delete;

  int64_t out_features() const;
  int64_t in_features() const;
  int64_t tokens() const;
  int rank() const;
  int padded_rank() const;       // p
  int64_t input_stride() const;  // in + 2p: the row length of the input buffer
  bool sparse() const;           // the 2:4 product runs (false: the dense fallback)

  // y [tokens, out] (overwritten) = the product above. x_wide [tokens, input_stride()]:
  // columns [0, in) hold X and are read; columns [in, input_stride()) are overwritten with
  // T̃. bias [out] must be given exactly when the layer was built with one.
  void forward(bf16* y, bf16* x_wide, const bf16* bias, cudaStream_t stream);

  // Device bytes the layer holds (the compressed weight or the dense fallback's, R̃, the
  // workspaces).
  size_t device_bytes() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace esplag::gpu
