// semi_sparse_activation's Linear on the GPU (namespace esplag::gpu): the CUDA counterpart of
// model/linear_semi_sparse.h's SemiSparseActivationLinear, torchao's
// SemiSparseActivationLinear. W [out, in] stays dense (the caller's bf16 weight, read by
// every call); the input activations X [N, in] are pruned 2:4 along the features at every
// call, and gradients pass straight through the pruning:
//   forward   Y [N, out] = Xs · Wᵀ (+ bias)     Xs = X pruned (the pattern below)
//   backward  dX [N, in] = dY · W               dW [out, in] (fp32) = dYᵀ · Xs
//
// Patterns (sparse/pattern.h's ActivationSparsity):
//   row_24   the two largest |x| of every 4 consecutive features of each row (exactly 50%);
//   tile_24  the transposable greedy mask over 4×4 tiles of X (tokens × features, the
//            tokens padded with zero rows to a multiple of 4), which may keep fewer.
// Both prune as gpu::activation_24_rows / activation_24_tiles do, bit for bit with the CPU.
//
// The forward's product is 2:4 on cuSPARSELt (SparseProduct::activation_forward: Xs is the
// structured operand A, W the dense one; plans cached per problem and tuned once, as
// every 2:4 product here) when cuSPARSELt is available, out, in and the tokens are
// multiples of 16 and the call has the layer's token count. Xs is then compressed at
// every call: in one read of X by cusparselt_layout.h's writer (pruning and compression
// fused) where its layout was checked equal to the library's for the problem (in and the
// tokens multiples of 64), else pruned into the scratch and compressed by
// cusparseLtSpMMACompress. A bias is added by a separate pass (cuSPARSELt's bias epilogue
// would run along the tokens). Elsewhere the forward prunes X into the scratch and runs
// cuBLASLt's product of Xs, the same function up to rounding order; without cuSPARSELt
// the layer warns once (warn_cusparselt_fallback_once) and sparse() says false.
// dX is always cuBLASLt's product of the dense W. dW = dYᵀ · Xs reduces over the tokens:
// with tile_24, Xsᵀ is 2:4 along the tokens too, so where the forward is 2:4, in and the
// tokens are multiples of 64 and cusparselt_layout's writer has the library's layout of the
// product (SparseProduct::activation_weight_grad), dW is the 2:4 product of Xsᵀ (its layout
// written from X in one pass, pruning included), in bf16 widened into fp32 (one rounding
// more than the dense product's fp32 accumulation; sparse_weight_grad()); a call that also
// asks for the bias gradient takes the dense dW. Elsewhere dW is cuBLASLt's product of Xs
// pruned again from X into the scratch. Either way the pruning is deterministic, so the
// backward's Xs is the forward's: nothing is kept between forward and backward.
//
// Per-layer dispatch: time_products() times the forward (and a 2:4 dW) both ways on the
// layer's shape; use_dense_products(true) makes the forward prune and run cuBLASLt instead
// (and dW too).
//
// Memory: the scratch (Xs [tokens, in] bf16, the compressed Xs or Xsᵀ, and for a 2:4 dW
// its bf16 output [out, in]; sized by sparse_activation_scratch_bytes) may be shared by
// layers whose calls run in one stream order (SparseActivationLinearOptions::scratch);
// the layer itself holds its cuSPARSELt workspace and compression scratch only.
//
// Sizes: in a multiple of 4 (the pattern's groups; Error otherwise), out and in positive and
// within the dense GEMM's int arguments; rows per call in [1, tokens]. Pointers 16-byte
// aligned. All calls are asynchronous on the given stream, except the first 2:4 forward
// (SparseGemm24::tune) and time_products, which synchronise.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "sparse/cuda/sparse_activation_linear.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "sparse/cuda/sparse_linear.h"
#include "sparse/pattern.h"

namespace esplag::gpu {

using bf16 = __nv_bfloat16;
class Gemm;

// xs [rows, in] = x pruned by `pattern`. in a multiple of 4, any rows >= 1; xs must not
// overlap x. Asynchronous on `stream`.
void prune_activation(ActivationSparsity pattern, bf16* xs, const bf16* x, int64_t rows, int64_t in,
                      cudaStream_t stream);

// Bytes of the scratch a layer of this shape and pattern needs (Xs and, where the 2:4
// products can run, the compressed operand and the bf16 dW), 256-byte aligned parts.
size_t sparse_activation_scratch_bytes(int64_t out, int64_t in, int64_t tokens, ActivationSparsity pattern);

struct SparseActivationLinearOptions {
  ActivationSparsity pattern = ActivationSparsity::row_24;
  bool bias = false;  // the forward adds a bias [out] (bf16)
  // sparse_activation_scratch_bytes(out, in, tokens, pattern) bytes of device memory (256-byte
  // aligned), owned by the caller; layers whose calls run in one stream order may share
  // one. Null: the layer allocates its own.
  void* scratch = nullptr;
  // The cuBLASLt products' GEMM (the caller's, e.g. a model's), used on the caller's
  // stream. Null: the layer makes its own at its first dense product.
  Gemm* gemm = nullptr;
};

class SparseActivationLinear {
 public:
  // Throws Error for shapes the layer cannot run. Builds (or takes from the cache) the 2:4
  // plan where the forward can be sparse.
  SparseActivationLinear(const SparseActivationLinearOptions& options, int64_t out, int64_t in, int64_t tokens);
  ~SparseActivationLinear();
  SparseActivationLinear(const SparseActivationLinear&) = delete;
  SparseActivationLinear& operator=(const SparseActivationLinear&) = delete;

  ActivationSparsity pattern() const;
  int64_t out_features() const;
  int64_t in_features() const;
  int64_t tokens() const;
  bool sparse() const;           // the 2:4 forward is possible (cuSPARSELt, shape)
  bool sparse_products() const;  // ... and in use (not use_dense_products)
  bool own_layout() const;       // the 2:4 forward's compression is our one-pass writer
  bool sparse_weight_grad() const;  // tile_24: dW can be the 2:4 product of Xsᵀ (see above)
  // What forward() and backward() run for a call of `rows` rows (for callers that label
  // the work): the 2:4 forward, and the 2:4 dW (which a call asking for the bias gradient
  // too does not take).
  bool sparse_forward_for(int64_t rows) const;
  bool sparse_weight_grad_for(int64_t rows, bool bias_grad) const;
  void use_dense_products(bool on);

  // y [rows, out] (overwritten) = prune(x [rows, in]) · wᵀ (+ bias, given exactly when the
  // options ask for one). The 2:4 product when rows == tokens() and sparse_products().
  void forward(bf16* y, const bf16* x, const bf16* w, const bf16* bias, int64_t rows, cudaStream_t stream);
  // dx [rows, in] (overwritten; may be null) = dy · w; dw [out, in] fp32 (= or += when
  // accumulate_dw; may be null) = dyᵀ · prune(x); db [out] fp32 (+= Σ dy; may be null, and
  // only given with dw: it comes out of the dW product).
  void backward(bf16* dx, float* dw, float* db, const bf16* dy, const bf16* x, const bf16* w, int64_t rows,
                bool accumulate_dw, cudaStream_t stream);

  // The forward (and a 2:4 dW) both ways on this layer's shape (median of `iters` after two untimed
  // rounds that tune the products), on scratch inputs allocated for the call, with the
  // caller's weight w; the layer's mode is kept. Synchronises the stream. Error unless
  // sparse().
  using ProductTimes = SparseLinear::ProductTimes;
  ProductTimes time_products(const bf16* w, cudaStream_t stream, int iters = 10);

  // Device bytes the layer holds itself (its scratch when not given, its cuSPARSELt
  // workspace and compression scratch, its own GEMM's workspace).
  size_t device_bytes() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace esplag::gpu
