// vnm: VENOM's V:N:M weights after kernel replacement. A mask (from gradual magnitude
// pruning with dense kernels, or by magnitude at construction) is frozen and the weight is
// stored compressed as V:2:M (sparse/compressed.h CompressedVNMT: 4 selected column indices
// per block of V rows × M columns, then 2:4 among them with 2-bit metadata). 2:M (N:M with
// N = 2) is stored the same way with blocks of one row, so 2:4 is V:2:4.
//
//   forward  out = X·Wᵀ + b       sparse: the sparse layer's linear_vnm walk
//   dX       dY·W                 sparse: the compressed form used transposed
//   dW       (dYᵀ·X) at the kept positions, compressed: the gradient of the kept values
//
// The kept values [out, in/M·2] are the trained parameter ("<weight>.values"); the
// flat-buffer weight is not trained and is rewritten from them after every optimizer step.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/zeroed_array.h"
#include "model/linear.h"
#include "model/linear_kinds.h"
#include "sparse/compressed.h"
#include "sparse/pattern.h"

namespace esplag {

template <typename T>
class VnmLinear final : public Linear<T> {
 public:
  // Keeps the positions `mask` marks ([out, in], 1 = kept), which must be the pattern
  // exactly: V:2:M (or 2:M) with 2 kept in every row of every block and at most 4 kept
  // columns per block, as the sparse layer's masks produce. Values come from the weight.
  VnmLinear(const LinearParams<T>& p, const SparsityPattern& pattern, const std::vector<uint8_t>& mask);
  // The pattern's magnitude mask of the current weight.
  VnmLinear(const LinearParams<T>& p, const SparsityPattern& pattern);
  // Continues `previous` (the same layer and pattern).
  VnmLinear(const LinearParams<T>& p, const VnmLinear& previous);

  void forward(T* out, const T* inp, int N) override;
  void backward(T* dinp, const T* dout, const T* inp, int N) override;
  std::string kind() const override { return "vnm"; }
  std::string pattern() const override { return pattern_.to_string(); }
  bool trains_dense_weight() const override { return false; }
  std::vector<OwnedParam<T>> owned_params() override;
  // Writes the effective weight into the flat weight.
  void after_optimizer_step() override;
  // "<name>.kind", "<name>.pattern", "<name>.columns" (u8 [out/V, in/M, 4]) and
  // "<name>.meta" (u16 [out, ceil(in/M·4/16)]).
  std::map<std::string, Tensor> state() const override;
  // Restores the indices exactly (the pattern must be the same); the values (owned
  // parameter) are kept as they are and written into the flat weight.
  void load_state(const std::map<std::string, Tensor>& tensors) override;
  void dense_weight(T* out) const override;

  const CompressedVNMT<T>& weight() const { return w_; }
  const SparsityPattern& sparsity_pattern() const { return pattern_; }
  std::vector<uint8_t> mask() const { return linear_detail::slot_mask(s_); }
  std::vector<T>& values() { return w_.inner.values; }

 private:
  void build(const std::vector<uint8_t>& mask);

  SparsityPattern pattern_;
  int v_ = 0, m_ = 0;  // block shape of the stored form (v_ = 1 for 2:M)
  CompressedVNMT<T> w_;
  CompressedVNMT<T> wq_;  // w_ with fp8's quantised values (linear_detail::with_values)
  linear_detail::SlotIndex s_;
  ZeroedArray<T> dvalues_;
  std::vector<T> scratch_;
};

}  // namespace esplag
