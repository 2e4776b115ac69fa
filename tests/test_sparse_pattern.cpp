// Sparsity pattern strings, divisibility errors and check_pattern.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "sparse/masks.h"
#include "sparse/pattern.h"

using namespace esplag;
using Kind = SparsityPattern::Kind;

namespace {

// The message of the Error thrown by fn ("" if none was thrown).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_parse_error(const std::string& text, const std::vector<std::string>& needles) {
  const std::string msg = error_of([&] { SparsityPattern::parse(text); });
  ASSERT_FALSE(msg.empty()) << "\"" << text << "\" parsed without error";
  for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "\"" << n << "\" not in: " << msg;
}

}  // namespace

TEST(SparsityPattern, ParsesEveryKind) {
  const auto d = SparsityPattern::parse("dense");
  EXPECT_EQ(d.kind, Kind::dense);
  EXPECT_EQ(d.density(), 1.0);
  EXPECT_EQ(d.to_string(), "dense");
  EXPECT_FALSE(d.is_structured());

  const auto u = SparsityPattern::parse(" Unstructured ", 0.7);
  EXPECT_EQ(u.kind, Kind::unstructured);
  EXPECT_DOUBLE_EQ(u.density(), 0.3);
  EXPECT_EQ(u.to_string(), "unstructured");

  const auto p24 = SparsityPattern::parse("2:4");
  EXPECT_EQ(p24.kind, Kind::nm);
  EXPECT_EQ(p24.n, 2);
  EXPECT_EQ(p24.m, 4);
  EXPECT_EQ(p24.density(), 0.5);
  EXPECT_EQ(p24.to_string(), "2:4");
  EXPECT_TRUE(p24.is_structured());

  const auto p18 = SparsityPattern::parse("1:8");
  EXPECT_EQ(p18.density(), 0.125);
  EXPECT_EQ(SparsityPattern::parse("15:16").density(), 15.0 / 16.0);

  const auto v = SparsityPattern::parse("64:2:8");
  EXPECT_EQ(v.kind, Kind::vnm);
  EXPECT_EQ(v.v, 64);
  EXPECT_EQ(v.n, 2);
  EXPECT_EQ(v.m, 8);
  EXPECT_EQ(v.density(), 0.25);
  EXPECT_EQ(v.to_string(), "64:2:8");
  EXPECT_EQ(SparsityPattern::parse("128:2:16").density(), 0.125);
  EXPECT_EQ(SparsityPattern::parse("16:2:4").density(), 0.5);
}

TEST(SparsityPattern, ToStringRoundTrips) {
  for (const char* s : {"dense", "unstructured", "2:4", "1:8", "7:16", "16:2:4", "32:2:5", "64:2:8", "128:2:16"}) {
    const auto p = SparsityPattern::parse(s, 0.25);
    EXPECT_EQ(p.to_string(), s);
    EXPECT_EQ(SparsityPattern::parse(p.to_string(), p.sparsity), p);
  }
  EXPECT_EQ(SparsityPattern::parse("2:4"), SparsityPattern::nm(2, 4));
  EXPECT_EQ(SparsityPattern::parse("64:2:8"), SparsityPattern::vnm(64, 2, 8));
  EXPECT_EQ(SparsityPattern::parse("unstructured", 0.5), SparsityPattern::unstructured(0.5));
  EXPECT_FALSE(SparsityPattern::parse("unstructured", 0.5) == SparsityPattern::unstructured(0.6));
}

TEST(SparsityPattern, RejectsMalformedStrings) {
  expect_parse_error("64:2:3", {"64:2:3", "M must be in 4..16", "got 3"});
  expect_parse_error("64:2:17", {"M must be in 4..16", "got 17"});
  expect_parse_error("3:2", {"\"3:2\"", "N must be smaller than M", "N = 3 >= M = 2"});
  expect_parse_error("4:4", {"N must be smaller than M"});
  expect_parse_error("0:4", {"N must be at least 1", "got 0"});
  expect_parse_error("2:17", {"M must be at most 16", "got 17"});
  expect_parse_error("2:4:8:1", {"\"2:4:8:1\"", "4 fields"});
  expect_parse_error("abc", {"\"abc\"", "not recognised", "2:4", "64:2:8"});
  expect_parse_error("", {"not recognised"});
  expect_parse_error("48:2:8", {"V must be one of 16, 32, 64, 128", "got 48"});
  expect_parse_error("8:2:8", {"V must be one of", "got 8"});
  expect_parse_error("64:1:8", {"N must be 2", "got 1"});
  expect_parse_error("64:4:8", {"N must be 2", "got 4"});
  expect_parse_error("2:", {"M is empty"});
  expect_parse_error(":4", {"N is empty"});
  expect_parse_error("2:4x", {"M \"4x\" is not a non-negative integer"});
  expect_parse_error("-2:4", {"N \"-2\" is not a non-negative integer"});
  expect_parse_error("2 :4", {"N \"2 \""});
  expect_parse_error("99999999999:4", {"too large"});
  expect_parse_error("unstructured:0.5", {"\"unstructured:0.5\"", "N \"unstructured\""});
  EXPECT_NE(error_of([] { SparsityPattern::parse("unstructured", 1.5); }).find("[0, 1]"), std::string::npos);
  EXPECT_NE(error_of([] { SparsityPattern::parse("unstructured", -0.1); }).find("[0, 1]"), std::string::npos);
}

TEST(SparsityPattern, ConstructorsValidateToo) {
  EXPECT_THROW(SparsityPattern::nm(2, 2), Error);
  EXPECT_THROW(SparsityPattern::nm(0, 4), Error);
  EXPECT_THROW(SparsityPattern::nm(1, 32), Error);
  EXPECT_THROW(SparsityPattern::vnm(64, 2, 3), Error);
  EXPECT_THROW(SparsityPattern::vnm(100, 2, 8), Error);
  EXPECT_THROW(SparsityPattern::vnm(64, 3, 8), Error);
  EXPECT_NO_THROW(SparsityPattern::vnm(16, 2, 16));
}

TEST(SparsityPattern, DivisibilityErrorsNameTheTensor) {
  const auto p24 = SparsityPattern::parse("2:4");
  EXPECT_NO_THROW(check_divisible(p24, 3, 8, "w"));
  std::string msg = error_of([&] { check_divisible(p24, 8, 770, "blocks.0.mlp.fc1.weight"); });
  EXPECT_NE(msg.find("'blocks.0.mlp.fc1.weight'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cols (770)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("M = 4"), std::string::npos) << msg;

  const auto v = SparsityPattern::parse("64:2:8");
  EXPECT_NO_THROW(check_divisible(v, 128, 16, "attn.qkv"));
  msg = error_of([&] { check_divisible(v, 96, 16, "attn.qkv"); });
  EXPECT_NE(msg.find("'attn.qkv'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rows (96)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("V = 64"), std::string::npos) << msg;
  msg = error_of([&] { check_divisible(v, 128, 12, "attn.out"); });
  EXPECT_NE(msg.find("'attn.out'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cols (12)"), std::string::npos) << msg;

  EXPECT_NO_THROW(check_divisible(SparsityPattern::dense(), 3, 5, "x"));
  EXPECT_NO_THROW(check_divisible(SparsityPattern::unstructured(0.5), 3, 5, "x"));
}

TEST(CheckPattern, NmCountsViolatingGroups) {
  // 2 rows × 8 cols; row 0 group 1 holds 3 non-zeros, row 1 is fine.
  const float w[16] = {1, 0, 0, 2, 3, 4, 5, 0,  //
                       0, 0, 0, 0, 0, 6, 0, 7};
  const auto p = SparsityPattern::parse("2:4");
  const auto bad = cpu::check_pattern(w, 2, 8, p);
  EXPECT_FALSE(bad.ok);
  EXPECT_EQ(bad.violations, 1);
  EXPECT_EQ(bad.nonzeros, 7);
  EXPECT_EQ(bad.total, 16);
  EXPECT_DOUBLE_EQ(bad.density, 7.0 / 16.0);
  EXPECT_NE(bad.detail.find("row 0 columns 4..7 hold 3"), std::string::npos) << bad.detail;
  EXPECT_TRUE(cpu::check_pattern(w, 2, 8, SparsityPattern::parse("3:4")).ok);
  EXPECT_FALSE(cpu::check_pattern(w, 2, 8, SparsityPattern::parse("1:4")).ok);
  EXPECT_EQ(cpu::check_pattern(w, 2, 8, SparsityPattern::parse("1:4")).violations, 3);
  EXPECT_TRUE(cpu::check_pattern(w, 2, 8, SparsityPattern::dense()).ok);
  const auto shape = cpu::check_pattern(w, 2, 8, SparsityPattern::parse("2:16"));
  EXPECT_FALSE(shape.ok);
  EXPECT_NE(shape.detail.find("not a multiple of M = 16"), std::string::npos) << shape.detail;
  // A NaN is a non-zero.
  const float nan_w[4] = {std::numeric_limits<float>::quiet_NaN(), 1, 1, 0};
  EXPECT_FALSE(cpu::check_pattern(nan_w, 1, 4, p).ok);
}

TEST(CheckPattern, Unstructured) {
  std::vector<float> w(10, 0.0f);
  for (int i = 0; i < 4; ++i) w[i * 2] = 1.0f + i;
  EXPECT_TRUE(cpu::check_pattern(w.data(), 2, 5, SparsityPattern::unstructured(0.6)).ok);
  const auto r = cpu::check_pattern(w.data(), 2, 5, SparsityPattern::unstructured(0.7));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.detail.find("4 non-zeros of 10, at most 3"), std::string::npos) << r.detail;
}

TEST(CheckPattern, VnmBlocks) {
  // V = 16, M = 8: one block of 16 rows × 8 cols (plus a second block column).
  const int rows = 16, cols = 16;
  std::vector<float> w(rows * cols, 0.0f);
  // Non-zeros of block 0 only in columns {1, 3, 4, 6}, at most 2 per row.
  const int sel[4] = {1, 3, 4, 6};
  for (int r = 0; r < rows; ++r) {
    w[r * cols + sel[r % 4]] = 1.0f + r;
    w[r * cols + sel[(r + 1) % 4]] = -2.0f - r;
    w[r * cols + 8 + (r % 2)] = 3.0f;  // block 1 uses columns 8, 9
  }
  const auto p = SparsityPattern::parse("16:2:8");
  EXPECT_TRUE(cpu::check_pattern(w.data(), rows, cols, p).ok);
  // A fifth column in block 0 (row 5 still holds 2 non-zeros after moving one).
  auto five = w;
  five[5 * cols + sel[5 % 4]] = 0.0f;
  five[5 * cols + 0] = 9.0f;
  auto r5 = cpu::check_pattern(five.data(), rows, cols, p);
  EXPECT_FALSE(r5.ok);
  EXPECT_EQ(r5.violations, 1);
  EXPECT_NE(r5.detail.find("non-zeros in 5 columns"), std::string::npos) << r5.detail;
  // A third non-zero in one row.
  auto three = w;
  three[7 * cols + 9] = 1.0f;
  three[7 * cols + 8] = 1.0f;
  three[7 * cols + 10] = 1.0f;
  auto r3 = cpu::check_pattern(three.data(), rows, cols, p);
  EXPECT_FALSE(r3.ok);
  EXPECT_NE(r3.detail.find("row 7 holds 3 non-zeros"), std::string::npos) << r3.detail;
  EXPECT_FALSE(cpu::check_pattern(w.data(), rows, cols, SparsityPattern::parse("32:2:8")).ok);  // rows % 32
  // Masks themselves can be checked.
  std::vector<uint8_t> m(w.size());
  for (size_t i = 0; i < w.size(); ++i) m[i] = w[i] != 0.0f;
  EXPECT_TRUE(cpu::check_pattern(m.data(), rows, cols, p).ok);
}
