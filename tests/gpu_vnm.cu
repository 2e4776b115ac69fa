// The V:2:M sparse-tensor-core GEMM (sparse/cuda/vnm_gemm.h) against the CPU reference
// (sparse/compressed.h: cpu::linear_vnm, cpu::decompress_vnm).
//
// Weights go through the CPU path a model uses: random dense values, the V:2:M magnitude
// mask (cpu::vnm_mask), cpu::compress_vnm, bf16; inputs are fresh seeded random bf16
// values. Outputs are poisoned with NaN before every launch. Sizes include the smallest
// legal weights (out = V, in = M), in features that are not a whole K step (8 blocks) or
// not a multiple of 8 (the element-wise load path), misaligned pointers and 1, 17 and 1000
// tokens.
//
// Accuracy rule (as tests/gpu_ops.cu): against a float64 reference, the GPU's RMS and max
// errors must be within twice those of the same product computed on the CPU in fp32 from
// the same bf16 numbers (cpu::linear_vnm, then rounded like the GPU output), with floors
// of 1e-6 (bf16 output; max: a bf16 ulp at the largest value) or 1e-5 (fp32) relative.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "sparse/compressed.h"
#include "bench/lib/vnm.h"
#include "sparse/cuda/vnm_gemm.h"
#include "sparse/masks.h"

#include "gpu_test_util.h"

namespace {

using esplag::CompressedVNMBf16;
using esplag::DeviceArena;
using esplag::Rng;
using esplag::gpu::bf16;
using esplag::gpu::VnmDeviceWeight;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;

using esplag::gpu_test::Bits;
using esplag::gpu_test::Data;
using esplag::gpu_test::has_device;
using esplag::gpu_test::random_bf16;
using esplag::gpu_test::round_bf16;
using esplag::gpu_test::VD;
using esplag::gpu_test::VF;

// A V:2:M weight made the way the model makes one.
CompressedVNMBf16 make_weight(int64_t rows, int64_t cols, int v, int m, uint64_t seed) {
  Rng rng(seed);
  VF w(size_t(rows * cols));
  for (float& x : w) x = static_cast<float>(rng.normal());
  const cpu::Mask mask = cpu::vnm_mask(w.data(), rows, cols, v, m);
  cpu::apply_mask(w.data(), mask.data(), rows * cols);
  return cpu::to_bf16(cpu::compress_vnm(w.data(), rows, cols, v, m, "test weight"));
}

class Dev : public esplag::gpu_test::DeviceBuffers {
 public:
  Dev() : DeviceBuffers(size_t(512) << 20, "gpu_vnm test") {}

  // `offset` elements in front, so that the returned pointer can be deliberately misaligned.
  template <typename T>
  T* put(const std::vector<T>& h, size_t offset = 0) {
    T* d = arena().allocate_array<T>("input", h.size() + offset + 1);
    CUDA_CHECK(cudaMemcpy(d + offset, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d + offset;
  }
  template <typename T>
  T* poisoned(size_t n, size_t offset = 0) {
    T* d = arena().allocate_array<T>("output", n + offset + 1);
    CUDA_CHECK(cudaMemset(d, 0xFF, (n + offset + 1) * sizeof(T)));  // NaN as bf16 and fp32
    return d + offset;
  }
};

// Where a wrong result goes wrong, for the failure message: the first non-finite output and
// the largest error, as (token, out row) with got vs expected. `rows` = out features.
std::string first_bad(const VD& ref, const VF& got, int64_t rows) {
  size_t nan_at = got.size(), worst = 0;
  double worst_err = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      if (nan_at == got.size()) nan_at = i;
      continue;
    }
    const double e = std::fabs(double(got[i]) - ref[i]);
    if (e > worst_err) worst_err = e, worst = i;
  }
  char buf[256];
  std::string out;
  if (nan_at < got.size()) {
    std::snprintf(buf, sizeof buf, "first non-finite output at index %zu (token %lld, row %lld), expected %.6g; ",
                  nan_at, (long long)(int64_t(nan_at) / rows), (long long)(int64_t(nan_at) % rows), ref[nan_at]);
    out += buf;
  }
  if (worst_err >= 0) {
    std::snprintf(buf, sizeof buf, "largest error %.3g at index %zu (token %lld, row %lld): got %.6g, expected %.6g",
                  worst_err, worst, (long long)(int64_t(worst) / rows), (long long)(int64_t(worst) % rows),
                  double(got[worst]), ref[worst]);
    out += buf;
  }
  return out;
}

void expect_matches(const std::string& what, const VD& ref, const VF& low, const VF& got, bool bf16_out,
                    int64_t rows) {
  SCOPED_TRACE(what + ": " + first_bad(ref, got, rows));
  esplag::gpu_test::expect_within_low_precision(what, ref, low, got, bf16_out, "CPU fp32");
}

// The kernels a forward test runs: the mma.sp kernel always, the wgmma.sp kernel where the
// device has it (WgmmaKernelIsAvailableOnSm90 fails where it should and does not).
std::vector<gpu::VnmKernel> kernels_to_test() {
  std::vector<gpu::VnmKernel> k = {gpu::VnmKernel::mma_sp};
  if (gpu::vnm_wgmma_available()) k.push_back(gpu::VnmKernel::wgmma_sp);
  return k;
}

class GpuVnm : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"; }
};

// ---------------------------------------------------------------------------------------
// The fragment and metadata layout the weight conversion relies on, checked on one
// mma.sp.m16n8k32 tile: lane (g, t) holds the kept values of rows g / g+8, chunks t / t+4
// (a0..a7), and metadata lanes 4g+0 / 4g+1 hold chunks 0-3 / 4-7 of rows g (low 16 bits)
// and g+8 (high 16 bits). Two other plausible layouts are run as well, to say in the log
// which one the hardware uses if the expected one ever fails.

__global__ void one_tile_kernel(float* d, const uint16_t* vals, const uint8_t* nib, const uint16_t* b, int layout) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  // vals [16][8 chunks][2], nib [16][8], b [32][8] (k-major), d [16][8]
  auto pair = [&](int r, int c) { return uint32_t(vals[(r * 8 + c) * 2]) | uint32_t(vals[(r * 8 + c) * 2 + 1]) << 16; };
  auto half = [&](int r, int c0) {
    uint32_t h = 0;
    for (int j = 0; j < 4; ++j) h |= uint32_t(nib[r * 8 + c0 + j]) << (4 * j);
    return h;
  };
  uint32_t a[4] = {pair(g, t), pair(g + 8, t), pair(g, t + 4), pair(g + 8, t + 4)};
  uint32_t e = 0;
  const int w = t & 1;
  if (layout == 0) e = half(g, 4 * w) | half(g + 8, 4 * w) << 16;
  if (layout == 1) e = w == 0 ? (half(g, 0) | half(g, 4) << 16) : (half(g + 8, 0) | half(g + 8, 4) << 16);
  if (layout == 2) e = half(g + 8 * w, 0) | half(g + 8 * w, 4) << 16;
  uint32_t bb[4];
  for (int i = 0; i < 4; ++i) {
    const int k = 2 * t + 8 * i;
    bb[i] = uint32_t(b[k * 8 + g]) | uint32_t(b[(k + 1) * 8 + g]) << 16;
  }
  float c[4] = {0, 0, 0, 0};
  asm volatile(
      "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(bb[0]), "r"(bb[1]), "r"(bb[2]), "r"(bb[3]), "r"(e));
  d[g * 8 + 2 * t] = c[0];
  d[g * 8 + 2 * t + 1] = c[1];
  d[(g + 8) * 8 + 2 * t] = c[2];
  d[(g + 8) * 8 + 2 * t + 1] = c[3];
}

TEST_F(GpuVnm, MmaSpFragmentAndMetadataLayout) {
  Dev dev;
  Rng rng(3);
  static constexpr uint8_t kPairs[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
  Bits vals(16 * 8 * 2), bmat(32 * 8);
  std::vector<uint8_t> nib(16 * 8);
  VD dense(16 * 32, 0.0);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 8; ++c) {
      const auto& p = kPairs[rng.below(6)];
      nib[r * 8 + c] = uint8_t(p[0] | p[1] << 2);
      for (int j = 0; j < 2; ++j) {
        vals[(r * 8 + c) * 2 + j] = esplag::float_to_bf16(float(rng.normal()));
        dense[r * 32 + 4 * c + p[j]] = esplag::bf16_to_float(vals[(r * 8 + c) * 2 + j]);
      }
    }
  for (auto& x : bmat) x = esplag::float_to_bf16(float(rng.normal()));
  VD ref(16 * 8, 0.0);
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n)
      for (int k = 0; k < 32; ++k) ref[r * 8 + n] += dense[r * 32 + k] * esplag::bf16_to_float(bmat[k * 8 + n]);
  bool matches[3] = {false, false, false};
  for (int layout = 0; layout < 3; ++layout) {
    float* d = dev.poisoned<float>(16 * 8);
    one_tile_kernel<<<1, 32, 0, dev.stream()>>>(d, dev.put(vals), dev.put(nib), dev.put(bmat), layout);
    CUDA_CHECK_LAUNCH("one_tile_kernel");
    const VF got = dev.get(d, 16 * 8);
    double max_err = 0;
    for (size_t i = 0; i < ref.size(); ++i) max_err = std::max(max_err, std::fabs(got[i] - ref[i]));
    matches[layout] = max_err < 1e-3;
    std::printf("[ mma.sp layout %d ] max error %.3g -> %s\n", layout, max_err, matches[layout] ? "match" : "no match");
  }
  EXPECT_TRUE(matches[0]) << "the metadata layout the weight conversion uses does not match the hardware";
}

// ---------------------------------------------------------------------------------------
// Forward against the CPU reference.

struct Case {
  int v, m;
  int64_t rows, cols, tokens;
  bool bias = false, f32_out = false;
  size_t x_offset = 0, out_offset = 0;  // elements; 1 misaligns the pointer
};

void run_forward(const Case& c, uint64_t seed) {
  SCOPED_TRACE(std::to_string(c.v) + ":2:" + std::to_string(c.m) + " W [" + std::to_string(c.rows) + ", " +
               std::to_string(c.cols) + "] tokens " + std::to_string(c.tokens) + (c.bias ? " bias" : "") +
               (c.f32_out ? " fp32-out" : " bf16-out") + " x+" + std::to_string(c.x_offset) + " out+" +
               std::to_string(c.out_offset));
  Dev dev;
  const CompressedVNMBf16 w = make_weight(c.rows, c.cols, c.v, c.m, seed);
  const Data x = random_bf16(size_t(c.tokens * c.cols), seed + 1);
  const Data bias = random_bf16(size_t(c.rows), seed + 2);
  const VnmDeviceWeight dw = gpu::vnm_upload_weight(w, dev.arena(), dev.stream());
  const bf16* dx = reinterpret_cast<const bf16*>(dev.put(x.bits, c.x_offset));
  const bf16* dbias = c.bias ? reinterpret_cast<const bf16*>(dev.put(bias.bits)) : nullptr;
  const size_t n_out = size_t(c.tokens * c.rows);
  // Every warp tile the pattern allows.
  std::vector<gpu::VnmTile> tiles = {gpu::VnmTile::rows64};
  if (c.v % 128 == 0) tiles.push_back(gpu::VnmTile::rows128);
  // The transposed input for the Xᵀ kernel, its padding columns poisoned: they must never be read.
  const int64_t ldxt = gpu::vnm_transposed_ld(c.tokens);
  uint16_t* xt = dev.poisoned<uint16_t>(size_t(c.cols * ldxt) + 8);
  gpu::vnm_transpose_input(reinterpret_cast<bf16*>(xt), dx, c.tokens, c.cols, dev.stream());
  std::vector<VF> results;
  std::vector<std::string> names;
  for (const gpu::VnmKernel kernel : kernels_to_test())
    for (const gpu::VnmTile tile : tiles) {
      if (kernel == gpu::VnmKernel::wgmma_sp && tile != tiles.front()) continue;  // no warp tiles to choose
      for (const bool transposed : {false, true}) {
        VF got;
        if (c.f32_out) {
          float* out = dev.poisoned<float>(n_out, c.out_offset);
          if (transposed)
            gpu::vnm_linear_forward_xt(out, reinterpret_cast<const bf16*>(xt), ldxt, dw, dbias, c.tokens,
                                       dev.stream(), tile, kernel);
          else
            gpu::vnm_linear_forward(out, dx, dw, dbias, c.tokens, dev.stream(), tile, kernel);
          got = dev.get(out, n_out);
        } else {
          uint16_t* out = dev.poisoned<uint16_t>(n_out, c.out_offset);
          if (transposed)
            gpu::vnm_linear_forward_xt(reinterpret_cast<bf16*>(out), reinterpret_cast<const bf16*>(xt), ldxt, dw,
                                       dbias, c.tokens, dev.stream(), tile, kernel);
          else
            gpu::vnm_linear_forward(reinterpret_cast<bf16*>(out), dx, dw, dbias, c.tokens, dev.stream(), tile, kernel);
          const Bits bits = dev.get(out, n_out);
          got.resize(n_out);
          for (size_t i = 0; i < n_out; ++i) got[i] = esplag::bf16_to_float(bits[i]);
        }
        results.push_back(std::move(got));
        std::string name = kernel == gpu::VnmKernel::wgmma_sp ? "wgmma.sp" : "mma.sp";
        name += transposed ? " forward from X transposed" : " forward";
        if (kernel == gpu::VnmKernel::mma_sp)
          name += tile == gpu::VnmTile::rows128 ? ", 128-row warp tile" : ", 64-row warp tile";
        names.push_back(name);
      }
    }
  // fp64 reference over the kept values, and the CPU's fp32 computation.
  const int64_t blocks = c.cols / c.m;
  VD ref(n_out);
  for (int64_t t = 0; t < c.tokens; ++t)
    for (int64_t r = 0; r < c.rows; ++r) {
      double acc = c.bias ? bias.f[r] : 0.0;
      for (int64_t b = 0; b < blocks; ++b)
        for (int j = 0; j < 2; ++j)
          acc += double(esplag::bf16_to_float(w.inner.values[r * blocks * 2 + 2 * b + j])) *
                 double(x.f[t * c.cols + w.column(r, b, j)]);
      ref[t * c.rows + r] = acc;
    }
  VF low(n_out);
  cpu::linear_vnm(low.data(), x.f.data(), w, c.bias ? bias.f.data() : nullptr, c.tokens);
  if (!c.f32_out)
    for (float& v : low) v = round_bf16(v);
  for (size_t i = 0; i < results.size(); ++i) expect_matches(names[i], ref, low, results[i], !c.f32_out, c.rows);
}

TEST_F(GpuVnm, ForwardSmallestWeights) {
  // out = V, in = M: one row block, one (padded) K step.
  for (int m : {4, 5, 8, 16})
    for (int64_t tokens : {1, 17, 1000}) run_forward({64, m, 64, m, tokens}, 100 + m * 7 + tokens);
  run_forward({128, 8, 128, 8, 17}, 201);
  run_forward({128, 13, 128, 13, 1000, true, true}, 202);
}

TEST_F(GpuVnm, ForwardNonSquare) {
  // Several row tiles (256 rows) and token tiles (128), partial K steps, every M.
  run_forward({64, 8, 320, 8 * 25, 1000}, 11);
  run_forward({128, 8, 384, 8 * 64, 17, true}, 12);
  run_forward({64, 16, 192, 16 * 9, 1000, false, true}, 13);
  run_forward({64, 16, 576, 16 * 24, 300, true}, 14);
  run_forward({128, 12, 256, 12 * 10, 1000}, 15);
  run_forward({64, 4, 64, 4 * 24, 129}, 16);
  for (int m = 5; m <= 16; ++m) run_forward({64, m, 128, int64_t(m) * 19, 130, m % 2 == 0, m % 3 == 0}, 20 + m);
  run_forward({128, 7, 1024, 7 * 24, 200, true}, 40);
  // V not dividing the 256-row tile: row blocks straddle thread-block tiles.
  run_forward({192, 8, 576, 8 * 16, 100}, 41);
  run_forward({256, 6, 768, 6 * 40, 77, true, true}, 42);
}

// The wgmma.sp kernel's tiles (128 out rows as two 64-row warpgroups, 128 tokens, K steps
// of 8 blocks) at sizes that are not multiples of them, small and large, for the patterns
// the benchmark runs; every case runs on both kernels (run_forward).
TEST_F(GpuVnm, ForwardAwkwardSizesAllPatterns) {
  struct P {
    int v, m;
  };
  for (const P pat : {P{64, 8}, P{128, 8}, P{64, 16}, P{64, 5}}) {
    const int64_t v = pat.v, m = pat.m;
    const uint64_t seed = uint64_t(1000 + 10 * v + m);
    run_forward({pat.v, pat.m, v, m * 3, 1}, seed);                              // one row block, one partial step
    run_forward({pat.v, pat.m, 3 * v, m * 8 * 5 + m * 3, 129, true}, seed + 1);  // a half-empty 128-row tile
    run_forward({pat.v, pat.m, 5 * v, m * 8 * 12, 255, false, true}, seed + 2);
    run_forward({pat.v, pat.m, 16 * v, m * 8 * 24 + m, 700, true}, seed + 3);    // larger, bias, 1 block past a step
  }
}

TEST_F(GpuVnm, WgmmaKernelIsAvailableOnSm90) {
  int dev = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  std::printf("[ vnm kernels ] compute capability %d.%d, wgmma.sp kernel %s\n", major, minor,
              gpu::vnm_wgmma_available() ? "available" : "not available");
  if (major == 9 && minor == 0)
    EXPECT_TRUE(gpu::vnm_wgmma_available()) << "an sm_90 device, but the loaded image of vnm_wgmma.cu is not the "
                                               "sm_90a one (check the --generate-code flags of the build)";
}

TEST_F(GpuVnm, KernelSelection) {
  unsetenv("ESPLAG_VNM_KERNEL");
  EXPECT_EQ(gpu::vnm_resolve_kernel(gpu::VnmKernel::automatic), gpu::VnmKernel::mma_sp);  // the faster, measured
  if (gpu::vnm_wgmma_available()) {
    setenv("ESPLAG_VNM_KERNEL", "wgmma_sp", 1);
    EXPECT_EQ(gpu::vnm_resolve_kernel(gpu::VnmKernel::automatic), gpu::VnmKernel::wgmma_sp);
  }
  EXPECT_EQ(gpu::vnm_resolve_kernel(gpu::VnmKernel::mma_sp), gpu::VnmKernel::mma_sp);
  setenv("ESPLAG_VNM_KERNEL", "mma_sp", 1);
  EXPECT_EQ(gpu::vnm_resolve_kernel(gpu::VnmKernel::automatic), gpu::VnmKernel::mma_sp);
  setenv("ESPLAG_VNM_KERNEL", "fast", 1);
  try {
    gpu::vnm_resolve_kernel(gpu::VnmKernel::automatic);
    ADD_FAILURE() << "an unknown ESPLAG_VNM_KERNEL was accepted";
  } catch (const esplag::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ESPLAG_VNM_KERNEL"), std::string::npos) << e.what();
  }
  unsetenv("ESPLAG_VNM_KERNEL");
  if (!gpu::vnm_wgmma_available()) {
    try {
      gpu::vnm_resolve_kernel(gpu::VnmKernel::wgmma_sp);
      ADD_FAILURE() << "the wgmma.sp kernel was accepted on a device without it";
    } catch (const esplag::Error& e) {
      EXPECT_NE(std::string(e.what()).find("sm_90a"), std::string::npos) << e.what();
    }
  }
}

TEST_F(GpuVnm, ForwardUnalignedPointersAndWidths) {
  run_forward({64, 8, 64, 8 * 8, 33, false, false, 1, 0}, 51);   // X misaligned: element-wise loads
  run_forward({64, 8, 128, 8 * 16, 33, true, false, 0, 1}, 52);  // output misaligned: scalar stores
  run_forward({64, 8, 128, 8 * 16, 33, false, true, 3, 1}, 53);  // both, fp32 output
  run_forward({64, 5, 192, 5 * 13, 1000, true}, 54);             // in = 65: not a multiple of 8
  run_forward({128, 7, 256, 7 * 9, 17, false, true}, 55);        // in = 63
}

TEST_F(GpuVnm, ForwardIsDeterministicAndLeavesOtherMemoryAlone) {
  Dev dev;
  const int64_t rows = 256, cols = 8 * 40, tokens = 300;
  const CompressedVNMBf16 w = make_weight(rows, cols, 64, 8, 61);
  const Data x = random_bf16(size_t(tokens * cols), 62);
  const VnmDeviceWeight dw = gpu::vnm_upload_weight(w, dev.arena(), dev.stream());
  const bf16* dx = reinterpret_cast<const bf16*>(dev.put(x.bits));
  // One guard element on each side of the output must keep its poison.
  uint16_t* out = dev.poisoned<uint16_t>(size_t(tokens * rows) + 1, 8);  // 16-byte aligned
  gpu::vnm_linear_forward(reinterpret_cast<bf16*>(out), dx, dw, nullptr, tokens, dev.stream());
  const Bits a = dev.get(out - 1, size_t(tokens * rows) + 2);
  CUDA_CHECK(cudaMemset(out, 0xFF, size_t(tokens * rows) * 2));
  gpu::vnm_linear_forward(reinterpret_cast<bf16*>(out), dx, dw, nullptr, tokens, dev.stream());
  const Bits b = dev.get(out - 1, size_t(tokens * rows) + 2);
  EXPECT_EQ(a.front(), 0xFFFF);
  EXPECT_EQ(a.back(), 0xFFFF);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 2), 0) << "results differ between runs";
}

// ---------------------------------------------------------------------------------------
// The converted layout: decompression, value updates.

TEST_F(GpuVnm, DecompressMatchesCpu) {
  struct S {
    int v, m;
    int64_t rows, cols;
  };
  for (const S& s : {S{64, 8, 64, 8}, S{64, 5, 320, 5 * 21}, S{128, 16, 384, 16 * 17}, S{192, 11, 384, 11 * 9},
                     S{64, 4, 128, 4 * 40}}) {
    SCOPED_TRACE(std::to_string(s.v) + ":2:" + std::to_string(s.m) + " [" + std::to_string(s.rows) + ", " +
                 std::to_string(s.cols) + "]");
    Dev dev;
    const CompressedVNMBf16 w = make_weight(s.rows, s.cols, s.v, s.m, uint64_t(s.rows + s.m));
    const VnmDeviceWeight dw = gpu::vnm_upload_weight(w, dev.arena(), dev.stream());
    uint16_t* out = dev.poisoned<uint16_t>(size_t(s.rows * s.cols));
    gpu::vnm_decompress(reinterpret_cast<bf16*>(out), dw, dev.stream());
    const Bits got = dev.get(out, size_t(s.rows * s.cols));
    VF ref(size_t(s.rows * s.cols));
    cpu::decompress_vnm(w, ref.data());
    size_t diff = 0;
    for (size_t i = 0; i < ref.size(); ++i) diff += esplag::bf16_to_float(got[i]) != ref[i];
    EXPECT_EQ(diff, 0u) << "decompressed weight differs from the CPU's in " << diff << " places";
  }
}

TEST_F(GpuVnm, UpdateValuesKeepsIndices) {
  Dev dev;
  const int64_t rows = 128, cols = 8 * 20, tokens = 50;
  CompressedVNMBf16 w = make_weight(rows, cols, 64, 8, 71);
  const VnmDeviceWeight dw = gpu::vnm_upload_weight(w, dev.arena(), dev.stream());
  Rng rng(72);
  for (uint16_t& v : w.inner.values) v = esplag::float_to_bf16(float(rng.normal()));
  gpu::vnm_update_values(dw, reinterpret_cast<const bf16*>(dev.put(w.inner.values)), dev.stream());
  const Data x = random_bf16(size_t(tokens * cols), 73);
  const size_t n_out = size_t(tokens * rows);
  VF low(n_out);
  cpu::linear_vnm(low.data(), x.f.data(), w, nullptr, tokens);
  VD ref(n_out);
  VF dense(size_t(rows * cols));
  cpu::decompress_vnm(w, dense.data());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      double acc = 0;
      for (int64_t k = 0; k < cols; ++k) acc += double(dense[r * cols + k]) * double(x.f[t * cols + k]);
      ref[t * rows + r] = acc;
    }
  const bf16* dx = reinterpret_cast<const bf16*>(dev.put(x.bits));
  for (const gpu::VnmKernel kernel : kernels_to_test()) {
    float* out = dev.poisoned<float>(n_out);
    gpu::vnm_linear_forward(out, dx, dw, nullptr, tokens, dev.stream(), gpu::VnmTile::automatic, kernel);
    expect_matches(std::string("forward after vnm_update_values, ") +
                       (kernel == gpu::VnmKernel::wgmma_sp ? "wgmma.sp" : "mma.sp"),
                   ref, low, dev.get(out, n_out), false, rows);
  }
}

// ---------------------------------------------------------------------------------------
// Errors

template <typename F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no esplag::Error thrown (expected one mentioning '" << needle << "')";
  } catch (const esplag::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

TEST_F(GpuVnm, IllegalShapesThrow) {
  expect_error([] { gpu::vnm_device_weight_bytes(96, 64, 64, 8); }, "not a multiple of V");
  expect_error([] { gpu::vnm_device_weight_bytes(128, 60, 64, 8); }, "not a multiple of M");
  expect_error([] { gpu::vnm_device_weight_bytes(64, 64, 32, 8); }, "multiple of 64");
  expect_error([] { gpu::vnm_device_weight_bytes(64, 48, 64, 3); }, "4 <= M <= 16");
  expect_error([] { gpu::vnm_device_weight_bytes(64, 68, 64, 17); }, "4 <= M <= 16");
  expect_error([] { gpu::vnm_device_weight_bytes(0, 64, 64, 8); }, "empty");
  Dev dev;
  CompressedVNMBf16 w = make_weight(128, 64, 64, 8, 81);
  // Storage too small.
  void* small = dev.arena().allocate("small", 256);
  expect_error(
      [&] {
        gpu::vnm_prepare_weight(small, 256, reinterpret_cast<const uint8_t*>(small), reinterpret_cast<const bf16*>(small),
                                reinterpret_cast<const uint16_t*>(small), 128, 64, 64, 8, dev.stream());
      },
      "too small");
  // Inconsistent host arrays.
  CompressedVNMBf16 bad = w;
  bad.columns.pop_back();
  expect_error([&] { gpu::vnm_upload_weight(bad, dev.arena(), dev.stream()); }, "inconsistent");
  // A column index >= M, and a metadata nibble naming the same position twice.
  bad = w;
  bad.columns[5] = 8;
  expect_error([&] { gpu::vnm_upload_weight(bad, dev.arena(), dev.stream()); }, "invalid indices");
  bad = w;
  bad.inner.meta[3] = uint16_t((bad.inner.meta[3] & ~0xFu) | 0x5u);
  expect_error([&] { gpu::vnm_upload_weight(bad, dev.arena(), dev.stream()); }, "invalid indices");
  // The forward: an unprepared weight, negative tokens, null pointers.
  const VnmDeviceWeight dw = gpu::vnm_upload_weight(w, dev.arena(), dev.stream());
  bf16* buf = reinterpret_cast<bf16*>(dev.arena().allocate("buf", 1 << 20));
  expect_error([&] { gpu::vnm_linear_forward(buf, buf, VnmDeviceWeight{}, nullptr, 4, dev.stream()); },
               "not been prepared");
  expect_error([&] { gpu::vnm_linear_forward(buf, buf, dw, nullptr, -1, dev.stream()); }, "negative");
  expect_error([&] { gpu::vnm_linear_forward(buf, static_cast<const bf16*>(nullptr), dw, nullptr, 4, dev.stream()); },
               "null");
  VnmDeviceWeight tampered = dw;
  tampered.cols = 128;
  expect_error([&] { gpu::vnm_linear_forward(buf, buf, tampered, nullptr, 4, dev.stream()); }, "do not match");
  expect_error([&] { gpu::vnm_linear_forward(buf, buf, dw, nullptr, 4, dev.stream(), gpu::VnmTile::rows128); },
               "multiple of 128");
  expect_error([&] { gpu::vnm_linear_forward_xt(buf, buf, 12, dw, nullptr, 4, dev.stream()); }, "multiple of 8");
  expect_error([&] { gpu::vnm_linear_forward_xt(buf, buf, 8, dw, nullptr, 9, dev.stream()); }, "at least tokens");
  // Zero tokens is a valid no-op.
  EXPECT_NO_THROW(gpu::vnm_linear_forward(buf, buf, dw, nullptr, 0, dev.stream()));
  CUDA_CHECK(cudaStreamSynchronize(dev.stream()));
}

// ---------------------------------------------------------------------------------------
// Timing (no assertions on time): llama-1b/7b GEMM shapes, V:2:M kernel vs cuBLASLt dense bf16.

TEST_F(GpuVnm, VnmGemmTiming) {
  const auto results = gpu::vnm_bench(gpu::vnm_bench_default_shapes(), gpu::vnm_bench_default_patterns(), 5, 20);
  std::printf("%s", gpu::vnm_bench_table(results).c_str());
  std::printf("csv:\n%s", gpu::vnm_bench_csv(results).c_str());
  for (const auto& r : results) {
    EXPECT_GT(r.vnm_ms, 0.0);
    EXPECT_GT(r.vnm_xt_ms, 0.0);
    if (gpu::vnm_wgmma_available()) EXPECT_GT(r.wgmma_ms * r.wgmma_xt_ms, 0.0);
    EXPECT_LT(r.spot_rel_error, 2e-2) << r.pattern.v << ":2:" << r.pattern.m << " " << r.shape.out << "x"
                                      << r.shape.in << "x" << r.shape.tokens << ": sparse GEMM output is wrong ("
                                      << r.spot_worst_path << ")";
  }
}

}  // namespace
