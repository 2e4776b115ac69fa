#include "model/linear.h"

#include <algorithm>

#include "ops/matmul.h"

namespace esplag {

template <typename T>
void Linear<T>::dense_weight(T* out) const {
  std::copy_n(p_.weight, size_t(p_.out_features) * p_.in_features, out);
}

template <typename T>
void DenseLinear<T>::forward(T* out, const T* inp, int N) {
  const auto& p = this->p_;
  cpu::linear_forward(out, inp, p.weight, p.bias, N, p.in_features, p.out_features);
}

template <typename T>
void DenseLinear<T>::backward(T* dinp, const T* dout, const T* inp, int N) {
  const auto& p = this->p_;
  cpu::linear_backward(dinp, p.dweight, p.dbias, dout, inp, p.weight, N, p.in_features, p.out_features);
}

template class Linear<float>;
template class Linear<double>;
template class DenseLinear<float>;
template class DenseLinear<double>;

}  // namespace esplag
