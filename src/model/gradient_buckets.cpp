#include "model/gradient_buckets.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace esplag {

namespace {

struct Range {
  size_t begin = 0, end = 0, numel = 0;
};

// Block l's tensors as [begin, end) with the elements they hold (numel == end - begin when
// they are contiguous); numel 0 when the block has none.
std::vector<Range> block_ranges(const std::vector<ParamInfo>& stored, int n_layer) {
  std::vector<Range> r(size_t(n_layer), Range{SIZE_MAX, 0, 0});
  for (const ParamInfo& p : stored) {
    if (p.name.rfind("blocks.", 0) != 0) continue;
    const size_t dot = p.name.find('.', 7);
    const int l = std::stoi(p.name.substr(7, dot - 7));
    ESPLAG_CHECK(l >= 0 && l < n_layer, "gradient buckets: tensor '", p.name, "' names a block beyond the ", n_layer);
    Range& b = r[size_t(l)];
    b.begin = std::min(b.begin, p.offset);
    b.end = std::max(b.end, p.offset + p.numel);
    b.numel += p.numel;
  }
  return r;
}

}  // namespace

std::vector<GradientBucket> plan_gradient_buckets(const std::vector<ParamInfo>& stored, int n_layer, size_t total,
                                                  size_t bucket_elements) {
  const std::vector<GradientBucket> one{{-1, 0, total}};
  if (bucket_elements == 0 || n_layer == 0) return one;
  const std::vector<Range> blocks = block_ranges(stored, n_layer);
  for (int l = 0; l < n_layer; ++l) {
    const Range& b = blocks[size_t(l)];
    if (b.numel == 0 || b.numel != b.end - b.begin || (l > 0 && b.begin != blocks[size_t(l) - 1].end)) return one;
  }
  std::vector<GradientBucket> out;
  size_t end = blocks.back().end;  // the open bucket's end
  for (int l = n_layer - 1; l >= 0; --l) {
    const size_t begin = blocks[size_t(l)].begin;
    if (end - begin >= bucket_elements || l == 0) {
      out.push_back({l, begin, end});
      end = begin;
    }
  }
  // The rest, after the backward: what lies before the first block and after the last.
  if (blocks.back().end < total) out.push_back({-1, blocks.back().end, total});
  if (blocks.front().begin > 0) out.push_back({-1, 0, blocks.front().begin});
  return out;
}

}  // namespace esplag
