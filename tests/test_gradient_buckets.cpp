// The buckets a data-parallel GPU step averages its gradients in while the backward runs
// (model/gradient_buckets.h): they cover the storage layout exactly once, each holds whole
// consecutive blocks launched after its lowest block's backward, the rest goes after the
// backward, and a layout whose blocks are not contiguous gets one bucket.
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
  for (size_t i = 2; i < buckets.size(); ++i) EXPECT_EQ(buckets[i].after_block, -1) << i;
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
  EXPECT_EQ(last->after_block, -1);
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

}  // namespace
}  // namespace esplag
