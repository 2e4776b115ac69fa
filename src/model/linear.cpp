#include "model/linear.h"

#include "ops/matmul.h"

namespace esplag {

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

template class DenseLinear<float>;
template class DenseLinear<double>;

}  // namespace esplag
