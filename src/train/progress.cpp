#include "train/progress.h"

#include <cmath>
#include <cstdio>

namespace esplag {

std::string format_duration(double seconds) {
  // A long run's estimate exceeds an int's hours (and a first step taking no measurable
  // time gives inf): whole minutes as 64-bit integers, and no number for no estimate.
  if (!std::isfinite(seconds) || seconds < 0 || seconds >= 9.2e18) return "?";
  char buf[48];
  if (seconds >= 3600) {
    const auto minutes = static_cast<long long>(seconds / 60);
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", minutes / 60, minutes % 60);
  } else {
    const auto whole = static_cast<long long>(seconds);
    std::snprintf(buf, sizeof buf, "%lldm%02llds", whole / 60, whole % 60);
  }
  return buf;
}

std::string format_rate(double tokens_per_s) {
  char buf[32];
  if (tokens_per_s >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", tokens_per_s / 1e6);
  else if (tokens_per_s >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fK", tokens_per_s / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", tokens_per_s);
  return buf;
}

std::string format_bytes(uint64_t bytes) {
  char buf[32];
  if (bytes >= (uint64_t(1) << 30))
    std::snprintf(buf, sizeof buf, "%.1f GiB", double(bytes) / double(uint64_t(1) << 30));
  else if (bytes >= (uint64_t(1) << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / double(uint64_t(1) << 20));
  else
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
  return buf;
}

}  // namespace esplag
