#include <gtest/gtest.h>

#include <numeric>

#include "core/error.h"
#include "profile/graph.h"

using namespace esplag;

namespace {

// The textbook example: A -> {B, C} -> D -> E, plus F unconnected.
//   A 3, B 2, C 5, D 4, E 1, F 2   => ES A0 B3 C3 D8 E12 F0, makespan 13,
//   critical path A C D E, slack B 3, F 11, others 0.
struct Diamond {
  OpGraph g;
  int a, b, c, d, e, f;
  Diamond() {
    a = g.add_node("A", 3);
    b = g.add_node("B", 2);
    c = g.add_node("C", 5);
    d = g.add_node("D", 4);
    e = g.add_node("E", 1);
    f = g.add_node("F", 2);
    g.add_edge(a, b);
    g.add_edge(a, c);
    g.add_edge(b, d);
    g.add_edge(c, d);
    g.add_edge(d, e);
  }
};

OpRecord rec(std::string name, int64_t start, int64_t end, std::vector<const void*> in = {},
             std::vector<const void*> out = {}, int stream = 0) {
  OpRecord r;
  r.name = std::move(name);
  r.start_ns = start;
  r.end_ns = end;
  r.inputs = std::move(in);
  r.outputs = std::move(out);
  r.stream = stream;
  return r;
}

}  // namespace

TEST(OpGraph, CriticalPathAndSlackOnAHandBuiltGraph) {
  Diamond t;
  const Schedule s = t.g.schedule();
  EXPECT_DOUBLE_EQ(s.makespan_ns, 13);
  const double es[] = {0, 3, 3, 8, 12, 0};
  const double ef[] = {3, 5, 8, 12, 13, 2};
  const double slack[] = {0, 3, 0, 0, 0, 11};
  for (int i = 0; i < 6; ++i) {
    EXPECT_DOUBLE_EQ(s.earliest_start[i], es[i]) << t.g.node(i).name;
    EXPECT_DOUBLE_EQ(s.earliest_finish[i], ef[i]) << t.g.node(i).name;
    EXPECT_DOUBLE_EQ(s.slack[i], slack[i]) << t.g.node(i).name;
    EXPECT_DOUBLE_EQ(s.latest_start[i], es[i] + slack[i]) << t.g.node(i).name;
  }
  EXPECT_EQ(s.critical_path, (std::vector<int>{t.a, t.c, t.d, t.e}));
  EXPECT_EQ(s.on_critical_path, (std::vector<char>{1, 0, 1, 1, 1, 0}));
  EXPECT_DOUBLE_EQ(s.critical_op_ns, 13);
  EXPECT_DOUBLE_EQ(s.critical_delay_ns, 0);
  // A hand-built graph has no measurement: its "measured" wall is the makespan.
  EXPECT_DOUBLE_EQ(t.g.measured_wall_ns(), 13);
}

TEST(OpGraph, ParallelStreamsFollowTheCriticalPathNotTheSum) {
  // stream 0: a1 -> a2 -> a3 (4 each); stream 1: b1 -> b2 (5 each); a3 needs b2's output.
  OpGraph g;
  const int a1 = g.add_node("a1", 4, OpCategory::dense_gemm, 0);
  const int a2 = g.add_node("a2", 4, OpCategory::dense_gemm, 0);
  const int b1 = g.add_node("b1", 5, OpCategory::comm, 1);
  const int b2 = g.add_node("b2", 5, OpCategory::comm, 1);
  const int a3 = g.add_node("a3", 4, OpCategory::dense_gemm, 0);
  g.add_edge(a1, a2, kEdgeStream);
  g.add_edge(a2, a3, kEdgeStream);
  g.add_edge(b1, b2, kEdgeStream);
  g.add_edge(b2, a3, kEdgeRaw);
  const Schedule s = g.schedule();
  double sum = 0;
  for (const auto& n : g.nodes()) sum += n.duration_ns;
  EXPECT_DOUBLE_EQ(sum, 22);  // what a sum of op times would claim
  EXPECT_DOUBLE_EQ(s.makespan_ns, 14);
  EXPECT_EQ(s.critical_path, (std::vector<int>{b1, b2, a3}));
  EXPECT_DOUBLE_EQ(s.earliest_start[a3], 10);
  EXPECT_DOUBLE_EQ(s.slack[a1], 2);
  EXPECT_DOUBLE_EQ(s.slack[a2], 2);
  EXPECT_DOUBLE_EQ(s.slack[b1], 0);
  EXPECT_DOUBLE_EQ(s.slack[b2], 0);

  // Other durations, same graph: b's twice as fast moves the path onto stream 0.
  std::vector<double> d = {4, 4, 2.5, 2.5, 4};
  const Schedule t = g.schedule(d);
  EXPECT_DOUBLE_EQ(t.makespan_ns, 12);
  EXPECT_EQ(t.critical_path, (std::vector<int>{a1, a2, a3}));
  EXPECT_DOUBLE_EQ(t.slack[b2], 3);
}

TEST(OpGraph, EdgesValidateAndMerge) {
  OpGraph g;
  const int x = g.add_node("x", 1);
  const int y = g.add_node("y", 1);
  g.add_edge(x, y, kEdgeRaw);
  g.add_edge(x, y, kEdgeStream);
  EXPECT_EQ(g.edges().size(), 1u);
  EXPECT_EQ(g.edge_kinds(x, y), kEdgeRaw | kEdgeStream);
  EXPECT_EQ(g.edge_kinds(y, x), 0);
  EXPECT_THROW(g.add_edge(x, x), Error);
  EXPECT_THROW(g.add_edge(x, 7), Error);
  EXPECT_THROW(g.add_node("neg", -1), Error);
  EXPECT_THROW(g.schedule(std::vector<double>{1}), Error);           // wrong count
  EXPECT_THROW(g.schedule(std::vector<double>{1, -2}), Error);       // negative
}

TEST(OpGraph, CycleIsReportedWithAnOpName) {
  OpGraph g;
  const int p = g.add_node("p", 1);
  const int q = g.add_node("q.cyclic", 1);
  const int r = g.add_node("r.cyclic", 1);
  g.add_edge(p, q);
  g.add_edge(q, r);
  g.add_edge(r, q);
  try {
    g.schedule();
    FAIL() << "a cycle must throw";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cycle"), std::string::npos) << m;
    EXPECT_NE(m.find(".cyclic"), std::string::npos) << m;
  }
}

TEST(OpGraph, TopologicalOrderOfAHandBuiltGraph) {
  OpGraph g;
  const int late = g.add_node("late", 1);
  const int early = g.add_node("early", 1);
  g.add_edge(early, late);
  EXPECT_EQ(g.topological_order(), (std::vector<int>{early, late}));
  const Schedule s = g.schedule();
  EXPECT_EQ(s.critical_path, (std::vector<int>{early, late}));
  EXPECT_DOUBLE_EQ(s.earliest_start[late], 1);
}

TEST(OpGraph, DependenciesFromBufferIdentities) {
  // Each op on its own stream except where stream order is under test, so the edges
  // below come from the buffers alone.
  int X, Y, Z, W;
  std::vector<OpRecord> r = {
      rec("w0", 0, 1, {}, {&X}, 0),          // 0 writes X
      rec("r1", 1, 2, {&X}, {&Y}, 1),        // 1 reads X (RAW on 0), writes Y
      rec("r2", 2, 3, {&X}, {&Z}, 2),        // 2 reads X (RAW on 0), writes Z
      rec("w3", 3, 4, {}, {&X}, 3),          // 3 writes X: WAW on 0, WAR on 1 and 2
      rec("r4", 4, 5, {&Y, &X}, {}, 3),      // 4 RAW on 1 (Y), RAW on 3 (X) + stream on 3
      rec("acc5", 5, 6, {&Z}, {&Z}, 2),      // 5 in place on Z: RAW+WAW on 2, stream on 2
      rec("w6", 6, 7, {&W}, {}, 0),          // 6 reads a never-written buffer; stream on 0
      rec("w7", 7, 8, {}, {&Z}, 4),          // 7 writes Z: WAW on 5; WAR none (5 wrote Z)
  };
  const OpGraph g = OpGraph::from_records(r);
  ASSERT_EQ(g.size(), 8);
  std::vector<std::tuple<int, int, int>> got;
  for (const auto& e : g.edges()) got.emplace_back(e.from, e.to, e.kinds);
  std::sort(got.begin(), got.end());
  const std::vector<std::tuple<int, int, int>> want = {
      {0, 1, kEdgeRaw},
      {0, 2, kEdgeRaw},
      {0, 3, kEdgeWaw},
      {0, 6, kEdgeStream},
      {1, 3, kEdgeWar},
      {1, 4, kEdgeRaw},
      {2, 3, kEdgeWar},
      {2, 5, kEdgeRaw | kEdgeWaw | kEdgeStream},
      {3, 4, kEdgeRaw | kEdgeStream},
      {5, 7, kEdgeWaw},
  };
  EXPECT_EQ(got, want);
}

TEST(OpGraph, OpsRunBySameHostThreadAreOrdered) {
  // Synchronous ops of one host thread on two stream labels: the thread orders them.
  std::vector<OpRecord> r = {rec("gemm", 0, 10, {}, {}, 0), rec("comm", 10, 15, {}, {}, 1),
                             rec("next", 15, 20, {}, {}, 0), rec("async", 0, 5, {}, {}, 2)};
  r[0].thread = r[1].thread = r[2].thread = 0;  // "async" keeps thread -1
  const OpGraph g = OpGraph::from_records(r);
  EXPECT_EQ(g.edge_kinds(0, 1), kEdgeHost);
  EXPECT_EQ(g.edge_kinds(1, 2), kEdgeHost);
  EXPECT_EQ(g.edge_kinds(0, 2), kEdgeStream);
  EXPECT_EQ(g.edge_kinds(2, 3), 0);
  EXPECT_EQ(g.in_edges(3).size(), 0u);
  EXPECT_DOUBLE_EQ(g.node(2).delay_ns, 0);  // it waited for "comm", not for nothing
  EXPECT_EQ(g.schedule().critical_path, (std::vector<int>{0, 1, 2}));
  // Without a thread the wait for "comm" would be taken as untraced time.
  for (auto& op : r) op.thread = -1;
  const OpGraph h = OpGraph::from_records(r);
  EXPECT_EQ(h.edge_kinds(0, 1), 0);
  EXPECT_DOUBLE_EQ(h.node(2).delay_ns, 5);
}

TEST(OpGraph, FromRecordsUsesLeafOpsAndKeepsUntracedTime) {
  // One stream: a parent op [0, 50] around three leaves with a 5 ns gap before the
  // second and 10 ns of parent time after the last.
  std::vector<OpRecord> r = {rec("step", 1000, 1050), rec("op0", 1000, 1010),
                             rec("op1", 1015, 1025), rec("op2", 1025, 1040)};
  r[0].leaf = false;
  for (int i = 1; i < 4; ++i) {
    r[i].depth = 1;
    r[i].parent = 0;
  }
  const OpGraph g = OpGraph::from_records(r);
  ASSERT_EQ(g.size(), 3);
  EXPECT_EQ(g.node(0).name, "op0");
  EXPECT_EQ(g.node(0).record, 1);
  EXPECT_DOUBLE_EQ(g.node(1).measured_start_ns, 15);
  EXPECT_DOUBLE_EQ(g.node(1).delay_ns, 5);
  EXPECT_DOUBLE_EQ(g.node(2).delay_ns, 0);
  EXPECT_DOUBLE_EQ(g.tail_ns(), 10);
  EXPECT_DOUBLE_EQ(g.measured_wall_ns(), 50);
  const Schedule s = g.schedule();
  // With measured durations the schedule reproduces the measurement.
  EXPECT_DOUBLE_EQ(s.makespan_ns, 50);
  for (int i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(s.earliest_start[i], g.node(i).measured_start_ns);
  EXPECT_DOUBLE_EQ(s.critical_op_ns, 35);
  EXPECT_DOUBLE_EQ(s.critical_delay_ns, 5);

  GraphOptions packed;
  packed.keep_untraced_time = false;
  const OpGraph p = OpGraph::from_records(r, packed);
  EXPECT_DOUBLE_EQ(p.schedule().makespan_ns, 35);
  EXPECT_DOUBLE_EQ(p.measured_wall_ns(), 50);
}

TEST(OpGraph, WaitingOnAnotherStreamIsNotUntracedTime) {
  int A;
  // a on stream 0 [0,10]; b on stream 1 [0,4]; c on stream 1 reads a's output, starts at
  // 12: it waited for a (until 10), then 2 ns of launch delay.
  std::vector<OpRecord> r = {rec("a", 0, 10, {}, {&A}, 0), rec("b", 0, 4, {}, {}, 1),
                             rec("c", 12, 20, {&A}, {}, 1)};
  const OpGraph g = OpGraph::from_records(r);
  EXPECT_DOUBLE_EQ(g.node(2).delay_ns, 2);
  const Schedule s = g.schedule();
  EXPECT_DOUBLE_EQ(s.makespan_ns, 20);
  EXPECT_EQ(s.critical_path, (std::vector<int>{0, 2}));
  // b must finish 2 ns (c's delay) before c's latest start of 12: slack 10 - 4 = 6.
  EXPECT_DOUBLE_EQ(s.slack[1], 6);
  // Halving a moves c earlier by 5: the wait shrinks, the launch delay stays.
  const Schedule h = g.schedule(std::vector<double>{5, 4, 8});
  EXPECT_DOUBLE_EQ(h.makespan_ns, 15);
}

TEST(OpGraph, FromRecordsRejectsAnOpenOp) {
  std::vector<OpRecord> r = {rec("fine", 0, 5), rec("never.closed", 6, 5)};
  try {
    OpGraph::from_records(r);
    FAIL() << "an open op must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("never.closed"), std::string::npos) << e.what();
  }
  const OpGraph empty = OpGraph::from_records({});
  EXPECT_EQ(empty.size(), 0);
  EXPECT_DOUBLE_EQ(empty.schedule().makespan_ns, 0);
  EXPECT_TRUE(empty.schedule().critical_path.empty());
}
