#include "model/linear_semi_sparse.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/error.h"
#include "core/op_trace.h"
#include "core/parallel.h"
#include "model/linear_kinds.h"
#include "ops/matmul.h"
#include "sparse/masks.h"
#include "sparse/mvue.h"
#include "sparse/mvue_seed.h"
#include "sparse/transposable.h"

namespace esplag {

namespace {

template <typename T>
void check_dims_24(const LinearParams<T>& p, const char* kind) {
  ESPLAG_CHECK(p.in_features % 4 == 0 && p.out_features % 4 == 0, "linear '", p.name, "' [out ", p.out_features,
               ", in ", p.in_features, "]: kind ", kind, " needs in and out features that are multiples of 4");
  ESPLAG_CHECK(p.weight != nullptr, "linear '", p.name, "': kind ", kind, " needs a weight buffer");
}

}  // namespace

// --- sparse_dw ------------------------------------------------------------------------------

template <typename T>
const T* MvueWeightGrad<T>::draw(const LinearParams<T>& p, const T* dout, int N) {
  ESPLAG_CHECK(N % 4 == 0, "linear '", p.name, "': sparse_dw needs the tokens of a micro-batch (train.batch_size x ",
               "train.seq_len) to be a multiple of 4, as the MVUE 2:4 of dY^T keeps 2 of every 4 consecutive tokens ",
               "of an output feature; got ", N);
  const int64_t O = p.out_features, n = N;
  g_.resize(size_t(O * n));
  st_.resize(size_t(O * n));
  ScopedOp op({p.module, "bwd.dw.mvue"}, OpCategory::other, p.layer, 0, double(sizeof(T) * 2 * O * n), {dout},
              {st_.data()});
  float* g = g_.data();
  parallel_for(
      O,
      [&](int64_t o0, int64_t o1) {
        for (int64_t o = o0; o < o1; ++o)
          for (int64_t i = 0; i < n; ++i) g[o * n + i] = static_cast<float>(dout[i * O + o]);
      },
      16);
  // In place (mvue_24 allows it): g_ holds S from here on.
  cpu::mvue_24(g, g, nullptr, O, n, mvue_draw_seed(base_, draws_), p.name + " output gradient (transposed)");
  T* st = st_.data();
  parallel_for(
      n,
      [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t o = 0; o < O; ++o) st[i * O + o] = static_cast<T>(g[o * n + i]);
      },
      16);
  ++draws_;
  return st;
}

template <typename T>
void MvueWeightGrad<T>::add_state(std::map<std::string, Tensor>& state, const std::string& name) const {
  if (!on_) return;
  Tensor t = Tensor::zeros({1}, DType::f64, name + ".sparse_dw_draws");
  t.data<double>()[0] = double(draws_);
  state[name + ".sparse_dw_draws"] = t;
}

template <typename T>
void MvueWeightGrad<T>::load_state(const std::map<std::string, Tensor>& state, const std::string& name) {
  if (!on_) return;
  const Tensor& t = linear_detail::state_entry(state, name + ".sparse_dw_draws", DType::f64, {1}, name);
  const double d = t.data<double>()[0];
  ESPLAG_CHECK(d == std::floor(d) && d >= 0 && d < 9.0e15, "linear '", name, "': saved sparse_dw draw count ", d,
               " is not a count");
  draws_ = uint64_t(d);
}

// --- semi_sparse -------------------------------------------------------------------------

template <typename T>
SemiSparseLinear<T>::SemiSparseLinear(const LinearParams<T>& p, MvueWeightGrad<T> dw)
    : Linear<T>(p), dw_(std::move(dw)) {
  check_dims_24(p, "semi_sparse");
}

template <typename T>
std::map<std::string, Tensor> SemiSparseLinear<T>::state() const {
  std::map<std::string, Tensor> s;
  if (!dw_.on()) return s;
  const auto& p = this->p_;
  s[p.name + ".kind"] = linear_detail::string_tensor(p.name + ".kind", kind());
  dw_.add_state(s, p.name);
  return s;
}

template <typename T>
void SemiSparseLinear<T>::load_state(const std::map<std::string, Tensor>& tensors) {
  const auto& p = this->p_;
  linear_detail::check_state_kind(tensors, p.name, kind());
  dw_.load_state(tensors, p.name);
}

template <typename T>
std::vector<uint8_t> SemiSparseLinear<T>::mask() const {
  const auto& p = this->p_;
  return cpu::transposable_mask_greedy(p.weight, p.out_features, p.in_features);
}

template <typename T>
void SemiSparseLinear<T>::sparsify_weight() {
  const auto& p = this->p_;
  const size_t n = size_t(p.out_features) * p.in_features;
  ws_.resize(n);
  ScopedOp op({p.module, "sparsify"}, OpCategory::other, p.layer, 0, double(sizeof(T) * 2 * n), {p.weight},
              {ws_.data()});
  const std::vector<uint8_t> m = mask();
  for (size_t i = 0; i < n; ++i) ws_[i] = m[i] ? p.weight[i] : T(0);
}

template <typename T>
void SemiSparseLinear<T>::dense_weight(T* out) const {
  const auto& p = this->p_;
  const std::vector<uint8_t> m = mask();
  for (size_t i = 0; i < m.size(); ++i) out[i] = m[i] ? p.weight[i] : T(0);
}

template <typename T>
void SemiSparseLinear<T>::forward(T* out, const T* inp, int N) {
  const auto& p = this->p_;
  sparsify_weight();
  const double M = N, K = p.in_features, O = p.out_features;
  ScopedOp op({p.module, "fwd"}, OpCategory::sparse_gemm, p.layer, M * K * O,
              sizeof(T) * (M * K + K * O / 2 + M * O), {inp, p.weight}, {out});
  cpu::linear_forward(out, this->operand(ProductOperand::input, inp, int64_t(N) * p.in_features),
                      this->operand(ProductOperand::weight, ws_.data(), int64_t(ws_.size())), p.bias, N, p.in_features,
                      p.out_features);
}

template <typename T>
void SemiSparseLinear<T>::backward(T* dinp, const T* dout, const T* inp, int N) {
  const auto& p = this->p_;
  const double M = N, K = p.in_features, O = p.out_features;
  const T* dy = this->operand(ProductOperand::grad, dout, int64_t(N) * p.out_features);
  if (dinp) {
    // The weight has not changed since the forward, so the mask is the forward's; it is
    // recomputed rather than cached so that backward never sees a stale copy.
    sparsify_weight();
    ScopedOp op({p.module, "bwd.dx"}, OpCategory::sparse_gemm, p.layer, M * K * O,
                sizeof(T) * (2 * M * K + K * O / 2 + M * O), {dout, p.weight}, {dinp});
    cpu::linear_backward(dinp, static_cast<T*>(nullptr), static_cast<T*>(nullptr), dy, inp,
                         this->operand(ProductOperand::weight, ws_.data(), int64_t(ws_.size())), N, p.in_features,
                         p.out_features);
  }
  const T* x = this->operand(ProductOperand::input, inp, int64_t(N) * p.in_features);
  if (dw_.on()) {
    // dW = S·X, S = MVUE(dYᵀ) 2:4 along the tokens (the product's reduction dimension); the
    // bias gradient from dY itself, exact.
    const T* st = dw_.draw(p, dout, N);
    ScopedOp op({p.module, "bwd.dw"}, OpCategory::sparse_gemm, p.layer, M * K * O,
                sizeof(T) * (M * K + 2 * K * O + M * O / 2) + M * O / 8, {st, dout, inp}, {p.dweight, p.dbias});
    cpu::linear_backward(static_cast<T*>(nullptr), p.dweight, static_cast<T*>(nullptr),
                         this->operand(ProductOperand::grad, st, int64_t(N) * p.out_features), x, p.weight, N,
                         p.in_features, p.out_features);
    this->bias_backward(dout, N);
    return;
  }
  ScopedOp op({p.module, "bwd.dw"}, OpCategory::dense_gemm, p.layer, 2 * M * K * O,
              sizeof(T) * (M * K + 2 * K * O + M * O), {dout, inp}, {p.dweight, p.dbias});
  cpu::linear_backward(static_cast<T*>(nullptr), p.dweight, static_cast<T*>(nullptr), dy, x, p.weight, N,
                       p.in_features, p.out_features);
  this->bias_backward(dout, N);
}

// --- semi_sparse_activation ------------------------------------------------------------------

template <typename T>
SemiSparseActivationLinear<T>::SemiSparseActivationLinear(const LinearParams<T>& p, ActivationSparsity how)
    : Linear<T>(p), how_(how) {
  check_dims_24(p, "semi_sparse_activation");
}

template <typename T>
void SemiSparseActivationLinear<T>::sparsify_input(T* xs, const T* x, int N) const {
  const int64_t C = this->p_.in_features;
  const size_t n = size_t(N) * C;
  if (how_ == ActivationSparsity::row_24) {
    const std::vector<uint8_t> m = cpu::nm_mask(x, N, C, 2, 4);
    for (size_t i = 0; i < n; ++i) xs[i] = m[i] ? x[i] : T(0);
    return;
  }
  // Zero rows pad the tokens to whole tiles; they rank below every non-zero value, so they
  // never displace a real activation.
  const int64_t N4 = (int64_t(N) + 3) / 4 * 4;
  std::vector<T> padded(size_t(N4 * C), T(0));
  std::copy_n(x, n, padded.begin());
  const std::vector<uint8_t> m = cpu::transposable_mask_greedy(padded.data(), N4, C);
  for (size_t i = 0; i < n; ++i) xs[i] = m[i] ? x[i] : T(0);
}

template <typename T>
void SemiSparseActivationLinear<T>::forward(T* out, const T* inp, int N) {
  const auto& p = this->p_;
  xs_.resize(size_t(N) * p.in_features);
  {
    ScopedOp op({p.module, "sparsify"}, OpCategory::other, p.layer, 0, double(sizeof(T) * 2 * xs_.size()), {inp},
                {xs_.data()});
    sparsify_input(xs_.data(), inp, N);
  }
  const double M = N, K = p.in_features, O = p.out_features;
  ScopedOp op({p.module, "fwd"}, OpCategory::sparse_gemm, p.layer, M * K * O,
              sizeof(T) * (M * K / 2 + K * O + M * O), {xs_.data(), p.weight}, {out});
  cpu::linear_forward(out, this->operand(ProductOperand::input, xs_.data(), int64_t(xs_.size())),
                      this->operand(ProductOperand::weight, p.weight, int64_t(p.out_features) * p.in_features),
                      p.bias, N, p.in_features, p.out_features);
}

template <typename T>
void SemiSparseActivationLinear<T>::backward(T* dinp, const T* dout, const T* inp, int N) {
  const auto& p = this->p_;
  const double M = N, K = p.in_features, O = p.out_features;
  const T* dy = this->operand(ProductOperand::grad, dout, int64_t(N) * p.out_features);
  if (dinp) {
    ScopedOp op({p.module, "bwd.dx"}, OpCategory::dense_gemm, p.layer, 2 * M * K * O,
                sizeof(T) * (2 * M * K + K * O + M * O), {dout, p.weight}, {dinp});
    cpu::linear_backward(dinp, static_cast<T*>(nullptr), static_cast<T*>(nullptr), dy, inp,
                         this->operand(ProductOperand::weight, p.weight, int64_t(p.out_features) * p.in_features), N,
                         p.in_features, p.out_features);
  }
  // Recomputed from inp (the same input the forward pruned), not kept from the forward.
  xs_.resize(size_t(N) * p.in_features);
  {
    ScopedOp op({p.module, "sparsify"}, OpCategory::other, p.layer, 0, double(sizeof(T) * 2 * xs_.size()), {inp},
                {xs_.data()});
    sparsify_input(xs_.data(), inp, N);
  }
  ScopedOp op({p.module, "bwd.dw"}, how_ == ActivationSparsity::tile_24 ? OpCategory::sparse_gemm : OpCategory::dense_gemm,
              p.layer, how_ == ActivationSparsity::tile_24 ? M * K * O : 2 * M * K * O,
              sizeof(T) * (M * K / 2 + 2 * K * O + M * O), {dout, xs_.data()}, {p.dweight, p.dbias});
  cpu::linear_backward(static_cast<T*>(nullptr), p.dweight, static_cast<T*>(nullptr), dy,
                       this->operand(ProductOperand::input, xs_.data(), int64_t(xs_.size())), p.weight, N,
                       p.in_features, p.out_features);
  this->bias_backward(dout, N);
}

template class MvueWeightGrad<float>;
template class MvueWeightGrad<double>;
template class SemiSparseLinear<float>;
template class SemiSparseLinear<double>;
template class SemiSparseActivationLinear<float>;
template class SemiSparseActivationLinear<double>;

}  // namespace esplag
