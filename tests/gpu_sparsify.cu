// The 2:4 sparsification kernels (sparse/cuda/sparsify.h) against their CPU references:
// transposable greedy (cpu::transposable_mask_greedy), SLoPe double pruning
// (cpu::double_prune_masks), activations by rows (cpu::nm_mask 2:4) and by tiles
// (SemiSparseActivationLinear::sparsify_input), MVUE (cpu::mvue_24_bf16). Every output
// must equal the CPU result bit for bit: pruned values, transposes, compressed values and
// metadata (built by linear_detail::compress_24_masked from the CPU mask) and tile masks.
//
// Inputs are fresh seeded bf16 values of three kinds: Gaussian, heavily tied (magnitudes
// from {0, 1, 2}: the tie rules decide most tiles) and special (NaN, ±inf, -0 mixed in).
// Outputs are poisoned (all bytes 0xFF) before each launch. Sizes include the smallest
// legal ones, non-square ones, sizes that are not multiples of the 64×64 block or of the
// 16-value metadata word, and misaligned (8- but not 16-byte) pointers.
//
// GpuSparsify.Timing prints bench_sparsify's table (timings are not asserted).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/linear_kinds.h"
#include "model/linear_semi_sparse.h"
#include "sparse/compressed.h"
#include "sparse/cuda/sparsify.h"
#include "bench/lib/sparsify.h"
#include "sparse/cuda/sparsify_device.h"
#include "sparse/double_prune.h"
#include "sparse/masks.h"
#include "sparse/mvue.h"
#include "sparse/transposable.h"

#include "gpu_test_util.h"

namespace {

using esplag::DeviceArena;
using esplag::Rng;
using esplag::gpu::bf16;
using esplag::gpu::Sparse24Out;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;

using Bits = std::vector<uint16_t>;
using Mask = std::vector<uint8_t>;

using esplag::cpu::tile_bits;
using esplag::gpu_test::has_device;

// ---------------------------------------------------------------------------------------
// Host data

enum class Kind { gaussian, tied, special };
const char* kind_name(Kind k) { return k == Kind::gaussian ? "gaussian" : k == Kind::tied ? "tied" : "special"; }

Bits random_bits(int64_t n, Kind kind, uint64_t seed) {
  Rng rng(seed);
  Bits b(static_cast<size_t>(n));
  for (auto& x : b) {
    float f = static_cast<float>(rng.normal());
    if (kind == Kind::tied) f = static_cast<float>(static_cast<int>(rng.below(5)) - 2);
    x = esplag::float_to_bf16(f);
    if (kind == Kind::special) {
      const uint32_t pick = rng.below(40);
      if (pick == 0) x = 0x7fc0;       // NaN
      else if (pick == 1) x = 0x7f80;  // +inf
      else if (pick == 2) x = 0xff80;  // -inf
      else if (pick == 3) x = 0x8000;  // -0
      else if (pick == 4) x = 0x0000;  // +0
    }
  }
  return b;
}

std::vector<float> to_float(const Bits& b) { return esplag::gpu_test::bits_to_float(b); }

template <typename T>
std::vector<T> transpose(const std::vector<T>& a, int64_t rows, int64_t cols) {
  std::vector<T> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

Bits apply(const Bits& b, const Mask& m) {
  Bits out(b.size());
  for (size_t i = 0; i < b.size(); ++i) out[i] = m[i] ? b[i] : uint16_t(0);
  return out;
}

// The expected compressed form of `bits` [rows, cols] kept by `mask`: the metadata of
// compress_24_masked (the project's CPU compression) and the raw bits at its slots.
struct Compressed {
  Bits values;
  std::vector<uint16_t> meta;
};
Compressed compress(const Bits& bits, const Mask& mask, int64_t rows, int64_t cols) {
  const std::vector<float> f = to_float(bits);
  const auto c = esplag::linear_detail::compress_24_masked(f.data(), mask.data(), rows, cols, "expected");
  Compressed out;
  out.meta = c.meta;
  out.values.resize(c.values.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < cols / 4; ++g)
      for (int j = 0; j < 2; ++j) {
        const int64_t pos = r * cols + c.column(r, g, j);
        out.values[r * cols / 2 + 2 * g + j] = mask[pos] ? bits[pos] : uint16_t(0);
      }
  return out;
}

// ---------------------------------------------------------------------------------------
// Device buffers

// Every buffer has one poisoned element past its end, which get() checks is untouched.
class Dev : public esplag::gpu_test::DeviceBuffers {
 public:
  Dev() : DeviceBuffers(size_t(512) << 20) {}

  template <typename T>
  T* put(const std::vector<T>& h, size_t offset_elems = 0) {
    T* d = arena().allocate_array<T>("input", h.size() + offset_elems + 1) + offset_elems;
    CUDA_CHECK(cudaMemset(d + h.size(), 0xFF, sizeof(T)));  // poisoned, for in-place checks
    CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  bf16* put_bf16(const Bits& h, size_t offset_elems = 0) { return reinterpret_cast<bf16*>(put(h, offset_elems)); }
  template <typename T>
  T* poisoned(size_t n, size_t offset_elems = 0) {
    T* d = arena().allocate_array<T>("output", n + offset_elems + 1) + offset_elems;
    CUDA_CHECK(cudaMemset(d, 0xFF, (n + 1) * sizeof(T)));
    return d;
  }
  bf16* poisoned_bf16(size_t n, size_t offset_elems = 0) {
    return reinterpret_cast<bf16*>(poisoned<uint16_t>(n, offset_elems));
  }
  // Reads n values, and checks the one past the end was not written.
  template <typename T>
  std::vector<T> get(const T* d, size_t n) {
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    CUDA_CHECK(cudaGetLastError());
    std::vector<T> h(n + 1);
    CUDA_CHECK(cudaMemcpy(h.data(), d, (n + 1) * sizeof(T), cudaMemcpyDeviceToHost));
    T poison;
    std::memset(&poison, 0xFF, sizeof(T));
    EXPECT_EQ(std::memcmp(&h[n], &poison, sizeof(T)), 0) << "written past the end of an output of " << n;
    h.pop_back();
    return h;
  }
  Bits get_bits(const bf16* d, size_t n) { return get(reinterpret_cast<const uint16_t*>(d), n); }
};

// Every form of one 2:4 result, poisoned.
struct Outs {
  int64_t rows, cols;
  Sparse24Out o;
  Outs(Dev& dev, int64_t r, int64_t c, size_t offset = 0) : rows(r), cols(c) {
    o.dense = dev.poisoned_bf16(size_t(r * c), offset);
    o.values = dev.poisoned_bf16(size_t(r * c / 2), offset);
    o.meta = dev.poisoned<uint16_t>(size_t(r * ((c + 15) / 16)));
  }
};

// Compares a device 2:4 result (any of its forms not null) with the expected one.
void expect_result(Dev& dev, const std::string& what, const Sparse24Out& o, int64_t rows, int64_t cols,
                   const Bits& bits, const Mask& mask) {
  if (o.dense) EXPECT_EQ(dev.get_bits(o.dense, size_t(rows * cols)), apply(bits, mask)) << what << ": dense";
  if (o.values || o.meta) {
    const Compressed c = compress(bits, mask, rows, cols);
    if (o.values) EXPECT_EQ(dev.get_bits(o.values, c.values.size()), c.values) << what << ": compressed values";
    if (o.meta) EXPECT_EQ(dev.get(o.meta, c.meta.size()), c.meta) << what << ": metadata";
  }
}

class GpuSparsify : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"; }
};

struct Shape {
  int64_t rows, cols;
};
// Smallest legal, thin, non-square, not multiples of the 64×64 block or of 16 columns.
const std::vector<Shape> kTileShapes = {{4, 4},    {4, 8},    {8, 12},   {4, 1000},  {1000, 4}, {20, 36},
                                        {68, 132}, {132, 68}, {64, 64},  {128, 192}, {516, 1028}};

std::string label(const char* op, Shape s, Kind k) {
  return std::string(op) + " [" + std::to_string(s.rows) + ", " + std::to_string(s.cols) + "] " + kind_name(k);
}

}  // namespace

// ---------------------------------------------------------------------------------------

TEST(GpuSparsifyNet, SortingNetworkSortsEveryZeroOneInput) {
  // The 0-1 principle: a comparator network that sorts all 2^16 0/1 inputs sorts everything.
  const auto& net = gpu::sparsify_detail::kSortNet16;
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
    uint32_t k[16];
    for (int i = 0; i < 16; ++i) k[i] = bits >> i & 1u;
    for (int s = 0; s < net.size; ++s) {
      const uint32_t hi = std::max(k[net.a[s]], k[net.b[s]]), lo = std::min(k[net.a[s]], k[net.b[s]]);
      k[net.a[s]] = hi;
      k[net.b[s]] = lo;
    }
    for (int i = 1; i < 16; ++i) ASSERT_GE(k[i - 1], k[i]) << "input " << bits;
  }
}

// The per-tile logic the kernels run, checked on the host (no device needed) against the
// CPU references on exhaustive or many random tiles.
namespace tile_logic {

namespace sd = gpu::sparsify_detail;

sd::PackedTile pack(const uint16_t* v) {  // v: 16 values, row-major
  sd::PackedTile t;
  for (int r = 0; r < 4; ++r) {
    t.lo[r] = v[4 * r] | uint32_t(v[4 * r + 1]) << 16;
    t.hi[r] = v[4 * r + 2] | uint32_t(v[4 * r + 3]) << 16;
  }
  return t;
}

uint32_t mask_bits(const Mask& m) {
  uint32_t b = 0;
  for (int i = 0; i < 16; ++i) b |= uint32_t(m[i] != 0) << i;
  return b;
}

// Tiles whose magnitudes are drawn from {0, 1} exhaustively, then random ones of each kind.
template <typename Fn>
void for_each_tile(Fn fn) {
  const uint16_t one = esplag::float_to_bf16(1.0f), minus_one = esplag::float_to_bf16(-1.0f);
  uint16_t v[16];
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
    for (int i = 0; i < 16; ++i) v[i] = (bits >> i & 1u) ? ((i * 7 + bits) % 3 ? one : minus_one) : uint16_t(0);
    fn(v);
  }
  for (Kind kind : {Kind::gaussian, Kind::tied, Kind::special}) {
    const Bits b = random_bits(16 * 20000, kind, 77 + int(kind));
    for (size_t t = 0; t < b.size(); t += 16) fn(&b[t]);
  }
}

}  // namespace tile_logic

TEST(GpuSparsifyTileLogic, GreedyAndDoublePruneMasksMatchTheCpu) {
  using namespace tile_logic;
  int64_t tiles = 0;
  for_each_tile([&](const uint16_t* v) {
    std::vector<float> f(16);
    for (int i = 0; i < 16; ++i) f[i] = esplag::bf16_to_float(v[i]);
    const sd::PackedTile t = pack(v);
    const uint32_t greedy = sd::greedy_mask(t);
    const cpu::DoublePrunedMasks dp = cpu::double_prune_masks(f.data(), 4, 4);
    const uint32_t fwd = sd::rows_top2_mask(t), bwd = sd::columns_top2_mask(t, fwd);
    ASSERT_EQ(greedy, mask_bits(cpu::transposable_mask_greedy(f.data(), 4, 4))) << "tile " << tiles;
    ASSERT_EQ(fwd, mask_bits(dp.forward)) << "tile " << tiles;
    ASSERT_EQ(bwd, mask_bits(dp.backward)) << "tile " << tiles;
    ++tiles;
  });
  EXPECT_EQ(tiles, 65536 + 3 * 20000);
}

TEST(GpuSparsifyTileLogic, TransposesSlotsAndMetadataWords) {
  using namespace tile_logic;
  Rng rng(5);
  for (int trial = 0; trial < 20000; ++trial) {
    uint16_t v[16];
    for (auto& x : v) x = static_cast<uint16_t>(rng.below(65536));
    const uint32_t bits = rng.below(65536);
    const sd::PackedTile t = pack(v), tt = sd::transpose_tile(t);
    const uint32_t tb = sd::transpose_tile_bits(bits);
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) {
        ASSERT_EQ(sd::tile_value(tt, 4 * c + r), v[4 * r + c]);
        ASSERT_EQ(tb >> (4 * c + r) & 1u, bits >> (4 * r + c) & 1u);
      }
    // The metadata word of row q gathered from the 4 lanes of a word (lane l holds the tile
    // of quarter l; lane q reads a[d] from lane q ^ d).
    uint32_t packed[4];
    for (auto& p : packed) p = rng.below(65536);
    for (uint32_t q = 0; q < 4; ++q) {
      const uint32_t a[4] = {packed[q], packed[q ^ 1], packed[q ^ 2], packed[q ^ 3]};
      uint32_t want = 0;
      for (uint32_t s = 0; s < 4; ++s) want |= ((packed[s] >> (4 * q)) & 15u) << (4 * s);
      ASSERT_EQ(sd::gather_meta_word(q, a), want);
    }
  }
  // Slots of every group keeping at most 2, against compress_24_masked, and the stored values.
  for (uint32_t kept = 0; kept < 16; ++kept) {
    if (__builtin_popcount(kept) > 2) continue;
    const Bits g = {0x3f80, 0xc000, 0x4040, 0xbf00};  // 1, -2, 3, -0.5
    Mask m(4);
    for (int i = 0; i < 4; ++i) m[i] = kept >> i & 1u;
    const Compressed want = compress(g, m, 1, 4);
    const uint32_t nib = sd::slot_nibble(kept);
    EXPECT_EQ(nib, want.meta[0]) << "kept " << kept;
    const uint32_t lo = (g[0] | uint32_t(g[1]) << 16) & sd::halfword_mask(kept),
                   hi = (g[2] | uint32_t(g[3]) << 16) & sd::halfword_mask(kept >> 2);
    EXPECT_EQ(sd::slot_values(lo, hi, nib), want.values[0] | uint32_t(want.values[1]) << 16) << "kept " << kept;
  }
}

TEST_F(GpuSparsify, TransposableMatchesTheCpuGreedyMask) {
  for (Kind kind : {Kind::gaussian, Kind::tied, Kind::special})
    for (Shape s : kTileShapes) {
      const std::string what = label("transposable_24", s, kind);
      SCOPED_TRACE(what);
      const int64_t R = s.rows, C = s.cols;
      const Bits w = random_bits(R * C, kind, 100 + R * 7 + C);
      const std::vector<float> wf = to_float(w);
      const Mask mask = cpu::transposable_mask_greedy(wf.data(), R, C);
      Dev dev;
      Outs a(dev, R, C), t(dev, C, R);
      uint16_t* tiles = dev.poisoned<uint16_t>(size_t(R * C / 16));
      gpu::transposable_24(dev.put_bf16(w), R, C, a.o, t.o, tiles, dev.stream());
      expect_result(dev, what, a.o, R, C, w, mask);
      expect_result(dev, what + " transposed", t.o, C, R, transpose(w, R, C), transpose(mask, R, C));
      EXPECT_EQ(dev.get(tiles, size_t(R * C / 16)), tile_bits(mask, R, C)) << what << ": tile mask";
    }
}

TEST_F(GpuSparsify, TransposableWritesOnlyTheFormsAskedForAndPrunesInPlace) {
  const int64_t R = 132, C = 68;
  const Bits w = random_bits(R * C, Kind::tied, 5);
  const std::vector<float> wf = to_float(w);
  const Mask mask = cpu::transposable_mask_greedy(wf.data(), R, C);
  Dev dev;
  // Only the transposed compressed values and the metadata of W.
  Sparse24Out a, t;
  a.meta = dev.poisoned<uint16_t>(size_t(R * ((C + 15) / 16)));
  t.values = dev.poisoned_bf16(size_t(R * C / 2));
  gpu::transposable_24(dev.put_bf16(w), R, C, a, t, nullptr, dev.stream());
  expect_result(dev, "meta only", a, R, C, w, mask);
  expect_result(dev, "transposed values only", t, C, R, transpose(w, R, C), transpose(mask, R, C));
  // In place: the dense output is the input.
  bf16* x = dev.put_bf16(w);
  Sparse24Out inplace;
  inplace.dense = x;
  gpu::transposable_24(x, R, C, inplace, Sparse24Out{}, nullptr, dev.stream());
  EXPECT_EQ(dev.get_bits(x, size_t(R * C)), apply(w, mask));
}

TEST_F(GpuSparsify, DoublePruneMatchesTheCpuMasks) {
  for (Kind kind : {Kind::gaussian, Kind::tied, Kind::special})
    for (Shape s : kTileShapes) {
      const std::string what = label("double_prune_24", s, kind);
      SCOPED_TRACE(what);
      const int64_t R = s.rows, C = s.cols;
      const Bits w = random_bits(R * C, kind, 200 + R * 5 + C);
      const std::vector<float> wf = to_float(w);
      const cpu::DoublePrunedMasks m = cpu::double_prune_masks(wf.data(), R, C);
      Dev dev;
      Outs a(dev, R, C), t(dev, C, R);
      uint16_t* fwd_tiles = dev.poisoned<uint16_t>(size_t(R * C / 16));
      uint16_t* bwd_tiles = dev.poisoned<uint16_t>(size_t(R * C / 16));
      gpu::double_prune_24(dev.put_bf16(w), R, C, a.o, t.o, fwd_tiles, bwd_tiles, dev.stream());
      expect_result(dev, what + " forward (W1)", a.o, R, C, w, m.forward);
      expect_result(dev, what + " backward (W2ᵀ)", t.o, C, R, transpose(w, R, C), transpose(m.backward, R, C));
      EXPECT_EQ(dev.get(fwd_tiles, size_t(R * C / 16)), tile_bits(m.forward, R, C)) << what;
      EXPECT_EQ(dev.get(bwd_tiles, size_t(R * C / 16)), tile_bits(m.backward, R, C)) << what;
    }
}

// Token counts that are not multiples of 4 (tile_24 pads), feature counts with and without
// whole metadata words (24, 40: rows of 16-byte words whose compressed rows are not
// 16-byte multiples), and pointers 8- but not 16-byte aligned (the 8-byte path).
const std::vector<Shape> kActShapes = {{1, 4},  {3, 8},   {5, 12},   {37, 20},  {9, 24},   {5, 40},
                                       {64, 36}, {7, 772}, {33, 768}, {130, 64}, {2, 4096}};

TEST_F(GpuSparsify, ActivationRowsMatchTheCpuNmMask) {
  for (Kind kind : {Kind::gaussian, Kind::tied, Kind::special})
    for (Shape s : kActShapes)
      for (size_t offset : {size_t(0), size_t(4)}) {
        const std::string what = label("activation_24_rows", s, kind) + (offset ? " misaligned" : "");
        SCOPED_TRACE(what);
        const int64_t N = s.rows, C = s.cols;
        const Bits x = random_bits(N * C, kind, 300 + N * 3 + C);
        const std::vector<float> xf = to_float(x);
        const Mask mask = cpu::nm_mask(xf.data(), N, C, 2, 4);
        Dev dev;
        Outs a(dev, N, C, offset);
        gpu::activation_24_rows(dev.put_bf16(x, offset), N, C, a.o, dev.stream());
        expect_result(dev, what, a.o, N, C, x, mask);
      }
}

TEST_F(GpuSparsify, ActivationTilesMatchSemiSparseActivationLinear) {
  for (Kind kind : {Kind::gaussian, Kind::tied, Kind::special})
    for (Shape s : kActShapes) {
      const std::string what = label("activation_24_tiles", s, kind);
      SCOPED_TRACE(what);
      const int64_t N = s.rows, C = s.cols, N4 = (N + 3) / 4 * 4;
      const Bits x = random_bits(N * C, kind, 400 + N * 3 + C);
      const std::vector<float> xf = to_float(x);
      // The layer's own pruning is the oracle for the pruned activations...
      std::vector<float> weight(size_t(4 * C), 0.0f), xs(xf.size());
      esplag::LinearParams<float> p;
      p.name = "act.weight";
      p.in_features = static_cast<int>(C);
      p.out_features = 4;
      p.weight = weight.data();
      esplag::SemiSparseActivationLinear<float>(p, esplag::ActivationSparsity::tile_24)
          .sparsify_input(xs.data(), xf.data(), static_cast<int>(N));
      // ... and the padded transposable mask, which must agree with it, for the other forms.
      Bits padded(size_t(N4 * C), 0);
      std::copy(x.begin(), x.end(), padded.begin());
      const std::vector<float> pf = to_float(padded);
      const Mask pmask = cpu::transposable_mask_greedy(pf.data(), N4, C);
      const Mask mask(pmask.begin(), pmask.begin() + N * C);
      Bits expected_dense(x.size());
      for (size_t i = 0; i < xs.size(); ++i) expected_dense[i] = esplag::float_to_bf16(xs[i]);
      ASSERT_EQ(apply(x, mask), expected_dense) << "the test's mask disagrees with the layer";

      Dev dev;
      Outs a(dev, N, C), t(dev, C, N4);
      gpu::activation_24_tiles(dev.put_bf16(x), N, C, a.o, t.o, dev.stream());
      EXPECT_EQ(dev.get_bits(a.o.dense, size_t(N * C)), expected_dense) << what;
      expect_result(dev, what, Sparse24Out{nullptr, a.o.values, a.o.meta}, N, C, x, mask);
      expect_result(dev, what + " transposed", t.o, C, N4, transpose(padded, N4, C), transpose(pmask, N4, C));
    }
}

TEST_F(GpuSparsify, MvueMatchesTheCpuReferenceBitForBit) {
  for (Kind kind : {Kind::gaussian, Kind::tied, Kind::special})
    for (Shape s : kActShapes)
      for (uint64_t seed : {uint64_t(1), uint64_t(0x5eed5eed5eedull)}) {
        const std::string what = label("mvue_24", s, kind) + " seed " + std::to_string(seed);
        SCOPED_TRACE(what);
        const int64_t R = s.rows, C = s.cols;
        Bits g = random_bits(R * C, kind, 500 + R * 3 + C);
        for (size_t i = 0; i < g.size(); i += 11) g[i] = 0;  // groups with fewer non-zeros
        Bits ref(g.size());
        Mask mask(g.size());
        cpu::mvue_24_bf16(g.data(), ref.data(), mask.data(), R, C, seed);
        Dev dev;
        Outs a(dev, R, C, seed == 1 ? 0 : 4);
        gpu::mvue_24(dev.put_bf16(g, seed == 1 ? 0 : 4), R, C, seed, a.o, dev.stream());
        EXPECT_EQ(dev.get_bits(a.o.dense, ref.size()), ref) << what;
        expect_result(dev, what, Sparse24Out{nullptr, a.o.values, a.o.meta}, R, C, ref, mask);
      }
}

TEST_F(GpuSparsify, MvueDependsOnlyOnTheSeed) {
  const int64_t R = 64, C = 256;
  const Bits g = random_bits(R * C, Kind::gaussian, 9);
  Dev dev;
  const bf16* in = dev.put_bf16(g);
  bf16* a = dev.poisoned_bf16(g.size());
  bf16* b = dev.poisoned_bf16(g.size());
  bf16* c = dev.poisoned_bf16(g.size());
  gpu::mvue_24(in, R, C, 3, Sparse24Out{a, nullptr, nullptr}, dev.stream());
  gpu::mvue_24(in, R, C, 3, Sparse24Out{b, nullptr, nullptr}, dev.stream());
  gpu::mvue_24(in, R, C, 4, Sparse24Out{c, nullptr, nullptr}, dev.stream());
  const Bits ga = dev.get_bits(a, g.size());
  EXPECT_EQ(ga, dev.get_bits(b, g.size()));
  EXPECT_NE(ga, dev.get_bits(c, g.size()));
}

TEST_F(GpuSparsify, RejectsIllegalShapesAndPointers) {
  Dev dev;
  const Bits w = random_bits(64, Kind::gaussian, 1);
  bf16* x = dev.put_bf16(w);
  bf16* out = dev.poisoned_bf16(64);
  const Sparse24Out d{out, nullptr, nullptr};
  auto expect_error = [](const char* fn, const auto& call, const char* phrase) {
    try {
      call();
      ADD_FAILURE() << fn << ": expected an esplag::Error";
    } catch (const esplag::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(fn), std::string::npos) << msg;
      EXPECT_NE(msg.find(phrase), std::string::npos) << msg;
    }
  };
  expect_error("gpu::transposable_24", [&] { gpu::transposable_24(x, 6, 8, d, {}, nullptr, dev.stream()); },
               "multiples of 4");
  expect_error("gpu::transposable_24", [&] { gpu::transposable_24(x, 8, 6, d, {}, nullptr, dev.stream()); },
               "[8, 6]");
  expect_error("gpu::double_prune_24", [&] { gpu::double_prune_24(x, 2, 8, d, {}, nullptr, nullptr, dev.stream()); },
               "multiples of 4");
  expect_error("gpu::activation_24_rows", [&] { gpu::activation_24_rows(x, 3, 6, d, dev.stream()); },
               "multiple of 4");
  expect_error("gpu::activation_24_tiles", [&] { gpu::activation_24_tiles(x, 3, 10, d, {}, dev.stream()); },
               "multiple of 4");
  expect_error("gpu::mvue_24", [&] { gpu::mvue_24(x, 2, 10, 1, d, dev.stream()); }, "multiple of 4");
  expect_error("gpu::transposable_24", [&] { gpu::transposable_24(x + 1, 4, 8, d, {}, nullptr, dev.stream()); },
               "8-byte aligned");
  expect_error("gpu::mvue_24",
               [&] { gpu::mvue_24(x, 4, 8, 1, Sparse24Out{nullptr, out + 1, nullptr}, dev.stream()); },
               "4-byte aligned");
  expect_error("gpu::activation_24_rows", [&] { gpu::activation_24_rows(x, -1, 8, d, dev.stream()); },
               "multiple of 4");
  // Empty tensors are legal and write nothing.
  gpu::transposable_24(x, 0, 8, d, {}, nullptr, dev.stream());
  gpu::activation_24_rows(x, 0, 8, d, dev.stream());
  EXPECT_EQ(dev.get_bits(out, 64), Bits(64, 0xFFFF));
}

TEST_F(GpuSparsify, Timing) {
  const auto timings = esplag::bench_sparsify();
  std::printf("%s\n%s", esplag::sparsify_timing_table(timings).c_str(), esplag::sparsify_timing_csv(timings, "test").c_str());
  EXPECT_FALSE(timings.empty());
}
