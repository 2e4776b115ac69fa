// ZeRO stages 1 and 2 on the CPU reference (docs/distributed.md, "ZeRO"): each rank keeps
// the AdamW moments of its range of the trained elements alone (train/zero_partition.h),
// takes AdamW on that range with the gradients' mean over the ranks (a reduce-scatter), and
// the ranks then all-gather the updated values so that every rank holds the whole model.
// Stage 1 writes the range's mean gradient back into the model's gradient tensors; stage 2
// keeps it in a buffer of the range's size. The backward on the CPU writes whole gradients
// either way, so stage 2 saves no memory here; on the GPU it is what lets a rank drop the
// gradients outside its range.
//
// When the set of trained tensors changes (a recipe's kind change), the moments are
// all-gathered under the old partition, matched to the new tensors by name as a single
// process does (a tensor of a new size starts from zero moments) and cut again.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dist/host_channel.h"
#include "model/linear.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/zero_partition.h"

namespace esplag {

class ZeroCpuOptimizer {
 public:
  using Params = std::vector<OwnedParam<float>>;
  // `m`, `v`: the whole moments by tensor name (a checkpoint's; empty for a fresh run).
  // Each rank keeps its range of them at the first step.
  ZeroCpuOptimizer(int stage, HostChannel& ranks, Moments m, Moments v);

  // Collective. This rank's range of the gradients' mean over the ranks (reduce-scatter);
  // returns the global norm of the mean gradient (the ranges' sums of squares, all-reduced).
  double reduce_gradients(const Params& params);
  // Collective. AdamW (step 0-based) on this rank's range with the gradients of
  // reduce_gradients times `grad_scale`, then the updated values all-gathered into `params`.
  void step(const Params& params, int64_t step, double lr, double grad_scale, const OptimizerConfig& o);
  // Collective. The whole moments by tensor name on rank 0, for a checkpoint (empty elsewhere).
  void gather_moments();
  const Moments& gathered_m() const { return gathered_m_; }
  const Moments& gathered_v() const { return gathered_v_; }

  // Elements whose moments this rank holds, and in all.
  int64_t range_elements() const { return partition_.count(ranks_.rank()); }
  int64_t total_elements() const { return partition_.total(); }

 private:
  using Layout = std::vector<std::pair<std::string, int64_t>>;  // each trained tensor's name and elements
  // Cuts the moments again when the trained tensors differ from the last step's.
  void relayout(const Params& params);
  // The whole of a range-held vector by tensor name: on every rank (to_all) or on rank 0.
  Moments whole(const std::vector<float>& range, bool to_all);

  int stage_;
  HostChannel& ranks_;
  Layout layout_;
  bool cut_ = false;  // whether the moments were cut for layout_ (at the first step)
  ZeroPartition partition_;
  std::vector<ZeroPiece> pieces_;  // this rank's parts of the tensors
  std::vector<float> m_, v_;       // the moments of this rank's range
  std::vector<float> grad_;        // stage 2: the range's mean gradient
  Moments initial_m_, initial_v_;  // the whole moments given, until the first step cuts them
  Moments gathered_m_, gathered_v_;
};

}  // namespace esplag
