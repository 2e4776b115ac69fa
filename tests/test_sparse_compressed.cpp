// Compressed 2:4, N:M and V:N:M formats: byte layouts, exact round trips, and the
// reference SpMMs against the masked dense product.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "ops/matmul.h"
#include "sparse/compressed.h"
#include "sparse/masks.h"

using namespace esplag;

namespace {

std::vector<float> gaussian(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

// A Gaussian matrix masked to a pattern, with some kept values zeroed as well so that
// groups with fewer non-zeros than slots (the padded case) occur.
std::vector<float> masked(int64_t rows, int64_t cols, const SparsityPattern& p, uint64_t seed) {
  auto w = gaussian(rows * cols, seed);
  const auto mask = cpu::make_mask(w.data(), rows, cols, p);
  cpu::apply_mask(w.data(), mask.data(), rows * cols);
  Rng rng(seed ^ 0xabcdef);
  for (auto& x : w)
    if (rng.below(5) == 0) x = 0.0f;
  return w;
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

// ref[rows, n] = W · X in double; scale[rows, n] = Σ |w||x| (the error bound's scale).
void dense_ref(const std::vector<float>& w, int64_t rows, int64_t cols, const std::vector<float>& x, int64_t n,
               std::vector<double>& ref, std::vector<double>& scale) {
  ref.assign(rows * n, 0.0);
  scale.assign(rows * n, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k)
      for (int64_t j = 0; j < n; ++j) {
        ref[r * n + j] += static_cast<double>(w[r * cols + k]) * x[k * n + j];
        scale[r * n + j] += std::fabs(static_cast<double>(w[r * cols + k]) * x[k * n + j]);
      }
}

// Checks out[rows, n] (W·X form) and the linear form out[N, rows] = X·Wᵀ + b against the
// double reference (relative to Σ|w||x|) and against ops' dense float linear_forward.
template <typename Spmm, typename Linear>
void check_products(const std::vector<float>& w, int64_t rows, int64_t cols, uint64_t seed, Spmm spmm, Linear linear) {
  const int64_t n = 1 + static_cast<int64_t>(seed % 13);
  const auto x = gaussian(cols * n, seed + 1);
  std::vector<float> out(rows * n, std::nanf(""));
  spmm(out.data(), x.data(), n);
  std::vector<double> ref, scale;
  dense_ref(w, rows, cols, x, n, ref, scale);
  for (int64_t i = 0; i < rows * n; ++i) ASSERT_NEAR(out[i], ref[i], 1e-5 * scale[i] + 1e-30) << "W·X element " << i;

  // Linear form: X2 [N, cols], out2 [N, rows]; reference via the transpose of the above.
  const int64_t N = n + 2;
  const auto x2 = gaussian(N * cols, seed + 2);
  const auto bias = gaussian(rows, seed + 3);
  for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
    std::vector<float> out2(N * rows, std::nanf("")), dense(N * rows);
    linear(out2.data(), x2.data(), b, N);
    cpu::linear_forward<float>(dense.data(), x2.data(), w.data(), b, static_cast<int>(N), static_cast<int>(cols),
                               static_cast<int>(rows));
    for (int64_t i = 0; i < N; ++i)
      for (int64_t r = 0; r < rows; ++r) {
        double acc = b ? b[r] : 0.0, sc = b ? std::fabs(b[r]) : 0.0;
        for (int64_t k = 0; k < cols; ++k) {
          acc += static_cast<double>(x2[i * cols + k]) * w[r * cols + k];
          sc += std::fabs(static_cast<double>(x2[i * cols + k]) * w[r * cols + k]);
        }
        ASSERT_NEAR(out2[i * rows + r], acc, 1e-5 * sc + 1e-30) << "linear element " << i << "," << r;
        ASSERT_NEAR(out2[i * rows + r], dense[i * rows + r], 2e-5 * sc + 1e-30) << "vs ops " << i << "," << r;
      }
  }
}

}  // namespace

TEST(Compressed24, ByteLayoutOfAHandExample) {
  // One row of 5 groups (so the second metadata word is half used).
  const float w[20] = {0, 3, 0, 4,  5, 0, 0, 0,  0, 0, 0, 0,  0, 0, 0, -7,  0, 0, 8, 9};
  const auto c = cpu::compress_24(w, 1, 20);
  EXPECT_EQ(c.rows, 1);
  EXPECT_EQ(c.cols, 20);
  EXPECT_EQ(c.meta_stride(), 2);
  EXPECT_EQ(c.values, (std::vector<float>{3, 4, 5, 0, 0, 0, 0, -7, 8, 9}));
  // Nibbles (first | second << 2): g0 {1,3} = 0xD, g1 {0,1} = 0x4 (padded), g2 {0,1} = 0x4,
  // g3 {0,3} = 0xC (padded with the lowest free index), g4 {2,3} = 0xE.
  ASSERT_EQ(c.meta.size(), 2u);
  EXPECT_EQ(c.meta[0], 0xC44D);
  EXPECT_EQ(c.meta[1], 0x000E);
  EXPECT_EQ(c.column(0, 3, 0), 12);
  EXPECT_EQ(c.column(0, 3, 1), 15);
  std::vector<float> back(20);
  cpu::decompress_24(c, back.data());
  EXPECT_EQ(std::memcmp(back.data(), w, sizeof(w)), 0);
}

TEST(Compressed24, RejectsMoreThanTwoNonZerosAndBadShapes) {
  const float w[16] = {1, 0, 0, 1,  //
                       0, 0, 0, 0,  //
                       0, 1, 1, 1,  //
                       0, 0, 0, 0};
  std::string msg = error_of([&] { cpu::compress_24(w, 2, 8, "mlp.fc2.weight"); });
  EXPECT_NE(msg.find("'mlp.fc2.weight' row 1 columns 0..3 hold 3 non-zeros"), std::string::npos) << msg;
  msg = error_of([&] { cpu::compress_24(w, 1, 6, "q"); });
  EXPECT_NE(msg.find("'q'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("multiple of 4"), std::string::npos) << msg;
  // A NaN counts as a value that must be kept.
  const float nan_w[4] = {std::nanf(""), 1, 2, 0};
  EXPECT_THROW(cpu::compress_24(nan_w, 1, 4), Error);
  // A corrupted compressed tensor is reported, not read out of bounds.
  auto c = cpu::compress_24(w, 1, 8);
  c.values.pop_back();
  std::vector<float> out(8);
  EXPECT_THROW(cpu::decompress_24(c, out.data()), Error);
}

TEST(Compressed24, RoundTripsExactlyOnRandomShapes) {
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    Rng rng(seed);
    const int64_t rows = 1 + rng.below(20), cols = 4 * (1 + rng.below(24));
    const auto w = masked(rows, cols, SparsityPattern::nm(2, 4), seed);
    const auto c = cpu::compress_24(w.data(), rows, cols);
    ASSERT_EQ(static_cast<int64_t>(c.values.size()), rows * cols / 2);
    ASSERT_EQ(static_cast<int64_t>(c.meta.size()), rows * ((cols + 15) / 16));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < cols / 4; ++g) {
        const uint32_t nib = (c.meta[r * c.meta_stride() + g / 4] >> (4 * (g % 4))) & 0xF;
        EXPECT_LT(nib & 3u, nib >> 2) << "indices must ascend";
      }
    std::vector<float> back(w.size(), 1.0f);
    cpu::decompress_24(c, back.data());
    expect_bitwise_equal(back, w);

    // bf16 values: round trip gives the bf16-rounded matrix.
    const auto b = cpu::to_bf16(c);
    EXPECT_EQ(b.meta, c.meta);
    std::vector<float> rounded(w.size()), back16(w.size());
    for (size_t i = 0; i < w.size(); ++i) rounded[i] = bf16_to_float(float_to_bf16(w[i]));
    cpu::decompress_24(b, back16.data());
    expect_bitwise_equal(back16, rounded);
  }
}

TEST(CompressedNM, LayoutRoundTripAndErrors) {
  // 1:8 and 3:8 by hand.
  const float w[8] = {0, 0, 0, 0, 0, 6, 0, 0};
  const auto c18 = cpu::compress_nm(w, 1, 8, 1, 8);
  EXPECT_EQ(c18.values, (std::vector<float>{6}));
  EXPECT_EQ(c18.indices, (std::vector<uint8_t>{5}));
  const auto c38 = cpu::compress_nm(w, 1, 8, 3, 8);
  EXPECT_EQ(c38.values, (std::vector<float>{0, 0, 6}));
  EXPECT_EQ(c38.indices, (std::vector<uint8_t>{0, 1, 5}));
  std::string msg = error_of([&] { cpu::compress_nm(w, 1, 8, 0, 8, "x"); });
  EXPECT_NE(msg.find("0 < N < M"), std::string::npos) << msg;
  const float three[8] = {1, 2, 3, 0, 0, 0, 0, 0};
  msg = error_of([&] { cpu::compress_nm(three, 1, 8, 2, 8, "emb.proj"); });
  EXPECT_NE(msg.find("'emb.proj' row 0 columns 0..7 hold 3 non-zeros, at most 2"), std::string::npos) << msg;

  const int nms[][2] = {{1, 2}, {2, 4}, {1, 4}, {3, 4}, {2, 8}, {3, 7}, {4, 16}, {15, 16}};
  uint64_t seed = 40;
  for (const auto& nm : nms) {
    const int n = nm[0], m = nm[1];
    Rng rng(seed);
    const int64_t rows = 1 + rng.below(9), cols = m * (1 + rng.below(6));
    const auto wm = masked(rows, cols, SparsityPattern::nm(n, m), seed++);
    const auto c = cpu::compress_nm(wm.data(), rows, cols, n, m);
    for (int64_t g = 0; g < rows * cols / m; ++g)
      for (int j = 1; j < n; ++j) EXPECT_LT(c.indices[g * n + j - 1], c.indices[g * n + j]);
    std::vector<float> back(wm.size(), 1.0f);
    cpu::decompress_nm(c, back.data());
    expect_bitwise_equal(back, wm);
    if (n == 2 && m == 4) {  // the same kept values as the 2:4 format
      const auto c24 = cpu::compress_24(wm.data(), rows, cols);
      EXPECT_EQ(c.values, c24.values);
    }
  }
}

TEST(CompressedVNM, LayoutOfAHandExample) {
  // V = 16, M = 8, one block: rows use columns {2, 5} or {5, 7}; the union {2, 5, 7} is
  // padded with column 0, so the block's selected columns are {0, 2, 5, 7}.
  const int64_t rows = 16, cols = 8;
  std::vector<float> w(rows * cols, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    w[r * cols + 5] = 1.0f + r;
    w[r * cols + (r % 2 ? 7 : 2)] = -1.0f - r;
  }
  const auto c = cpu::compress_vnm(w.data(), rows, cols, 16, 8, "w");
  EXPECT_EQ(c.columns, (std::vector<uint8_t>{0, 2, 5, 7}));
  EXPECT_EQ(c.inner.rows, rows);
  EXPECT_EQ(c.inner.cols, 4);
  ASSERT_EQ(c.inner.values.size(), 32u);
  // Row 0: columns 2, 5 -> selected positions 1, 2 -> nibble 1 | 2 << 2 = 0x9.
  EXPECT_EQ(c.inner.meta[0], 0x9);
  EXPECT_EQ(c.inner.values[0], -1.0f);
  EXPECT_EQ(c.inner.values[1], 1.0f);
  // Row 1: columns 5, 7 -> positions 2, 3 -> 0xE.
  EXPECT_EQ(c.inner.meta[1], 0xE);
  EXPECT_EQ(c.inner.values[2], 2.0f);
  EXPECT_EQ(c.inner.values[3], -2.0f);
  EXPECT_EQ(c.column(1, 0, 1), 7);
  std::vector<float> back(w.size());
  cpu::decompress_vnm(c, back.data());
  expect_bitwise_equal(back, w);
}

TEST(CompressedVNM, RejectsPatternViolations) {
  const int64_t rows = 16, cols = 16;
  std::vector<float> w(rows * cols, 0.0f);
  for (int64_t r = 0; r < rows; ++r) w[r * cols + 8 + r % 5] = 1.0f;  // block 1 uses 5 columns
  std::string msg = error_of([&] { cpu::compress_vnm(w.data(), rows, cols, 16, 8, "ffn.up"); });
  EXPECT_NE(msg.find("'ffn.up' block rows 0..15 columns 8..15 has non-zeros in 5 columns"), std::string::npos) << msg;
  std::fill(w.begin(), w.end(), 0.0f);
  w[3 * cols + 0] = w[3 * cols + 1] = w[3 * cols + 2] = 1.0f;
  msg = error_of([&] { cpu::compress_vnm(w.data(), rows, cols, 16, 8, "ffn.up"); });
  EXPECT_NE(msg.find("'ffn.up' row 3 columns 0..7 hold 3 non-zeros"), std::string::npos) << msg;
  msg = error_of([&] { cpu::compress_vnm(w.data(), rows, cols, 32, 8, "ffn.up"); });
  EXPECT_NE(msg.find("'ffn.up' of shape [16, 16] is not a multiple of [V, M] = [32, 8]"), std::string::npos) << msg;
}

TEST(CompressedVNM, RoundTripsExactlyOnRandomShapes) {
  const int vms[][2] = {{16, 4}, {16, 8}, {32, 5}, {16, 16}, {64, 8}, {128, 10}};
  uint64_t seed = 90;
  for (const auto& vm : vms) {
    const int v = vm[0], m = vm[1];
    Rng rng(seed);
    const int64_t rows = v * (1 + rng.below(v >= 64 ? 1 : 3)), cols = m * (1 + rng.below(5));
    const auto w = masked(rows, cols, SparsityPattern::vnm(v, 2, m), seed++);
    const auto c = cpu::compress_vnm(w.data(), rows, cols, v, m);
    ASSERT_EQ(static_cast<int64_t>(c.columns.size()), rows / v * cols / m * 4);
    ASSERT_EQ(static_cast<int64_t>(c.inner.values.size()), rows * cols / m * 2);
    for (size_t b = 0; b < c.columns.size() / 4; ++b)
      for (int k = 1; k < 4; ++k) EXPECT_LT(c.columns[4 * b + k - 1], c.columns[4 * b + k]);
    std::vector<float> back(w.size(), 1.0f);
    cpu::decompress_vnm(c, back.data());
    expect_bitwise_equal(back, w);
    const auto b16 = cpu::to_bf16(c);
    std::vector<float> rounded(w.size()), back16(w.size());
    for (size_t i = 0; i < w.size(); ++i) rounded[i] = bf16_to_float(float_to_bf16(w[i]));
    cpu::decompress_vnm(b16, back16.data());
    expect_bitwise_equal(back16, rounded);
  }
}

TEST(SparseProducts, MatchTheMaskedDenseProduct) {
  uint64_t seed = 500;
  for (int trial = 0; trial < 4; ++trial) {
    Rng rng(seed);
    // 2:4
    {
      const int64_t rows = 1 + rng.below(40), cols = 4 * (1 + rng.below(40));
      const auto w = masked(rows, cols, SparsityPattern::nm(2, 4), seed);
      const auto c = cpu::compress_24(w.data(), rows, cols);
      check_products(
          w, rows, cols, seed++, [&](float* o, const float* x, int64_t n) { cpu::spmm_24(o, c, x, n); },
          [&](float* o, const float* x, const float* b, int64_t N) { cpu::linear_24(o, x, c, b, N); });
      // bf16 storage equals the float product of the bf16-rounded weight.
      const auto c16 = cpu::to_bf16(c);
      std::vector<float> w16(w.size());
      for (size_t i = 0; i < w.size(); ++i) w16[i] = bf16_to_float(float_to_bf16(w[i]));
      check_products(
          w16, rows, cols, seed++, [&](float* o, const float* x, int64_t n) { cpu::spmm_24(o, c16, x, n); },
          [&](float* o, const float* x, const float* b, int64_t N) { cpu::linear_24(o, x, c16, b, N); });
    }
    // N:M
    {
      const int n = 1 + rng.below(3), m = n + 1 + rng.below(6);
      const int64_t rows = 1 + rng.below(30), cols = m * (1 + rng.below(8));
      const auto w = masked(rows, cols, SparsityPattern::nm(n, m), seed);
      const auto c = cpu::compress_nm(w.data(), rows, cols, n, m);
      check_products(
          w, rows, cols, seed++, [&](float* o, const float* x, int64_t k) { cpu::spmm_nm(o, c, x, k); },
          [&](float* o, const float* x, const float* b, int64_t N) { cpu::linear_nm(o, x, c, b, N); });
    }
    // V:N:M
    {
      const int v = 16 << rng.below(2), m = 4 + rng.below(9);
      const int64_t rows = v * (1 + rng.below(2)), cols = m * (1 + rng.below(6));
      const auto w = masked(rows, cols, SparsityPattern::vnm(v, 2, m), seed);
      const auto c = cpu::compress_vnm(w.data(), rows, cols, v, m);
      check_products(
          w, rows, cols, seed++, [&](float* o, const float* x, int64_t n) { cpu::spmm_vnm(o, c, x, n); },
          [&](float* o, const float* x, const float* b, int64_t N) { cpu::linear_vnm(o, x, c, b, N); });
      const auto c16 = cpu::to_bf16(c);
      std::vector<float> w16(w.size());
      for (size_t i = 0; i < w.size(); ++i) w16[i] = bf16_to_float(float_to_bf16(w[i]));
      check_products(
          w16, rows, cols, seed++, [&](float* o, const float* x, int64_t n) { cpu::spmm_vnm(o, c16, x, n); },
          [&](float* o, const float* x, const float* b, int64_t N) { cpu::linear_vnm(o, x, c16, b, N); });
    }
  }
}
