// gpu::Gemm's autotuning (ops/gpu.h): the algorithm chosen by timing cuBLASLt's
// candidates must give the CPU reference's results, tuning runs must not add into an
// accumulated output, tuned plans must capture into a CUDA graph (and shapes first seen
// inside a capture must not tune there), and with autotuning off the algorithm must be
// the heuristic's first pick.
//
// Accuracy rule as in gpu_ops.cu (docs/architecture.md): against the fp64 CPU reference, the GPU's
// error must be no worse than twice the error of the same computation on the CPU in fp32
// with the same bf16 roundings, in RMS and max norm, with small floors; bf16 outputs also
// within 1e-2 relative RMS.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "gpu_test_util.h"
#include "ops/activation.h"
#include "ops/gpu.h"
#include "ops/matmul.h"

namespace {

using esplag::gpu::bf16;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;

using namespace esplag::gpu_test;

// One arena of 256 MiB and a stream per test.
struct Dev : DeviceBuffers {
  Dev() : DeviceBuffers(size_t(256) << 20) {}
};

enum class Out { bf16, f32 };

void expect_matches(const std::string& what, const VD& ref, const VF& low, const VF& got, Out kind) {
  expect_within_low_precision(what, ref, low, got, kind == Out::bf16);
}

template <typename T>
void expect_bitwise_equal(const std::string& what, const std::vector<T>& a, const std::vector<T>& b) {
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)), 0) << what << ": results differ";
}

void print_plans(const char* what, const gpu::Gemm& gemm) {
  for (const auto& p : gemm.plans())
    std::printf("[ plan     ] %s: m=%d n=%d k=%d ta=%d tb=%d epi=%d f32=%d: %d candidates, chosen #%d%s%s "
                "(first %.4f ms, chosen %.4f ms)\n",
                what, p.m, p.n, p.k, int(p.transa), int(p.transb), int(p.epilogue), int(p.f32_out), p.candidates,
                p.chosen, p.tuned ? " tuned" : "", p.pending ? " pending" : "", p.first_ms, p.chosen_ms);
}

// Every plan of `gemm` is settled (nothing left pending), its choice lies among its
// candidates, and at least one plan with several candidates was chosen by timing.
void expect_tuned(const gpu::Gemm& gemm) {
  const auto plans = gemm.plans();
  ASSERT_FALSE(plans.empty());
  int multi = 0;
  for (const auto& p : plans) {
    EXPECT_FALSE(p.pending) << "m=" << p.m << " n=" << p.n << " k=" << p.k;
    EXPECT_GE(p.chosen, 0);
    EXPECT_LT(p.chosen, p.candidates);
    if (p.candidates > 1) {
      ++multi;
      EXPECT_TRUE(p.tuned) << "m=" << p.m << " n=" << p.n << " k=" << p.k << ": " << p.candidates
                           << " candidates but not tuned";
      EXPECT_GT(p.chosen_ms, 0.f);
      if (p.chosen != 0 && p.first_ms > 0) EXPECT_LT(p.chosen_ms, p.first_ms);
    }
  }
  EXPECT_GT(multi, 0) << "the heuristic offered a single algorithm for every shape: nothing was tuned";
}

// Restores the process-wide switch after each test.
class GpuGemmAutotune : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests";
    saved_ = gpu::gemm_autotune();
  }
  void TearDown() override { gpu::set_gemm_autotune(saved_); }

 private:
  bool saved_ = true;
};

// ---------------------------------------------------------------------------------------

// Every Gemm entry point, with autotuning on, against the CPU reference; the first call
// of each shape is the one that tunes.
void run_all_ops(int N, int C, int OC, bool epilogues, uint64_t seed) {
  SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C) + " OC=" + std::to_string(OC) +
               (epilogues ? " epilogues" : " separate kernels"));
  Dev dev;
  gpu::Gemm gemm(dev.arena());
  gemm.set_use_epilogues(epilogues);
  const Data inp = random_bf16(size_t(N) * C, seed), w = random_bf16(size_t(OC) * C, seed + 1, 0.05),
             bias = random_bf16(OC, seed + 2, 0.5), dout = random_bf16(size_t(N) * OC, seed + 3);
  const bf16* di = dev.put_bf16(inp.bits);
  const bf16* dw = dev.put_bf16(w.bits);
  const bf16* db = dev.put_bf16(bias.bits);
  const bf16* dd = dev.put_bf16(dout.bits);
  const size_t no = size_t(N) * OC, ni = size_t(N) * C;

  VD ref_lin(no), ref_lin_b(no);
  VF low_lin(no), low_lin_b(no);
  cpu::linear_forward(ref_lin.data(), inp.d.data(), w.d.data(), static_cast<const double*>(nullptr), N, C, OC);
  cpu::linear_forward(low_lin.data(), inp.f.data(), w.f.data(), static_cast<const float*>(nullptr), N, C, OC);
  cpu::linear_forward(ref_lin_b.data(), inp.d.data(), w.d.data(), bias.d.data(), N, C, OC);
  cpu::linear_forward(low_lin_b.data(), inp.f.data(), w.f.data(), bias.f.data(), N, C, OC);
  {
    // With bias first: without epilogues this tunes the plain GEMM on its beta = 1 call
    // (bias broadcast into the output first), which must time into the scratch buffer.
    bf16* out = dev.poisoned_bf16(no);
    gemm.forward(out, di, dw, db, N, C, OC, dev.stream());
    expect_matches("forward + bias", ref_lin_b, round_bf16(low_lin_b), dev.get_bf16(out, no), Out::bf16);
    bf16* out2 = dev.poisoned_bf16(no);
    gemm.forward(out2, di, dw, nullptr, N, C, OC, dev.stream());
    expect_matches("forward", ref_lin, round_bf16(low_lin), dev.get_bf16(out2, no), Out::bf16);
    float* out32 = dev.poisoned<float>(no);
    gemm.forward(out32, di, dw, N, C, OC, dev.stream());
    expect_matches("forward fp32", ref_lin, low_lin, dev.get(out32, no), Out::f32);

    VD ref_act(no);
    cpu::gelu_forward(ref_act.data(), ref_lin_b.data(), int64_t(no));
    const VF pre_low = round_bf16(low_lin_b);
    VF low_act(no);
    cpu::gelu_forward(low_act.data(), pre_low.data(), int64_t(no));
    bf16* act = dev.poisoned_bf16(no);
    bf16* pre = dev.poisoned_bf16(no, "pre_gelu");
    gemm.forward(act, di, dw, db, N, C, OC, dev.stream(), gpu::Gemm::Act::gelu, pre);
    expect_matches("forward + bias + gelu", ref_act, round_bf16(low_act), dev.get_bf16(act, no), Out::bf16);
    expect_matches("pre_gelu", ref_lin_b, pre_low, dev.get_bf16(pre, no), Out::bf16);
  }

  VD ref_dinp(ni, 0.0);
  VF low_dinp(ni, 0.f);
  cpu::linear_backward(ref_dinp.data(), static_cast<double*>(nullptr), static_cast<double*>(nullptr), dout.d.data(),
                       inp.d.data(), w.d.data(), N, C, OC);
  cpu::linear_backward(low_dinp.data(), static_cast<float*>(nullptr), static_cast<float*>(nullptr), dout.f.data(),
                       inp.f.data(), w.f.data(), N, C, OC);
  {
    // Accumulating first (the plan is tuned on a beta = 1 call), then overwriting.
    const Data dinp0 = random_bf16(ni, seed + 4, 0.5);
    bf16* acc = dev.put_bf16(dinp0.bits);
    gemm.backward_input(acc, dd, dw, N, C, OC, true, dev.stream());
    VD ref_acc = dinp0.d;
    VF low_acc = dinp0.f;
    for (size_t i = 0; i < ni; ++i) {
      ref_acc[i] += ref_dinp[i];
      low_acc[i] += low_dinp[i];
    }
    expect_matches("dinp (accumulate, first call)", ref_acc, round_bf16(low_acc), dev.get_bf16(acc, ni), Out::bf16);
    bf16* dinp = dev.poisoned_bf16(ni);
    gemm.backward_input(dinp, dd, dw, N, C, OC, false, dev.stream());
    expect_matches("dinp", ref_dinp, round_bf16(low_dinp), dev.get_bf16(dinp, ni), Out::bf16);

    VD ref_g(ni, 0.0);
    cpu::gelu_backward(ref_g.data(), inp.d.data(), ref_dinp.data(), int64_t(ni));
    const VF tmp_low = round_bf16(low_dinp);
    VF low_g(ni, 0.f);
    cpu::gelu_backward(low_g.data(), inp.f.data(), tmp_low.data(), int64_t(ni));
    bf16* dg = dev.poisoned_bf16(ni);
    gemm.backward_input(dg, dd, dw, N, C, OC, false, dev.stream(), di);
    expect_matches("dinp through gelu", ref_g, round_bf16(low_g), dev.get_bf16(dg, ni), Out::bf16);
  }
  {
    // dW += (first call of its plan, with and without the bias-gradient epilogue), then =.
    const VF dw0 = random_f32(size_t(OC) * C, seed + 5), db0 = random_f32(OC, seed + 6);
    float* gw = dev.put(dw0, "dweight");
    float* gb = dev.put(db0, "dbias");
    gemm.backward_weight(gw, gb, dd, di, N, C, OC, true, dev.stream());
    VD ref_w = to_double(dw0), ref_b = to_double(db0);
    VF low_w = dw0, low_b = db0;
    cpu::linear_backward(static_cast<double*>(nullptr), ref_w.data(), ref_b.data(), dout.d.data(), inp.d.data(),
                         w.d.data(), N, C, OC);
    cpu::linear_backward(static_cast<float*>(nullptr), low_w.data(), low_b.data(), dout.f.data(), inp.f.data(),
                         w.f.data(), N, C, OC);
    expect_matches("dweight + dbias (accumulate, first call)", ref_w, low_w, dev.get(gw, dw0.size()), Out::f32);
    expect_matches("dbias (accumulate, first call)", ref_b, low_b, dev.get(gb, OC), Out::f32);

    float* gw1 = dev.put(dw0, "dweight1");
    gemm.backward_weight(gw1, nullptr, dd, di, N, C, OC, true, dev.stream());
    VD ref_w1 = to_double(dw0);
    VF low_w1 = dw0;
    cpu::linear_backward(static_cast<double*>(nullptr), ref_w1.data(), static_cast<double*>(nullptr),
                         dout.d.data(), inp.d.data(), w.d.data(), N, C, OC);
    cpu::linear_backward(static_cast<float*>(nullptr), low_w1.data(), static_cast<float*>(nullptr), dout.f.data(),
                         inp.f.data(), w.f.data(), N, C, OC);
    expect_matches("dweight (accumulate)", ref_w1, low_w1, dev.get(gw1, dw0.size()), Out::f32);

    float* gw2 = dev.poisoned<float>(dw0.size(), "dweight2");
    gemm.backward_weight(gw2, nullptr, dd, di, N, C, OC, false, dev.stream());
    VD ref_w2(dw0.size(), 0.0);
    VF low_w2(dw0.size(), 0.f);
    cpu::linear_backward(static_cast<double*>(nullptr), ref_w2.data(), static_cast<double*>(nullptr), dout.d.data(),
                         inp.d.data(), w.d.data(), N, C, OC);
    cpu::linear_backward(static_cast<float*>(nullptr), low_w2.data(), static_cast<float*>(nullptr), dout.f.data(),
                         inp.f.data(), w.f.data(), N, C, OC);
    expect_matches("dweight", ref_w2, low_w2, dev.get(gw2, dw0.size()), Out::f32);
  }
  print_plans(epilogues ? "epilogues" : "separate kernels", gemm);
}

TEST_F(GpuGemmAutotune, MatchesCpuReference) {
  gpu::set_gemm_autotune(true);
  run_all_ops(37, 771, 259, true, 301);
  run_all_ops(37, 771, 259, false, 302);
  run_all_ops(256, 512, 384, true, 303);
  run_all_ops(256, 512, 384, false, 304);
}

// Accumulating calls tune into the Gemm's own buffer: the caller's sum must hold exactly
// one product, and a second Gemm (sharing the process's choice) must give the same bits.
TEST_F(GpuGemmAutotune, AccumulateFirstCallAddsOnce) {
  gpu::set_gemm_autotune(true);
  const int N = 512, C = 384, OC = 640;  // shapes of their own: nothing tuned them yet
  Dev dev;
  gpu::Gemm gemm(dev.arena());
  const Data inp = random_bf16(size_t(N) * C, 401), w = random_bf16(size_t(OC) * C, 402, 0.05),
             dout = random_bf16(size_t(N) * OC, 403);
  const bf16* di = dev.put_bf16(inp.bits);
  const bf16* dw = dev.put_bf16(w.bits);
  const bf16* dd = dev.put_bf16(dout.bits);
  const VF dw0 = random_f32(size_t(OC) * C, 404);
  float* gw = dev.put(dw0, "dweight");
  gemm.backward_weight(gw, nullptr, dd, di, N, C, OC, true, dev.stream());
  const Data dinp0 = random_bf16(size_t(N) * C, 405, 0.5);
  bf16* acc = dev.put_bf16(dinp0.bits);
  gemm.backward_input(acc, dd, dw, N, C, OC, true, dev.stream());

  VD ref_w = to_double(dw0), ref_x = dinp0.d;
  VF low_w = dw0, low_x(size_t(N) * C, 0.f);
  cpu::linear_backward(ref_x.data(), ref_w.data(), static_cast<double*>(nullptr), dout.d.data(), inp.d.data(),
                       w.d.data(), N, C, OC);
  cpu::linear_backward(low_x.data(), low_w.data(), static_cast<float*>(nullptr), dout.f.data(), inp.f.data(),
                       w.f.data(), N, C, OC);
  for (size_t i = 0; i < low_x.size(); ++i) low_x[i] += dinp0.f[i];
  const VF got_w = dev.get(gw, dw0.size()), got_x = dev.get_bf16(acc, low_x.size());
  expect_matches("dweight (accumulate)", ref_w, low_w, got_w, Out::f32);
  expect_matches("dinp (accumulate)", ref_x, round_bf16(low_x), got_x, Out::bf16);
  print_plans("accumulate", gemm);
  expect_tuned(gemm);
  const size_t scratch = gemm.tuning_scratch_bytes();
  EXPECT_GE(scratch, size_t(OC) * C * sizeof(float)) << "the beta = 1 tuning needs its own output buffer";

  // Later calls neither tune nor grow the buffer.
  float* gw_again = dev.put(dw0, "dweight again");
  gemm.backward_weight(gw_again, nullptr, dd, di, N, C, OC, true, dev.stream());
  expect_bitwise_equal("dweight, second call", got_w, dev.get(gw_again, dw0.size()));
  EXPECT_EQ(gemm.tuning_scratch_bytes(), scratch);
  gemm.release_tuning_scratch();
  EXPECT_EQ(gemm.tuning_scratch_bytes(), 0u);

  // A second Gemm takes the process's choice without timing (no buffer needed).
  gpu::Gemm other(dev.arena());
  float* gw_other = dev.put(dw0, "dweight other");
  other.backward_weight(gw_other, nullptr, dd, di, N, C, OC, true, dev.stream());
  expect_bitwise_equal("dweight, second Gemm", got_w, dev.get(gw_other, dw0.size()));
  EXPECT_EQ(other.tuning_scratch_bytes(), 0u);
  const auto a = gemm.plans(), b = other.plans();
  for (const auto& pb : b) {
    bool found = false;
    for (const auto& pa : a)
      if (pa.m == pb.m && pa.n == pb.n && pa.k == pb.k && pa.transa == pb.transa && pa.transb == pb.transb &&
          pa.epilogue == pb.epilogue) {
        found = true;
        EXPECT_EQ(pa.chosen, pb.chosen);
        EXPECT_EQ(std::memcmp(&pa.algo, &pb.algo, sizeof pa.algo), 0) << "the second Gemm chose another algorithm";
      }
    EXPECT_TRUE(found);
  }
}

// Tuned shapes replay from a CUDA graph with the same results as eagerly; a shape first
// seen inside the capture must not tune there (a synchronising call would break the
// capture), runs the heuristic's pick in the graph and is tuned at its first eager call.
TEST_F(GpuGemmAutotune, GraphCaptureAfterTuning) {
  gpu::set_gemm_autotune(true);
  const int N = 384, C = 320, OC = 448;
  Dev dev;
  gpu::Gemm gemm(dev.arena());
  const Data inp = random_bf16(size_t(N) * C, 501), w = random_bf16(size_t(OC) * C, 502, 0.05),
             bias = random_bf16(OC, 503, 0.5), dout = random_bf16(size_t(N) * OC, 504);
  const bf16* di = dev.put_bf16(inp.bits);
  const bf16* dw = dev.put_bf16(w.bits);
  const bf16* db = dev.put_bf16(bias.bits);
  const bf16* dd = dev.put_bf16(dout.bits);
  const size_t no = size_t(N) * OC;
  const VF dw0 = random_f32(size_t(OC) * C, 505);

  // Eager: tunes the forward and the dW plan.
  bf16* out_e = dev.poisoned_bf16(no);
  float* gw_e = dev.put(dw0, "dweight eager");
  gemm.forward(out_e, di, dw, db, N, C, OC, dev.stream());
  gemm.backward_weight(gw_e, nullptr, dd, di, N, C, OC, true, dev.stream());
  const VF got_out_e = dev.get_bf16(out_e, no), got_gw_e = dev.get(gw_e, dw0.size());
  expect_tuned(gemm);
  const size_t plans_before = gemm.cached_plans();

  // A shape only the graph uses: the fp32 forward with another row count.
  const int N2 = 200;
  const Data inp2 = random_bf16(size_t(N2) * C, 506);
  const bf16* di2 = dev.put_bf16(inp2.bits);
  float* out2 = dev.poisoned<float>(size_t(N2) * OC, "graph-only output");

  bf16* out_g = dev.poisoned_bf16(no, "graph output");
  float* gw_g = dev.put(dw0, "dweight graph");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(dev.stream(), cudaStreamCaptureModeThreadLocal));
  try {
    gemm.forward(out_g, di, dw, db, N, C, OC, dev.stream());
    gemm.backward_weight(gw_g, nullptr, dd, di, N, C, OC, true, dev.stream());
    gemm.forward(out2, di2, dw, N2, C, OC, dev.stream());
  } catch (...) {
    cudaStreamEndCapture(dev.stream(), &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  ASSERT_EQ(cudaStreamEndCapture(dev.stream(), &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiateWithFlags(&exec, graph, 0), cudaSuccess);
  EXPECT_EQ(gemm.cached_plans(), plans_before + 1);
  bool pending_seen = false;
  for (const auto& p : gemm.plans())
    if (p.n == N2) {
      EXPECT_FALSE(p.tuned) << "a shape first seen inside a capture must not be tuned there";
      EXPECT_EQ(p.chosen, 0);
      pending_seen = p.pending || p.candidates == 1;
    }
  EXPECT_TRUE(pending_seen);
  CUDA_CHECK(cudaGraphLaunch(exec, dev.stream()));
  expect_bitwise_equal("forward, graph vs eager", got_out_e, dev.get_bf16(out_g, no));
  expect_bitwise_equal("dweight, graph vs eager", got_gw_e, dev.get(gw_g, dw0.size()));
  VD ref2(size_t(N2) * OC);
  VF low2(size_t(N2) * OC);
  cpu::linear_forward(ref2.data(), inp2.d.data(), w.d.data(), static_cast<const double*>(nullptr), N2, C, OC);
  cpu::linear_forward(low2.data(), inp2.f.data(), w.f.data(), static_cast<const float*>(nullptr), N2, C, OC);
  expect_matches("graph-only shape", ref2, low2, dev.get(out2, ref2.size()), Out::f32);

  // Replays accumulate once each (dW += per launch).
  CUDA_CHECK(cudaGraphLaunch(exec, dev.stream()));
  VD ref_w = to_double(dw0);
  VF low_w = dw0;
  for (int rep = 0; rep < 2; ++rep) {
    cpu::linear_backward(static_cast<double*>(nullptr), ref_w.data(), static_cast<double*>(nullptr), dout.d.data(),
                         inp.d.data(), w.d.data(), N, C, OC);
    cpu::linear_backward(static_cast<float*>(nullptr), low_w.data(), static_cast<float*>(nullptr), dout.f.data(),
                         inp.f.data(), w.f.data(), N, C, OC);
  }
  expect_matches("dweight after two replays", ref_w, low_w, dev.get(gw_g, dw0.size()), Out::f32);

  // The first eager call of the graph-only shape tunes it.
  float* out3 = dev.poisoned<float>(size_t(N2) * OC, "eager output");
  gemm.forward(out3, di2, dw, N2, C, OC, dev.stream());
  expect_matches("graph-only shape, eager", ref2, low2, dev.get(out3, ref2.size()), Out::f32);
  for (const auto& p : gemm.plans())
    if (p.n == N2) {
      EXPECT_FALSE(p.pending);
      if (p.candidates > 1) EXPECT_TRUE(p.tuned);
    }
  print_plans("graph", gemm);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// cuBLASLt's C typedef wrapped: nvcc's front end fails on a std::vector of the typedef.
struct Algo {
  cublasLtMatmulAlgo_t a;
};

// The heuristic's choice for a forward GEMM as Gemm::forward lays it out (row-major
// out[N, OC] = inp[N, C] · W[OC, C]ᵀ as column-major D = op_T(W) · inp, bf16 out).
std::vector<Algo> heuristic_algos(int N, int C, int OC, int count) {
  cublasLtHandle_t h;
  CUBLAS_CHECK(cublasLtCreate(&h));
  cublasLtMatmulDesc_t desc;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
  cublasLtMatrixLayout_t la, lb, ld;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, C, OC, C));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, C, N, C));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, OC, N, OC));
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = gpu::Gemm::kDefaultWorkspaceBytes;
  const uint32_t al = 256;  // arena allocations are 256-byte aligned
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof al));
  cublasLtMatmulHeuristicResult_t res[gpu::Gemm::kTuneCandidates] = {};
  count = std::min(count, gpu::Gemm::kTuneCandidates);
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, count, res, &found));
  std::vector<Algo> out;
  for (int i = 0; i < found; ++i)
    if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= ws) out.push_back({res[i].algo});
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(h);
  return out;
}

const gpu::Gemm::PlanInfo* find_forward_plan(const std::vector<gpu::Gemm::PlanInfo>& plans, int N, int C, int OC) {
  for (const auto& p : plans)
    if (p.m == OC && p.n == N && p.k == C && p.transa == CUBLAS_OP_T && p.epilogue == CUBLASLT_EPILOGUE_DEFAULT &&
        !p.f32_out)
      return &p;
  return nullptr;
}

TEST_F(GpuGemmAutotune, OffUsesHeuristicFirstPick) {
  gpu::set_gemm_autotune(false);
  EXPECT_FALSE(gpu::gemm_autotune());
  const int N = 640, C = 576, OC = 704;  // not used by the other tests
  Dev dev;
  gpu::Gemm gemm(dev.arena());
  const Data inp = random_bf16(size_t(N) * C, 601), w = random_bf16(size_t(OC) * C, 602, 0.05);
  const bf16* di = dev.put_bf16(inp.bits);
  const bf16* dw = dev.put_bf16(w.bits);
  bf16* out = dev.poisoned_bf16(size_t(N) * OC);
  gemm.forward(out, di, dw, nullptr, N, C, OC, dev.stream());
  VD ref(size_t(N) * OC);
  VF low(size_t(N) * OC);
  cpu::linear_forward(ref.data(), inp.d.data(), w.d.data(), static_cast<const double*>(nullptr), N, C, OC);
  cpu::linear_forward(low.data(), inp.f.data(), w.f.data(), static_cast<const float*>(nullptr), N, C, OC);
  expect_matches("forward (autotune off)", ref, round_bf16(low), dev.get_bf16(out, ref.size()), Out::bf16);
  EXPECT_EQ(gemm.tuning_scratch_bytes(), 0u);
  for (const auto& p : gemm.plans()) {
    EXPECT_FALSE(p.tuned);
    EXPECT_FALSE(p.pending);
    EXPECT_EQ(p.chosen, 0);
    EXPECT_EQ(p.candidates, 1);
  }
  const auto first = heuristic_algos(N, C, OC, 1);
  ASSERT_EQ(first.size(), 1u);
  const auto* plan = find_forward_plan(gemm.plans(), N, C, OC);
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(std::memcmp(&plan->algo, &first[0].a, sizeof first[0].a), 0) << "not the heuristic's first algorithm";

  // Switching autotuning on later does not change a choice already made.
  gpu::set_gemm_autotune(true);
  bf16* out2 = dev.poisoned_bf16(size_t(N) * OC);
  gemm.forward(out2, di, dw, nullptr, N, C, OC, dev.stream());
  plan = find_forward_plan(gemm.plans(), N, C, OC);
  ASSERT_NE(plan, nullptr);
  EXPECT_FALSE(plan->tuned);
  EXPECT_EQ(std::memcmp(&plan->algo, &first[0].a, sizeof first[0].a), 0);
  expect_bitwise_equal("forward before / after switching on", dev.get_bf16(out, ref.size()),
                       dev.get_bf16(out2, ref.size()));

  // A new Gemm with autotuning on picks among the heuristic's candidates, in its order.
  gpu::Gemm tuned(dev.arena());
  bf16* out3 = dev.poisoned_bf16(size_t(N) * OC);
  tuned.forward(out3, di, dw, nullptr, N, C, OC, dev.stream());
  expect_matches("forward (autotune on)", ref, round_bf16(low), dev.get_bf16(out3, ref.size()), Out::bf16);
  const auto cands = heuristic_algos(N, C, OC, gpu::Gemm::kTuneCandidates);
  const auto* tp = find_forward_plan(tuned.plans(), N, C, OC);
  ASSERT_NE(tp, nullptr);
  ASSERT_LT(size_t(tp->chosen), cands.size());
  EXPECT_EQ(tp->candidates, int(cands.size()));
  EXPECT_EQ(std::memcmp(&tp->algo, &cands[size_t(tp->chosen)].a, sizeof tp->algo), 0)
      << "the chosen index does not name the algorithm used";
  EXPECT_EQ(std::memcmp(&cands[0].a, &first[0].a, sizeof first[0].a), 0)
      << "the heuristic's order changed with the count";
  print_plans("off, then on", tuned);
}

}  // namespace
