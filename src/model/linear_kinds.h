// Building Linear kinds by name (docs/linear-kinds.md): the options a recipe step turns
// into, the factory (a lookup in the kind registry, model/linear_registry.h), and the
// compressed-form helpers the compressed kinds (slope, vnm) share.
//
//   LinearOptions o;  o.kind = "vnm";  o.pattern = SparsityPattern::vnm(64, 2, 8);
//   auto impl = make_linear(model.linear_params(name), o, &model.linear(name));
//   model.replace_linear(name, std::move(impl));
//
// `previous` (the layer being replaced, or null) carries state across a rebuild:
//   - vnm from a masked layer keeps that layer's mask (kernel replacement after GMP), from
//     a vnm layer its compressed weight and indices;
//   - slope from a slope layer continues it (masks, values, refresh counter, adapters);
//   - the LoRA wrapper keeps the previous wrapper's adapters when the rank is unchanged,
//     and builds its inner kind with the previous inner kind as `previous`;
//   - with sparse_dw, semi_sparse or slope after a layer with sparse_dw goes on with its
//     count of MVUE draws (no draw is taken twice).
// Everything else is built afresh from the flat-buffer weight.
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/linear.h"
#include "model/linear_semi_sparse.h"
#include "sparse/compressed.h"
#include "sparse/pattern.h"

namespace esplag {

struct LinearOptions {
  // One of linear_kind_names().
  std::string kind = "dense";
  // masked: the mask's pattern (unstructured uses `sparsity`); vnm: V:2:M, or 2:M (one
  // row per block, e.g. 2:4); ignored by the other kinds.
  SparsityPattern pattern;
  // masked with an unstructured pattern: fraction of zeros; when 0, pattern.sparsity is
  // used (so a GMP ramp can pass the final pattern and the current sparsity).
  double sparsity = 0.0;
  // slope: steps between refreshes of the double-pruned backward mask (<= 0: never).
  int mask_change_freq = 100;
  // semi_sparse_activation: how the activations are pruned.
  ActivationSparsity activation = ActivationSparsity::row_24;
  // Low-rank adapter, present when lora_rank > 0 and lora_enabled. slope has its own
  // (lazy, W1 + L·R); every other kind gets the LoraLinear wrapper (W + alpha/r·B·A).
  int lora_rank = 0;
  double lora_alpha = 0.0;  // wrapper only; <= 0 means alpha = rank (scale 1)
  bool lora_enabled = false;
  // semi_sparse, slope: the weight gradient from S = MVUE(dYᵀ), the unbiased 2:4 estimate
  // of the output gradient along the tokens, instead of dYᵀ (MvueWeightGrad in
  // model/linear_semi_sparse.h); the other kinds refuse it.
  bool sparse_dw = false;
  // Adapter initialisation and sparse_dw's draws; mixed with the weight's name so layers
  // differ.
  uint64_t seed = 0;

  friend bool operator==(const LinearOptions&, const LinearOptions&) = default;
};

// The names of linear_kinds() (model/linear_registry.h): "dense", "masked", "semi_sparse",
// "semi_sparse_activation", "slope", "vnm", then any registered kinds.
std::vector<std::string> linear_kind_names();

// Builds the registered kind o.kind (its make_cpu), wrapped in the LoRA adapter where asked
// for and the kind has no adapter of its own. Throws Error naming the layer for an unknown
// kind (listing the known ones), an option the kind does not take (sparse_dw), a shape the
// kind cannot use, or a `previous` layer whose state does not fit.
template <typename T>
std::unique_ptr<Linear<T>> make_linear(const LinearParams<T>& params, const LinearOptions& options,
                                       const Linear<T>* previous = nullptr);

// The seed an adapter of layer `name` draws from: `seed` mixed with a hash of the name
// (FNV-1a, fixed across platforms).
uint64_t layer_seed(uint64_t seed, const std::string& name);
// The base seed of sparse_dw's MVUE draws of layer `name` (draw k uses
// mvue_draw_seed(base, k), sparse/mvue_seed.h): layer_seed of "<name>.sparse_dw", a stream
// apart from the adapter's.
uint64_t sparse_dw_seed(uint64_t seed, const std::string& name);

namespace linear_detail {

// A compressed weight as the list of stored slots of each row (ascending column), the
// layout every compressed format of sparse/compressed.h shares once decoded: the value
// at values[r·per_row + j] is W[r, col[r·per_row + j]].
struct SlotIndex {
  int64_t rows = 0, cols = 0, per_row = 0;
  std::vector<int32_t> col;
};

// Compressed 2:4 / V:2:M whose slots are the kept positions of `mask` ([rows, cols]),
// which must fit the pattern (at most 2 kept per group of 4; for V:N:M at most 4 kept
// columns per block and 2 kept per row of a block). Groups keeping fewer than their slot
// count are padded with the lowest positions not kept, as compress_24 pads zeros; values
// are w at kept slots and 0 at padded ones. `name` names the layer in errors.
template <typename T>
Compressed24T<T> compress_24_masked(const T* w, const uint8_t* mask, int64_t rows, int64_t cols,
                                    const std::string& name);
template <typename T>
CompressedVNMT<T> compress_vnm_masked(const T* w, const uint8_t* mask, int64_t rows, int64_t cols, int v, int m,
                                      const std::string& name);

// A compressed 2:4 matrix with the given metadata ([rows, ceil(cols/16)]) and zero values;
// throws naming `name` unless every group's two indices are strictly ascending and the
// nibbles past the last group of a row are 0 (what a checkpoint must hold).
template <typename T>
Compressed24T<T> compressed_24_from_meta(const uint16_t* meta, int64_t rows, int64_t cols, const std::string& name);
// Likewise for V:2:M: columns [rows/v, cols/m, 4] strictly ascending below m, inner
// metadata [rows, ceil(cols/m·4/16)].
template <typename T>
CompressedVNMT<T> compressed_vnm_from_state(const uint8_t* columns, const uint16_t* meta, int64_t rows, int64_t cols,
                                            int v, int m, const std::string& name);

template <typename V>
SlotIndex slot_index(const Compressed24T<V>& c);
template <typename V>
SlotIndex slot_index(const CompressedVNMT<V>& c);

// The values of a compressed weight.
template <typename T>
std::vector<T>& stored_values(Compressed24T<T>& c) {
  return c.values;
}
template <typename T>
std::vector<T>& stored_values(CompressedVNMT<T>& c) {
  return c.inner.values;
}
template <typename T>
const std::vector<T>& stored_values(const Compressed24T<T>& c) {
  return c.values;
}
template <typename T>
const std::vector<T>& stored_values(const CompressedVNMT<T>& c) {
  return c.inner.values;
}
// `c` as a product multiplies it, given the values the product takes (Linear::operand of
// c's values): c itself when they are its own (full precision), else `copy` made c with them.
template <typename C, typename T>
const C& with_values(const C& c, const T* values, C& copy) {
  if (values == stored_values(c).data()) return c;
  copy = c;
  std::copy_n(values, stored_values(copy).size(), stored_values(copy).data());
  return copy;
}

// values[s] = (keep == null || keep[pos(s)]) ? dense[pos(s)] : 0.
template <typename T>
void gather(T* values, const SlotIndex& s, const T* dense, const uint8_t* keep);
// values[s] += dense[pos(s)] where keep (or everywhere when keep is null).
template <typename T>
void gather_add(T* values, const SlotIndex& s, const T* dense, const uint8_t* keep);
// out = the dense [rows, cols] matrix, zeros outside the slots.
template <typename T>
void scatter(T* out, const SlotIndex& s, const T* values);
// out[N, rows] = x[N, cols] · Wᵀ + bias: each element starts from its bias and adds its
// products in ascending column order, as the sparse layer's linear_24 / linear_vnm do.
template <typename T>
void slot_linear(T* out, const T* x, const SlotIndex& s, const T* values, const T* bias, int64_t N);
// dx[N, cols] += dy[N, rows] · W (the transposed use of the compressed form): each
// element adds its products in ascending row order, one thread per row of dx.
template <typename T>
void slot_linear_dx(T* dx, const T* dy, const SlotIndex& s, const T* values, int64_t N);
// 1 at every slot position ([rows, cols]).
std::vector<uint8_t> slot_mask(const SlotIndex& s);

// State tensors: strings and small integers as owned host tensors.
Tensor string_tensor(const std::string& name, const std::string& text);
std::string tensor_string(const Tensor& t);
Tensor u8_tensor(const std::string& name, const std::vector<uint8_t>& data, const Shape& shape);
Tensor u16_tensor(const std::string& name, const std::vector<uint16_t>& data, const Shape& shape);
Tensor i32_tensor(const std::string& name, const std::vector<int32_t>& data);
// The entry `key` of a state map; throws naming `layer` when it is missing or its dtype
// or shape differ.
const Tensor& state_entry(const std::map<std::string, Tensor>& state, const std::string& key, DType dtype,
                          const Shape& shape, const std::string& layer);
// Throws unless state["<name>.kind"] (when present) is `kind`.
void check_state_kind(const std::map<std::string, Tensor>& state, const std::string& name, const std::string& kind);

}  // namespace linear_detail
}  // namespace esplag
