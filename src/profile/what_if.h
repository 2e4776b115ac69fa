// What-if predictions: "if these ops were F times faster, how long would the step take?"
// Durations of the matched ops are divided by F and the graph is rescheduled, so the
// answer follows the critical path (Amdahl's law over a graph): speeding up an op with
// slack changes nothing until the slack is used up.
//
// Spec syntax, PATTERN=FACTOR (split at the last '='):
//   PATTERN  re:REGEX          ops whose name contains a match of REGEX (std::regex,
//                              ECMAScript; anchor with ^ and $ for a whole-name match)
//            category:NAME     ops of that category (dense_gemm, sparse_gemm, attention,
//                              norm, elementwise, loss, optimizer, memcpy, comm, other)
//            NAME              a bare category name means that category
//            anything else     a regex over op names, as with re:
//   FACTOR   1.5, 1.5x, 0.5x   speedup (a factor below 1 is a slowdown)
//            inf, infx         the ops become free
// With several specs, the first spec that matches an op decides its factor.
#pragma once
#include <optional>
#include <regex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "profile/graph.h"

namespace esplag {

struct WhatIfSpec {
  std::string text;                    // the spec as written (for reports)
  std::string pattern;                 // regex source or category name
  std::optional<OpCategory> category;  // set: a category spec
  std::regex regex;                    // used when category is not set
  double factor = 1;                   // > 0; +inf: the ops become free

  bool matches(const GraphNode& node) const;
  // "1.5x" or "free".
  std::string factor_str() const;
};

// Throws Error with the spec and what is wrong: missing '=', empty pattern, invalid regex,
// unknown category, missing / non-numeric / non-positive factor.
WhatIfSpec parse_what_if_spec(std::string_view text);
std::vector<WhatIfSpec> parse_what_if_specs(std::span<const std::string> texts);

// CSV of specs (e.g. written by a benchmark): a header naming a pattern column
// ("pattern" or "name") and a factor column ("factor" or "speedup"), in any order and
// among other columns, which are ignored; then one spec per row. Fields may be
// double-quoted (a regex with a comma); blank lines and lines starting with '#' are
// skipped. Errors name the source and line.
std::vector<WhatIfSpec> parse_what_if_csv(std::string_view content,
                                          std::string_view source = "<csv>");
std::vector<WhatIfSpec> read_what_if_csv(const std::string& path);

struct WhatIfPatternResult {
  std::string spec;                 // the spec's text
  int matched_ops = 0;              // ops the spec matches on its own
  int applied_ops = 0;              // ops it decides in the combined prediction
  double matched_ns = 0;            // measured time of the matched ops
  double matched_critical_ns = 0;   // ... of which on the baseline critical path
  double predicted_alone_ns = 0;    // step time with only this spec applied
  double amdahl_bound_ns = 0;       // step time if the matched ops took no time
};

struct WhatIfResult {
  std::vector<WhatIfSpec> specs;
  double baseline_ns = 0;         // modelled step time with measured durations
  double predicted_ns = 0;        // with every spec applied
  std::vector<int> spec_of_node;  // the spec applied to each node, -1 for none
  Schedule predicted;             // the schedule behind predicted_ns
  std::vector<WhatIfPatternResult> per_spec;

  // baseline / predicted (+inf when everything became free).
  double speedup() const;
};

WhatIfResult what_if(const OpGraph& graph, const std::vector<WhatIfSpec>& specs);

// One warning line per spec of `result` that matched no op of `graph` (a typo predicts a
// speed-up of exactly 1.00x): the spec, the categories the graph's ops have and up to
// `examples` distinct op names, so the pattern can be corrected. Empty when all matched.
std::string unmatched_what_if_warnings(const OpGraph& graph, const WhatIfResult& result, int examples = 6);

}  // namespace esplag
