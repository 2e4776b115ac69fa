// Seeded random numbers, reproducible across runs and machines (no std::distribution,
// whose output is implementation-defined). The whole state is four words, so
// checkpoints save it and a resumed run draws exactly what the uninterrupted one would.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>

namespace esplag {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) { reseed(seed); }
  void reseed(uint64_t seed);

  uint64_t next_u64();                  // xoshiro256**
  uint32_t below(uint32_t n);           // uniform in [0, n), unbiased
  double uniform();                     // [0, 1), 53 random bits
  double normal();                      // standard normal (Box-Muller, no cached spare)

  using State = std::array<uint64_t, 4>;
  State state() const { return s_; }
  void set_state(const State& s) { s_ = s; }

 private:
  State s_{};
};

// out[i] = T(rng.normal() * scale) for i in [0, n): the values, and the state rng is left
// in, are exactly those of that loop, but the values are drawn in parallel (core/parallel.h).
// One sequential pass advances the generator as normal() would, taking its uniform draws
// without the logarithm, root and cosine that make a normal about seven times dearer, and
// records where each chunk of values starts; then the chunks are drawn concurrently.
// For the initialisation of large models (llama-1b: 953M values, about 28 s one after the
// other).
template <typename T>
void fill_normal(Rng& rng, T* out, size_t n, double scale);

}  // namespace esplag
