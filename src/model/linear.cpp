#include "model/linear.h"

#include <algorithm>

#include "core/op_trace.h"
#include "ops/matmul.h"

namespace esplag {

template <typename T>
void Linear<T>::dense_weight(T* out) const {
  std::copy_n(p_.weight, size_t(p_.out_features) * p_.in_features, out);
}

template <typename T>
void Linear<T>::dense_forward(T* out, const T* inp, int N) const {
  const auto& p = p_;
  const double M = N, K = p.in_features, O = p.out_features;
  ScopedOp op({p.module, "fwd"}, OpCategory::dense_gemm, p.layer, 2 * M * K * O, sizeof(T) * (M * K + K * O + M * O),
              {inp, p.weight}, {out});
  cpu::linear_forward(out, operand(ProductOperand::input, inp, int64_t(N) * p.in_features),
                      operand(ProductOperand::weight, p.weight, int64_t(p.out_features) * p.in_features), p.bias, N,
                      p.in_features, p.out_features);
}

template <typename T>
void Linear<T>::dense_backward(T* dinp, const T* dout, const T* inp, int N) const {
  const auto& p = p_;
  const double M = N, K = p.in_features, O = p.out_features;
  ScopedOp op({p.module, "bwd"}, OpCategory::dense_gemm, p.layer, (dinp ? 4 : 2) * M * K * O,
              sizeof(T) * (2 * M * K + 2 * K * O + M * O), {dout, inp, p.weight}, {dinp, p.dweight});
  const T* dy = operand(ProductOperand::grad, dout, int64_t(N) * p.out_features);
  const T* w = dinp ? operand(ProductOperand::weight, p.weight, int64_t(p.out_features) * p.in_features) : p.weight;
  const T* x = operand(ProductOperand::input, inp, int64_t(N) * p.in_features);
  cpu::linear_backward(dinp, p.dweight, static_cast<T*>(nullptr), dy, x, w, N, p.in_features, p.out_features);
  bias_backward(dout, N);
}

template <typename T>
void Linear<T>::bias_backward(const T* dout, int N) const {
  if (!p_.dbias) return;
  const T* none = nullptr;
  cpu::linear_backward(static_cast<T*>(nullptr), static_cast<T*>(nullptr), p_.dbias, dout, none, none, N,
                       p_.in_features, p_.out_features);
}

template class Linear<float>;
template class Linear<double>;
template class DenseLinear<float>;
template class DenseLinear<double>;

}  // namespace esplag
