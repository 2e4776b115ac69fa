// The buckets in which a data-parallel GPU step averages its gradients over the ranks while
// the backward still runs (GpuModelOptions::reduce_gradients, docs/distributed.md).
//
// The backward finishes the blocks' gradients from the last block to the first; block l's
// tensors ("blocks.<l>.*") are final once its backward is done (a later block's backward
// writes only into its own block and into the previous block's bias gradient). A bucket is a
// contiguous range of the storage layout: consecutive blocks, from the last down, until it
// holds at least `bucket_elements`, launched after the backward of its first (lowest) block.
// The rest (embeddings, final norm, LM head, the layers' extra tensors such as adapters) is
// final only at the end of the backward and goes last.
#pragma once

#include <cstddef>
#include <vector>

#include "model/transformer.h"

namespace esplag {

struct GradientBucket {
  int after_block = -1;  // launched after this block's backward; -1: after the whole backward
  size_t begin = 0, end = 0;  // elements of the storage layout
};

// The buckets of a storage layout `stored` (offsets and numels in elements) of `total`
// elements with `n_layer` blocks, in launch order. They cover [0, total) exactly once. With
// `bucket_elements` 0, or when a block's tensors are not one contiguous range following
// the previous block's, one bucket after the whole backward.
std::vector<GradientBucket> plan_gradient_buckets(const std::vector<ParamInfo>& stored, int n_layer, size_t total,
                                                  size_t bucket_elements);

}  // namespace esplag
