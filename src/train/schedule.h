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

  // Learning rate for 0-based step `step`; steps past total_steps keep the final rate.
  double at(int64_t step) const;
};

// What a resumed run with another total of steps does to the schedule. `keep` (the
// default): the schedule stays the one the run started with, so the rate does not jump;
// steps past its end continue at its final rate. `stretch`: the schedule is recomputed
// for the new total (the rate jumps to where the longer schedule would be at that step).
enum class ScheduleOnResume { keep, stretch };
ScheduleOnResume schedule_on_resume_from(const std::string& s);  // "keep" | "stretch"
std::string to_string(ScheduleOnResume s);

}  // namespace esplag
