#include "model/linear_kinds.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/error.h"
#include "core/parallel.h"
#include "model/linear_lora.h"
#include "model/linear_registry.h"
#include "model/linear_semi_sparse.h"
#include "model/linear_slope.h"

namespace esplag {

std::vector<std::string> linear_kind_names() {
  std::vector<std::string> names;
  for (const auto& k : linear_kinds()) names.push_back(k.name);
  return names;
}

uint64_t layer_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  // splitmix64's finaliser, so that nearby seeds give unrelated streams.
  uint64_t z = seed ^ h;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t sparse_dw_seed(uint64_t seed, const std::string& name) { return layer_seed(seed, name + ".sparse_dw"); }

namespace {

// The sparse_dw draws of a layer being replaced, or null when it takes none.
template <typename T>
const MvueWeightGrad<T>* previous_draws(const Linear<T>* previous) {
  const MvueWeightGrad<T>* dw = nullptr;
  if (const auto* s = dynamic_cast<const SemiSparseLinear<T>*>(previous)) dw = &s->weight_grad();
  if (const auto* s = dynamic_cast<const SlopeLinear<T>*>(previous)) dw = &s->weight_grad();
  return dw && dw->on() ? dw : nullptr;
}

}  // namespace

template <typename T>
std::unique_ptr<Linear<T>> make_linear(const LinearParams<T>& p, const LinearOptions& o, const Linear<T>* previous) {
  const LinearKindInfo& kind = find_linear_kind(o.kind, "linear '" + p.name + "'");
  if (previous)
    ESPLAG_CHECK(previous->params().name == p.name, "linear '", p.name, "': the layer it replaces is '",
                 previous->params().name, "'");
  ESPLAG_CHECK(!o.sparse_dw || kind.takes_sparse_dw, "linear '", p.name,
               "': sparse_dw (the weight gradient from the MVUE 2:4 of dY^T) is an option of the kinds ",
               linear_kind_list([](const LinearKindInfo& k) { return k.takes_sparse_dw; }), ", not of ", o.kind);
  const auto* prev_lora = dynamic_cast<const LoraLinear<T>*>(previous);
  LinearBuild<T> build{p, o, prev_lora ? &prev_lora->inner() : previous, {}};
  build.adapter = o.lora_enabled && o.lora_rank > 0;
  build.adapter_seed = layer_seed(o.seed, p.name);
  if (o.sparse_dw) {
    build.dw = MvueWeightGrad<T>(sparse_dw_seed(o.seed, p.name));
    if (const MvueWeightGrad<T>* before = previous_draws(build.previous)) build.dw.continue_from(*before);
  }
  std::unique_ptr<Linear<T>> impl = kind.make_cpu<T>()(build);

  if (!build.adapter || kind.adapter == AdapterStyle::own) return impl;
  auto wrapped = std::make_unique<LoraLinear<T>>(std::move(impl), o.lora_rank, o.lora_alpha, build.adapter_seed);
  if (prev_lora && prev_lora->rank() == o.lora_rank) wrapped->copy_adapter_from(*prev_lora);
  return wrapped;
}

template std::unique_ptr<Linear<float>> make_linear(const LinearParams<float>&, const LinearOptions&,
                                                    const Linear<float>*);
template std::unique_ptr<Linear<double>> make_linear(const LinearParams<double>&, const LinearOptions&,
                                                     const Linear<double>*);

namespace linear_detail {

namespace {

// The stored positions of a group of m whose kept positions are `kept` (bits): the kept
// ones, then the lowest others, `slots` in all, ascending.
int pad_slots(uint32_t kept, int m, int slots, uint8_t* idx) {
  for (int i = 0; i < m && std::popcount(kept) < slots; ++i) kept |= 1u << i;
  int k = 0;
  for (int i = 0; i < m; ++i)
    if (kept >> i & 1u) idx[k++] = static_cast<uint8_t>(i);
  return k;
}

}  // namespace

template <typename T>
Compressed24T<T> compress_24_masked(const T* w, const uint8_t* mask, int64_t rows, int64_t cols,
                                    const std::string& name) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && cols % 4 == 0, "linear '", name, "': 2:4 storage of a [", rows, ", ", cols,
               "] matrix needs cols % 4 == 0");
  Compressed24T<T> c;
  c.rows = rows;
  c.cols = cols;
  c.values.assign(size_t(rows * cols / 2), T(0));
  c.meta.assign(size_t(rows * c.meta_stride()), 0);
  const int64_t stride = c.meta_stride();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < cols / 4; ++g) {
      const int64_t base = r * cols + 4 * g;
      uint32_t kept = 0;
      for (int i = 0; i < 4; ++i)
        if (mask[base + i]) kept |= 1u << i;
      ESPLAG_CHECK(std::popcount(kept) <= 2, "linear '", name, "': mask row ", r, " columns ", 4 * g, "..",
                   4 * g + 3, " keeps ", std::popcount(kept), " values, at most 2 fit 2:4 storage");
      uint8_t idx[4];
      pad_slots(kept, 4, 2, idx);
      for (int j = 0; j < 2; ++j) c.values[r * cols / 2 + 2 * g + j] = mask[base + idx[j]] ? w[base + idx[j]] : T(0);
      c.meta[r * stride + g / 4] |= static_cast<uint16_t>((idx[0] | idx[1] << 2) << (4 * (g % 4)));
    }
  return c;
}

template <typename T>
CompressedVNMT<T> compress_vnm_masked(const T* w, const uint8_t* mask, int64_t rows, int64_t cols, int v, int m,
                                      const std::string& name) {
  constexpr int kSel = SparsityPattern::kVnmSelected;
  ESPLAG_CHECK(v > 0 && m >= kSel && m <= SparsityPattern::kMaxM, "linear '", name,
               "': V:2:M storage needs V > 0 and 4 <= M <= 16, got V = ", v, ", M = ", m);
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && rows % v == 0 && cols % m == 0, "linear '", name, "': [", rows, ", ", cols,
               "] is not a multiple of [V, M] = [", v, ", ", m, "]");
  CompressedVNMT<T> c;
  c.v = v;
  c.m = m;
  c.rows = rows;
  c.cols = cols;
  const int64_t blocks = cols / m, gcols = blocks * kSel;
  c.columns.assign(size_t(rows / v * blocks * kSel), 0);
  std::vector<T> g(size_t(rows * gcols));
  std::vector<uint8_t> gm(size_t(rows * gcols));
  for (int64_t rb = 0; rb < rows / v; ++rb)
    for (int64_t b = 0; b < blocks; ++b) {
      uint32_t used = 0;
      for (int64_t r = rb * v; r < (rb + 1) * v; ++r)
        for (int j = 0; j < m; ++j)
          if (mask[r * cols + m * b + j]) used |= 1u << j;
      ESPLAG_CHECK(std::popcount(used) <= kSel, "linear '", name, "': mask block rows ", rb * v, "..",
                   rb * v + v - 1, " columns ", m * b, "..", m * b + m - 1, " keeps values in ", std::popcount(used),
                   " columns, at most 4 fit V:2:M storage");
      uint8_t* sel = c.columns.data() + (rb * blocks + b) * kSel;
      pad_slots(used, m, kSel, sel);
      for (int64_t r = rb * v; r < (rb + 1) * v; ++r)
        for (int k = 0; k < kSel; ++k) {
          g[r * gcols + b * kSel + k] = w[r * cols + m * b + sel[k]];
          gm[r * gcols + b * kSel + k] = mask[r * cols + m * b + sel[k]];
        }
    }
  c.inner = compress_24_masked(g.data(), gm.data(), rows, gcols, name);
  return c;
}

template <typename T>
Compressed24T<T> compressed_24_from_meta(const uint16_t* meta, int64_t rows, int64_t cols, const std::string& name) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && cols % 4 == 0, "linear '", name, "': 2:4 metadata for a [", rows, ", ",
               cols, "] matrix needs cols % 4 == 0");
  Compressed24T<T> c;
  c.rows = rows;
  c.cols = cols;
  const int64_t stride = c.meta_stride(), groups = cols / 4;
  c.meta.assign(meta, meta + rows * stride);
  c.values.assign(size_t(rows * cols / 2), T(0));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t word = 0; word < stride; ++word)
      for (int q = 0; q < 4; ++q) {
        const uint32_t nib = (c.meta[r * stride + word] >> (4 * q)) & 0xFu;
        const int64_t g = 4 * word + q;
        if (g >= groups) {
          ESPLAG_CHECK(nib == 0, "linear '", name, "': metadata row ", r, " has a non-zero nibble past its last group");
          continue;
        }
        ESPLAG_CHECK((nib & 3u) < (nib >> 2), "linear '", name, "': metadata row ", r, " group ", g, " has indices ",
                     nib & 3u, ", ", nib >> 2, ", expected two strictly ascending positions");
      }
  return c;
}

template <typename T>
CompressedVNMT<T> compressed_vnm_from_state(const uint8_t* columns, const uint16_t* meta, int64_t rows, int64_t cols,
                                            int v, int m, const std::string& name) {
  constexpr int kSel = SparsityPattern::kVnmSelected;
  ESPLAG_CHECK(v > 0 && m >= kSel && m <= SparsityPattern::kMaxM && rows % v == 0 && cols % m == 0, "linear '", name,
               "': V:2:M indices for a [", rows, ", ", cols, "] matrix with V = ", v, ", M = ", m,
               " do not divide it");
  CompressedVNMT<T> c;
  c.v = v;
  c.m = m;
  c.rows = rows;
  c.cols = cols;
  c.columns.assign(columns, columns + rows / v * (cols / m) * kSel);
  for (size_t i = 0; i < c.columns.size(); i += kSel)
    for (int k = 0; k < kSel; ++k) {
      const int col = c.columns[i + k];
      ESPLAG_CHECK(col < m && (k == 0 || col > c.columns[i + k - 1]), "linear '", name, "': block ", i / kSel,
                   " has selected columns ", int(c.columns[i]), ", ", int(c.columns[i + 1]), ", ",
                   int(c.columns[i + 2]), ", ", int(c.columns[i + 3]), ", expected 4 strictly ascending below M = ",
                   m);
    }
  c.inner = compressed_24_from_meta<T>(meta, rows, cols / m * kSel, name);
  return c;
}

template <typename V>
SlotIndex slot_index(const Compressed24T<V>& c) {
  SlotIndex s;
  s.rows = c.rows;
  s.cols = c.cols;
  s.per_row = c.cols / 2;
  s.col.resize(size_t(s.rows * s.per_row));
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t g = 0; g < c.cols / 4; ++g)
      for (int j = 0; j < 2; ++j) s.col[r * s.per_row + 2 * g + j] = int32_t(c.column(r, g, j));
  return s;
}

template <typename V>
SlotIndex slot_index(const CompressedVNMT<V>& c) {
  SlotIndex s;
  s.rows = c.rows;
  s.cols = c.cols;
  const int64_t blocks = c.cols / c.m;
  s.per_row = blocks * 2;
  s.col.resize(size_t(s.rows * s.per_row));
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < 2; ++j) s.col[r * s.per_row + 2 * b + j] = int32_t(c.column(r, b, j));
  return s;
}

template <typename T>
void gather(T* values, const SlotIndex& s, const T* dense, const uint8_t* keep) {
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t j = 0; j < s.per_row; ++j) {
      const int64_t pos = r * s.cols + s.col[r * s.per_row + j];
      values[r * s.per_row + j] = (!keep || keep[pos]) ? dense[pos] : T(0);
    }
}

template <typename T>
void gather_add(T* values, const SlotIndex& s, const T* dense, const uint8_t* keep) {
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t j = 0; j < s.per_row; ++j) {
      const int64_t pos = r * s.cols + s.col[r * s.per_row + j];
      if (!keep || keep[pos]) values[r * s.per_row + j] += dense[pos];
    }
}

template <typename T>
void scatter(T* out, const SlotIndex& s, const T* values) {
  std::fill(out, out + s.rows * s.cols, T(0));
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t j = 0; j < s.per_row; ++j) out[r * s.cols + s.col[r * s.per_row + j]] = values[r * s.per_row + j];
}

std::vector<uint8_t> slot_mask(const SlotIndex& s) {
  std::vector<uint8_t> m(size_t(s.rows * s.cols), 0);
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t j = 0; j < s.per_row; ++j) m[r * s.cols + s.col[r * s.per_row + j]] = 1;
  return m;
}

template <typename T>
void slot_linear(T* out, const T* x, const SlotIndex& s, const T* values, const T* bias, int64_t N) {
  const int64_t rows = s.rows, cols = s.cols, per_row = s.per_row;
  const int32_t* col = s.col.data();
  parallel_for(
      N * rows,
      [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t i = e / rows, r = e % rows;
          const T* xi = x + i * cols;
          T acc = bias ? bias[r] : T(0);
          for (int64_t j = 0; j < per_row; ++j) acc += xi[col[r * per_row + j]] * values[r * per_row + j];
          out[e] = acc;
        }
      },
      256);
}

template <typename T>
void slot_linear_dx(T* dx, const T* dy, const SlotIndex& s, const T* values, int64_t N) {
  const int64_t rows = s.rows, cols = s.cols, per_row = s.per_row;
  const int32_t* col = s.col.data();
  parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          T* d = dx + n * cols;
          const T* g = dy + n * rows;
          for (int64_t r = 0; r < rows; ++r) {
            const T gr = g[r];
            for (int64_t j = 0; j < per_row; ++j) d[col[r * per_row + j]] += gr * values[r * per_row + j];
          }
        }
      },
      1);
}

Tensor string_tensor(const std::string& name, const std::string& text) {
  Tensor t = Tensor::zeros({int64_t(text.size())}, DType::u8, name);
  if (!text.empty()) std::memcpy(t.data<uint8_t>(), text.data(), text.size());
  return t;
}

std::string tensor_string(const Tensor& t) {
  ESPLAG_CHECK(t.dtype() == DType::u8 && t.ndim() == 1, "state tensor '", t.name(), "' is not a string (u8 [n])");
  const uint8_t* d = t.data<uint8_t>();
  return std::string(d, d + t.numel());
}

Tensor u8_tensor(const std::string& name, const std::vector<uint8_t>& data, const Shape& shape) {
  Tensor t = Tensor::zeros(shape, DType::u8, name);
  ESPLAG_CHECK(size_t(t.numel()) == data.size(), "state tensor '", name, "': ", data.size(), " bytes for shape ",
               shape_str(shape));
  std::copy(data.begin(), data.end(), t.data<uint8_t>());
  return t;
}

Tensor u16_tensor(const std::string& name, const std::vector<uint16_t>& data, const Shape& shape) {
  Tensor t = Tensor::zeros(shape, DType::u16, name);
  ESPLAG_CHECK(size_t(t.numel()) == data.size(), "state tensor '", name, "': ", data.size(), " words for shape ",
               shape_str(shape));
  std::copy(data.begin(), data.end(), t.data<uint16_t>());
  return t;
}

Tensor i32_tensor(const std::string& name, const std::vector<int32_t>& data) {
  Tensor t = Tensor::zeros({int64_t(data.size())}, DType::i32, name);
  std::copy(data.begin(), data.end(), t.data<int32_t>());
  return t;
}

const Tensor& state_entry(const std::map<std::string, Tensor>& state, const std::string& key, DType dtype,
                          const Shape& shape, const std::string& layer) {
  auto it = state.find(key);
  ESPLAG_CHECK(it != state.end(), "linear '", layer, "': state has no tensor '", key, "'");
  ESPLAG_CHECK(it->second.dtype() == dtype, "linear '", layer, "': state tensor '", key, "' is ",
               dtype_name(it->second.dtype()), ", expected ", dtype_name(dtype));
  ESPLAG_CHECK(it->second.shape() == shape, "linear '", layer, "': state tensor '", key, "' has shape ",
               shape_str(it->second.shape()), ", expected ", shape_str(shape));
  return it->second;
}

void check_state_kind(const std::map<std::string, Tensor>& state, const std::string& name, const std::string& kind) {
  auto it = state.find(name + ".kind");
  if (it == state.end()) return;
  const std::string saved = tensor_string(it->second);
  ESPLAG_CHECK(saved == kind, "linear '", name, "': state was saved by kind '", saved, "', this layer is '", kind,
               "'");
}

#define ESPLAG_LINEAR_DETAIL(T)                                                                                      \
  template Compressed24T<T> compress_24_masked<T>(const T*, const uint8_t*, int64_t, int64_t, const std::string&);  \
  template CompressedVNMT<T> compress_vnm_masked<T>(const T*, const uint8_t*, int64_t, int64_t, int, int,            \
                                                    const std::string&);                                             \
  template Compressed24T<T> compressed_24_from_meta<T>(const uint16_t*, int64_t, int64_t, const std::string&);      \
  template CompressedVNMT<T> compressed_vnm_from_state<T>(const uint8_t*, const uint16_t*, int64_t, int64_t, int,    \
                                                          int, const std::string&);                                  \
  template SlotIndex slot_index<T>(const Compressed24T<T>&);                                                         \
  template SlotIndex slot_index<T>(const CompressedVNMT<T>&);                                                        \
  template void gather<T>(T*, const SlotIndex&, const T*, const uint8_t*);                                          \
  template void gather_add<T>(T*, const SlotIndex&, const T*, const uint8_t*);                                      \
  template void scatter<T>(T*, const SlotIndex&, const T*);                                                          \
  template void slot_linear<T>(T*, const T*, const SlotIndex&, const T*, const T*, int64_t);                        \
  template void slot_linear_dx<T>(T*, const T*, const SlotIndex&, const T*, int64_t);
ESPLAG_LINEAR_DETAIL(float)
ESPLAG_LINEAR_DETAIL(double)
#undef ESPLAG_LINEAR_DETAIL

}  // namespace linear_detail
}  // namespace esplag
