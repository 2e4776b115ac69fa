// cuBLASLt's fp8 GEMM (ops/gpu_fp8.h): fp8 operands, per-tensor scales in device memory,
// fp32 accumulation, bf16 or fp32 output.
//
// cuBLASLt is column-major; a row-major [R, K] matrix is the column-major [K, R] one with
// leading dimension K. D [M, N] = A [M, K] · B [N, K]ᵀ (row-major) is therefore
//   Dᵀ (N×M, ld N) = op_T(B_cm: K×N) · A_cm (K×M)     cuBLASLt m=N n=M k=K, A=B, B=A
// the "TN" layout that Hopper's fp8 kernels require (as gpu::Gemm's forward, ops/cuda/gemm.cu).
// The bias epilogue adds per row of Dᵀ, i.e. per column of D. The scales are cuBLASLt's
// A/B scale pointers: D = scale_a · scale_b · Σ codes (+ beta · D + bias).
//
// Plans use the heuristic's first algorithm (no autotuning, unlike gpu::Gemm) and assume
// 16-byte alignment, which every call is checked for.
#include <cstring>
#include <string>
#include <unordered_map>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/gpu_fp8.h"

namespace esplag::gpu {

namespace {

constexpr uint32_t kAlignment = 16;

struct Fp8PlanKey {
  int32_t m, n, k;
  int32_t type_a, type_b, type_d;
  int32_t bias, fast_accum;
  bool operator==(const Fp8PlanKey& o) const { return std::memcmp(this, &o, sizeof(Fp8PlanKey)) == 0; }
};

struct Fp8PlanKeyHash {
  size_t operator()(const Fp8PlanKey& k) const {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&k);
    uint64_t h = 1469598103934665603ull;  // FNV-1a; the key has no padding
    for (size_t i = 0; i < sizeof(Fp8PlanKey); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Fp8Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

cudaDataType_t cuda_type(Fp8Format f) { return f == Fp8Format::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

bool aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & (kAlignment - 1)) == 0; }

std::string problem_text(const Fp8PlanKey& k) {
  return "M=" + std::to_string(k.n) + " N=" + std::to_string(k.m) + " K=" + std::to_string(k.k) + " (" +
         (k.type_b == CUDA_R_8F_E4M3 ? "e4m3" : "e5m2") + " x " + (k.type_a == CUDA_R_8F_E4M3 ? "e4m3" : "e5m2") +
         " -> " + (k.type_d == CUDA_R_32F ? "fp32" : "bf16") + (k.bias ? ", bias" : "") + ")";
}

}  // namespace

struct Fp8Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::unordered_map<Fp8PlanKey, Fp8Plan, Fp8PlanKeyHash> cache;

  ~Impl() {
    for (auto& [key, plan] : cache) destroy(plan);
    if (handle) cublasLtDestroy(handle);
  }

  static void destroy(Fp8Plan& p) {
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.d) cublasLtMatrixLayoutDestroy(p.d);
    p = Fp8Plan{};
  }

  // The plan of `key`, built on first use; throws when cuBLASLt has no algorithm for it.
  Fp8Plan& plan(const Fp8PlanKey& key) {
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    Fp8Plan p;
    try {
      build(p, key);
    } catch (...) {
      destroy(p);
      throw;
    }
    return cache.emplace(key, p).first->second;
  }

  void build(Fp8Plan& p, const Fp8PlanKey& key) {
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
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, static_cast<cudaDataType_t>(key.type_a), key.k, key.m, key.k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, static_cast<cudaDataType_t>(key.type_b), key.k, key.n, key.k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, type_d, key.m, key.n, key.m));

    cublasLtMatmulPreference_t pref = nullptr;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = workspace_bytes;
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    for (const auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &kAlignment, sizeof kAlignment);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.d, p.d, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_CHECK(st);
    ESPLAG_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS,
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
    if (M == 0) return;
    ESPLAG_CHECK(D && A.data && B.data && A.inv_scale && B.inv_scale,
                 "Fp8Gemm: D, the operands and their inv_scale must not be null");
    ESPLAG_CHECK(aligned(D) && aligned(A.data) && aligned(B.data) && (!bias || aligned(bias)),
                 "Fp8Gemm: D, A, B and the bias must be 16-byte aligned");
    Fp8PlanKey key;
    std::memset(&key, 0, sizeof key);
    key.m = N;
    key.n = M;
    key.k = K;
    key.type_a = cuda_type(B.format);
    key.type_b = cuda_type(A.format);
    key.type_d = type_d;
    key.bias = bias != nullptr;
    key.fast_accum = fast_accum;
    Fp8Plan& p = plan(key);
    // Pointers are per call; the descriptor is shared by every call of this plan.
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &B.inv_scale,
                                                sizeof B.inv_scale));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &A.inv_scale,
                                                sizeof A.inv_scale));
    if (bias)
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    CUBLAS_CHECK(cublasLtMatmul(handle, p.desc, &alpha, B.data, p.a, A.data, p.b, &beta, D, p.d, D, p.d, &p.algo,
                                workspace, workspace_bytes, stream));
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
