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
#pragma once
#include <cstdint>
#include <vector>

#include "core/fp8.h"

namespace esplag {

struct LinearPrecision {
  bool fp8 = false;                  // false: the products in the layer's own type
  Fp8Format grad = Fp8Format::e4m3;  // the output gradient's format in fp8

  friend bool operator==(const LinearPrecision&, const LinearPrecision&) = default;
};

// Which operand of a product: each has its own buffer, so a product's two operands (and the
// backward's dY, used by dX and dW) are alive together.
enum class ProductOperand { input, weight, grad };

// The operands of one layer's products, as its precision has them multiplied.
template <typename T>
class Fp8Operands {
 public:
  // `x` ([n] values) itself in full precision; in fp8 its quantised and dequantised copy
  // (e4m3, or precision.grad for the gradient), valid until the next call for `role`.
  const T* operator()(const LinearPrecision& precision, ProductOperand role, const T* x, int64_t n);
  // Values the casts saturated so far (the run log warns about them).
  int64_t saturated() const { return saturated_; }

 private:
  std::vector<T> buf_[3];
  int64_t saturated_ = 0;
};

}  // namespace esplag
