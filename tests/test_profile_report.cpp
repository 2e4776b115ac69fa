#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "profile/profiler.h"

using namespace esplag;
using nlohmann::json;

namespace {

OpRecord rec(std::string name, OpCategory cat, int layer, int stream, int64_t start,
             int64_t end, std::vector<const void*> in = {}, std::vector<const void*> out = {}) {
  OpRecord r;
  r.name = std::move(name);
  r.category = cat;
  r.layer = layer;
  r.stream = stream;
  r.start_ns = start;
  r.end_ns = end;
  r.inputs = std::move(in);
  r.outputs = std::move(out);
  return r;
}

// A window starting at t = 1 ms (so timestamps are relative to it):
//   "step"            [0, 100 us]  encloses everything (not a leaf)
//   s0 "fc<1>,fwd"    [0, 30]  dense_gemm, layer 0, 2e9 flops, writes Y
//   s1 "allreduce"    [0, 50]  comm, layer -1
//   s0 "gelu"         [30, 40] elementwise, layer 0, reads Y
//   s0 "loss"         [55, 90] loss, reads the allreduce output and gelu's
// Critical path: allreduce (50) -> loss (starts 55: 5 us delay) -> 10 us tail = 100.
struct Window {
  int Y, G, R;
  std::vector<OpRecord> records;
  Window() {
    const int64_t t0 = 1'000'000, us = 1000;
    records = {rec("step", OpCategory::other, -1, 0, t0, t0 + 100 * us),
               rec("fc<1>,fwd", OpCategory::dense_gemm, 0, 0, t0, t0 + 30 * us, {}, {&Y}),
               rec("allreduce", OpCategory::comm, -1, 1, t0, t0 + 50 * us, {}, {&R}),
               rec("gelu", OpCategory::elementwise, 0, 0, t0 + 30 * us, t0 + 40 * us, {&Y}, {&G}),
               rec("loss", OpCategory::loss, -1, 0, t0 + 55 * us, t0 + 90 * us, {&R, &G}, {})};
    records[0].leaf = false;
    records[1].flops = 2e9;
    records[1].bytes = 4096;
    for (int i = 1; i < 5; ++i) {
      records[i].depth = 1;
      records[i].parent = 0;
    }
  }
};

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  std::string line;
  while (std::getline(is, line)) out.push_back(line);
  return out;
}

}  // namespace

TEST(ProfileAnalysis, BreakdownsAndCriticalPath) {
  Window w;
  const ProfileResult r = analyse(w.records);
  ASSERT_EQ(r.graph.size(), 4);
  EXPECT_DOUBLE_EQ(r.measured_wall_ns, 100'000);
  EXPECT_DOUBLE_EQ(r.schedule.makespan_ns, 100'000);
  EXPECT_DOUBLE_EQ(r.op_time_ns, 125'000);  // more than the wall: streams overlap
  std::vector<std::string> path;
  for (int i : r.schedule.critical_path) path.push_back(r.graph.node(i).name);
  EXPECT_EQ(path, (std::vector<std::string>{"allreduce", "loss"}));
  EXPECT_EQ(r.streams, 2);
  ASSERT_EQ(r.by_category.size(), 4u);
  EXPECT_EQ(r.by_category[0].category, OpCategory::comm);  // 50, the largest
  EXPECT_DOUBLE_EQ(r.by_category[0].critical_ns, 50'000);
  EXPECT_EQ(r.by_category[1].category, OpCategory::loss);  // 35
  EXPECT_EQ(r.by_category[2].category, OpCategory::dense_gemm);  // 30
  EXPECT_DOUBLE_EQ(r.by_category[2].critical_ns, 0);
  ASSERT_EQ(r.by_layer.size(), 2u);
  EXPECT_EQ(r.by_layer[0].layer, -1);
  EXPECT_DOUBLE_EQ(r.by_layer[0].total_ns, 85'000);
  EXPECT_EQ(r.by_layer[1].layer, 0);
  EXPECT_DOUBLE_EQ(r.by_layer[1].total_ns, 40'000);
  EXPECT_EQ(r.by_layer[1].ops, 2);
}

TEST(ProfileReport, TraceJsonHasTheEvents) {
  Window w;
  const ProfileResult r = analyse(w.records, Profiler::what_if_specs({"comm=2"}));
  const json doc = json::parse(trace_json(r));
  ASSERT_TRUE(doc.contains("traceEvents"));
  int measured = 0, critical_lane = 0, predicted = 0;
  json fc, gelu_pred;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    if (e["cat"] == "critical_path") {
      ++critical_lane;
    } else if (e["pid"] == 1) {
      ++measured;
      if (e["name"] == "fc<1>,fwd") fc = e;
    } else if (e["pid"] == 2) {
      ++predicted;
      if (e["name"] == "loss") gelu_pred = e;
    }
  }
  EXPECT_EQ(measured, 5);  // every record, the enclosing one included
  EXPECT_EQ(critical_lane, 2);
  EXPECT_EQ(predicted, 4);
  ASSERT_FALSE(fc.is_null());
  EXPECT_DOUBLE_EQ(fc["ts"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(fc["dur"].get<double>(), 30);  // microseconds
  EXPECT_EQ(fc["tid"], 0);
  EXPECT_EQ(fc["cat"], "dense_gemm");
  EXPECT_EQ(fc["args"]["category"], "dense_gemm");
  EXPECT_EQ(fc["args"]["layer"], 0);
  EXPECT_DOUBLE_EQ(fc["args"]["flops"].get<double>(), 2e9);
  EXPECT_DOUBLE_EQ(fc["args"]["bytes"].get<double>(), 4096);
  EXPECT_EQ(fc["args"]["critical_path"], false);
  // loss may start by 55 after a 5 us delay, so gelu must end by 50 and fc by 40.
  EXPECT_DOUBLE_EQ(fc["args"]["slack_us"].get<double>(), 10);
  // comm 2x: allreduce 25 us, loss waits for gelu (40) + 5 us delay -> 45..80, +10 tail.
  ASSERT_FALSE(gelu_pred.is_null());
  EXPECT_DOUBLE_EQ(gelu_pred["ts"].get<double>(), 45);
  EXPECT_DOUBLE_EQ(r.what_if.predicted_ns, 90'000);
  EXPECT_DOUBLE_EQ(doc["otherData"]["measured_wall_us"].get<double>(), 100);
  EXPECT_DOUBLE_EQ(doc["otherData"]["comm_us"].get<double>(), 50);
  EXPECT_DOUBLE_EQ(doc["otherData"]["comm_exposed_us"].get<double>(), 10);
}

TEST(ProfileReport, OpsCsvHasAHeaderAndOneRowPerOp) {
  Window w;
  const ProfileResult r = analyse(w.records);
  const auto lines = lines_of(ops_csv(r));
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[0],
            "name,category,layer,stream,start_us,dur_us,flops,bytes,on_critical_path,slack_us");
  EXPECT_EQ(lines[1], "\"fc<1>,fwd\",dense_gemm,0,0,0.000,30.000,2000000000,4096,0,10.000");
  EXPECT_EQ(lines[2], "allreduce,comm,-1,1,0.000,50.000,0,0,1,0.000");
  EXPECT_EQ(lines[4], "loss,loss,-1,0,55.000,35.000,0,0,1,0.000");
}

TEST(ProfileReport, HtmlIsSelfContained) {
  Window w;
  const ProfileResult r = analyse(w.records, Profiler::what_if_specs({"re:fc=2", "comm=inf"}));
  const std::string html = report_html(r);
  EXPECT_NE(html.find("<svg"), std::string::npos);
  EXPECT_NE(html.find("</html>"), std::string::npos);
  EXPECT_NE(html.find("<td class=\"n\">50.000 us / 10.000 us (80.0% hidden)</td>"), std::string::npos);
  // One inline script (sorting, the rendered marker), nothing loaded from elsewhere.
  const size_t script = html.find("<script>");
  ASSERT_NE(script, std::string::npos);
  EXPECT_EQ(html.find("<script", script + 1), std::string::npos);
  EXPECT_NE(html.find("data-rendered", script), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_EQ(html.find("url("), std::string::npos);
  EXPECT_EQ(html.find("<img"), std::string::npos);
  // The only "http" is the SVG namespace.
  const std::string ns = "http://www.w3.org/2000/svg";
  int svgs = 0;
  for (size_t p = html.find("http"); p != std::string::npos; p = html.find("http", p + 1)) {
    EXPECT_EQ(html.compare(p, ns.size(), ns), 0) << "stray reference at " << html.substr(p, 40);
    ++svgs;
  }
  EXPECT_GE(svgs, 4);  // category, layer, timeline, what-if charts
  // Names are escaped, sections present.
  EXPECT_NE(html.find("fc&lt;1&gt;,fwd"), std::string::npos);
  EXPECT_EQ(html.find("fc<1>"), std::string::npos);
  for (const char* s : {"Time by category", "Time by layer", "Timeline", "What-if", "critical path",
                        "comm=inf"})
    EXPECT_NE(html.find(s), std::string::npos) << s;
}

TEST(ProfileReport, HtmlWithAValidationSection) {
  // The Window's step as the dense run and a copy where "fc<1>,fwd" (module "fc<1>,")
  // takes 10 us instead of 30 as the sparse run.
  Window dense;
  std::vector<OpRecord> sparse = dense.records;
  sparse[1].name = "fc<1>,.fwd";
  dense.records[1].name = "fc<1>,.fwd";
  sparse[1].end_ns -= 20'000;
  sparse[1].category = OpCategory::sparse_gemm;
  const ValidationResult v = validate_prediction(
      {dense.records}, {sparse}, speedups_from_calibration({dense.records}, {sparse}, {"fc<1>,"}));
  ASSERT_EQ(v.model.specs.size(), 1u);
  EXPECT_DOUBLE_EQ(v.model.specs[0].factor, 3);
  const ProfileResult r = analyse(dense.records, v.model.specs);
  const std::string html = report_html(r, &v);
  for (const char* s : {"Validation: predicted vs measured", "By category (op time per step)", "Per step",
                        "Speed-ups applied to the dense graph", "fc&lt;1&gt;,", "3.000x", "sparse_gemm"})
    EXPECT_NE(html.find(s), std::string::npos) << s;
  EXPECT_EQ(html.find("fc<1>"), std::string::npos);
  // fc is off the critical path (loss waits for the allreduce): faster, it changes nothing.
  EXPECT_NE(html.find("validation: sparse step predicted / measured"), std::string::npos);
  EXPECT_DOUBLE_EQ(v.predicted_ns, 100'000);
  EXPECT_GE(std::count(html.begin(), html.end(), '\n'), 10);
  // Without a validation the section is absent.
  EXPECT_EQ(report_html(r).find("Validation: predicted"), std::string::npos);
}

TEST(ProfileReport, SummaryText) {
  Window w;
  const ProfileResult r = analyse(w.records, Profiler::what_if_specs({"comm=2", "loss=inf"}));
  const std::string s = summary_text(r);
  EXPECT_NE(s.find("step time: 100.000 us measured, 100.000 us modelled (4 ops on 2 streams)"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("critical path: 100.000 us over 2 ops"), std::string::npos) << s;
  EXPECT_NE(s.find("comm"), std::string::npos) << s;
  EXPECT_NE(s.find("40.0%"), std::string::npos) << s;  // comm: 50 of 125 us of op time
  // Without the allreduce the loss starts 5 us after gelu (40 us): 90 us, 10 us shorter.
  EXPECT_NE(s.find("collectives: 50.000 us, of which 10.000 us exposed (the step without them is that much "
                   "shorter); 80.0% hidden behind other work"),
            std::string::npos)
      << s;
  // comm 2x alone: 90 us; loss free alone: allreduce 50 + 5 delay + 10 tail = 65 us.
  EXPECT_NE(s.find("comm=2: 1 ops, 50.000 us -> 90.000 us (1.11x)"), std::string::npos) << s;
  EXPECT_NE(s.find("loss=inf: 1 ops, 35.000 us -> 65.000 us (1.54x)"), std::string::npos) << s;
  // Both: allreduce 25, loss 0: max(25, 40) + 5 + 10 = 55 us.
  EXPECT_NE(s.find("all specs: 55.000 us (1.82x)"), std::string::npos) << s;
}

TEST(ProfileReport, WriteReportsCreatesTheFiles) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "esplag_test_profile_report" / "nested";
  fs::remove_all(dir.parent_path());
  Window w;
  const ProfileResult r = analyse(w.records);
  write_reports(dir.string(), r);
  for (const char* f : {"trace.json", "ops.csv", "report.html"})
    EXPECT_GT(fs::file_size(dir / f), 100u) << f;
  std::ifstream in(dir / "trace.json");
  const json doc = json::parse(in);
  EXPECT_TRUE(doc["traceEvents"].is_array());
  // A path that is a file cannot become a directory.
  const fs::path file = dir / "ops.csv";
  EXPECT_THROW(write_reports((file / "sub").string(), r), Error);
  fs::remove_all(dir.parent_path());
}

TEST(ProfileReport, HandBuiltGraphReports) {
  OpGraph g;
  const int a = g.add_node("a", 3000, OpCategory::dense_gemm);
  const int b = g.add_node("b", 2000, OpCategory::norm, 1);
  const int c = g.add_node("c", 1000, OpCategory::loss);
  g.add_edge(a, c);
  g.add_edge(b, c);
  const ProfileResult r = analyse(std::move(g), Profiler::what_if_specs({"dense_gemm=3"}));
  EXPECT_DOUBLE_EQ(r.measured_wall_ns, 4000);
  EXPECT_DOUBLE_EQ(r.what_if.predicted_ns, 3000);  // b becomes critical: 2 + 1 us
  const auto lines = lines_of(ops_csv(r));
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[2], "b,norm,-1,1,0.000,2.000,0,0,0,1.000");
  EXPECT_EQ(lines[3], "c,loss,-1,0,3.000,1.000,0,0,1,0.000");
  const json doc = json::parse(trace_json(r));
  int x = 0;
  for (const auto& e : doc["traceEvents"])
    if (e["ph"] == "X" && e["pid"] == 1 && e["cat"] != "critical_path") ++x;
  EXPECT_EQ(x, 3);
  EXPECT_NE(report_html(r).find("<svg"), std::string::npos);
}

TEST(Profiler, RecordsSleepsAndPredicts) {
  Profiler p;
  ASSERT_EQ(current_op_tracer(), nullptr);
  p.start();
  EXPECT_TRUE(p.running());
  {
    ScopedOp step("step", OpCategory::other);
    const char* names[] = {"a", "b", "c"};
    for (const char* n : names) {
      ScopedOp op(n, OpCategory::elementwise, 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  auto records = p.stop();
  EXPECT_FALSE(p.running());
  EXPECT_EQ(current_op_tracer(), nullptr);
  ASSERT_EQ(records.size(), 4u);
  const ProfileResult r = Profiler::analyse(records, Profiler::what_if_specs({"re:^b$=inf"}));
  ASSERT_EQ(r.graph.size(), 3);
  double sum = 0;
  for (const auto& n : r.graph.nodes()) sum += n.duration_ns;
  EXPECT_GE(sum, 6e6);
  EXPECT_LE(sum, r.measured_wall_ns);
  EXPECT_LT(r.measured_wall_ns - sum, 2e6);  // bookkeeping only, with room for preemption
  // The schedule reproduces the measured wall time, and making b free removes exactly b.
  EXPECT_NEAR(r.schedule.makespan_ns, r.measured_wall_ns, 1e-6 * r.measured_wall_ns);
  EXPECT_NEAR(r.what_if.predicted_ns, r.measured_wall_ns - r.graph.node(1).duration_ns,
              1e-6 * r.measured_wall_ns);
  EXPECT_EQ(r.schedule.critical_path, (std::vector<int>{0, 1, 2}));
  EXPECT_FALSE(Profiler::summary(r).empty());
}

TEST(Profiler, MisuseThrows) {
  Profiler p;
  EXPECT_THROW(p.stop(), Error);  // not started
  p.start();
  EXPECT_THROW(p.start(), Error);  // already running
  Profiler other;
  EXPECT_THROW(other.start(), Error);  // another tracer is installed
  {
    ScopedOp open("still.open", OpCategory::other);
    try {
      p.stop();
      ADD_FAILURE() << "stop inside an op must throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("still.open"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(current_op_tracer(), nullptr);
  other.start();  // the slot is free again
  { ScopedOp op("x", OpCategory::other); }
  EXPECT_EQ(other.stop().size(), 1u);
  {
    Profiler scoped;
    scoped.start();
  }  // the destructor uninstalls
  EXPECT_EQ(current_op_tracer(), nullptr);
}

TEST(Profiler, SpecsFromTheCommandLineThenCsvFiles) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "esplag_test_profiler_specs";
  fs::create_directories(dir);
  const std::string path = (dir / "bench.csv").string();
  {
    std::ofstream out(path);
    out << "name,speedup\nre:mlp,1.5\nattention,2\n";
  }
  const auto specs = Profiler::what_if_specs({"re:mlp=3"}, {path});
  ASSERT_EQ(specs.size(), 3u);
  EXPECT_DOUBLE_EQ(specs[0].factor, 3);
  EXPECT_DOUBLE_EQ(specs[1].factor, 1.5);
  EXPECT_EQ(*specs[2].category, OpCategory::attention);
  fs::remove_all(dir);
  EXPECT_THROW(Profiler::what_if_specs({}, {path}), Error);
}
