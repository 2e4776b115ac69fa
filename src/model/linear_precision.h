// The precision of the block Linear layers' products (train.precision, docs/fp8.md), and the
// one helper through which every Linear kind honours it.
//
// In fp8 each GEMM of a layer multiplies fp8 operands with fp32 accumulation: activations
// and weights in e4m3, the output gradient (dY, or sparse_dw's MVUE estimate of it) in
// `grad` (e4m3 by default). The CPU emulates it: each operand is quantised with its
// per-tensor scale (core/fp8.h), dequantised back and multiplied by the layer's usual
// products; the GPU scales its fp32 accumulator instead, which differs by rounding only.
// What a kind multiplies is what is quantised: a sparse kind's pruned or compressed weight
// (its kept values), semi_sparse_activation's pruned input. Bias gradients stay the exact
// sums of dY, and low-rank adapters' products stay in full precision.
//
// Scaling: per tensor, from the tensor's own amax (current) or, for X and dY, from an amax
// history of earlier steps (delayed, model/fp8_amax_history.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/fp8.h"

namespace esplag {

enum class Fp8Scaling { current, delayed };

struct LinearPrecision {
  bool fp8 = false;                  // false: the products in the layer's own type
  Fp8Format grad = Fp8Format::e4m3;  // the output gradient's format in fp8
  Fp8Scaling scaling = Fp8Scaling::current;  // of X and dY (weights: current)
  int amax_history = 16;                     // delayed: the optimizer steps an amax history keeps

  bool delayed() const { return fp8 && scaling == Fp8Scaling::delayed; }

  friend bool operator==(const LinearPrecision&, const LinearPrecision&) = default;
};

// Which operand of a product: each has its own buffer, so a product's two operands (and the
// backward's dY, used by dX and dW) are alive together.
enum class ProductOperand { input, weight, grad };

class Fp8AmaxHistory;

// The operands of one layer's products, as its precision has them multiplied.
template <typename T>
class Fp8Operands {
 public:
  // `x` ([n] values) itself in full precision; in fp8 its quantised and dequantised copy
  // (e4m3, or precision.grad for the gradient), valid until the next call for `role`. With
  // delayed scaling, X and dY are scaled by `history` and recorded in it.
  const T* operator()(const LinearPrecision& precision, ProductOperand role, const T* x, int64_t n,
                      Fp8AmaxHistory* history);
  // Values the casts saturated so far (the run log warns about them).
  int64_t saturated() const { return saturated_; }

 private:
  std::vector<T> buf_[3];
  int64_t saturated_ = 0;
};

}  // namespace esplag
