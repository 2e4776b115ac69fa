// What the cuBLASLt GEMMs (ops/cuda/gemm.cu, ops/cuda/gemm_fp8.cu) share about their plan
// caches: keys compared and hashed by their bytes, the pointer alignment cuBLASLt reads,
// the heuristic query and the release of a plan's descriptors.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace esplag::gpu::detail {

// The largest power of two, up to 256, that divides p's address (256 for null): what
// cuBLASLt's heuristic assumes of a pointer it is given.
inline uint32_t alignment_of(const void* p) {
  if (!p) return 256;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 1;
  while (al < 256 && (a & al) == 0) al <<= 1;
  return al;
}

// A plan key is a struct of integers made by zeroed_key, padding included, so that equal
// keys have equal bytes; KeyBytesEqual and KeyBytesHash (FNV-1a) make it an unordered_map key.
template <typename Key>
Key zeroed_key() {
  static_assert(std::is_trivially_copyable_v<Key>, "a plan key is compared by its bytes");
  Key k;
  std::memset(&k, 0, sizeof k);
  return k;
}

template <typename Key>
struct KeyBytesEqual {
  bool operator()(const Key& a, const Key& b) const { return std::memcmp(&a, &b, sizeof(Key)) == 0; }
};

template <typename Key>
struct KeyBytesHash {
  size_t operator()(const Key& k) const {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&k);
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof(Key); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// cublasLtMatmulAlgoGetHeuristic for D = op(A) · op(B) (+ C, C laid out as D): up to
// `requested` algorithms that need at most workspace_bytes and the given pointer
// alignments (C's is D's). Returns cuBLASLt's status; the caller decides what a refusal means.
inline cublasStatus_t query_heuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                      cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d, uint64_t workspace_bytes,
                                      uint32_t align_a, uint32_t align_b, uint32_t align_d, int requested,
                                      cublasLtMatmulHeuristicResult_t* results, int* found) {
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                            sizeof workspace_bytes);
  const cublasLtMatmulPreferenceAttributes_t attrs[] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  const uint32_t alignments[] = {align_a, align_b, align_d, align_d};
  for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i)
    st = cublasLtMatmulPreferenceSetAttribute(pref, attrs[i], &alignments[i], sizeof alignments[i]);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, pref, requested, results, found);
  cublasLtMatmulPreferenceDestroy(pref);
  return st;
}

// Releases a plan's descriptor and layouts (members desc, a, b, d) and resets the plan.
template <typename Plan>
void destroy_plan(Plan& p) {
  if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.d) cublasLtMatrixLayoutDestroy(p.d);
  p = Plan{};
}

}  // namespace esplag::gpu::detail
