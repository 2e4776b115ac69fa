// cuBLASLt's fp8 GEMM (ops/gpu_fp8.h): fp8 operands, per-tensor scales in device memory,
// fp32 accumulation, bf16 or fp32 output.
//
// cuBLASLt is column-major; a row-major [R, K] matrix is the column-major [K, R] one with
// leading dimension K. D [M, N] = A [M, K] · B [N, K]ᵀ (row-major) is therefore
//   Dᵀ (N×M, ld N) = op_T(B_cm: K×N) · A_cm (K×M)     cuBLASLt m=N n=M k=K, A=B, B=A
// the "TN" layout that Hopper's fp8 kernels require (as gpu::Gemm's forward, ops/cuda/gemm.cu).
// The bias epilogue adds per row of Dᵀ, i.e. per column of D. The scales are cuBLASLt's
// A/B scale pointers: D = scale_a · scale_b · Σ codes (+ beta · D or + bias).
//
// A plan's algorithm is the heuristic's first pick (no autotuning, unlike gpu::Gemm) for
// the descriptor as its first call sets it: the scale and bias pointers are on it before
// the query, because cuBLASLt may otherwise pick a kernel that cannot apply scales, which
// cublasLtMatmul then refuses (CUBLAS_STATUS_NOT_SUPPORTED), and it reads the bias pointer
// for its alignment. So the plan key holds everything the query sees: the shape, the
// types, the bias epilogue, fast accumulation, and the alignments of the bias and scale
// pointers. The operands and D are checked 16-byte aligned, the alignment the query is
// told. beta is no input of the query: a plan serves overwriting and accumulating calls.
#include <string>
#include <unordered_map>
#include <utility>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/cublaslt_plan.cuh"
#include "ops/gpu_fp8.h"

namespace esplag::gpu {

namespace {

using detail::alignment_of;

constexpr uint32_t kAlignment = 16;

struct Fp8PlanKey {
  int32_t m, n, k;  // cuBLASLt's: m = N, n = M
  int32_t type_a, type_b, type_d;
  int32_t bias, fast_accum;
  uint32_t align_bias;
};

struct Fp8Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

cudaDataType_t cuda_type(Fp8Format f) { return f == Fp8Format::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

bool aligned(const void* p) { return alignment_of(p) >= kAlignment; }

std::string problem_text(const Fp8PlanKey& k) {
  return "M=" + std::to_string(k.n) + " N=" + std::to_string(k.m) + " K=" + std::to_string(k.k) + " (" +
         (k.type_b == CUDA_R_8F_E4M3 ? "e4m3" : "e5m2") + " x " + (k.type_a == CUDA_R_8F_E4M3 ? "e4m3" : "e5m2") +
         " -> " + (k.type_d == CUDA_R_32F ? "fp32" : "bf16") + (k.bias ? ", bias" : "") +
         (k.fast_accum ? ", fast accumulation" : ", accurate accumulation") + ")";
}

// The algorithm's configuration, for an error message.
std::string algo_text(const cublasLtMatmulAlgo_t& algo) {
  std::string t;
  const std::pair<cublasLtMatmulAlgoConfigAttributes_t, const char*> fields[] = {
      {CUBLASLT_ALGO_CONFIG_ID, "algorithm "},
      {CUBLASLT_ALGO_CONFIG_TILE_ID, ", tile "},
      {CUBLASLT_ALGO_CONFIG_SPLITK_NUM, ", split-K "},
      {CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, ", reduction scheme "}};
  for (const auto& [attr, name] : fields) {
    uint32_t v = 0;  // each of these is 32 bits wide
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof v, &written) == CUBLAS_STATUS_SUCCESS)
      t += name + std::to_string(v);
  }
  return t;
}

}  // namespace

struct Fp8Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::unordered_map<Fp8PlanKey, Fp8Plan, detail::KeyBytesHash<Fp8PlanKey>, detail::KeyBytesEqual<Fp8PlanKey>> cache;

  ~Impl() {
    for (auto& [key, plan] : cache) detail::destroy_plan(plan);
    if (handle) cublasLtDestroy(handle);
  }

  // The call's pointers onto the plan's descriptor (shared by every call of the plan).
  static void set_pointers(Fp8Plan& p, const float* scale_a, const float* scale_b, const bf16* bias) {
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b));
    if (bias)
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  }

  // The plan of `key` with this call's pointers set, built on first use; throws when
  // cuBLASLt has no algorithm for it.
  Fp8Plan& plan(const Fp8PlanKey& key, const float* scale_a, const float* scale_b, const bf16* bias) {
    auto it = cache.find(key);
    if (it != cache.end()) {
      set_pointers(it->second, scale_a, scale_b, bias);
      return it->second;
    }
    Fp8Plan p;
    try {
      build(p, key, scale_a, scale_b, bias);
    } catch (...) {
      detail::destroy_plan(p);
      throw;
    }
    return cache.emplace(key, p).first->second;
  }

  void build(Fp8Plan& p, const Fp8PlanKey& key, const float* scale_a, const float* scale_b, const bf16* bias) {
    int dev = 0, major = 0, minor = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    ESPLAG_CHECK(major * 10 + minor >= 89,
                 "Fp8Gemm: fp8 GEMMs need a GPU of compute capability 8.9 or newer; this one is ", major, ".", minor);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const auto type_d = static_cast<cudaDataType_t>(key.type_d);
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const int8_t fast = key.fast_accum ? 1 : 0;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    if (key.bias) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bias_type = CUDA_R_16BF;
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
      CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type));
    }
    set_pointers(p, scale_a, scale_b, bias);
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, static_cast<cudaDataType_t>(key.type_a), key.k, key.m, key.k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, static_cast<cudaDataType_t>(key.type_b), key.k, key.n, key.k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, type_d, key.m, key.n, key.m));

    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    const cublasStatus_t st = detail::query_heuristic(handle, p.desc, p.a, p.b, p.d, workspace_bytes, kAlignment,
                                                      kAlignment, kAlignment, 1, &res, &found);
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_CHECK(st);
    ESPLAG_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS &&
                     res.workspaceSize <= workspace_bytes,
                 "cuBLASLt has no algorithm for the fp8 GEMM ", problem_text(key), " with a ", workspace_bytes,
                 "-byte workspace");
    p.algo = res.algo;
  }

  void run(void* D, const Fp8Operand& A, const Fp8Operand& B, const bf16* bias, int M, int N, int K,
           cudaDataType_t type_d, bool accumulate, bool fast_accum, cudaStream_t stream) {
    ESPLAG_CHECK(M >= 0 && N > 0 && K > 0 && M % 16 == 0 && N % 16 == 0 && K % 16 == 0,
                 "Fp8Gemm: M=", M, ", N=", N, ", K=", K, " must be positive multiples of 16 (M may be 0)");
    ESPLAG_CHECK(!(A.format == Fp8Format::e5m2 && B.format == Fp8Format::e5m2),
                 "Fp8Gemm: cuBLASLt has no e5m2 x e5m2 product; one operand must be e4m3");
    ESPLAG_CHECK(!(bias && accumulate),
                 "Fp8Gemm: a bias together with accumulate is not supported (cuBLASLt's fp8 kernels then round an "
                 "intermediate sum to bf16); a Linear's forward, the product with a bias, overwrites its output");
    if (M == 0) return;
    ESPLAG_CHECK(D && A.data && B.data && A.inv_scale && B.inv_scale,
                 "Fp8Gemm: D, the operands and their inv_scale must not be null");
    ESPLAG_CHECK(aligned(D) && aligned(A.data) && aligned(B.data) && (!bias || aligned(bias)),
                 "Fp8Gemm: D, A, B and the bias must be 16-byte aligned");
    // Measured on H100 with cuBLASLt 13: its fp8 kernels refuse (CUBLAS_STATUS_NOT_SUPPORTED at
    // the call, after the heuristic chose them) scale pointers that are only 4-byte aligned.
    ESPLAG_CHECK(aligned(A.inv_scale) && aligned(B.inv_scale),
                 "Fp8Gemm: the inverse scales must be 16-byte aligned (cuBLASLt's fp8 kernels refuse others)");
    auto key = detail::zeroed_key<Fp8PlanKey>();
    key.m = N;
    key.n = M;
    key.k = K;
    key.type_a = cuda_type(B.format);
    key.type_b = cuda_type(A.format);
    key.type_d = type_d;
    key.bias = bias != nullptr;
    key.fast_accum = fast_accum;
    key.align_bias = bias ? alignment_of(bias) : 0;
    Fp8Plan& p = plan(key, B.inv_scale, A.inv_scale, bias);
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    const cublasStatus_t st = cublasLtMatmul(handle, p.desc, &alpha, B.data, p.a, A.data, p.b, &beta, D, p.d, D, p.d,
                                             &p.algo, workspace, workspace_bytes, stream);
    if (st != CUBLAS_STATUS_SUCCESS)
      fail("cuBLASLt refused the fp8 GEMM ", problem_text(key), (accumulate ? " accumulating into D" : ""),
           " with its heuristic's ", algo_text(p.algo), ": ", cublasLtGetStatusName(st), " (",
           cublasLtGetStatusString(st), ")");
  }
};

Fp8Gemm::Fp8Gemm(void* workspace, size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  ESPLAG_CHECK(workspace || workspace_bytes == 0, "Fp8Gemm: a workspace of ", workspace_bytes,
               " bytes must not be null");
  CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
  impl_->workspace = workspace;
  impl_->workspace_bytes = workspace_bytes;
}

Fp8Gemm::~Fp8Gemm() = default;

size_t Fp8Gemm::cached_plans() const { return impl_->cache.size(); }

void Fp8Gemm::matmul(bf16* D, const Fp8Operand& A, const Fp8Operand& B, const bf16* bias, int M, int N, int K,
                     bool accumulate, cudaStream_t stream) {
  impl_->run(D, A, B, bias, M, N, K, CUDA_R_16BF, accumulate, fast_accum_, stream);
}

void Fp8Gemm::matmul(float* D, const Fp8Operand& A, const Fp8Operand& B, int M, int N, int K, bool accumulate,
                     cudaStream_t stream) {
  impl_->run(D, A, B, nullptr, M, N, K, CUDA_R_32F, accumulate, fast_accum_, stream);
}

}  // namespace esplag::gpu
