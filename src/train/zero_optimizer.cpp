#include "train/zero_optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/op_trace.h"
#include "ops/adamw.h"

namespace esplag {

ZeroCpuOptimizer::ZeroCpuOptimizer(int stage, HostChannel& ranks, Moments m, Moments v)
    : stage_(stage), ranks_(ranks), initial_m_(std::move(m)), initial_v_(std::move(v)) {
  ESPLAG_CHECK(stage == 1 || stage == 2, "the CPU's ZeRO optimizer takes stages 1 and 2, got ", stage);
}

Moments ZeroCpuOptimizer::whole(const std::vector<float>& range, bool to_all) {
  std::vector<float> flat(to_all || ranks_.rank() == 0 ? partition_.total() : 0);
  if (to_all)
    ranks_.all_gather(range.data(), partition_.counts(), flat.data());
  else
    ranks_.gather(range.data(), partition_.counts(), flat.data());
  Moments out;
  if (flat.empty() && partition_.total() > 0) return out;
  const float* at = flat.data();
  for (const auto& [name, n] : layout_) {
    out[name].assign(at, at + n);
    at += n;
  }
  return out;
}

void ZeroCpuOptimizer::relayout(const Params& params) {
  Layout layout;
  std::vector<int64_t> sizes;
  for (const auto& p : params) {
    layout.emplace_back(p.name, shape_numel(p.shape));
    sizes.push_back(layout.back().second);
  }
  if (cut_ && layout == layout_) return;
  // The whole moments of the tensors so far: the ones given, or every rank's range gathered.
  Moments m = std::move(initial_m_), v = std::move(initial_v_);
  if (cut_) m = whole(m_, true), v = whole(v_, true);
  cut_ = true;
  layout_ = std::move(layout);
  partition_ = ZeroPartition(std::move(sizes), ranks_.size());
  pieces_ = partition_.pieces(ranks_.rank());
  // A tensor seen for the first time (or of another size) starts with zero moments, as in one process.
  m_.assign(partition_.count(ranks_.rank()), 0.0f);
  v_.assign(m_.size(), 0.0f);
  for (const ZeroPiece& piece : pieces_) {
    const auto& [name, n] = layout_[piece.tensor];
    const auto mi = m.find(name), vi = v.find(name);
    if (mi == m.end() || vi == v.end() || mi->second.size() != size_t(n) || vi->second.size() != size_t(n)) continue;
    std::copy(mi->second.begin() + piece.begin, mi->second.begin() + piece.end, m_.begin() + piece.offset);
    std::copy(vi->second.begin() + piece.begin, vi->second.begin() + piece.end, v_.begin() + piece.offset);
  }
}

double ZeroCpuOptimizer::reduce_gradients(const Params& params) {
  relayout(params);
  std::vector<float> range(partition_.count(ranks_.rank()));
  {
    std::vector<float> flat;
    flat.reserve(partition_.total());
    for (const auto& p : params) flat.insert(flat.end(), p.grad, p.grad + shape_numel(p.shape));
    ScopedOp op("gradients.reduce_scatter", OpCategory::comm, -1, 0, sizeof(float) * double(flat.size()));
    ranks_.reduce_scatter_sum(flat.data(), partition_.counts(), range.data());
  }
  // The mean, rounded as the all-reduce of stage 0 rounds it, so the ranges hold its bits.
  const double inv = 1.0 / ranks_.size();
  for (float& g : range) g = static_cast<float>(g * inv);
  double sq = 0;
  for (const ZeroPiece& piece : pieces_) {
    const int64_t n = piece.end - piece.begin;
    const float* g = range.data() + piece.offset;
    if (stage_ == 1) std::copy(g, g + n, params[piece.tensor].grad + piece.begin);
    sq += cpu::global_grad_norm_squared(g, n);
  }
  if (stage_ == 2) grad_ = std::move(range);
  ranks_.all_reduce_sum(&sq, 1);
  return std::sqrt(sq);
}

void ZeroCpuOptimizer::step(const Params& params, int64_t step, double lr, double grad_scale,
                            const OptimizerConfig& o) {
  std::vector<float> range(m_.size());
  for (const ZeroPiece& piece : pieces_) {
    const auto& p = params[piece.tensor];
    const int64_t n = piece.end - piece.begin;
    float* value = p.value + piece.begin;
    const float* grad = stage_ == 1 ? p.grad + piece.begin : grad_.data() + piece.offset;
    float* m = m_.data() + piece.offset;
    float* v = v_.data() + piece.offset;
    ScopedOp op({p.name, "adamw"}, OpCategory::optimizer, -1, 12.0 * n, 7.0 * sizeof(float) * n, {value, grad, m, v},
                {value, m, v});
    cpu::adamw_step(value, grad, m, v, n, lr, o.beta1, o.beta2, o.eps, p.decay ? o.weight_decay : 0.0, step + 1,
                    grad_scale);
    std::copy(value, value + n, range.begin() + piece.offset);
  }
  std::vector<float> all(partition_.total());
  {
    ScopedOp op("weights.all_gather", OpCategory::comm, -1, 0, sizeof(float) * double(all.size()));
    ranks_.all_gather(range.data(), partition_.counts(), all.data());
  }
  const float* at = all.data();
  for (const auto& p : params) {
    const int64_t n = shape_numel(p.shape);
    std::copy(at, at + n, p.value);
    at += n;
  }
}

void ZeroCpuOptimizer::gather_moments() {
  gathered_m_ = whole(m_, false);
  gathered_v_ = whole(v_, false);
}

}  // namespace esplag
