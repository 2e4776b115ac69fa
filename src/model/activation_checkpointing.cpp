#include "model/activation_checkpointing.h"

#include "core/error.h"

namespace esplag {

CheckpointMode checkpoint_mode_from(const std::string& s) {
  if (s == "none") return CheckpointMode::none;
  if (s == "full") return CheckpointMode::full;
  if (s == "selective") return CheckpointMode::selective;
  fail("train.checkpointing must be none, full or selective, got '", s, "'");
}

std::string to_string(CheckpointMode m) {
  switch (m) {
    case CheckpointMode::none: return "none";
    case CheckpointMode::full: return "full";
    case CheckpointMode::selective: return "selective";
  }
  return "?";
}

}  // namespace esplag
