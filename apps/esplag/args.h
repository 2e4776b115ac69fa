// A small command-line parser: `--name value`, `--name=value`, repeatable options, flags.
// Anything it does not know is an error that names the option.
#pragma once
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"

namespace esplag::cli {

class Args {
 public:
  // `options` take a value, `flags` do not; `repeated` options may be given many times.
  Args(const std::vector<std::string>& argv, const std::string& command, const std::set<std::string>& options,
       const std::set<std::string>& flags = {}, const std::set<std::string>& repeated = {})
      : command_(command) {
    for (size_t i = 0; i < argv.size(); ++i) {
      std::string a = argv[i], value;
      ESPLAG_CHECK(a.rfind("--", 0) == 0, command, ": unexpected argument '", a, "'");
      a = a.substr(2);
      const auto eq = a.find('=');
      const bool inline_value = eq != std::string::npos;
      if (inline_value) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
      }
      if (flags.count(a)) {
        ESPLAG_CHECK(!inline_value, command, ": --", a, " takes no value");
        flags_.insert(a);
        continue;
      }
      ESPLAG_CHECK(options.count(a) || repeated.count(a), command, ": unknown option --", a);
      if (!inline_value) {
        ESPLAG_CHECK(i + 1 < argv.size(), command, ": --", a, " needs a value");
        value = argv[++i];
      }
      ESPLAG_CHECK(repeated.count(a) || !values_.count(a), command, ": --", a, " given twice");
      values_[a].push_back(value);
    }
  }

  bool has(const std::string& name) const { return values_.count(name) || flags_.count(name); }
  std::string get(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second.front();
  }
  std::string required(const std::string& name) const {
    ESPLAG_CHECK(values_.count(name), command_, ": --", name, " is required");
    return get(name);
  }
  std::vector<std::string> all(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
  }
  double number(const std::string& name, double fallback) const {
    if (!values_.count(name)) return fallback;
    const std::string v = get(name);
    try {
      size_t used = 0;
      const double d = std::stod(v, &used);
      if (used == v.size()) return d;
    } catch (const std::exception&) {
    }
    fail(command_, ": --", name, " must be a number, got '", v, "'");
  }
  long long integer(const std::string& name, long long fallback) const {
    const double d = number(name, static_cast<double>(fallback));
    ESPLAG_CHECK(d == static_cast<double>(static_cast<long long>(d)), command_, ": --", name,
                 " must be an integer, got '", get(name), "'");
    return static_cast<long long>(d);
  }

 private:
  std::string command_;
  std::map<std::string, std::vector<std::string>> values_;
  std::set<std::string> flags_;
};

}  // namespace esplag::cli
