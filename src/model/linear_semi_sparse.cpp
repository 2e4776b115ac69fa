#include "model/linear_semi_sparse.h"

#include <algorithm>

#include "core/error.h"
#include "core/op_trace.h"
#include "ops/matmul.h"
#include "sparse/masks.h"
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

std::string activation_sparsity_name(ActivationSparsity a) {
  return a == ActivationSparsity::row_24 ? "row_24" : "tile_24";
}

// --- semi_sparse -------------------------------------------------------------------------

template <typename T>
SemiSparseLinear<T>::SemiSparseLinear(const LinearParams<T>& p) : Linear<T>(p) {
  check_dims_24(p, "semi_sparse");
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
  cpu::linear_forward(out, inp, ws_.data(), p.bias, N, p.in_features, p.out_features);
}

template <typename T>
void SemiSparseLinear<T>::backward(T* dinp, const T* dout, const T* inp, int N) {
  const auto& p = this->p_;
  const double M = N, K = p.in_features, O = p.out_features;
  if (dinp) {
    // The weight has not changed since the forward, so the mask is the forward's; it is
    // recomputed rather than cached so that backward never sees a stale copy.
    sparsify_weight();
    ScopedOp op({p.module, "bwd.dx"}, OpCategory::sparse_gemm, p.layer, M * K * O,
                sizeof(T) * (2 * M * K + K * O / 2 + M * O), {dout, p.weight}, {dinp});
    cpu::linear_backward(dinp, static_cast<T*>(nullptr), static_cast<T*>(nullptr), dout, inp, ws_.data(), N,
                         p.in_features, p.out_features);
  }
  ScopedOp op({p.module, "bwd.dw"}, OpCategory::dense_gemm, p.layer, 2 * M * K * O,
              sizeof(T) * (M * K + 2 * K * O + M * O), {dout, inp}, {p.dweight, p.dbias});
  cpu::linear_backward(static_cast<T*>(nullptr), p.dweight, p.dbias, dout, inp, p.weight, N, p.in_features,
                       p.out_features);
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
  cpu::linear_forward(out, xs_.data(), p.weight, p.bias, N, p.in_features, p.out_features);
}

template <typename T>
void SemiSparseActivationLinear<T>::backward(T* dinp, const T* dout, const T* inp, int N) {
  const auto& p = this->p_;
  const double M = N, K = p.in_features, O = p.out_features;
  if (dinp) {
    ScopedOp op({p.module, "bwd.dx"}, OpCategory::dense_gemm, p.layer, 2 * M * K * O,
                sizeof(T) * (2 * M * K + K * O + M * O), {dout, p.weight}, {dinp});
    cpu::linear_backward(dinp, static_cast<T*>(nullptr), static_cast<T*>(nullptr), dout, inp, p.weight, N,
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
  cpu::linear_backward(static_cast<T*>(nullptr), p.dweight, p.dbias, dout, xs_.data(), p.weight, N, p.in_features,
                       p.out_features);
}

template class SemiSparseLinear<float>;
template class SemiSparseLinear<double>;
template class SemiSparseActivationLinear<float>;
template class SemiSparseActivationLinear<double>;

}  // namespace esplag
