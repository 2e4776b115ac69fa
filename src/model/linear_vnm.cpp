#include "model/linear_vnm.h"

#include <type_traits>

#include "core/error.h"
#include "core/op_trace.h"
#include "ops/matmul.h"
#include "sparse/masks.h"

namespace esplag {

namespace {

// The V:2:M pattern the stored form uses: V:2:M itself, or 2:M as blocks of one row.
template <typename T>
void stored_shape(const LinearParams<T>& p, const SparsityPattern& pattern, int& v, int& m) {
  const bool vnm = pattern.kind == SparsityPattern::Kind::vnm;
  const bool nm2 = pattern.kind == SparsityPattern::Kind::nm && pattern.n == SparsityPattern::kVnmN &&
                   pattern.m >= SparsityPattern::kVnmSelected;
  ESPLAG_CHECK(vnm || nm2, "linear '", p.name, "': kind vnm needs a V:2:M or 2:M pattern (M >= 4), got ",
               pattern.to_string());
  check_divisible(pattern, p.out_features, p.in_features, p.name);
  v = vnm ? pattern.v : 1;
  m = pattern.m;
}

}  // namespace

template <typename T>
VnmLinear<T>::VnmLinear(const LinearParams<T>& p, const SparsityPattern& pattern, const std::vector<uint8_t>& mask)
    : Linear<T>(p), pattern_(pattern) {
  build(mask);
}

template <typename T>
VnmLinear<T>::VnmLinear(const LinearParams<T>& p, const SparsityPattern& pattern) : Linear<T>(p), pattern_(pattern) {
  stored_shape(p, pattern, v_, m_);
  ESPLAG_CHECK(p.weight != nullptr, "linear '", p.name, "': kind vnm needs a weight buffer");
  build(cpu::make_mask(p.weight, p.out_features, p.in_features, pattern, p.name));
}

template <typename T>
VnmLinear<T>::VnmLinear(const LinearParams<T>& p, const VnmLinear& prev)
    : Linear<T>(p), pattern_(prev.pattern_), v_(prev.v_), m_(prev.m_), w_(prev.w_), s_(prev.s_) {
  const auto& q = prev.params();
  ESPLAG_CHECK(q.name == p.name && q.in_features == p.in_features && q.out_features == p.out_features,
               "linear '", p.name, "' [out ", p.out_features, ", in ", p.in_features,
               "]: cannot continue the vnm layer '", q.name, "' [out ", q.out_features, ", in ", q.in_features, "]");
  dvalues_ = ZeroedArray<T>(w_.inner.values.size());
  after_optimizer_step();
}

template <typename T>
void VnmLinear<T>::build(const std::vector<uint8_t>& mask) {
  const auto& p = this->p_;
  stored_shape(p, pattern_, v_, m_);
  ESPLAG_CHECK(p.weight != nullptr, "linear '", p.name, "': kind vnm needs a weight buffer");
  const int64_t O = p.out_features, C = p.in_features;
  ESPLAG_CHECK(int64_t(mask.size()) == O * C, "linear '", p.name, "': mask has ", mask.size(),
               " entries, expected ", O * C);
  const auto check = cpu::check_pattern(mask.data(), O, C, pattern_);
  ESPLAG_CHECK(check.ok, "linear '", p.name, "': mask does not fit pattern ", pattern_.to_string(), ": ",
               check.detail);
  // Exactly 2 per row of each block: a slot outside the mask would have to be stored,
  // held at zero and told apart from kept values in every checkpoint.
  for (int64_t r = 0; r < O; ++r)
    for (int64_t b = 0; b < C / m_; ++b) {
      int kept = 0;
      for (int j = 0; j < m_; ++j) kept += mask[r * C + b * m_ + j] != 0;
      ESPLAG_CHECK(kept == SparsityPattern::kVnmN, "linear '", p.name, "': mask row ", r, " columns ", b * m_, "..",
                   b * m_ + m_ - 1, " keeps ", kept, " values; kind vnm needs exactly 2 in every row of a block");
    }
  w_ = linear_detail::compress_vnm_masked(p.weight, mask.data(), O, C, v_, m_, p.name);
  s_ = linear_detail::slot_index(w_);
  dvalues_ = ZeroedArray<T>(w_.inner.values.size());
  after_optimizer_step();
}

template <typename T>
void VnmLinear<T>::forward(T* out, const T* inp, int N) {
  const auto& p = this->p_;
  const double M = N, K = p.in_features, O = p.out_features, kept = O * K * 2 / m_;
  ScopedOp op({p.module, "fwd"}, OpCategory::sparse_gemm, p.layer, 2 * M * kept,
              sizeof(T) * (M * K + kept + M * O) + kept / 4 + O * K / m_ / v_ * 4, {inp, w_.inner.values.data()},
              {out});
  const T* x = this->operand(ProductOperand::input, inp, int64_t(N) * p.in_features);
  const CompressedVNMT<T>& w = linear_detail::with_values(
      w_, this->operand(ProductOperand::weight, w_.inner.values.data(), int64_t(w_.inner.values.size())), wq_);
  if constexpr (std::is_same_v<T, float>)
    cpu::linear_vnm(out, x, w, p.bias, N);
  else
    linear_detail::slot_linear(out, x, s_, w.inner.values.data(), p.bias, N);
}

template <typename T>
void VnmLinear<T>::backward(T* dinp, const T* dout, const T* inp, int N) {
  const auto& p = this->p_;
  const int64_t O = p.out_features, C = p.in_features;
  const double M = N, K = double(C), Od = double(O), kept = Od * K * 2 / m_;
  const T* dy = this->operand(ProductOperand::grad, dout, int64_t(N) * O);
  if (dinp) {
    ScopedOp op({p.module, "bwd.dx"}, OpCategory::sparse_gemm, p.layer, 2 * M * kept,
                sizeof(T) * (2 * M * K + kept + M * Od), {dout, w_.inner.values.data()}, {dinp});
    linear_detail::slot_linear_dx(
        dinp, dy, s_,
        this->operand(ProductOperand::weight, w_.inner.values.data(), int64_t(w_.inner.values.size())), N);
  }
  // On the GPU the gather of the kept positions is the dW GEMM's epilogue.
  scratch_.assign(size_t(O * C), T(0));
  ScopedOp op({p.module, "bwd.dw"}, OpCategory::dense_gemm, p.layer, 2 * M * K * Od,
              sizeof(T) * (M * K + kept + M * Od), {dout, inp}, {dvalues_.data(), p.dbias});
  cpu::linear_backward(static_cast<T*>(nullptr), scratch_.data(), static_cast<T*>(nullptr), dy,
                       this->operand(ProductOperand::input, inp, int64_t(N) * C), p.weight, N, int(C), int(O));
  this->bias_backward(dout, N);
  linear_detail::gather_add(dvalues_.data(), s_, scratch_.data(), static_cast<const uint8_t*>(nullptr));
}

template <typename T>
std::vector<OwnedParam<T>> VnmLinear<T>::owned_params() {
  const auto& p = this->p_;
  return {{p.name + ".values", {p.out_features, p.in_features / m_ * 2}, w_.inner.values.data(), dvalues_.data(),
           true}};
}

template <typename T>
void VnmLinear<T>::after_optimizer_step() {
  linear_detail::scatter(this->p_.weight, s_, w_.inner.values.data());
}

template <typename T>
void VnmLinear<T>::dense_weight(T* out) const {
  linear_detail::scatter(out, s_, w_.inner.values.data());
}

template <typename T>
std::map<std::string, Tensor> VnmLinear<T>::state() const {
  const auto& p = this->p_;
  using namespace linear_detail;
  const int64_t O = p.out_features, C = p.in_features;
  std::map<std::string, Tensor> s;
  s[p.name + ".kind"] = string_tensor(p.name + ".kind", kind());
  s[p.name + ".pattern"] = string_tensor(p.name + ".pattern", pattern_.to_string());
  s[p.name + ".columns"] = u8_tensor(p.name + ".columns", w_.columns, {O / v_, C / m_, 4});
  s[p.name + ".meta"] = u16_tensor(p.name + ".meta", w_.inner.meta, {O, w_.inner.meta_stride()});
  return s;
}

template <typename T>
void VnmLinear<T>::load_state(const std::map<std::string, Tensor>& tensors) {
  const auto& p = this->p_;
  using namespace linear_detail;
  const int64_t O = p.out_features, C = p.in_features;
  check_state_kind(tensors, p.name, kind());
  auto it = tensors.find(p.name + ".pattern");
  if (it != tensors.end())
    ESPLAG_CHECK(tensor_string(it->second) == pattern_.to_string(), "linear '", p.name, "': saved pattern ",
                 tensor_string(it->second), " differs from this layer's ", pattern_.to_string());
  const Tensor& cols = state_entry(tensors, p.name + ".columns", DType::u8, {O / v_, C / m_, 4}, p.name);
  const Tensor& meta = state_entry(tensors, p.name + ".meta", DType::u16, {O, w_.inner.meta_stride()}, p.name);
  CompressedVNMT<T> w =
      compressed_vnm_from_state<T>(cols.data<uint8_t>(), meta.data<uint16_t>(), O, C, v_, m_, p.name);
  w.inner.values = std::move(w_.inner.values);  // the trained values belong to the saved indices
  w_ = std::move(w);
  s_ = slot_index(w_);
  after_optimizer_step();
}

template class VnmLinear<float>;
template class VnmLinear<double>;

}  // namespace esplag
