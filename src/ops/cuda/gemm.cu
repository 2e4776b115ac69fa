// Linear layers through cuBLASLt: bf16 operands, fp32 accumulation (CUBLAS_COMPUTE_32F).
//
// cuBLASLt is column-major; a row-major [R, K] matrix is the column-major [K, R] matrix
// with leading dimension K. With W [OC, C], inp [N, C], dout [N, OC] row-major:
//   out  = inp · Wᵀ     ->  outᵀ (OC×N)  = op_T(W_cm: C×OC) · inp_cm (C×N)      m=OC n=N  k=C
//   dinp = dout · W     ->  dinpᵀ (C×N)  = W_cm (C×OC) · dout_cm (OC×N)          m=C  n=N  k=OC
//   dW   = doutᵀ · inp  ->  dWᵀ (C×OC)   = inp_cm (C×N) · op_T(dout_cm: OC×N)    m=C  n=OC k=N
// The bias of the forward is then per row of D (what the BIAS epilogue adds), and the
// bias gradient Σ_n dout is the column sum of op(B) in the dW product (BGRADB).
//
// A plan (descriptor, four layouts, the algorithm) is built on first use of a (shape,
// operation, epilogue, alignment) combination and cached; a combination the heuristic
// rejects is cached as unsupported and served by separate kernels.
//
// Autotuning: the heuristic's first pick is often not the fastest algorithm for the
// shapes of a training step (timing its candidates saved 3.8-6.4% of the GEMM time of a
// step on an H100, up to 23% on single shapes), so with autotuning on a plan keeps up to
// kTuneCandidates of the heuristic's algorithms until its first call outside a CUDA graph
// capture, which times them with the call's own operands, epilogue and beta and fixes
// the fastest. GpuTransformer runs every step eagerly once before capturing it, so all
// of its shapes are tuned before any graph is recorded.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/device_arena.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/cublaslt_plan.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/gpu.h"

namespace esplag::gpu {

namespace {

using detail::alignment_of;
using detail::KeyBytesEqual;
using detail::KeyBytesHash;
using detail::to_bf;
using detail::to_f;
using detail::zeroed_key;

constexpr int kThreads = 256;

// out[n, o] = bias[o]: the fallback for the bias epilogue. The GEMM then runs with
// beta = 1, so the bias is added in fp32 before the single rounding, as the epilogue does.
__global__ void broadcast_rows_kernel(bf16* out, const bf16* bias, int64_t N, int OC) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < N * OC) out[i] = bias[i % OC];
}

__global__ void add_vec_kernel(float* dst, const float* src, int n) {
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i < n) dst[i] += src[i];
}

struct PlanKey {
  int32_t m, n, k, lda, ldb, ldd;
  int32_t transa, transb, dtype_d, epilogue;
  uint32_t align_a, align_b, align_d, align_bias, align_aux;
  int64_t aux_ld;
};

struct Plan {
  bool ok = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  // The heuristic's algorithms in its order (a plain array: nvcc's front end fails on a
  // std::vector of the C typedef), their count, the index chosen and the timings.
  cublasLtMatmulAlgo_t candidates[Gemm::kTuneCandidates] = {};
  int num_candidates = 1;
  int chosen = 0;
  bool pending = false, tuned = false;
  float first_ms = 0, chosen_ms = 0;
};

// -1: not read from the environment yet; 0 off; 1 on.
std::atomic<int> g_autotune{-1};

// Tuned choices, process-wide, so that every Gemm (a model's, an evaluator's, a test's)
// runs a shape with the same algorithm, and a shape is timed once per process and device.
struct TuneKey {
  PlanKey plan;
  uint64_t workspace_bytes;
  int32_t device, pad;
};
struct TuneChoice {
  cublasLtMatmulAlgo_t algo;
  int num_candidates, chosen;
  float first_ms, chosen_ms;
};
std::mutex g_tuned_mutex;
using TuneMap = std::unordered_map<TuneKey, TuneChoice, KeyBytesHash<TuneKey>, KeyBytesEqual<TuneKey>>;
TuneMap& tuned_choices() {
  static auto* m = new TuneMap();  // never destroyed: used until exit
  return *m;
}

TuneKey tune_key(const PlanKey& key, size_t workspace_bytes) {
  auto t = zeroed_key<TuneKey>();
  t.plan = key;
  t.workspace_bytes = workspace_bytes;
  CUDA_CHECK(cudaGetDevice(&t.device));
  return t;
}

// Gives the plan the process's choice for its key, if one was made.
bool adopt_tuned(Plan& p, const TuneKey& key) {
  const std::lock_guard<std::mutex> lock(g_tuned_mutex);
  const auto it = tuned_choices().find(key);
  if (it == tuned_choices().end()) return false;
  const TuneChoice& c = it->second;
  p.algo = c.algo;
  p.num_candidates = c.num_candidates;
  p.chosen = c.chosen;
  p.first_ms = c.first_ms;
  p.chosen_ms = c.chosen_ms;
  p.tuned = true;
  p.pending = false;
  return true;
}

bool autotune_from_env() {
  return env_flag("ESPLAG_GEMM_AUTOTUNE", true);
}

// Capturing (or unable to tell, e.g. the legacy stream while another stream captures):
// then nothing may synchronise, so no tuning.
bool stream_capturing(cudaStream_t s) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &cs) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; leave none behind
    return true;
  }
  return cs != cudaStreamCaptureStatusNone;
}

bool overlap(const void* p, size_t pb, const void* q, size_t qb) {
  if (!p || !q || !pb || !qb) return false;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return a < b + qb && b < a + pb;
}

}  // namespace

void set_gemm_autotune(bool on) { g_autotune.store(on ? 1 : 0); }

bool gemm_autotune() {
  int v = g_autotune.load();
  if (v < 0) {
    int expected = -1;
    g_autotune.compare_exchange_strong(expected, autotune_from_env() ? 1 : 0);
    v = g_autotune.load();
  }
  return v == 1;
}

struct Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  float* scratch = nullptr;
  size_t scratch_floats = 0;
  std::unordered_map<PlanKey, Plan, KeyBytesHash<PlanKey>, KeyBytesEqual<PlanKey>> cache;
  // Tuning: the output buffer for timed runs that must not touch the caller's output
  // (own cudaMalloc, grown on demand), and the events that time them.
  void* tune_out = nullptr;
  size_t tune_out_bytes = 0;
  cudaEvent_t events[Gemm::kTuneReps + 1] = {};

  ~Impl() {
    for (auto& [key, plan] : cache) detail::destroy_plan(plan);
    for (cudaEvent_t e : events)
      if (e) cudaEventDestroy(e);
    if (tune_out) cudaFree(tune_out);
    if (handle) cublasLtDestroy(handle);
  }

  void release_tune_out() {
    if (!tune_out) return;
    CUDA_CHECK(cudaFree(tune_out));  // synchronises the device: nothing still uses it
    tune_out = nullptr;
    tune_out_bytes = 0;
  }

  // A zeroed device buffer of at least `bytes`, or null when the device has no memory
  // for it (the caller then keeps the heuristic's pick).
  void* tuning_output(size_t bytes, cudaStream_t stream) {
    if (bytes <= tune_out_bytes) return tune_out;
    release_tune_out();
    const size_t rounded = (bytes + (size_t(2) << 20) - 1) / (size_t(2) << 20) * (size_t(2) << 20);
    void* p = nullptr;
    if (cudaMalloc(&p, rounded) != cudaSuccess) {
      (void)cudaGetLastError();  // out of memory is not sticky
      return nullptr;
    }
    tune_out = p;
    tune_out_bytes = rounded;
    // Zero once so that beta = 1 runs read finite values (timing does not depend on them).
    CUDA_CHECK(cudaMemsetAsync(p, 0, rounded, stream));
    return p;
  }

  // Times the plan's candidates with this call's operands, epilogue and beta, and fixes
  // the algorithm. Writes only the tuning buffer, or D when the call overwrites D anyway
  // (beta = 0) and D overlaps no input; the epilogue's own outputs (GELU aux, bias
  // gradient) are rewritten by the real call that follows. Synchronises the stream.
  void tune(Plan& plan, const PlanKey& key, const bf16* A, const bf16* B, void* D, float beta, const void* bias,
            const void* aux, cudaStream_t stream) {
    if (!gemm_autotune()) {  // switched off since the plan was built: the first pick is final
      plan.pending = false;
      return;
    }
    if (stream_capturing(stream)) return;  // stays pending: tuned at the first eager call
    const TuneKey tkey = tune_key(key, workspace_bytes);
    if (adopt_tuned(plan, tkey)) return;  // another Gemm timed it meanwhile
    plan.pending = false;
    const bool a_n = key.transa == CUBLAS_OP_N, b_n = key.transb == CUBLAS_OP_N;
    const size_t d_elem = key.dtype_d == CUDA_R_32F ? 4 : 2;
    const size_t d_bytes = size_t(key.ldd) * size_t(key.n) * d_elem;
    const size_t a_bytes = size_t(key.lda) * size_t(a_n ? key.k : key.m) * 2;
    const size_t b_bytes = size_t(key.ldb) * size_t(b_n ? key.n : key.k) * 2;
    const size_t aux_bytes = size_t(key.aux_ld) * size_t(key.n) * 2;
    const size_t bias_bytes = size_t(key.m) * 4;
    const bool in_place = beta == 0.f && !overlap(D, d_bytes, A, a_bytes) && !overlap(D, d_bytes, B, b_bytes) &&
                          !overlap(D, d_bytes, aux, aux_bytes) && !overlap(D, d_bytes, bias, bias_bytes);
    void* target = in_place ? D : tuning_output(d_bytes, stream);
    if (!target) {
      std::fprintf(stderr,
                   "esplag: warning: gpu::Gemm: no device memory for the %zu-byte autotuning output of the GEMM "
                   "m=%d n=%d k=%d; it keeps the heuristic's first algorithm\n",
                   d_bytes, key.m, key.n, key.k);
      return;
    }
    for (cudaEvent_t& e : events)
      if (!e) CUDA_CHECK(cudaEventCreate(&e));

    const float alpha = 1.f;
    auto run = [&](const cublasLtMatmulAlgo_t& algo) {
      return cublasLtMatmul(handle, plan.desc, &alpha, A, plan.a, B, plan.b, &beta, target, plan.d, target, plan.d,
                            &algo, workspace, workspace_bytes, stream);
    };
    constexpr float kFailed = 1e30f;
    std::vector<float> median(size_t(plan.num_candidates), kFailed);
    for (int i = 0; i < plan.num_candidates; ++i) {
      const cublasLtMatmulAlgo_t& algo = plan.candidates[i];
      if (run(algo) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; a candidate the call refuses is skipped
      bool ok = true;
      CUDA_CHECK(cudaEventRecord(events[0], stream));
      for (int r = 0; r < Gemm::kTuneReps && ok; ++r) {
        ok = run(algo) == CUBLAS_STATUS_SUCCESS;
        CUDA_CHECK(cudaEventRecord(events[r + 1], stream));
      }
      CUDA_CHECK(cudaEventSynchronize(events[Gemm::kTuneReps]));
      if (!ok) continue;
      float t[Gemm::kTuneReps];
      for (int r = 0; r < Gemm::kTuneReps; ++r) CUDA_CHECK(cudaEventElapsedTime(&t[r], events[r], events[r + 1]));
      std::sort(t, t + Gemm::kTuneReps);
      median[i] = t[Gemm::kTuneReps / 2];
    }
    const size_t best = static_cast<size_t>(std::min_element(median.begin(), median.end()) - median.begin());
    if (median[best] < kFailed) {
      // The heuristic's pick stays unless another is clearly faster: a near tie is timing
      // noise, and keeping the first pick then makes the choice stable across processes.
      const bool keep_first = median[0] < kFailed && median[best] > (1.f - Gemm::kTuneMinGain) * median[0];
      plan.chosen = keep_first ? 0 : static_cast<int>(best);
      plan.algo = plan.candidates[plan.chosen];
      plan.first_ms = median[0] < kFailed ? median[0] : 0.f;
      plan.chosen_ms = median[plan.chosen];
      plan.tuned = true;
      const std::lock_guard<std::mutex> lock(g_tuned_mutex);
      tuned_choices().emplace(tkey,
                              TuneChoice{plan.algo, plan.num_candidates, plan.chosen, plan.first_ms, plan.chosen_ms});
    }
  }

  // D (m×n, column-major, ld ldd) = alpha · op(A) · op(B) + beta · D with the epilogue.
  // Returns false when cuBLASLt does not support the combination with a non-default
  // epilogue (the caller falls back); throws for anything else.
  bool matmul(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const bf16* A, int lda,
              const bf16* B, int ldb, void* D, int ldd, cudaDataType_t dtype_d, float beta,
              cublasLtEpilogue_t epi, const void* bias, const void* aux, int64_t aux_ld, cudaStream_t stream) {
    auto key = zeroed_key<PlanKey>();
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldd = ldd;
    key.transa = ta;
    key.transb = tb;
    key.dtype_d = dtype_d;
    key.epilogue = epi;
    key.align_a = alignment_of(A);
    key.align_b = alignment_of(B);
    key.align_d = alignment_of(D);
    key.align_bias = bias ? alignment_of(bias) : 0;
    key.align_aux = aux ? alignment_of(aux) : 0;
    key.aux_ld = aux_ld;

    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, build(key, bias, aux)).first;
    Plan& plan = it->second;
    if (!plan.ok) {
      if (epi == CUBLASLT_EPILOGUE_DEFAULT)
        fail("cuBLASLt has no algorithm for the bf16 GEMM m=", m, " n=", n, " k=", k, " (lda=", lda, ", ldb=", ldb,
             ", ldd=", ldd, ", alignments ", key.align_a, "/", key.align_b, "/", key.align_d, " bytes)");
      return false;
    }
    // Pointers are per call; the descriptor is shared by every call of this plan.
    if (bias)
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    if (aux)
      CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
    if (plan.pending) tune(plan, key, A, B, D, beta, bias, aux, stream);
    const float alpha = 1.f;
    const cublasStatus_t st = cublasLtMatmul(handle, plan.desc, &alpha, A, plan.a, B, plan.b, &beta, D, plan.d, D,
                                             plan.d, &plan.algo, workspace, workspace_bytes, stream);
    if ((st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) && epi != CUBLASLT_EPILOGUE_DEFAULT) {
      plan.ok = false;  // remembered: later calls go straight to the fallback
      return false;
    }
    CUBLAS_CHECK(st);
    return true;
  }

  Plan build(const PlanKey& key, const void* bias, const void* aux) {
    Plan p;
    const auto ta = static_cast<cublasOperation_t>(key.transa), tb = static_cast<cublasOperation_t>(key.transb);
    const auto epi = static_cast<cublasLtEpilogue_t>(key.epilogue);
    const auto dt = static_cast<cudaDataType_t>(key.dtype_d);
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    // The heuristic reads the pointers for their alignment.
    if (bias)
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    if (aux) {
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &key.aux_ld,
                                                  sizeof key.aux_ld));
    }
    const bool a_n = ta == CUBLAS_OP_N, b_n = tb == CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, a_n ? key.m : key.k, a_n ? key.k : key.m, key.lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, b_n ? key.k : key.n, b_n ? key.n : key.k, key.ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, dt, key.m, key.n, key.ldd));

    // With autotuning, several candidates to time at the first eager call; without, the
    // heuristic's first pick only (exactly what it would return for a request of one).
    const bool want_tuning = gemm_autotune();
    cublasLtMatmulHeuristicResult_t res[Gemm::kTuneCandidates] = {};
    int found = 0;
    const cublasStatus_t st =
        detail::query_heuristic(handle, p.desc, p.a, p.b, p.d, workspace_bytes, key.align_a, key.align_b, key.align_d,
                                want_tuning ? Gemm::kTuneCandidates : 1, res, &found);
    // NOT_SUPPORTED (or no result) means this combination cannot run. With a fused
    // epilogue any refusal just selects the separate kernels; otherwise it is an error.
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED && epi == CUBLASLT_EPILOGUE_DEFAULT) {
      detail::destroy_plan(p);
      CUBLAS_CHECK(st);
    }
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
      detail::destroy_plan(p);
      return p;  // ok = false
    }
    p.num_candidates = 0;
    for (int i = 0; i < found && i < Gemm::kTuneCandidates; ++i)
      if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= workspace_bytes)
        p.candidates[p.num_candidates++] = res[i].algo;
    if (p.num_candidates == 0) {
      detail::destroy_plan(p);
      return p;  // ok = false
    }
    p.algo = p.candidates[0];
    p.pending = want_tuning && p.num_candidates > 1;
    // Already timed by another Gemm of this process: the same choice, no timing.
    if (p.pending) adopt_tuned(p, tune_key(key, workspace_bytes));
    p.ok = true;
    return p;
  }
};

Gemm::Gemm(DeviceArena& arena, size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
  impl_->workspace_bytes = workspace_bytes;
  impl_->workspace = workspace_bytes ? arena.allocate("gemm.workspace", workspace_bytes) : nullptr;
  impl_->scratch_floats = kScratchBytes / sizeof(float);
  impl_->scratch = arena.allocate_array<float>("gemm.scratch", impl_->scratch_floats);
}

Gemm::~Gemm() = default;

size_t Gemm::cached_plans() const { return impl_->cache.size(); }

std::vector<Gemm::PlanInfo> Gemm::plans() const {
  std::vector<PlanInfo> out;
  for (const auto& [key, plan] : impl_->cache) {
    if (!plan.ok) continue;
    PlanInfo i;
    i.m = key.m;
    i.n = key.n;
    i.k = key.k;
    i.transa = static_cast<cublasOperation_t>(key.transa);
    i.transb = static_cast<cublasOperation_t>(key.transb);
    i.epilogue = static_cast<cublasLtEpilogue_t>(key.epilogue);
    i.f32_out = key.dtype_d == CUDA_R_32F;
    i.candidates = plan.num_candidates;
    i.chosen = plan.chosen;
    i.tuned = plan.tuned;
    i.pending = plan.pending;
    i.first_ms = plan.first_ms;
    i.chosen_ms = plan.chosen_ms;
    i.algo = plan.algo;
    out.push_back(i);
  }
  return out;
}

size_t Gemm::tuning_scratch_bytes() const { return impl_->tune_out_bytes; }

void Gemm::release_tuning_scratch() { impl_->release_tune_out(); }

namespace {
void check_sizes(const char* op, int N, int C, int OC) {
  ESPLAG_CHECK(N >= 0 && C > 0 && OC > 0, "Gemm::", op, ": bad size N=", N, ", C=", C, ", OC=", OC);
}
}  // namespace

void Gemm::forward(bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C, int OC,
                   cudaStream_t stream, Act act, bf16* pre_gelu) {
  check_sizes("forward", N, C, OC);
  ESPLAG_CHECK(out && inp && weight, "Gemm::forward: out, inp and weight must not be null");
  if (N == 0) return;
  const bool gelu = act == Act::gelu;
  bf16* aux = gelu ? pre_gelu : nullptr;
  if (bias || gelu) {
    if (use_epilogues_ && (!aux || OC % 8 == 0)) {  // the aux matrix needs ld % 8 == 0
      cublasLtEpilogue_t epi;
      if (!gelu)
        epi = CUBLASLT_EPILOGUE_BIAS;
      else if (aux)
        epi = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      else
        epi = bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
      if (impl_->matmul(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, out, OC, CUDA_R_16BF, 0.f, epi, bias,
                        aux, aux ? OC : 0, stream))
        return;
    }
    ++fallbacks_;
  }
  // Separate kernels: bias broadcast + GEMM with beta = 1, then GELU.
  bf16* target = aux ? aux : out;
  float beta = 0.f;
  if (bias) {
    broadcast_rows_kernel<<<detail::blocks_for(int64_t(N) * OC, kThreads), kThreads, 0, stream>>>(target, bias, N, OC);
    CUDA_CHECK_LAUNCH("Gemm::forward (bias)");
    beta = 1.f;
  }
  impl_->matmul(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, target, OC, CUDA_R_16BF, beta,
                CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, stream);
  if (gelu) gelu_forward(out, target, int64_t(N) * OC, stream);
}

void Gemm::forward(float* out, const bf16* inp, const bf16* weight, int N, int C, int OC, cudaStream_t stream) {
  check_sizes("forward", N, C, OC);
  ESPLAG_CHECK(out && inp && weight, "Gemm::forward: out, inp and weight must not be null");
  if (N == 0) return;
  impl_->matmul(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, out, OC, CUDA_R_32F, 0.f,
                CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, stream);
}

void Gemm::forward_strided(bf16* out, int ldo, const bf16* inp, int ldi, const bf16* weight, int N, int C, int OC,
                           bool accumulate, cudaStream_t stream) {
  check_sizes("forward_strided", N, C, OC);
  ESPLAG_CHECK(out && inp && weight, "Gemm::forward_strided: out, inp and weight must not be null");
  ESPLAG_CHECK(ldo >= OC && ldi >= C, "Gemm::forward_strided: row strides ldo=", ldo, ", ldi=", ldi,
               " must be at least OC=", OC, " and C=", C);
  if (N == 0) return;
  impl_->matmul(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, ldi, out, ldo, CUDA_R_16BF,
                accumulate ? 1.f : 0.f, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, stream);
}

void Gemm::backward_input(bf16* dinp, const bf16* dout, const bf16* weight, int N, int C, int OC, bool accumulate,
                          cudaStream_t stream, const bf16* pre_gelu) {
  check_sizes("backward_input", N, C, OC);
  ESPLAG_CHECK(dinp && dout && weight, "Gemm::backward_input: dinp, dout and weight must not be null");
  ESPLAG_CHECK(!(pre_gelu && accumulate), "Gemm::backward_input: the fused GELU gradient overwrites dinp; "
               "accumulate must be false when pre_gelu is given");
  if (N == 0) return;
  if (pre_gelu) {
    if (use_epilogues_ && C % 8 == 0 &&
        impl_->matmul(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, dout, OC, dinp, C, CUDA_R_16BF, 0.f,
                      CUBLASLT_EPILOGUE_DGELU, nullptr, pre_gelu, C, stream))
      return;
    ++fallbacks_;
    impl_->matmul(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, dout, OC, dinp, C, CUDA_R_16BF, 0.f,
                  CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, stream);
    gelu_backward(dinp, pre_gelu, dinp, int64_t(N) * C, false, stream);
    return;
  }
  impl_->matmul(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, dout, OC, dinp, C, CUDA_R_16BF,
                accumulate ? 1.f : 0.f, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, stream);
}

void Gemm::backward_weight(float* dweight, float* dbias, const bf16* dout, const bf16* inp, int N, int C, int OC,
                           bool accumulate, cudaStream_t stream) {
  check_sizes("backward_weight", N, C, OC);
  ESPLAG_CHECK(dout && (inp || !dweight), "Gemm::backward_weight: dout and inp must not be null");
  if (!dweight && !dbias) return;
  if (N == 0) {
    if (dweight && !accumulate) CUDA_CHECK(cudaMemsetAsync(dweight, 0, sizeof(float) * size_t(OC) * C, stream));
    return;
  }
  const float beta = accumulate ? 1.f : 0.f;
  if (dweight && dbias && use_epilogues_ && size_t(OC) <= impl_->scratch_floats) {
    // BGRADB writes Σ_n dout into scratch (it cannot accumulate), then it is added.
    if (impl_->matmul(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, dout, OC, dweight, C, CUDA_R_32F, beta,
                      CUBLASLT_EPILOGUE_BGRADB, impl_->scratch, nullptr, 0, stream)) {
      add_vec_kernel<<<detail::blocks_for(OC, kThreads), kThreads, 0, stream>>>(dbias, impl_->scratch, OC);
      CUDA_CHECK_LAUNCH("Gemm::backward_weight (bias)");
      return;
    }
  }
  if (dbias && dweight) ++fallbacks_;
  if (dweight)
    impl_->matmul(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, dout, OC, dweight, C, CUDA_R_32F, beta,
                  CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, stream);
  if (dbias)
    detail::column_reduce(detail::ColumnMode::bias, dbias, nullptr, dout, nullptr, nullptr, nullptr, N, OC,
                          impl_->scratch, impl_->scratch_floats, stream);
}

}  // namespace esplag::gpu
