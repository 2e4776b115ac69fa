// Helpers shared by the gradient-check tests: random inputs, central finite differences
// in fp64, and element-wise comparison with a useful failure message.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "core/rng.h"

namespace esplag::testing {

inline std::vector<double> randn(size_t n, Rng& rng, double scale = 1.0) {
  std::vector<double> v(n);
  for (auto& x : v) x = rng.normal() * scale;
  return v;
}

// d f / d x[i] for every i, by central differences; x is perturbed in place and restored.
inline std::vector<double> numeric_grad(std::vector<double>& x, const std::function<double()>& f,
                                        double eps = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double fp = f();
    x[i] = saved - eps;
    const double fm = f();
    x[i] = saved;
    g[i] = (fp - fm) / (2 * eps);
  }
  return g;
}

// Σ out[i] * r[i]: a scalar loss whose gradient w.r.t. out is r.
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Expects |got - want| <= atol + rtol * |want| element-wise; reports the worst element.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rtol,
                         double atol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double excess = std::abs(got[i] - want[i]) - (atol + rtol * std::abs(want[i]));
    if (!(excess <= worst_excess) || std::isnan(got[i])) {
      worst_excess = std::isnan(got[i]) ? INFINITY : excess;
      worst = i;
    }
  }
  EXPECT_LE(worst_excess, 0.0) << what << ": element " << worst << " got " << got[worst] << " want "
                               << want[worst];
}

}  // namespace esplag::testing
