#include "profile/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <sstream>

#include "core/error.h"
#include "profile/graph.h"
#include "profile/profiler.h"

namespace esplag {

namespace {

using Json = nlohmann::ordered_json;
using Categories = std::array<double, kNumOpCategories>;

std::string fmt_error(double pct) {
  if (!std::isfinite(pct)) return "n/a";
  return format_value("%+.1f%%", pct);
}

// Escapes the characters that ECMAScript regexes treat specially.
std::string regex_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}/").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

double wall_of(const std::vector<OpRecord>& step) {
  if (step.empty()) return 0;
  int64_t t0 = std::numeric_limits<int64_t>::max(), t1 = std::numeric_limits<int64_t>::min();
  for (const auto& r : step) {
    t0 = std::min(t0, r.start_ns);
    t1 = std::max(t1, r.end_ns);
  }
  return static_cast<double>(t1 - t0);
}

double duration_of(const OpRecord& r) { return static_cast<double>(r.end_ns - r.start_ns); }

// Index of the element holding the median (the lower middle for an even count).
int median_index(const std::vector<double>& v) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] < v[b]; });
  return idx.empty() ? 0 : idx[(idx.size() - 1) / 2];
}

void add_name(std::vector<std::string>& names, const std::string& n) {
  if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
}

// Per-name median over steps of the name's summed leaf time per step (absent: 0).
std::map<std::string, double> median_time_by_name(
    const std::vector<std::vector<OpRecord>>& steps,
    const std::function<bool(size_t step, size_t record)>& keep) {
  std::map<std::string, std::vector<double>> per;
  for (size_t s = 0; s < steps.size(); ++s) {
    for (size_t i = 0; i < steps[s].size(); ++i) {
      const OpRecord& r = steps[s][i];
      if (!r.leaf || !keep(s, i)) continue;
      auto& v = per[r.name];
      v.resize(steps.size(), 0.0);
      v[s] += duration_of(r);
    }
  }
  std::map<std::string, double> out;
  for (auto& [name, v] : per) {
    v.resize(steps.size(), 0.0);
    out[name] = median(v);
  }
  return out;
}

std::vector<NamedTime> sorted_by_time(const std::map<std::string, double>& m) {
  std::vector<NamedTime> out;
  for (const auto& [name, ns] : m) out.push_back(NamedTime{name, ns});
  std::stable_sort(out.begin(), out.end(),
                   [](const NamedTime& a, const NamedTime& b) { return a.ns > b.ns; });
  return out;
}

}  // namespace

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

ValidationSteps run_validation_steps(Profiler& profiler, const std::function<void()>& dense_step,
                                     const std::function<void()>& sparse_step,
                                     const ValidationPlan& plan) {
  ESPLAG_CHECK(plan.warmup >= 0, "validation: warmup must not be negative, got ", plan.warmup);
  ESPLAG_CHECK(plan.calibration >= 0, "validation: calibration steps must not be negative, got ",
               plan.calibration);
  ESPLAG_CHECK(plan.steps >= 1, "validation: needs at least 1 compared step, got ", plan.steps);
  auto profiled = [&](const std::function<void()>& step) {
    profiler.start();
    try {
      step();
    } catch (...) {
      try {
        profiler.stop();
      } catch (...) {
      }
      throw;
    }
    return profiler.stop();
  };
  for (int i = 0; i < plan.warmup; ++i) {
    dense_step();
    sparse_step();
  }
  ValidationSteps out;
  for (int i = 0; i < plan.calibration; ++i) {
    out.calibration_dense.push_back(profiled(dense_step));
    out.calibration_sparse.push_back(profiled(sparse_step));
  }
  for (int i = 0; i < plan.steps; ++i) {
    out.dense.push_back(profiled(dense_step));
    out.sparse.push_back(profiled(sparse_step));
  }
  return out;
}

double TwinGroup::factor() const {
  if (sparse_ns <= 0) return std::numeric_limits<double>::infinity();
  return dense_ns / sparse_ns;
}

std::vector<std::pair<std::string, std::string>> module_phases(
    const std::vector<OpRecord>& step, const std::vector<std::string>& modules) {
  // Longest prefix first, so "blocks.1.mlp.fc" wins over a module named "blocks.1.mlp".
  std::vector<std::string> sorted = modules;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  std::vector<std::pair<std::string, std::string>> out(step.size());
  std::map<std::string, std::vector<size_t>> waiting;  // helper ops before the next fwd/bwd
  std::map<std::string, std::string> last_phase;
  for (size_t i = 0; i < step.size(); ++i) {
    const OpRecord& r = step[i];
    if (!r.leaf) continue;
    const std::string* module = nullptr;
    for (const auto& m : sorted) {
      if (r.name.size() > m.size() && r.name.compare(0, m.size(), m) == 0 && r.name[m.size()] == '.') {
        module = &m;
        break;
      }
    }
    if (module == nullptr) {
      // With changed modules, an optimizer op of none of them (a per-tensor update, or one
      // fused update of every parameter, as the GPU's AdamW) is a group of its own: the
      // recipe can change how much it updates (slope's kept values) without renaming it.
      if (r.category == OpCategory::optimizer && !modules.empty()) out[i] = {r.name, "optimizer"};
      continue;
    }
    const std::string rest = r.name.substr(module->size() + 1);
    const std::string first = rest.substr(0, rest.find('.'));
    out[i].first = *module;
    if (r.category == OpCategory::optimizer) {
      out[i].second = "optimizer";
    } else if (first == "fwd" || first == "bwd") {
      out[i].second = first;
      for (size_t k : waiting[*module]) out[k].second = first;
      waiting[*module].clear();
      last_phase[*module] = first;
    } else {
      waiting[*module].push_back(i);
    }
  }
  for (const auto& [module, list] : waiting) {
    auto it = last_phase.find(module);
    for (size_t k : list) out[k].second = it != last_phase.end() ? it->second : "other";
  }
  return out;
}

SpeedupModel speedups_from_calibration(const std::vector<std::vector<OpRecord>>& dense_steps,
                                       const std::vector<std::vector<OpRecord>>& sparse_steps,
                                       const std::vector<std::string>& modules) {
  ESPLAG_CHECK(!dense_steps.empty() && !sparse_steps.empty(),
               "validation: the calibration needs at least one step of each run (got ",
               dense_steps.size(), " dense, ", sparse_steps.size(), " sparse)");
  SpeedupModel model;
  model.source = "calibration";
  model.calibration_steps = static_cast<int>(std::min(dense_steps.size(), sparse_steps.size()));

  struct Side {
    std::vector<std::string> names;
    std::map<std::string, OpCategory> category_of;
    std::vector<double> per_step;
    std::array<std::vector<double>, kNumOpCategories> category_per_step;
  };
  struct Group {
    std::string module, phase;
    Side dense, sparse;
  };
  std::vector<Group> groups;
  std::map<std::pair<std::string, std::string>, size_t> index;
  auto collect = [&](const std::vector<std::vector<OpRecord>>& steps, bool dense) {
    for (size_t s = 0; s < steps.size(); ++s) {
      const auto phases = module_phases(steps[s], modules);
      for (size_t i = 0; i < steps[s].size(); ++i) {
        const auto& key = phases[i];
        if (key.first.empty()) continue;
        auto it = index.find(key);
        if (it == index.end()) {
          it = index.emplace(key, groups.size()).first;
          groups.push_back(Group{key.first, key.second, {}, {}});
        }
        Side& side = dense ? groups[it->second].dense : groups[it->second].sparse;
        const OpRecord& r = steps[s][i];
        add_name(side.names, r.name);
        side.category_of[r.name] = r.category;
        side.per_step.resize(steps.size(), 0.0);
        side.per_step[s] += duration_of(r);
        auto& cat = side.category_per_step[static_cast<size_t>(r.category)];
        cat.resize(steps.size(), 0.0);
        cat[s] += duration_of(r);
      }
    }
    for (auto& g : groups) {
      Side& side = dense ? g.dense : g.sparse;
      side.per_step.resize(steps.size(), 0.0);
      for (auto& cat : side.category_per_step)
        if (!cat.empty()) cat.resize(steps.size(), 0.0);
    }
  };
  collect(dense_steps, true);
  collect(sparse_steps, false);

  for (auto& g : groups) {
    TwinGroup t;
    t.module = g.module;
    t.phase = g.phase;
    t.dense_ops = g.dense.names;
    t.sparse_ops = g.sparse.names;
    t.dense_ns = median(g.dense.per_step);
    t.sparse_ns = median(g.sparse.per_step);
    // The split comes from per-category medians, so an outlier step does not skew it.
    Categories cat_median{};
    for (int c = 0; c < kNumOpCategories; ++c) cat_median[c] = median(g.sparse.category_per_step[c]);
    const double total = std::accumulate(cat_median.begin(), cat_median.end(), 0.0);
    if (total > 0)
      for (int c = 0; c < kNumOpCategories; ++c) t.sparse_category_share[c] = cat_median[c] / total;
    t.identical = g.dense.category_of == g.sparse.category_of;
    // A group the dense run lacks cannot be expressed over the dense graph; one whose
    // dense ops took no time cannot be scaled to a positive time.
    // (An optimizer op outside the changed modules is the same op in both runs, yet its
    // time may differ: it is scaled by its measured factor all the same.)
    const bool outside = std::find(modules.begin(), modules.end(), g.module) == modules.end();
    const bool expressible =
        (!t.identical || outside) && !t.dense_ops.empty() && (t.dense_ns > 0 || t.sparse_ns <= 0);
    if (expressible) {
      std::string pattern = "re:^(?:";
      for (size_t k = 0; k < t.dense_ops.size(); ++k) {
        if (k) pattern += '|';
        pattern += regex_escape(t.dense_ops[k]);
      }
      pattern += ")$";
      const double f = t.factor();
      const std::string factor = std::isinf(f) ? std::string("inf") : format_value("%.9g", std::max(f, 1e-9));
      t.spec = static_cast<int>(model.specs.size());
      model.specs.push_back(parse_what_if_spec(pattern + "=" + factor));
      if (total > 0)
        model.category_share.push_back(t.sparse_category_share);
      else
        model.category_share.push_back(std::nullopt);
    }
    model.groups.push_back(std::move(t));
  }
  return model;
}

SpeedupModel speedups_from_specs(std::vector<WhatIfSpec> specs) {
  SpeedupModel model;
  model.source = "what-if specs";
  model.category_share.assign(specs.size(), std::nullopt);
  model.specs = std::move(specs);
  return model;
}

std::string speedups_csv(const SpeedupModel& model) {
  std::ostringstream os;
  os << "pattern,factor,module,phase,dense_us,sparse_us\n";
  auto pattern_of = [](const WhatIfSpec& s) { return s.text.substr(0, s.text.rfind('=')); };
  auto factor_of = [](const WhatIfSpec& s) { return s.text.substr(s.text.rfind('=') + 1); };
  if (!model.groups.empty()) {
    for (const auto& g : model.groups) {
      if (g.spec < 0) continue;
      const WhatIfSpec& s = model.specs[g.spec];
      os << csv_field(pattern_of(s)) << ',' << factor_of(s) << ',' << csv_field(g.module) << ','
         << g.phase << ',' << format_value("%.3f", g.dense_ns / 1e3) << ',' << format_value("%.3f", g.sparse_ns / 1e3)
         << '\n';
    }
  } else {
    for (const auto& s : model.specs) os << csv_field(pattern_of(s)) << ',' << factor_of(s) << ",,,,\n";
  }
  return os.str();
}

double CategoryValidation::error_pct() const {
  if (measured_ns <= 0) return std::numeric_limits<double>::quiet_NaN();
  return 100.0 * (predicted_ns - measured_ns) / measured_ns;
}

double ValidationResult::error_pct() const {
  if (measured_ns <= 0) return std::numeric_limits<double>::quiet_NaN();
  return 100.0 * (predicted_ns - measured_ns) / measured_ns;
}

double ValidationResult::measured_spread_pct() const {
  if (sparse_wall_ns.empty() || measured_ns <= 0) return 0;
  const auto [lo, hi] = std::minmax_element(sparse_wall_ns.begin(), sparse_wall_ns.end());
  return 100.0 * (*hi - *lo) / measured_ns;
}

ValidationResult validate_prediction(const std::vector<std::vector<OpRecord>>& dense_steps,
                                     const std::vector<std::vector<OpRecord>>& sparse_steps,
                                     SpeedupModel model) {
  ESPLAG_CHECK(!dense_steps.empty() && !sparse_steps.empty(),
               "validation: needs at least one profiled step of each run (got ", dense_steps.size(),
               " dense, ", sparse_steps.size(), " sparse)");
  ESPLAG_CHECK(model.category_share.size() == model.specs.size(),
               "validation: the speed-up model has ", model.specs.size(), " specs but ",
               model.category_share.size(), " category splits");
  ValidationResult v;
  v.steps = static_cast<int>(std::min(dense_steps.size(), sparse_steps.size()));

  std::vector<Categories> predicted_categories, measured_categories;
  std::vector<double> predicted_op, measured_op;
  for (const auto& step : dense_steps) {
    const OpGraph g = OpGraph::from_records(step);
    const WhatIfResult w = what_if(g, model.specs);
    v.dense_wall_ns.push_back(g.measured_wall_ns());
    v.predicted_ns_list.push_back(w.predicted_ns);
    Categories c{};
    double total = 0;
    for (int i = 0; i < g.size(); ++i) {
      const double d = w.predicted.durations[i];
      const int spec = w.spec_of_node[i];
      if (spec >= 0 && model.category_share[spec]) {
        for (int k = 0; k < kNumOpCategories; ++k) c[k] += d * (*model.category_share[spec])[k];
      } else {
        c[static_cast<size_t>(g.node(i).category)] += d;
      }
      total += d;
    }
    predicted_categories.push_back(c);
    predicted_op.push_back(total);
  }
  for (const auto& step : sparse_steps) {
    v.sparse_wall_ns.push_back(wall_of(step));
    Categories c{};
    double total = 0;
    for (const auto& r : step) {
      if (!r.leaf) continue;
      c[static_cast<size_t>(r.category)] += duration_of(r);
      total += duration_of(r);
    }
    measured_categories.push_back(c);
    measured_op.push_back(total);
  }
  v.dense_ns = median(v.dense_wall_ns);
  v.predicted_ns = median(v.predicted_ns_list);
  v.measured_ns = median(v.sparse_wall_ns);
  v.predicted_op_ns = median(predicted_op);
  v.measured_op_ns = median(measured_op);
  v.dense_step = median_index(v.dense_wall_ns);
  v.sparse_step = median_index(v.sparse_wall_ns);
  for (int k = 0; k < kNumOpCategories; ++k) {
    std::vector<double> p, m;
    for (const auto& c : predicted_categories) p.push_back(c[k]);
    for (const auto& c : measured_categories) m.push_back(c[k]);
    CategoryValidation cv;
    cv.category = all_op_categories()[k];
    cv.predicted_ns = median(p);
    cv.measured_ns = median(m);
    if (cv.predicted_ns > 0 || cv.measured_ns > 0) v.by_category.push_back(cv);
  }

  // Which ops the prediction covers. With a calibration, an op of a changed module is
  // covered when its (module, phase) group has a spec or is identical in both runs; any
  // other op when the other run has an op of the same name (the same op). With specs, by
  // name only: the specs are over the dense op names and cannot say what they replace.
  std::set<std::string> dense_names, sparse_names;
  for (const auto& step : dense_steps)
    for (const auto& r : step)
      if (r.leaf) dense_names.insert(r.name);
  for (const auto& step : sparse_steps)
    for (const auto& r : step)
      if (r.leaf) sparse_names.insert(r.name);
  std::vector<std::string> modules;
  std::map<std::pair<std::string, std::string>, bool> group_covered;
  for (const auto& g : model.groups) {
    add_name(modules, g.module);
    group_covered[{g.module, g.phase}] = g.spec >= 0 || g.identical;
  }
  auto covered_by = [&](const std::vector<std::vector<OpRecord>>& steps,
                        const std::set<std::string>& other_names) {
    std::vector<std::vector<std::pair<std::string, std::string>>> phases;
    for (const auto& step : steps) phases.push_back(module_phases(step, modules));
    return sorted_by_time(median_time_by_name(steps, [&, phases](size_t s, size_t i) {
      const auto& key = phases[s][i];
      if (key.first.empty()) return !other_names.count(steps[s][i].name);
      auto it = group_covered.find(key);
      return it == group_covered.end() || !it->second;
    }));
  };
  v.uncovered_sparse_ops = covered_by(sparse_steps, dense_names);
  v.dense_only_ops = covered_by(dense_steps, sparse_names);
  v.model = std::move(model);
  return v;
}

std::string validation_json(const ValidationResult& v) {
  auto number = [](double x) { return std::isfinite(x) ? Json(x) : Json(nullptr); };
  Json by_category = Json::array();
  for (const auto& c : v.by_category)
    by_category.push_back({{"category", std::string(op_category_name(c.category))},
                           {"predicted_ns", c.predicted_ns},
                           {"measured_ns", c.measured_ns},
                           {"error_pct", number(c.error_pct())}});
  Json specs = Json::array();
  for (const auto& s : v.model.specs) specs.push_back({{"spec", s.text}, {"factor", number(s.factor)}});
  Json groups = Json::array();
  for (const auto& g : v.model.groups) {
    Json share = Json::object();
    for (int k = 0; k < kNumOpCategories; ++k)
      if (g.sparse_category_share[k] > 0)
        share[std::string(op_category_name(all_op_categories()[k]))] = g.sparse_category_share[k];
    groups.push_back({{"module", g.module},
                      {"phase", g.phase},
                      {"dense_ops", g.dense_ops},
                      {"sparse_ops", g.sparse_ops},
                      {"dense_ns", g.dense_ns},
                      {"sparse_ns", g.sparse_ns},
                      {"factor", number(g.factor())},
                      {"spec", g.spec >= 0 ? Json(v.model.specs[g.spec].text) : Json(nullptr)},
                      {"sparse_category_share", share}});
  }
  auto named = [](const std::vector<NamedTime>& list) {
    Json a = Json::array();
    for (const auto& n : list) a.push_back({{"name", n.name}, {"ns", n.ns}});
    return a;
  };
  const double op_error = v.measured_op_ns > 0
                              ? 100.0 * (v.predicted_op_ns - v.measured_op_ns) / v.measured_op_ns
                              : std::numeric_limits<double>::quiet_NaN();
  Json doc = {{"source", v.model.source},
              {"steps", v.steps},
              {"calibration_steps", v.model.calibration_steps},
              {"dense", {{"median_wall_ns", v.dense_ns}, {"wall_ns", v.dense_wall_ns}, {"median_step", v.dense_step}}},
              {"predicted", {{"median_ns", v.predicted_ns}, {"per_step_ns", v.predicted_ns_list}}},
              {"measured", {{"median_wall_ns", v.measured_ns}, {"wall_ns", v.sparse_wall_ns}, {"median_step", v.sparse_step}}},
              {"error_pct", number(v.error_pct())},
              {"measured_spread_pct", v.measured_spread_pct()},
              {"predicted_speedup", number(v.predicted_ns > 0 ? v.dense_ns / v.predicted_ns : NAN)},
              {"measured_speedup", number(v.measured_ns > 0 ? v.dense_ns / v.measured_ns : NAN)},
              {"op_time", {{"predicted_ns", v.predicted_op_ns}, {"measured_ns", v.measured_op_ns}, {"error_pct", number(op_error)}}},
              {"by_category", by_category},
              {"specs", specs},
              {"groups", groups},
              {"uncovered_sparse_ops", named(v.uncovered_sparse_ops)},
              {"dense_only_ops", named(v.dense_only_ops)}};
  return doc.dump(2) + "\n";
}

std::string validation_summary(const ValidationResult& v) {
  std::ostringstream os;
  os << "validation (" << v.steps << " steps per run, medians; speed-ups from " << v.model.source;
  if (v.model.calibration_steps > 0) os << " over " << v.model.calibration_steps << " steps";
  os << "):\n";
  os << "  dense measured     " << format_ns(v.dense_ns) << "\n";
  os << "  sparse predicted   " << format_ns(v.predicted_ns) << "\n";
  os << "  sparse measured    " << format_ns(v.measured_ns) << " (spread "
     << format_value("%.1f%%", v.measured_spread_pct()) << ")\n";
  os << "  error              " << fmt_error(v.error_pct()) << "\n";
  if (!v.by_category.empty()) {
    os << "  by category (op time, predicted / measured / error):\n";
    for (const auto& c : v.by_category) {
      char line[200];
      std::snprintf(line, sizeof line, "    %-12s %12s %12s %8s\n",
                    std::string(op_category_name(c.category)).c_str(), format_ns(c.predicted_ns).c_str(),
                    format_ns(c.measured_ns).c_str(), fmt_error(c.error_pct()).c_str());
      os << line;
    }
  }
  std::vector<const TwinGroup*> changed;
  for (const auto& g : v.model.groups)
    if (!g.identical) changed.push_back(&g);
  if (!changed.empty()) {
    std::stable_sort(changed.begin(), changed.end(),
                     [](const TwinGroup* a, const TwinGroup* b) { return a->dense_ns > b->dense_ns; });
    os << "  speed-ups (median dense -> sparse time of each changed module and phase):\n";
    const size_t shown = std::min<size_t>(changed.size(), 12);
    for (size_t k = 0; k < shown; ++k) {
      const TwinGroup& g = *changed[k];
      const double f = g.factor();
      char line[240];
      std::snprintf(line, sizeof line, "    %-28s %-9s %12s -> %12s  %s\n", g.module.c_str(), g.phase.c_str(),
                    format_ns(g.dense_ns).c_str(), format_ns(g.sparse_ns).c_str(),
                    g.spec < 0 ? "(no dense twin)" : std::isinf(f) ? "free" : format_value("%.2fx", f).c_str());
      os << line;
    }
    if (changed.size() > shown) os << "    ... " << changed.size() - shown << " more\n";
  }
  if (!v.uncovered_sparse_ops.empty()) {
    double t = 0;
    for (const auto& n : v.uncovered_sparse_ops) t += n.ns;
    os << "  not covered by the prediction: " << v.uncovered_sparse_ops.size() << " sparse op(s), "
       << format_ns(t) << " per step (e.g. " << v.uncovered_sparse_ops.front().name << ")\n";
  }
  if (!v.dense_only_ops.empty())
    os << "  dense ops the sparse run does not have: " << v.dense_only_ops.size() << " (e.g. "
       << v.dense_only_ops.front().name << ")\n";
  return os.str();
}

std::string format_value(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::string format_ns(double ns) {
  const double a = std::abs(ns);
  if (a >= 1e9) return format_value("%.3f s", ns / 1e9);
  if (a >= 1e6) return format_value("%.3f ms", ns / 1e6);
  if (a >= 1e3) return format_value("%.3f us", ns / 1e3);
  return format_value("%.0f ns", ns);
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace esplag
