// The ranking every mask in sparse/ uses: larger |w| first, equal |w| broken by lower
// index. NaN ranks as +inf so that a NaN weight is kept and surfaces in the loss instead
// of being silently pruned (and so that the order stays a strict weak order).
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

namespace esplag::sparse_detail {

template <typename T>
inline double magnitude(T x) {
  const double a = std::fabs(static_cast<double>(x));
  return std::isnan(a) ? std::numeric_limits<double>::infinity() : a;
}

// True when (ma, ia) ranks before (mb, ib).
inline bool ranks_before(double ma, int64_t ia, double mb, int64_t ib) {
  return ma > mb || (ma == mb && ia < ib);
}

}  // namespace esplag::sparse_detail
