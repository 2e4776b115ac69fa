// cuSPARSELt's compressed 2:4 layout written directly (sparse/cuda/cusparselt_layout.h)
// against the library.
//
// Dump: compresses crafted 2:4 matrices through SparseGemm24::compress for the two products
// of a weight (forward: W [out, in] as A, op N, 2:4 along rows; backward_data: op T, 2:4
// along columns) and, when $ESPLAG_PROBE_DIR is set, writes the dense inputs and the
// compressed buffers there (raw little-endian) with the compressed sizes, so that the
// layout can be read off them (every kept value is a distinct positive bf16 bit pattern;
// patterns 0-5 keep the same pair in every group). It checks the sizes against
// cusparselt24_layout_bytes.
// HostMatchesLibrary: the CPU reference's buffer is byte-identical to the library's for
// random 2:4 matrices (non-zero kept values) of several sizes, forward-form products; for
// backward_data (op T, a layout the writer does not claim) the self-check must agree.
// DeviceMatchesHost: the GPU writer against the CPU reference (both orientations in one
// pass, outputs poisoned, groups with fewer than two non-zeros included); needs no library.
// MatmulWithOwnBuffers: the writer's buffers in SparseGemm24::matmul (forward and
// backward_data) against the fp64 product of the masked W, with degenerate groups.
// WeightGradLayoutMatchesLibrary: the weight-gradient product's structured operand S
// [out, tokens] (op N) compressed by the library and by the CPU reference: the same bytes,
// and the self-check agreeing.
// CompressKeptMatchesTheDenseWriter: slope's preparation from its stored form against the
// writer on the dense W1 and W2.
// E4m3HostMatchesLibrary / CompressKeptE4m3MatchesTheHostCast: the 8-bit layout's CPU
// reference against the library, and the fp8 copies written from slope's stored form and
// from a transposable W (semi_sparse) against core's casts followed by that reference.
// MvueCompressMatchesHostReference: the fused MVUE kernel (cusparselt24_compress_mvue_t on
// dY [N, out]) against cpu::mvue_24_bf16 of dYᵀ followed by the CPU writer, bit for bit,
// with ties, zeros of both signs, groups of 0-2 non-zeros and groups holding NaN, ±inf or
// values whose sum overflows (kept unscaled as their top 2); needs no library.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/fp8.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/cusparselt_layout.h"
#include "sparse/cuda/sparsify.h"
#include "sparse/mvue.h"

#include "gpu_test_util.h"

namespace {

using esplag::gpu::SparseGemm24;
using esplag::gpu::SparseGemm24Problem;
using esplag::gpu::SparseProduct;
namespace gpu = esplag::gpu;

constexpr int kPairs[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};

uint32_t lcg(uint64_t& s) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<uint32_t>(s >> 33);
}

// W [rows, cols] with 2 non-zeros per group of 4 along the product's K (columns for the
// forward, rows for backward_data). pattern 0..5: every group keeps kPairs[pattern];
// -1: random pair per group; -2: random, with some groups holding one or no non-zero.
std::vector<uint16_t> craft(int64_t rows, int64_t cols, bool along_rows, int pattern, uint64_t seed) {
  std::vector<uint16_t> w(size_t(rows * cols), 0);
  uint64_t s = seed;
  uint32_t id = 0;
  auto next_id = [&]() { return static_cast<uint16_t>(0x0100 + (id++ % 0x3E00)); };
  const int64_t groups_r = along_rows ? rows : rows / 4, groups_c = along_rows ? cols / 4 : cols;
  // ids in row-major order of the kept elements: visit elements row-major, keep-test each
  std::vector<uint8_t> keep(size_t(rows * cols), 0);
  for (int64_t gr = 0; gr < groups_r; ++gr)
    for (int64_t gc = 0; gc < groups_c; ++gc) {
      int p = pattern >= 0 ? pattern : int(lcg(s) % 6);
      int a = kPairs[p][0], b = kPairs[p][1];
      bool ka = true, kb = true;
      if (pattern == -2) {
        const uint32_t r = lcg(s) % 8;
        if (r == 0) ka = false;
        if (r == 1) kb = false;
        if (r == 2) ka = kb = false;
      }
      auto at = [&](int j) -> uint8_t& {
        return along_rows ? keep[size_t(gr * cols + gc * 4 + j)] : keep[size_t((gr * 4 + j) * cols + gc)];
      };
      if (ka) at(a) = 1;
      if (kb) at(b) = 1;
    }
  for (size_t i = 0; i < w.size(); ++i)
    if (keep[i]) w[i] = next_id();
  return w;
}

void write_file(const std::string& path, const void* p, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(p), std::streamsize(bytes));
  ASSERT_TRUE(bool(f)) << path;
}

TEST(CusparseltLayout, Dump) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << gpu::cusparselt_unavailable_reason();
  const char* dir_env = std::getenv("ESPLAG_PROBE_DIR");
  const std::string dir = dir_env ? dir_env : "";
  std::string sizes = "version " + std::to_string(gpu::cusparselt_version()) + "\n";
  auto problem = [](bool fwd, int64_t out, int64_t in) {
    return fwd ? SparseGemm24Problem::linear_forward(out, in, 16)
               : SparseGemm24Problem::linear_backward_data(out, in, 16);
  };
  for (bool fwd : {true, false})
    for (auto [out, in] : {std::pair<int64_t, int64_t>{16, 16}, {16, 32}, {32, 16}, {32, 32}, {64, 64}, {80, 48},
                           {48, 80}, {128, 256}, {256, 128}, {512, 1024}, {1024, 512}, {4096, 4096},
                           {11008, 4096}, {4096, 11008}}) {
      SparseGemm24 g(problem(fwd, out, in), SparseGemm24::Algorithm::library_default);
      const int64_t M = fwd ? out : in, K = fwd ? in : out;
      if (M % 64 == 0 && K % 64 == 0)
        EXPECT_EQ(g.compressed_bytes(), gpu::cusparselt24_layout_bytes(M, K)) << (fwd ? "fwd " : "bwd ") << out << "x" << in;
      sizes += std::string(fwd ? "fwd" : "bwd") + " " + std::to_string(out) + " " + std::to_string(in) + " " +
               std::to_string(g.compressed_bytes()) + " " + std::to_string(g.compress_scratch_bytes()) + "\n";
    }
  std::printf("%s", sizes.c_str());
  if (!dir.empty()) write_file(dir + "/sizes.txt", sizes.data(), sizes.size());

  cudaStream_t st = nullptr;
  for (bool fwd : {true, false})
    for (auto [out, in] : {std::pair<int64_t, int64_t>{64, 64}, {128, 256}, {256, 128}, {80, 48}, {48, 80},
                           {512, 1024}, {1024, 512}, {16, 16}, {32, 32}}) {
      SparseGemm24 g(problem(fwd, out, in), SparseGemm24::Algorithm::library_default);
      const size_t n = size_t(out * in), cb = g.compressed_bytes();
      void *dw = nullptr, *dc = nullptr, *ds = nullptr;
      CUDA_CHECK(cudaMalloc(&dw, n * 2));
      CUDA_CHECK(cudaMalloc(&dc, cb));
      CUDA_CHECK(cudaMalloc(&ds, std::max<size_t>(g.compress_scratch_bytes(), 16)));
      std::vector<int> patterns = {-1};
      if (out <= 256 && in <= 256) patterns = {0, 1, 2, 3, 4, 5, -1, -2};
      for (int pat : patterns) {
        const auto w = craft(out, in, fwd, pat, 1234 + uint64_t(out * 7 + in) + uint64_t(pat + 10));
        CUDA_CHECK(cudaMemcpy(dw, w.data(), n * 2, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemset(dc, 0xA5, cb));
        g.compress(dc, static_cast<const gpu::bf16*>(dw), ds, g.compress_scratch_bytes(), st);
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<uint8_t> c(cb);
        CUDA_CHECK(cudaMemcpy(c.data(), dc, cb, cudaMemcpyDeviceToHost));
        const std::string name = std::string(fwd ? "fwd" : "bwd") + "_" + std::to_string(out) + "x" +
                                 std::to_string(in) + "_p" + std::to_string(pat);
        if (!dir.empty()) {
          write_file(dir + "/" + name + ".in", w.data(), n * 2);
          write_file(dir + "/" + name + ".c", c.data(), cb);
        }
      }
      cudaFree(dw);
      cudaFree(dc);
      cudaFree(ds);
    }
}

// W [rows, cols], 2:4 along both dimensions (each 4×4 tile keeps columns s + r, s + r + 1
// mod 4 of its row r), kept values uniform in [-1, 1] rounded to bf16 and non-zero;
// with `holes`, one kept value in 8 is set to zero (groups with fewer than two non-zeros).
std::vector<uint16_t> random_transposable(int64_t rows, int64_t cols, uint64_t seed, bool holes) {
  std::vector<uint16_t> w(size_t(rows * cols), 0);
  uint64_t s = seed;
  for (int64_t tr = 0; tr < rows / 4; ++tr)
    for (int64_t tc = 0; tc < cols / 4; ++tc) {
      const int shift = int(lcg(s) % 4);
      for (int r = 0; r < 4; ++r)
        for (int e = 0; e < 2; ++e) {
          float x = (float(lcg(s) % 2000001u) - 1000000.0f) / 1000000.0f;
          uint16_t b = esplag::float_to_bf16(x);
          if ((b & 0x7FFF) == 0) b = 0x3F80;
          if (holes && lcg(s) % 8 == 0) b = 0;
          w[size_t((tr * 4 + r) * cols + tc * 4 + (shift + r + e) % 4)] = b;
        }
    }
  return w;
}

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) { CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~Dev() { cudaFree(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

std::vector<uint8_t> download(const Dev& d, size_t bytes) {
  std::vector<uint8_t> h(bytes);
  CUDA_CHECK(cudaMemcpy(h.data(), d.p, bytes, cudaMemcpyDeviceToHost));
  return h;
}

// Where two buffers first differ, and whether the values part (the first m·k bytes) agrees.
std::string diff_text(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, size_t values_bytes) {
  size_t first = a.size(), count = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      if (first == a.size()) first = i;
      ++count;
    }
  return "differ in " + std::to_string(count) + " of " + std::to_string(a.size()) + " bytes, first at " +
         std::to_string(first) + (first < values_bytes ? " (values)" : " (metadata)");
}

TEST(CusparseltLayout, HostMatchesLibrary) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << gpu::cusparselt_unavailable_reason();
  for (bool fwd : {true, false})
    for (auto [out, in] : {std::pair<int64_t, int64_t>{64, 64}, {128, 256}, {256, 128}, {192, 320}, {1024, 512}}) {
      const auto p = fwd ? SparseGemm24Problem::linear_forward(out, in, 16)
                         : SparseGemm24Problem::linear_backward_data(out, in, 16);
      SparseGemm24 g(p, SparseGemm24::Algorithm::library_default);
      const size_t bytes = gpu::cusparselt24_layout_bytes(fwd ? out : in, fwd ? in : out);
      ASSERT_EQ(g.compressed_bytes(), bytes) << p.key();
      const auto w = random_transposable(out, in, 77 + uint64_t(out + in), false);
      Dev dw(w.size() * 2), dc(bytes), ds(g.compress_scratch_bytes());
      CUDA_CHECK(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
      g.compress(dc.p, dw.as<gpu::bf16>(), ds.p, g.compress_scratch_bytes(), nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      const auto lib = download(dc, bytes);
      std::vector<uint8_t> host(bytes);
      gpu::cusparselt24_compress_host(w.data(), out, in, !fwd, host.data());
      // The forward-form (op N) layout is the one the writer implements and SparseLinear
      // uses; cuSPARSELt 0.8 lays out op T differently (seen on an H100), which the
      // library self-check must then report so that the library's compression is kept.
      if (fwd)
        EXPECT_TRUE(lib == host) << p.key() << ": " << diff_text(lib, host, size_t(out * in));
      else if (lib != host)
        std::printf("%s: op T layout is not the writer's (%s); library compression kept\n", p.key().c_str(),
                    diff_text(lib, host, size_t(out * in)).c_str());
      EXPECT_EQ(gpu::cusparselt24_layout_matches(g), lib == host) << p.key();
    }
}

TEST(CusparseltLayout, DeviceMatchesHost) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{64, 64}, {128, 320}, {320, 128}, {448, 192}}) {
    const auto w = random_transposable(rows, cols, 991 + uint64_t(rows * 3 + cols), true);
    const size_t bytes = gpu::cusparselt24_layout_bytes(rows, cols);
    Dev dw(w.size() * 2), dn(bytes), dt(bytes);
    CUDA_CHECK(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(dn.p, 0xFF, bytes));  // NaN bits in the values, 0xF nibbles
    CUDA_CHECK(cudaMemset(dt.p, 0xFF, bytes));
    gpu::cusparselt24_compress(dw.as<gpu::bf16>(), rows, cols, dn.p, dt.p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> hn(bytes), ht(bytes);
    gpu::cusparselt24_compress_host(w.data(), rows, cols, false, hn.data());
    gpu::cusparselt24_compress_host(w.data(), rows, cols, true, ht.data());
    const auto gn = download(dn, bytes), gt = download(dt, bytes);
    EXPECT_TRUE(gn == hn) << rows << "x" << cols << " op N: " << diff_text(gn, hn, size_t(rows * cols));
    EXPECT_TRUE(gt == ht) << rows << "x" << cols << " op T: " << diff_text(gt, ht, size_t(rows * cols));
    // one orientation alone writes the same bytes
    CUDA_CHECK(cudaMemset(dt.p, 0xFF, bytes));
    gpu::cusparselt24_compress(dw.as<gpu::bf16>(), rows, cols, nullptr, dt.p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(download(dt, bytes) == ht) << rows << "x" << cols << " op T alone";
  }
  EXPECT_THROW(gpu::cusparselt24_compress(nullptr, 48, 64, nullptr, nullptr, nullptr), esplag::Error);
  EXPECT_EQ(gpu::cusparselt24_layout_bytes(80, 64), 0u);
}

// The fused pruning (semi_sparse's preparation) against its two passes: gpu::transposable_24
// then the writer, on dense random W with ties (few distinct magnitudes), zeros and both
// signs; outputs poisoned.
TEST(CusparseltLayout, PruneCompressMatchesTheTwoPasses) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{64, 64}, {128, 320}, {320, 192}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols));
    std::vector<uint16_t> w(size_t(rows * cols));
    uint64_t seed = 4242 + uint64_t(rows * 7 + cols);
    for (auto& x : w) {
      const uint32_t r = lcg(seed);
      // 1 in 8 zero (of either sign), else one of 12 magnitudes: ties are common
      x = r % 8 == 0 ? uint16_t((r >> 3 & 1u) << 15) : uint16_t(((r >> 3 & 1u) << 15) | (0x3C00u + (r >> 4) % 12u * 8u));
    }
    const size_t n = w.size() * 2, bytes = gpu::cusparselt24_layout_bytes(rows, cols);
    Dev dw(n), p_ref(n), n_ref(bytes), t_ref(bytes), p_got(n), n_got(bytes), t_got(bytes);
    CUDA_CHECK(cudaMemcpy(dw.p, w.data(), n, cudaMemcpyHostToDevice));
    for (const Dev* d : {&p_ref, &p_got}) CUDA_CHECK(cudaMemset(d->p, 0xFF, n));
    for (const Dev* d : {&n_ref, &t_ref, &n_got, &t_got}) CUDA_CHECK(cudaMemset(d->p, 0xFF, bytes));
    gpu::transposable_24(dw.as<gpu::bf16>(), rows, cols, gpu::Sparse24Out{p_ref.as<gpu::bf16>()}, gpu::Sparse24Out{},
                         nullptr, nullptr);
    gpu::cusparselt24_compress(p_ref.as<gpu::bf16>(), rows, cols, n_ref.p, t_ref.p, nullptr);
    gpu::cusparselt24_prune_compress(dw.as<gpu::bf16>(), rows, cols, p_got.as<gpu::bf16>(), n_got.p, t_got.p,
                                     nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(download(p_got, n) == download(p_ref, n)) << "pruned W";
    EXPECT_TRUE(download(n_got, bytes) == download(n_ref, bytes))
        << "op N: " << diff_text(download(n_got, bytes), download(n_ref, bytes), n);
    EXPECT_TRUE(download(t_got, bytes) == download(t_ref, bytes))
        << "op T: " << diff_text(download(t_got, bytes), download(t_ref, bytes), n);
    // Without the pruned copy: the same layouts.
    CUDA_CHECK(cudaMemset(n_got.p, 0xFF, bytes));
    gpu::cusparselt24_prune_compress(dw.as<gpu::bf16>(), rows, cols, nullptr, n_got.p, nullptr, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(download(n_got, bytes) == download(n_ref, bytes)) << "op N without the pruned copy";
  }
}

// A slope weight W1 [rows, cols] in its stored form: kept values (1 in 8 of them zero: groups
// whose stored positions are padded), the forward mask as tile bits, and a backward mask
// keeping the first two of the forward mask's positions down each column of a tile (so
// columns keep 0, 1 or 2); with W1 and W2 = W1 ⊙ backward mask dense.
// `specials`: now and then a group's first kept value is NaN (either sign), ±inf, -0 or a
// negative bf16 subnormal (an fp8 -0 after any scale).
struct SlopeWeight {
  std::vector<uint16_t> w1, w2, kept, fwd, bwd;
  SlopeWeight(int64_t rows, int64_t cols, uint64_t seed, bool specials = false) {
    const uint16_t kSpecials[6] = {0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x8001};
    const int64_t groups = cols / 4;
    w1.assign(size_t(rows * cols), 0);
    w2.assign(w1.size(), 0);
    kept.assign(w1.size() / 2, 0);
    fwd.assign(size_t(rows / 4 * groups), 0);
    bwd.assign(fwd.size(), 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const unsigned pairs[6] = {0x3, 0x5, 0x6, 0x9, 0xA, 0xC};
        const unsigned nib = pairs[lcg(seed) % 6];
        fwd[size_t((r / 4) * groups + g)] |= uint16_t(nib << (4 * (r % 4)));
        int k = 0;
        for (int j = 0; j < 4; ++j)
          if (nib >> j & 1u) {
            const uint32_t x = lcg(seed);
            uint16_t b = x % 8 == 0 ? 0 : uint16_t(((x & 1u) << 15) | (0x3C00u + (x >> 4) % 200u));
            if (specials && k == 0 && (r * groups + g) % 29 == 3) b = kSpecials[size_t((r * groups + g) / 29 % 6)];
            w1[size_t(r * cols + 4 * g + j)] = b;
            kept[size_t(r * (cols / 2) + 2 * g + k++)] = b;
          }
      }
    for (size_t t = 0; t < fwd.size(); ++t)
      for (int c = 0; c < 4; ++c) {  // the first two kept rows of column c
        int taken = 0;
        for (int r = 0; r < 4 && taken < 2; ++r)
          if (fwd[t] >> (4 * r + c) & 1u) {
            bwd[t] |= uint16_t(1u << (4 * r + c));
            ++taken;
          }
      }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        if (bwd[size_t((r / 4) * groups + c / 4)] >> (4 * (r % 4) + c % 4) & 1u)
          w2[size_t(r * cols + c)] = w1[size_t(r * cols + c)];
  }
};

// slope's preparation from its stored form (W1's kept values and the two tile masks)
// against the writer on the dense W1 and W2 = W1 ⊙ backward mask: the same bytes, outputs
// poisoned.
TEST(CusparseltLayout, CompressKeptMatchesTheDenseWriter) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{64, 64}, {128, 320}, {320, 192}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols));
    const SlopeWeight sw(rows, cols, 777 + uint64_t(rows * 5 + cols));
    const size_t n = sw.w1.size() * 2, bytes = gpu::cusparselt24_layout_bytes(rows, cols);
    Dev d1(n), d2(n), dk(n / 2), df(sw.fwd.size() * 2), db(sw.bwd.size() * 2);
    Dev n_ref(bytes), t_ref(bytes), n_got(bytes), t_got(bytes);
    CUDA_CHECK(cudaMemcpy(d1.p, sw.w1.data(), n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d2.p, sw.w2.data(), n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dk.p, sw.kept.data(), n / 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(df.p, sw.fwd.data(), sw.fwd.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.p, sw.bwd.data(), sw.bwd.size() * 2, cudaMemcpyHostToDevice));
    for (const Dev* d : {&n_ref, &t_ref, &n_got, &t_got}) CUDA_CHECK(cudaMemset(d->p, 0xFF, bytes));
    gpu::cusparselt24_compress(d1.as<gpu::bf16>(), rows, cols, n_ref.p, nullptr, nullptr);
    gpu::cusparselt24_compress(d2.as<gpu::bf16>(), rows, cols, nullptr, t_ref.p, nullptr);
    gpu::cusparselt24_compress_kept(dk.as<gpu::bf16>(), df.as<uint16_t>(), db.as<uint16_t>(), rows, cols, n_got.p,
                                    t_got.p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(download(n_got, bytes) == download(n_ref, bytes))
        << "W1's layout: " << diff_text(download(n_got, bytes), download(n_ref, bytes), n / 2);
    EXPECT_TRUE(download(t_got, bytes) == download(t_ref, bytes))
        << "W2^T's layout: " << diff_text(download(t_got, bytes), download(t_ref, bytes), n / 2);
  }
}

// The e4m3 layout's CPU reference against cuSPARSELt's compression of random codes (groups
// of two, one and no non-zeros) for forward problems of several shapes: the self-check
// cusparselt24_layout_matches runs exactly that comparison for e4m3 problems.
TEST(CusparseltLayout, E4m3HostMatchesLibrary) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << gpu::cusparselt_unavailable_reason();
  for (auto [out, in] : {std::pair<int64_t, int64_t>{64, 128}, {128, 256}, {192, 320}, {256, 64}, {2048, 5632}}) {
    SCOPED_TRACE(std::to_string(out) + "x" + std::to_string(in));
    SparseGemm24Problem p = SparseGemm24Problem::linear_forward(out, in, 64);
    p.dtype = gpu::SparseDtype::e4m3;
    p.device_scale = true;
    SparseGemm24 g(p);
    EXPECT_EQ(g.compressed_bytes(), gpu::cusparselt24_e4m3_layout_bytes(out, in));
    EXPECT_TRUE(gpu::cusparselt24_layout_matches(g));
  }
}

// The e4m3 copies of a slope weight from its stored form (cusparselt24_compress_kept_e4m3)
// against the CPU: core's amax of W1 and of W2, each cast with its scale (fp8_encode of
// float(w) · s), W2 transposed, both through the CPU reference of the layout; and the
// inverse scales. Then W2 (2:4 both ways) as a dense W through cusparselt24_compress_e4m3:
// its codes and its transpose's with one scale. NaN of either sign, ±inf, -0 and a negative
// subnormal among the values (SlopeWeight's specials); outputs poisoned; needs no library.
TEST(CusparseltLayout, CompressKeptE4m3MatchesTheHostCast) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{64, 64}, {128, 320}, {320, 192}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols));
    const SlopeWeight sw(rows, cols, 991 + uint64_t(rows * 7 + cols), true);
    const size_t n = sw.w1.size(), bytes = gpu::cusparselt24_e4m3_layout_bytes(rows, cols);
    // The CPU side.
    auto codes = [&](const std::vector<uint16_t>& w, bool transpose, float* amax, float* inv) {
      std::vector<float> f(n);
      for (size_t i = 0; i < n; ++i) f[i] = esplag::bf16_to_float(w[i]);
      *amax = esplag::fp8_amax(f.data(), int64_t(n));
      const float s = esplag::fp8_scale(*amax, esplag::Fp8Format::e4m3);
      *inv = 1.0f / s;
      std::vector<uint8_t> c(n);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < cols; ++k)
          c[size_t(transpose ? k * rows + r : r * cols + k)] =
              esplag::fp8_encode(double(f[size_t(r * cols + k)] * s), esplag::Fp8Format::e4m3);
      std::vector<uint8_t> layout(bytes);
      gpu::cusparselt24_compress_e4m3_host(c.data(), transpose ? cols : rows, transpose ? rows : cols,
                                           layout.data());
      return layout;
    };
    float amax_n = 0, amax_t = 0, inv_n = 0, inv_t = 0;
    const std::vector<uint8_t> want_n = codes(sw.w1, false, &amax_n, &inv_n);
    const std::vector<uint8_t> want_t = codes(sw.w2, true, &amax_t, &inv_t);
    // The GPU side.
    Dev dk(n), df(sw.fwd.size() * 2), db(sw.bwd.size() * 2), scales(64 * sizeof(float)), n_got(bytes), t_got(bytes);
    CUDA_CHECK(cudaMemcpy(dk.p, sw.kept.data(), n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(df.p, sw.fwd.data(), sw.fwd.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db.p, sw.bwd.data(), sw.bwd.size() * 2, cudaMemcpyHostToDevice));
    for (const Dev* d : {&scales, &n_got, &t_got}) CUDA_CHECK(cudaMemset(d->p, 0xFF, d == &scales ? 256 : bytes));
    float* sc = scales.as<float>();
    gpu::cusparselt24_compress_kept_e4m3(dk.as<gpu::bf16>(), df.as<uint16_t>(), db.as<uint16_t>(), rows, cols, sc,
                                         sc + 16, sc + 32, sc + 48, n_got.p, t_got.p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    float got[64];
    CUDA_CHECK(cudaMemcpy(got, sc, sizeof got, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got[0], amax_n);
    EXPECT_EQ(got[16], amax_t);
    EXPECT_EQ(got[32], inv_n);
    EXPECT_EQ(got[48], inv_t);
    EXPECT_TRUE(download(n_got, bytes) == want_n)
        << "W1's codes: " << diff_text(download(n_got, bytes), want_n, n / 2);
    EXPECT_TRUE(download(t_got, bytes) == want_t)
        << "W2^T's codes: " << diff_text(download(t_got, bytes), want_t, n / 2);
    // Either copy alone: its block stores it with all its threads (half of them with both).
    for (const bool forward : {true, false}) {
      Dev one(bytes);
      CUDA_CHECK(cudaMemset(one.p, 0xFF, bytes));
      gpu::cusparselt24_compress_kept_e4m3(dk.as<gpu::bf16>(), df.as<uint16_t>(), db.as<uint16_t>(), rows, cols, sc,
                                           sc + 16, sc + 32, sc + 48, forward ? one.p : nullptr,
                                           forward ? nullptr : one.p, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(download(one, bytes) == (forward ? want_n : want_t)) << (forward ? "W1's" : "W2^T's")
                                                                       << " codes alone";
    }
    // W2 is 2:4 along both dimensions: from it as a dense W (semi_sparse's way), both
    // orientations with W2's one scale.
    float amax_w2 = 0, inv_w2 = 0;
    const std::vector<uint8_t> want_w2 = codes(sw.w2, false, &amax_w2, &inv_w2);
    Dev dw2(2 * n), w2_n(bytes), w2_t(bytes);
    CUDA_CHECK(cudaMemcpy(dw2.p, sw.w2.data(), 2 * n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(w2_n.p, 0xFF, bytes));
    CUDA_CHECK(cudaMemset(w2_t.p, 0xFF, bytes));
    CUDA_CHECK(cudaMemset(sc + 32, 0xFF, sizeof(float)));
    CUDA_CHECK(cudaMemcpy(sc, &amax_w2, sizeof(float), cudaMemcpyHostToDevice));
    gpu::cusparselt24_compress_e4m3(dw2.as<gpu::bf16>(), rows, cols, sc, sc + 32, w2_n.p, w2_t.p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(got, sc, sizeof got, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got[32], inv_w2);
    EXPECT_TRUE(download(w2_n, bytes) == want_w2) << "W2's codes: " << diff_text(download(w2_n, bytes), want_w2, n / 2);
    EXPECT_TRUE(download(w2_t, bytes) == want_t) << "W2^T's codes: " << diff_text(download(w2_t, bytes), want_t, n / 2);
  }
}

TEST(CusparseltLayout, MatmulWithOwnBuffers) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << gpu::cusparselt_unavailable_reason();
  const int64_t out = 192, in = 320, tok = 48;
  const auto w = random_transposable(out, in, 4242, true);
  uint64_t s = 99;
  auto rnd = [&](size_t n) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = esplag::float_to_bf16((float(lcg(s) % 2001u) - 1000.0f) / 1000.0f);
    return v;
  };
  const auto x = rnd(size_t(tok * in)), dy = rnd(size_t(tok * out));
  auto f = [](uint16_t b) { return double(esplag::bf16_to_float(b)); };
  // 0: forward (W's layout), 1: the forward-form input gradient of Wᵀ [in, out] (Wᵀ's
  // layout, written from W: what SparseLinear uses), 2: backward_data (op T of W), only
  // where the layout check accepts it for that problem.
  for (int c = 0; c < 3; ++c) {
    const bool fwd = c == 0;
    const auto p = c == 0   ? SparseGemm24Problem::linear_forward(out, in, tok)
                   : c == 1 ? SparseGemm24Problem::linear_forward(in, out, tok)
                            : SparseGemm24Problem::linear_backward_data(out, in, tok);
    SparseGemm24 g(p, SparseGemm24::Algorithm::library_default);
    if (c == 2 && !gpu::cusparselt24_layout_matches(g)) {
      std::printf("backward_data (op T) layout differs from the writer's: not used, not checked\n");
      continue;
    }
    const int64_t feat_in = fwd ? in : out, feat_out = fwd ? out : in;
    const auto& a = fwd ? x : dy;
    Dev dw(w.size() * 2), dc(g.compressed_bytes()), da(a.size() * 2), dy_out(size_t(tok * feat_out) * 2),
        ws(g.workspace_bytes());
    CUDA_CHECK(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(da.p, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(dy_out.p, 0xFF, size_t(tok * feat_out) * 2));
    gpu::cusparselt24_compress(dw.as<gpu::bf16>(), out, in, fwd ? dc.p : nullptr, fwd ? nullptr : dc.p, nullptr);
    g.matmul(dy_out.as<gpu::bf16>(), dc.p, da.as<gpu::bf16>(), nullptr, ws.p, g.workspace_bytes(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = download(dy_out, size_t(tok * feat_out) * 2);
    const uint16_t* gb = reinterpret_cast<const uint16_t*>(got.data());
    double err = 0, ref2 = 0;
    for (int64_t n = 0; n < tok; ++n)
      for (int64_t o = 0; o < feat_out; ++o) {
        double acc = 0;
        for (int64_t i = 0; i < feat_in; ++i)
          acc += f(a[size_t(n * feat_in + i)]) * (fwd ? f(w[size_t(o * in + i)]) : f(w[size_t(i * in + o)]));
        const double d = f(gb[size_t(n * feat_out + o)]) - acc;
        err += d * d;
        ref2 += acc * acc;
      }
    EXPECT_LT(std::sqrt(err / ref2), 1e-2) << p.key();
  }
}

TEST(CusparseltLayout, WeightGradLayoutMatchesLibrary) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  if (!gpu::cusparselt_available()) GTEST_SKIP() << gpu::cusparselt_unavailable_reason();
  for (auto [out, tokens] : {std::pair<int64_t, int64_t>{64, 128}, {192, 64}, {256, 320}, {1024, 512}}) {
    const auto p = SparseGemm24Problem::linear_weight_grad(out, 48, tokens);
    SparseGemm24 g(p, SparseGemm24::Algorithm::library_default);
    const size_t bytes = gpu::cusparselt24_layout_bytes(out, tokens);
    ASSERT_EQ(g.compressed_bytes(), bytes) << p.key();
    const auto s = random_transposable(out, tokens, 313 + uint64_t(out + tokens), false);
    Dev ds(s.size() * 2), dc(bytes), dscratch(g.compress_scratch_bytes());
    CUDA_CHECK(cudaMemcpy(ds.p, s.data(), s.size() * 2, cudaMemcpyHostToDevice));
    g.compress(dc.p, ds.as<gpu::bf16>(), dscratch.p, g.compress_scratch_bytes(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto lib = download(dc, bytes);
    std::vector<uint8_t> host(bytes);
    gpu::cusparselt24_compress_host(s.data(), out, tokens, false, host.data());
    // The op N layout of an [out, tokens] operand: the forward form the writer implements.
    EXPECT_TRUE(lib == host) << p.key() << ": " << diff_text(lib, host, size_t(out * tokens));
    EXPECT_EQ(gpu::cusparselt24_layout_matches(g), lib == host) << p.key();
  }
}

// dY [N, out] with few distinct magnitudes (ties), zeros of both signs (1 in 8), and crafted
// groups (4 consecutive tokens of one output feature) along feature 0 and 1.
std::vector<uint16_t> craft_gradient(int64_t N, int64_t out, uint64_t seed) {
  std::vector<uint16_t> g(size_t(N * out));
  uint64_t s = seed;
  for (auto& x : g) {
    const uint32_t r = lcg(s);
    x = r % 8 == 0 ? uint16_t((r >> 3 & 1u) << 15) : uint16_t(((r >> 3 & 1u) << 15) | (0x3C00u + (r >> 4) % 6u * 16u));
  }
  const uint16_t kNaN = 0x7FC0, kInf = 0x7F80, kNegInf = 0xFF80, kHuge = 0x7F7F /* 3.39e38 */, kOne = 0x3F80,
                 kTwo = 0x4000, kZero = 0x0000, kNegZero = 0x8000;
  const uint16_t groups[][4] = {
      {kNaN, kOne, kTwo, kOne},              // NaN: top 2 (NaN and the first 2), unscaled
      {kInf, kNegInf, kOne, kZero},          // two infinities
      {kHuge, kHuge, kOne, kTwo},            // finite, but the sum overflows float
      {kNegZero, kZero, kNegZero, kZero},    // no non-zero
      {kZero, kTwo, kNegZero, kZero},        // one
      {kOne, kNegZero, kZero, kTwo},         // two: copied unchanged
      {kOne, kOne, kOne, kOne},              // four ties
      {kTwo, kOne, kOne, kOne},              // a tie below the largest
      {uint16_t(0x4100), kOne, kOne, kOne},  // 8, 1, 1, 1: the largest capped at probability 1
  };
  const int64_t count = int64_t(sizeof(groups) / sizeof(groups[0]));
  for (int64_t i = 0; i < count && 4 * (i + 1) <= N; ++i)
    for (int64_t feature : {int64_t(0), out - 1})
      for (int j = 0; j < 4; ++j) g[size_t((4 * i + j) * out + feature)] = groups[i][j];
  return g;
}

TEST(CusparseltLayout, MvueCompressMatchesHostReference) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  // (tokens N, out): the kernel's rows and columns, N != out.
  for (auto [N, out] : {std::pair<int64_t, int64_t>{64, 128}, {192, 64}, {256, 320}}) {
    SCOPED_TRACE("dY [" + std::to_string(N) + ", " + std::to_string(out) + "]");
    const auto dy = craft_gradient(N, out, 55 + uint64_t(N * 3 + out));
    // dYᵀ [out, N] for the CPU's estimate.
    std::vector<uint16_t> dyt(dy.size());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < out; ++o) dyt[size_t(o * N + n)] = dy[size_t(n * out + o)];
    const size_t bytes = gpu::cusparselt24_layout_bytes(out, N);
    Dev d_dy(dy.size() * 2), d_s(bytes), d_seed(sizeof(uint64_t));
    CUDA_CHECK(cudaMemcpy(d_dy.p, dy.data(), dy.size() * 2, cudaMemcpyHostToDevice));
    std::vector<uint8_t> first;
    for (uint64_t seed : {uint64_t(1), uint64_t(0x9e3779b97f4a7c15ull)}) {
      std::vector<uint16_t> s(dyt.size());
      std::vector<uint8_t> mask(dyt.size());
      esplag::cpu::mvue_24_bf16(dyt.data(), s.data(), mask.data(), out, N, seed, "dY^T");
      std::vector<uint8_t> host(bytes);
      gpu::cusparselt24_compress_host(s.data(), out, N, false, host.data());
      CUDA_CHECK(cudaMemset(d_s.p, 0xFF, bytes));  // NaN values, 0xF nibbles
      CUDA_CHECK(cudaMemcpy(d_seed.p, &seed, sizeof seed, cudaMemcpyHostToDevice));  // read by the kernel
      gpu::cusparselt24_compress_mvue_t(d_dy.as<gpu::bf16>(), N, out, d_seed.as<uint64_t>(), d_s.p, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = download(d_s, bytes);
      EXPECT_TRUE(got == host) << "seed " << seed << ": " << diff_text(got, host, size_t(out * N));
      // Not vacuous: the estimate rescaled kept values (scaled ones differ from the input)
      // and kept the non-finite values of the crafted groups.
      size_t scaled = 0, non_finite = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (mask[i] && s[i] != dyt[i]) ++scaled;
        if ((s[i] & 0x7F80u) == 0x7F80u) ++non_finite;
      }
      EXPECT_GT(scaled, s.size() / 8) << "seed " << seed;
      EXPECT_GE(non_finite, 6u) << "seed " << seed << ": NaN and infinities must survive (top 2, unscaled)";
      if (first.empty())
        first = got;
      else
        EXPECT_FALSE(got == first) << "another seed must give another draw";
    }
  }
  Dev d(64 * 128 * 2), dst(gpu::cusparselt24_layout_bytes(64, 64)), seed(sizeof(uint64_t));
  const uint64_t* sd = seed.as<uint64_t>();
  EXPECT_THROW(gpu::cusparselt24_compress_mvue_t(d.as<gpu::bf16>(), 48, 128, sd, dst.p, nullptr), esplag::Error);
  EXPECT_THROW(gpu::cusparselt24_compress_mvue_t(d.as<gpu::bf16>(), 64, 96, sd, dst.p, nullptr), esplag::Error);
  EXPECT_THROW(gpu::cusparselt24_compress_mvue_t(d.as<gpu::bf16>() + 1, 64, 64, sd, dst.p, nullptr), esplag::Error);
  EXPECT_THROW(gpu::cusparselt24_compress_mvue_t(d.as<gpu::bf16>(), 64, 64, nullptr, dst.p, nullptr), esplag::Error);
}

}  // namespace
