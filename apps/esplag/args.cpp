#include "args.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "core/error.h"

namespace esplag::cli {

namespace {

std::string format_real(double x) {
  char s[32];
  std::snprintf(s, sizeof s, "%g", x);
  return s;
}

// "command: " before a message, or nothing for the common options.
std::string prefix(const std::string& command) { return command.empty() ? "" : command + ": "; }

bool is_help(const std::string& a) { return a == "--help" || a == "-h"; }

// A number as strtod would read it, but all of the text (no trailing junk, no spaces).
bool parse_whole_real(const std::string& v, double& x) {
  const char* first = v.data() + (!v.empty() && v[0] == '+');
  const char* last = v.data() + v.size();
  const auto [end, ec] = std::from_chars(first, last, x);
  return first != last && end == last && ec != std::errc::invalid_argument;
}

}  // namespace

Option Option::text(std::string name, std::string value, std::string fallback, std::string help) {
  Option o;
  o.name = std::move(name);
  o.value = std::move(value);
  o.fallback = std::move(fallback);
  o.help = std::move(help);
  return o;
}

Option Option::integer(std::string name, std::string fallback, int64_t min, int64_t max, std::string help) {
  Option o = text(std::move(name), "N", std::move(fallback), std::move(help));
  o.type = Type::integer;
  o.int_min = min;
  o.int_max = max;
  return o;
}

Option Option::number(std::string name, std::string fallback, double min, double max, std::string help) {
  Option o = text(std::move(name), "X", std::move(fallback), std::move(help));
  o.type = Type::number;
  o.min = min;
  o.max = max;
  return o;
}

Option Option::flag(std::string name, std::string help) {
  Option o = text(std::move(name), "", "", std::move(help));
  o.type = Type::flag;
  return o;
}

Option Option::list(std::string name, std::string value, std::string help) {
  Option o = text(std::move(name), std::move(value), "", std::move(help));
  o.repeated = true;
  return o;
}

Option Option::mandatory() const {
  Option o = *this;
  o.required = true;
  return o;
}

Option Option::below_max() const {
  Option o = *this;
  o.max_excluded = true;
  return o;
}

std::string Option::range_text() const {
  if (type == Type::integer)
    return int_max == kInt64Max ? "an integer >= " + std::to_string(int_min)
                                : "an integer in [" + std::to_string(int_min) + ", " + std::to_string(int_max) + "]";
  if (type == Type::number)
    return max == kRealMax ? "a number >= " + format_real(min)
                           : "a number in [" + format_real(min) + ", " + format_real(max) + (max_excluded ? ")" : "]");
  return "";
}

const std::vector<Option>& common_options() {
  static const std::vector<Option> options = {
      Option::integer("threads", "", 1, 1024, "CPU worker threads (default: all cores)"),
  };
  return options;
}

int64_t parse_integer(const std::string& command, const Option& o, const std::string& v) {
  int64_t x = 0;
  const char* last = v.data() + v.size();
  const auto [end, ec] = std::from_chars(v.data(), last, x);
  const bool whole = !v.empty() && end == last;
  ESPLAG_CHECK(whole && ec == std::errc() && x >= o.int_min && x <= o.int_max, prefix(command), "--", o.name,
               " must be ",
               o.range_text(), ", got '", v, "'");
  return x;
}

double parse_number(const std::string& command, const Option& o, const std::string& v) {
  double x = 0;
  ESPLAG_CHECK(parse_whole_real(v, x), prefix(command), "--", o.name, " must be ", o.range_text(), ", got '", v, "'");
  ESPLAG_CHECK(std::isfinite(x), prefix(command), "--", o.name, " must be a finite number, got '", v, "'");
  const bool below_max = o.max_excluded ? x < o.max : x <= o.max;
  ESPLAG_CHECK(x >= o.min && below_max, prefix(command), "--", o.name, " must be ", o.range_text(), ", got '", v, "'");
  return x;
}

std::string help_text(const Command& c) {
  std::ostringstream os;
  os << "usage: esplag " << c.name;
  for (const Option& o : c.options)
    if (o.required) os << " --" << o.name << " " << o.value;
  os << " [options]\n\n" << c.summary << "\n";
  if (!c.description.empty()) os << "\n" << c.description << "\n";
  auto column = [](const Option& o) { return "--" + o.name + (o.value.empty() ? "" : " " + o.value); };
  size_t width = 0;
  for (const auto* list : {&c.options, &common_options()})
    for (const Option& o : *list) width = std::max(width, column(o).size());
  width = std::min<size_t>(width, 24);
  auto print = [&](const Option& o) {
    const std::string left = column(o);
    os << "  " << left;
    if (left.size() > width) os << "\n  " << std::string(width, ' ');
    else os << std::string(width - left.size(), ' ');
    os << "  " << o.help << ".";
    std::string range = o.range_text();
    if (!range.empty()) range[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(range[0])));
    if (o.required) os << " Required.";
    if (!range.empty()) os << " " << range << (o.fallback.empty() ? "." : ",");
    if (!o.fallback.empty()) os << (range.empty() ? " Default " : " default ") << o.fallback << ".";
    if (o.repeated) os << " Repeatable.";
    os << "\n";
  };
  os << "\noptions:\n";
  for (const Option& o : c.options) print(o);
  os << "common options:\n";
  for (const Option& o : common_options()) print(o);
  print(Option::flag("help", "this help (also -h)"));
  return os.str();
}

Args::Args(const std::vector<std::string>& argv, const Command& command) : command_(&command) {
  const std::string& cmd = command.name;
  help_ = std::any_of(argv.begin(), argv.end(), is_help);
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string a = argv[i], value;
    if (is_help(a)) continue;
    ESPLAG_CHECK(a.rfind("--", 0) == 0, cmd, ": unexpected argument '", a, "' (see esplag ", cmd, " --help)");
    a = a.substr(2);
    const auto eq = a.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    const auto o = std::find_if(command.options.begin(), command.options.end(),
                                [&](const Option& x) { return x.name == a; });
    ESPLAG_CHECK(o != command.options.end(), cmd, ": unknown option --", a, " (see esplag ", cmd, " --help)");
    ESPLAG_CHECK(o->repeated || !values_.count(a), cmd, ": --", a, " given twice");
    if (o->type == Option::Type::flag) {
      ESPLAG_CHECK(!inline_value, cmd, ": --", a, " takes no value");
      values_[a];
      continue;
    }
    if (!inline_value) {
      ESPLAG_CHECK(i + 1 < argv.size(), cmd, ": --", a, " needs a value (", o->value, ")");
      value = argv[++i];
    }
    values_[a].push_back(value);
  }
  if (help_) return;
  for (const Option& o : command.options) {
    ESPLAG_CHECK(!o.required || values_.count(o.name), cmd, ": --", o.name, " is required (see esplag ", cmd,
                 " --help)");
    if (!values_.count(o.name)) continue;
    for (const std::string& v : values_.at(o.name)) {
      if (o.type == Option::Type::integer) parse_integer(cmd, o, v);
      if (o.type == Option::Type::number) parse_number(cmd, o, v);
    }
  }
}

const Option& Args::option(const std::string& name, Option::Type type) const {
  for (const Option& o : command_->options)
    if (o.name == name) {
      // A program error: the code asks for an option its table does not declare as such.
      if (o.type != type && !(type == Option::Type::text && o.type == Option::Type::flag))
        throw std::logic_error("esplag " + command_->name + ": --" + name + " read as another type");
      return o;
    }
  throw std::logic_error("esplag " + command_->name + ": --" + name + " is not in its option table");
}

bool Args::has(const std::string& name) const {
  const auto& options = command_->options;
  if (std::none_of(options.begin(), options.end(), [&](const Option& o) { return o.name == name; }))
    throw std::logic_error("esplag " + command_->name + ": --" + name + " is not in its option table");
  return values_.count(name) > 0;
}

const std::string* Args::given(const Option& o) const {
  const auto it = values_.find(o.name);
  if (it != values_.end()) return &it->second.front();
  return o.fallback.empty() ? nullptr : &o.fallback;
}

namespace {

// Which of the two sources of a default applies; both, or neither, is a program error.
void check_default_source(const std::string& command, const Option& o, bool code_fallback) {
  if (code_fallback == o.fallback.empty()) return;
  throw std::logic_error("esplag " + command + ": --" + o.name +
                         (code_fallback ? " has a default in its table and another in the code"
                                        : " has no default, in its table or in the code"));
}

}  // namespace

std::string Args::get(const std::string& name) const {
  const Option& o = option(name, Option::Type::text);
  const std::string* v = given(o);
  return v ? *v : std::string();
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  const Option& o = option(name, Option::Type::text);
  check_default_source(command_->name, o, true);
  return has(name) ? get(name) : fallback;
}

std::vector<std::string> Args::all(const std::string& name) const {
  option(name, Option::Type::text);
  const auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

int64_t Args::integer(const std::string& name) const {
  const Option& o = option(name, Option::Type::integer);
  const std::string* v = given(o);
  if (!v) check_default_source(command_->name, o, false);
  return parse_integer(command_->name, o, *v);
}

int64_t Args::integer(const std::string& name, int64_t fallback) const {
  check_default_source(command_->name, option(name, Option::Type::integer), true);
  return has(name) ? integer(name) : fallback;
}

int Args::int32(const std::string& name) const {
  const Option& o = option(name, Option::Type::integer);
  if (o.int_min < -kIntMax - 1 || o.int_max > kIntMax)
    throw std::logic_error("esplag " + command_->name + ": --" + name + " does not fit an int");
  return static_cast<int>(integer(name));
}

int Args::int32(const std::string& name, int fallback) const {
  check_default_source(command_->name, option(name, Option::Type::integer), true);
  return has(name) ? int32(name) : fallback;
}

double Args::number(const std::string& name) const {
  const Option& o = option(name, Option::Type::number);
  const std::string* v = given(o);
  if (!v) check_default_source(command_->name, o, false);
  return parse_number(command_->name, o, *v);
}

double Args::number(const std::string& name, double fallback) const {
  check_default_source(command_->name, option(name, Option::Type::number), true);
  return has(name) ? number(name) : fallback;
}

}  // namespace esplag::cli
