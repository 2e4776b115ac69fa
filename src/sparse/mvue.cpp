#include "sparse/mvue.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"

namespace esplag::cpu {

namespace {

void check_shape(const char* what, const std::string& name, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && cols % 4 == 0, what, ": tensor '", name, "' of shape [", rows, ", ", cols,
               "]: cols must be a multiple of 4 (groups of 4 along a row)");
}

// Calls fn(group index, row, first column) for every group, rows split over the workers.
template <typename Fn>
void for_each_group(int64_t rows, int64_t cols, Fn fn) {
  const int64_t groups = cols / 4;
  parallel_for(
      rows,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t g = 0; g < groups; ++g) fn(r * groups + g, r, 4 * g);
      },
      16);
}

}  // namespace

void mvue_24(const float* in, float* out, uint8_t* mask, int64_t rows, int64_t cols, uint64_t seed,
             const std::string& name) {
  check_shape("mvue_24", name, rows, cols);
  for_each_group(rows, cols, [&](int64_t group, int64_t r, int64_t c0) {
    const int64_t base = r * cols + c0;
    const float a[4] = {in[base], in[base + 1], in[base + 2], in[base + 3]};
    const auto g = sparse_detail::mvue_24_group(a, sparse_detail::mvue_uniform24(seed, static_cast<uint64_t>(group)));
    for (int i = 0; i < 4; ++i) {
      out[base + i] = g.out[i];
      if (mask) mask[base + i] = static_cast<uint8_t>(g.keep >> i & 1u);
    }
  });
}

void mvue_24_bf16(const uint16_t* in, uint16_t* out, uint8_t* mask, int64_t rows, int64_t cols, uint64_t seed,
                  const std::string& name) {
  check_shape("mvue_24_bf16", name, rows, cols);
  for_each_group(rows, cols, [&](int64_t group, int64_t r, int64_t c0) {
    const int64_t base = r * cols + c0;
    const uint16_t bits[4] = {in[base], in[base + 1], in[base + 2], in[base + 3]};
    const float a[4] = {bf16_to_float(bits[0]), bf16_to_float(bits[1]), bf16_to_float(bits[2]),
                        bf16_to_float(bits[3])};
    const auto g = sparse_detail::mvue_24_group(a, sparse_detail::mvue_uniform24(seed, static_cast<uint64_t>(group)));
    for (int i = 0; i < 4; ++i) {
      const bool kept = g.keep >> i & 1u;
      out[base + i] = !kept ? uint16_t(0) : g.scaled ? float_to_bf16(g.out[i]) : bits[i];
      if (mask) mask[base + i] = static_cast<uint8_t>(kept);
    }
  });
}

}  // namespace esplag::cpu
