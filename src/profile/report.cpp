#include "profile/report.h"

#include <cstdint>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <sstream>

#include "core/error.h"

namespace esplag {

namespace {

using Json = nlohmann::ordered_json;

std::string fmt_pct(double part, double whole) {
  return format_value("%.1f%%", whole > 0 ? 100.0 * part / whole : 0.0);
}

std::string fmt_speedup(double baseline, double predicted) {
  if (predicted <= 0) return baseline > 0 ? "inf" : "1.00x";
  return format_value("%.2fx", baseline / predicted);
}

// Integers print exactly, other values with enough digits to read back.
std::string fmt_number(double v) {
  if (std::abs(v) < 9e15 && v == std::floor(v)) return format_value("%.0f", v);
  return format_value("%.17g", v);
}

std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

const char* category_color(OpCategory c) {
  static const char* kColors[kNumOpCategories] = {
      "#4e79a7", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2",
      "#edc948", "#9c755f", "#bab0ac", "#ff9da7", "#8c8c8c"};
  return kColors[static_cast<size_t>(c)];
}
constexpr const char* kCriticalColor = "#d62728";

// Where an op sits on the timeline: measured start when known, else the scheduled one.
double node_start(const ProfileResult& r, int i) {
  const double m = r.graph.nodes()[i].measured_start_ns;
  return m >= 0 ? m : r.schedule.earliest_start[i];
}

std::string layer_label(int layer) {
  return layer < 0 ? std::string("(none)") : "layer " + std::to_string(layer);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// trace.json

std::string trace_json(const ProfileResult& r) {
  const auto& nodes = r.graph.nodes();
  std::map<int64_t, int> node_of_record;
  for (int i = 0; i < r.graph.size(); ++i)
    if (nodes[i].record >= 0) node_of_record[nodes[i].record] = i;

  std::set<int> streams;
  for (const auto& n : nodes) streams.insert(n.stream);
  for (const auto& rec : r.records) streams.insert(rec.stream);
  const int critical_tid = streams.empty() ? 1 : *streams.rbegin() + 1;

  Json events = Json::array();
  auto meta = [&](const char* what, int pid, int tid, const std::string& name, int sort) {
    Json m = {{"ph", "M"}, {"name", what}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}};
    events.push_back(m);
    Json s = {{"ph", "M"},
              {"name", std::string(what) == "process_name" ? "process_sort_index"
                                                           : "thread_sort_index"},
              {"pid", pid},
              {"tid", tid},
              {"args", {{"sort_index", sort}}}};
    events.push_back(s);
  };
  meta("process_name", 1, 0, "measured", 1);
  for (int s : streams) meta("thread_name", 1, s, "stream " + std::to_string(s), s);
  meta("thread_name", 1, critical_tid, "critical path", critical_tid);

  auto node_args = [&](Json& args, int i) {
    args["critical_path"] = r.schedule.on_critical_path[i] != 0;
    args["slack_us"] = r.schedule.slack[i] / 1e3;
  };
  auto x_event = [&](const std::string& name, OpCategory cat, int pid, int tid, double ts_ns,
                     double dur_ns, Json args) {
    Json e = {{"name", name},  {"cat", std::string(op_category_name(cat))},
              {"ph", "X"},     {"ts", ts_ns / 1e3},
              {"dur", dur_ns / 1e3}, {"pid", pid},
              {"tid", tid},    {"args", std::move(args)}};
    return e;
  };

  if (!r.records.empty()) {
    int64_t t0 = std::numeric_limits<int64_t>::max();
    for (const auto& rec : r.records) t0 = std::min(t0, rec.start_ns);
    for (size_t k = 0; k < r.records.size(); ++k) {
      const OpRecord& rec = r.records[k];
      Json args = {{"category", std::string(op_category_name(rec.category))},
                   {"layer", rec.layer},
                   {"flops", rec.flops},
                   {"bytes", rec.bytes},
                   {"depth", rec.depth},
                   {"leaf", rec.leaf}};
      auto it = node_of_record.find(static_cast<int64_t>(k));
      if (it != node_of_record.end()) node_args(args, it->second);
      Json e = x_event(rec.name, rec.category, 1, rec.stream,
                       static_cast<double>(rec.start_ns - t0),
                       static_cast<double>(rec.end_ns - rec.start_ns), std::move(args));
      if (it != node_of_record.end() && r.schedule.on_critical_path[it->second])
        e["cname"] = "terrible";
      events.push_back(std::move(e));
    }
  } else {
    for (int i = 0; i < r.graph.size(); ++i) {
      const GraphNode& n = nodes[i];
      Json args = {{"category", std::string(op_category_name(n.category))},
                   {"layer", n.layer},
                   {"flops", n.flops},
                   {"bytes", n.bytes},
                   {"depth", 0},
                   {"leaf", true}};
      node_args(args, i);
      Json e = x_event(n.name, n.category, 1, n.stream, node_start(r, i), n.duration_ns,
                       std::move(args));
      if (r.schedule.on_critical_path[i]) e["cname"] = "terrible";
      events.push_back(std::move(e));
    }
  }
  for (int i : r.schedule.critical_path) {
    const GraphNode& n = nodes[i];
    Json e = x_event(n.name, n.category, 1, critical_tid, node_start(r, i), n.duration_ns,
                     Json{{"stream", n.stream}, {"layer", n.layer}});
    e["cat"] = "critical_path";
    e["cname"] = "terrible";
    events.push_back(std::move(e));
  }

  const WhatIfResult& w = r.what_if;
  if (!w.specs.empty()) {
    meta("process_name", 2, 0, "what-if predicted", 2);
    for (int s : streams) meta("thread_name", 2, s, "stream " + std::to_string(s), s);
    for (int i = 0; i < r.graph.size(); ++i) {
      const GraphNode& n = nodes[i];
      const int spec = w.spec_of_node[i];
      Json args = {{"category", std::string(op_category_name(n.category))},
                   {"layer", n.layer},
                   {"measured_dur_us", n.duration_ns / 1e3},
                   {"what_if", spec >= 0 ? w.specs[spec].text : std::string()},
                   {"critical_path", w.predicted.on_critical_path[i] != 0}};
      events.push_back(x_event(n.name, n.category, 2, n.stream, w.predicted.earliest_start[i],
                               w.predicted.durations[i], std::move(args)));
    }
  }

  Json other = {{"measured_wall_us", r.measured_wall_ns / 1e3},
                {"modelled_step_us", r.schedule.makespan_ns / 1e3},
                {"critical_path_us", r.schedule.makespan_ns / 1e3},
                {"critical_path_ops", r.schedule.critical_path.size()},
                {"op_time_us", r.op_time_ns / 1e3}};
  if (r.comm_ns > 0) {
    other["comm_us"] = r.comm_ns / 1e3;
    other["comm_exposed_us"] = r.comm_exposed_ns / 1e3;
  }
  if (!w.specs.empty()) {
    Json specs = Json::array();
    for (const auto& s : w.specs) specs.push_back(s.text);
    other["what_if"] = specs;
    other["what_if_predicted_us"] = w.predicted_ns / 1e3;
  }
  Json doc = {{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ns"},
              {"otherData", std::move(other)}};
  return doc.dump();
}

// ---------------------------------------------------------------------------------------
// ops.csv

std::string ops_csv(const ProfileResult& r) {
  std::ostringstream os;
  os << "name,category,layer,stream,start_us,dur_us,flops,bytes,on_critical_path,slack_us\n";
  for (int i = 0; i < r.graph.size(); ++i) {
    const GraphNode& n = r.graph.nodes()[i];
    os << csv_field(n.name) << ',' << op_category_name(n.category) << ',' << n.layer << ','
       << n.stream << ',' << format_value("%.3f", node_start(r, i) / 1e3) << ','
       << format_value("%.3f", n.duration_ns / 1e3) << ',' << fmt_number(n.flops) << ','
       << fmt_number(n.bytes) << ',' << (r.schedule.on_critical_path[i] ? 1 : 0) << ','
       << format_value("%.3f", r.schedule.slack[i] / 1e3) << '\n';
  }
  return os.str();
}

// ---------------------------------------------------------------------------------------
// summary

std::string summary_text(const ProfileResult& r, int top_categories) {
  std::ostringstream os;
  const Schedule& s = r.schedule;
  os << "step time: " << format_ns(r.measured_wall_ns) << " measured, "
     << format_ns(s.makespan_ns) << " modelled (" << r.graph.size() << " ops on " << r.streams
     << (r.streams == 1 ? " stream)\n" : " streams)\n");
  os << "critical path: " << format_ns(s.makespan_ns) << " over " << s.critical_path.size()
     << " ops (in ops " << format_ns(s.critical_op_ns) << ", untraced "
     << format_ns(s.makespan_ns - s.critical_op_ns) << "); op time summed over all ops "
     << format_ns(r.op_time_ns) << "\n";
  if (!r.by_category.empty()) {
    os << "time by category (share of op time / of critical path):\n";
    int shown = 0;
    for (const auto& c : r.by_category) {
      if (shown++ >= top_categories) break;
      char line[160];
      std::snprintf(line, sizeof line, "  %-12s %12s  %6s / %6s\n",
                    std::string(op_category_name(c.category)).c_str(),
                    format_ns(c.total_ns).c_str(), fmt_pct(c.total_ns, r.op_time_ns).c_str(),
                    fmt_pct(c.critical_ns, s.makespan_ns).c_str());
      os << line;
    }
  }
  if (r.comm_ns > 0)
    os << "collectives: " << format_ns(r.comm_ns) << ", of which " << format_ns(r.comm_exposed_ns)
       << " exposed (the step without them is that much shorter); "
       << fmt_pct(r.comm_ns - r.comm_exposed_ns, r.comm_ns) << " hidden behind other work\n";
  const WhatIfResult& w = r.what_if;
  if (!w.specs.empty()) {
    os << "what-if (modelled baseline " << format_ns(w.baseline_ns) << "):\n";
    for (const auto& p : w.per_spec) {
      os << "  " << p.spec << ": " << p.matched_ops << " ops, " << format_ns(p.matched_ns)
         << " -> " << format_ns(p.predicted_alone_ns) << " ("
         << fmt_speedup(w.baseline_ns, p.predicted_alone_ns) << "); if free "
         << format_ns(p.amdahl_bound_ns) << " (" << fmt_speedup(w.baseline_ns, p.amdahl_bound_ns)
         << ")\n";
    }
    if (w.specs.size() > 1)
      os << "  all specs: " << format_ns(w.predicted_ns) << " ("
         << fmt_speedup(w.baseline_ns, w.predicted_ns) << ")\n";
  }
  return os.str();
}

// ---------------------------------------------------------------------------------------
// report.html

namespace {

struct Bar {
  std::string label;
  double value = 0;
  double highlight = -1;  // drawn over the bar in a darker shade; < 0: none
  std::string color;
  std::string text;       // printed after the bar
};

constexpr const char* kSvgOpen = "<svg xmlns=\"http://www.w3.org/2000/svg\" ";

std::string bar_chart(const std::vector<Bar>& bars, int label_w = 260) {
  if (bars.empty()) return "<p>(nothing to show)</p>\n";
  const int bar_w = 520, row_h = 22, text_w = 300;
  const int width = label_w + bar_w + text_w;
  const int height = static_cast<int>(bars.size()) * row_h + 8;
  double max_v = 0;
  for (const auto& b : bars) max_v = std::max(max_v, b.value);
  std::ostringstream os;
  os << kSvgOpen << "width=\"" << width << "\" height=\"" << height << "\" viewBox=\"0 0 "
     << width << " " << height << "\" class=\"chart\">\n";
  // Labels longer than the label column are cut in the middle; the bar's tooltip keeps
  // the whole text.
  const size_t max_chars = static_cast<size_t>(label_w / 7);
  auto short_label = [&](const std::string& l) {
    if (l.size() <= max_chars) return l;
    const size_t keep = max_chars / 2 - 1;
    return l.substr(0, keep) + "\u2026" + l.substr(l.size() - keep);
  };
  for (size_t k = 0; k < bars.size(); ++k) {
    const Bar& b = bars[k];
    const double y = 4 + static_cast<double>(k) * row_h;
    const double w = max_v > 0 ? bar_w * b.value / max_v : 0;
    os << "<text x=\"" << label_w - 6 << "\" y=\"" << format_value("%.1f", y + 15)
       << "\" text-anchor=\"end\">" << html_escape(short_label(b.label)) << "</text>";
    os << "<rect x=\"" << label_w << "\" y=\"" << format_value("%.1f", y + 3) << "\" width=\""
       << format_value("%.2f", w) << "\" height=\"" << row_h - 6 << "\" fill=\"" << b.color
       << "\" fill-opacity=\"0.45\"><title>" << html_escape(b.label) << ": "
       << html_escape(b.text) << "</title></rect>";
    if (b.highlight >= 0 && max_v > 0)
      os << "<rect x=\"" << label_w << "\" y=\"" << format_value("%.1f", y + 3) << "\" width=\""
         << format_value("%.2f", bar_w * b.highlight / max_v) << "\" height=\"" << row_h - 6
         << "\" fill=\"" << b.color << "\"/>";
    os << "<text x=\"" << format_value("%.1f", label_w + w + 6) << "\" y=\"" << format_value("%.1f", y + 15)
       << "\">" << html_escape(b.text) << "</text>\n";
  }
  os << "</svg>\n";
  return os.str();
}

std::string timeline_svg(const ProfileResult& r) {
  const auto& nodes = r.graph.nodes();
  std::set<int> stream_set;
  for (const auto& n : nodes) stream_set.insert(n.stream);
  std::vector<int> streams(stream_set.begin(), stream_set.end());
  const int label_w = 110, plot_w = 1000, lane_h = 26, axis_h = 28;
  const int lanes = static_cast<int>(streams.size()) + 1;  // + the critical path lane
  const int width = label_w + plot_w + 50;  // room for the last tick label
  const int height = lanes * lane_h + axis_h + 6;
  double total = std::max(r.measured_wall_ns, r.schedule.makespan_ns);
  for (int i = 0; i < r.graph.size(); ++i)
    total = std::max(total, node_start(r, i) + nodes[i].duration_ns);
  if (total <= 0) total = 1;
  auto x_of = [&](double t) { return label_w + plot_w * t / total; };

  std::ostringstream os;
  os << kSvgOpen << "width=\"" << width << "\" height=\"" << height << "\" viewBox=\"0 0 "
     << width << " " << height << "\" class=\"chart\">\n";
  auto lane_y = [&](int lane) { return 4 + lane * lane_h; };
  for (int l = 0; l < lanes; ++l) {
    const bool crit = l == lanes - 1;
    os << "<rect x=\"" << label_w << "\" y=\"" << lane_y(l) << "\" width=\"" << plot_w
       << "\" height=\"" << lane_h - 4 << "\" fill=\"" << (crit ? "#fbeaea" : "#f3f3f3")
       << "\"/>";
    os << "<text x=\"" << label_w - 6 << "\" y=\"" << lane_y(l) + 16
       << "\" text-anchor=\"end\">"
       << (crit ? std::string("critical path") : "stream " + std::to_string(streams[l]))
       << "</text>\n";
  }
  auto draw = [&](int i, int lane, bool crit_lane) {
    const GraphNode& n = nodes[i];
    const bool crit = r.schedule.on_critical_path[i] != 0;
    const double x = x_of(node_start(r, i));
    const double w = std::max(0.5, plot_w * n.duration_ns / total);
    os << "<rect x=\"" << format_value("%.2f", x) << "\" y=\"" << lane_y(lane) + 2 << "\" width=\""
       << format_value("%.2f", w) << "\" height=\"" << lane_h - 8 << "\" fill=\""
       << (crit_lane ? kCriticalColor : category_color(n.category)) << "\"";
    if (crit && !crit_lane) os << " stroke=\"" << kCriticalColor << "\" stroke-width=\"1.5\"";
    os << "><title>" << html_escape(n.name) << " (" << op_category_name(n.category) << ", "
       << layer_label(n.layer) << "): " << format_ns(n.duration_ns) << ", slack "
       << format_ns(r.schedule.slack[i]) << (crit ? ", on the critical path" : "")
       << "</title></rect>\n";
  };
  for (int i = 0; i < r.graph.size(); ++i) {
    const int lane = static_cast<int>(
        std::lower_bound(streams.begin(), streams.end(), nodes[i].stream) - streams.begin());
    draw(i, lane, false);
  }
  for (int i : r.schedule.critical_path) draw(i, lanes - 1, true);
  const int axis_y = lanes * lane_h + 6;
  os << "<line x1=\"" << label_w << "\" y1=\"" << axis_y << "\" x2=\"" << label_w + plot_w
     << "\" y2=\"" << axis_y << "\" stroke=\"#444\"/>";
  for (int k = 0; k <= 5; ++k) {
    const double t = total * k / 5;
    const double x = x_of(t);
    os << "<line x1=\"" << format_value("%.1f", x) << "\" y1=\"" << axis_y << "\" x2=\""
       << format_value("%.1f", x) << "\" y2=\"" << axis_y + 4 << "\" stroke=\"#444\"/>";
    os << "<text x=\"" << format_value("%.1f", x) << "\" y=\"" << axis_y + 18
       << "\" text-anchor=\"middle\">" << format_ns(t) << "</text>";
  }
  os << "\n</svg>\n";
  return os.str();
}

std::string legend_html() {
  std::ostringstream os;
  os << "<p class=\"legend\">";
  for (OpCategory c : all_op_categories())
    os << "<span><span class=\"sw\" style=\"background:" << category_color(c) << "\"></span>"
       << op_category_name(c) << "</span> ";
  os << "<span><span class=\"sw\" style=\"background:" << kCriticalColor
     << "\"></span>critical path</span></p>\n";
  return os.str();
}

// A numeric table cell that sorts by its value.
std::string num_td(double sort_value, const std::string& text) {
  return "<td class=\"n\" data-v=\"" + format_value("%.6g", sort_value) + "\">" + html_escape(text) + "</td>";
}

std::string fmt_error_pct(double pct) {
  if (!std::isfinite(pct)) return "n/a";
  return format_value("%+.1f%%", pct);
}

std::string validation_html(const ValidationResult& v) {
  std::ostringstream os;
  os << "<h2 id=\"validation\">Validation: predicted vs measured</h2>\n<p>The sparse configuration's step time "
        "predicted from the dense run's op graph with per-op speed-ups (from "
     << html_escape(v.model.source);
  if (v.model.calibration_steps > 0)
    os << ", " << v.model.calibration_steps << " calibration step"
       << (v.model.calibration_steps == 1 ? "" : "s");
  os << "), against the sparse configuration measured; medians over " << v.steps << " step"
     << (v.steps == 1 ? "" : "s") << " per run.</p>\n";
  os << "<table>\n";
  auto row = [&](const std::string& k, const std::string& val) {
    os << "<tr><th>" << html_escape(k) << "</th><td class=\"n\">" << html_escape(val)
       << "</td></tr>\n";
  };
  row("dense step (measured)", format_ns(v.dense_ns));
  row("sparse step predicted", format_ns(v.predicted_ns) + " (" +
                                   fmt_speedup(v.dense_ns, v.predicted_ns) + " vs dense)");
  row("sparse step measured", format_ns(v.measured_ns) + " (" +
                                  fmt_speedup(v.dense_ns, v.measured_ns) + " vs dense)");
  row("error of the prediction", fmt_error_pct(v.error_pct()));
  row("spread of the measured steps (max - min)", format_value("%.1f%%", v.measured_spread_pct()));
  const double op_err = v.measured_op_ns > 0
                            ? 100.0 * (v.predicted_op_ns - v.measured_op_ns) / v.measured_op_ns
                            : std::nan("");
  row("op time predicted / measured", format_ns(v.predicted_op_ns) + " / " +
                                          format_ns(v.measured_op_ns) + " (" +
                                          fmt_error_pct(op_err) + ")");
  os << "</table>\n";
  os << bar_chart({Bar{"dense (measured)", v.dense_ns, -1, "#8c8c8c", format_ns(v.dense_ns)},
                   Bar{"sparse predicted", v.predicted_ns, -1, "#4e79a7",
                       format_ns(v.predicted_ns) + " (" + fmt_error_pct(v.error_pct()) + ")"},
                   Bar{"sparse measured", v.measured_ns, -1, kCriticalColor, format_ns(v.measured_ns)}});

  os << "<h3>By category (op time per step)</h3>\n";
  {
    std::vector<Bar> bars;
    for (const auto& c : v.by_category) {
      const std::string name(op_category_name(c.category));
      bars.push_back(Bar{name + " predicted", c.predicted_ns, -1, category_color(c.category),
                         format_ns(c.predicted_ns)});
      bars.push_back(Bar{name + " measured", c.measured_ns, c.measured_ns, category_color(c.category),
                         format_ns(c.measured_ns) + " (error " + fmt_error_pct(c.error_pct()) + ")"});
    }
    os << bar_chart(bars, 200);
  }
  os << "<p>Light bar: predicted; dark bar: measured.</p>\n";
  os << "<table class=\"sortable\">\n<tr><th>category</th><th>predicted</th><th>measured</th>"
        "<th>error</th></tr>\n";
  for (const auto& c : v.by_category)
    os << "<tr><td>" << op_category_name(c.category) << "</td>" << num_td(c.predicted_ns, format_ns(c.predicted_ns))
       << num_td(c.measured_ns, format_ns(c.measured_ns))
       << num_td(std::isfinite(c.error_pct()) ? c.error_pct() : 0, fmt_error_pct(c.error_pct())) << "</tr>\n";
  os << "</table>\n";

  os << "<h3>Per step</h3>\n<table class=\"sortable\">\n<tr><th>step</th><th>dense measured</th>"
        "<th>sparse predicted</th><th>sparse measured</th></tr>\n";
  const size_t n = std::max({v.dense_wall_ns.size(), v.predicted_ns_list.size(), v.sparse_wall_ns.size()});
  auto cell = [&](const std::vector<double>& list, size_t i) {
    return i < list.size() ? num_td(list[i], format_ns(list[i])) : std::string("<td></td>");
  };
  for (size_t i = 0; i < n; ++i)
    os << "<tr>" << num_td(double(i), std::to_string(i)) << cell(v.dense_wall_ns, i)
       << cell(v.predicted_ns_list, i) << cell(v.sparse_wall_ns, i) << "</tr>\n";
  os << "</table>\n";

  os << "<h3>Speed-ups applied to the dense graph</h3>\n";
  if (!v.model.groups.empty()) {
    os << "<table class=\"sortable\">\n<tr><th>module</th><th>phase</th><th>dense ops</th>"
          "<th>sparse ops</th><th>dense</th><th>sparse</th><th>speed-up</th></tr>\n";
    auto join = [](const std::vector<std::string>& names, const std::string& module) {
      std::string out;
      for (const auto& nm : names) {
        if (!out.empty()) out += ", ";
        out += nm.rfind(module + ".", 0) == 0 ? nm.substr(module.size() + 1) : nm;
      }
      return out;
    };
    for (const auto& g : v.model.groups) {
      const double f = g.factor();
      os << "<tr><td>" << html_escape(g.module) << "</td><td>" << html_escape(g.phase) << "</td><td>"
         << html_escape(join(g.dense_ops, g.module)) << "</td><td>"
         << html_escape(join(g.sparse_ops, g.module)) << "</td>" << num_td(g.dense_ns, format_ns(g.dense_ns))
         << num_td(g.sparse_ns, format_ns(g.sparse_ns))
         << num_td(g.identical ? 1.0 : std::isfinite(f) ? f : 1e300,
                   g.identical   ? std::string("unchanged (1x)")
                   : g.spec < 0  ? std::string("(no dense twin)")
                   : std::isinf(f) ? std::string("free")
                                   : format_value("%.3fx", f))
         << "</tr>\n";
    }
    os << "</table>\n";
  } else if (!v.model.specs.empty()) {
    os << "<ul>\n";
    for (const auto& sp : v.model.specs) os << "<li>" << html_escape(sp.text) << "</li>\n";
    os << "</ul>\n";
  } else {
    os << "<p>None: the prediction is the dense step itself.</p>\n";
  }
  auto named_list = [&](const char* title, const std::vector<NamedTime>& list) {
    if (list.empty()) return;
    os << "<h3>" << title << "</h3>\n<table>\n<tr><th>op</th><th>time per step</th></tr>\n";
    for (size_t i = 0; i < list.size() && i < 20; ++i)
      os << "<tr><td>" << html_escape(list[i].name) << "</td>" << num_td(list[i].ns, format_ns(list[i].ns))
         << "</tr>\n";
    if (list.size() > 20) os << "<tr><td>... " << list.size() - 20 << " more</td><td></td></tr>\n";
    os << "</table>\n";
  };
  named_list("Sparse ops the prediction does not cover", v.uncovered_sparse_ops);
  named_list("Dense ops the sparse run does not have", v.dense_only_ops);
  return os.str();
}

// Sortable tables, and the rendered marker (see report.h).
constexpr const char* kScript = R"JS(
(function () {
  'use strict';
  function key(td) {
    if (!td) return '';
    var v = td.getAttribute('data-v');
    return v !== null ? parseFloat(v) : td.textContent;
  }
  document.querySelectorAll('table.sortable').forEach(function (table) {
    var headers = table.querySelectorAll('tr:first-child th');
    headers.forEach(function (th, col) {
      th.style.cursor = 'pointer';
      th.title = 'click to sort';
      th.addEventListener('click', function () {
        var rows = Array.prototype.slice.call(table.querySelectorAll('tr'), 1);
        var desc = th.getAttribute('data-sort') !== 'desc';
        headers.forEach(function (h) { h.removeAttribute('data-sort'); });
        th.setAttribute('data-sort', desc ? 'desc' : 'asc');
        rows.sort(function (a, b) {
          var x = key(a.children[col]), y = key(b.children[col]);
          var r = (typeof x === 'number' && typeof y === 'number') ? x - y
                                                                   : String(x).localeCompare(String(y));
          return desc ? -r : r;
        });
        rows.forEach(function (r) { r.parentNode.appendChild(r); });
      });
    });
  });
  var charts = document.querySelectorAll('svg.chart');
  var drawn = 0;
  charts.forEach(function (svg) {
    var box = svg.getBoundingClientRect();
    var visible = 0;
    svg.querySelectorAll('rect').forEach(function (m) {
      var b = m.getBoundingClientRect();
      if (b.width > 0 && b.height > 0) visible++;
    });
    if (box.width > 0 && box.height > 0 && visible > 0) drawn++;
  });
  document.body.setAttribute('data-charts', String(charts.length));
  document.body.setAttribute('data-charts-drawn', String(drawn));
  document.body.setAttribute('data-rendered', charts.length > 0 && drawn === charts.length ? '1' : '0');
})();
)JS";

}  // namespace

std::string report_html(const ProfileResult& r, const ValidationResult* validation) {
  const Schedule& s = r.schedule;
  const WhatIfResult& w = r.what_if;
  std::ostringstream os;
  os << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
     << "<title>esplag profile</title>\n<style>\n"
     << "body{font-family:sans-serif;margin:24px;color:#222}\n"
     << "h1{font-size:22px}h2{font-size:17px;margin-top:28px}\n"
     << "table{border-collapse:collapse;font-size:13px}\n"
     << "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}\n"
     << "td.n{text-align:right;font-variant-numeric:tabular-nums}\n"
     << "svg.chart{font-size:12px;display:block}\n"
     << "h3{font-size:15px;margin-top:18px}th[data-sort]{background:#eef}\n"
     << ".legend{font-size:12px}.sw{display:inline-block;width:10px;height:10px;"
        "margin:0 4px 0 10px}\n"
     << "</style>\n</head>\n<body>\n<h1>esplag profile</h1>\n";

  // Summary.
  os << "<h2 id=\"summary\">Summary</h2>\n<table>\n";
  auto row = [&](const std::string& k, const std::string& v) {
    os << "<tr><th>" << html_escape(k) << "</th><td class=\"n\">" << html_escape(v)
       << "</td></tr>\n";
  };
  row("measured step time (wall)", format_ns(r.measured_wall_ns));
  row("modelled step time (critical path)", format_ns(s.makespan_ns));
  row("ops on the critical path", std::to_string(s.critical_path.size()) + " of " +
                                      std::to_string(r.graph.size()));
  row("time in ops on the critical path", format_ns(s.critical_op_ns));
  row("untraced time on the critical path", format_ns(s.makespan_ns - s.critical_op_ns));
  row("op time summed over all ops", format_ns(r.op_time_ns));
  row("streams", std::to_string(r.streams));
  if (r.comm_ns > 0)
    row("collectives (comm): time / exposed", format_ns(r.comm_ns) + " / " + format_ns(r.comm_exposed_ns) + " (" +
                                                  fmt_pct(r.comm_ns - r.comm_exposed_ns, r.comm_ns) + " hidden)");
  if (!r.records.empty()) row("recorded ops (incl. enclosing)", std::to_string(r.records.size()));
  if (!w.specs.empty())
    row("what-if predicted step time",
        format_ns(w.predicted_ns) + " (" + fmt_speedup(w.baseline_ns, w.predicted_ns) + ")");
  if (validation != nullptr)
    row("validation: sparse step predicted / measured",
        format_ns(validation->predicted_ns) + " / " + format_ns(validation->measured_ns) + " (" +
            fmt_error_pct(validation->error_pct()) + ")");
  os << "</table>\n";
  if (validation != nullptr) os << validation_html(*validation);

  // Time by category.
  os << "<h2 id=\"categories\">Time by category</h2>\n<p>Light bar: summed op time; dark part: time on the "
        "critical path.</p>\n";
  {
    std::vector<Bar> bars;
    for (const auto& c : r.by_category)
      bars.push_back(Bar{std::string(op_category_name(c.category)), c.total_ns, c.critical_ns,
                         category_color(c.category),
                         format_ns(c.total_ns) + " (" + fmt_pct(c.total_ns, r.op_time_ns) +
                             "), critical path " + fmt_pct(c.critical_ns, s.makespan_ns)});
    os << bar_chart(bars, 140);
  }

  // Time by layer.
  os << "<h2 id=\"layers\">Time by layer</h2>\n";
  {
    std::vector<Bar> bars;
    for (const auto& l : r.by_layer)
      bars.push_back(Bar{layer_label(l.layer), l.total_ns, l.critical_ns, "#4e79a7",
                         format_ns(l.total_ns) + " (" + fmt_pct(l.total_ns, r.op_time_ns) +
                             "), " + std::to_string(l.ops) + " ops"});
    os << bar_chart(bars, 140);
  }

  // Timeline.
  os << "<h2 id=\"timeline\">Timeline</h2>\n" << legend_html() << timeline_svg(r);

  // What-if.
  os << "<h2 id=\"what-if\">What-if</h2>\n";
  if (w.specs.empty()) {
    os << "<p>No what-if specs were given.</p>\n";
  } else {
    std::vector<Bar> bars;
    bars.push_back(Bar{"baseline (modelled)", w.baseline_ns, -1, "#8c8c8c",
                       format_ns(w.baseline_ns)});
    for (const auto& p : w.per_spec) {
      const std::string pattern = p.spec.substr(0, p.spec.rfind('='));
      bars.push_back(Bar{p.spec, p.predicted_alone_ns, -1, "#4e79a7",
                         format_ns(p.predicted_alone_ns) + " (" +
                             fmt_speedup(w.baseline_ns, p.predicted_alone_ns) + ")"});
      bars.push_back(Bar{pattern + " free", p.amdahl_bound_ns, -1, "#59a14f",
                         format_ns(p.amdahl_bound_ns) + " (" +
                             fmt_speedup(w.baseline_ns, p.amdahl_bound_ns) +
                             ", Amdahl bound)"});
    }
    bars.push_back(Bar{"all specs", w.predicted_ns, -1, kCriticalColor,
                       format_ns(w.predicted_ns) + " (" +
                           fmt_speedup(w.baseline_ns, w.predicted_ns) + ")"});
    os << bar_chart(bars);
    os << "<table>\n<tr><th>spec</th><th>ops matched</th><th>ops decided</th><th>matched "
          "time</th><th>on critical path</th><th>predicted alone</th><th>if free</th></tr>\n";
    for (const auto& p : w.per_spec)
      os << "<tr><td>" << html_escape(p.spec) << "</td><td class=\"n\">" << p.matched_ops
         << "</td><td class=\"n\">" << p.applied_ops << "</td><td class=\"n\">"
         << format_ns(p.matched_ns) << "</td><td class=\"n\">" << format_ns(p.matched_critical_ns)
         << "</td><td class=\"n\">" << format_ns(p.predicted_alone_ns) << " ("
         << fmt_speedup(w.baseline_ns, p.predicted_alone_ns) << ")</td><td class=\"n\">"
         << format_ns(p.amdahl_bound_ns) << " (" << fmt_speedup(w.baseline_ns, p.amdahl_bound_ns)
         << ")</td></tr>\n";
    os << "</table>\n<p>With several specs, the first that matches an op decides its "
          "factor (ops decided).</p>\n";
  }

  // Top ops.
  os << "<h2 id=\"ops\">Longest ops</h2>\n<table class=\"sortable\">\n<tr><th>op</th><th>category</th><th>layer</th>"
        "<th>stream</th><th>duration</th><th>slack</th><th>critical</th></tr>\n";
  std::vector<int> ids(r.graph.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) {
    return r.graph.nodes()[a].duration_ns > r.graph.nodes()[b].duration_ns;
  });
  if (ids.size() > 30) ids.resize(30);
  for (int i : ids) {
    const GraphNode& n = r.graph.nodes()[i];
    os << "<tr><td>" << html_escape(n.name) << "</td><td>" << op_category_name(n.category)
       << "</td>" << num_td(n.layer, std::to_string(n.layer)) << num_td(n.stream, std::to_string(n.stream))
       << num_td(n.duration_ns, format_ns(n.duration_ns)) << num_td(s.slack[i], format_ns(s.slack[i]))
       << "<td>" << (s.on_critical_path[i] ? "yes" : "") << "</td></tr>\n";
  }
  os << "</table>\n<script>" << kScript << "</script>\n</body>\n</html>\n";
  return os.str();
}

// ---------------------------------------------------------------------------------------

void write_text_file(const std::string& path, const std::string& text) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) {
    fs::create_directories(p.parent_path(), ec);
    if (ec) fail("cannot create directory '", p.parent_path().string(), "': ", ec.message());
  }
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  if (!out) fail("cannot open '", p.string(), "' for writing");
  out << text;
  out.close();
  if (!out) fail("error writing '", p.string(), "'");
}

void write_reports(const std::string& dir, const ProfileResult& result,
                   const ValidationResult* validation) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("write_reports: cannot create directory '", dir, "': ", ec.message());
  auto write = [&](const char* file, const std::string& text) {
    try {
      write_text_file((fs::path(dir) / file).string(), text);
    } catch (const Error& e) {
      fail("write_reports: ", e.what());
    }
  };
  write("trace.json", trace_json(result));
  write("ops.csv", ops_csv(result));
  write("report.html", report_html(result, validation));
}

}  // namespace esplag
