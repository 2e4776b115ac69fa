#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace esplag {

void validate(const SamplingOptions& o) {
  ESPLAG_CHECK(std::isfinite(o.temperature) && o.temperature >= 0, "sampling: temperature must be >= 0, got ",
               o.temperature);
  ESPLAG_CHECK(o.top_k >= 0, "sampling: top_k must be >= 0, got ", o.top_k);
  ESPLAG_CHECK(o.top_p > 0 && o.top_p <= 1, "sampling: top_p must be in (0, 1], got ", o.top_p);
}

int32_t sample_token(const float* logits, int n_ids, const SamplingOptions& o, Rng& rng) {
  validate(o);
  ESPLAG_CHECK(n_ids > 0, "sampling: no ids to draw from");
  if (o.temperature == 0) return static_cast<int32_t>(std::max_element(logits, logits + n_ids) - logits);
  // The k most likely ids, most likely first.
  std::vector<int> order(n_ids);
  std::iota(order.begin(), order.end(), 0);
  const int k = o.top_k > 0 ? std::min(o.top_k, n_ids) : n_ids;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int x, int y) { return logits[x] > logits[y] || (logits[x] == logits[y] && x < y); });
  // Their unnormalised probabilities, and the nucleus: the shortest prefix reaching top_p.
  std::vector<double> p(k);
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += p[j] = std::exp((logits[order[j]] - logits[order[0]]) / o.temperature);
  int n = k;
  if (o.top_p < 1) {
    double kept = 0;
    for (n = 0; n < k && kept < o.top_p * sum;) kept += p[n++];
    sum = kept;
  }
  double r = rng.uniform() * sum;
  for (int j = 0; j < n; ++j)
    if ((r -= p[j]) < 0) return order[j];
  return order[n - 1];  // r within rounding of the sum
}

}  // namespace esplag
