// Helpers shared by the 2:4 sparsification kernels (sparsify_tiles.cu, sparsify_rows.cu):
// the magnitude key, the greedy tile mask with its 16-key sorting network, top-2
// selections, the compressed-slot rule, 4×4 tile transposes, the metadata-word gather and
// the launchers' argument checks. The per-tile logic is __host__ __device__ so that
// tests/gpu_sparsify.cu checks it against the CPU references on the host as well.
// Internal to sparse/cuda; include sparse/cuda/sparsify.h for the public API.
#pragma once

#ifndef __CUDACC__
#error "sparse/cuda/sparsify_device.h is for CUDA sources only"
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "core/error.h"
#include "sparse/cuda/sparsify.h"

#define ESPLAG_SPARSIFY_HD __host__ __device__ __forceinline__

namespace esplag::gpu::sparsify_detail {

// --- portable bit operations (device intrinsics, host equivalents) ----------------------

ESPLAG_SPARSIFY_HD uint32_t popc(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#else
  return static_cast<uint32_t>(__builtin_popcount(x));
#endif
}

// The 16 low bits of x in reverse order.
ESPLAG_SPARSIFY_HD uint32_t reverse16(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __brev(x) >> 16;
#else
  uint32_t r = 0;
  for (int i = 0; i < 16; ++i) r |= ((x >> i) & 1u) << (15 - i);
  return r;
#endif
}

// PTX prmt (selector nibbles 0..7 only): byte n of the result is byte s_n of the 8-byte
// value b:a.
ESPLAG_SPARSIFY_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, s);
#else
  const uint64_t ab = uint64_t(b) << 32 | a;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<uint32_t>((ab >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
#endif
}

// --- ranking ------------------------------------------------------------------------------

// The rank key of a bf16 value (raw bits): |x| as its 15 magnitude bits, which order like
// the magnitudes for every non-NaN value (±0 both 0); NaN ranks as +inf (sparse/magnitude.h).
ESPLAG_SPARSIFY_HD uint32_t magnitude_key(uint32_t bits) {
  const uint32_t m = bits & 0x7fffu;
  return m > 0x7f80u ? 0x7f80u : m;
}

// Batcher's odd-even merge sort for 16 keys (63 comparators), built at compile time and
// unrolled into straight-line min/max code with register operands.
struct SortNet16 {
  int size = 0;
  int a[64] = {};
  int b[64] = {};
};
constexpr SortNet16 make_sort_net16() {
  SortNet16 s;
  constexpr int n = 16;
  for (int p = 1; p < n; p += p)
    for (int k = p; k > 0; k /= 2)
      for (int j = k % p; j + k < n; j += k + k)
        for (int i = 0; i < k && i + j + k < n; ++i)
          if ((i + j) / (p + p) == (i + j + k) / (p + p)) {
            s.a[s.size] = i + j;
            s.b[s.size] = i + j + k;
            ++s.size;
          }
  return s;
}
inline constexpr SortNet16 kSortNet16 = make_sort_net16();
static_assert(kSortNet16.size == 63, "Batcher's network for 16 keys has 63 comparators");

template <int A, int B>
ESPLAG_SPARSIFY_HD void compare_exchange_desc(uint32_t (&k)[16]) {
  const uint32_t x = k[A], y = k[B];
  k[A] = x > y ? x : y;
  k[B] = x > y ? y : x;
}
template <size_t... S>
ESPLAG_SPARSIFY_HD void run_sort_net16(uint32_t (&k)[16], std::index_sequence<S...>) {
  (compare_exchange_desc<kSortNet16.a[S], kSortNet16.b[S]>(k), ...);
}
// Sorts 16 keys, largest first.
ESPLAG_SPARSIFY_HD void sort16_desc(uint32_t (&k)[16]) {
  run_sort_net16(k, std::make_index_sequence<kSortNet16.size>{});
}

// 1 << (n % 32): one funnel shift on the device.
ESPLAG_SPARSIFY_HD uint32_t bit_at(uint32_t n) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(0u, 1u, n);
#else
  return 1u << (n & 31u);
#endif
}

// The greedy transposable mask of one 4×4 tile (cpu::transposable_mask_greedy): values
// visited by magnitude descending, ties by lower row-major index, each kept while its row
// and its column hold fewer than 2. mag[i] = magnitude_key of element i = 4·r + c; bit i of
// the result is element i.
//
// The sort key is mag·2¹³ + rc·2⁵ + (15 - i), where rc = (8 >> r)·16 + (8 >> c) names the
// element's row and column as one bit each (both fall as i grows, so equal magnitudes still
// order by lower index), and j = 15 - i names the element in the tile reversed (bit 4 stays
// 0, so the key's low 5 bits are j). The walk
// keeps two sets in the key's rc bits: the rows and columns holding one kept value (has)
// and those that are full; a value is kept unless its row or column is full, which is a
// handful of integer operations per step (the integer pipe bounds the kernels using this).
ESPLAG_SPARSIFY_HD uint32_t greedy_tile_mask(const uint32_t (&mag)[16]) {
  uint32_t k[16];
#pragma unroll
  for (int i = 0; i < 16; ++i)
    k[i] = (mag[i] << 13) | ((8u >> (i / 4)) << 9) | ((8u >> (i % 4)) << 5) | static_cast<uint32_t>(15 - i);
  sort16_desc(k);
  constexpr uint32_t kRowsCols = 0x1fe0u;
  uint32_t kept = 0, has = 0, full = 0;
#pragma unroll
  for (int s = 0; s < 16; ++s) {
    if (!(k[s] & full)) {
      kept |= bit_at(k[s]);  // bit j: the shift counts modulo 32
      full |= has & k[s];    // a second value fills its row / column
      has |= k[s] & kRowsCols;
    }
  }
  return reverse16(kept);
}

// The 2 best of 4 keys (distinct keys: callers append the tie-breaking index), as 4 bits.
ESPLAG_SPARSIFY_HD uint32_t top2_of4_keys(uint32_t k0, uint32_t k1, uint32_t k2, uint32_t k3) {
  const uint32_t b0 = (k1 > k0) + (k2 > k0) + (k3 > k0);
  const uint32_t b1 = (k0 > k1) + (k2 > k1) + (k3 > k1);
  const uint32_t b2 = (k0 > k2) + (k1 > k2) + (k3 > k2);
  const uint32_t b3 = (k0 > k3) + (k1 > k3) + (k2 > k3);
  return uint32_t(b0 < 2) | uint32_t(b1 < 2) << 1 | uint32_t(b2 < 2) << 2 | uint32_t(b3 < 2) << 3;
}

// The 2 largest magnitudes of 4 (ties: lower position), as 4 bits (cpu::nm_mask 2:4).
ESPLAG_SPARSIFY_HD uint32_t top2_of4(uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  return top2_of4_keys(m0 << 2 | 3u, m1 << 2 | 2u, m2 << 2 | 1u, m3 << 2);
}

// --- compressed slots -----------------------------------------------------------------------

// The stored positions of a group whose kept positions are `kept` (4 bits, at most 2
// set): the kept ones padded with the lowest others, ascending, as the metadata nibble
// first | second << 2 (sparse/compressed.h; compress_24_masked's padding rule). Entry
// `kept` of a 16-nibble table (groups keeping more than 2 cannot occur: nibble 0).
constexpr uint64_t make_slot_nibble_table() {
  uint64_t t = 0;
  for (uint32_t kept = 0; kept < 16; ++kept) {
    uint32_t k = kept, n = 0;
    for (int i = 0; i < 4; ++i) n += (k >> i) & 1u;
    if (n > 2) continue;
    for (int i = 0; i < 4 && n < 2; ++i)
      if (!((k >> i) & 1u)) k |= 1u << i, ++n;
    uint32_t first = 4, second = 4;
    for (int i = 0; i < 4; ++i)
      if ((k >> i) & 1u) (first == 4 ? first : second) = static_cast<uint32_t>(i);
    t |= uint64_t(first | second << 2) << (4 * kept);
  }
  return t;
}
inline constexpr uint64_t kSlotNibbles = make_slot_nibble_table();

ESPLAG_SPARSIFY_HD uint32_t slot_nibble(uint32_t kept) {
  return static_cast<uint32_t>(kSlotNibbles >> (4 * kept)) & 15u;
}

// The two stored values (bf16 bits, first in the low half) of a group held pruned (values
// not kept are 0) in lo = v0 | v1 << 16 and hi = v2 | v3 << 16, with stored positions
// `nib`: one byte permutation, halfword h being bytes 2h, 2h + 1. Padded slots are pruned
// positions, so they store 0.
ESPLAG_SPARSIFY_HD uint32_t slot_values(uint32_t lo, uint32_t hi, uint32_t nib) {
  return byte_perm(lo, hi, 0x1010u + 0x22u * (nib & 3u) + 0x2200u * (nib >> 2));
}

// 32-bit masks keeping the halfwords of kept values: bits 0, 1 of `kept2` for the low
// and high halfword.
ESPLAG_SPARSIFY_HD uint32_t halfword_mask(uint32_t kept2) {
  return (kept2 & 1u) * 0x0000ffffu + (kept2 & 2u) * 0x7fff8000u;
}

// --- 4×4 tiles --------------------------------------------------------------------------------

// Swaps the bits of x selected by `mask` with those `shift` places above them.
ESPLAG_SPARSIFY_HD uint32_t delta_swap(uint32_t x, uint32_t mask, int shift) {
  const uint32_t t = ((x >> shift) ^ x) & mask;
  return x ^ t ^ (t << shift);
}

// Bit (4·c + r) of the result = bit (4·r + c) of `bits`: the 2×2 blocks' corners, then the
// off-diagonal 2×2 blocks.
ESPLAG_SPARSIFY_HD uint32_t transpose_tile_bits(uint32_t bits) {
  return delta_swap(delta_swap(bits, 0x0a0au, 3), 0x00ccu, 6);
}

// A tile of bf16 held as loaded: row r is words lo[r] (columns 0, 1) and hi[r] (columns 2,
// 3), the lower column in the low half.
struct PackedTile {
  uint32_t lo[4], hi[4];
};

ESPLAG_SPARSIFY_HD PackedTile transpose_tile(const PackedTile& t) {
  PackedTile o;
  // Transposed row c = column c: halfword c%2 of the words holding column c in rows 0..3.
  o.lo[0] = byte_perm(t.lo[0], t.lo[1], 0x5410u);
  o.lo[1] = byte_perm(t.lo[0], t.lo[1], 0x7632u);
  o.lo[2] = byte_perm(t.hi[0], t.hi[1], 0x5410u);
  o.lo[3] = byte_perm(t.hi[0], t.hi[1], 0x7632u);
  o.hi[0] = byte_perm(t.lo[2], t.lo[3], 0x5410u);
  o.hi[1] = byte_perm(t.lo[2], t.lo[3], 0x7632u);
  o.hi[2] = byte_perm(t.hi[2], t.hi[3], 0x5410u);
  o.hi[3] = byte_perm(t.hi[2], t.hi[3], 0x7632u);
  return o;
}

// Raw bf16 bits of element i = 4·r + c.
ESPLAG_SPARSIFY_HD uint32_t tile_value(const PackedTile& t, int i) {
  const uint32_t w = (i & 2) ? t.hi[i >> 2] : t.lo[i >> 2];
  return (i & 1) ? w >> 16 : w & 0xffffu;
}

// The greedy transposable mask of a packed tile.
ESPLAG_SPARSIFY_HD uint32_t greedy_mask(const PackedTile& t) {
  uint32_t mag[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) mag[i] = magnitude_key(tile_value(t, i));
  return greedy_tile_mask(mag);
}

// SLoPe's forward mask of a tile: the 2 largest of every row.
ESPLAG_SPARSIFY_HD uint32_t rows_top2_mask(const PackedTile& t) {
  uint32_t bits = 0;
#pragma unroll
  for (int r = 0; r < 4; ++r)
    bits |= top2_of4(magnitude_key(tile_value(t, 4 * r)), magnitude_key(tile_value(t, 4 * r + 1)),
                     magnitude_key(tile_value(t, 4 * r + 2)), magnitude_key(tile_value(t, 4 * r + 3)))
            << (4 * r);
  return bits;
}

// SLoPe's backward mask of a tile: in every column, the 2 largest of the values `forward`
// keeps (ties: lower row); values it prunes rank below all (key 0).
ESPLAG_SPARSIFY_HD uint32_t columns_top2_mask(const PackedTile& t, uint32_t forward) {
  uint32_t bits = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t k[4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
      k[r] = (forward >> (4 * r + c) & 1u) ? ((magnitude_key(tile_value(t, 4 * r + c)) << 2 | (3u - r)) + 1u) : 0u;
    const uint32_t top = top2_of4_keys(k[0], k[1], k[2], k[3]);
#pragma unroll
    for (int r = 0; r < 4; ++r)
      if ((top >> r & 1u) && k[r] != 0) bits |= 1u << (4 * r + c);
  }
  return bits;
}

// The tile with the values `keep` does not keep set to 0.
ESPLAG_SPARSIFY_HD PackedTile prune_tile(const PackedTile& t, uint32_t keep) {
  PackedTile p;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    p.lo[r] = t.lo[r] & halfword_mask(keep >> (4 * r));
    p.hi[r] = t.hi[r] & halfword_mask(keep >> (4 * r + 2));
  }
  return p;
}

// The 4×4 tile at (gr, gc) of a dense row-major W [rows, cols] (bf16 bits, 8-byte aligned
// rows of the tile).
ESPLAG_SPARSIFY_HD PackedTile dense_tile(const uint16_t* w, int64_t cols, int64_t gr, int64_t gc) {
  PackedTile t;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint2 v = *reinterpret_cast<const uint2*>(w + (gr + r) * cols + gc);
    t.lo[r] = v.x;
    t.hi[r] = v.y;
  }
  return t;
}

// The 4×4 tile of a row-wise 2:4 weight W1 [rows, cols] at (gr, gc) from its kept values
// [rows, cols/2] (bf16 bits, kept_values.h's order: per group of 4 its two kept values in
// ascending position) and the tile's forward mask bits (bit 4r + c = element (r, c) kept).
ESPLAG_SPARSIFY_HD PackedTile kept_tile(const uint16_t* kept, int64_t cols, int64_t gr, int64_t gc, uint32_t mask) {
  PackedTile t;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint32_t two = *reinterpret_cast<const uint32_t*>(kept + (gr + r) * (cols / 2) + gc / 2);
    const uint32_t nib = (mask >> (4 * r)) & 15u;
    uint64_t v = 0;
    int k = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if ((nib >> j) & 1u && k < 2) v |= uint64_t((two >> (16 * k++)) & 0xFFFFu) << (16 * j);
    t.lo[r] = uint32_t(v);
    t.hi[r] = uint32_t(v >> 32);
  }
  return t;
}

// The metadata word of row q of a 4-tile-wide word, written by the lane holding the tile
// of quarter q (tile column % 4 == q). a[d] is the packed nibbles (row r at bits 4r) of the
// tile in lane (this lane ^ d), i.e. of quarter q ^ d.
ESPLAG_SPARSIFY_HD uint32_t gather_meta_word(uint32_t q, const uint32_t (&a)[4]) {
  uint32_t word = 0;
#pragma unroll
  for (uint32_t d = 0; d < 4; ++d) word |= ((a[d] >> (4 * q)) & 15u) << (4 * (q ^ d));
  return word;
}

// --- host-side argument checks -----------------------------------------------------------

inline bool aligned_to(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

inline void check_input(const char* fn, const void* in, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(rows == 0 || cols == 0 || in != nullptr, fn, ": null input of shape [", rows, ", ", cols, "]");
  ESPLAG_CHECK(aligned_to(in, 8), fn, ": the input must be 8-byte aligned (4 bf16 are read at once), got address ",
               in);
}

inline void check_out(const char* fn, const char* which, const Sparse24Out& o) {
  ESPLAG_CHECK(aligned_to(o.dense, 8), fn, ": ", which, ".dense must be 8-byte aligned, got address ",
               static_cast<const void*>(o.dense));
  ESPLAG_CHECK(aligned_to(o.values, 4), fn, ": ", which, ".values must be 4-byte aligned, got address ",
               static_cast<const void*>(o.values));
  ESPLAG_CHECK(aligned_to(o.meta, 2), fn, ": ", which, ".meta must be 2-byte aligned, got address ",
               static_cast<const void*>(o.meta));
}

}  // namespace esplag::gpu::sparsify_detail
