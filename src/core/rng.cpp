#include "core/rng.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"

namespace esplag {

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

void Rng::reseed(uint64_t seed) {
  for (auto& w : s_) w = splitmix64(seed);
}

uint64_t Rng::next_u64() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

uint32_t Rng::below(uint32_t n) {
  // Lemire's multiply-shift with rejection: unbiased and branch-light.
  uint64_t m = static_cast<uint64_t>(static_cast<uint32_t>(next_u64() >> 32)) * n;
  uint32_t low = static_cast<uint32_t>(m);
  if (low < n) {
    const uint32_t threshold = static_cast<uint32_t>(-n) % n;
    while (low < threshold) {
      m = static_cast<uint64_t>(static_cast<uint32_t>(next_u64() >> 32)) * n;
      low = static_cast<uint32_t>(m);
    }
  }
  return static_cast<uint32_t>(m >> 32);
}

double Rng::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

double Rng::normal() {
  double u1 = uniform();
  while (u1 <= 0.0) u1 = uniform();
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

namespace {
// Advances r past one normal(): its first uniform draw repeated while it is 0, then one more.
void skip_normal(Rng& r) {
  while ((r.next_u64() >> 11) == 0) {
  }
  r.next_u64();
}
constexpr size_t kNormalChunk = size_t(1) << 16;  // values per parallel chunk
}  // namespace

template <typename T>
void fill_normal(Rng& rng, T* out, size_t n, double scale) {
  const size_t chunks = (n + kNormalChunk - 1) / kNormalChunk;
  std::vector<Rng::State> starts(chunks);
  for (size_t c = 0; c < chunks; ++c) {
    starts[c] = rng.state();
    const size_t count = std::min(kNormalChunk, n - c * kNormalChunk);
    for (size_t i = 0; i < count; ++i) skip_normal(rng);
  }
  parallel_for(int64_t(chunks), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      Rng r;
      r.set_state(starts[size_t(c)]);
      T* o = out + size_t(c) * kNormalChunk;
      const size_t count = std::min(kNormalChunk, n - size_t(c) * kNormalChunk);
      for (size_t i = 0; i < count; ++i) o[i] = static_cast<T>(r.normal() * scale);
    }
  });
}

template void fill_normal<float>(Rng&, float*, size_t, double);
template void fill_normal<double>(Rng&, double*, size_t, double);

}  // namespace esplag
