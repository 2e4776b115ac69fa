// The command-line options of esplag: each command declares its options once, in a table
// (name, value placeholder, default, range, one line of help) that both the parser and the
// --help text read, so the two cannot drift apart. Adding an option is one line there.
//
// Parsing: `--name value`, `--name=value`, flags, repeatable options. Anything unknown, a
// missing required option, or a number that is malformed, non-finite or outside its
// declared range is an Error naming the command, the option, the value and what was
// expected, raised before the command does any work. `-h`/`--help` anywhere asks for the
// help (after the options were checked to be the command's).
#pragma once
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace esplag::cli {

constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr double kRealMax = std::numeric_limits<double>::max();

struct Option {
  enum class Type { text, integer, number, flag };

  std::string name;      // without the leading "--"
  std::string value;     // the placeholder the help shows ("N", "FILE"); empty for a flag
  std::string fallback;  // the default value the parser returns; empty: none, or one the help text describes
  std::string help;      // one line
  Type type = Type::text;
  int64_t int_min = 0, int_max = 0;  // integer: the accepted range, inclusive
  double min = 0, max = 0;           // number: the accepted range, inclusive unless max_excluded
  bool max_excluded = false;
  bool required = false;
  bool repeated = false;

  static Option text(std::string name, std::string value, std::string fallback, std::string help);
  static Option integer(std::string name, std::string fallback, int64_t min, int64_t max, std::string help);
  static Option number(std::string name, std::string fallback, double min, double max, std::string help);
  static Option flag(std::string name, std::string help);
  // Given any number of times; Args::all returns the values in order.
  static Option list(std::string name, std::string value, std::string help);
  // The same option, required (the help marks it so and the parser checks it is given).
  Option mandatory() const;
  // The same number option with its range open at the top: [min, max).
  Option below_max() const;

  // What the help says of the accepted values, e.g. "integer in [1, 2147483647]".
  std::string range_text() const;
};

struct Args;

struct Command {
  std::string name;         // "train", "bench gemm"
  std::string summary;      // one line, for the overview of all commands
  std::string description;  // what --help prints under the usage line (may be several lines)
  std::vector<Option> options;
  int (*run)(const Args&) = nullptr;
};

// The options every command accepts (placed anywhere on the command line): --threads.
const std::vector<Option>& common_options();

// The --help text of `command`: usage, description, each option with its value, range,
// default and help line, then the common options.
std::string help_text(const Command& command);

// Parses `value` as the integer or number option `option` of `command` ("" for a common
// option), range-checked.
int64_t parse_integer(const std::string& command, const Option& option, const std::string& value);
double parse_number(const std::string& command, const Option& option, const std::string& value);

struct Args {
  // Parses the arguments after the command's name against its table and checks every
  // value (types, ranges, required options) unless help was asked for.
  Args(const std::vector<std::string>& argv, const Command& command);

  bool help() const { return help_; }
  bool has(const std::string& name) const;
  // A text option's value, or its declared default ("" when it has none).
  std::string get(const std::string& name) const;
  // ... or `fallback` for an option whose default the table leaves to the code.
  std::string get(const std::string& name, const std::string& fallback) const;
  std::vector<std::string> all(const std::string& name) const;
  int64_t integer(const std::string& name) const;
  int64_t integer(const std::string& name, int64_t fallback) const;
  // integer() for options whose declared range fits an int.
  int int32(const std::string& name) const;
  int int32(const std::string& name, int fallback) const;
  double number(const std::string& name) const;
  double number(const std::string& name, double fallback) const;

 private:
  const Option& option(const std::string& name, Option::Type type) const;
  // The value given, or the declared default; the code's fallback only where none is declared.
  const std::string* given(const Option& o) const;

  const Command* command_;
  bool help_ = false;
  std::map<std::string, std::vector<std::string>> values_;
};

}  // namespace esplag::cli
