// Runtime 2:4 kinds in the manner of torchao's SemiSparseLinear and
// SemiSparseActivationLinear: nothing sparse is stored, the 2:4 operand is recomputed from
// the dense tensor on every call, and gradients pass straight through the pruning.
//
// semi_sparse: W is dense and trained densely (the master weight). Every forward prunes W
// with the transposable greedy mask of sparse/transposable.h (4×4 tiles, at most 2 kept per
// row and per column), so one mask serves the forward (x·Wsᵀ, 2:4 along in) and dX (dY·Ws,
// Wsᵀ 2:4 along out). Straight-through: dW = dYᵀ·X, not masked.
//
// semi_sparse_activation: W dense; the input activations are pruned instead, 2:4 along the
// features (the forward's reduction dimension). forward = Xs·Wᵀ + b, dW = dYᵀ·Xs,
// dX = dY·W (straight through the pruning of X).
//
// The CPU reference multiplies the pruned dense copies with the dense GEMM (the zeros
// included); the result is the one a 2:4 GEMM computes up to rounding order.
//
// sparse_dw (MvueWeightGrad below), an option of semi_sparse and of slope
// (model/linear_slope.h): the third GEMM made 2:4 as well, through the output gradient.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/linear.h"
#include "sparse/pattern.h"

namespace esplag {

// sparse_dw: the weight gradient from the minimum-variance unbiased 2:4 estimate of the
// output gradient (sparse/mvue.h). dW = dYᵀ·X reduces over the tokens, so its 2:4 operand
// is S = MVUE(dYᵀ) [out, N], groups of 4 consecutive tokens of one output feature
// (numbered o·N/4 + n/4); E[S] = dYᵀ, so E[S·X] is the dense dW: each draw adds variance,
// no bias. The bias gradient stays the exact column sum of dY, and dX does not change.
//
// Draw k of a layer (k = 0, 1, ...: one per backward call) uses the seed
// mvue_draw_seed(base, k) (sparse/mvue_seed.h), the sequence of the GPU layer
// gpu::SparseLinear; the base comes from the run seed and the weight's name
// (sparse_dw_seed in model/linear_kinds.h), and the number of draws taken is checkpointed,
// so a resumed run takes the uninterrupted run's draws.
//
// The MVUE reference works on float: a double layer rounds dYᵀ to float for it and widens
// S again (the GPU rounds dY to bf16 the same way). Needs N % 4 == 0.
template <typename T>
class MvueWeightGrad {
 public:
  MvueWeightGrad() = default;  // off: the layer's dW is the dense dYᵀ·X
  explicit MvueWeightGrad(uint64_t base_seed) : on_(true), base_(base_seed) {}

  bool on() const { return on_; }
  uint64_t base_seed() const { return base_; }
  uint64_t draws() const { return draws_; }  // draws taken so far: the next one's number
  // A layer rebuilt from another (slope continuing slope, or taking over from
  // semi_sparse) goes on with its draw count, so that no draw is repeated.
  void continue_from(const MvueWeightGrad& previous) { draws_ = previous.draws_; }

  // Sᵀ [N, out] for draw draws() of dout [N, out] (then draws() + 1), valid until the next
  // call: the operand `dout` of cpu::linear_backward's weight gradient. Profiled as
  // "<module>.bwd.dw.mvue". Throws naming the layer unless N is a multiple of 4.
  const T* draw(const LinearParams<T>& p, const T* dout, int N);

  // "<name>.sparse_dw_draws" (f64 [1]) when on; nothing when off.
  void add_state(std::map<std::string, Tensor>& state, const std::string& name) const;
  // Restores the draw count (when on); throws naming the layer when it is missing or not a count.
  void load_state(const std::map<std::string, Tensor>& state, const std::string& name);

 private:
  bool on_ = false;
  uint64_t base_ = 0;
  uint64_t draws_ = 0;
  std::vector<float> g_, s_;  // dYᵀ and S, [out, N]
  std::vector<T> st_;         // Sᵀ, [N, out]
};

template <typename T>
class SemiSparseLinear final : public Linear<T> {
 public:
  // Throws naming the layer unless in_features and out_features are multiples of 4.
  // `dw` on: sparse_dw (dW from S = MVUE(dYᵀ), above).
  explicit SemiSparseLinear(const LinearParams<T>& p, MvueWeightGrad<T> dw = {});

  void forward(T* out, const T* inp, int N) override;
  void backward(T* dinp, const T* dout, const T* inp, int N) override;
  std::string kind() const override { return "semi_sparse"; }
  std::string pattern() const override { return "2:4"; }
  // W ⊙ mask(W): what the next forward multiplies by.
  void dense_weight(T* out) const override;

  // With sparse_dw: "<name>.kind" and the draw count (MvueWeightGrad::add_state);
  // without, nothing (the mask is recomputed from W).
  std::map<std::string, Tensor> state() const override;
  void load_state(const std::map<std::string, Tensor>& tensors) override;

  // The transposable 2:4 mask of the current weight, [out, in].
  std::vector<uint8_t> mask() const;
  bool sparse_dw() const { return dw_.on(); }
  const MvueWeightGrad<T>& weight_grad() const { return dw_; }

 private:
  // ws_ = W ⊙ mask(W) for the current W.
  void sparsify_weight();
  std::vector<T> ws_;
  MvueWeightGrad<T> dw_;
};

template <typename T>
class SemiSparseActivationLinear final : public Linear<T> {
 public:
  // Throws naming the layer unless in_features and out_features are multiples of 4.
  SemiSparseActivationLinear(const LinearParams<T>& p, ActivationSparsity how = ActivationSparsity::row_24);

  void forward(T* out, const T* inp, int N) override;
  void backward(T* dinp, const T* dout, const T* inp, int N) override;
  std::string kind() const override { return "semi_sparse_activation"; }
  // The weight is dense; the 2:4 is on the activations.
  std::string pattern() const override { return "dense"; }

  ActivationSparsity activation() const { return how_; }
  // xs[N, in] = x with the pruned activations set to 0 (xs may not alias x).
  void sparsify_input(T* xs, const T* x, int N) const;

 private:
  ActivationSparsity how_;
  std::vector<T> xs_;
};

}  // namespace esplag
