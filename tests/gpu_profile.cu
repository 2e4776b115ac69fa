// The CUDA op tracer (make_cuda_op_recorder) on a real device: kernels of a known length
// on two streams are timed where they ran (not when they were launched), stream order and
// cross-stream waits show in the timestamps, the graph gets stream and buffer edges and no
// host-order edges between kernels, device times sit on the host clock, and event pools
// survive many windows.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/op_trace.h"
#include "profile/graph.h"
#include "profile/profiler.h"

using namespace esplag;

namespace {

bool has_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// The gpu label runs only where a GPU is expected; a missing one is a failure, not a skip.
#define REQUIRE_DEVICE() ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"

// Busy-waits `ns` nanoseconds of the GPU's global timer: a kernel whose length is known.
__global__ void spin_kernel(uint64_t ns) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

void spin(cudaStream_t s, double us) {
  spin_kernel<<<1, 1, 0, s>>>(static_cast<uint64_t>(us * 1000));
  CUDA_CHECK_LAUNCH("spin_kernel");
}

struct Streams {
  cudaStream_t a = nullptr, b = nullptr;
  Streams() {
    CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    spin(a, 1);  // the first launch of a kernel pays for loading it
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~Streams() {
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
  }
};

const OpRecord& find(const std::vector<OpRecord>& records, const std::string& name) {
  for (const auto& r : records)
    if (r.name == name) return r;
  throw std::runtime_error("no record named " + name);
}

int node_of(const OpGraph& g, const std::string& name) {
  for (int i = 0; i < g.size(); ++i)
    if (g.node(i).name == name) return i;
  return -1;
}

double us(int64_t ns) { return static_cast<double>(ns) / 1e3; }
double dur_us(const OpRecord& r) { return us(r.end_ns - r.start_ns); }

// Event timestamps have a resolution of about 0.5 us.
constexpr int64_t kTick = 1000;

}  // namespace

TEST(GpuProfile, KernelsAreTimedOnTheirStreams) {
  REQUIRE_DEVICE();
  Streams st;
  int A, B, C, D;  // buffer identities
  cudaEvent_t c_done = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&c_done, cudaEventDisableTiming));
  Profiler p(make_cuda_op_recorder());
  p.start();
  {
    ScopedOp step("step", OpCategory::other);  // a host op around the launches
    {
      ScopedOp a("a", OpCategory::dense_gemm, 0, 0, 0, {}, {&A}, st.a);
      spin(st.a, 300);
    }
    {
      ScopedOp b("b", OpCategory::comm, -1, 0, 0, {}, {&B}, st.b);
      spin(st.b, 500);
    }
    {
      ScopedOp c("c", OpCategory::elementwise, 0, 0, 0, {&A}, {&C}, st.a);
      spin(st.a, 100);
    }
    CUDA_CHECK(cudaEventRecord(c_done, st.a));
    CUDA_CHECK(cudaStreamWaitEvent(st.b, c_done, 0));
    {
      ScopedOp d("d", OpCategory::loss, -1, 0, 0, {&B, &C}, {&D}, st.b);
      spin(st.b, 50);
    }
  }
  const std::vector<OpRecord> r = p.stop();
  CUDA_CHECK(cudaEventDestroy(c_done));
  ASSERT_EQ(r.size(), 5u);

  const OpRecord &step = find(r, "step"), &a = find(r, "a"), &b = find(r, "b"), &c = find(r, "c"),
                 &d = find(r, "d");
  EXPECT_FALSE(step.device);
  EXPECT_EQ(step.thread, 0);
  for (const OpRecord* x : {&a, &b, &c, &d}) {
    EXPECT_TRUE(x->device) << x->name;
    EXPECT_EQ(x->thread, -1) << x->name;
    EXPECT_EQ(x->parent, 0) << x->name;
  }
  EXPECT_EQ(a.stream, 1);
  EXPECT_EQ(c.stream, 1);
  EXPECT_EQ(b.stream, 2);
  EXPECT_EQ(d.stream, 2);

  // Durations are the kernels' (host launches take a few microseconds, not hundreds).
  EXPECT_GE(dur_us(a), 0.97 * 300) << dur_us(a);
  EXPECT_GE(dur_us(b), 0.97 * 500) << dur_us(b);
  EXPECT_GE(dur_us(c), 0.97 * 100) << dur_us(c);
  EXPECT_GE(dur_us(d), 0.97 * 50) << dur_us(d);
  for (const OpRecord* x : {&a, &b, &c, &d}) EXPECT_LT(dur_us(*x), 5000) << x->name;
  // The host op only launched: it closed long before the kernels finished.
  EXPECT_LT(step.end_ns, b.end_ns);
  // Stream order, concurrency of the two streams, and the cross-stream wait.
  EXPECT_GE(c.start_ns + kTick, a.end_ns);
  EXPECT_LT(b.start_ns, a.end_ns);
  EXPECT_LT(a.start_ns, b.end_ns);
  EXPECT_GE(d.start_ns + kTick, b.end_ns);
  EXPECT_GE(d.start_ns + kTick, c.end_ns);

  // The graph: stream order within a stream, buffer edges across, no host order between
  // kernels (they ran asynchronously to the host thread).
  const OpGraph g = OpGraph::from_records(r);
  ASSERT_EQ(g.size(), 4);
  const int na = node_of(g, "a"), nb = node_of(g, "b"), nc = node_of(g, "c"), nd = node_of(g, "d");
  EXPECT_EQ(g.edge_kinds(na, nc), kEdgeStream | kEdgeRaw);
  EXPECT_EQ(g.edge_kinds(na, nb), 0);
  EXPECT_EQ(g.edge_kinds(nb, nd), kEdgeStream | kEdgeRaw);
  EXPECT_EQ(g.edge_kinds(nc, nd), kEdgeRaw);
  EXPECT_EQ(g.edge_kinds(nb, nc), 0);
  // b (500 us) is longer than a + c (400 us): the path is b -> d.
  const ProfileResult res = Profiler::analyse(r, Profiler::what_if_specs({"re:^b$=inf"}));
  EXPECT_EQ(res.schedule.critical_path.back(), nd);
  EXPECT_NE(std::find(res.schedule.critical_path.begin(), res.schedule.critical_path.end(), nb),
            res.schedule.critical_path.end());
  EXPECT_NEAR(res.schedule.makespan_ns, res.measured_wall_ns, 1e-6 * res.measured_wall_ns);
  // With b free, a -> c -> d (about 450 us) decides: at least 80 us saved.
  EXPECT_LT(res.what_if.predicted_ns, res.what_if.baseline_ns - 80e3)
      << res.what_if.predicted_ns << " vs " << res.what_if.baseline_ns;
  EXPECT_GT(res.what_if.predicted_ns, 0.95 * 450e3);
}

TEST(GpuProfile, MemsetTimeIsTheDevicesAndSitsOnTheHostClock) {
  REQUIRE_DEVICE();
  Streams st;
  const size_t bytes = size_t(256) << 20;
  void* buf = nullptr;
  CUDA_CHECK(cudaMalloc(&buf, bytes));
  Profiler p(make_cuda_op_recorder());
  p.start();
  {
    ScopedOp m("memset", OpCategory::memcpy, -1, 0, double(bytes), {}, {buf}, st.a);
    CUDA_CHECK(cudaMemsetAsync(buf, 0, bytes, st.a));
  }
  {
    // A host op that waits for the stream: it cannot end before the memset did.
    ScopedOp w("wait", OpCategory::other, -1, 0, 0, {buf}, {});
    CUDA_CHECK(cudaStreamSynchronize(st.a));
  }
  const auto r = p.stop();
  CUDA_CHECK(cudaFree(buf));
  const OpRecord &m = find(r, "memset"), &w = find(r, "wait");
  ASSERT_GT(m.end_ns, m.start_ns);
  // A physical bandwidth (an H100 writes a few TB/s); a launch-time measurement would
  // claim hundreds of TB/s.
  const double tb_per_s = double(bytes) / double(m.end_ns - m.start_ns) / 1e3;
  EXPECT_LT(tb_per_s, 10.0) << tb_per_s << " TB/s";
  EXPECT_GT(tb_per_s, 0.05) << tb_per_s << " TB/s";
  // Clock alignment: within the latency of one synchronisation.
  EXPECT_GE(w.end_ns + 50 * kTick, m.end_ns) << "host op ends " << us(m.end_ns - w.end_ns) << " us before the device op";
  EXPECT_LE(w.start_ns, m.end_ns);
  const OpGraph g = OpGraph::from_records(r);
  EXPECT_EQ(g.edge_kinds(node_of(g, "memset"), node_of(g, "wait")), kEdgeRaw);
}

TEST(GpuProfile, ManyWindowsReuseEventsAndStayOrdered) {
  REQUIRE_DEVICE();
  Streams st;
  Profiler p(make_cuda_op_recorder());
  int64_t last_end = 0;
  for (int window = 0; window < 40; ++window) {
    p.start();
    for (int i = 0; i < 25; ++i) {
      ScopedOp op("k" + std::to_string(i), OpCategory::elementwise, 0, 0, 0, {}, {}, i % 2 ? st.a : st.b);
      spin(i % 2 ? st.a : st.b, 2);
    }
    const auto r = p.stop();
    ASSERT_EQ(r.size(), 25u);
    int64_t first_start = r[0].start_ns, window_end = 0;
    for (const auto& x : r) {
      EXPECT_GE(x.end_ns, x.start_ns);
      EXPECT_GE(x.end_ns - x.start_ns, int64_t(0.9 * 2000)) << x.name;
      first_start = std::min(first_start, x.start_ns);
      window_end = std::max(window_end, x.end_ns);
    }
    // Windows follow each other (each window ties the clocks anew: allow for the wake-up
    // latency of those synchronisations).
    EXPECT_GE(first_start + 20 * kTick, last_end) << "window " << window;
    last_end = window_end;
  }
}

TEST(GpuProfile, ClearDropsOpenDeviceOps) {
  REQUIRE_DEVICE();
  Streams st;
  auto rec = make_cuda_op_recorder();
  OpTracer* prev = set_op_tracer(rec.get());
  {
    ScopedOp open("open", OpCategory::other, -1, 0, 0, {}, {}, st.a);
    spin(st.a, 5);
    EXPECT_THROW(rec->take(), Error);
    rec->clear();
  }  // its end is ignored
  {
    ScopedOp after("after", OpCategory::other, -1, 0, 0, {}, {}, st.b);
    spin(st.b, 5);
  }
  set_op_tracer(prev);
  const auto r = rec->take();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].name, "after");
  EXPECT_EQ(r[0].stream, 1);  // numbering restarts with the records
  EXPECT_GE(r[0].end_ns - r[0].start_ns, int64_t(0.9 * 5000));
  CUDA_CHECK(cudaDeviceSynchronize());
}
