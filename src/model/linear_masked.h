// masked: gradual magnitude pruning on dense kernels (sparseml's GMP; VENOM's V:N:M masks
// before kernel replacement). The weight stays dense in the flat buffer, with a byte mask
// of the same shape; pruned entries of the flat weight are 0 at all times outside the
// optimizer step, so forward, dX and dW are ordinary dense GEMMs on it.
//
//   forward  out = X·Wᵀ + b                 (W already masked)
//   dX       dY·W                            (dense)
//   dW       (dYᵀ·X) ⊙ mask                  (pruned entries get no gradient)
//   after the optimizer step the mask is re-applied, so neither weight decay nor moments
//   left over from before a mask change can revive a pruned weight.
//
// set_mask is how GMP advances: it recomputes the mask by magnitude from the current
// weight with the sparse layer's mask functions (unstructured / N:M / V:N:M) and zeroes the
// newly pruned weights.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/linear.h"
#include "sparse/pattern.h"

namespace esplag {

template <typename T>
class MaskedLinear final : public Linear<T> {
 public:
  // Computes the first mask with set_mask(pattern, sparsity).
  MaskedLinear(const LinearParams<T>& p, const SparsityPattern& pattern, double sparsity = 0.0);

  // Recomputes the mask by magnitude from the current weight and zeroes pruned weights.
  // For an unstructured pattern `sparsity` (fraction of zeros, in [0, 1]) is the target;
  // structured patterns imply theirs. Throws naming the layer when the shape does not
  // divide the pattern.
  void set_mask(const SparsityPattern& pattern, double sparsity = 0.0);

  void forward(T* out, const T* inp, int N) override;
  void backward(T* dinp, const T* dout, const T* inp, int N) override;
  std::string kind() const override { return "masked"; }
  // "2:4", "64:2:8", "unstructured 50%", "dense".
  std::string pattern() const override;
  void after_optimizer_step() override;
  // "<name>.mask" (u8 [out, in], 1 = kept) and "<name>.kind".
  std::map<std::string, Tensor> state() const override;
  // Restores the mask exactly and re-applies it to the weight.
  void load_state(const std::map<std::string, Tensor>& tensors) override;

  const std::vector<uint8_t>& mask() const { return mask_; }
  const SparsityPattern& sparsity_pattern() const { return pattern_; }

 private:
  SparsityPattern pattern_;
  std::vector<uint8_t> mask_;
};

}  // namespace esplag
