// ZeRO's partition of the trained elements (train/zero_partition.h): balanced contiguous
// ranges over the tensors laid end to end, tensors split between ranks where a range ends.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "train/zero_partition.h"

using esplag::ZeroPartition;
using esplag::ZeroPiece;

namespace {

bool same(const ZeroPiece& a, const ZeroPiece& b) {
  return a.tensor == b.tensor && a.begin == b.begin && a.end == b.end && a.offset == b.offset;
}

}  // namespace

TEST(ZeroPartition, BalancedRangesSplitTensors) {
  // 3 + 0 + 8 = 11 elements over 3 ranks: 4, 4, 3 (the first 11 mod 3 ranks hold one more).
  const ZeroPartition p({3, 0, 8}, 3);
  EXPECT_EQ(p.total(), 11);
  EXPECT_EQ(p.counts(), (std::vector<size_t>{4, 4, 3}));
  EXPECT_EQ(p.begin(1), 4);
  EXPECT_EQ(p.begin(3), 11);
  const auto r0 = p.pieces(0), r1 = p.pieces(1), r2 = p.pieces(2);
  ASSERT_EQ(r0.size(), 2u);
  EXPECT_TRUE(same(r0[0], {0, 0, 3, 0}));
  EXPECT_TRUE(same(r0[1], {2, 0, 1, 3}));  // the empty tensor 1 has no piece
  ASSERT_EQ(r1.size(), 1u);
  EXPECT_TRUE(same(r1[0], {2, 1, 5, 0}));
  ASSERT_EQ(r2.size(), 1u);
  EXPECT_TRUE(same(r2[0], {2, 5, 8, 0}));
}

TEST(ZeroPartition, PiecesCoverEveryElementOnce) {
  const std::vector<int64_t> sizes = {7, 1, 0, 64, 5, 13};
  for (int world = 1; world <= 9; ++world) {
    const ZeroPartition p(sizes, world);
    std::vector<int> seen(p.total(), 0);
    std::vector<int64_t> starts = {0};
    for (int64_t n : sizes) starts.push_back(starts.back() + n);
    int64_t lo = p.total(), hi = 0;
    for (int r = 0; r < world; ++r) {
      int64_t filled = 0;
      for (const ZeroPiece& piece : p.pieces(r)) {
        EXPECT_EQ(piece.offset, filled) << world << " " << r;
        for (int64_t i = piece.begin; i < piece.end; ++i) ++seen[starts[piece.tensor] + i];
        filled += piece.end - piece.begin;
      }
      EXPECT_EQ(filled, p.count(r)) << world << " " << r;
      lo = std::min(lo, p.count(r)), hi = std::max(hi, p.count(r));
    }
    EXPECT_EQ(seen, std::vector<int>(p.total(), 1)) << world;
    EXPECT_LE(hi - lo, 1) << world;
  }
}

TEST(ZeroPartition, MoreRanksThanElementsAndNoTensors) {
  const ZeroPartition p({2}, 4);
  EXPECT_EQ(p.counts(), (std::vector<size_t>{1, 1, 0, 0}));
  EXPECT_TRUE(p.pieces(3).empty());
  EXPECT_TRUE(ZeroPartition({}, 2).pieces(0).empty());
  EXPECT_THROW(ZeroPartition({1}, 0), esplag::Error);
}
