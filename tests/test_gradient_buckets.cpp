// The buckets a data-parallel GPU step averages its gradients in while the backward runs
// (model/gradient_buckets.h): they cover the storage layout exactly once, each holds whole
// consecutive blocks launched after its lowest block's backward, the final norm and LM head
// go ahead of the blocks, the rest after the backward, and a layout whose blocks are not
// contiguous gets one bucket.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/gradient_buckets.h"
#include "model/transformer.h"

namespace esplag {
namespace {

// [begin, end) of block l's tensors in `layout`.
std::pair<size_t, size_t> block_range(const std::vector<ParamInfo>& layout, int l) {
  const std::string prefix = "blocks." + std::to_string(l) + ".";
  size_t begin = SIZE_MAX, end = 0;
  for (const ParamInfo& p : layout)
    if (p.name.rfind(prefix, 0) == 0) {
      begin = std::min(begin, p.offset);
      end = std::max(end, p.offset + p.numel);
    }
  return {begin, end};
}

ModelConfig llama(int n_layer) {
  ModelConfig c = model_preset("llama-tiny");
  c.vocab_size = 256;
  c.n_layer = n_layer;
  return c;
}

size_t total_of(const std::vector<ParamInfo>& layout) { return layout.back().offset + layout.back().numel; }

// Every element of [0, total) in exactly one bucket.
void expect_cover(const std::vector<GradientBucket>& buckets, size_t total) {
  std::vector<GradientBucket> sorted = buckets;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  size_t at = 0;
  for (const GradientBucket& b : sorted) {
    EXPECT_EQ(b.begin, at);
    EXPECT_LT(b.begin, b.end);
    at = b.end;
  }
  EXPECT_EQ(at, total);
}

TEST(GradientBuckets, EachBucketHoldsWholeBlocksLaunchedAfterItsLowestBlock) {
  const ModelConfig c = llama(6);
  const std::vector<ParamInfo> layout = transformer_param_layout(c);
  const size_t total = total_of(layout);
  const auto [b5, e5] = block_range(layout, 5);
  const size_t block = e5 - b5;
  // Two blocks and a bit per bucket: buckets of three blocks (5..3, 2..0), then the rest.
  const std::vector<GradientBucket> buckets = plan_gradient_buckets(layout, c.n_layer, total, 2 * block + 1);
  expect_cover(buckets, total);
  ASSERT_GE(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].after_block, 3);
  EXPECT_EQ(buckets[0].begin, block_range(layout, 3).first);
  EXPECT_EQ(buckets[0].end, e5);
  EXPECT_EQ(buckets[1].after_block, 0);
  EXPECT_EQ(buckets[1].begin, block_range(layout, 0).first);
  EXPECT_EQ(buckets[1].end, block_range(layout, 3).first);
  // Then the final norm and the LM head, launched ahead of the blocks, and the embeddings.
  ASSERT_EQ(buckets.size(), 4u);
  EXPECT_EQ(buckets[2].after_block, GradientBucket::kAfterHead);
  EXPECT_EQ(std::pair(buckets[2].begin, buckets[2].end), std::pair(e5, total));
  EXPECT_EQ(buckets[3].after_block, GradientBucket::kAfterBackward);
  EXPECT_EQ(std::pair(buckets[3].begin, buckets[3].end), std::pair(size_t(0), block_range(layout, 0).first));
  // One element per bucket: one bucket per block.
  const std::vector<GradientBucket> each = plan_gradient_buckets(layout, c.n_layer, total, 1);
  expect_cover(each, total);
  for (int l = c.n_layer - 1, i = 0; l >= 0; --l, ++i) {
    EXPECT_EQ(each[size_t(i)].after_block, l);
    EXPECT_EQ(std::pair(each[size_t(i)].begin, each[size_t(i)].end), block_range(layout, l));
  }
  // A bucket larger than every block: all blocks in one, after block 0.
  const std::vector<GradientBucket> all = plan_gradient_buckets(layout, c.n_layer, total, total);
  expect_cover(all, total);
  EXPECT_EQ(all[0].after_block, 0);
  EXPECT_EQ(all[0].end - all[0].begin, e5 - block_range(layout, 0).first);
}

TEST(GradientBuckets, ExtraTensorsAfterTheLayoutGoAfterTheBackward) {
  const ModelConfig c = llama(2);
  std::vector<ParamInfo> layout = transformer_param_layout(c);
  ParamInfo adapter{"blocks.0.mlp.fc.lora_l", {64, 8}, total_of(layout), 64 * 8, true};
  layout.push_back(adapter);  // a layer's own tensor, appended as GpuTransformer lays them out
  const size_t total = total_of(layout);
  const std::vector<GradientBucket> buckets = plan_gradient_buckets(layout, c.n_layer, total, 1);
  expect_cover(buckets, total);
  const auto last = std::find_if(buckets.begin(), buckets.end(),
                                 [&](const GradientBucket& b) { return b.end == total; });
  ASSERT_NE(last, buckets.end());
  EXPECT_EQ(last->after_block, GradientBucket::kAfterBackward);
  EXPECT_EQ(last->begin, adapter.offset);
  // The final norm and the LM head before it still go ahead of the blocks.
  const auto head = std::find_if(buckets.begin(), buckets.end(), [&](const GradientBucket& b) {
    return b.after_block == GradientBucket::kAfterHead;
  });
  ASSERT_NE(head, buckets.end());
  EXPECT_EQ(std::pair(head->begin, head->end), std::pair(block_range(layout, 1).second, adapter.offset));
  // The blocks still make a bucket each (block 0's adapter is not block 0's range).
  ASSERT_GE(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].after_block, 1);
  EXPECT_EQ(std::pair(buckets[0].begin, buckets[0].end), block_range(transformer_param_layout(c), 1));
  EXPECT_EQ(buckets[1].after_block, 0);
}

TEST(GradientBuckets, NoBucketSizeOrScatteredBlocksGiveOneBucketAfterTheBackward) {
  const ModelConfig c = llama(2);
  std::vector<ParamInfo> layout = transformer_param_layout(c);
  const size_t total = total_of(layout);
  const auto one = [&](const std::vector<GradientBucket>& b) {
    ASSERT_EQ(b.size(), 1u);
    EXPECT_EQ(b[0].after_block, -1);
    EXPECT_EQ(b[0].begin, 0u);
    EXPECT_EQ(b[0].end, total);
  };
  one(plan_gradient_buckets(layout, c.n_layer, total, 0));
  // Block 0's first tensor moved behind block 1: its range no longer holds only its own.
  const auto it = std::find_if(layout.begin(), layout.end(), [](const ParamInfo& p) {
    return p.name.rfind("blocks.0.", 0) == 0;
  });
  ASSERT_NE(it, layout.end());
  it->offset = block_range(layout, 1).second;
  one(plan_gradient_buckets(layout, c.n_layer, total, 1));
}

// ZeRO on the GPU: every bucket padded to `ranks` slices of a multiple of 64 elements, the
// tensors keeping their order and their bucket, the buckets still covering the layout.
TEST(GradientBuckets, ShardedBucketsArePaddedToEqualSlicesOfEveryRank) {
  const ModelConfig c = llama(6);
  const std::vector<ParamInfo> packed = transformer_param_layout(c);
  const size_t total = total_of(packed);
  for (const int ranks : {1, 2, 3, 8})
    for (const size_t elements : {size_t(0), size_t(1), total / 3}) {
      std::vector<ParamInfo> layout = packed;
      const std::vector<GradientBucket> before = plan_gradient_buckets(layout, c.n_layer, total, elements);
      std::vector<GradientBucket> buckets = before;
      const ShardedBuckets sharded = shard_gradient_buckets(layout, buckets, ranks);
      ASSERT_EQ(sharded.slice.size(), buckets.size());
      expect_cover(buckets, sharded.padded);
      size_t per_rank = 0;
      for (size_t i = 0; i < buckets.size(); ++i) {
        const size_t len = before[i].end - before[i].begin, slice = sharded.slice[i];
        EXPECT_EQ(buckets[i].after_block, before[i].after_block);
        EXPECT_EQ(slice % 64, 0u);
        EXPECT_GE(slice * size_t(ranks), len);
        EXPECT_LT(slice * size_t(ranks), len + 64 * size_t(ranks));  // the least such slice
        EXPECT_EQ(buckets[i].end - buckets[i].begin, slice * size_t(ranks));
        per_rank += slice;
        // Each tensor moved with its bucket, by the padding of the buckets before it.
        for (size_t k = 0; k < packed.size(); ++k)
          if (packed[k].offset >= before[i].begin && packed[k].offset < before[i].end)
            EXPECT_EQ(layout[k].offset - buckets[i].begin, packed[k].offset - before[i].begin) << layout[k].name;
      }
      EXPECT_EQ(sharded.per_rank(), per_rank);
      for (size_t k = 1; k < layout.size(); ++k)
        EXPECT_GE(layout[k].offset, layout[k - 1].offset + layout[k - 1].numel) << layout[k].name;
    }
  // One bucket: chunks of ceil(E / ranks) rounded up to 64, as the whole layout's.
  std::vector<ParamInfo> layout = packed;
  std::vector<GradientBucket> one = plan_gradient_buckets(layout, c.n_layer, total, 0);
  const ShardedBuckets sharded = shard_gradient_buckets(layout, one, 3);
  EXPECT_EQ(sharded.slice.at(0), ((total + 2) / 3 + 63) / 64 * 64);
  EXPECT_EQ(sharded.padded, 3 * sharded.slice[0]);
  for (size_t k = 0; k < layout.size(); ++k) EXPECT_EQ(layout[k].offset, packed[k].offset);
}

// ZeRO stage 2 on the GPU: the blocks' buckets take turns in two slots (consecutive ones
// in different slots), the rest keep buffers of their own after the slots, no two buckets
// that live at once overlap, and every element maps into its bucket's place. Without the
// ring, the storage is the layout.
TEST(GradientBuckets, TheBlocksBucketsTakeTurnsInARingOfSlots) {
  const ModelConfig c = llama(6);
  std::vector<ParamInfo> layout = transformer_param_layout(c);
  const size_t total = total_of(layout);
  const auto [b5, e5] = block_range(layout, 5);
  std::vector<GradientBucket> buckets = plan_gradient_buckets(layout, c.n_layer, total, e5 - b5);
  const size_t padded = shard_gradient_buckets(layout, buckets, 2).padded;
  ASSERT_EQ(buckets.size(), 8u);  // one per block, then the rest after and before the blocks
  const GradientStorage ring = plan_gradient_storage(buckets, true);
  EXPECT_EQ(ring.slots, 2);
  size_t largest = 0, rest = 0;
  for (size_t i = 0; i < buckets.size(); ++i) {
    const size_t len = buckets[i].end - buckets[i].begin;
    if (buckets[i].after_block >= 0) {
      largest = std::max(largest, len);
      EXPECT_EQ(ring.slot[i], int(i % 2)) << i;
      EXPECT_EQ(ring.offset[i], size_t(ring.slot[i]) * ring.slot_elements) << i;
    } else {
      EXPECT_EQ(ring.slot[i], -1);
      EXPECT_EQ(ring.offset[i], 2 * ring.slot_elements + rest) << i;
      rest += len;
    }
  }
  EXPECT_EQ(ring.slot_elements, largest);
  EXPECT_EQ(ring.elements, 2 * largest + rest);
  EXPECT_LT(ring.elements, padded);
  for (const ParamInfo& p : layout) {
    const auto b = std::find_if(buckets.begin(), buckets.end(),
                                [&](const GradientBucket& g) { return p.offset >= g.begin && p.offset < g.end; });
    ASSERT_NE(b, buckets.end()) << p.name;
    const size_t i = size_t(b - buckets.begin());
    EXPECT_EQ(ring.of(buckets, p.offset), ring.offset[i] + (p.offset - b->begin)) << p.name;
    EXPECT_LE(ring.of(buckets, p.offset) + p.numel, ring.offset[i] + (b->end - b->begin)) << p.name;
  }
  const GradientStorage flat = plan_gradient_storage(buckets, false);
  EXPECT_EQ(flat.slots, 0);
  for (size_t i = 0; i < buckets.size(); ++i) EXPECT_EQ(flat.offset[i], buckets[i].begin);
  EXPECT_EQ(flat.of(buckets, layout[3].offset), layout[3].offset);
  // No block buckets: the layout itself, as without the ring.
  const std::vector<GradientBucket> none = plan_gradient_buckets(layout, c.n_layer, total, 0);
  EXPECT_EQ(plan_gradient_storage(none, true).slots, 0);
  EXPECT_EQ(plan_gradient_storage(none, true).offset, std::vector<size_t>{0});
  // One block bucket: one slot.
  std::vector<ParamInfo> packed = transformer_param_layout(c);
  std::vector<GradientBucket> few = plan_gradient_buckets(packed, c.n_layer, total, total);
  EXPECT_EQ(plan_gradient_storage(few, true).slots, 1);
}

// What must be zero before a backward adds into it: the tensors but the blocks' attention and
// MLP weights and the LM head's, zero_grad's outside the ring; a ring bucket's own, with its
// padding, which its slot's previous bucket (a larger one here: five blocks in buckets of
// two, the last of one) wrote with its gradients.
TEST(GradientBuckets, ARingSlotZeroesItsBucketsAddedTensorsAndPadding) {
  const ModelConfig c = llama(5);
  std::vector<ParamInfo> layout = transformer_param_layout(c);
  const size_t total = total_of(layout);
  const auto [b4, e4] = block_range(layout, 4);
  std::vector<GradientBucket> buckets = plan_gradient_buckets(layout, c.n_layer, total, 2 * (e4 - b4));
  shard_gradient_buckets(layout, buckets, 3);
  const GradientStorage ring = plan_gradient_storage(buckets, true);
  ASSERT_EQ(ring.slot.at(2), 0);  // blocks 0 (one), after 4..3 (two) in the same slot
  ASSERT_LT(buckets[2].end - buckets[2].begin, buckets[0].end - buckets[0].begin);
  const std::string head = c.tie_embeddings ? "embed.tokens.weight" : "lm_head.weight";
  const GradientZeroRanges z = gradient_zero_ranges(layout, buckets, ring, head);
  ASSERT_EQ(z.ring.size(), buckets.size());
  auto covered = [](const std::vector<std::pair<size_t, size_t>>& ranges, size_t o) {
    return std::any_of(ranges.begin(), ranges.end(),
                       [&](const auto& r) { return o >= r.first && o < r.first + r.second; });
  };
  for (const ParamInfo& p : layout) {
    const int b = bucket_of(buckets, p.offset);
    ASSERT_GE(b, 0) << p.name;
    const bool block_weight = p.name.rfind("blocks.", 0) == 0 && p.name.find("norm") == std::string::npos &&
                              p.name.find(".weight") != std::string::npos;
    const bool overwritten = p.name == head || block_weight;
    const bool in_ring = ring.slot[size_t(b)] >= 0;
    const size_t at = ring.of(buckets, p.offset);
    EXPECT_EQ(covered(z.zero_grad, at), !overwritten && !in_ring) << p.name;
    EXPECT_EQ(covered(z.ring[size_t(b)], at), !overwritten && in_ring) << p.name;
    EXPECT_TRUE(covered(z.ring[size_t(b)], at + p.numel - 1) == covered(z.ring[size_t(b)], at)) << p.name;
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (ring.slot[b] < 0) {
      EXPECT_TRUE(z.ring[b].empty()) << b;
      continue;
    }
    size_t tensors_end = 0;
    for (const ParamInfo& p : layout)
      if (bucket_of(buckets, p.offset) == int(b)) tensors_end = std::max(tensors_end, p.offset + p.numel);
    for (size_t o = tensors_end; o < buckets[b].end; ++o)
      EXPECT_TRUE(covered(z.ring[b], ring.offset[b] + (o - buckets[b].begin))) << "bucket " << b << " padding " << o;
  }
  EXPECT_GT(buckets[2].end, [&] {
    size_t e = 0;
    for (const ParamInfo& p : layout)
      if (bucket_of(buckets, p.offset) == 2) e = std::max(e, p.offset + p.numel);
    return e;
  }());  // the case at hand: the bucket is padded
}

TEST(GradientBuckets, TheStoredLayoutKeepsHalfOfEachKeptValuesWeight) {
  const ModelConfig c = llama(2);
  const std::vector<ParamInfo> dense = transformer_param_layout(c);
  const std::string fc = transformer_linear_names(c).at(2);
  const std::vector<ParamInfo> stored = stored_param_layout(c, {fc});
  ASSERT_EQ(stored.size(), dense.size());
  size_t offset = 0;
  for (size_t k = 0; k < stored.size(); ++k) {
    EXPECT_EQ(stored[k].offset, offset) << stored[k].name;
    const bool kept = stored[k].name == fc;
    EXPECT_EQ(stored[k].numel, kept ? dense[k].numel / 2 : dense[k].numel) << stored[k].name;
    if (kept) EXPECT_EQ(stored[k].shape, (Shape{dense[k].shape.at(0), dense[k].shape.at(1) / 2}));
    offset += stored[k].numel;
  }
}

}  // namespace
}  // namespace esplag
