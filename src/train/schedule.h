// Learning-rate schedules: linear warmup from 0, then cosine / linear decay to
// min_lr_ratio·lr at the last step, or constant.
#pragma once
#include <cstdint>
#include <string>

namespace esplag {

enum class DecayKind { cosine, linear, constant };
DecayKind decay_kind_from(const std::string& s);
std::string to_string(DecayKind k);

struct LrSchedule {
  double lr = 1e-3;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  DecayKind decay = DecayKind::cosine;
  double min_lr_ratio = 0.1;

  // Learning rate for 0-based step `step`.
  double at(int64_t step) const;
};

}  // namespace esplag
