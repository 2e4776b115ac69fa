#include "model/linear_lora.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/op_trace.h"
#include "core/rng.h"
#include "ops/matmul.h"

namespace esplag {

template <typename T>
LoraLinear<T>::LoraLinear(std::unique_ptr<Linear<T>> inner, int rank, double alpha, uint64_t seed)
    : Linear<T>(inner ? inner->params() : LinearParams<T>{}), inner_(std::move(inner)), rank_(rank), alpha_(alpha) {
  ESPLAG_CHECK(inner_ != nullptr, "LoRA wrapper needs a linear layer to wrap");
  const auto& p = this->p_;
  ESPLAG_CHECK(rank >= 1 && rank <= std::min(p.in_features, p.out_features), "linear '", p.name,
               "': LoRA rank ", rank, " is outside [1, min(in, out) = ", std::min(p.in_features, p.out_features),
               "]");
  ESPLAG_CHECK(std::isfinite(alpha), "linear '", p.name, "': LoRA alpha ", alpha, " is not finite");
  if (alpha_ <= 0) alpha_ = rank;
  Rng rng(seed);
  const double std = 1.0 / std::sqrt(double(p.in_features));
  a_.resize(size_t(rank) * p.in_features);
  for (auto& x : a_) x = static_cast<T>(rng.normal() * std);
  b_.assign(size_t(p.out_features) * rank, T(0));
  da_.assign(a_.size(), T(0));
  db_.assign(b_.size(), T(0));
}

template <typename T>
void LoraLinear<T>::copy_adapter_from(const LoraLinear& other) {
  const auto& p = this->p_;
  ESPLAG_CHECK(other.params().name == p.name && other.rank_ == rank_ && other.a_.size() == a_.size() &&
                   other.b_.size() == b_.size(),
               "linear '", p.name, "': cannot take over the LoRA adapter of '", other.params().name, "' (rank ",
               other.rank_, ", this one ", rank_, ")");
  a_ = other.a_;
  b_ = other.b_;
}

template <typename T>
std::string LoraLinear<T>::adapter_name(const char* what) const {
  const auto& p = this->p_;
  return (p.module.empty() ? p.name : p.module) + "." + what;
}

template <typename T>
std::vector<OwnedParam<T>> LoraLinear<T>::owned_params() {
  const auto& p = this->p_;
  std::vector<OwnedParam<T>> out = inner_->owned_params();
  out.push_back({adapter_name("lora_a"), {rank_, p.in_features}, a_.data(), da_.data(), true});
  out.push_back({adapter_name("lora_b"), {p.out_features, rank_}, b_.data(), db_.data(), true});
  return out;
}

template <typename T>
void LoraLinear<T>::forward(T* out, const T* inp, int N) {
  const auto& p = this->p_;
  inner_->forward(out, inp, N);
  const int C = p.in_features, O = p.out_features, r = rank_;
  ScopedOp op({p.module, "fwd.lora"}, OpCategory::dense_gemm, p.layer, 2.0 * N * r * (C + O),
              sizeof(T) * (double(N) * (C + r + 2.0 * O) + double(r) * (C + O)), {inp, a_.data(), b_.data(), out},
              {out});
  // u = s·(X·Aᵀ); out += u·Bᵀ.
  u_.resize(size_t(N) * r);
  cpu::linear_forward(u_.data(), inp, a_.data(), static_cast<const T*>(nullptr), N, C, r);
  const T s = static_cast<T>(scale());
  for (auto& x : u_) x *= s;
  tmp_.resize(size_t(N) * O);
  cpu::linear_forward(tmp_.data(), u_.data(), b_.data(), static_cast<const T*>(nullptr), N, r, O);
  for (size_t i = 0; i < tmp_.size(); ++i) out[i] += tmp_[i];
}

template <typename T>
void LoraLinear<T>::backward(T* dinp, const T* dout, const T* inp, int N) {
  const auto& p = this->p_;
  inner_->backward(dinp, dout, inp, N);
  const int C = p.in_features, O = p.out_features, r = rank_;
  ScopedOp op({p.module, "bwd.lora"}, OpCategory::dense_gemm, p.layer, 2.0 * N * r * (3.0 * C + 2.0 * O),
              sizeof(T) * (double(N) * (2.0 * C + O + 2.0 * r) + 2.0 * r * (C + O)),
              {dout, inp, a_.data(), b_.data()}, {dinp, da_.data(), db_.data()});
  const T s = static_cast<T>(scale());
  u_.resize(size_t(N) * r);
  cpu::linear_forward(u_.data(), inp, a_.data(), static_cast<const T*>(nullptr), N, C, r);
  for (auto& x : u_) x *= s;
  // du = dY·B, dB += dYᵀ·u (u already carries the scale); then the scale moves onto du for
  // dA += duᵀ·X and dX += du·A.
  du_.assign(size_t(N) * r, T(0));
  cpu::linear_backward(du_.data(), db_.data(), static_cast<T*>(nullptr), dout, u_.data(), b_.data(), N, r, O);
  for (auto& x : du_) x *= s;
  cpu::linear_backward(dinp, da_.data(), static_cast<T*>(nullptr), du_.data(), inp, a_.data(), N, C, r);
}

template <typename T>
void LoraLinear<T>::dense_weight(T* out) const {
  const auto& p = this->p_;
  inner_->dense_weight(out);
  const int64_t O = p.out_features, C = p.in_features;
  const T s = static_cast<T>(scale());
  for (int64_t o = 0; o < O; ++o)
    for (int64_t c = 0; c < C; ++c) {
      T acc = 0;
      for (int k = 0; k < rank_; ++k) acc += b_[o * rank_ + k] * a_[k * C + c];
      out[o * C + c] += s * acc;
    }
}

template class LoraLinear<float>;
template class LoraLinear<double>;

}  // namespace esplag
