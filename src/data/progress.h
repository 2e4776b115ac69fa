// Progress reporting: library code never prints; long operations hand one line at a time
// to a callback that the caller may leave empty.
#pragma once
#include <functional>
#include <string>

namespace esplag {

using ProgressFn = std::function<void(const std::string&)>;

}  // namespace esplag
