// cuSPARSELt 2:4 GEMMs (sparse/cuda/cusparselt.h) against the CPU reference.
//
// W is pruned on the GPU (4×4 tile rule), read back and checked to be 2:4 along both
// dimensions; the CPU then computes the same masked product twice: in fp64 (the
// reference) and through sparse/'s compressed 2:4 SpMM (cpu::compress_24 + linear_24,
// fp32 accumulation, bf16 rounding: "low"). Accuracy rule as in gpu_ops.cu: the GPU's
// error against fp64 is no worse than twice the CPU low-precision error (RMS and max, with
// the bf16 floors), and within 1e-2 relative RMS. Outputs are poisoned with NaN before
// every product; sizes are multiples of 16 (cuSPARSELt's rule) but not of 32 or 64.
// The weight-gradient product (dW [out, in] = S [out, N] · X [N, in], S structured) is
// checked the same way with S pruned and compressed by the library.
//
// Tests that need the library skip (GTEST_SKIP, with the reason) when it cannot be loaded;
// the shape rules are checked without it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "ops/activation.h"
#include "sparse/compressed.h"
#include "sparse/masks.h"
#include "sparse/pattern.h"
#include "sparse/transposable.h"
#include "sparse/cuda/cusparselt.h"

#include "gpu_test_util.h"
#include "test_util.h"

namespace {

using esplag::DeviceArena;
using esplag::Rng;
using esplag::gpu::bf16;
using esplag::gpu::SparseActivation;
using esplag::gpu::SparseGemm24;
using esplag::gpu::SparseGemm24Config;
using esplag::gpu::SparseGemm24Problem;
using esplag::gpu::SparseOperand;
using esplag::gpu::SparseProduct;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;

using esplag::gpu_test::Bits;
using esplag::gpu_test::has_device;
using esplag::gpu_test::round_bf16;
using esplag::gpu_test::VD;
using esplag::gpu_test::VF;
using esplag::testing::contains;
using esplag::testing::error_of;

VF to_float(const Bits& b) { return esplag::gpu_test::bits_to_float(b); }

// bf16-representable random values, never zero (|x| >= 0.05·scale), so the tile pruning
// keeps exactly 2 of 4 everywhere.
Bits random_bits(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  Bits b(n);
  for (auto& x : b) {
    double v = rng.normal();
    if (std::fabs(v) < 0.05) v = v < 0 ? -0.05 : 0.05;
    x = esplag::float_to_bf16(static_cast<float>(scale * v));
  }
  return b;
}

// Device buffers from one arena per test.
class Dev : public esplag::gpu_test::DeviceBuffers {
 public:
  Dev() : DeviceBuffers(size_t(64) << 20) {}
  void poison(bf16* d, size_t n) { CUDA_CHECK(cudaMemsetAsync(d, 0xFF, n * sizeof(bf16), stream())); }
  void* bytes(size_t n, const char* name) { return scratch(n, name); }
};

// ---------------------------------------------------------------------------------------
// Comparison (the rule of gpu_ops.cu)

void expect_matches(const std::string& what, const VD& ref, const VF& low, const VF& got) {
  esplag::gpu_test::expect_within_low_precision(what, ref, low, got, /*bf16_out=*/true);
}

// ---------------------------------------------------------------------------------------
// CPU references of the masked products

VF transpose(const VF& a, int64_t rows, int64_t cols) {
  VF t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

double gelu_tanh(double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

double activate(double x, SparseActivation a) {
  if (a == SparseActivation::relu) return x > 0 ? x : 0;
  if (a == SparseActivation::gelu) return gelu_tanh(x);
  return x;
}

// forward: Y [N, out] = act(X [N, in] · Wpᵀ + bias);  backward_data: dX [N, in] = dY [N, out] · Wp.
struct Reference {
  VD ref;
  VF low;
};

Reference reference(const SparseGemm24Problem& p, const VF& wp, const VF& x, const VF* bias) {
  const int64_t out = p.out, in = p.in, N = p.tokens;
  const bool fwd = p.product == SparseProduct::forward;
  const int64_t rows = fwd ? out : in, cols = fwd ? in : out;  // the CPU's W for out[N, rows] = x · Wᵀ
  const VF w = fwd ? wp : transpose(wp, out, in);
  Reference r;
  r.ref.assign(size_t(N) * rows, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < rows; ++o) {
      double s = bias ? double((*bias)[o]) : 0.0;
      for (int64_t k = 0; k < cols; ++k) s += double(x[n * cols + k]) * double(w[o * cols + k]);
      r.ref[n * rows + o] = activate(s, p.activation);
    }
  // sparse/'s compressed 2:4 SpMM (throws if the GPU-pruned W is not 2:4 along K).
  const esplag::Compressed24 c = cpu::compress_24(w.data(), rows, cols, "pruned W");
  r.low.assign(size_t(N) * rows, 0.f);
  cpu::linear_24(r.low.data(), x.data(), c, bias ? bias->data() : nullptr, N);
  for (float& v : r.low) v = round_bf16(static_cast<float>(activate(v, p.activation)));
  return r;
}

// Each 4×4 tile keeps exactly 2 per row and 2 per column (inputs have no zeros).
void expect_tile_24(const VF& wp, int64_t rows, int64_t cols) {
  std::vector<uint8_t> nz(wp.size());
  for (size_t i = 0; i < wp.size(); ++i) nz[i] = wp[i] != 0.f;
  const auto along_cols = cpu::check_pattern(nz.data(), rows, cols, esplag::SparsityPattern::nm(2, 4));
  EXPECT_TRUE(along_cols.ok) << "pruned W is not 2:4 along its rows: " << along_cols.detail;
  std::vector<uint8_t> nzt(nz.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) nzt[c * rows + r] = nz[r * cols + c];
  const auto along_rows = cpu::check_pattern(nzt.data(), cols, rows, esplag::SparsityPattern::nm(2, 4));
  EXPECT_TRUE(along_rows.ok) << "pruned W is not 2:4 along its columns: " << along_rows.detail;
  EXPECT_DOUBLE_EQ(along_cols.density, 0.5);
}

// One problem end to end: prune (tile), check, compress, poisoned matmul vs the CPU.
struct Run {
  VF wp;  // the pruned W as the GPU left it
};

Run run_problem(const SparseGemm24Problem& p, uint64_t seed, SparseGemm24* obj = nullptr, bool search = false,
                Dev* shared = nullptr) {
  SCOPED_TRACE(p.key());
  std::unique_ptr<Dev> own_dev;
  if (!shared) own_dev = std::make_unique<Dev>();
  Dev& dev = shared ? *shared : *own_dev;
  const int64_t out = p.out, in = p.in, N = p.tokens;
  const bool fwd = p.product == SparseProduct::forward;
  const size_t n_w = size_t(out) * in, n_x = size_t(N) * (fwd ? in : out), n_y = size_t(N) * (fwd ? out : in);
  const Bits w = random_bits(n_w, seed, 0.1), x = random_bits(n_x, seed + 1);
  Bits bias_bits;
  VF bias;
  if (p.bias) {
    bias_bits = random_bits(size_t(out), seed + 2, 0.5);
    bias = to_float(bias_bits);
  }
  std::unique_ptr<SparseGemm24> own;
  if (!obj) {
    own = std::make_unique<SparseGemm24>(p);
    obj = own.get();
  }
  const bf16* dw = dev.put_bf16(w, "W");
  const bf16* dx = dev.put_bf16(x, "x");
  const bf16* db = p.bias ? dev.put_bf16(bias_bits, "bias") : nullptr;
  bf16* pruned = dev.poisoned_bf16(n_w, "pruned");

  EXPECT_FALSE(obj->is_pruned(dw, dev.stream())) << "a dense random W must fail the 2:4 check";
  obj->prune(pruned, dw, dev.stream());
  EXPECT_TRUE(obj->is_pruned(pruned, dev.stream()));
  Run run;
  run.wp = dev.get_bf16(pruned, n_w);
  {
    const VF wf = to_float(w);
    for (size_t i = 0; i < n_w; ++i)
      if (run.wp[i] != 0.f && run.wp[i] != wf[i]) {
        ADD_FAILURE() << "prune changed a kept value at " << i << ": " << wf[i] << " -> " << run.wp[i];
        break;
      }
  }
  expect_tile_24(run.wp, out, in);

  void* comp = dev.bytes(obj->compressed_bytes(), "compressed");
  void* scratch = dev.bytes(obj->compress_scratch_bytes(), "scratch");
  obj->compress(comp, pruned, scratch, obj->compress_scratch_bytes(), dev.stream());
  const size_t ws_bytes = std::max<size_t>(obj->workspace_bytes(), size_t(8) << 20);
  void* ws = dev.bytes(ws_bytes, "workspace");
  bf16* y = dev.poisoned_bf16(n_y, "y");
  if (search) {
    obj->search(y, comp, dx, db, ws, ws_bytes, dev.stream());
    EXPECT_LE(obj->workspace_bytes(), ws_bytes) << "the searched plan needs more workspace than the test gave";
    dev.poison(y, n_y);
  }
  obj->matmul(y, comp, dx, db, ws, ws_bytes, dev.stream());
  const Reference ref = reference(p, run.wp, to_float(x), p.bias ? &bias : nullptr);
  expect_matches(p.key(), ref.ref, ref.low, dev.get_bf16(y, n_y));
  return run;
}

// The weight-gradient product: S [out, N] random, pruned (tile rule, along K = N) and
// compressed by the library, dW [out, in] = S · X [N, in] against fp64 and against
// sparse/'s compressed SpMM (dWᵀ = Xᵀ · Sᵀ as linear_24 computes it, fp32, bf16-rounded).
void run_weight_grad(const SparseGemm24Problem& p, uint64_t seed, SparseGemm24* obj = nullptr, bool search = false) {
  SCOPED_TRACE(p.key());
  Dev dev;
  const int64_t out = p.out, in = p.in, N = p.tokens;
  const size_t n_s = size_t(out) * N, n_x = size_t(N) * in, n_d = size_t(out) * in;
  const Bits sd = random_bits(n_s, seed, 0.5), x = random_bits(n_x, seed + 1);
  std::unique_ptr<SparseGemm24> own;
  if (!obj) {
    own = std::make_unique<SparseGemm24>(p);
    obj = own.get();
  }
  bf16* ds = dev.put_bf16(sd, "S");
  const bf16* dx = dev.put_bf16(x, "x");
  EXPECT_FALSE(obj->is_pruned(ds, dev.stream())) << "a dense random S must fail the 2:4 check";
  obj->prune(ds, ds, dev.stream());
  EXPECT_TRUE(obj->is_pruned(ds, dev.stream()));
  const VF sp = dev.get_bf16(ds, n_s);
  expect_tile_24(sp, out, N);
  void* comp = dev.bytes(obj->compressed_bytes(), "compressed");
  void* scratch = dev.bytes(obj->compress_scratch_bytes(), "scratch");
  obj->compress(comp, ds, scratch, obj->compress_scratch_bytes(), dev.stream());
  const size_t ws_bytes = std::max<size_t>(obj->workspace_bytes(), size_t(8) << 20);
  void* ws = dev.bytes(ws_bytes, "workspace");
  bf16* d = dev.poisoned_bf16(n_d, "dW");
  if (search) {
    obj->search(d, comp, dx, nullptr, ws, ws_bytes, dev.stream());
    EXPECT_LE(obj->workspace_bytes(), ws_bytes) << "the searched plan needs more workspace than the test gave";
    dev.poison(d, n_d);
  }
  obj->matmul(d, comp, dx, nullptr, ws, ws_bytes, dev.stream());
  const VF xf = to_float(x);
  VD ref(n_d, 0.0);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double acc = 0;
      for (int64_t n = 0; n < N; ++n) acc += double(sp[size_t(o * N + n)]) * double(xf[size_t(n * in + i)]);
      ref[size_t(o * in + i)] = acc;
    }
  const esplag::Compressed24 c = cpu::compress_24(sp.data(), out, N, "pruned S");
  VF low_t(n_d, 0.f);  // [in, out]
  cpu::linear_24(low_t.data(), transpose(xf, N, in).data(), c, nullptr, in);
  VF low = transpose(low_t, in, out);
  for (float& v : low) v = round_bf16(v);
  expect_matches(p.key(), ref, low, dev.get_bf16(d, n_d));
}

struct Shape {
  int64_t out, in, tokens;
};
// Multiples of 16, most of them not of 32 (cuSPARSELt's tiles are larger than 16).
const Shape kShapes[] = {{64, 128, 32}, {48, 80, 112}, {144, 208, 96}, {16, 16, 16}, {272, 48, 176}};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class CusparseLt : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests";
    if (!gpu::cusparselt_available())
      GTEST_SKIP() << "cuSPARSELt cannot be loaded: " << gpu::cusparselt_unavailable_reason();
    // Every test tunes into its own file, never into the user's cache.
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    tuning_ = (std::filesystem::temp_directory_path() /
               ("esplag_cusparselt_" + std::to_string(::getpid()) + "_" + info->name() + ".json"))
                  .string();
    std::filesystem::remove(tuning_);
    gpu::set_cusparselt_tuning_path(tuning_);
    gpu::set_cusparselt_search(true);
    gpu::clear_sparse_gemm24_cache();
  }
  void TearDown() override {
    if (!tuning_.empty()) std::filesystem::remove(tuning_);
  }
  std::string tuning_;
};

// ---------------------------------------------------------------------------------------

TEST(CusparseLtRules, ShapesThatCannotRunThrowClearErrors) {
  // Pure checks: these need neither a GPU nor the library.
  auto msg = error_of([] { gpu::check_sparse_gemm24_problem(SparseGemm24Problem::linear_forward(50, 64, 32)); });
  EXPECT_TRUE(contains(msg, "out = 50") && contains(msg, "multiple of 16")) << msg;
  msg = error_of([] { gpu::check_sparse_gemm24_problem(SparseGemm24Problem::linear_forward(64, 72, 32)); });
  EXPECT_TRUE(contains(msg, "in = 72") && contains(msg, "multiple of 16")) << msg;
  msg = error_of([] { gpu::check_sparse_gemm24_problem(SparseGemm24Problem::linear_backward_data(64, 64, 37)); });
  EXPECT_TRUE(contains(msg, "tokens = 37")) << msg;
  msg = error_of([] { gpu::check_sparse_gemm24_problem(SparseGemm24Problem::linear_forward(64, 64, 0)); });
  EXPECT_TRUE(contains(msg, "tokens must be positive")) << msg;
  msg = error_of([] {
    gpu::check_sparse_gemm24_problem(
        SparseGemm24Problem::linear_forward(64, 64, 32, true, SparseActivation::none, SparseOperand::b));
  });
  EXPECT_TRUE(contains(msg, "operand A")) << msg;
  SparseGemm24Problem bwd = SparseGemm24Problem::linear_backward_data(64, 64, 32);
  bwd.bias = true;
  msg = error_of([&] { gpu::check_sparse_gemm24_problem(bwd); });
  EXPECT_TRUE(contains(msg, "no bias")) << msg;
  msg = error_of([] { gpu::check_sparse_gemm24_problem(SparseGemm24Problem::linear_forward(65536, 65536, 16)); });
  EXPECT_TRUE(contains(msg, "2^31")) << msg;
  EXPECT_EQ(error_of([] { gpu::check_sparse_gemm24_problem(SparseGemm24Problem::linear_forward(48, 80, 112)); }),
            "(no error)");
  // The constructor applies the same rules before touching the library.
  msg = error_of([] { SparseGemm24 g(SparseGemm24Problem::linear_forward(64, 64, 40)); });
  EXPECT_TRUE(contains(msg, "tokens = 40")) << msg;
  // Keys name every field, so distinct problems never share a plan or a tuning entry.
  EXPECT_EQ(SparseGemm24Problem::linear_forward(4096, 1024, 8192, true, SparseActivation::gelu).key(),
            "fwd out=4096 in=1024 tokens=8192 w=A bias=1 act=gelu bf16");
  EXPECT_EQ(SparseGemm24Problem::linear_backward_data(64, 32, 16, SparseOperand::b).key(),
            "bwd out=64 in=32 tokens=16 w=B bias=0 act=none bf16");
  // The weight-gradient product: K = tokens, the structured operand [out, tokens], no
  // epilogue, operand A only.
  const SparseGemm24Problem dw = SparseGemm24Problem::linear_weight_grad(4096, 1024, 8192);
  EXPECT_EQ(dw.key(), "dw out=4096 in=1024 tokens=8192 w=A bias=0 act=none bf16");
  EXPECT_EQ(dw.k(), 8192);
  EXPECT_EQ(dw.structured_rows(), 4096);
  EXPECT_EQ(dw.structured_cols(), 8192);
  EXPECT_EQ(error_of([&] { gpu::check_sparse_gemm24_problem(dw); }), "(no error)");
  msg = error_of([] { gpu::check_sparse_gemm24_problem(SparseGemm24Problem::linear_weight_grad(64, 64, 40)); });
  EXPECT_TRUE(contains(msg, "tokens = 40") && contains(msg, "dw out=64")) << msg;
  SparseGemm24Problem dw_bias = SparseGemm24Problem::linear_weight_grad(64, 64, 64);
  dw_bias.bias = true;
  msg = error_of([&] { gpu::check_sparse_gemm24_problem(dw_bias); });
  EXPECT_TRUE(contains(msg, "weight-gradient product has no bias")) << msg;
  SparseGemm24Problem dw_b = SparseGemm24Problem::linear_weight_grad(64, 64, 64);
  dw_b.weight_operand = SparseOperand::b;
  msg = error_of([&] { gpu::check_sparse_gemm24_problem(dw_b); });
  EXPECT_TRUE(contains(msg, "operand A only")) << msg;
  msg = error_of([] { gpu::check_sparse_gemm24_problem(SparseGemm24Problem::linear_weight_grad(65536, 64, 65536)); });
  EXPECT_TRUE(contains(msg, "structured dY^T") && contains(msg, "2^31")) << msg;
  // semi_sparse_activation's products: the structured operand is the pruned input Xs
  // [tokens, in] (forward, K = in) or its transpose [in, tokens] (weight gradient, K =
  // tokens); no epilogue, operand A only.
  const SparseGemm24Problem xf = SparseGemm24Problem::linear_activation_forward(4096, 1024, 8192);
  const SparseGemm24Problem xd = SparseGemm24Problem::linear_activation_weight_grad(4096, 1024, 8192);
  EXPECT_EQ(xf.key(), "xfwd out=4096 in=1024 tokens=8192 w=A bias=0 act=none bf16");
  EXPECT_EQ(xd.key(), "xdw out=4096 in=1024 tokens=8192 w=A bias=0 act=none bf16");
  EXPECT_EQ(xf.k(), 1024);
  EXPECT_EQ(xd.k(), 8192);
  EXPECT_EQ(std::make_pair(xf.structured_rows(), xf.structured_cols()), std::make_pair(int64_t(8192), int64_t(1024)));
  EXPECT_EQ(std::make_pair(xd.structured_rows(), xd.structured_cols()), std::make_pair(int64_t(1024), int64_t(8192)));
  for (SparseGemm24Problem q : {xf, xd}) {
    EXPECT_EQ(error_of([&] { gpu::check_sparse_gemm24_problem(q); }), "(no error)");
    q.bias = true;
    EXPECT_TRUE(contains(error_of([&] { gpu::check_sparse_gemm24_problem(q); }), "has no bias")) << q.key();
    q.bias = false;
    q.weight_operand = SparseOperand::b;
    EXPECT_TRUE(contains(error_of([&] { gpu::check_sparse_gemm24_problem(q); }), "operand A only")) << q.key();
  }
  // fp8 (e4m3) operands: the forward product with W as A, no epilogue, multiples of 32.
  SparseGemm24Problem f8 = SparseGemm24Problem::linear_forward(4096, 1024, 8192);
  f8.dtype = gpu::SparseDtype::e4m3;
  EXPECT_EQ(f8.key(), "fwd out=4096 in=1024 tokens=8192 w=A bias=0 act=none e4m3");
  EXPECT_EQ(f8.element_bytes(), 1u);
  EXPECT_EQ(error_of([&] { gpu::check_sparse_gemm24_problem(f8); }), "(no error)");
  for (const auto& [make, needle] : std::vector<std::pair<std::function<SparseGemm24Problem()>, std::string>>{
           {[] { return SparseGemm24Problem::linear_forward(64, 48, 32); }, "in = 48 is not a multiple of 32"},
           {[] { return SparseGemm24Problem::linear_backward_data(64, 64, 32); }, "forward product with W as operand A"},
           {[] { return SparseGemm24Problem::linear_forward(64, 64, 32, true); }, "without bias or activation"},
           {[] { return SparseGemm24Problem::linear_forward(64, 64, 32, false, SparseActivation::none,
                                                            SparseOperand::b); },
            "forward product with W as operand A"}}) {
    SparseGemm24Problem q = make();
    q.dtype = gpu::SparseDtype::e4m3;
    msg = error_of([&] { gpu::check_sparse_gemm24_problem(q); });
    EXPECT_TRUE(contains(msg, needle) && contains(msg, "e4m3")) << msg;
  }
}

TEST(CusparseLtRules, FallbackWarningIsPrintedOncePerCaller) {
  ::testing::internal::CaptureStderr();
  gpu::warn_cusparselt_fallback_once("layer h.0.mlp", "in = 72 is not a multiple of 16");
  gpu::warn_cusparselt_fallback_once("layer h.0.mlp", "in = 72 is not a multiple of 16");
  gpu::warn_cusparselt_fallback_once("layer h.1.mlp", "in = 72 is not a multiple of 16");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err,
            "esplag: warning: layer h.0.mlp runs dense GEMMs: in = 72 is not a multiple of 16\n"
            "esplag: warning: layer h.1.mlp runs dense GEMMs: in = 72 is not a multiple of 16\n");
}

TEST(CusparseLtRules, AvailabilityIsReported) {
  if (gpu::cusparselt_available()) {
    EXPECT_TRUE(gpu::cusparselt_unavailable_reason().empty());
    EXPECT_GE(gpu::cusparselt_version(), 800) << "this code was written against cuSPARSELt 0.8";
    std::printf("[ cusparselt ] version %d\n", gpu::cusparselt_version());
  } else {
    EXPECT_FALSE(gpu::cusparselt_unavailable_reason().empty());
    EXPECT_EQ(gpu::cusparselt_version(), 0);
    std::printf("[ cusparselt ] not available: %s\n", gpu::cusparselt_unavailable_reason().c_str());
  }
}

TEST_F(CusparseLt, ForwardWeightAsA) {
  uint64_t seed = 100;
  for (const Shape& s : kShapes) run_problem(SparseGemm24Problem::linear_forward(s.out, s.in, s.tokens), seed += 10);
}

// fp8 (e4m3) W and X, bf16 Y: W and X rounded to e4m3 on the host (cuda_fp8.h's
// conversion, round to nearest), W pruned by the library on its fp8 bytes, and the product
// against fp64 and against sparse/'s compressed SpMM of the same fp8 values (fp32, rounded
// to bf16), on outputs poisoned with NaN.
TEST_F(CusparseLt, ForwardE4m3) {
  struct S { int64_t out, in, tokens; };
  uint64_t seed = 900;
  for (const S& sh : {S{64, 64, 32}, S{96, 160, 64}, S{32, 224, 96}}) {
    SparseGemm24Problem p = SparseGemm24Problem::linear_forward(sh.out, sh.in, sh.tokens);
    p.dtype = gpu::SparseDtype::e4m3;
    SCOPED_TRACE(p.key());
    Dev dev;
    const size_t n_w = size_t(sh.out) * sh.in, n_x = size_t(sh.tokens) * sh.in, n_y = size_t(sh.tokens) * sh.out;
    auto to_fp8 = [](const Bits& b) {
      std::vector<uint8_t> q(b.size());
      for (size_t i = 0; i < b.size(); ++i) q[i] = __nv_fp8_e4m3(esplag::bf16_to_float(b[i])).__x;
      return q;
    };
    auto from_fp8 = [](const std::vector<uint8_t>& q) {
      VF f(q.size());
      for (size_t i = 0; i < q.size(); ++i) {
        __nv_fp8_e4m3 v;
        v.__x = q[i];
        f[i] = float(v);
      }
      return f;
    };
    const std::vector<uint8_t> w8 = to_fp8(random_bits(n_w, seed)), x8 = to_fp8(random_bits(n_x, seed + 1));
    seed += 10;
    SparseGemm24 g(p);
    const uint8_t* dw = dev.put(w8, "W");
    const uint8_t* dx = dev.put(x8, "X");
    uint8_t* pruned = static_cast<uint8_t*>(dev.bytes(n_w, "pruned"));
    EXPECT_FALSE(g.is_pruned(dw, dev.stream())) << "a dense random W must fail the 2:4 check";
    g.prune(pruned, dw, dev.stream());
    EXPECT_TRUE(g.is_pruned(pruned, dev.stream()));
    const VF wp = from_fp8(dev.get(pruned, n_w));
    expect_tile_24(wp, sh.out, sh.in);
    void* comp = dev.bytes(g.compressed_bytes(), "compressed");
    void* scratch = dev.bytes(g.compress_scratch_bytes(), "scratch");
    g.compress(comp, pruned, scratch, g.compress_scratch_bytes(), dev.stream());
    const size_t ws_bytes = std::max<size_t>(g.workspace_bytes(), size_t(8) << 20);
    void* ws = dev.bytes(ws_bytes, "workspace");
    bf16* y = dev.poisoned_bf16(n_y, "y");
    g.matmul(y, comp, dx, nullptr, ws, ws_bytes, dev.stream());
    const Reference ref = reference(p, wp, from_fp8(x8), nullptr);
    expect_matches(p.key(), ref.ref, ref.low, dev.get_bf16(y, n_y));
  }
}

TEST_F(CusparseLt, ForwardWeightAsB) {
  uint64_t seed = 200;
  for (const Shape& s : kShapes)
    run_problem(SparseGemm24Problem::linear_forward(s.out, s.in, s.tokens, false, SparseActivation::none,
                                                    SparseOperand::b),
                seed += 10);
}

TEST_F(CusparseLt, BackwardDataWeightAsA) {
  uint64_t seed = 300;
  for (const Shape& s : kShapes)
    run_problem(SparseGemm24Problem::linear_backward_data(s.out, s.in, s.tokens), seed += 10);
}

TEST_F(CusparseLt, BackwardDataWeightAsB) {
  uint64_t seed = 400;
  for (const Shape& s : kShapes)
    run_problem(SparseGemm24Problem::linear_backward_data(s.out, s.in, s.tokens, SparseOperand::b), seed += 10);
}

TEST_F(CusparseLt, WeightGrad) {
  uint64_t seed = 450;
  for (const Shape& s : kShapes)
    run_weight_grad(SparseGemm24Problem::linear_weight_grad(s.out, s.in, s.tokens), seed += 10);
}

// The weight-gradient product goes through the same tuning as the others: a search is
// recorded under its key and read back by a fresh cache, and the tuned plan still matches.
TEST_F(CusparseLt, WeightGradSearchIsRecordedAndReadBack) {
  const SparseGemm24Problem p = SparseGemm24Problem::linear_weight_grad(144, 208, 96);
  SparseGemm24Config searched;
  {
    SparseGemm24& g = SparseGemm24::get(p);
    run_weight_grad(p, 901, &g, /*search=*/true);
    EXPECT_TRUE(g.tuned());
    searched = g.config();
  }
  EXPECT_TRUE(contains(read_text(tuning_), p.key()));
  gpu::clear_sparse_gemm24_cache();
  gpu::reload_cusparselt_tuning_cache();
  SparseGemm24Config looked_up;
  ASSERT_TRUE(gpu::cusparselt_tuning_lookup(p, &looked_up));
  EXPECT_EQ(looked_up, searched);
  SparseGemm24& g = SparseGemm24::get(p);
  EXPECT_TRUE(g.from_tuning_cache());
  run_weight_grad(p, 902, &g);
  // Keyed by the whole problem: not the forward of the same sizes.
  EXPECT_NE(&g, &SparseGemm24::get(SparseGemm24Problem::linear_forward(144, 208, 96)));
}

TEST_F(CusparseLt, OnePrunedWeightServesForwardAndBackward) {
  // The tile rule keeps 2 per row and per column of each 4×4 tile, so the W pruned for
  // the forward product is already 2:4 along the backward product's K.
  Dev dev;
  const int64_t out = 144, in = 80;
  const Bits w = random_bits(size_t(out) * in, 7, 0.1);
  SparseGemm24 fwd(SparseGemm24Problem::linear_forward(out, in, 48));
  SparseGemm24 bwd(SparseGemm24Problem::linear_backward_data(out, in, 48));
  const bf16* dw = dev.put_bf16(w);
  bf16* pruned = dev.poisoned_bf16(w.size());
  fwd.prune(pruned, dw, dev.stream());
  EXPECT_TRUE(fwd.is_pruned(pruned, dev.stream()));
  EXPECT_TRUE(bwd.is_pruned(pruned, dev.stream()));
  // Kept magnitude of the tile rule against sparse/'s exact optimum with exactly 2 per row
  // and column of each tile (information; the rule itself is cuSPARSELt's).
  const VF wp = dev.get_bf16(pruned, w.size()), wf = to_float(w);
  std::vector<uint8_t> kept(wp.size());
  for (size_t i = 0; i < wp.size(); ++i) kept[i] = wp[i] != 0.f;
  const auto exact = cpu::transposable_mask_exact_full(wf.data(), out, in);
  const double f_gpu = cpu::kept_magnitude_fraction(wf.data(), kept.data(), int64_t(wf.size()));
  const double f_exact = cpu::kept_magnitude_fraction(wf.data(), exact.data(), int64_t(wf.size()));
  std::printf("[ cusparselt ] tile prune keeps %.4f of |W|, the exact transposable optimum %.4f\n", f_gpu, f_exact);
  EXPECT_LE(f_gpu, f_exact + 1e-9) << "no transposable mask can keep more than the optimum";
  EXPECT_GT(f_gpu, 0.5);
}

TEST_F(CusparseLt, BiasAndActivationEpilogues) {
  uint64_t seed = 500;
  for (const Shape& s : {Shape{64, 128, 32}, Shape{48, 80, 112}}) {
    run_problem(SparseGemm24Problem::linear_forward(s.out, s.in, s.tokens, true), seed += 10);
    run_problem(SparseGemm24Problem::linear_forward(s.out, s.in, s.tokens, true, SparseActivation::relu), seed += 10);
    run_problem(SparseGemm24Problem::linear_forward(s.out, s.in, s.tokens, false, SparseActivation::relu),
                seed += 10);
    // GELU where cuSPARSELt has it; otherwise construction must say so clearly.
    const SparseGemm24Problem gelu =
        SparseGemm24Problem::linear_forward(s.out, s.in, s.tokens, true, SparseActivation::gelu);
    if (gpu::sparse_gemm24_activation_supported(SparseActivation::gelu)) {
      run_problem(gelu, seed += 10);
    } else {
      const auto msg = error_of([&] { SparseGemm24 g(gelu); });
      EXPECT_TRUE(contains(msg, "no GELU epilogue") && contains(msg, "apply it separately")) << msg;
    }
  }
  EXPECT_TRUE(gpu::sparse_gemm24_activation_supported(SparseActivation::relu));
  EXPECT_TRUE(gpu::sparse_gemm24_activation_supported(SparseActivation::none));
  std::printf("[ cusparselt ] fused GELU epilogue for bf16: %s\n",
              gpu::sparse_gemm24_activation_supported(SparseActivation::gelu) ? "yes" : "no");
}

TEST_F(CusparseLt, OneCachedPlanServesEveryBiasPointer) {
  // Two layers of one shape share the cached object; each passes its own bias.
  const SparseGemm24Problem p = SparseGemm24Problem::linear_forward(48, 80, 112, true);
  SparseGemm24& g = SparseGemm24::get(p);
  EXPECT_EQ(g.plans(), 0u);
  Dev dev;  // one arena: the three biases lie at three addresses
  for (uint64_t seed : {601, 602, 603}) run_problem(p, seed, &g, false, &dev);
  EXPECT_EQ(g.plans(), 3u) << "one plan per bias pointer";
}

TEST_F(CusparseLt, PlanCacheIsKeyedByTheWholeProblem) {
  const size_t before = gpu::sparse_gemm24_cached_plans();
  SparseGemm24& a = SparseGemm24::get(SparseGemm24Problem::linear_forward(64, 128, 32));
  SparseGemm24& b = SparseGemm24::get(SparseGemm24Problem::linear_forward(64, 128, 32));
  EXPECT_EQ(&a, &b);
  SparseGemm24& c = SparseGemm24::get(SparseGemm24Problem::linear_forward(64, 128, 32, true));
  SparseGemm24& d = SparseGemm24::get(SparseGemm24Problem::linear_backward_data(64, 128, 32));
  EXPECT_NE(&a, &c);
  EXPECT_NE(&a, &d);
  EXPECT_EQ(gpu::sparse_gemm24_cached_plans(), before + 3);
  EXPECT_GT(a.plan_build_ms(), 0.0);
  gpu::clear_sparse_gemm24_cache();
  EXPECT_EQ(gpu::sparse_gemm24_cached_plans(), 0u);
}

TEST_F(CusparseLt, MisuseThrowsClearErrors) {
  Dev dev;
  const SparseGemm24Problem p = SparseGemm24Problem::linear_forward(64, 128, 32);
  SparseGemm24 g(p);
  const Bits w = random_bits(64 * 128, 9, 0.1), x = random_bits(32 * 128, 10);
  bf16* dw = dev.put_bf16(w);
  const bf16* dx = dev.put_bf16(x);
  void* comp = dev.bytes(g.compressed_bytes(), "compressed");
  void* scratch = dev.bytes(g.compress_scratch_bytes() + 16, "scratch");
  bf16* y = dev.poisoned_bf16(32 * 64);
  g.prune(dw, dw, dev.stream());  // in place
  EXPECT_TRUE(g.is_pruned(dw, dev.stream()));
  if (g.compress_scratch_bytes() > 0) {
    const auto msg =
        error_of([&] { g.compress(comp, dw, scratch, g.compress_scratch_bytes() - 1, dev.stream()); });
    EXPECT_TRUE(contains(msg, "scratch")) << msg;
  }
  g.compress(comp, dw, scratch, g.compress_scratch_bytes(), dev.stream());
  const bf16* db = dev.put_bf16(random_bits(64, 13, 0.5));
  auto msg = error_of([&] { g.matmul(y, comp, dx, db, nullptr, 0, dev.stream()); });
  EXPECT_TRUE(contains(msg, "no bias")) << msg;
  SparseGemm24 gb(SparseGemm24Problem::linear_forward(64, 128, 32, true));
  msg = error_of([&] { gb.matmul(y, comp, dx, nullptr, nullptr, 0, dev.stream()); });
  EXPECT_TRUE(contains(msg, "no bias pointer")) << msg;
  if (g.workspace_bytes() > 0) {
    msg = error_of([&] { g.matmul(y, comp, dx, nullptr, nullptr, 0, dev.stream()); });
    EXPECT_TRUE(contains(msg, "workspace")) << msg;
  }
  msg = error_of([&] {
    g.matmul(reinterpret_cast<bf16*>(reinterpret_cast<char*>(y) + 2), comp, dx, nullptr, nullptr, 1 << 30,
             dev.stream());
  });
  EXPECT_TRUE(contains(msg, "16-byte aligned")) << msg;
}

// ---------------------------------------------------------------------------------------
// Tuning

TEST_F(CusparseLt, SearchIsRecordedAndReadBack) {
  const SparseGemm24Problem p = SparseGemm24Problem::linear_forward(144, 208, 96, true, SparseActivation::relu);
  SparseGemm24Config searched;
  {
    SparseGemm24 g(p);
    EXPECT_FALSE(g.tuned());
    run_problem(p, 701, &g, /*search=*/true);  // searched, then still matches the CPU
    EXPECT_TRUE(g.tuned());
    EXPECT_FALSE(g.from_tuning_cache());
    EXPECT_GT(g.search_ms(), 0.0);
    searched = g.config();
    EXPECT_GE(searched.alg_id, 0);
    EXPECT_LE(searched.alg_id, g.max_alg_id());
    std::printf("[ cusparselt ] %s: searched alg %d of 0..%d, split-k %d (mode %d, buffers %d) in %.0f ms\n",
                p.key().c_str(), searched.alg_id, g.max_alg_id(), searched.split_k, searched.split_k_mode,
                searched.split_k_buffers, g.search_ms());
  }
  ASSERT_TRUE(std::filesystem::exists(tuning_)) << "the search must be written to " << tuning_;
  const std::string text = read_text(tuning_);
  EXPECT_TRUE(contains(text, "\"format\": \"esplag-cusparselt-tuning\"")) << text;
  EXPECT_TRUE(contains(text, p.key())) << text;
  EXPECT_FALSE(std::filesystem::exists(tuning_ + ".tmp." + std::to_string(::getpid())));

  // A later process: nothing in memory, the file read back.
  gpu::clear_sparse_gemm24_cache();
  gpu::reload_cusparselt_tuning_cache();
  EXPECT_EQ(gpu::cusparselt_tuning_entries(), 1u);
  SparseGemm24Config looked_up;
  ASSERT_TRUE(gpu::cusparselt_tuning_lookup(p, &looked_up));
  EXPECT_EQ(looked_up, searched);
  SparseGemm24& g = SparseGemm24::get(p);
  EXPECT_TRUE(g.tuned());
  EXPECT_TRUE(g.from_tuning_cache());
  EXPECT_EQ(g.config(), searched);
  run_problem(p, 702, &g);  // tune() is a no-op now, and the tuned plan computes right
  {
    Dev dev;  // tune() does not search a tuned problem (operands are not even read)
    bf16* y = dev.poisoned_bf16(16);
    EXPECT_FALSE(g.tune(y, y, y, y, nullptr, 0, dev.stream()));
  }
  // The default algorithm ignores the cache.
  SparseGemm24 plain(p, SparseGemm24::Algorithm::library_default);
  EXPECT_FALSE(plain.tuned());
  // Other problems are not tuned by this entry.
  SparseGemm24Config other;
  EXPECT_FALSE(gpu::cusparselt_tuning_lookup(SparseGemm24Problem::linear_forward(144, 208, 96, true), &other));
}

TEST_F(CusparseLt, CorruptTuningFileWarnsAndIsRetuned) {
  const SparseGemm24Problem p = SparseGemm24Problem::linear_backward_data(48, 80, 112);
  for (const std::string& bad :
       {std::string("{ \"format\": \"esplag-cusparselt-tuning\", \"version\": 1, \"entries\": [ {\"gpu\": "),
        std::string("not json at all"), std::string("{\"format\": \"something-else\", \"version\": 1, \"entries\": []}"),
        std::string("{\"format\": \"esplag-cusparselt-tuning\", \"version\": 1, \"entries\": [{\"gpu\": 3}]}")}) {
    SCOPED_TRACE(bad);
    {
      std::ofstream f(tuning_, std::ios::binary | std::ios::trunc);
      f << bad;
    }
    gpu::clear_sparse_gemm24_cache();
    ::testing::internal::CaptureStderr();
    gpu::reload_cusparselt_tuning_cache();
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(contains(err, "corrupt") && contains(err, tuning_)) << "stderr: " << err;
    EXPECT_EQ(gpu::cusparselt_tuning_entries(), 0u);

    // Re-tuned: tune() searches, the file is rewritten whole and reads back cleanly.
    SparseGemm24& g = SparseGemm24::get(p);
    EXPECT_FALSE(g.tuned());
    Dev dev;
    const Bits w = random_bits(48 * 80, 11, 0.1), dy = random_bits(112 * 48, 12);
    bf16* dw = dev.put_bf16(w);
    g.prune(dw, dw, dev.stream());
    void* comp = dev.bytes(g.compressed_bytes(), "compressed");
    void* scratch = dev.bytes(g.compress_scratch_bytes(), "scratch");
    g.compress(comp, dw, scratch, g.compress_scratch_bytes(), dev.stream());
    const size_t ws_bytes = std::max<size_t>(g.workspace_bytes(), size_t(8) << 20);
    void* ws = dev.bytes(ws_bytes, "ws");
    bf16* dx = dev.poisoned_bf16(112 * 80);
    EXPECT_TRUE(g.tune(dx, comp, dev.put_bf16(dy), nullptr, ws, ws_bytes, dev.stream()));
    EXPECT_TRUE(g.tuned());
    ::testing::internal::CaptureStderr();
    gpu::reload_cusparselt_tuning_cache();
    const std::string err2 = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(err2.empty()) << err2;
    EXPECT_EQ(gpu::cusparselt_tuning_entries(), 1u);
    std::filesystem::remove(tuning_);
  }
}

TEST_F(CusparseLt, SearchOffMeansNoSearch) {
  gpu::set_cusparselt_search(false);
  const SparseGemm24Problem p = SparseGemm24Problem::linear_forward(64, 128, 32);
  SparseGemm24& g = SparseGemm24::get(p);
  Dev dev;
  bf16* y = dev.poisoned_bf16(16);
  EXPECT_FALSE(g.tune(y, y, y, nullptr, nullptr, 0, dev.stream()));
  EXPECT_FALSE(g.tuned());
  EXPECT_FALSE(std::filesystem::exists(tuning_));
  gpu::set_cusparselt_search(true);
}

TEST_F(CusparseLt, UnwritableTuningPathWarnsAndKeepsTuningInMemory) {
  // A path under a regular file cannot be created.
  const std::string blocker = tuning_ + ".file";
  {
    std::ofstream f(blocker);
    f << "x";
  }
  gpu::set_cusparselt_tuning_path(blocker + "/sub/tuning.json");
  const SparseGemm24Problem p = SparseGemm24Problem::linear_forward(48, 80, 112);
  ::testing::internal::CaptureStderr();
  run_problem(p, 801, &SparseGemm24::get(p), /*search=*/true);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(contains(err, "cannot write")) << err;
  EXPECT_EQ(gpu::cusparselt_tuning_entries(), 1u);
  std::filesystem::remove(blocker);
}

}  // namespace
