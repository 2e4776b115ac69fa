// Reports of a ProfileResult:
//   trace.json   Chrome trace event format (loads in Perfetto / chrome://tracing)
//   ops.csv      one row per (leaf) op
//   report.html  self-contained page (inline SVG and CSS, no scripts, no network)
// and a short plain-text summary for the terminal.
#pragma once
#include <string>

#include "profile/analysis.h"

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

std::string report_html(const ProfileResult& result);

// A few lines: step time, critical path, top categories with their share, what-if.
std::string summary_text(const ProfileResult& result, int top_categories = 5);

// Creates `dir` (and parents) and writes trace.json, ops.csv and report.html into it.
void write_reports(const std::string& dir, const ProfileResult& result);

}  // namespace esplag
