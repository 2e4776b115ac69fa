#include "model/fp8_amax_history.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace esplag {

void Fp8AmaxHistory::resize(int length) {
  ESPLAG_CHECK(length >= 1, "fp8 amax history: the length must be at least 1, got ", length);
  length_ = length;
  warm_ = false;
  current_.assign(2, 0.0f);
  past_.assign(2 * size_t(length), 0.0f);
}

int Fp8AmaxHistory::operand_index(ProductOperand role) {
  ESPLAG_CHECK(role != ProductOperand::weight, "fp8 amax history: weights keep current scaling");
  return role == ProductOperand::input ? 0 : 1;
}

float Fp8AmaxHistory::scale_amax(ProductOperand role) const {
  const auto first = past_.begin() + ptrdiff_t(operand_index(role)) * length_;
  return *std::max_element(first, first + length_);
}

void Fp8AmaxHistory::record(ProductOperand role, float a) {
  float& c = current_[size_t(operand_index(role))];
  c = std::max(c, a);
}

void Fp8AmaxHistory::roll() {
  for (int r = 0; r < 2; ++r) {
    float* p = past_.data() + size_t(r) * length_;
    std::copy_backward(p, p + length_ - 1, p + length_);
    p[0] = current_[size_t(r)];
    current_[size_t(r)] = 0.0f;
  }
  warm_ = true;
}

std::vector<float> Fp8AmaxHistory::values() const {
  std::vector<float> v;
  for (int r = 0; r < 2; ++r) {
    v.push_back(current_[size_t(r)]);
    v.insert(v.end(), past_.begin() + ptrdiff_t(r) * length_, past_.begin() + ptrdiff_t(r + 1) * length_);
  }
  return v;
}

void Fp8AmaxHistory::set_values(const std::vector<float>& v, const std::string& what) {
  const int64_t per = values_per_operand(length_);
  ESPLAG_CHECK(int64_t(v.size()) == 2 * per, what, ": ", v.size(), " values for an fp8 amax history of length ",
               length_, ", expected ", 2 * per, " (train.fp8_amax_history changed?)");
  for (float x : v)
    ESPLAG_CHECK(std::isfinite(x) && x >= 0, what, ": an fp8 amax history holds ", x,
                 "; amaxes are finite and not negative");
  for (int r = 0; r < 2; ++r) {
    current_[size_t(r)] = v[size_t(r * per)];
    std::copy(v.begin() + r * per + 1, v.begin() + (r + 1) * per, past_.begin() + ptrdiff_t(r) * length_);
  }
  warm_ = true;
}

}  // namespace esplag
