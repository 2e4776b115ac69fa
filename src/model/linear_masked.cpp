#include "model/linear_masked.h"

#include <cmath>

#include "core/error.h"
#include "core/op_trace.h"
#include "model/linear_kinds.h"
#include "ops/matmul.h"
#include "sparse/masks.h"

namespace esplag {

template <typename T>
MaskedLinear<T>::MaskedLinear(const LinearParams<T>& p, const SparsityPattern& pattern, double sparsity)
    : Linear<T>(p) {
  ESPLAG_CHECK(p.weight != nullptr && p.dweight != nullptr, "linear '", p.name,
               "': kind masked needs weight and gradient buffers");
  set_mask(pattern, sparsity);
}

template <typename T>
void MaskedLinear<T>::set_mask(const SparsityPattern& pattern, double sparsity) {
  const auto& p = this->p_;
  SparsityPattern pat = pattern;
  if (pat.kind == SparsityPattern::Kind::unstructured) {
    ESPLAG_CHECK(sparsity >= 0.0 && sparsity <= 1.0, "linear '", p.name, "': unstructured sparsity ", sparsity,
                 " is outside [0, 1]");
    pat = SparsityPattern::unstructured(sparsity);
  }
  const int64_t n = int64_t(p.out_features) * p.in_features;
  ScopedOp op({p.module, "mask"}, OpCategory::other, p.layer, 0, double(sizeof(T) * 2 * n), {p.weight},
              {p.weight});
  mask_ = cpu::make_mask(p.weight, p.out_features, p.in_features, pat, p.name);
  pattern_ = pat;
  cpu::apply_mask(p.weight, mask_.data(), n);
}

template <typename T>
std::string MaskedLinear<T>::pattern() const {
  if (pattern_.kind != SparsityPattern::Kind::unstructured) return pattern_.to_string();
  return detail::concat("unstructured ", std::round(pattern_.sparsity * 1e4) / 1e2, "%");
}

template <typename T>
void MaskedLinear<T>::forward(T* out, const T* inp, int N) {
  this->dense_forward(out, inp, N);  // the pruned weights are zeros in the flat buffer
}

template <typename T>
void MaskedLinear<T>::backward(T* dinp, const T* dout, const T* inp, int N) {
  const auto& p = this->p_;
  this->dense_backward(dinp, dout, inp, N);
  // The whole accumulated gradient is masked: its pruned entries only ever held what this
  // and earlier micro-batches added there, all of which must go.
  ScopedOp op({p.module, "bwd.mask"}, OpCategory::elementwise, p.layer, 0,
              sizeof(T) * 2.0 * p.in_features * p.out_features, {p.dweight},
              {p.dweight});
  cpu::apply_mask(p.dweight, mask_.data(), int64_t(p.out_features) * p.in_features);
}

template <typename T>
void MaskedLinear<T>::after_optimizer_step() {
  const auto& p = this->p_;
  cpu::apply_mask(p.weight, mask_.data(), int64_t(p.out_features) * p.in_features);
}

template <typename T>
std::map<std::string, Tensor> MaskedLinear<T>::state() const {
  const auto& p = this->p_;
  std::map<std::string, Tensor> s;
  s[p.name + ".kind"] = linear_detail::string_tensor(p.name + ".kind", kind());
  s[p.name + ".mask"] = linear_detail::u8_tensor(p.name + ".mask", mask_, {p.out_features, p.in_features});
  return s;
}

template <typename T>
void MaskedLinear<T>::load_state(const std::map<std::string, Tensor>& tensors) {
  const auto& p = this->p_;
  linear_detail::check_state_kind(tensors, p.name, kind());
  const Tensor& m =
      linear_detail::state_entry(tensors, p.name + ".mask", DType::u8, {p.out_features, p.in_features}, p.name);
  const uint8_t* src = m.data<uint8_t>();
  std::vector<uint8_t> mask(src, src + m.numel());
  for (auto& b : mask) b = b ? 1 : 0;
  const auto check = cpu::check_pattern(mask.data(), p.out_features, p.in_features, pattern_);
  ESPLAG_CHECK(check.ok, "linear '", p.name, "': saved mask does not fit pattern ", pattern(), ": ", check.detail);
  mask_ = std::move(mask);
  after_optimizer_step();
}

template class MaskedLinear<float>;
template class MaskedLinear<double>;

}  // namespace esplag
