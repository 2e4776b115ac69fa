// The host channel between ranks: each rank a thread (its own HostChannel on a free port)
// or, where a rank dies, a forked process. Sums and maxima identical on every rank, sums added in rank
// order, reduce-scatter and gathers, broadcast, barrier, any, large buffers, and failures
// that end every rank with an Error naming the rank instead of hanging.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/host_channel.h"
#include "dist/launch.h"

namespace {

using esplag::HostChannel;
using esplag::World;
using Clock = std::chrono::steady_clock;

World world_of(int rank, int size, int port) {
  World w;
  w.rank = rank;
  w.size = size;
  w.local_rank = rank;
  w.local_size = size;
  w.master_port = port;
  w.launcher = "test";
  return w;
}

// Runs body(channel) for each of `size` ranks, one thread each; returns each rank's error ("" when none).
std::vector<std::string> run_threads(int size, const std::function<void(HostChannel&)>& body, double timeout = 30) {
  const int port = esplag::free_local_port();
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      try {
        auto channel = HostChannel::connect(world_of(r, size, port), 30);
        channel->set_timeout(timeout);
        body(*channel);
      } catch (const esplag::Error& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

TEST(HostChannel, SumIsBitIdenticalAndInRankOrder) {
  // In float, (1e8 + 1) + -1e8 is 0 while 1e8 + (1 + -1e8) is 8 (and other orders give 1):
  // only the sum in rank order gives 0.
  const std::vector<float> per_rank = {1e8f, 1.0f, -1e8f};
  const float expected = (per_rank[0] + per_rank[1]) + per_rank[2];
  ASSERT_EQ(expected, 0.0f);
  std::vector<std::vector<float>> results(3);
  std::vector<std::vector<double>> doubles(3);
  expect_no_errors(run_threads(3, [&](HostChannel& c) {
    std::vector<float> v(1000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = per_rank[c.rank()] + (i % 2 ? 0.1f * c.rank() : 0.0f);
    c.all_reduce_sum(v.data(), v.size());
    results[c.rank()] = v;
    std::vector<double> d = {1e16, 1.0, -1e16};
    std::rotate(d.begin(), d.begin() + c.rank(), d.end());
    c.all_reduce_sum(d.data(), d.size());
    doubles[c.rank()] = d;
  }));
  EXPECT_EQ(results[0][0], 0.0f);
  for (int r = 1; r < 3; ++r) {
    EXPECT_EQ(std::memcmp(results[r].data(), results[0].data(), results[0].size() * sizeof(float)), 0) << r;
    EXPECT_EQ(doubles[r], doubles[0]);
  }
  // Element 0 of the doubles: 1e16 + 1.0 + -1e16 from ranks 0, 1, 2 (rotated per rank) in rank order.
  EXPECT_EQ(doubles[0][0], (1e16 + 1.0) + -1e16);
  EXPECT_EQ(results[0][1], ((1e8f + 0.0f) + (1.0f + 0.1f)) + (-1e8f + 0.2f));
}

TEST(HostChannel, MaxIsElementwiseAndTheSameOnEveryRank) {
  std::vector<std::vector<float>> results(3);
  expect_no_errors(run_threads(3, [&](HostChannel& c) {
    // Element i's largest value is on rank i % 3; -0.0 and 0.0 compare equal (rank 0's stays).
    std::vector<float> v(5'000'000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = size_t(c.rank()) == i % 3 ? float(i) : -float(c.rank());
    v[1] = c.rank() == 0 ? -0.0f : 0.0f;
    c.all_reduce_max(v.data(), v.size());
    results[c.rank()] = v;
  }));
  bool right = true;
  for (size_t i = 2; i < results[0].size(); ++i) right = right && results[0][i] == float(i);
  EXPECT_TRUE(right);
  EXPECT_TRUE(std::signbit(results[0][1]));
  for (int r = 1; r < 3; ++r)
    EXPECT_EQ(std::memcmp(results[r].data(), results[0].data(), results[0].size() * sizeof(float)), 0) << r;
  // A max and a sum are different collectives.
  const auto errors = run_threads(2, [&](HostChannel& c) {
    std::vector<float> v(4);
    c.rank() == 0 ? c.all_reduce_max(v.data(), v.size()) : c.all_reduce_sum(v.data(), v.size());
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(contains(errors[r], "rank 0 all_reduce_max(float), rank 1 all_reduce_sum(float)")) << errors[r];
}

TEST(HostChannel, LargeBuffers) {
  const size_t n = 10'000'000;
  std::vector<double> checksums(4);
  expect_no_errors(run_threads(4, [&](HostChannel& c) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((i % 1000) * (c.rank() + 1));
    c.all_reduce_sum(v.data(), n);
    double s = 0;
    bool right = true;
    for (size_t i = 0; i < n; ++i) {
      right = right && v[i] == static_cast<float>((i % 1000) * 10);
      s += v[i];
    }
    EXPECT_TRUE(right) << "rank " << c.rank();
    checksums[c.rank()] = s;
  }));
  for (int r = 1; r < 4; ++r) EXPECT_EQ(checksums[r], checksums[0]);
}

TEST(HostChannel, BroadcastBarrierAny) {
  std::vector<std::string> got(3);
  std::vector<std::vector<bool>> anys(3);
  expect_no_errors(run_threads(3, [&](HostChannel& c) {
    std::string s = c.rank() == 0 ? std::string(3'000'000, 'x') + "end" : "stale";
    c.broadcast(s);
    std::string from_two = c.rank() == 2 ? "from rank 2" : "";
    c.broadcast(from_two, 2);
    got[c.rank()] = s.substr(s.size() - 3) + std::to_string(s.size()) + " " + from_two;
    c.barrier();
    anys[c.rank()] = {c.any(false), c.any(c.rank() == 1), c.any(true)};
    std::string empty = c.rank() == 1 ? "" : "not empty";
    c.broadcast(empty, 1);
    EXPECT_EQ(empty, "");
  }));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(got[r], "end3000003 from rank 2") << r;
    EXPECT_EQ(anys[r], (std::vector<bool>{false, true, true})) << r;
  }
}

TEST(HostChannel, ReduceScatterIsTheAllReducesRangeInRankOrder) {
  // Ranges of 3, 0 and 5 elements (a rank may own nothing); each rank's values are those of
  // the all_reduce test, so only the sum in rank order gives the same bits.
  const std::vector<size_t> counts = {3, 0, 5};
  const std::vector<float> per_rank = {1e8f, 1.0f, -1e8f};
  std::vector<std::vector<float>> scattered(3), reduced(3);
  expect_no_errors(run_threads(3, [&](HostChannel& c) {
    std::vector<float> v(8);
    for (size_t i = 0; i < v.size(); ++i) v[i] = per_rank[c.rank()] * (i + 1) + 0.1f * c.rank() * i;
    std::vector<float> mine(counts[c.rank()], -7.0f);
    c.reduce_scatter_sum(v.data(), counts, mine.data());
    scattered[c.rank()] = mine;
    c.all_reduce_sum(v.data(), v.size());
    reduced[c.rank()] = v;
  }));
  EXPECT_EQ(scattered[0][0], 0.0f);
  EXPECT_EQ(scattered[1].size(), 0u);
  const std::vector<float> joined = [&] {
    std::vector<float> all;
    for (const auto& s : scattered) all.insert(all.end(), s.begin(), s.end());
    return all;
  }();
  ASSERT_EQ(joined.size(), 8u);
  EXPECT_EQ(std::memcmp(joined.data(), reduced[0].data(), 8 * sizeof(float)), 0);
}

TEST(HostChannel, AllGatherAndGatherConcatenateInRankOrder) {
  const std::vector<size_t> counts = {2, 3, 0, 1};
  std::vector<std::vector<float>> all(4), to_zero(4);
  expect_no_errors(run_threads(4, [&](HostChannel& c) {
    std::vector<float> mine(counts[c.rank()]);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = 10.0f * c.rank() + i;
    std::vector<float> out(6, -1.0f);
    c.all_gather(mine.data(), counts, out.data());
    all[c.rank()] = out;
    std::fill(out.begin(), out.end(), -1.0f);
    c.gather(mine.data(), counts, out.data());
    to_zero[c.rank()] = out;
  }));
  const std::vector<float> expected = {0, 1, 10, 11, 12, 30};
  for (int r = 0; r < 4; ++r) EXPECT_EQ(all[r], expected) << r;
  EXPECT_EQ(to_zero[0], expected);
  for (int r = 1; r < 4; ++r) EXPECT_EQ(to_zero[r], std::vector<float>(6, -1.0f)) << r;  // untouched
}

TEST(HostChannel, LargeReduceScatterAndAllGather) {
  // Far more than the sockets buffer: the exchange must not wait on itself.
  const size_t n = 10'000'001;
  const std::vector<size_t> counts = {2'500'001, 2'500'000, 2'500'000, 2'500'000};
  std::vector<int> right(4);
  expect_no_errors(run_threads(4, [&](HostChannel& c) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((i % 1000) * (c.rank() + 1));
    std::vector<float> mine(counts[c.rank()]);
    c.reduce_scatter_sum(v.data(), counts, mine.data());
    std::fill(v.begin(), v.end(), 0.0f);
    c.all_gather(mine.data(), counts, v.data());
    bool ok = true;
    for (size_t i = 0; i < n; ++i) ok = ok && v[i] == static_cast<float>((i % 1000) * 10);
    right[c.rank()] = ok;
  }));
  EXPECT_EQ(right, (std::vector<int>{1, 1, 1, 1}));
}

TEST(HostChannel, GathersOfDifferentShapesAreAnError) {
  const auto totals = run_threads(2, [&](HostChannel& c) {
    std::vector<float> v(10), out(5);
    c.reduce_scatter_sum(v.data(), c.rank() == 0 ? std::vector<size_t>{5, 5} : std::vector<size_t>{5, 4}, out.data());
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(contains(totals[r], "reduce_scatter_sum of different sizes: 10 elements in all on rank 0, 9 on rank 1"))
        << totals[r];
  const auto counts = run_threads(2, [&](HostChannel& c) {
    std::vector<float> mine(5), out(10);
    c.all_gather(mine.data(), c.rank() == 0 ? std::vector<size_t>{5, 5} : std::vector<size_t>{6, 4}, out.data());
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(contains(counts[r], "all_gather: rank 1 sent 4 elements, rank 0 expected 5")) << counts[r];
}

TEST(HostChannel, OneRankNeedsNoPeers) {
  auto c = HostChannel::connect(World{});
  float x = 2.5f;
  c->all_reduce_sum(&x, 1);
  EXPECT_EQ(x, 2.5f);
  EXPECT_TRUE(c->any(true));
  c->barrier();
  const float two[2] = {1.0f, 2.0f};
  float out[2] = {};
  c->reduce_scatter_sum(two, {2}, out);
  EXPECT_EQ(out[1], 2.0f);
  out[1] = 0;
  c->all_gather(two, {2}, out);
  EXPECT_EQ(out[1], 2.0f);
}

TEST(HostChannel, DifferentCollectivesAreAnError) {
  const auto errors = run_threads(3, [&](HostChannel& c) {
    if (c.rank() == 1) {
      c.barrier();
    } else {
      std::vector<float> v(10);
      c.all_reduce_sum(v.data(), v.size());
    }
  });
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(contains(errors[r], "different collectives: rank 0 all_reduce_sum(float), rank 1 barrier")) << errors[r];
  const auto sizes = run_threads(2, [&](HostChannel& c) {
    std::vector<double> v(c.rank() == 0 ? 10 : 12);
    c.all_reduce_sum(v.data(), v.size());
  });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(contains(sizes[r], "80 bytes on rank 0, 96 on rank 1")) << sizes[r];
}

TEST(HostChannel, LateRankTimesOutNamingIt) {
  const auto start = Clock::now();
  const auto errors = run_threads(
      3,
      [&](HostChannel& c) {
        if (c.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        c.barrier();
      },
      0.3);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10);
  // Rank 0 waited for rank 2 and told rank 1; rank 2 comes late to a closed run.
  EXPECT_TRUE(contains(errors[0], "rank 2 did not answer within 0.3 s during barrier")) << errors[0];
  EXPECT_EQ(errors[1], errors[0]);
  EXPECT_FALSE(errors[2].empty());
}

TEST(HostChannel, ConnectTimesOutWithoutRankZero) {
  const int port = esplag::free_local_port();
  const auto start = Clock::now();
  try {
    HostChannel::connect(world_of(1, 2, port), 0.5);
    FAIL() << "connected without rank 0";
  } catch (const esplag::Error& e) {
    EXPECT_TRUE(contains(e.what(), "rank 1 could not connect to rank 0 at 127.0.0.1:" + std::to_string(port)))
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5);
  try {
    HostChannel::connect(world_of(0, 3, port), 0.3);
    FAIL() << "rank 0 connected without the others";
  } catch (const esplag::Error& e) {
    EXPECT_TRUE(contains(e.what(), "only 1 of 3 ranks arrived")) << e.what();
    EXPECT_TRUE(contains(e.what(), "missing: rank 1, 2")) << e.what();
  }
}

// Forks one process per rank running body(channel); returns what each wrote to its pipe (its
// error, or "ok") with its exit status.
struct RankResult {
  std::string message;
  int status = 0;
};
std::vector<RankResult> run_processes(int size, const std::function<void(HostChannel&)>& body) {
  const int port = esplag::free_local_port();
  std::vector<pid_t> pids;
  std::vector<int> pipes;
  for (int r = 0; r < size; ++r) {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      std::string message = "ok";
      try {
        auto channel = HostChannel::connect(world_of(r, size, port), 30);
        channel->set_timeout(20);
        body(*channel);
      } catch (const esplag::Error& e) {
        message = e.what();
      }
      [[maybe_unused]] const ssize_t written = ::write(fds[1], message.data(), message.size());
      ::_exit(0);
    }
    ::close(fds[1]);
    pids.push_back(pid);
    pipes.push_back(fds[0]);
  }
  std::vector<RankResult> results(size);
  for (int r = 0; r < size; ++r) {
    char buf[4096];
    for (ssize_t k; (k = ::read(pipes[r], buf, sizeof buf)) > 0;) results[r].message.append(buf, k);
    ::close(pipes[r]);
    ::waitpid(pids[r], &results[r].status, 0);
  }
  return results;
}

TEST(HostChannel, RankDyingEndsTheOthers) {
  for (const int dying : {1, 0}) {
    const auto start = Clock::now();
    const auto results = run_processes(3, [&](HostChannel& c) {
      std::vector<float> v(100000, 1.0f);
      for (int step = 0; step < 5; ++step) {
        if (step == 3 && c.rank() == dying) ::raise(SIGKILL);
        c.all_reduce_sum(v.data(), v.size());
      }
    });
    // Every other rank ends with the error, well within the collective timeout (20 s).
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10);
    for (int r = 0; r < 3; ++r) {
      if (r == dying) {
        EXPECT_TRUE(WIFSIGNALED(results[r].status));
        continue;
      }
      EXPECT_TRUE(contains(results[r].message, "rank " + std::to_string(dying) + " left the run")) << results[r].message;
      EXPECT_TRUE(contains(results[r].message, "during all_reduce_sum")) << results[r].message;
    }
  }
}

TEST(HostChannel, AfterAFailureEveryCallThrows) {
  const auto results = run_processes(2, [&](HostChannel& c) {
    if (c.rank() == 1) ::_exit(3);
    try {
      c.barrier();
    } catch (const esplag::Error&) {
    }
    c.any(false);
  });
  EXPECT_TRUE(contains(results[0].message, "rank 1 left the run (connection closed) during barrier")) << results[0].message;
  EXPECT_TRUE(contains(results[0].message, "an earlier collective failed")) << results[0].message;
}

}  // namespace
