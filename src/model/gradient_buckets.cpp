#include "model/gradient_buckets.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "core/error.h"

namespace esplag {

namespace {

struct Range {
  size_t begin = 0, end = 0, numel = 0;
};

// Block l's tensors as [begin, end) with the elements they hold (numel == end - begin when
// they are contiguous); numel 0 when the block has none. The tensors of a block that come
// after a tensor of no block which follows the blocks (a layer's own tensors, such as an
// adapter's, appended after the flat layout) are not the block's here: they go with the rest.
std::vector<Range> block_ranges(const std::vector<ParamInfo>& stored, int n_layer) {
  std::vector<Range> r(size_t(n_layer), Range{SIZE_MAX, 0, 0});
  bool seen_block = false, past_blocks = false;
  for (const ParamInfo& p : stored) {
    if (p.name.rfind("blocks.", 0) != 0) {
      past_blocks = past_blocks || seen_block;
      continue;
    }
    seen_block = true;
    if (past_blocks) continue;
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
  const std::vector<GradientBucket> one{{GradientBucket::kAfterBackward, 0, total}};
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
  // After the last block: the flat tensors (final norm, LM head), final ahead of the blocks'
  // backward, up to the layers' own tensors appended after the layout (block-named).
  size_t head_end = blocks.back().end;
  for (const ParamInfo& p : stored) {
    if (p.offset < head_end) continue;
    if (p.name.rfind("blocks.", 0) == 0) break;
    head_end = p.offset + p.numel;
  }
  if (head_end > blocks.back().end) out.push_back({GradientBucket::kAfterHead, blocks.back().end, head_end});
  // The rest, after the backward: those own tensors, and what lies before the first block.
  if (head_end < total) out.push_back({GradientBucket::kAfterBackward, head_end, total});
  if (blocks.front().begin > 0) out.push_back({GradientBucket::kAfterBackward, 0, blocks.front().begin});
  return out;
}

size_t ShardedBuckets::per_rank() const { return std::accumulate(slice.begin(), slice.end(), size_t(0)); }

ShardedBuckets shard_gradient_buckets(std::vector<ParamInfo>& stored, std::vector<GradientBucket>& buckets, int ranks) {
  ESPLAG_CHECK(ranks >= 1, "gradient buckets: cannot shard over ", ranks, " ranks");
  const size_t n = size_t(ranks);
  std::vector<size_t> order(buckets.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return buckets[a].begin < buckets[b].begin; });
  ShardedBuckets out;
  out.slice.resize(buckets.size());
  // Old bucket ends in layout order, with how far everything from there on moves.
  std::vector<std::pair<size_t, size_t>> shift_from;
  size_t shift = 0;
  for (const size_t i : order) {
    GradientBucket& b = buckets[i];
    ESPLAG_CHECK(b.begin + shift == out.padded, "gradient buckets: the buckets do not cover the layout in one piece");
    const size_t len = b.end - b.begin;
    const size_t slice = ((len + n - 1) / n + 63) / 64 * 64;
    out.slice[i] = slice;
    const size_t old_end = b.end;
    b.begin += shift;
    b.end = b.begin + n * slice;
    shift += n * slice - len;
    shift_from.push_back({old_end, shift});
    out.padded = b.end;
  }
  for (ParamInfo& p : stored) {
    const auto after = std::upper_bound(shift_from.begin(), shift_from.end(), std::pair{p.offset, SIZE_MAX});
    if (after != shift_from.begin()) p.offset += std::prev(after)->second;
  }
  return out;
}

int bucket_of(const std::vector<GradientBucket>& buckets, size_t offset) {
  for (size_t i = 0; i < buckets.size(); ++i)
    if (offset >= buckets[i].begin && offset < buckets[i].end) return int(i);
  return -1;
}

GradientStorage plan_gradient_storage(const std::vector<GradientBucket>& buckets, bool ring) {
  GradientStorage g;
  g.slot.assign(buckets.size(), -1);
  int ringed = 0;
  for (size_t i = 0; ring && i < buckets.size(); ++i)
    if (buckets[i].after_block >= 0) {
      g.slot[i] = ringed++ % GradientStorage::kRingSlots;
      g.slot_elements = std::max(g.slot_elements, buckets[i].end - buckets[i].begin);
    }
  g.slots = std::min(ringed, GradientStorage::kRingSlots);
  g.elements = size_t(g.slots) * g.slot_elements;
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (g.slots == 0) {  // the layout itself
      g.offset.push_back(buckets[i].begin);
      g.elements = std::max(g.elements, buckets[i].end);
    } else if (g.slot[i] >= 0) {
      g.offset.push_back(size_t(g.slot[i]) * g.slot_elements);
    } else {
      g.offset.push_back(g.elements);
      g.elements += buckets[i].end - buckets[i].begin;
    }
  }
  return g;
}

size_t GradientStorage::of(const std::vector<GradientBucket>& buckets, size_t at) const {
  if (buckets.empty()) return at;
  const int b = bucket_of(buckets, at);
  ESPLAG_CHECK(b >= 0, "gradient storage: element ", at, " lies in no bucket");
  return offset[size_t(b)] + (at - buckets[size_t(b)].begin);
}

GradientZeroRanges gradient_zero_ranges(const std::vector<ParamInfo>& stored,
                                        const std::vector<GradientBucket>& buckets, const GradientStorage& g,
                                        const std::string& head) {
  auto overwritten = [&](const std::string& n) {
    if (n == head) return true;
    if (n.rfind("blocks.", 0) != 0 || n.size() < 7 || n.compare(n.size() - 7, 7, ".weight") != 0) return false;
    return n.find(".attn.") != std::string::npos || n.find(".mlp.") != std::string::npos;
  };
  GradientZeroRanges z;
  z.ring.resize(buckets.size());
  auto add = [](std::vector<std::pair<size_t, size_t>>& ranges, size_t o, size_t n) {
    if (!ranges.empty() && ranges.back().first + ranges.back().second == o)
      ranges.back().second += n;
    else
      ranges.push_back({o, n});
  };
  std::vector<size_t> tensors_end(buckets.size(), 0);  // per bucket, the end of its last tensor
  for (const ParamInfo& p : stored) {
    const int b = bucket_of(buckets, p.offset);
    if (b >= 0) tensors_end[size_t(b)] = std::max(tensors_end[size_t(b)], p.offset + p.numel);
    if (overwritten(p.name) || p.numel == 0) continue;
    const size_t at = b >= 0 ? g.offset[size_t(b)] + (p.offset - buckets[size_t(b)].begin) : p.offset;
    add(b >= 0 && g.slot[size_t(b)] >= 0 ? z.ring[size_t(b)] : z.zero_grad, at, p.numel);
  }
  for (size_t b = 0; b < buckets.size(); ++b)
    if (g.slot[b] >= 0 && tensors_end[b] < buckets[b].end)
      add(z.ring[b], g.offset[b] + (tensors_end[b] - buckets[b].begin), buckets[b].end - tensors_end[b]);
  return z;
}

std::vector<ParamInfo> stored_param_layout(const ModelConfig& config, const std::set<std::string>& kept_values) {
  std::vector<ParamInfo> stored = transformer_param_layout(config);
  size_t offset = 0;
  for (ParamInfo& i : stored) {
    if (kept_values.count(i.name)) {
      i.shape = {i.shape.at(0), i.shape.at(1) / 2};
      i.numel = size_t(shape_numel(i.shape));
    }
    i.offset = offset;
    offset += i.numel;
  }
  return stored;
}

}  // namespace esplag
