#include "model/linear_precision.h"

#include "core/error.h"
#include "model/fp8_amax_history.h"

namespace esplag {

template <typename T>
const T* Fp8Operands<T>::operator()(const LinearPrecision& precision, ProductOperand role, const T* x, int64_t n,
                                    Fp8AmaxHistory* history) {
  if (!precision.fp8) return x;
  std::vector<T>& b = buf_[int(role)];
  b.resize(size_t(n));
  const Fp8Format f = role == ProductOperand::grad ? precision.grad : Fp8Format::e4m3;
  float amax = float(fp8_amax(x, n));
  if (precision.delayed() && role != ProductOperand::weight && !(history && history->paused())) {
    ESPLAG_CHECK(history, "fp8 delayed scaling: the layer has no amax history");
    history->record(role, amax);
    if (history->warm()) amax = history->scale_amax(role);
  }
  saturated_ += fp8_quantize_dequantize(b.data(), x, n, f, amax);
  return b.data();
}

template class Fp8Operands<float>;
template class Fp8Operands<double>;

}  // namespace esplag
