// The buckets in which a data-parallel GPU step averages its gradients over the ranks while
// the backward still runs (GpuModelOptions::reduce_gradients, docs/distributed.md).
//
// The backward finishes the blocks' gradients from the last block to the first; block l's
// tensors ("blocks.<l>.*") are final once its backward is done (a later block's backward
// writes only into its own block and into the previous block's bias gradient). A bucket is a
// contiguous range of the storage layout: consecutive blocks, from the last down, until it
// holds at least `bucket_elements`, launched after the backward of its first (lowest) block.
// The final norm and the LM head (the flat tensors after the blocks) are final once the
// backward of the head and the final norm is done, before any block's: their bucket is
// launched then. The rest (embeddings, the layers' extra tensors such as adapters) is final
// only at the end of the backward and goes last.
#pragma once

#include <cstddef>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "model/transformer.h"

namespace esplag {

struct GradientBucket {
  static constexpr int kAfterHead = -2;      // launched after the head's and the final norm's backward
  static constexpr int kAfterBackward = -1;  // launched after the whole backward
  int after_block = kAfterBackward;          // >= 0: launched after this block's backward
  size_t begin = 0, end = 0;                 // elements of the storage layout
};

// The buckets of a storage layout `stored` (offsets and numels in elements, in layout order)
// of `total` elements with `n_layer` blocks: the blocks' in launch order, then the rest's
// (the head's first). They cover [0, total) exactly once. With `bucket_elements` 0, or when
// a block's tensors are not one contiguous range following the previous block's, one bucket
// after the whole backward.
std::vector<GradientBucket> plan_gradient_buckets(const std::vector<ParamInfo>& stored, int n_layer, size_t total,
                                                  size_t bucket_elements);

// ZeRO on the GPU (GpuModelOptions::shard_optimizer): rank r owns slice r of every bucket,
// so that a bucket's gradients are reduce-scattered as soon as the backward has made them
// and the updated weights are all-gathered bucket by bucket. Each bucket is padded with
// zeros to `ranks` equal slices of a multiple of 64 elements: the tensors after it move
// (their offsets in `stored`), and so do the buckets' ranges.
struct ShardedBuckets {
  std::vector<size_t> slice;  // per bucket, in the buckets' order: the elements each rank owns
  size_t padded = 0;          // elements of the padded layout
  size_t per_rank() const;    // the elements one rank owns: the sum of the slices
};
ShardedBuckets shard_gradient_buckets(std::vector<ParamInfo>& stored, std::vector<GradientBucket>& buckets, int ranks);

// The index of the bucket that holds layout element `offset`, -1 for none.
int bucket_of(const std::vector<GradientBucket>& buckets, size_t offset);

// Where a GPU model keeps its gradients while the backward writes them. Without `ring`, or
// without block buckets, in the storage layout itself (each bucket at its own offset). With
// it (ZeRO stage 2: GpuModelOptions::shard_gradients) the buckets launched after a block's
// backward take turns in a ring of `slots` buffers of `slot_elements` each (the j-th such
// bucket in launch order writes ring slot j mod slots, once the reduce-scatter of the bucket
// that used it last has read it), and the rest (final norm and LM head, embeddings, extra
// tensors), which accumulates over a step's micro-batches, keeps a buffer of its own after
// the slots.
struct GradientStorage {
  static constexpr int kRingSlots = 2;
  std::vector<size_t> offset;  // per bucket, in the buckets' order: where its first element is stored
  std::vector<int> slot;       // per bucket: its ring slot, -1 for a buffer of its own
  int slots = 0;               // 0: no ring
  size_t slot_elements = 0;
  size_t elements = 0;  // of the whole storage
  // The storage offset of layout element `offset` (which a bucket holds; itself without buckets).
  size_t of(const std::vector<GradientBucket>& buckets, size_t offset) const;
};
GradientStorage plan_gradient_storage(const std::vector<GradientBucket>& buckets, bool ring);

// The gradient ranges a GPU backward adds into instead of overwriting, which must be zero
// before it runs: every tensor of `stored` but the blocks' attention and MLP weights and the
// LM head's weight (`head`: lm_head.weight, or the tied embedding's), as (offset, count) of
// the gradient storage `g`, adjacent ranges merged. `zero_grad`: what zero_grad zeroes (all
// of them without a ring). `ring`, per bucket: what its ring slot needs zeroed in every
// micro-batch, the bucket's padding included (the slot holds the gradients of the bucket
// that used it before, which a reduce-scatter of the padding would carry into the norm);
// empty for a bucket with a buffer of its own.
struct GradientZeroRanges {
  std::vector<std::pair<size_t, size_t>> zero_grad;
  std::vector<std::vector<std::pair<size_t, size_t>>> ring;
};
GradientZeroRanges gradient_zero_ranges(const std::vector<ParamInfo>& stored,
                                        const std::vector<GradientBucket>& buckets, const GradientStorage& g,
                                        const std::string& head);

// The storage layout a GPU model starts with for `config` (transformer_param_layout's
// tensors in its order, packed), the weights named in `kept_values` stored as their kept
// values [out, in/2] (slope).
std::vector<ParamInfo> stored_param_layout(const ModelConfig& config, const std::set<std::string>& kept_values);

}  // namespace esplag
