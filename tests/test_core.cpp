#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "core/tensor.h"

using namespace esplag;

TEST(Tensor, ZerosShapeAndTypedAccess) {
  Tensor t = Tensor::zeros({2, 3, 4}, DType::f32, "x");
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.dim(-1), 4);
  EXPECT_TRUE(t.owns_storage());
  for (int i = 0; i < 24; ++i) EXPECT_EQ(t.data<float>()[i], 0.0f);
  EXPECT_THROW(t.data<double>(), Error);
  EXPECT_THROW(t.data<int32_t>(), Error);
  EXPECT_THROW(t.dim(3), Error);
}

TEST(Tensor, BorrowSharesMemoryAndReshapeChecksCount) {
  float buf[6] = {1, 2, 3, 4, 5, 6};
  Tensor t = Tensor::borrow(buf, {2, 3}, DType::f32, Device::cpu, "b");
  EXPECT_FALSE(t.owns_storage());
  t.data<float>()[0] = 7;
  EXPECT_EQ(buf[0], 7);
  EXPECT_EQ(t.reshape({3, 2}).dim(0), 3);
  EXPECT_THROW(t.reshape({4, 2}), Error);
  EXPECT_THROW(t.expect_shape({3, 2}), Error);
  try {
    t.expect_shape({3, 2});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos) << e.what();
  }
}

TEST(Tensor, ConvertsToBf16AndF16AndBack) {
  Tensor t = Tensor::zeros({5}, DType::f32);
  const float vals[5] = {1.0f, -2.5f, 3.14159f, 65504.0f, 1e-6f};
  for (int i = 0; i < 5; ++i) t.data<float>()[i] = vals[i];
  Tensor b = t.to(DType::bf16).to(DType::f32);
  Tensor h = t.to(DType::f16).to(DType::f32);
  for (int i = 0; i < 5; ++i) {
    EXPECT_NEAR(b.data<float>()[i], vals[i], std::abs(vals[i]) * 1.0 / 128) << i;
    EXPECT_NEAR(h.data<float>()[i], vals[i], std::abs(vals[i]) * 1.0 / 1024 + 6e-8) << i;
  }
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f16_to_float(0x7bff), 65504.0f);
}

TEST(Tensor, I64IsAnEightByteIntegerType) {
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_name(DType::i64), "i64");
  EXPECT_EQ(dtype_safetensors(DType::i64), "I64");
  for (const char* n : {"i64", "I64", "int64"}) EXPECT_EQ(dtype_from_name(n), DType::i64) << n;
  Tensor t = Tensor::zeros({3}, DType::i64, "ids");
  EXPECT_EQ(t.nbytes(), 24u);
  t.data<int64_t>()[0] = -7;
  t.data<int64_t>()[1] = int64_t(1) << 40;
  EXPECT_THROW(t.data<double>(), Error);
  EXPECT_THROW(t.data<int32_t>(), Error);
  const Tensor f = t.to(DType::f64);
  EXPECT_EQ(f.data<double>()[0], -7.0);
  EXPECT_EQ(f.data<double>()[1], 1099511627776.0);
  EXPECT_EQ(f.to(DType::i64).data<int64_t>()[1], int64_t(1) << 40);
}

TEST(Rng, ReproducibleAndStateRoundTrips) {
  Rng a(42), b(42);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.next_u64(), b.next_u64());
  Rng::State s = a.state();
  const double x = a.normal();
  a.set_state(s);
  EXPECT_EQ(a.normal(), x);
  Rng c(43);
  EXPECT_NE(Rng(42).next_u64(), c.next_u64());
}

TEST(Rng, NormalHasUnitMomentsAndBelowIsInRange) {
  Rng r(1);
  double sum = 0, sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = r.normal();
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 1.0, 0.02);
  for (int i = 0; i < 1000; ++i) EXPECT_LT(r.below(7), 7u);
}

// fill_normal against the loop it replaces: the same bits and the same final state, for
// sizes around its chunk of 65536 values, several thread counts, and a start whose first
// uniform draw is 0 (a state with s[1] = 0 outputs 0), which normal() draws again.
template <typename T>
void expect_fill_normal_matches_the_loop(const Rng::State& start, size_t n, double scale) {
  Rng seq, par;
  seq.set_state(start);
  par.set_state(start);
  std::vector<T> want(n), got(n, T(-7));
  for (auto& x : want) x = static_cast<T>(seq.normal() * scale);
  fill_normal(par, got.data(), n, scale);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want[i]) << "value " << i << " of " << n;
  EXPECT_EQ(par.state(), seq.state()) << n << " values";
}

TEST(Rng, FillNormalDrawsWhatTheLoopDraws) {
  const int threads = num_threads();
  const Rng::State zero_first = {1, 0, 2, 3};
  ASSERT_EQ(Rng(0).state().size(), 4u);
  {
    Rng r;
    r.set_state(zero_first);
    ASSERT_EQ(r.next_u64() >> 11, 0u) << "the test's start must make normal() draw again";
  }
  for (int t : {1, 3}) {
    set_num_threads(t);
    for (size_t n : {size_t(0), size_t(1), size_t(65535), size_t(65536), size_t(65537), size_t(3 * 65536 + 17)}) {
      expect_fill_normal_matches_the_loop<float>(Rng(42).state(), n, 0.02);
      expect_fill_normal_matches_the_loop<double>(Rng(7).state(), n, 1.5);
    }
    expect_fill_normal_matches_the_loop<float>(zero_first, 65536 + 5, 0.02);
  }
  set_num_threads(threads);
}

TEST(Parallel, CoversEveryIndexOnce) {
  std::vector<std::atomic<int>> hits(10007);
  parallel_for(10007, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[i]++;
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  // Nested calls run inline rather than deadlocking.
  std::atomic<int> total{0};
  parallel_for(8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      parallel_for(100, [&](int64_t b2, int64_t e2) { total += static_cast<int>(e2 - b2); });
  });
  EXPECT_EQ(total.load(), 800);
}

// Every task runs even when some throw; the lowest index's exception comes back.
TEST(Parallel, TasksRethrowTheLowestFailure) {
  const int original = num_threads();
  set_num_threads(4);
  std::vector<std::atomic<int>> ran(9);
  try {
    parallel_tasks(9, [&](int64_t i) {
      ran[size_t(i)]++;
      if (i == 7 || i == 3) throw esplag::Error("task " + std::to_string(i));
    });
    ADD_FAILURE() << "no exception";
  } catch (const esplag::Error& e) {
    EXPECT_STREQ(e.what(), "task 3");
  }
  for (auto& r : ran) EXPECT_EQ(r.load(), 1);
  std::atomic<int> sum{0};
  parallel_tasks(5, [&](int64_t i) { sum += static_cast<int>(i); });
  EXPECT_EQ(sum.load(), 10);
  set_num_threads(original);
}

TEST(Parallel, ResizingAfterARunIsSafe) {
  const int original = num_threads();
  for (int n : {3, 1, 2, 4}) {
    set_num_threads(n);
    EXPECT_EQ(num_threads(), n);
    std::atomic<int64_t> sum{0};
    parallel_for(1000, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sum += i;
    });
    EXPECT_EQ(sum.load(), 999 * 1000 / 2);
  }
  set_num_threads(original);
}
