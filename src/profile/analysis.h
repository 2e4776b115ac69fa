// Everything the profiler knows about one profiled window: the records, their graph and
// schedule, time breakdowns and the what-if predictions. Reports are written from this.
#pragma once
#include <vector>

#include "core/op_trace.h"
#include "profile/graph.h"
#include "profile/what_if.h"

namespace esplag {

struct CategoryTime {
  OpCategory category = OpCategory::other;
  int ops = 0;
  double total_ns = 0;     // summed op durations
  double critical_ns = 0;  // of which on the critical path
};

struct LayerTime {
  int layer = -1;  // -1: ops outside numbered layers
  int ops = 0;
  double total_ns = 0;
  double critical_ns = 0;
};

struct ProfileResult {
  std::vector<OpRecord> records;  // every recorded op, enclosing ones included
  OpGraph graph;                  // leaf ops
  Schedule schedule;              // measured durations
  WhatIfResult what_if;           // with no specs, predicted == baseline
  std::vector<CategoryTime> by_category;  // categories that have ops, most time first
  std::vector<LayerTime> by_layer;        // ascending layer id
  double measured_wall_ns = 0;            // max end - min start over the records
  double op_time_ns = 0;                  // sum of leaf op durations
  int streams = 0;                        // distinct streams among the ops
  // The collectives (category comm): their summed time, and how much of it the step pays,
  // the modelled step minus the step with them free (the rest overlaps other work).
  double comm_ns = 0;
  double comm_exposed_ns = 0;
};

// Builds the graph of `records` (see graph.h), schedules it and runs the what-if specs.
ProfileResult analyse(std::vector<OpRecord> records, const std::vector<WhatIfSpec>& specs = {},
                      const GraphOptions& options = {});
// The same for a hand-built graph (no records; measured wall = modelled step time).
ProfileResult analyse(OpGraph graph, const std::vector<WhatIfSpec>& specs = {});

}  // namespace esplag
