#include "profile/analysis.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

namespace esplag {

ProfileResult analyse(std::vector<OpRecord> records, const std::vector<WhatIfSpec>& specs,
                      const GraphOptions& options) {
  OpGraph graph = OpGraph::from_records(records, options);
  ProfileResult r = analyse(std::move(graph), specs);
  r.records = std::move(records);
  return r;
}

ProfileResult analyse(OpGraph graph, const std::vector<WhatIfSpec>& specs) {
  ProfileResult r;
  r.graph = std::move(graph);
  r.schedule = r.graph.schedule();
  r.what_if = what_if(r.graph, specs);
  r.measured_wall_ns = r.graph.measured_wall_ns();

  std::vector<CategoryTime> cats(kNumOpCategories);
  std::map<int, LayerTime> layers;
  std::set<int> streams;
  for (int i = 0; i < r.graph.size(); ++i) {
    const GraphNode& n = r.graph.nodes()[i];
    const double crit = r.schedule.on_critical_path[i] ? n.duration_ns : 0.0;
    CategoryTime& c = cats[static_cast<size_t>(n.category)];
    c.category = n.category;
    ++c.ops;
    c.total_ns += n.duration_ns;
    c.critical_ns += crit;
    LayerTime& l = layers[n.layer];
    l.layer = n.layer;
    ++l.ops;
    l.total_ns += n.duration_ns;
    l.critical_ns += crit;
    streams.insert(n.stream);
    r.op_time_ns += n.duration_ns;
  }
  for (const auto& c : cats)
    if (c.ops > 0) r.by_category.push_back(c);
  std::stable_sort(r.by_category.begin(), r.by_category.end(),
                   [](const CategoryTime& a, const CategoryTime& b) {
                     return a.total_ns > b.total_ns;
                   });
  const CategoryTime& comm = cats[static_cast<size_t>(OpCategory::comm)];
  if (comm.ops > 0) {
    r.comm_ns = comm.total_ns;
    r.comm_exposed_ns = r.schedule.makespan_ns - what_if(r.graph, {parse_what_if_spec("comm=inf")}).predicted_ns;
  }
  for (const auto& [id, l] : layers) r.by_layer.push_back(l);
  r.streams = static_cast<int>(streams.size());
  return r;
}

}  // namespace esplag
