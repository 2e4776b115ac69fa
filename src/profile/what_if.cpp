#include "profile/what_if.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace esplag {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool starts_with_nocase(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && lower(s.substr(0, prefix.size())) == prefix;
}

constexpr const char* kSyntax =
    "expected PATTERN=FACTOR, e.g. 're:.*mlp.*=1.5x', 'category:dense_gemm=2', "
    "'attention=inf'";

double parse_factor(std::string_view spec, std::string_view text) {
  std::string_view f = trim(text);
  if (f.empty()) fail("what-if spec '", spec, "': missing factor after '=' (", kSyntax, ")");
  std::string_view number = f;
  if (number.back() == 'x' || number.back() == 'X') number.remove_suffix(1);
  number = trim(number);
  const std::string l = lower(number);
  double v = 0;
  if (l == "inf" || l == "infinity" || l == "+inf" || l == "+infinity") {
    v = std::numeric_limits<double>::infinity();
  } else {
    const char* first = number.data();
    const char* last = number.data() + number.size();
    if (!number.empty() && *first == '+') ++first;  // from_chars rejects a leading '+'
    auto [ptr, ec] = std::from_chars(first, last, v);
    if (number.empty() || ec == std::errc::invalid_argument || ptr != last || std::isnan(v))
      fail("what-if spec '", spec, "': factor '", f,
           "' is not a number (expected e.g. 1.5, 1.5x or inf)");
    if (ec == std::errc::result_out_of_range)
      fail("what-if spec '", spec, "': factor '", f, "' is out of range");
  }
  if (!(v > 0)) fail("what-if spec '", spec, "': factor must be > 0, got '", f, "'");
  return v;
}

WhatIfSpec make_spec(std::string_view display, std::string_view pattern_text,
                     std::string_view factor_text) {
  WhatIfSpec s;
  s.text = std::string(display);
  const std::string_view pattern = trim(pattern_text);
  if (pattern.empty())
    fail("what-if spec '", display, "': empty pattern before '=' (", kSyntax, ")");
  std::string regex_source;
  if (starts_with_nocase(pattern, "re:")) {
    regex_source = std::string(pattern.substr(3));
    if (regex_source.empty()) fail("what-if spec '", display, "': empty regex after 're:'");
  } else if (starts_with_nocase(pattern, "category:")) {
    const std::string_view name = trim(pattern.substr(9));
    if (name.empty())
      fail("what-if spec '", display, "': empty category after 'category:' (one of ",
           op_category_list(), ")");
    s.category = parse_op_category(name);
    if (!s.category)
      fail("what-if spec '", display, "': unknown category '", name, "' (expected one of ",
           op_category_list(), ")");
    s.pattern = std::string(op_category_name(*s.category));
  } else if (auto c = parse_op_category(pattern)) {
    s.category = c;
    s.pattern = std::string(op_category_name(*c));
  } else {
    regex_source = std::string(pattern);
  }
  if (!s.category) {
    s.pattern = regex_source;
    try {
      s.regex = std::regex(regex_source, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      fail("what-if spec '", display, "': invalid regex '", regex_source, "': ", e.what());
    }
  }
  s.factor = parse_factor(display, factor_text);
  return s;
}

}  // namespace

bool WhatIfSpec::matches(const GraphNode& node) const {
  if (category) return node.category == *category;
  return std::regex_search(node.name, regex);
}

std::string WhatIfSpec::factor_str() const {
  if (std::isinf(factor)) return "free";
  std::ostringstream os;
  os << factor << "x";
  return os.str();
}

WhatIfSpec parse_what_if_spec(std::string_view text) {
  const std::string_view t = trim(text);
  if (t.empty()) fail("what-if spec is empty (", kSyntax, ")");
  const size_t eq = t.rfind('=');
  if (eq == std::string_view::npos)
    fail("what-if spec '", t, "': missing '=' (", kSyntax, ")");
  return make_spec(t, t.substr(0, eq), t.substr(eq + 1));
}

std::vector<WhatIfSpec> parse_what_if_specs(std::span<const std::string> texts) {
  std::vector<WhatIfSpec> out;
  out.reserve(texts.size());
  for (const auto& t : texts) out.push_back(parse_what_if_spec(t));
  return out;
}

namespace {

// Splits one CSV line (RFC 4180 quoting; a quoted field cannot span lines here).
std::vector<std::string> split_csv_line(std::string_view line, std::string_view where) {
  std::vector<std::string> fields;
  std::string field;
  size_t i = 0;
  while (true) {
    field.clear();
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    if (i < line.size() && line[i] == '"') {
      ++i;
      bool closed = false;
      while (i < line.size()) {
        if (line[i] == '"') {
          if (i + 1 < line.size() && line[i + 1] == '"') {
            field += '"';
            i += 2;
          } else {
            closed = true;
            ++i;
            break;
          }
        } else {
          field += line[i++];
        }
      }
      if (!closed) fail(where, ": unterminated quoted field");
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
      if (i < line.size() && line[i] != ',')
        fail(where, ": unexpected text after a quoted field");
    } else {
      while (i < line.size() && line[i] != ',') field += line[i++];
      field = std::string(trim(field));
    }
    fields.push_back(field);
    if (i >= line.size()) break;
    ++i;  // the comma
  }
  return fields;
}

}  // namespace

std::vector<WhatIfSpec> parse_what_if_csv(std::string_view content, std::string_view source) {
  std::vector<WhatIfSpec> out;
  int pattern_col = -1;
  int factor_col = -1;
  bool have_header = false;
  size_t pos = 0;
  int line_no = 0;
  while (pos <= content.size()) {
    size_t nl = content.find('\n', pos);
    if (nl == std::string_view::npos) nl = content.size();
    std::string_view line = content.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const std::string_view t = trim(line);
    if (t.empty() || t.front() == '#') continue;
    const std::string where = std::string(source) + ":" + std::to_string(line_no);
    const auto fields = split_csv_line(line, where);
    if (!have_header) {
      for (size_t c = 0; c < fields.size(); ++c) {
        const std::string h = lower(trim(fields[c]));
        if ((h == "pattern" || h == "name") && pattern_col < 0) pattern_col = static_cast<int>(c);
        if ((h == "factor" || h == "speedup") && factor_col < 0) factor_col = static_cast<int>(c);
      }
      if (pattern_col < 0 || factor_col < 0)
        fail(where, ": the header must name a 'pattern' (or 'name') column and a 'factor' (or "
             "'speedup') column, got '", t, "'");
      have_header = true;
      continue;
    }
    const size_t need = static_cast<size_t>(std::max(pattern_col, factor_col)) + 1;
    if (fields.size() < need)
      fail(where, ": expected at least ", need, " fields, got ", fields.size(), " in '", t,
           "'");
    const std::string display = fields[pattern_col] + "=" + fields[factor_col];
    try {
      out.push_back(make_spec(display, fields[pattern_col], fields[factor_col]));
    } catch (const Error& e) {
      fail(where, ": ", e.what());
    }
  }
  if (!have_header)
    fail(source, ": no header line (expected 'pattern,factor' or 'name,speedup')");
  if (out.empty()) fail(source, ": no what-if rows after the header");
  return out;
}

std::vector<WhatIfSpec> read_what_if_csv(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("what-if CSV '", path, "': cannot open the file for reading");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("what-if CSV '", path, "': read error");
  return parse_what_if_csv(ss.str(), path);
}

double WhatIfResult::speedup() const {
  if (predicted_ns > 0) return baseline_ns / predicted_ns;
  return baseline_ns > 0 ? std::numeric_limits<double>::infinity() : 1.0;
}

WhatIfResult what_if(const OpGraph& graph, const std::vector<WhatIfSpec>& specs) {
  const int n = graph.size();
  const auto& nodes = graph.nodes();
  WhatIfResult r;
  r.specs = specs;
  const Schedule baseline = graph.schedule();
  r.baseline_ns = baseline.makespan_ns;

  auto scaled = [](double d, double factor) { return std::isinf(factor) ? 0.0 : d / factor; };

  // matches[s][i]: spec s matches node i, each spec on its own.
  std::vector<std::vector<char>> matches(specs.size(), std::vector<char>(n, 0));
  for (size_t s = 0; s < specs.size(); ++s)
    for (int i = 0; i < n; ++i) matches[s][i] = specs[s].matches(nodes[i]) ? 1 : 0;

  r.spec_of_node.assign(n, -1);
  std::vector<double> combined(n);
  for (int i = 0; i < n; ++i) {
    combined[i] = nodes[i].duration_ns;
    for (size_t s = 0; s < specs.size(); ++s) {
      if (matches[s][i]) {
        r.spec_of_node[i] = static_cast<int>(s);
        combined[i] = scaled(nodes[i].duration_ns, specs[s].factor);
        break;
      }
    }
  }
  r.predicted = graph.schedule(combined);
  r.predicted_ns = r.predicted.makespan_ns;

  for (size_t s = 0; s < specs.size(); ++s) {
    WhatIfPatternResult p;
    p.spec = specs[s].text;
    std::vector<double> alone(n), bound(n);
    for (int i = 0; i < n; ++i) {
      const double d = nodes[i].duration_ns;
      alone[i] = bound[i] = d;
      if (!matches[s][i]) continue;
      ++p.matched_ops;
      p.matched_ns += d;
      if (baseline.on_critical_path[i]) p.matched_critical_ns += d;
      alone[i] = scaled(d, specs[s].factor);
      bound[i] = 0;
      if (r.spec_of_node[i] == static_cast<int>(s)) ++p.applied_ops;
    }
    p.predicted_alone_ns = graph.schedule(alone).makespan_ns;
    p.amdahl_bound_ns = graph.schedule(bound).makespan_ns;
    r.per_spec.push_back(std::move(p));
  }
  return r;
}

std::string unmatched_what_if_warnings(const OpGraph& graph, const WhatIfResult& result, int examples) {
  std::vector<OpCategory> categories;
  std::vector<std::string> names;
  for (const GraphNode& n : graph.nodes()) {
    if (std::find(categories.begin(), categories.end(), n.category) == categories.end())
      categories.push_back(n.category);
    if (static_cast<int>(names.size()) < examples && std::find(names.begin(), names.end(), n.name) == names.end())
      names.push_back(n.name);
  }
  std::string known;
  for (const OpCategory c : categories) known += (known.empty() ? "" : ", ") + std::string(op_category_name(c));
  std::string some;
  for (const std::string& n : names) some += (some.empty() ? "" : ", ") + n;
  std::ostringstream os;
  for (const WhatIfPatternResult& p : result.per_spec) {
    if (p.matched_ops > 0) continue;
    os << "warning: what-if spec '" << p.spec << "' matches no op of the " << graph.size()
       << " profiled; categories here: " << (known.empty() ? "none" : known) << "; op names such as "
       << (some.empty() ? "none" : some) << "\n";
  }
  return os.str();
}

}  // namespace esplag
