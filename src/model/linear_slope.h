// slope: SLoPe (Mozaffari et al.), static 2:4 sparse pre-training with double pruning and
// lazy low-rank adapters.
//
//   W1 = W ⊙ forward mask      row-wise 2:4 of W, chosen once at construction, never changed
//   W2 = W1 ⊙ backward mask    W1 pruned again 2:4 down each column (groups of 4 rows), so
//                              W2ᵀ is 2:4 along its reduction dimension; recomputed from the
//                              current W1 every `mask_change_freq` steps
//   forward  out = X·W1ᵀ + b  (+ (X·Rᵀ)·Lᵀ with the adapter)    sparse: W1 compressed
//   dX       dY·W2             (+ (dY·L)·R)                      sparse: W2ᵀ compressed
//   dW       (dYᵀ·X) at W1's kept positions, compressed: the gradient of the kept values;
//            with sparse_dw (MvueWeightGrad, model/linear_semi_sparse.h) (S·X) at those
//            positions, S = MVUE(dYᵀ) 2:4 along the tokens          sparse: S compressed
//
// The trained parameter is the compressed form itself: the kept values [out, in/2]
// ("<weight>.values"), so AdamW's moments exist for kept values only (sparse AdamW); the
// flat-buffer weight is not trained and holds W1, rewritten after every optimizer step so
// that export, evaluation and sampling that read it see the trained weight.
//
// The adapter (enable_lora) adds L [out, r] (random, N(0, 1/r)) and R [r, in] (zero), so
// enabling it does not change the output; both are owned parameters ("<module>.lora_l",
// "<module>.lora_r"). merged_forward computes the same output for inference in one pass
// over [W1 | L] and [X | X·Rᵀ].
//
// What defines the layer is held always: W1 (kept values and metadata), W2ᵀ's metadata (the
// backward mask), the refresh step, the adapter and sparse_dw's draw count, about 2.25 bytes
// per weight in fp32. The CPU products' own state (W2ᵀ's values and the slot index of W1
// and of W2ᵀ, 6 bytes per weight more) is built on the first CPU forward or backward: the
// host twin of a GPU run, which only hands its state to the GPU and takes it back, never
// holds it (llama-7b's 6.5 billion block-Linear weights would need 36 GiB for it).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/zeroed_array.h"
#include "model/linear.h"
#include "model/linear_kinds.h"
#include "model/linear_semi_sparse.h"
#include "sparse/compressed.h"

namespace esplag {

template <typename T>
class SlopeLinear final : public Linear<T> {
 public:
  // Prunes the current weight row-wise 2:4 (in and out features must be multiples of 4),
  // compresses it, computes the backward mask and writes W1 into the flat weight. `dw` on:
  // sparse_dw (the kept values' gradient from S = MVUE(dYᵀ) instead of dYᵀ).
  SlopeLinear(const LinearParams<T>& p, int mask_change_freq, MvueWeightGrad<T> dw = {});
  // Continues `previous` (the same layer): masks, values, refresh step and adapter.
  SlopeLinear(const LinearParams<T>& p, const SlopeLinear& previous, int mask_change_freq,
              MvueWeightGrad<T> dw = {});

  void forward(T* out, const T* inp, int N) override;
  void backward(T* dinp, const T* dout, const T* inp, int N) override;
  std::string kind() const override { return "slope"; }
  std::string pattern() const override { return "2:4"; }
  // Refreshes the backward mask when `mask_change_freq` steps have passed since the last
  // refresh (the masks computed at construction count as computed at the first step seen).
  void on_step_begin(int64_t step) override;
  bool trains_dense_weight() const override { return false; }
  std::vector<OwnedParam<T>> owned_params() override;
  // Writes W1 into the flat weight (and W2ᵀ's values where the CPU products' state exists).
  void after_optimizer_step() override;
  // "<name>.kind", "<name>.meta" (u16 [out, ceil(in/16)]: W1's 2:4 metadata, i.e. the
  // forward mask), "<name>.backward_meta" (u16 [in, ceil(out/16)]: W2ᵀ's),
  // "<name>.refresh_step" (f64 [1], -1 before the first step), and with sparse_dw
  // "<name>.sparse_dw_draws" (f64 [1]).
  std::map<std::string, Tensor> state() const override;
  // Restores masks, refresh step and draw count exactly; the values (owned parameters) are
  // kept as they are, the flat weight is rebuilt from them and the CPU products' state is
  // dropped (the next CPU product builds it again).
  void load_state(const std::map<std::string, Tensor>& tensors) override;
  // W1 + L·R.
  void dense_weight(T* out) const override;
  void sparse_weight(T* out) const override;

  // Adds the adapter (rank in [1, min(in, out)]). Enabling it again with the same rank
  // keeps the trained adapter; another rank throws.
  void enable_lora(int rank, uint64_t seed);
  // The adapter's L [out, rank] as enable_lora draws it (N(0, 1/rank) from Rng(seed)), for
  // a GPU model that starts an adapter where this layer would.
  static std::vector<T> initial_lora_l(int64_t out, int rank, uint64_t seed);
  int lora_rank() const { return rank_; }
  // Inference: the forward's output in one pass per output element over the compressed
  // W1 and the adapter, equal bit for bit to forward().
  void merged_forward(T* out, const T* inp, int N) const;

  // Recomputes the backward mask from the current W1 now.
  void refresh_backward_mask();
  int64_t refresh_step() const { return refresh_step_; }
  int mask_change_freq() const { return freq_; }
  bool sparse_dw() const { return dw_.on(); }
  const MvueWeightGrad<T>& weight_grad() const { return dw_; }
  // The masks [out, in] (1 = kept), built from the metadata on each call.
  std::vector<uint8_t> forward_mask() const;
  std::vector<uint8_t> backward_mask() const;
  // The same masks as 4×4 tile bits (sparse/masks.h's tile_bits, the GPU's form), straight
  // from the metadata.
  std::vector<uint16_t> forward_tiles() const;
  std::vector<uint16_t> backward_tiles() const;
  const Compressed24T<T>& forward_weight() const { return w1_; }  // W1, [out, in]
  // W2ᵀ [in, out] with its values from the current W1, built on each call.
  Compressed24T<T> backward_weight() const;
  std::vector<T>& values() { return w1_.values; }
  std::vector<T>& lora_l() { return l_; }
  std::vector<T>& lora_r() { return r_; }
  // Whether the CPU products' state exists (after a CPU forward or backward).
  bool has_cpu_products() const { return !s1_.col.empty(); }
  // The host bytes the layer's own buffers hold (capacities): the defining state, the CPU
  // products' state and work buffers, the adapter. Not counted: the kept values' gradient,
  // calloc'd and so backed by memory only once a CPU backward writes it, and sparse_dw's
  // buffers of one micro-batch.
  size_t host_bytes() const;

 private:
  // The CPU products' state (s1_, s2t_, W2ᵀ's values) from the defining state, unless it exists.
  void ensure_cpu_products();
  // Flat weight = W1; W2ᵀ's values from it where the products' state exists.
  void sync();
  // Frees the dense-size work buffers (scratch_, tmp_) after a mask refresh without the CPU
  // products' state (at construction) or a state load: a layer that never trains on the
  // host (GPU training) should not hold 8 bytes per weight of them; the training paths grow
  // them again on first use.
  void release_work_buffers();
  void adapter_forward_add(T* out, const T* inp, int N);
  // c (W1 or W2ᵀ) as the products multiply it: c itself, or in fp8 wq_ with its quantised values.
  const Compressed24T<T>& product_weight(const Compressed24T<T>& c);
  std::string adapter_name(const char* what) const;

  int freq_;
  int64_t refresh_step_ = -1;
  // The defining state: W1 whole, W2ᵀ's metadata (its values only with the CPU products).
  Compressed24T<T> w1_, w2t_;
  // The CPU products' state: the slot indices (empty until ensure_cpu_products).
  linear_detail::SlotIndex s1_, s2t_;
  Compressed24T<T> wq_;  // W1 or W2ᵀ with fp8's quantised values (linear_detail::with_values)
  ZeroedArray<T> dvalues_;
  int rank_ = 0;
  std::vector<T> l_, r_, dl_, dr_;
  std::vector<T> scratch_, tmp_, t_, dt_;
  MvueWeightGrad<T> dw_;
};

}  // namespace esplag
