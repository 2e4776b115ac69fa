// A CPU Linear layer's buffers for the layer tests: its flat-buffer slices (weight and bias
// drawn from a seed, zero gradients) owned in one place, and random vectors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/linear.h"

namespace esplag::testing {

template <typename T>
struct LayerBuffers {
  std::vector<T> w, b, dw, db;
  LinearParams<T> p;
  LayerBuffers(int out, int in, uint64_t seed, bool bias = true, const std::string& module = "blocks.0.mlp.fc") {
    Rng rng(seed);
    w.resize(size_t(out) * in);
    for (auto& x : w) x = static_cast<T>(rng.normal());
    b.resize(size_t(out));
    for (auto& x : b) x = static_cast<T>(rng.normal() * 0.5);
    dw.assign(w.size(), T(0));
    db.assign(b.size(), T(0));
    p.name = module + ".weight";
    p.module = module;
    p.layer = 0;
    p.in_features = in;
    p.out_features = out;
    p.weight = w.data();
    p.dweight = dw.data();
    if (bias) {
      p.bias = b.data();
      p.dbias = db.data();
    }
  }
  LayerBuffers(const LayerBuffers&) = delete;
  LayerBuffers& operator=(const LayerBuffers&) = delete;
};

// n values drawn from N(0, scale²) by Rng(seed).
template <typename T>
std::vector<T> randv(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(rng.normal() * scale);
  return v;
}

}  // namespace esplag::testing
