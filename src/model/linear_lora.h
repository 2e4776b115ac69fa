// LoRA on any Linear kind: out = inner(X) + (alpha/r)·(X·Aᵀ)·Bᵀ with A [r, in] random
// (N(0, 1/in)) and B [out, r] zero, so wrapping does not change the output (standard
// LoRA initialisation). A and B are owned parameters ("<module>.lora_a", "<module>.lora_b")
// next to the inner kind's own; every hook is forwarded to the inner kind, whose weight
// keeps training as that kind trains it.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/linear.h"

namespace esplag {

template <typename T>
class LoraLinear final : public Linear<T> {
 public:
  // rank in [1, min(in, out)]; alpha <= 0 means alpha = rank (scale 1).
  LoraLinear(std::unique_ptr<Linear<T>> inner, int rank, double alpha, uint64_t seed);

  void forward(T* out, const T* inp, int N) override;
  void backward(T* dinp, const T* dout, const T* inp, int N) override;
  // The inner kind's name with "+lora", e.g. "masked+lora".
  std::string kind() const override { return inner_->kind() + "+lora"; }
  std::string pattern() const override { return inner_->pattern(); }
  void on_step_begin(int64_t step) override { inner_->on_step_begin(step); }
  bool trains_dense_weight() const override { return inner_->trains_dense_weight(); }
  // The inner kind's, then A and B.
  std::vector<OwnedParam<T>> owned_params() override;
  void after_optimizer_step() override { inner_->after_optimizer_step(); }
  std::map<std::string, Tensor> state() const override { return inner_->state(); }
  void load_state(const std::map<std::string, Tensor>& tensors) override { inner_->load_state(tensors); }
  // inner's effective weight + (alpha/r)·B·A.
  void dense_weight(T* out) const override;
  void sparse_weight(T* out) const override { inner_->sparse_weight(out); }
  // The inner kind's products take the precision; the adapter's stay in full precision.
  void set_precision(const LinearPrecision& precision) override {
    Linear<T>::set_precision(precision);
    inner_->set_precision(precision);
  }
  int64_t fp8_saturated() const override { return inner_->fp8_saturated(); }

  Linear<T>& inner() { return *inner_; }
  const Linear<T>& inner() const { return *inner_; }
  int rank() const { return rank_; }
  double alpha() const { return alpha_; }
  double scale() const { return alpha_ / rank_; }
  std::vector<T>& lora_a() { return a_; }
  std::vector<T>& lora_b() { return b_; }
  // Takes over another wrapper's adapter values (same layer, same rank).
  void copy_adapter_from(const LoraLinear& other);

 private:
  std::string adapter_name(const char* what) const;

  std::unique_ptr<Linear<T>> inner_;
  int rank_;
  double alpha_;
  std::vector<T> a_, b_, da_, db_;
  std::vector<T> u_, du_, tmp_;
};

}  // namespace esplag
