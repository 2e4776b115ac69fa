#include "model/linear_slope.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/error.h"
#include "core/op_trace.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "ops/matmul.h"
#include "sparse/double_prune.h"
#include "sparse/masks.h"

namespace esplag {

namespace {

// dst [cols, rows] = src [rows, cols]ᵀ, in 32 × 32 tiles (a 1B model's weights are
// transposed at every SLoPe mask refresh and host write-back: row by row, every write of a
// large matrix would miss the cache).
template <typename T>
void transpose(T* dst, const T* src, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) dst[c * rows + r] = src[r * cols + c];
    }
}

// out[N, rows] = x · Wᵀ + bias with W compressed 2:4: the sparse layer's reference for
// float, the same walk over the slots for other types.
template <typename T>
void compressed_linear(T* out, const T* x, const Compressed24T<T>& w, const linear_detail::SlotIndex& s,
                       const T* bias, int64_t N) {
  if constexpr (std::is_same_v<T, float>)
    cpu::linear_24(out, x, w, bias, N);
  else
    linear_detail::slot_linear(out, x, s, w.values.data(), bias, N);
}

// out [rows, cols] = c with zeros outside its slots, read from the metadata (the slot
// index is the CPU products' state, which a GPU run's twin does not hold).
template <typename T>
void decompress(T* out, const Compressed24T<T>& c) {
  const int64_t per_row = c.cols / 2;
  std::fill(out, out + c.rows * c.cols, T(0));
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t g = 0; g < c.cols / 4; ++g)
      for (int j = 0; j < 2; ++j) out[r * c.cols + c.column(r, g, j)] = c.values[r * per_row + 2 * g + j];
}

// f(o, c) for every position [out, in] the forward mask keeps: W1's slots (row-wise 2:4
// keeps exactly 2 of every 4, so W1 has no padding).
template <typename T, typename F>
void for_each_forward(const Compressed24T<T>& w1, F f) {
  for (int64_t o = 0; o < w1.rows; ++o)
    for (int64_t g = 0; g < w1.cols / 4; ++g)
      for (int j = 0; j < 2; ++j) f(o, w1.column(o, g, j));
}

// f(o, c) for every position [out, in] the backward mask keeps: W2ᵀ's slots within the
// forward mask. A group of W2ᵀ is padded only when it holds fewer than 2 forward-kept
// values, all of which it then keeps, so its padding lies outside the forward mask.
template <typename T, typename F>
void for_each_backward(const Compressed24T<T>& w1, const Compressed24T<T>& w2t, F f) {
  for (int64_t c = 0; c < w2t.rows; ++c)
    for (int64_t g = 0; g < w2t.cols / 4; ++g)
      for (int j = 0; j < 2; ++j) {
        const int64_t o = w2t.column(c, g, j);
        if (w1.column(o, c / 4, 0) == c || w1.column(o, c / 4, 1) == c) f(o, c);
      }
}

// The positions `each` calls for as a mask [rows, cols] and as 4×4 tile bits (sparse/masks.h).
template <typename Each>
std::vector<uint8_t> mask_of(int64_t rows, int64_t cols, Each each) {
  std::vector<uint8_t> m(size_t(rows * cols), 0);
  each([&](int64_t r, int64_t c) { m[r * cols + c] = 1; });
  return m;
}
template <typename Each>
std::vector<uint16_t> tiles_of(int64_t rows, int64_t cols, Each each) {
  std::vector<uint16_t> t(size_t(rows / 4 * (cols / 4)), 0);
  each([&](int64_t r, int64_t c) { t[(r / 4) * (cols / 4) + c / 4] |= uint16_t(1u << (4 * (r % 4) + c % 4)); });
  return t;
}

// W2ᵀ's values [in, out/2] (slots `s`): W1 (dense [out, in], zero outside the forward mask)
// at W2ᵀ's slots, so 0 at its padding, which lies outside the forward mask. Consecutive
// rows c of W2ᵀ read neighbouring columns of W1, so a cache line read for one row serves
// the next.
template <typename T>
void fill_backward_values(T* values, const linear_detail::SlotIndex& s, const T* w1_dense) {
  for (int64_t c = 0; c < s.rows; ++c)
    for (int64_t j = 0; j < s.per_row; ++j) values[c * s.per_row + j] = w1_dense[s.col[c * s.per_row + j] * s.rows + c];
}

template <typename V>
size_t capacity_bytes(const std::vector<V>& v) {
  return v.capacity() * sizeof(V);
}

}  // namespace

template <typename T>
SlopeLinear<T>::SlopeLinear(const LinearParams<T>& p, int mask_change_freq, MvueWeightGrad<T> dw)
    : Linear<T>(p), freq_(mask_change_freq), dw_(std::move(dw)) {
  ESPLAG_CHECK(p.weight != nullptr, "linear '", p.name, "': kind slope needs a weight buffer");
  ESPLAG_CHECK(p.in_features % 4 == 0 && p.out_features % 4 == 0, "linear '", p.name, "' [out ", p.out_features,
               ", in ", p.in_features,
               "]: kind slope needs in and out features that are multiples of 4 (row-wise 2:4 of W, "
               "column-wise 2:4 of its backward copy)");
  const int64_t O = p.out_features, C = p.in_features;
  dvalues_ = ZeroedArray<T>(size_t(O * C / 2));
  {
    ScopedOp op({p.module, "prune"}, OpCategory::other, p.layer, 0, double(sizeof(T) * 2 * O * C), {p.weight},
                {p.weight});
    const std::vector<uint8_t> fwd_mask = cpu::nm_mask(p.weight, O, C, 2, 4);
    w1_ = linear_detail::compress_24_masked(p.weight, fwd_mask.data(), O, C, p.name);
  }
  decompress(p.weight, w1_);
  refresh_backward_mask();
}

template <typename T>
SlopeLinear<T>::SlopeLinear(const LinearParams<T>& p, const SlopeLinear& prev, int mask_change_freq,
                            MvueWeightGrad<T> dw)
    : Linear<T>(p), freq_(mask_change_freq), dw_(std::move(dw)) {
  const auto& q = prev.params();
  ESPLAG_CHECK(q.name == p.name && q.in_features == p.in_features && q.out_features == p.out_features,
               "linear '", p.name, "' [out ", p.out_features, ", in ", p.in_features,
               "]: cannot continue the slope layer '", q.name, "' [out ", q.out_features, ", in ", q.in_features,
               "]");
  refresh_step_ = prev.refresh_step_;
  w1_ = prev.w1_;
  w2t_ = {prev.w2t_.rows, prev.w2t_.cols, {}, prev.w2t_.meta};  // the defining part; the products build the rest
  dvalues_ = ZeroedArray<T>(w1_.values.size());
  rank_ = prev.rank_;
  l_ = prev.l_;
  r_ = prev.r_;
  dl_.assign(l_.size(), T(0));
  dr_.assign(r_.size(), T(0));
  sync();
}

template <typename T>
void SlopeLinear<T>::refresh_backward_mask() {
  const auto& p = this->p_;
  const int64_t O = p.out_features, C = p.in_features;
  scratch_.resize(size_t(O * C));
  tmp_.resize(size_t(O * C));
  ScopedOp op({p.module, "double_prune"}, OpCategory::other, p.layer, 0, double(sizeof(T) * 2 * O * C),
              {w1_.values.data()}, {w2t_.values.data()});
  decompress(scratch_.data(), w1_);
  const std::vector<uint8_t> bwd = cpu::double_prune_backward_mask(scratch_.data(), forward_mask().data(), O, C);
  std::vector<uint8_t> bwd_t(size_t(O * C));
  transpose(bwd_t.data(), bwd.data(), O, C);
  transpose(tmp_.data(), scratch_.data(), O, C);
  Compressed24T<T> c =
      linear_detail::compress_24_masked(tmp_.data(), bwd_t.data(), C, O, p.name + " (backward copy)");
  w2t_.rows = c.rows;
  w2t_.cols = c.cols;
  w2t_.meta = std::move(c.meta);
  if (!has_cpu_products()) {  // a layer that runs no CPU product (yet) keeps no work buffers either
    release_work_buffers();
    return;
  }
  // Refilled in place, so that the backward copy keeps one buffer (its identity for the
  // profiler) across refreshes.
  std::copy(c.values.begin(), c.values.end(), w2t_.values.begin());
  s2t_ = linear_detail::slot_index(w2t_);
}

template <typename T>
void SlopeLinear<T>::ensure_cpu_products() {
  if (has_cpu_products()) return;
  s1_ = linear_detail::slot_index(w1_);
  s2t_ = linear_detail::slot_index(w2t_);
  std::vector<T> w1(size_t(w1_.rows * w1_.cols));
  decompress(w1.data(), w1_);
  w2t_.values.resize(size_t(w2t_.rows * w2t_.cols / 2));
  fill_backward_values(w2t_.values.data(), s2t_, w1.data());
}

template <typename T>
void SlopeLinear<T>::sync() {
  const auto& p = this->p_;
  decompress(p.weight, w1_);
  if (has_cpu_products()) fill_backward_values(w2t_.values.data(), s2t_, p.weight);
}

template <typename T>
void SlopeLinear<T>::on_step_begin(int64_t step) {
  if (refresh_step_ < 0) {
    refresh_step_ = step;
    return;
  }
  if (freq_ > 0 && step - refresh_step_ >= freq_) {
    refresh_backward_mask();
    refresh_step_ = step;
  }
}

template <typename T>
void SlopeLinear<T>::after_optimizer_step() {
  const auto& p = this->p_;
  ScopedOp op({p.module, "sync"}, OpCategory::memcpy, p.layer, 0,
              double(sizeof(T) * 3 * p.out_features * p.in_features), {w1_.values.data()},
              {p.weight, w2t_.values.data()});
  sync();
}

template <typename T>
std::string SlopeLinear<T>::adapter_name(const char* what) const {
  const auto& p = this->p_;
  return (p.module.empty() ? p.name : p.module) + "." + what;
}

template <typename T>
std::vector<OwnedParam<T>> SlopeLinear<T>::owned_params() {
  const auto& p = this->p_;
  std::vector<OwnedParam<T>> out;
  out.push_back({p.name + ".values", {p.out_features, p.in_features / 2}, w1_.values.data(), dvalues_.data(), true});
  if (rank_ > 0) {
    out.push_back({adapter_name("lora_l"), {p.out_features, rank_}, l_.data(), dl_.data(), true});
    out.push_back({adapter_name("lora_r"), {rank_, p.in_features}, r_.data(), dr_.data(), true});
  }
  return out;
}

template <typename T>
void SlopeLinear<T>::enable_lora(int rank, uint64_t seed) {
  const auto& p = this->p_;
  ESPLAG_CHECK(rank >= 1 && rank <= std::min(p.in_features, p.out_features), "linear '", p.name,
               "': adapter rank ", rank, " is outside [1, min(in, out) = ", std::min(p.in_features, p.out_features),
               "]");
  if (rank_ == rank) return;
  ESPLAG_CHECK(rank_ == 0, "linear '", p.name, "': the adapter already has rank ", rank_, ", cannot change it to ",
               rank);
  rank_ = rank;
  l_ = initial_lora_l(p.out_features, rank, seed);
  r_.assign(size_t(rank) * p.in_features, T(0));
  dl_.assign(l_.size(), T(0));
  dr_.assign(r_.size(), T(0));
}

template <typename T>
std::vector<T> SlopeLinear<T>::initial_lora_l(int64_t out, int rank, uint64_t seed) {
  Rng rng(seed);
  std::vector<T> l(size_t(out) * size_t(rank));
  fill_normal(rng, l.data(), l.size(), 1.0 / std::sqrt(double(rank)));
  return l;
}

template <typename T>
void SlopeLinear<T>::adapter_forward_add(T* out, const T* inp, int N) {
  const auto& p = this->p_;
  const int O = p.out_features, r = rank_;
  t_.resize(size_t(N) * r);
  ScopedOp op({p.module, "fwd.lora"}, OpCategory::dense_gemm, p.layer, 2.0 * N * r * (p.in_features + O),
              sizeof(T) * (double(N) * (p.in_features + r + O) + double(r) * (p.in_features + O)),
              {inp, r_.data(), l_.data()}, {out});
  cpu::linear_forward(t_.data(), inp, r_.data(), static_cast<const T*>(nullptr), N, p.in_features, r);
  const T* t = t_.data();
  const T* l = l_.data();
  // Added to each output element one rank term at a time, the order merged_forward uses.
  parallel_for(
      int64_t(N) * O,
      [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e) {
          const T* te = t + (e / O) * r;
          const T* le = l + (e % O) * r;
          T acc = out[e];
          for (int k = 0; k < r; ++k) acc += te[k] * le[k];
          out[e] = acc;
        }
      },
      256);
}

template <typename T>
const Compressed24T<T>& SlopeLinear<T>::product_weight(const Compressed24T<T>& c) {
  return linear_detail::with_values(
      c, this->operand(ProductOperand::weight, c.values.data(), int64_t(c.values.size())), wq_);
}

template <typename T>
void SlopeLinear<T>::forward(T* out, const T* inp, int N) {
  const auto& p = this->p_;
  ensure_cpu_products();
  {
    const double M = N, K = p.in_features, O = p.out_features;
    ScopedOp op({p.module, "fwd"}, OpCategory::sparse_gemm, p.layer, M * K * O,
                sizeof(T) * (M * K + K * O / 2 + M * O) + K * O / 8, {inp, w1_.values.data()}, {out});
    compressed_linear(out, this->operand(ProductOperand::input, inp, int64_t(N) * p.in_features),
                      product_weight(w1_), s1_, p.bias, N);
  }
  if (rank_ > 0) adapter_forward_add(out, inp, N);
}

template <typename T>
void SlopeLinear<T>::merged_forward(T* out, const T* inp, int N) const {
  const auto& p = this->p_;
  const int O = p.out_features, C = p.in_features, r = rank_;
  std::vector<T> t(size_t(N) * r);
  if (r > 0) cpu::linear_forward(t.data(), inp, r_.data(), static_cast<const T*>(nullptr), N, C, r);
  const T* vals = w1_.values.data();
  const linear_detail::SlotIndex s1 = linear_detail::slot_index(w1_);  // for this call: inference holds no products
  const int32_t* cols = s1.col.data();
  const int64_t per_row = s1.per_row;
  parallel_for(
      int64_t(N) * O,
      [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t n = e / O, o = e % O;
          const T* x = inp + n * C;
          T acc = p.bias ? p.bias[o] : T(0);
          for (int64_t j = 0; j < per_row; ++j) acc += x[cols[o * per_row + j]] * vals[o * per_row + j];
          const T* te = t.data() + n * r;
          const T* le = l_.data() + o * r;
          for (int k = 0; k < r; ++k) acc += te[k] * le[k];
          out[e] = acc;
        }
      },
      256);
}

template <typename T>
void SlopeLinear<T>::backward(T* dinp, const T* dout, const T* inp, int N) {
  const auto& p = this->p_;
  ensure_cpu_products();
  const int64_t O = p.out_features, C = p.in_features;
  const double M = N, K = double(C), Od = double(O);
  const T* dy = this->operand(ProductOperand::grad, dout, int64_t(N) * O);
  if (dinp) {
    tmp_.resize(size_t(N) * C);
    ScopedOp op({p.module, "bwd.dx"}, OpCategory::sparse_gemm, p.layer, M * K * Od,
                sizeof(T) * (2 * M * K + K * Od / 2 + M * Od) + K * Od / 8, {dout, w2t_.values.data()}, {dinp});
    compressed_linear(tmp_.data(), dy, product_weight(w2t_), s2t_, static_cast<const T*>(nullptr), N);
    for (size_t i = 0; i < tmp_.size(); ++i) dinp[i] += tmp_[i];
  }
  const T* x = this->operand(ProductOperand::input, inp, int64_t(N) * C);
  if (dw_.on()) {
    // sparse_dw: the product S·X with S = MVUE(dYᵀ), 2:4 along the tokens, then the same
    // gather; the bias gradient from dY itself, exact.
    const T* st = dw_.draw(p, dout, N);
    scratch_.assign(size_t(O * C), T(0));
    ScopedOp op({p.module, "bwd.dw"}, OpCategory::sparse_gemm, p.layer, M * K * Od,
                sizeof(T) * (M * K + K * Od / 2 + M * Od / 2) + M * Od / 8, {st, dout, inp},
                {dvalues_.data(), p.dbias});
    cpu::linear_backward(static_cast<T*>(nullptr), scratch_.data(), static_cast<T*>(nullptr),
                         this->operand(ProductOperand::grad, st, int64_t(N) * O), x, p.weight, N, int(C), int(O));
    this->bias_backward(dout, N);
    linear_detail::gather_add(dvalues_.data(), s1_, scratch_.data(), static_cast<const uint8_t*>(nullptr));
  } else {
    // On the GPU the gather of the kept positions is the dW GEMM's epilogue; here the dense
    // product is formed first.
    scratch_.assign(size_t(O * C), T(0));
    ScopedOp op({p.module, "bwd.dw"}, OpCategory::dense_gemm, p.layer, 2 * M * K * Od,
                sizeof(T) * (M * K + K * Od / 2 + M * Od), {dout, inp}, {dvalues_.data(), p.dbias});
    cpu::linear_backward(static_cast<T*>(nullptr), scratch_.data(), static_cast<T*>(nullptr), dy, x, p.weight, N,
                         int(C), int(O));
    this->bias_backward(dout, N);
    linear_detail::gather_add(dvalues_.data(), s1_, scratch_.data(), static_cast<const uint8_t*>(nullptr));
  }
  if (rank_ > 0) {
    const int r = rank_;
    t_.resize(size_t(N) * r);
    dt_.assign(size_t(N) * r, T(0));
    ScopedOp op({p.module, "bwd.lora"}, OpCategory::dense_gemm, p.layer, 2.0 * M * r * (3 * K + 2 * Od),
                sizeof(T) * (M * (2 * K + Od + 2 * r) + 2.0 * r * (K + Od)), {dout, inp, l_.data(), r_.data()},
                {dinp, dl_.data(), dr_.data()});
    cpu::linear_forward(t_.data(), inp, r_.data(), static_cast<const T*>(nullptr), N, int(C), r);
    // dt = dY·L, dL += dYᵀ·t; then dX += dt·R, dR += dtᵀ·X.
    cpu::linear_backward(dt_.data(), dl_.data(), static_cast<T*>(nullptr), dout, t_.data(), l_.data(), N, r, int(O));
    cpu::linear_backward(dinp, dr_.data(), static_cast<T*>(nullptr), dt_.data(), inp, r_.data(), N, int(C), r);
  }
}

template <typename T>
void SlopeLinear<T>::sparse_weight(T* out) const {
  decompress(out, w1_);
}

template <typename T>
void SlopeLinear<T>::dense_weight(T* out) const {
  const auto& p = this->p_;
  const int64_t O = p.out_features, C = p.in_features;
  sparse_weight(out);
  if (rank_ == 0) return;
  for (int64_t o = 0; o < O; ++o)
    for (int64_t c = 0; c < C; ++c) {
      T acc = out[o * C + c];
      for (int k = 0; k < rank_; ++k) acc += l_[o * rank_ + k] * r_[k * C + c];
      out[o * C + c] = acc;
    }
}

template <typename T>
std::map<std::string, Tensor> SlopeLinear<T>::state() const {
  const auto& p = this->p_;
  using namespace linear_detail;
  std::map<std::string, Tensor> s;
  s[p.name + ".kind"] = string_tensor(p.name + ".kind", kind());
  s[p.name + ".meta"] = u16_tensor(p.name + ".meta", w1_.meta, {w1_.rows, w1_.meta_stride()});
  s[p.name + ".backward_meta"] = u16_tensor(p.name + ".backward_meta", w2t_.meta, {w2t_.rows, w2t_.meta_stride()});
  Tensor step = Tensor::zeros({1}, DType::f64, p.name + ".refresh_step");
  step.data<double>()[0] = double(refresh_step_);
  s[p.name + ".refresh_step"] = step;
  dw_.add_state(s, p.name);
  return s;
}

template <typename T>
void SlopeLinear<T>::load_state(const std::map<std::string, Tensor>& tensors) {
  const auto& p = this->p_;
  using namespace linear_detail;
  const int64_t O = p.out_features, C = p.in_features;
  check_state_kind(tensors, p.name, kind());
  const Tensor& meta = state_entry(tensors, p.name + ".meta", DType::u16, {O, w1_.meta_stride()}, p.name);
  const Tensor& bmeta = state_entry(tensors, p.name + ".backward_meta", DType::u16, {C, w2t_.meta_stride()}, p.name);
  const Tensor& step = state_entry(tensors, p.name + ".refresh_step", DType::f64, {1}, p.name);
  const double rs = step.data<double>()[0];
  ESPLAG_CHECK(rs == std::floor(rs) && rs >= -1 && rs < 9.0e15, "linear '", p.name, "': saved refresh step ", rs,
               " is not a step");
  dw_.load_state(tensors, p.name);
  Compressed24T<T> w1 = compressed_24_from_meta<T>(meta.data<uint16_t>(), O, C, p.name);
  Compressed24T<T> w2t = compressed_24_from_meta<T>(bmeta.data<uint16_t>(), C, O, p.name + " (backward copy)");
  w1.values = std::move(w1_.values);  // the trained values stay; they belong to the saved masks
  w1_ = std::move(w1);
  w2t_ = {w2t.rows, w2t.cols, {}, std::move(w2t.meta)};
  s1_ = {};  // the CPU products' state belonged to the old masks: the next product builds it
  s2t_ = {};
  refresh_step_ = int64_t(rs);
  sync();
  release_work_buffers();
}

template <typename T>
std::vector<uint8_t> SlopeLinear<T>::forward_mask() const {
  return mask_of(w1_.rows, w1_.cols, [&](auto f) { for_each_forward(w1_, f); });
}

template <typename T>
std::vector<uint8_t> SlopeLinear<T>::backward_mask() const {
  return mask_of(w1_.rows, w1_.cols, [&](auto f) { for_each_backward(w1_, w2t_, f); });
}

template <typename T>
std::vector<uint16_t> SlopeLinear<T>::forward_tiles() const {
  return tiles_of(w1_.rows, w1_.cols, [&](auto f) { for_each_forward(w1_, f); });
}

template <typename T>
std::vector<uint16_t> SlopeLinear<T>::backward_tiles() const {
  return tiles_of(w1_.rows, w1_.cols, [&](auto f) { for_each_backward(w1_, w2t_, f); });
}

template <typename T>
Compressed24T<T> SlopeLinear<T>::backward_weight() const {
  Compressed24T<T> c{w2t_.rows, w2t_.cols, std::vector<T>(size_t(w2t_.rows * w2t_.cols / 2)), w2t_.meta};
  std::vector<T> w1(size_t(w1_.rows * w1_.cols));
  decompress(w1.data(), w1_);
  fill_backward_values(c.values.data(), linear_detail::slot_index(c), w1.data());
  return c;
}

template <typename T>
size_t SlopeLinear<T>::host_bytes() const {
  size_t n = 0;
  for (const auto* v : {&w1_.values, &w2t_.values, &wq_.values, &l_, &r_, &dl_, &dr_, &scratch_, &tmp_, &t_, &dt_})
    n += capacity_bytes(*v);
  for (const auto* m : {&w1_.meta, &w2t_.meta, &wq_.meta}) n += capacity_bytes(*m);
  return n + capacity_bytes(s1_.col) + capacity_bytes(s2t_.col);
}

template <typename T>
void SlopeLinear<T>::release_work_buffers() {
  std::vector<T>().swap(scratch_);
  std::vector<T>().swap(tmp_);
}

template class SlopeLinear<float>;
template class SlopeLinear<double>;

}  // namespace esplag
