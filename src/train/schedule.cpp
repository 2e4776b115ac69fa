#include "train/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace esplag {

DecayKind decay_kind_from(const std::string& s) {
  if (s == "cosine") return DecayKind::cosine;
  if (s == "linear") return DecayKind::linear;
  if (s == "constant") return DecayKind::constant;
  fail("schedule.decay must be cosine, linear or constant, got '", s, "'");
}

std::string to_string(DecayKind k) {
  return k == DecayKind::cosine ? "cosine" : k == DecayKind::linear ? "linear" : "constant";
}

ScheduleOnResume schedule_on_resume_from(const std::string& s) {
  if (s == "keep") return ScheduleOnResume::keep;
  if (s == "stretch") return ScheduleOnResume::stretch;
  fail("the schedule on resume must be keep or stretch, got '", s, "'");
}

std::string to_string(ScheduleOnResume s) { return s == ScheduleOnResume::keep ? "keep" : "stretch"; }

double LrSchedule::at(int64_t step) const {
  // Warmup reaches the full rate at step warmup_steps - 1 (step 0 already gets lr/warmup).
  if (step < warmup_steps) return lr * double(step + 1) / double(warmup_steps);
  if (decay == DecayKind::constant) return lr;
  const int64_t span = std::max<int64_t>(1, total_steps - 1 - warmup_steps);
  const double progress = std::clamp(double(step - warmup_steps) / double(span), 0.0, 1.0);
  const double min_lr = lr * min_lr_ratio;
  const double shape = decay == DecayKind::cosine ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
  return min_lr + (lr - min_lr) * shape;
}

}  // namespace esplag
