#include "train/zero_partition.h"

#include <algorithm>

#include "core/error.h"

namespace esplag {

ZeroPartition::ZeroPartition(std::vector<int64_t> sizes, int world) : sizes_(std::move(sizes)), world_(world) {
  ESPLAG_CHECK(world >= 1, "a ZeRO partition needs at least one rank, got ", world);
  starts_.assign(1, 0);
  for (int64_t n : sizes_) {
    ESPLAG_CHECK(n >= 0, "a ZeRO partition's tensor has ", n, " elements");
    starts_.push_back(starts_.back() + n);
  }
}

int64_t ZeroPartition::begin(int rank) const {
  const int64_t q = total() / world_, extra = total() % world_;
  return rank * q + std::min<int64_t>(rank, extra);
}

std::vector<size_t> ZeroPartition::counts() const {
  std::vector<size_t> out(world_);
  for (int r = 0; r < world_; ++r) out[r] = static_cast<size_t>(count(r));
  return out;
}

std::vector<ZeroPiece> ZeroPartition::pieces(int rank) const {
  const int64_t first = begin(rank), last = begin(rank + 1);
  std::vector<ZeroPiece> out;
  if (sizes_.empty()) return out;
  // The first tensor that ends after `first`.
  auto t = std::upper_bound(starts_.begin(), starts_.end() - 1, first) - 1;
  for (int i = static_cast<int>(t - starts_.begin()); i < static_cast<int>(sizes_.size()) && starts_[i] < last; ++i) {
    const int64_t b = std::max(first, starts_[i]) - starts_[i], e = std::min(last, starts_[i + 1]) - starts_[i];
    if (e > b) out.push_back({i, b, e, starts_[i] + b - first});
  }
  return out;
}

}  // namespace esplag
