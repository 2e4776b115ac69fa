// ZeRO's partition of the trained state among the ranks of a data-parallel run
// (docs/distributed.md): the trainable tensors' elements, in the order of
// Transformer::trainable_params(), laid end to end and cut into one contiguous range per
// rank. The ranges are balanced: with T elements in all and N ranks, rank r owns
// [r·⌊T/N⌋ + min(r, T mod N), ...) of ⌊T/N⌋ elements, one more for the first T mod N ranks.
// A tensor may be split between ranks. The partition depends on the tensors' sizes and N
// alone, so every rank computes the same one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace esplag {

// Elements [begin, end) of tensor `tensor`, stored at `offset` in the owning rank's range.
struct ZeroPiece {
  int tensor = 0;
  int64_t begin = 0, end = 0, offset = 0;
};

class ZeroPartition {
 public:
  ZeroPartition() = default;
  // `sizes`: each tensor's elements, in order; `world`: the ranks (>= 1).
  ZeroPartition(std::vector<int64_t> sizes, int world);

  int world() const { return world_; }
  int64_t total() const { return starts_.empty() ? 0 : starts_.back(); }
  const std::vector<int64_t>& sizes() const { return sizes_; }
  // Where rank r's range begins in the flat order, and its elements.
  int64_t begin(int rank) const;
  int64_t count(int rank) const { return begin(rank + 1) - begin(rank); }
  // Every rank's count (HostChannel's reduce_scatter_sum and gathers take them).
  std::vector<size_t> counts() const;
  // The parts of the tensors in rank r's range, in order (empty tensors none).
  std::vector<ZeroPiece> pieces(int rank) const;

 private:
  std::vector<int64_t> sizes_;
  std::vector<int64_t> starts_;  // starts_[i]: tensor i's first element in the flat order; back(): the total
  int world_ = 1;
};

}  // namespace esplag
