// Dependency graph of the ops of a profiled window and its schedule: earliest start and
// finish of every op when each op starts as soon as all its predecessors have finished,
// the critical path and per-op slack.
//
// Graphs come from recorded ops (OpGraph::from_records) or are built by hand (add_node,
// add_edge). From records, only leaf ops (ops with no op opened inside them) become
// nodes: leaves are the kernels whose speed a what-if changes, and the enclosing ops
// only group them. Edges, always from an earlier-opened op to a later one:
//   - read after write:  an op reading buffer b depends on the last op that wrote b;
//   - write after read:  an op writing b depends on every op that read b since b's last
//                        write;
//   - write after write: an op writing b depends on the last op that wrote b;
//   - stream order:      consecutive ops of one stream;
//   - host order:        consecutive ops run synchronously by one host thread
//                        (OpRecord::thread >= 0, as the CPU recorder marks them), since
//                        such an op cannot start before the thread finished the last one,
//                        whatever stream it was labelled with.
// Time that no leaf op accounts for (host work between ops, the self time of enclosing
// ops, waits) is kept as a per-op delay: the time between the moment an op's
// predecessors had all finished and the moment it started. With measured durations the
// schedule therefore reproduces the measured timeline, and a what-if changes op
// durations while the untraced time stays as measured.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/op_trace.h"

namespace esplag {

struct GraphNode {
  std::string name;
  OpCategory category = OpCategory::other;
  int layer = -1;
  int stream = 0;
  double duration_ns = 0;  // >= 0
  double delay_ns = 0;     // untraced time before the op may start (>= 0)
  // Measured start relative to the window's first timestamp; negative when unknown (a
  // hand-built node).
  double measured_start_ns = -1;
  double flops = 0;
  double bytes = 0;
  int64_t record = -1;  // index of the source OpRecord, -1 for a hand-built node
};

// Why an edge exists; an edge may have several reasons (a bit set).
enum EdgeKind : uint8_t {
  kEdgeManual = 1,
  kEdgeRaw = 2,     // read after write
  kEdgeWar = 4,     // write after read
  kEdgeWaw = 8,     // write after write
  kEdgeStream = 16, // stream order
  kEdgeHost = 32,   // host thread order
};

struct GraphEdge {
  int from = 0;
  int to = 0;
  uint8_t kinds = 0;
};

struct Schedule {
  std::vector<double> durations;  // the durations used (ns)
  std::vector<double> earliest_start;
  std::vector<double> earliest_finish;
  std::vector<double> latest_start;   // latest start that keeps the makespan
  std::vector<double> slack;          // latest_start - earliest_start (total float)
  std::vector<int> critical_path;     // node ids, first to last
  std::vector<char> on_critical_path; // 1 for the nodes of critical_path
  double makespan_ns = 0;             // predicted step time (includes the graph's tail)
  double critical_op_ns = 0;          // time in ops along the critical path
  double critical_delay_ns = 0;       // untraced time along the critical path
};

struct GraphOptions {
  // Keep untraced time as per-op delays (see the top of this file). When false, ops are
  // packed back to back and the prediction is the pure op-time critical path.
  bool keep_untraced_time = true;
};

class OpGraph {
 public:
  // Hand-built graphs. Durations are in ns by convention (any unit works if consistent).
  int add_node(GraphNode node);
  int add_node(std::string name, double duration_ns, OpCategory category = OpCategory::other,
               int stream = 0, int layer = -1);
  // Adds from -> to (or adds `kinds` to an existing edge). Throws on a self edge or an
  // unknown node id.
  void add_edge(int from, int to, uint8_t kinds = kEdgeManual);

  // The graph of the leaf ops in `records` (recording order). Throws Error for an op
  // that never closed (end_ns < start_ns).
  static OpGraph from_records(const std::vector<OpRecord>& records,
                              const GraphOptions& options = {});

  int size() const { return static_cast<int>(nodes_.size()); }
  const std::vector<GraphNode>& nodes() const { return nodes_; }
  const GraphNode& node(int id) const;
  const std::vector<GraphEdge>& edges() const { return edges_; }
  // Edge indices into edges(), sorted by the other end's id.
  const std::vector<int>& in_edges(int id) const;
  const std::vector<int>& out_edges(int id) const;
  // Whether from -> to is an edge; its kinds (0 when absent).
  uint8_t edge_kinds(int from, int to) const;

  // Measured wall time of the window (max end - min start over every record, enclosing
  // ops included); for a hand-built graph, the makespan of schedule().
  double measured_wall_ns() const;
  // Untraced time after the last leaf op finished (enclosing ops ending later).
  double tail_ns() const { return tail_ns_; }

  // Nodes in an order where every edge goes forward. Throws Error on a cycle, naming an
  // op on it.
  std::vector<int> topological_order() const;

  Schedule schedule() const;
  // Same graph with other durations (one per node, >= 0).
  Schedule schedule(std::span<const double> durations) const;

 private:
  std::vector<GraphNode> nodes_;
  std::vector<GraphEdge> edges_;
  std::vector<std::vector<int>> in_;
  std::vector<std::vector<int>> out_;
  double tail_ns_ = 0;
  double measured_wall_ns_ = -1;
};

}  // namespace esplag
