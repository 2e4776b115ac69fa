// The closing line of the sparse benchmark tables (esplag bench gemm / layer): which of
// the compared 2:4 rows reach the target speed-up over dense.
#pragma once
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

namespace esplag::gpu {

// `what` names the rows ("2:4", "2:4 steps"), `unit` follows the counts (" problems" or
// ""), `nothing` is the line when no 2:4 row was timed; `meets` lists the rows at target.
inline std::string target_summary(const std::vector<std::string>& meets, size_t compared, double target,
                                  const char* what, const char* unit, const char* nothing) {
  char buf[256];
  if (compared == 0) {
    std::snprintf(buf, sizeof buf, "%s: nothing to compare against %.1fx\n", nothing, target);
    return buf;
  }
  if (meets.empty()) {
    std::snprintf(buf, sizeof buf, "%s at >= %.1fx dense: none of %zu%s\n", what, target, compared, unit);
    return buf;
  }
  std::snprintf(buf, sizeof buf, "%s at >= %.1fx dense (%zu of %zu%s): ", what, target, meets.size(), compared, unit);
  std::string o = buf;
  for (size_t i = 0; i < meets.size(); ++i) o += (i ? ", " : "") + meets[i];
  return o + "\n";
}

}  // namespace esplag::gpu
