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
  cpu::linear_forward(out, inp, p.weight, p.bias, N, p.in_features, p.out_features);
}

template <typename T>
void Linear<T>::dense_backward(T* dinp, const T* dout, const T* inp, int N) const {
  const auto& p = p_;
  const double M = N, K = p.in_features, O = p.out_features;
  ScopedOp op({p.module, "bwd"}, OpCategory::dense_gemm, p.layer, (dinp ? 4 : 2) * M * K * O,
              sizeof(T) * (2 * M * K + 2 * K * O + M * O), {dout, inp, p.weight}, {dinp, p.dweight});
  cpu::linear_backward(dinp, p.dweight, p.dbias, dout, inp, p.weight, N, p.in_features, p.out_features);
}

template class Linear<float>;
template class Linear<double>;
template class DenseLinear<float>;
template class DenseLinear<double>;

}  // namespace esplag
