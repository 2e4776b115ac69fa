// The device side of the op hook without a GPU: OpStream, device stream numbering, and the
// OpRecorder hooks a device tracer (the CUDA recorder) implements, driven here by a fake
// device with its own clock. The CUDA recorder itself is tested in tests/gpu_profile.cu.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <thread>

#include "core/error.h"
#include "core/op_trace.h"
#include "profile/graph.h"
#include "profile/profiler.h"

using namespace esplag;

namespace {

// Stand-ins for cudaStream_t values; never dereferenced.
CUstream_st* fake_stream(uintptr_t v) { return reinterpret_cast<CUstream_st*>(v); }

// A device whose ops take fixed times on a clock of its own: each op of a stream starts
// when the stream's previous op has finished (or at its issue time, if later) and takes
// 1000 ns per character of its name. Timestamps are only known when resolved, like event
// timestamps after a synchronisation.
class FakeDeviceRecorder : public OpRecorder {
 public:
  int begins = 0, ends = 0, resets = 0;
  mutable int resolves = 0;  // resolve_device_ops is const (records() is)

 protected:
  bool begin_device_op(const OpDesc& op, size_t index) override {
    ++begins;
    const std::string name = op.name.str();
    int64_t& free_at = stream_free_[op.stream.handle];
    const int64_t start = std::max(free_at, issue_);
    issue_ += 100;
    free_at = start + 1000 * int64_t(name.size());
    times_[index] = {start, free_at, false};
    return true;
  }
  void end_device_op(size_t index) override {
    ++ends;
    times_[index].ended = true;
  }
  void resolve_device_ops(std::vector<OpRecord>& records) const override {
    ++resolves;
    for (const auto& [index, t] : times_) {
      if (!t.ended || index >= records.size()) continue;
      records[index].start_ns = t.start;
      records[index].end_ns = t.end;
    }
  }
  void reset_device_ops() override {
    ++resets;
    times_.clear();
    stream_free_.clear();
  }

 private:
  struct Times {
    int64_t start, end;
    bool ended;
  };
  std::map<size_t, Times> times_;
  std::map<CUstream_st*, int64_t> stream_free_;
  int64_t issue_ = 0;
};

struct Install {
  explicit Install(OpTracer* t) { prev = set_op_tracer(t); }
  ~Install() { set_op_tracer(prev); }
  OpTracer* prev;
};

const OpRecord& by_name(const std::vector<OpRecord>& r, const std::string& name) {
  for (const auto& x : r)
    if (x.name == name) return x;
  throw std::runtime_error("no record " + name);
}

}  // namespace

TEST(OpStream, HostByDefaultDeviceForACudaStream) {
  constexpr OpStream host;
  static_assert(!host.device && host.id == 0 && host.handle == nullptr);
  constexpr OpStream labelled(3);
  static_assert(!labelled.device && labelled.id == 3);
  const OpStream legacy(nullptr);  // the legacy default stream is a device stream
  EXPECT_TRUE(legacy.device);
  EXPECT_EQ(legacy.id, -1);
  EXPECT_EQ(legacy.handle, nullptr);
  const OpStream s(fake_stream(0x10), 7);
  EXPECT_TRUE(s.device);
  EXPECT_EQ(s.id, 7);
  EXPECT_EQ(OpStream(2), OpStream(2));
  EXPECT_NE(OpStream(0), OpStream(nullptr));
}

TEST(OpRecorderDevice, HostClockRecorderKeepsDeviceOpsOnTheHost) {
  // The plain recorder has no device clock: a device op is timed by the host (its launch)
  // and stays ordered with its thread, but it is still labelled as a device op.
  OpRecorder rec;
  {
    Install in(&rec);
    ScopedOp a("a", OpCategory::dense_gemm, 0, 0, 0, {}, {}, fake_stream(0x10));
    ScopedOp h("host", OpCategory::other);
  }
  const auto r = rec.take();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_TRUE(r[0].device);
  EXPECT_EQ(r[0].stream, 1);
  EXPECT_EQ(r[0].thread, 0);
  EXPECT_FALSE(r[1].device);
  EXPECT_EQ(r[1].stream, 0);
  EXPECT_GE(r[0].end_ns, r[0].start_ns);
}

TEST(OpRecorderDevice, HooksTimeDeviceOpsAndNumberStreams) {
  FakeDeviceRecorder rec;
  CUstream_st* s1 = fake_stream(0x100);
  CUstream_st* s2 = fake_stream(0x200);
  int X, Y, Z;
  {
    Install in(&rec);
    ScopedOp step("step", OpCategory::other);  // a host op enclosing device ops
    { ScopedOp a("aa", OpCategory::dense_gemm, 0, 0, 0, {}, {&X}, s1); }
    { ScopedOp b("bbbb", OpCategory::comm, -1, 0, 0, {}, {&Y}, s2); }
    { ScopedOp c("c", OpCategory::elementwise, 0, 0, 0, {&X}, {&Z}, s1); }
    { ScopedOp d("dd", OpCategory::elementwise, 0, 0, 0, {&Y, &Z}, {}, OpStream(s2, 9)); }
    ScopedOp e("legacy", OpCategory::memcpy, -1, 0, 0, {}, {}, nullptr);
    EXPECT_EQ(rec.begins, 5);
    EXPECT_EQ(rec.ends, 4);  // "legacy" is still open
  }
  EXPECT_EQ(rec.ends, 5);
  const auto peek = rec.records();  // resolved into a copy; nothing consumed
  EXPECT_EQ(rec.resolves, 1);
  EXPECT_EQ(rec.resets, 0);
  const auto r = rec.take();
  EXPECT_EQ(rec.resolves, 2);
  EXPECT_EQ(rec.resets, 1);
  ASSERT_EQ(r.size(), 6u);
  ASSERT_EQ(peek.size(), 6u);
  for (size_t i = 0; i < r.size(); ++i) {
    EXPECT_EQ(peek[i].start_ns, r[i].start_ns) << r[i].name;
    EXPECT_EQ(peek[i].end_ns, r[i].end_ns) << r[i].name;
  }

  const OpRecord& step = by_name(r, "step");
  EXPECT_FALSE(step.device);
  EXPECT_EQ(step.thread, 0);
  EXPECT_FALSE(step.leaf);
  const OpRecord& a = by_name(r, "aa");
  const OpRecord& b = by_name(r, "bbbb");
  const OpRecord& c = by_name(r, "c");
  const OpRecord& d = by_name(r, "dd");
  const OpRecord& e = by_name(r, "legacy");
  for (const OpRecord* x : {&a, &b, &c, &d, &e}) {
    EXPECT_TRUE(x->device) << x->name;
    EXPECT_EQ(x->thread, -1) << x->name;  // asynchronous to the host
    EXPECT_EQ(x->depth, 1) << x->name;    // nesting still follows the host thread
    EXPECT_EQ(x->parent, 0) << x->name;
  }
  // Streams are numbered 1, 2, ... in order of first appearance; an explicit id wins.
  EXPECT_EQ(a.stream, 1);
  EXPECT_EQ(b.stream, 2);
  EXPECT_EQ(c.stream, 1);
  EXPECT_EQ(d.stream, 9);
  EXPECT_EQ(e.stream, 3);
  // The device clock's timestamps replaced the host ones.
  EXPECT_EQ(a.start_ns, 0);
  EXPECT_EQ(a.end_ns, 2000);
  EXPECT_EQ(b.start_ns, 100);
  EXPECT_EQ(b.end_ns, 4100);
  EXPECT_EQ(c.start_ns, 2000);  // waited for aa on stream 1
  EXPECT_EQ(c.end_ns, 3000);

  // The graph of device ops: stream order and buffer edges, no host order between them.
  const OpGraph g = OpGraph::from_records(r);
  ASSERT_EQ(g.size(), 5);  // the leaves
  EXPECT_EQ(g.edge_kinds(0, 2), kEdgeStream | kEdgeRaw);  // aa -> c, one stream, X
  EXPECT_EQ(g.edge_kinds(0, 1), 0);                       // aa, bbbb: two streams
  EXPECT_EQ(g.edge_kinds(1, 3), kEdgeRaw);                // bbbb -> dd: Y (dd is on "stream 9")
  EXPECT_EQ(g.edge_kinds(2, 3), kEdgeRaw);                // c -> dd: Z
  EXPECT_EQ(g.edge_kinds(3, 4), 0);
  const Schedule s = g.schedule();
  // "legacy" (issued at 400, 6000 long) ends last, at 6400; bbbb -> dd ends at 6100, so
  // dd has 300 of slack.
  EXPECT_EQ(s.critical_path, std::vector<int>{4});
  EXPECT_DOUBLE_EQ(s.earliest_finish[3], 6100);
  EXPECT_DOUBLE_EQ(s.slack[3], 300);
}

TEST(OpRecorderDevice, TakeWithAnOpenDeviceOpThrowsAndClearResets) {
  FakeDeviceRecorder rec;
  Install in(&rec);
  {
    ScopedOp a("a", OpCategory::other, -1, 0, 0, {}, {}, fake_stream(0x1));
    EXPECT_THROW(rec.take(), Error);
    const auto r = rec.records();
    ASSERT_EQ(r.size(), 1u);
    EXPECT_LT(r[0].end_ns, r[0].start_ns);  // still open: not resolved
    rec.clear();
    EXPECT_EQ(rec.resets, 1);
  }  // closes after clear(): ignored
  EXPECT_EQ(rec.ends, 0);
  EXPECT_TRUE(rec.take().empty());
}

TEST(OpRecorderDevice, ProfilerTakesADeviceRecorder) {
  auto owned = std::make_unique<FakeDeviceRecorder>();
  FakeDeviceRecorder* rec = owned.get();
  Profiler p(std::move(owned));
  p.start();
  { ScopedOp a("abc", OpCategory::dense_gemm, 0, 0, 0, {}, {}, fake_stream(0x5)); }
  const auto r = p.stop();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].end_ns - r[0].start_ns, 3000);
  EXPECT_GE(rec->resets, 2);  // start() clears, stop() takes
  const ProfileResult res = Profiler::analyse(r);
  EXPECT_DOUBLE_EQ(res.measured_wall_ns, 3000);
}

TEST(OpRecorderDevice, CudaRecorderFactory) {
  if (have_cuda_op_recorder()) {
    GTEST_SUCCEED() << "CUDA build: the CUDA recorder is tested by gpu_profile";
  } else {
    try {
      make_cuda_op_recorder();
      ADD_FAILURE() << "a build without CUDA must refuse the CUDA recorder";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("no CUDA"), std::string::npos) << e.what();
    }
  }
}
