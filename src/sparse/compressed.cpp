#include "sparse/compressed.h"

#include <algorithm>
#include <bit>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "sparse/pattern.h"

namespace esplag::cpu {

namespace {

inline float value_of(float v) { return v; }
inline float value_of(uint16_t bf16) { return bf16_to_float(bf16); }

// Chooses the `slots` stored positions of one group of m values: the non-zeros, then the
// lowest zero positions, ascending. Returns the number of non-zeros (> slots: invalid,
// idx untouched beyond what was written).
int pick_slots(const float* group, int m, int slots, uint8_t* idx) {
  uint32_t used = 0;
  for (int i = 0; i < m; ++i)
    if (group[i] != 0.0f) used |= 1u << i;  // NaN counts as a non-zero
  const int nonzeros = std::popcount(used);
  if (nonzeros > slots) return nonzeros;
  for (int i = 0; i < m && std::popcount(used) < slots; ++i) used |= 1u << i;
  int k = 0;
  for (int i = 0; i < m; ++i)
    if (used >> i & 1u) idx[k++] = static_cast<uint8_t>(i);
  return nonzeros;
}

template <typename V>
void check_consistent_24(const Compressed24T<V>& c, const char* what) {
  ESPLAG_CHECK(c.rows >= 0 && c.cols >= 0 && c.cols % 4 == 0, what, ": compressed 2:4 shape [", c.rows, ", ", c.cols,
               "] needs cols % 4 == 0");
  ESPLAG_CHECK(static_cast<int64_t>(c.values.size()) == c.rows * c.cols / 2, what, ": expected ",
               c.rows * c.cols / 2, " values, got ", c.values.size());
  ESPLAG_CHECK(static_cast<int64_t>(c.meta.size()) == c.rows * c.meta_stride(), what, ": expected ",
               c.rows * c.meta_stride(), " metadata words, got ", c.meta.size());
}

template <typename V>
void check_consistent_vnm(const CompressedVNMT<V>& c, const char* what) {
  ESPLAG_CHECK(c.v > 0 && c.m >= 4 && c.rows % c.v == 0 && c.cols % c.m == 0, what, ": compressed V:N:M shape [",
               c.rows, ", ", c.cols, "] with V = ", c.v, ", M = ", c.m, " is inconsistent");
  ESPLAG_CHECK(static_cast<int64_t>(c.columns.size()) == c.rows / c.v * (c.cols / c.m) * 4, what, ": expected ",
               c.rows / c.v * (c.cols / c.m) * 4, " column indices, got ", c.columns.size());
  for (uint8_t col : c.columns)
    ESPLAG_CHECK(col < c.m, what, ": selected column index ", int(col), " is not below M = ", c.m);
  ESPLAG_CHECK(c.inner.rows == c.rows && c.inner.cols == c.cols / c.m * 4, what, ": inner 2:4 matrix is [",
               c.inner.rows, ", ", c.inner.cols, "], expected [", c.rows, ", ", c.cols / c.m * 4, "]");
  check_consistent_24(c.inner, what);
}

}  // namespace

Compressed24 compress_24(const float* w, int64_t rows, int64_t cols, const std::string& name) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && cols % 4 == 0, "compress_24: tensor '", name, "' of shape [", rows, ", ",
               cols, "]: cols must be a multiple of 4");
  Compressed24 c;
  c.rows = rows;
  c.cols = cols;
  c.values.assign(static_cast<size_t>(rows * cols / 2), 0.0f);
  c.meta.assign(static_cast<size_t>(rows * c.meta_stride()), 0);
  const int64_t groups = cols / 4, stride = c.meta_stride();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = w + r * cols + 4 * g;
      uint8_t idx[2];
      const int nz = pick_slots(src, 4, 2, idx);
      ESPLAG_CHECK(nz <= 2, "compress_24: tensor '", name, "' row ", r, " columns ", 4 * g, "..", 4 * g + 3, " hold ",
                   nz, " non-zeros, at most 2 allowed (apply a 2:4 mask first)");
      c.values[r * cols / 2 + 2 * g] = src[idx[0]];
      c.values[r * cols / 2 + 2 * g + 1] = src[idx[1]];
      c.meta[r * stride + g / 4] |= static_cast<uint16_t>((idx[0] | idx[1] << 2) << (4 * (g % 4)));
    }
  return c;
}

CompressedNM compress_nm(const float* w, int64_t rows, int64_t cols, int n, int m, const std::string& name) {
  ESPLAG_CHECK(n > 0 && n < m && m <= SparsityPattern::kMaxM, "compress_nm: tensor '", name,
               "': need 0 < N < M <= 16, got ", n, ":", m);
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && cols % m == 0, "compress_nm: tensor '", name, "' of shape [", rows, ", ",
               cols, "]: cols must be a multiple of M = ", m);
  CompressedNM c;
  c.n = n;
  c.m = m;
  c.rows = rows;
  c.cols = cols;
  const int64_t per_row = cols / m * n;
  c.values.assign(static_cast<size_t>(rows * per_row), 0.0f);
  c.indices.assign(static_cast<size_t>(rows * per_row), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < cols / m; ++g) {
      const float* src = w + r * cols + m * g;
      uint8_t* idx = c.indices.data() + r * per_row + g * n;
      const int nz = pick_slots(src, m, n, idx);
      ESPLAG_CHECK(nz <= n, "compress_nm: tensor '", name, "' row ", r, " columns ", m * g, "..", m * g + m - 1,
                   " hold ", nz, " non-zeros, at most ", n, " allowed (apply a ", n, ":", m, " mask first)");
      for (int j = 0; j < n; ++j) c.values[r * per_row + g * n + j] = src[idx[j]];
    }
  return c;
}

CompressedVNM compress_vnm(const float* w, int64_t rows, int64_t cols, int v, int m, const std::string& name) {
  constexpr int kSel = SparsityPattern::kVnmSelected;
  ESPLAG_CHECK(v > 0 && m >= kSel && m <= SparsityPattern::kMaxM, "compress_vnm: tensor '", name,
               "': need V > 0 and 4 <= M <= 16, got V = ", v, ", M = ", m);
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && rows % v == 0 && cols % m == 0, "compress_vnm: tensor '", name,
               "' of shape [", rows, ", ", cols, "] is not a multiple of [V, M] = [", v, ", ", m, "]");
  CompressedVNM c;
  c.v = v;
  c.m = m;
  c.rows = rows;
  c.cols = cols;
  const int64_t blocks = cols / m, gcols = blocks * kSel;
  c.columns.assign(static_cast<size_t>(rows / v * blocks * kSel), 0);
  std::vector<float> gathered(static_cast<size_t>(rows * gcols));
  for (int64_t rb = 0; rb < rows / v; ++rb)
    for (int64_t b = 0; b < blocks; ++b) {
      // The union of the block's non-zero columns, padded to 4 like a group's slots.
      std::vector<float> any(static_cast<size_t>(m), 0.0f);
      for (int64_t r = rb * v; r < (rb + 1) * v; ++r) {
        int count = 0;
        for (int j = 0; j < m; ++j)
          if (w[r * cols + m * b + j] != 0.0f) any[j] = 1.0f, ++count;
        ESPLAG_CHECK(count <= 2, "compress_vnm: tensor '", name, "' row ", r, " columns ", m * b, "..",
                     m * b + m - 1, " hold ", count, " non-zeros, at most 2 allowed in a V:2:", m, " block");
      }
      uint8_t* sel = c.columns.data() + (rb * blocks + b) * kSel;
      const int used = pick_slots(any.data(), m, kSel, sel);
      ESPLAG_CHECK(used <= kSel, "compress_vnm: tensor '", name, "' block rows ", rb * v, "..", rb * v + v - 1,
                   " columns ", m * b, "..", m * b + m - 1, " has non-zeros in ", used,
                   " columns, at most 4 allowed (apply a ", v, ":2:", m, " mask first)");
      for (int64_t r = rb * v; r < (rb + 1) * v; ++r)
        for (int k = 0; k < kSel; ++k) gathered[r * gcols + b * kSel + k] = w[r * cols + m * b + sel[k]];
    }
  c.inner = compress_24(gathered.data(), rows, gcols, name);
  return c;
}

Compressed24Bf16 to_bf16(const Compressed24& c) {
  Compressed24Bf16 out;
  out.rows = c.rows;
  out.cols = c.cols;
  out.meta = c.meta;
  out.values.resize(c.values.size());
  for (size_t i = 0; i < c.values.size(); ++i) out.values[i] = float_to_bf16(c.values[i]);
  return out;
}

CompressedVNMBf16 to_bf16(const CompressedVNM& c) {
  CompressedVNMBf16 out;
  out.v = c.v;
  out.m = c.m;
  out.rows = c.rows;
  out.cols = c.cols;
  out.columns = c.columns;
  out.inner = to_bf16(c.inner);
  return out;
}

template <typename V>
void decompress_24(const Compressed24T<V>& c, float* out) {
  check_consistent_24(c, "decompress_24");
  std::fill(out, out + c.rows * c.cols, 0.0f);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t g = 0; g < c.cols / 4; ++g)
      for (int j = 0; j < 2; ++j) out[r * c.cols + c.column(r, g, j)] = value_of(c.values[r * c.cols / 2 + 2 * g + j]);
}

void decompress_nm(const CompressedNM& c, float* out) {
  const int64_t per_row = c.m > 0 ? c.cols / c.m * c.n : 0;
  ESPLAG_CHECK(c.m > 0 && c.cols % c.m == 0 && static_cast<int64_t>(c.values.size()) == c.rows * per_row &&
                   c.indices.size() == c.values.size(),
               "decompress_nm: inconsistent compressed ", c.n, ":", c.m, " tensor of shape [", c.rows, ", ", c.cols,
               "]");
  std::fill(out, out + c.rows * c.cols, 0.0f);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t g = 0; g < c.cols / c.m; ++g)
      for (int j = 0; j < c.n; ++j) {
        const int64_t i = r * per_row + g * c.n + j;
        out[r * c.cols + g * c.m + c.indices[i]] = c.values[i];
      }
}

template <typename V>
void decompress_vnm(const CompressedVNMT<V>& c, float* out) {
  check_consistent_vnm(c, "decompress_vnm");
  std::fill(out, out + c.rows * c.cols, 0.0f);
  const int64_t blocks = c.cols / c.m;
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < 2; ++j)
        out[r * c.cols + c.column(r, b, j)] = value_of(c.inner.values[r * blocks * 2 + 2 * b + j]);
}

// The compressed formats differ only in how the kept (column, value) pairs of a row are
// listed; each product below walks them in ascending column order.
namespace {

template <typename Visit>
void spmm_rows(float* out, int64_t rows, const float* x, int64_t n, Visit visit_row) {
  parallel_for(
      rows,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          float* o = out + r * n;
          std::fill(o, o + n, 0.0f);
          visit_row(r, [&](int64_t col, float val) {
            const float* xr = x + col * n;
            for (int64_t j = 0; j < n; ++j) o[j] += val * xr[j];
          });
        }
      },
      4);
}

template <typename Visit>
void linear_rows(float* out, const float* x, int64_t rows, int64_t cols, const float* bias, int64_t N,
                 Visit visit_row) {
  parallel_for(
      N * rows,
      [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t i = e / rows, r = e % rows;
          const float* xi = x + i * cols;
          float acc = bias ? bias[r] : 0.0f;
          visit_row(r, [&](int64_t col, float val) { acc += xi[col] * val; });
          out[e] = acc;
        }
      },
      256);
}

template <typename V>
auto visit_24(const Compressed24T<V>& w) {
  return [&w](int64_t r, auto&& f) {
    const V* vals = w.values.data() + r * w.cols / 2;
    for (int64_t g = 0; g < w.cols / 4; ++g)
      for (int j = 0; j < 2; ++j) f(w.column(r, g, j), value_of(vals[2 * g + j]));
  };
}

auto visit_nm(const CompressedNM& w) {
  return [&w](int64_t r, auto&& f) {
    const int64_t per_row = w.cols / w.m * w.n;
    for (int64_t g = 0; g < w.cols / w.m; ++g)
      for (int j = 0; j < w.n; ++j) {
        const int64_t i = r * per_row + g * w.n + j;
        f(g * w.m + w.indices[i], w.values[i]);
      }
  };
}

template <typename V>
auto visit_vnm(const CompressedVNMT<V>& w) {
  return [&w](int64_t r, auto&& f) {
    const int64_t blocks = w.cols / w.m;
    const V* vals = w.inner.values.data() + r * blocks * 2;
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < 2; ++j) f(w.column(r, b, j), value_of(vals[2 * b + j]));
  };
}

void check_nm(const CompressedNM& c, const char* what) {
  ESPLAG_CHECK(c.n > 0 && c.m > c.n && c.cols % c.m == 0 &&
                   static_cast<int64_t>(c.values.size()) == c.rows * (c.cols / c.m * c.n) &&
                   c.indices.size() == c.values.size(),
               what, ": inconsistent compressed ", c.n, ":", c.m, " tensor of shape [", c.rows, ", ", c.cols, "]");
}

}  // namespace

template <typename V>
void spmm_24(float* out, const Compressed24T<V>& w, const float* x, int64_t n) {
  check_consistent_24(w, "spmm_24");
  spmm_rows(out, w.rows, x, n, visit_24(w));
}

void spmm_nm(float* out, const CompressedNM& w, const float* x, int64_t n) {
  check_nm(w, "spmm_nm");
  spmm_rows(out, w.rows, x, n, visit_nm(w));
}

template <typename V>
void spmm_vnm(float* out, const CompressedVNMT<V>& w, const float* x, int64_t n) {
  check_consistent_vnm(w, "spmm_vnm");
  spmm_rows(out, w.rows, x, n, visit_vnm(w));
}

template <typename V>
void linear_24(float* out, const float* x, const Compressed24T<V>& w, const float* bias, int64_t N) {
  check_consistent_24(w, "linear_24");
  linear_rows(out, x, w.rows, w.cols, bias, N, visit_24(w));
}

void linear_nm(float* out, const float* x, const CompressedNM& w, const float* bias, int64_t N) {
  check_nm(w, "linear_nm");
  linear_rows(out, x, w.rows, w.cols, bias, N, visit_nm(w));
}

template <typename V>
void linear_vnm(float* out, const float* x, const CompressedVNMT<V>& w, const float* bias, int64_t N) {
  check_consistent_vnm(w, "linear_vnm");
  linear_rows(out, x, w.rows, w.cols, bias, N, visit_vnm(w));
}

#define ESPLAG_SPARSE_COMPRESSED(V)                                                                 \
  template void decompress_24<V>(const Compressed24T<V>&, float*);                                  \
  template void decompress_vnm<V>(const CompressedVNMT<V>&, float*);                                \
  template void spmm_24<V>(float*, const Compressed24T<V>&, const float*, int64_t);                 \
  template void spmm_vnm<V>(float*, const CompressedVNMT<V>&, const float*, int64_t);               \
  template void linear_24<V>(float*, const float*, const Compressed24T<V>&, const float*, int64_t); \
  template void linear_vnm<V>(float*, const float*, const CompressedVNMT<V>&, const float*, int64_t);
ESPLAG_SPARSE_COMPRESSED(float)
ESPLAG_SPARSE_COMPRESSED(uint16_t)
#undef ESPLAG_SPARSE_COMPRESSED

}  // namespace esplag::cpu
