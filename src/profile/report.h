// Reports of a ProfileResult:
//   trace.json   Chrome trace event format (loads in Perfetto / chrome://tracing)
//   ops.csv      one row per (leaf) op
//   report.html  self-contained page (inline SVG, CSS and one small script; no network)
// and a short plain-text summary for the terminal. With a validation (validate.h) the page
// gains a section comparing the predicted and the measured sparse step.
#pragma once
#include <string>

#include "profile/analysis.h"
#include "profile/validate.h"

namespace esplag {

// Chrome trace JSON. Process 1 ("measured") has one thread per stream with every recorded
// op (enclosing ones included) as an "X" event, ts/dur in microseconds from the first
// record, args {category, layer, flops, bytes, depth, leaf, critical_path, slack_us}, and
// one more thread, "critical path", repeating the ops of the critical path. With what-if
// specs, process 2 ("what-if predicted") holds the predicted schedule of the leaf ops.
std::string trace_json(const ProfileResult& result);

// Header: name,category,layer,stream,start_us,dur_us,flops,bytes,on_critical_path,slack_us
// then one row per graph node in recording order (start_us: measured start from the first
// record, or the scheduled start for a hand-built graph).
std::string ops_csv(const ProfileResult& result);

// The page's script makes tables sortable and, once it has checked that every chart drew
// at least one visible mark, sets data-rendered="1" on <body> ("0" if a chart is empty):
// a headless browser can tell from the DOM that the page rendered and its script ran.
std::string report_html(const ProfileResult& result, const ValidationResult* validation = nullptr);

// A few lines: step time, critical path, top categories with their share, what-if.
std::string summary_text(const ProfileResult& result, int top_categories = 5);

// Creates `dir` (and parents) and writes trace.json, ops.csv and report.html into it.
void write_reports(const std::string& dir, const ProfileResult& result,
                   const ValidationResult* validation = nullptr);

// Writes `text` to `path` (creating its directory), throwing Error on failure.
void write_text_file(const std::string& path, const std::string& text);

}  // namespace esplag
