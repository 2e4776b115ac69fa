// Choosing the next token (model/sampling.h): greedy is the argmax, top-k and top-p draw only
// inside their sets and in proportion to softmax(logits / temperature) there, only the first
// n_ids ids are ever drawn, a seed gives the same draws, and bad options are Errors naming them.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "model/sampling.h"
#include "test_util.h"

using namespace esplag;

namespace {

// Logits whose softmax at temperature 1 is `probs`.
std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

// How often each id is drawn in n draws.
std::map<int, double> frequencies(const std::vector<float>& logits, int n_ids, const SamplingOptions& o, int n,
                                  uint64_t seed = 1) {
  Rng rng(seed);
  std::map<int, double> f;
  for (int i = 0; i < n; ++i) f[sample_token(logits.data(), n_ids, o, rng)] += 1;
  for (auto& [id, count] : f) count /= n;
  return f;
}

}  // namespace

TEST(Sampling, GreedyIsTheArgmaxOfTheFirstNIdsAndDrawsNothing) {
  const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f, 9.0f};
  Rng rng(3);
  const Rng::State before = rng.state();
  EXPECT_EQ(sample_token(l.data(), 5, {.temperature = 0}, rng), 4);
  EXPECT_EQ(sample_token(l.data(), 4, {.temperature = 0}, rng), 1);  // ties: the lowest id; id 4 is not drawable
  EXPECT_EQ(rng.state(), before);
}

TEST(Sampling, DrawsFollowTheSoftmaxAtTheTemperature) {
  const std::vector<float> l = logits_of({0.5, 0.3, 0.2});
  auto f = frequencies(l, 3, {.temperature = 1, .top_k = 0}, 20000);
  EXPECT_NEAR(f[0], 0.5, 0.015);
  EXPECT_NEAR(f[1], 0.3, 0.015);
  EXPECT_NEAR(f[2], 0.2, 0.015);
  // At temperature 1/2 the probabilities go as p²: 25 : 9 : 4.
  f = frequencies(l, 3, {.temperature = 0.5, .top_k = 0}, 20000);
  EXPECT_NEAR(f[0], 25.0 / 38, 0.015);
  EXPECT_NEAR(f[2], 4.0 / 38, 0.015);
}

TEST(Sampling, TopKDrawsOnlyTheKMostLikely) {
  // Ids 1, 3, 6 are the three most likely; id 7, the likeliest of all, is past n_ids.
  const std::vector<float> l = {0.1f, 3.0f, 0.2f, 2.5f, 0.0f, -2.0f, 2.9f, 50.0f};
  const auto f = frequencies(l, 7, {.temperature = 100, .top_k = 3}, 3000);
  EXPECT_EQ(f.size(), 3u);
  for (int id : {1, 3, 6}) EXPECT_GT(f.count(id) ? f.at(id) : 0.0, 0.25) << id;  // near-uniform at temperature 100
  EXPECT_EQ(frequencies(l, 7, {.temperature = 100, .top_k = 1}, 200), (std::map<int, double>{{1, 1.0}}));
}

TEST(Sampling, TopPDrawsOnlyTheNucleus) {
  // Probabilities 0.1, 0.5, 0.1, 0.3: the nucleus of 0.75 is {1, 3} (0.5 < 0.75 <= 0.8).
  const std::vector<float> l = logits_of({0.1, 0.5, 0.1, 0.3});
  auto f = frequencies(l, 4, {.temperature = 1, .top_k = 0, .top_p = 0.75}, 20000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_NEAR(f[1], 0.5 / 0.8, 0.015);  // renormalised within the nucleus
  EXPECT_NEAR(f[3], 0.3 / 0.8, 0.015);
  EXPECT_EQ(frequencies(l, 4, {.temperature = 1, .top_k = 0, .top_p = 0.45}, 500), (std::map<int, double>{{1, 1.0}}));
  // top-k applies first: of {1, 3, 0} (0 before 2 by id), 0.75 of their mass keeps {1, 3}.
  f = frequencies(l, 4, {.temperature = 1, .top_k = 3, .top_p = 0.75}, 2000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_EQ(frequencies(l, 4, {.temperature = 1, .top_k = 0, .top_p = 1}, 20000).size(), 4u);
}

TEST(Sampling, TheSameSeedGivesTheSameDraws) {
  std::vector<float> l(50);
  for (int i = 0; i < 50; ++i) l[i] = static_cast<float>(std::sin(i));
  auto draws = [&](uint64_t seed) {
    Rng rng(seed);
    std::vector<int> d;
    for (int i = 0; i < 100; ++i)
      d.push_back(sample_token(l.data(), 50, {.temperature = 1, .top_k = 20, .top_p = 0.9}, rng));
    return d;
  };
  EXPECT_EQ(draws(7), draws(7));
  EXPECT_NE(draws(7), draws(8));
}

TEST(Sampling, BadOptionsAreErrorsNamingThem) {
  using esplag::testing::error_of;
  const float l[2] = {0, 1};
  Rng rng(1);
  auto msg = [&](SamplingOptions o) { return error_of([&] { sample_token(l, 2, o, rng); }); };
  for (double p : {0.0, -0.5, 1.5, std::nan("")})
    EXPECT_NE(msg({.top_p = p}).find("top_p must be in (0, 1]"), std::string::npos) << p;
  for (double t : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()})
    EXPECT_NE(msg({.temperature = t}).find("temperature must be >= 0"), std::string::npos) << t;
  EXPECT_NE(msg({.top_k = -1}).find("top_k must be >= 0"), std::string::npos);
  EXPECT_NE(error_of([&] { sample_token(l, 0, {}, rng); }).find("no ids"), std::string::npos);
}
