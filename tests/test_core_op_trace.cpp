#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/op_trace.h"

using namespace esplag;

// Counts heap allocations in this binary, to show that a ScopedOp without a tracer makes
// none.
static std::atomic<long> g_allocations{0};
void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

// Installs a tracer for the scope of a test and always uninstalls it.
struct Install {
  explicit Install(OpTracer* t) { prev = set_op_tracer(t); }
  ~Install() { set_op_tracer(prev); }
  OpTracer* prev;
};

struct CountingTracer : OpTracer {
  int begins = 0, ends = 0;
  std::vector<uint64_t> ended;
  OpDesc last;
  std::vector<const void*> last_inputs, last_outputs;
  std::string last_name;
  uint64_t begin_op(const OpDesc& op) override {
    last = op;
    last_name = op.name.str();
    last_inputs.assign(op.inputs.begin(), op.inputs.end());
    last_outputs.assign(op.outputs.begin(), op.outputs.end());
    return 100 + begins++;
  }
  void end_op(uint64_t token) override {
    ++ends;
    ended.push_back(token);
  }
};

}  // namespace

TEST(OpCategory, NamesRoundTrip) {
  EXPECT_EQ(all_op_categories().size(), static_cast<size_t>(kNumOpCategories));
  const char* expected[] = {"dense_gemm", "sparse_gemm", "attention", "norm", "elementwise",
                            "loss", "optimizer", "memcpy", "comm", "other"};
  for (int i = 0; i < kNumOpCategories; ++i) {
    const OpCategory c = all_op_categories()[i];
    EXPECT_EQ(op_category_name(c), expected[i]);
    auto back = parse_op_category(expected[i]);
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(*back, c);
    EXPECT_NE(op_category_list().find(expected[i]), std::string::npos);
  }
  EXPECT_EQ(parse_op_category("Dense_GEMM"), OpCategory::dense_gemm);
  EXPECT_FALSE(parse_op_category("gemm").has_value());
  EXPECT_FALSE(parse_op_category("").has_value());
  EXPECT_FALSE(parse_op_category("dense_gemm ").has_value());
}

TEST(ScopedOp, NoTracerRecordsNothing) {
  ASSERT_EQ(current_op_tracer(), nullptr);
  OpRecorder rec;
  CountingTracer counting;
  {
    Install on(&counting);
    Install off(nullptr);  // installed then removed: ops must not reach either tracer
    float buf[4];
    ScopedOp op("x", OpCategory::elementwise, 0, 1, 2, {buf}, {buf});
    EXPECT_FALSE(op.tracing());
    ScopedOp inner("y", OpCategory::other);
  }
  EXPECT_EQ(counting.begins, 0);
  EXPECT_EQ(counting.ends, 0);
  EXPECT_TRUE(rec.records().empty());
  EXPECT_EQ(current_op_tracer(), nullptr);
}

TEST(ScopedOp, SetTracerReturnsPrevious) {
  CountingTracer a, b;
  EXPECT_EQ(set_op_tracer(&a), nullptr);
  EXPECT_EQ(current_op_tracer(), &a);
  EXPECT_EQ(set_op_tracer(&b), &a);
  EXPECT_EQ(set_op_tracer(nullptr), &b);
  EXPECT_EQ(current_op_tracer(), nullptr);
}

TEST(ScopedOp, PassesTheDescriptionToTheTracer) {
  CountingTracer t;
  Install in(&t);
  float x[2], w[2], y[2];
  {
    ScopedOp op("blocks.3.mlp.fc.fwd", OpCategory::dense_gemm, 3, 1e9, 4096, {x, w},
                {y, nullptr}, 2);
    EXPECT_TRUE(op.tracing());
    EXPECT_EQ(t.begins, 1);
    EXPECT_EQ(t.ends, 0);
    EXPECT_EQ(t.last_name, "blocks.3.mlp.fc.fwd");
    EXPECT_EQ(t.last.category, OpCategory::dense_gemm);
    EXPECT_EQ(t.last.layer, 3);
    EXPECT_EQ(t.last.stream, 2);
    EXPECT_EQ(t.last.flops, 1e9);
    EXPECT_EQ(t.last.bytes, 4096);
    EXPECT_EQ(t.last_inputs, (std::vector<const void*>{x, w}));
    EXPECT_EQ(t.last_outputs, (std::vector<const void*>{y, nullptr}));
  }
  EXPECT_EQ(t.ends, 1);
  ASSERT_EQ(t.ended.size(), 1u);
  EXPECT_EQ(t.ended[0], 100u);  // the token begin_op returned

  // A name in two parts is joined only by the tracer.
  const std::string layer_name = "blocks.3.mlp.fc";
  { ScopedOp op({layer_name, "bwd.dx"}, OpCategory::dense_gemm, 3); }
  EXPECT_EQ(t.last_name, "blocks.3.mlp.fc.bwd.dx");
  EXPECT_EQ(t.last.name.prefix, layer_name);
  EXPECT_EQ(t.last.name.name, "bwd.dx");
  { ScopedOp op(layer_name, OpCategory::dense_gemm); }
  EXPECT_EQ(t.last_name, "blocks.3.mlp.fc");
  { ScopedOp op(std::string_view("sv"), OpCategory::other); }
  EXPECT_EQ(t.last_name, "sv");

  // A run-time list of buffers goes through a span.
  std::vector<const void*> ins = {x, w, y};
  { ScopedOp op("concat", OpCategory::memcpy, -1, 0, 0, std::span<const void* const>(ins), {y}); }
  EXPECT_EQ(t.last_inputs, ins);
  EXPECT_EQ(t.last.layer, -1);
  EXPECT_EQ(t.last.stream, 0);
}

TEST(OpRecorder, NestedAndSequentialOps) {
  OpRecorder rec;
  float a_in[1], a_out[1];
  {
    Install in(&rec);
    {
      ScopedOp a("a", OpCategory::other, 0, 0, 0, {a_in, nullptr}, {a_out});
      { ScopedOp b({"", "b"}, OpCategory::dense_gemm, 0, 10, 20); }
      {
        ScopedOp c("c", OpCategory::norm);
        { ScopedOp d({"c", "d"}, OpCategory::elementwise, 1, 0, 0, {}, {}, 1); }
      }
    }
    { ScopedOp e("e", OpCategory::loss); }
  }
  EXPECT_EQ(rec.open_ops(), 0);
  const auto r = rec.take();
  ASSERT_EQ(r.size(), 5u);
  const char* names[] = {"a", "b", "c", "c.d", "e"};
  const int depth[] = {0, 1, 1, 2, 0};
  const int64_t parent[] = {-1, 0, 0, 2, -1};
  const bool leaf[] = {false, true, false, true, true};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(r[i].name, names[i]);
    EXPECT_EQ(r[i].depth, depth[i]) << names[i];
    EXPECT_EQ(r[i].parent, parent[i]) << names[i];
    EXPECT_EQ(r[i].leaf, leaf[i]) << names[i];
    EXPECT_LE(r[i].start_ns, r[i].end_ns) << names[i];
  }
  EXPECT_EQ(r[0].inputs, (std::vector<const void*>{a_in}));  // null dropped
  EXPECT_EQ(r[0].outputs, (std::vector<const void*>{a_out}));
  EXPECT_EQ(r[1].category, OpCategory::dense_gemm);
  EXPECT_EQ(r[1].flops, 10);
  EXPECT_EQ(r[1].bytes, 20);
  EXPECT_EQ(r[3].stream, 1);
  for (const auto& op : r) EXPECT_EQ(op.thread, 0);  // CPU ops run on the recording thread
  EXPECT_EQ(r[3].layer, 1);
  // Time order: a opens, b runs, c opens, d runs, c and a close, e runs.
  const int64_t seq[] = {r[0].start_ns, r[1].start_ns, r[1].end_ns, r[2].start_ns,
                         r[3].start_ns, r[3].end_ns,   r[2].end_ns, r[0].end_ns,
                         r[4].start_ns, r[4].end_ns};
  for (int k = 1; k < 10; ++k) EXPECT_LE(seq[k - 1], seq[k]) << "position " << k;
  EXPECT_TRUE(rec.take().empty());
}

TEST(OpRecorder, SleepsAddUpToTheWallTime) {
  OpRecorder rec;
  const auto sleep = std::chrono::milliseconds(3);
  {
    Install in(&rec);
    for (int i = 0; i < 4; ++i) {
      ScopedOp op("sleep", OpCategory::other);
      std::this_thread::sleep_for(sleep);
    }
  }
  const auto r = rec.take();
  ASSERT_EQ(r.size(), 4u);
  int64_t sum = 0;
  for (const auto& op : r) {
    EXPECT_GE(op.end_ns - op.start_ns, 3'000'000);
    sum += op.end_ns - op.start_ns;
  }
  const int64_t wall = r.back().end_ns - r.front().start_ns;
  EXPECT_GE(wall, sum);
  // Between ops only the recorder's bookkeeping runs (microseconds); the bound leaves room
  // for a preemption on a loaded machine.
  EXPECT_LT(wall - sum, 2'000'000) << "wall " << wall << " ns, sum " << sum << " ns";
}

TEST(OpRecorder, TakeWhileOpenThrowsAndClearDropsLateEnds) {
  OpRecorder rec;
  Install in(&rec);
  {
    ScopedOp outer("outer", OpCategory::other);
    ScopedOp inner("inner.open", OpCategory::other);
    EXPECT_EQ(rec.open_ops(), 2);
    try {
      rec.take();
      ADD_FAILURE() << "take() with open ops must throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("inner.open"), std::string::npos) << e.what();
    }
    rec.clear();
    EXPECT_EQ(rec.open_ops(), 0);
    { ScopedOp fresh("fresh", OpCategory::other); }
  }  // outer and inner close after clear(): ignored
  set_op_tracer(nullptr);
  const auto r = rec.take();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].name, "fresh");
  EXPECT_EQ(r[0].depth, 0);
  EXPECT_LE(r[0].start_ns, r[0].end_ns);
}

TEST(OpRecorder, NestingIsTrackedPerThread) {
  OpRecorder rec;
  {
    Install in(&rec);
    auto work = [](const char* outer, const char* inner) {
      for (int i = 0; i < 50; ++i) {
        ScopedOp o(outer, OpCategory::other);
        ScopedOp n(inner, OpCategory::other);
      }
    };
    std::thread t1(work, "o1", "i1");
    std::thread t2(work, "o2", "i2");
    t1.join();
    t2.join();
  }
  const auto r = rec.take();
  ASSERT_EQ(r.size(), 200u);
  int thread_of[2] = {-1, -1};  // by the digit in the op names
  for (size_t k = 0; k < r.size(); ++k) {
    const OpRecord& op = r[k];
    int& t = thread_of[op.name[1] - '1'];
    if (t < 0) t = op.thread;
    EXPECT_EQ(op.thread, t) << "one thread, one number";
    if (op.name[0] == 'o') {
      EXPECT_EQ(op.depth, 0);
      EXPECT_EQ(op.parent, -1);
      EXPECT_FALSE(op.leaf);
    } else {
      ASSERT_EQ(op.depth, 1);
      ASSERT_GE(op.parent, 0);
      EXPECT_EQ(r[op.parent].name[1], op.name[1]) << "inner op nested in the other thread's op";
      EXPECT_TRUE(op.leaf);
    }
  }
  EXPECT_NE(thread_of[0], thread_of[1]);
  EXPECT_TRUE((thread_of[0] == 0 && thread_of[1] == 1) || (thread_of[0] == 1 && thread_of[1] == 0));
}

TEST(ScopedOp, DoesNotAllocateWithoutATracer) {
  ASSERT_EQ(current_op_tracer(), nullptr);
  float x[1], y[1];
  const std::string layer = "blocks.0.mlp.fc";
  const long before = g_allocations.load();
  for (int i = 0; i < 1000; ++i) {
    ScopedOp a("blocks.0.mlp.fc.fwd", OpCategory::dense_gemm, 0, 2.0 * i, 8.0 * i, {x}, {y});
    ScopedOp b({layer, "bwd.dx"}, OpCategory::dense_gemm, 0, 2.0 * i, 8.0 * i, {x, y}, {x});
  }
  EXPECT_EQ(g_allocations.load() - before, 0);
  // The counter works: a recorder does allocate.
  OpRecorder rec;
  {
    Install in(&rec);
    ScopedOp a("x", OpCategory::other, 0, 0, 0, {x}, {y});
  }
  EXPECT_GT(g_allocations.load() - before, 0);
}

#if defined(__OPTIMIZE__)
TEST(ScopedOp, CostsAlmostNothingWithoutATracer) {
  ASSERT_EQ(current_op_tracer(), nullptr);
  float x[1], y[1];
  const int n = 2'000'000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    ScopedOp op("blocks.0.mlp.fc.fwd", OpCategory::dense_gemm, 0, 2.0 * i, 8.0 * i, {x}, {y});
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  // A load and a branch take about a nanosecond in an optimised build; 25 ns would mean
  // locking or a call that should not be there.
  EXPECT_LT(ns / n, 25.0);
}
#endif
