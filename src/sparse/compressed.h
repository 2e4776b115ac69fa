// Compressed storage of N:M / V:N:M sparse weights and reference SpMMs (CPU).
//
// A weight W is row-major [rows, cols] and sparse along cols (the reduction dimension K).
// The layouts below are the logical, row-major ones; GPU kernels may reorder values and
// metadata into their fragment layouts, and are checked against these by decompressing.
// docs/sparsity-formats.md gives the layouts byte by byte.
//
// Groups holding fewer non-zeros than slots are padded: the slots are filled with the
// non-zero positions and then the lowest positions that are not among them, and sorted
// ascending; the stored value is the dense value at that position (a zero). So every
// group always has exactly its slot count of strictly ascending indices, as sparse tensor
// cores require, and decompress(compress(W)) == W exactly.
//
// Values are float, or bf16 (raw uint16 bits, core/dtype.h) in the *Bf16 variants, which
// round the float values to nearest even. Products accumulate in float.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace esplag {

// 2:4 along cols (cols % 4 == 0).
//   values: [rows, cols/2]; the 2 kept values of group g (cols 4g..4g+3) of row r are
//           values[r·cols/2 + 2g + 0/1], in ascending column order.
//   meta:   [rows, meta_stride()] uint16, meta_stride() = ceil(cols/16). Group g of row r
//           owns the nibble at bits 4·(g%4) .. 4·(g%4)+3 of meta[r·meta_stride() + g/4]:
//           bits 0-1 = index (0..3) of the first kept value, bits 2-3 = index of the second,
//           first < second (the nibble of PTX mma.sp / CUTLASS / cuSPARSELt, one per group
//           of 4). Nibbles past the last group of a row are 0.
template <typename V>
struct Compressed24T {
  int64_t rows = 0, cols = 0;
  std::vector<V> values;
  std::vector<uint16_t> meta;

  int64_t meta_stride() const { return (cols / 4 + 3) / 4; }
  // Column (0..cols-1) of the j-th (0/1) kept value of group g of row r.
  int64_t column(int64_t r, int64_t g, int j) const {
    const uint32_t nib = (meta[r * meta_stride() + g / 4] >> (4 * (g % 4))) & 0xFu;
    return 4 * g + ((nib >> (2 * j)) & 3u);
  }
};
using Compressed24 = Compressed24T<float>;
using Compressed24Bf16 = Compressed24T<uint16_t>;

// General N:M along cols (cols % m == 0).
//   values:  [rows, cols/m·n]; the n kept values of group g of row r are at
//            values[r·(cols/m·n) + g·n + j], j = 0..n-1, ascending column.
//   indices: same shape, uint8: position (0..m-1) inside the group of each value, strictly
//            ascending within a group.
struct CompressedNM {
  int n = 0, m = 0;
  int64_t rows = 0, cols = 0;
  std::vector<float> values;
  std::vector<uint8_t> indices;
};

// VENOM V:2:M (rows % v == 0, cols % m == 0, 4 <= m <= 16).
//   columns: [rows/v, cols/m, 4] uint8: for the block of rows v·rb.. and cols m·b.., the
//            4 selected column positions (0..m-1) inside the block, strictly ascending;
//            stored once per block.
//   inner:   the selected columns gathered into a [rows, cols/m·4] matrix,
//            G[r, 4b + k] = W[r, m·b + columns[rb, b, k]], which is 2:4 and stored as a
//            Compressed24T: values [rows, cols/m·2], one metadata nibble per (row, block)
//            indexing the 4 selected columns.
template <typename V>
struct CompressedVNMT {
  int v = 0, m = 0;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> columns;
  Compressed24T<V> inner;

  // Column (0..cols-1) of W holding the j-th (0/1) kept value of block b of row r.
  int64_t column(int64_t r, int64_t b, int j) const {
    const int64_t k = inner.column(r, b, j) - 4 * b;
    return m * b + columns[((r / v) * (cols / m) + b) * 4 + k];
  }
};
using CompressedVNM = CompressedVNMT<float>;
using CompressedVNMBf16 = CompressedVNMT<uint16_t>;

}  // namespace esplag

namespace esplag::cpu {

// `name` names the tensor in errors. Each compress_* throws if W does not already satisfy
// the pattern (more non-zeros in a group than slots; for V:N:M, non-zeros in more than 4
// columns of a block or more than 2 in a row of a block) or if the shape does not divide.
Compressed24 compress_24(const float* w, int64_t rows, int64_t cols, const std::string& name = "weight");
CompressedNM compress_nm(const float* w, int64_t rows, int64_t cols, int n, int m,
                         const std::string& name = "weight");
CompressedVNM compress_vnm(const float* w, int64_t rows, int64_t cols, int v, int m,
                           const std::string& name = "weight");

// Values rounded to bf16 (nearest even); indices and metadata unchanged.
Compressed24Bf16 to_bf16(const Compressed24& c);
CompressedVNMBf16 to_bf16(const CompressedVNM& c);

// out: dense [rows, cols], fully overwritten.
template <typename V>
void decompress_24(const Compressed24T<V>& c, float* out);
void decompress_nm(const CompressedNM& c, float* out);
template <typename V>
void decompress_vnm(const CompressedVNMT<V>& c, float* out);

// out[rows, n] = W · X, X dense [cols, n]. Each element sums its products in ascending
// column order, starting from 0.
template <typename V>
void spmm_24(float* out, const Compressed24T<V>& w, const float* x, int64_t n);
void spmm_nm(float* out, const CompressedNM& w, const float* x, int64_t n);
template <typename V>
void spmm_vnm(float* out, const CompressedVNMT<V>& w, const float* x, int64_t n);

// The nn.Linear form the model uses: out[N, rows] = X[N, cols] · Wᵀ + bias (bias [rows] or
// null). Each element starts from its bias and adds its products in ascending column
// order, as ops/matmul.h's dense linear_forward does.
template <typename V>
void linear_24(float* out, const float* x, const Compressed24T<V>& w, const float* bias, int64_t N);
void linear_nm(float* out, const float* x, const CompressedNM& w, const float* bias, int64_t N);
template <typename V>
void linear_vnm(float* out, const float* x, const CompressedVNMT<V>& w, const float* bias, int64_t N);

}  // namespace esplag::cpu
