#include "profile/graph.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <unordered_map>
#include <utility>

#include "core/error.h"

namespace esplag {

int OpGraph::add_node(GraphNode node) {
  ESPLAG_CHECK(std::isfinite(node.duration_ns) && node.duration_ns >= 0,
               "OpGraph: op '", node.name, "' has duration ", node.duration_ns,
               " ns, expected a finite value >= 0");
  ESPLAG_CHECK(std::isfinite(node.delay_ns) && node.delay_ns >= 0, "OpGraph: op '",
               node.name, "' has delay ", node.delay_ns, " ns, expected a finite value >= 0");
  nodes_.push_back(std::move(node));
  in_.emplace_back();
  out_.emplace_back();
  return static_cast<int>(nodes_.size()) - 1;
}

int OpGraph::add_node(std::string name, double duration_ns, OpCategory category, int stream,
                      int layer) {
  GraphNode n;
  n.name = std::move(name);
  n.duration_ns = duration_ns;
  n.category = category;
  n.stream = stream;
  n.layer = layer;
  return add_node(std::move(n));
}

void OpGraph::add_edge(int from, int to, uint8_t kinds) {
  ESPLAG_CHECK(from >= 0 && from < size() && to >= 0 && to < size(), "OpGraph: edge ", from,
               " -> ", to, " names a node outside [0, ", size(), ")");
  ESPLAG_CHECK(from != to, "OpGraph: self edge on op '", nodes_[from].name, "' (node ", from,
               ")");
  for (int e : out_[from]) {
    if (edges_[e].to == to) {
      edges_[e].kinds |= kinds;
      return;
    }
  }
  const int e = static_cast<int>(edges_.size());
  edges_.push_back(GraphEdge{from, to, kinds});
  // Keep the adjacency lists sorted by the other end so traversals are deterministic.
  auto insert_sorted = [&](std::vector<int>& list, auto key) {
    auto it = std::lower_bound(list.begin(), list.end(), e,
                               [&](int a, int b) { return key(a) < key(b); });
    list.insert(it, e);
  };
  insert_sorted(out_[from], [&](int i) { return edges_[i].to; });
  insert_sorted(in_[to], [&](int i) { return edges_[i].from; });
}

const GraphNode& OpGraph::node(int id) const {
  ESPLAG_CHECK(id >= 0 && id < size(), "OpGraph: node ", id, " outside [0, ", size(), ")");
  return nodes_[id];
}

const std::vector<int>& OpGraph::in_edges(int id) const {
  node(id);
  return in_[id];
}

const std::vector<int>& OpGraph::out_edges(int id) const {
  node(id);
  return out_[id];
}

uint8_t OpGraph::edge_kinds(int from, int to) const {
  if (from < 0 || from >= size()) return 0;
  for (int e : out_[from])
    if (edges_[e].to == to) return edges_[e].kinds;
  return 0;
}

namespace {
struct BufferState {
  int last_writer = -1;
  std::vector<int> readers;  // since the last write
};
}  // namespace

OpGraph OpGraph::from_records(const std::vector<OpRecord>& records,
                              const GraphOptions& options) {
  OpGraph g;
  if (records.empty()) {
    g.measured_wall_ns_ = 0;
    return g;
  }
  int64_t t0 = std::numeric_limits<int64_t>::max();
  int64_t t1 = std::numeric_limits<int64_t>::min();
  for (size_t i = 0; i < records.size(); ++i) {
    const OpRecord& r = records[i];
    ESPLAG_CHECK(r.end_ns >= r.start_ns, "OpGraph: op '", r.name, "' (record ", i,
                 ") ends before it starts (start ", r.start_ns, " ns, end ", r.end_ns,
                 " ns); was it still open when the records were taken?");
    t0 = std::min(t0, r.start_ns);
    t1 = std::max(t1, r.end_ns);
  }

  std::unordered_map<const void*, BufferState> buffers;
  std::unordered_map<int, int> last_on_stream;
  std::unordered_map<int, int> last_on_thread;
  std::vector<std::pair<int, uint8_t>> preds;
  double last_leaf_end = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const OpRecord& r = records[i];
    if (!r.leaf) continue;
    GraphNode n;
    n.name = r.name;
    n.category = r.category;
    n.layer = r.layer;
    n.stream = r.stream;
    n.duration_ns = static_cast<double>(r.end_ns - r.start_ns);
    n.measured_start_ns = static_cast<double>(r.start_ns - t0);
    n.flops = r.flops;
    n.bytes = r.bytes;
    n.record = static_cast<int64_t>(i);
    const int id = g.add_node(std::move(n));

    preds.clear();
    for (const void* b : r.inputs) {
      auto it = buffers.find(b);
      if (it != buffers.end() && it->second.last_writer >= 0)
        preds.emplace_back(it->second.last_writer, kEdgeRaw);
    }
    for (const void* b : r.outputs) {
      auto it = buffers.find(b);
      if (it == buffers.end()) continue;
      if (it->second.last_writer >= 0) preds.emplace_back(it->second.last_writer, kEdgeWaw);
      for (int reader : it->second.readers)
        if (reader != id) preds.emplace_back(reader, kEdgeWar);
    }
    auto s = last_on_stream.find(r.stream);
    if (s != last_on_stream.end()) preds.emplace_back(s->second, kEdgeStream);
    last_on_stream[r.stream] = id;
    if (r.thread >= 0) {
      auto t = last_on_thread.find(r.thread);
      if (t != last_on_thread.end()) preds.emplace_back(t->second, kEdgeHost);
      last_on_thread[r.thread] = id;
    }

    for (const void* b : r.inputs) {
      auto& readers = buffers[b].readers;
      if (readers.empty() || readers.back() != id) readers.push_back(id);
    }
    for (const void* b : r.outputs) {
      BufferState& st = buffers[b];
      st.last_writer = id;
      st.readers.clear();
    }

    std::sort(preds.begin(), preds.end());
    double ready = 0;
    for (size_t k = 0; k < preds.size(); ++k) {
      uint8_t kinds = preds[k].second;
      while (k + 1 < preds.size() && preds[k + 1].first == preds[k].first)
        kinds |= preds[++k].second;
      g.add_edge(preds[k].first, id, kinds);
      const GraphNode& p = g.nodes_[preds[k].first];
      ready = std::max(ready, p.measured_start_ns + p.duration_ns);
    }
    GraphNode& self = g.nodes_[id];
    if (options.keep_untraced_time)
      self.delay_ns = std::max(0.0, self.measured_start_ns - ready);
    last_leaf_end = std::max(last_leaf_end, self.measured_start_ns + self.duration_ns);
  }
  g.measured_wall_ns_ = static_cast<double>(t1 - t0);
  if (options.keep_untraced_time) g.tail_ns_ = std::max(0.0, g.measured_wall_ns_ - last_leaf_end);
  return g;
}

double OpGraph::measured_wall_ns() const {
  if (measured_wall_ns_ >= 0) return measured_wall_ns_;
  return schedule().makespan_ns;
}

std::vector<int> OpGraph::topological_order() const {
  const int n = size();
  std::vector<int> indegree(n);
  for (int i = 0; i < n; ++i) indegree[i] = static_cast<int>(in_[i].size());
  // Smallest ready id first: recorded graphs (edges point to larger ids) come out in id
  // order, and hand-built ones in a deterministic order.
  std::vector<int> ready;
  for (int i = 0; i < n; ++i)
    if (indegree[i] == 0) ready.push_back(i);
  std::make_heap(ready.begin(), ready.end(), std::greater<int>());
  std::vector<int> order;
  order.reserve(n);
  while (!ready.empty()) {
    std::pop_heap(ready.begin(), ready.end(), std::greater<int>());
    const int v = ready.back();
    ready.pop_back();
    order.push_back(v);
    for (int e : out_[v]) {
      const int w = edges_[e].to;
      if (--indegree[w] == 0) {
        ready.push_back(w);
        std::push_heap(ready.begin(), ready.end(), std::greater<int>());
      }
    }
  }
  if (static_cast<int>(order.size()) != n) {
    int on_cycle = -1;
    for (int i = 0; i < n && on_cycle < 0; ++i)
      if (indegree[i] > 0) on_cycle = i;
    fail("OpGraph: the dependency edges form a cycle (", n - static_cast<int>(order.size()),
         " ops never become ready; one of them is '", nodes_[on_cycle].name, "', node ",
         on_cycle, ")");
  }
  return order;
}

Schedule OpGraph::schedule() const {
  std::vector<double> d(nodes_.size());
  for (size_t i = 0; i < nodes_.size(); ++i) d[i] = nodes_[i].duration_ns;
  return schedule(d);
}

Schedule OpGraph::schedule(std::span<const double> durations) const {
  const int n = size();
  ESPLAG_CHECK(static_cast<int>(durations.size()) == n, "OpGraph::schedule: got ",
               durations.size(), " durations for a graph of ", n, " ops");
  for (int i = 0; i < n; ++i)
    ESPLAG_CHECK(std::isfinite(durations[i]) && durations[i] >= 0, "OpGraph::schedule: op '",
                 nodes_[i].name, "' gets duration ", durations[i],
                 ", expected a finite value >= 0");
  Schedule s;
  s.durations.assign(durations.begin(), durations.end());
  s.earliest_start.assign(n, 0);
  s.earliest_finish.assign(n, 0);
  s.latest_start.assign(n, 0);
  s.slack.assign(n, 0);
  s.on_critical_path.assign(n, 0);
  const std::vector<int> order = topological_order();

  double end = 0;
  for (int v : order) {
    double ready = 0;
    for (int e : in_[v]) ready = std::max(ready, s.earliest_finish[edges_[e].from]);
    s.earliest_start[v] = ready + nodes_[v].delay_ns;
    s.earliest_finish[v] = s.earliest_start[v] + durations[v];
    end = std::max(end, s.earliest_finish[v]);
  }
  s.makespan_ns = end + tail_ns_;

  std::vector<double> latest_finish(n, end);
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const int v = *it;
    for (int e : out_[v]) {
      const int w = edges_[e].to;
      latest_finish[v] = std::min(latest_finish[v], s.latest_start[w] - nodes_[w].delay_ns);
    }
    s.latest_start[v] = latest_finish[v] - durations[v];
    double slack = s.latest_start[v] - s.earliest_start[v];
    // Sums taken in different orders differ in the last bits; that is not slack.
    if (std::abs(slack) <= 1e-9 * std::max(1.0, end)) slack = 0;
    s.slack[v] = std::max(0.0, slack);
  }

  if (n > 0) {
    // The path ends at the op that finishes last and walks back through the predecessor
    // that finished last (ties: smallest id), which is the one the op waited for.
    int v = 0;
    for (int i = 1; i < n; ++i)
      if (s.earliest_finish[i] > s.earliest_finish[v]) v = i;
    while (true) {
      s.critical_path.push_back(v);
      s.on_critical_path[v] = 1;
      s.critical_op_ns += durations[v];
      s.critical_delay_ns += nodes_[v].delay_ns;
      int best = -1;
      for (int e : in_[v]) {
        const int p = edges_[e].from;
        if (best < 0 || s.earliest_finish[p] > s.earliest_finish[best]) best = p;
      }
      if (best < 0) break;
      v = best;
    }
    std::reverse(s.critical_path.begin(), s.critical_path.end());
  }
  return s;
}

}  // namespace esplag
