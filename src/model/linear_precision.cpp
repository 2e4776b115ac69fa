#include "model/linear_precision.h"

namespace esplag {

template <typename T>
const T* Fp8Operands<T>::operator()(const LinearPrecision& precision, ProductOperand role, const T* x,
                                    int64_t n) {
  if (!precision.fp8) return x;
  std::vector<T>& b = buf_[int(role)];
  b.resize(size_t(n));
  saturated_ += fp8_quantize_dequantize(b.data(), x, n, role == ProductOperand::grad ? precision.grad : Fp8Format::e4m3);
  return b.data();
}

template class Fp8Operands<float>;
template class Fp8Operands<double>;

}  // namespace esplag
