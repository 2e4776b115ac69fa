// The cuDNN attention paths (ops/gpu_attention.h, ops/cuda/attention_cudnn.cu) against the
// CPU reference (ops/attention.h, fp64 and fp32) and against our own kernels, and the
// timing table of bench/lib/attention.h.
//
// Inputs are seeded bf16-representable normals; every output is poisoned with NaN before
// the call, so an element cuDNN does not write fails the test. Shapes: GPT-2 heads
// (NKV = NH, HD 64), LLaMA-style grouped-query heads (NH 16, NKV 4 or 8, HD 64 / 128) and
// awkward lengths (1, 17, 200). Tests that need cuDNN skip, saying why, where
// libcudnn.so.9 cannot be loaded.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "ops/attention.h"
#include "bench/lib/attention.h"
#include "ops/gpu_attention.h"

#include "gpu_test_util.h"

namespace {

using esplag::DeviceArena;
using esplag::Rng;
using esplag::gpu::AttentionPath;
using esplag::gpu::bf16;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;

using esplag::gpu_test::Data;
using esplag::gpu_test::has_device;
using esplag::gpu_test::random_bf16;
using esplag::gpu_test::VD;
using esplag::gpu_test::VF;

#define REQUIRE_CUDNN()                                                                                 \
  do {                                                                                                  \
    ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests";                            \
    if (!gpu::attention_cudnn_available()) GTEST_SKIP() << "cuDNN: " << gpu::attention_cudnn_status(); \
  } while (0)

class Dev : public esplag::gpu_test::DeviceBuffers {
 public:
  explicit Dev(size_t bytes = size_t(256) << 20) : DeviceBuffers(bytes) {}
};

// bf16 output `got` against the fp64 reference; `low` is the fp32 CPU result (rounded to
// bf16 there). The same rule as the native kernels' tests in gpu_model.cu.
void expect_bf16_close(const std::string& what, const VD& ref, const VF& low, const VF& got) {
  esplag::gpu_test::expect_bf16_close(what, ref, low, got, 34);
}

// ---------------------------------------------------------------------------------------
// One problem: inputs, CPU references, and GPU runs on fresh poisoned outputs.

struct Shape {
  int B, T, NH, NKV, HD;
  size_t C() const { return size_t(NH + 2 * NKV) * HD; }
  size_t nq() const { return size_t(B) * T * C(); }
  size_t no() const { return size_t(B) * T * NH * HD; }
  size_t ns() const { return size_t(B) * NH * T; }
  std::string str() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
           " NKV=" + std::to_string(NKV) + " HD=" + std::to_string(HD);
  }
};

struct GpuResult {
  VF out, lse, dqkv;
};

class Problem {
 public:
  // qk_scale scales q, k and v: 3 makes the softmax peaked (scores of a few tens).
  Problem(Shape s, uint64_t seed, double qk_scale = 1.0)
      : s_(s), qkv_(random_bf16(s.nq(), seed, qk_scale)), dout_(random_bf16(s.no(), seed + 1, 1.0)) {
    const int B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, HD = s.HD;
    VD att(size_t(B) * NH * T * T);
    ref_out_.assign(s.no(), 0.0);
    ref_dqkv_.assign(s.nq(), 0.0);
    cpu::attention_forward(ref_out_.data(), att.data(), qkv_.d.data(), B, T, NH, NKV, HD);
    cpu::attention_backward(ref_dqkv_.data(), dout_.d.data(), qkv_.d.data(), att.data(), B, T, NH, NKV, HD);
    VF att_f(att.size());
    low_out_.assign(s.no(), 0.f);
    low_dqkv_.assign(s.nq(), 0.f);
    cpu::attention_forward(low_out_.data(), att_f.data(), qkv_.f.data(), B, T, NH, NKV, HD);
    cpu::attention_backward(low_dqkv_.data(), dout_.f.data(), qkv_.f.data(), att_f.data(), B, T, NH, NKV, HD);
    // The log-sum-exp of each row's scaled scores, in fp64.
    const int group = NH / NKV;
    const double scale = 1.0 / std::sqrt(double(HD));
    const size_t C = s.C();
    ref_lse_.resize(s.ns());
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < T; ++t) {
          const double* q = qkv_.d.data() + (size_t(b) * T + t) * C + size_t(h) * HD;
          std::vector<double> sc(t + 1);
          double mx = -std::numeric_limits<double>::infinity();
          for (int j = 0; j <= t; ++j) {
            const double* k = qkv_.d.data() + (size_t(b) * T + j) * C + size_t(NH + h / group) * HD;
            double dot = 0;
            for (int d = 0; d < HD; ++d) dot += q[d] * k[d];
            sc[j] = dot * scale;
            mx = std::max(mx, sc[j]);
          }
          double sum = 0;
          for (double x : sc) sum += std::exp(x - mx);
          ref_lse_[(size_t(b) * NH + h) * T + t] = mx + std::log(sum);
        }
  }

  // Forward on `fwd`, backward on `bwd` (consuming that forward's out and lse), with the
  // workspace both paths ask for.
  GpuResult run(AttentionPath fwd, AttentionPath bwd, bool second_backward = false, VF* dqkv2 = nullptr) const {
    const Shape& s = s_;
    const size_t ws = std::max(gpu::attention_workspace_bytes(s.B, s.T, s.NH, s.NKV, s.HD, fwd),
                               gpu::attention_workspace_bytes(s.B, s.T, s.NH, s.NKV, s.HD, bwd));
    Dev dev(3 * s.nq() * 2 + 2 * s.no() * 2 + s.ns() * 4 + ws + (size_t(8) << 20));
    bf16* qkv = dev.put_bf16(qkv_.bits);
    bf16* dout = dev.put_bf16(dout_.bits);
    bf16* out = dev.poisoned_bf16(s.no());
    float* lse = dev.poisoned<float>(s.ns());
    bf16* dqkv = dev.poisoned_bf16(s.nq());
    void* w = dev.scratch(ws);
    gpu::attention_forward(out, lse, qkv, s.B, s.T, s.NH, s.NKV, s.HD, w, ws, dev.stream(), fwd);
    gpu::attention_backward(dqkv, dout, qkv, out, lse, s.B, s.T, s.NH, s.NKV, s.HD, w, ws, dev.stream(), bwd);
    GpuResult r{dev.get_bf16(out, s.no()), dev.get(lse, s.ns()), dev.get_bf16(dqkv, s.nq())};
    if (second_backward) {
      bf16* d2 = dev.poisoned_bf16(s.nq());
      gpu::attention_backward(d2, dout, qkv, out, lse, s.B, s.T, s.NH, s.NKV, s.HD, w, ws, dev.stream(), bwd);
      *dqkv2 = dev.get_bf16(d2, s.nq());
    }
    return r;
  }

  // Every output of `r` against the CPU reference.
  void expect_matches_cpu(const GpuResult& r) const {
    const Shape& s = s_;
    expect_bf16_close("out", ref_out_, low_out_, r.out);
    const size_t C = s.C();
    const int parts[4] = {0, s.NH * s.HD, (s.NH + s.NKV) * s.HD, (s.NH + 2 * s.NKV) * s.HD};
    const char* names[3] = {"dq", "dk", "dv"};
    for (int p = 0; p < 3; ++p) {
      VD ref;
      VF low, got;
      for (size_t row = 0; row < size_t(s.B) * s.T; ++row)
        for (int c = parts[p]; c < parts[p + 1]; ++c) {
          ref.push_back(ref_dqkv_[row * C + c]);
          low.push_back(low_dqkv_[row * C + c]);
          got.push_back(r.dqkv[row * C + c]);
        }
      expect_bf16_close(names[p], ref, low, got);
    }
    double worst = 0;
    for (size_t i = 0; i < ref_lse_.size(); ++i) {
      ASSERT_TRUE(std::isfinite(r.lse[i])) << "lse " << i << " not written";
      worst = std::max(worst, std::fabs(r.lse[i] - ref_lse_[i]) / (1.0 + std::fabs(ref_lse_[i])));
    }
    std::printf("  %-34s max rel error %.2e\n", "lse", worst);
    EXPECT_LE(worst, 1e-4) << "log-sum-exp";
  }

 private:
  Shape s_;
  Data qkv_, dout_;
  VD ref_out_, ref_dqkv_, ref_lse_;
  VF low_out_, low_dqkv_;
};

double rel_diff(const VF& a, const VF& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void check_cudnn(Shape s, uint64_t seed) {
  SCOPED_TRACE(s.str());
  std::printf("cudnn %s\n", s.str().c_str());
  const Problem p(s, seed);
  VF dqkv2;
  const GpuResult r = p.run(AttentionPath::cudnn, AttentionPath::cudnn, true, &dqkv2);
  p.expect_matches_cpu(r);
  // The deterministic backward gives the same bits twice.
  ASSERT_EQ(dqkv2.size(), r.dqkv.size());
  EXPECT_EQ(std::memcmp(dqkv2.data(), r.dqkv.data(), r.dqkv.size() * sizeof(float)), 0)
      << "cudnn backward differs between runs";

  // Against our own kernels on the same inputs: both are within bf16 rounding of the
  // reference, so they are within twice that of each other.
  const GpuResult n = p.run(AttentionPath::native, AttentionPath::native);
  const double d_out = rel_diff(r.out, n.out), d_dqkv = rel_diff(r.dqkv, n.dqkv);
  double d_lse = 0;
  for (size_t i = 0; i < r.lse.size(); ++i) d_lse = std::max(d_lse, double(std::fabs(r.lse[i] - n.lse[i])));
  std::printf("  vs native: out rel %.2e, dqkv rel %.2e, lse max abs %.2e\n", d_out, d_dqkv, d_lse);
  EXPECT_LE(d_out, 1e-2);
  EXPECT_LE(d_dqkv, 2e-2);
  EXPECT_LE(d_lse, 1e-3);
}

class GpuAttentionCudnn : public ::testing::Test {};

// ---------------------------------------------------------------------------------------
// Accuracy

TEST_F(GpuAttentionCudnn, Gpt2Heads) {
  REQUIRE_CUDNN();
  check_cudnn({2, 17, 12, 12, 64}, 101);
  check_cudnn({1, 200, 12, 12, 64}, 102);
  check_cudnn({3, 64, 4, 4, 64}, 103);  // exactly one tile
}

TEST_F(GpuAttentionCudnn, GroupedQueryHeads) {
  REQUIRE_CUDNN();
  check_cudnn({1, 200, 16, 4, 64}, 201);
  check_cudnn({2, 17, 16, 8, 128}, 202);
  check_cudnn({1, 200, 16, 4, 128}, 203);
  check_cudnn({1, 130, 16, 16, 128}, 204);
}

TEST_F(GpuAttentionCudnn, PeakedSoftmax) {
  REQUIRE_CUDNN();
  // Large scores: the online softmax rescales often and the lse is far from 0.
  for (const Shape s : {Shape{1, 200, 4, 2, 64}, Shape{1, 200, 4, 4, 128}}) {
    SCOPED_TRACE(s.str());
    std::printf("cudnn peaked %s\n", s.str().c_str());
    const Problem p(s, 301, 3.0);
    p.expect_matches_cpu(p.run(AttentionPath::cudnn, AttentionPath::cudnn));
  }
}

TEST_F(GpuAttentionCudnn, NondeterministicBackward) {
  REQUIRE_CUDNN();
  for (const Shape s : {Shape{2, 17, 12, 12, 64}, Shape{1, 200, 16, 4, 128}}) {
    SCOPED_TRACE(s.str());
    std::printf("cudnn_nondeterministic %s\n", s.str().c_str());
    const Problem p(s, 401);
    p.expect_matches_cpu(p.run(AttentionPath::cudnn_nondeterministic, AttentionPath::cudnn_nondeterministic));
  }
}

// The two paths save the same lse in the same layout, so either backward may consume
// either forward: the dispatch relies on it when the backward's workspace or buffers rule
// cuDNN out after a cuDNN forward.
TEST_F(GpuAttentionCudnn, ForwardAndBackwardOfDifferentPathsAgree) {
  REQUIRE_CUDNN();
  for (const Shape s : {Shape{2, 17, 12, 12, 64}, Shape{1, 200, 16, 4, 128}}) {
    SCOPED_TRACE(s.str());
    const Problem p(s, 501);
    std::printf("cudnn forward, native backward %s\n", s.str().c_str());
    p.expect_matches_cpu(p.run(AttentionPath::cudnn, AttentionPath::native));
    std::printf("native forward, cudnn backward %s\n", s.str().c_str());
    p.expect_matches_cpu(p.run(AttentionPath::native, AttentionPath::cudnn));
  }
}

// ---------------------------------------------------------------------------------------
// Dispatch

TEST_F(GpuAttentionCudnn, AutomaticPrefersCudnn) {
  REQUIRE_CUDNN();
  EXPECT_EQ(gpu::attention_resolve_path(2, 17, 12, 12, 64), AttentionPath::cudnn);
  EXPECT_EQ(gpu::attention_resolve_path(1, 200, 16, 4, 128), AttentionPath::cudnn);
  // Head sizes cuDNN does not take stay on our kernels, silently.
  EXPECT_EQ(gpu::attention_resolve_path(1, 17, 2, 1, 20), AttentionPath::native);
  EXPECT_EQ(gpu::attention_resolve_path(1, 17, 2, 1, 24, AttentionPath::native), AttentionPath::native);
  // Workspace: cuDNN's plans need more than our scratch (the deterministic backward's dP).
  EXPECT_GE(gpu::attention_workspace_bytes(2, 17, 12, 12, 64), gpu::attention_backward_scratch_bytes(2, 17, 12));
  std::printf("workspace B=16 T=1024 NH=12 HD=64: automatic %zu, nondeterministic %zu, native %zu bytes\n",
              gpu::attention_workspace_bytes(16, 1024, 12, 12, 64),
              gpu::attention_workspace_bytes(16, 1024, 12, 12, 64, AttentionPath::cudnn_nondeterministic),
              gpu::attention_workspace_bytes(16, 1024, 12, 12, 64, AttentionPath::native));
}

// Whatever automatic picks, the results are right, on lengths cuDNN may refuse (T = 1:
// its backward does not take s_q = s_kv = 1) and head sizes it does not take.
TEST_F(GpuAttentionCudnn, AutomaticIsCorrectEverywhere) {
  REQUIRE_CUDNN();
  for (const Shape s : {Shape{1, 1, 16, 4, 64}, Shape{2, 1, 12, 12, 64}, Shape{2, 17, 12, 12, 64},
                        Shape{1, 37, 4, 2, 20}, Shape{1, 200, 16, 8, 128}}) {
    SCOPED_TRACE(s.str());
    const AttentionPath resolved = gpu::attention_resolve_path(s.B, s.T, s.NH, s.NKV, s.HD);
    std::printf("automatic %s -> %s\n", s.str().c_str(), gpu::attention_path_name(resolved));
    const Problem p(s, 601);
    p.expect_matches_cpu(p.run(AttentionPath::automatic, AttentionPath::automatic));
  }
}

// With only our scratch (what attention_backward_scratch_bytes gives) the automatic
// backward cannot use cuDNN's plan: it runs our kernels, correctly, and says so once.
TEST_F(GpuAttentionCudnn, AutomaticFallsBackWhenWorkspaceIsShort) {
  REQUIRE_CUDNN();
  const Shape s{1, 200, 16, 4, 64};
  SCOPED_TRACE(s.str());
  const size_t need = gpu::attention_workspace_bytes(s.B, s.T, s.NH, s.NKV, s.HD);
  const size_t scratch = gpu::attention_backward_scratch_bytes(s.B, s.T, s.NH);
  if (need <= scratch) GTEST_SKIP() << "cuDNN's plans need no more than our scratch here";
  Dev dev;
  // Forward with the full workspace (cuDNN), backward with only our scratch (falls back),
  // twice: one warning. Then our kernels' backward on the same lse, for comparison.
  const Data q = random_bf16(s.nq(), 701, 1.0), d = random_bf16(s.no(), 702, 1.0);
  bf16* dq = dev.put_bf16(q.bits);
  bf16* dd = dev.put_bf16(d.bits);
  bf16* out = dev.poisoned_bf16(s.no());
  float* lse = dev.poisoned<float>(s.ns());
  bf16* dqkv_auto = dev.poisoned_bf16(s.nq());
  bf16* dqkv_native = dev.poisoned_bf16(s.nq());
  void* ws = dev.scratch(need);
  gpu::attention_forward(out, lse, dq, s.B, s.T, s.NH, s.NKV, s.HD, ws, need, dev.stream());
  ::testing::internal::CaptureStderr();
  gpu::attention_backward(dqkv_auto, dd, dq, out, lse, s.B, s.T, s.NH, s.NKV, s.HD, ws, scratch, dev.stream());
  gpu::attention_backward(dqkv_auto, dd, dq, out, lse, s.B, s.T, s.NH, s.NKV, s.HD, ws, scratch, dev.stream());
  CUDA_CHECK(cudaStreamSynchronize(dev.stream()));
  const std::string err = ::testing::internal::GetCapturedStderr();
  std::printf("stderr: %s", err.c_str());
  EXPECT_NE(err.find("attention_workspace_bytes"), std::string::npos) << err;
  EXPECT_EQ(err.find("warning"), err.rfind("warning")) << "warned more than once: " << err;
  gpu::attention_backward(dqkv_native, dd, dq, out, lse, s.B, s.T, s.NH, s.NKV, s.HD, ws, scratch, dev.stream(),
                          AttentionPath::native);
  const VF a = dev.get_bf16(dqkv_auto, s.nq()), n = dev.get_bf16(dqkv_native, s.nq());
  EXPECT_EQ(std::memcmp(a.data(), n.data(), a.size() * sizeof(float)), 0)
      << "the fallback is not our kernels' result";
}

TEST_F(GpuAttentionCudnn, ExplicitCudnnSaysWhyItCannotRun) {
  REQUIRE_CUDNN();
  Dev dev;
  const Shape s{1, 64, 4, 4, 64};
  bf16* qkv = dev.poisoned_bf16(s.nq());
  bf16* out = dev.poisoned_bf16(s.no());
  bf16* dqkv = dev.poisoned_bf16(s.nq());
  float* lse = dev.poisoned<float>(s.ns());
  const size_t scratch = gpu::attention_backward_scratch_bytes(s.B, s.T, s.NH);
  const size_t need = gpu::attention_workspace_bytes(s.B, s.T, s.NH, s.NKV, s.HD, AttentionPath::cudnn);
  void* ws = dev.scratch(scratch);
  if (need > scratch) {
    try {
      gpu::attention_backward(dqkv, out, qkv, out, lse, s.B, s.T, s.NH, s.NKV, s.HD, ws, scratch, dev.stream(),
                              AttentionPath::cudnn);
      ADD_FAILURE() << "no Error for a workspace of " << scratch << " bytes (need " << need << ")";
    } catch (const esplag::Error& e) {
      EXPECT_NE(std::string(e.what()).find("attention_workspace_bytes"), std::string::npos) << e.what();
    }
  }
  // A head size cuDNN does not take.
  EXPECT_THROW(gpu::attention_resolve_path(1, 17, 2, 1, 20, AttentionPath::cudnn), esplag::Error);
  EXPECT_THROW(gpu::attention_forward(out, lse, qkv, 1, 17, 2, 1, 20, dev.stream(), AttentionPath::cudnn),
               esplag::Error);
}

// ---------------------------------------------------------------------------------------
// Timing (no assertions on speed): the table of bench/lib/attention.h for the training
// shapes; ESPLAG_ATTENTION_BENCH_CSV names a file to write it to as CSV.

TEST_F(GpuAttentionCudnn, Timing) {
  ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests";
  std::printf("cuDNN: %s\n", gpu::attention_cudnn_status().c_str());
  gpu::AttentionBenchOptions options;
  options.warmup = 3;
  options.iters = 15;
  const auto rows = gpu::bench_attention(gpu::attention_bench_shapes(), options);
  std::printf("%s", gpu::format_attention_bench(rows).c_str());
  if (const char* path = std::getenv("ESPLAG_ATTENTION_BENCH_CSV"); path && *path) {
    std::ofstream(path) << gpu::attention_bench_csv(rows);
  }
  for (const auto& r : rows) {
    if (r.path == AttentionPath::native) EXPECT_TRUE(r.ran) << r.note;
    // A path that ran must agree with the first one (native) to within bf16 rounding.
    if (r.ran && r.out_rel_diff >= 0) {
      EXPECT_LE(r.out_rel_diff, 1e-2) << r.shape.name << " " << gpu::attention_path_name(r.path);
      EXPECT_LE(r.dqkv_rel_diff, 2e-2) << r.shape.name << " " << gpu::attention_path_name(r.path);
    }
  }
}

}  // namespace
