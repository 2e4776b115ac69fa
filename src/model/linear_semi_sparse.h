// Runtime 2:4 kinds in the manner of torchao's SemiSparseLinear and
// SemiSparseActivationLinear: nothing sparse is stored, the 2:4 operand is recomputed from
// the dense tensor on every call, and gradients pass straight through the pruning.
//
// semi_sparse: W is dense and trained densely (the master weight). Every forward prunes W
// with the transposable greedy mask of sparse/transposable.h (4×4 tiles, at most 2 kept per
// row and per column), so one mask serves the forward (x·Wsᵀ, 2:4 along in) and dX (dY·Ws,
// Wsᵀ 2:4 along out). Straight-through: dW = dYᵀ·X, not masked.
//
// semi_sparse_activation: W dense; the input activations are pruned instead, 2:4 along the
// features (the forward's reduction dimension). forward = Xs·Wᵀ + b, dW = dYᵀ·Xs,
// dX = dY·W (straight through the pruning of X).
//
// The CPU reference multiplies the pruned dense copies with the dense GEMM (the zeros
// included); the result is the one a 2:4 GEMM computes up to rounding order.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/linear.h"

namespace esplag {

// How semi_sparse_activation prunes X [N, in]:
//   row_24:  the 2 largest |x| of every 4 consecutive features of each row (exactly 50%).
//   tile_24: the transposable greedy mask over 4×4 tiles of X (tokens × features; N is
//            padded with zero rows to a multiple of 4), so Xsᵀ is 2:4 along the tokens too
//            and the dW GEMM (reduction over tokens) can also run on sparse tensor cores;
//            what torchao does. May keep fewer than 50%.
enum class ActivationSparsity : uint8_t { row_24, tile_24 };
std::string activation_sparsity_name(ActivationSparsity a);  // "row_24", "tile_24"

template <typename T>
class SemiSparseLinear final : public Linear<T> {
 public:
  // Throws naming the layer unless in_features and out_features are multiples of 4.
  explicit SemiSparseLinear(const LinearParams<T>& p);

  void forward(T* out, const T* inp, int N) override;
  void backward(T* dinp, const T* dout, const T* inp, int N) override;
  std::string kind() const override { return "semi_sparse"; }
  std::string pattern() const override { return "2:4"; }
  // W ⊙ mask(W): what the next forward multiplies by.
  void dense_weight(T* out) const override;

  // The transposable 2:4 mask of the current weight, [out, in].
  std::vector<uint8_t> mask() const;

 private:
  // ws_ = W ⊙ mask(W) for the current W.
  void sparsify_weight();
  std::vector<T> ws_;
};

template <typename T>
class SemiSparseActivationLinear final : public Linear<T> {
 public:
  // Throws naming the layer unless in_features and out_features are multiples of 4.
  SemiSparseActivationLinear(const LinearParams<T>& p, ActivationSparsity how = ActivationSparsity::row_24);

  void forward(T* out, const T* inp, int N) override;
  void backward(T* dinp, const T* dout, const T* inp, int N) override;
  std::string kind() const override { return "semi_sparse_activation"; }
  // The weight is dense; the 2:4 is on the activations.
  std::string pattern() const override { return "dense"; }

  ActivationSparsity activation() const { return how_; }
  // xs[N, in] = x with the pruned activations set to 0 (xs may not alias x).
  void sparsify_input(T* xs, const T* x, int N) const;

 private:
  ActivationSparsity how_;
  std::vector<T> xs_;
};

}  // namespace esplag
