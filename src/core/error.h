// Errors: every failure in the library throws esplag::Error with what failed and why.
// Library code never exits; the CLI turns an Error into one line on stderr and exit code 1.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace esplag {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// Throws Error with a message built from the arguments (streamed, like std::cout).
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(detail::concat(args...));
}

}  // namespace esplag

// ESPLAG_CHECK(cond, "message", values...): throws Error("message values...") when cond is
// false. For conditions a user can break through input (shapes, files, configs), so the
// message must say what was expected and what was found.
#define ESPLAG_CHECK(cond, ...)                       \
  do {                                                \
    if (!(cond)) ::esplag::fail(__VA_ARGS__);         \
  } while (0)
