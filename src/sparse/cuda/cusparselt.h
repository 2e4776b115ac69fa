// 2:4 sparse GEMMs of a Linear layer through cuSPARSELt (namespace esplag::gpu).
//
// cuSPARSELt is opened at run time (dlopen of libcusparseLt.so.0, or of the file or folder
// named by ESPLAG_CUSPARSELT_LIB), so binaries start without it; callers ask
// cusparselt_available() and fall back to the dense cuBLASLt GEMM (ops/gpu.h), warning once.
//
// The products of a Linear with weight W [out, in] (nn.Linear layout, bf16, row-major),
// tokens N = B·T, all operands bf16, fp32 accumulation:
//   forward         Y [N, out] = X [N, in] · Wᵀ  (+ bias [out], then ReLU)          K = in
//   backward_data  dX [N, in]  = dY [N, out] · W                                     K = out
//   weight_grad    dW [out, in] = S [out, N] · X [N, in]                             K = N
//   activation_forward  Y [N, out] = Xs [N, in] · Wᵀ                                K = in
//   activation_weight_grad  dW [out, in] = dYᵀ [out, N] · Xs [N, in]               K = N
// cuSPARSELt needs the sparse operand 2:4 along K, so the forward needs W 2:4 along its
// rows and the backward-data product needs W 2:4 along its columns. prune() uses the 4×4
// tile mode, whose masks keep exactly 2 values in every row and every column of each
// tile: one pruned W then serves both products. Each product has its own compressed copy
// of W (compress(); the layouts differ), made from the same dense pruned W with no
// transpose kernel: the descriptors read W [out, in] as it lies in memory.
// weight_grad's structured operand is not W but S, a 2:4 estimate of dYᵀ along the tokens
// (SparseLinear's sparse_dw: the MVUE of dYᵀ, compressed by cusparselt_layout.h's fused
// kernel straight from dY [N, out]); its output dW [out, in] is bf16 like every output
// here (cuSPARSELt's bf16 inputs give bf16 outputs), to be widened by the caller.
// activation_forward is semi_sparse_activation's forward (sparse/cuda/sparse_activation_linear.h):
// its structured operand is the input Xs [N, in], pruned 2:4 along the features at every
// call, and W is the dense operand. activation_weight_grad is that kind's weight gradient
// where Xs is 2:4 along the tokens as well (the tile_24 pattern): its structured operand is
// Xsᵀ [in, N], dY the dense one, and dW comes out in bf16 like every output here.
//
// Layouts (cuSPARSELt computes D[m,n] = op(A)[m,k] · op(B)[k,n]; see cusparselt.cu):
//   weight as A (default): the output is described column-major [m = features, n = N],
//     which is the row-major [N, features] the model uses; the bias then runs along m,
//     one value per output feature, which is what the BIAS epilogue adds.
//   weight as B: the output is row-major [N, features] directly, but the bias epilogue
//     would add one value per token, so bias is refused in this layout. cuSPARSELt 0.8.0
//     also refuses the layout itself (INVALID_VALUE at descriptor init) at LLM sizes
//     (4096×4096×8192 and up, measured on an H100); it is kept for comparison.
//   weight_grad (structured operand A only): S row-major [out, N] with op N, X row-major
//     [N, in] with op N, dW row-major [out, in]; no bias, no activation.
//   activation_forward (structured operand A only): Xs row-major [N, in] with op N, W
//     [out, in] described column-major [in, out] with op N, Y row-major [N, out]; no bias
//     (the epilogue's bias runs along the rows of D, here the tokens), no activation.
//   activation_weight_grad (structured operand A only): Xsᵀ row-major [in, N] with op N,
//     dY row-major [N, out] with op N, D column-major [in, out] (= dW row-major [out, in]).
//
// Sizes: out, in and N must be multiples of 16 (cuSPARSELt's rule for 16-bit operands:
// rows, columns and leading dimensions); anything else throws esplag::Error naming the
// dimension. Pointers must be 16-byte aligned.
//
// Plans: one SparseGemm24 per problem (product, shape, operand, epilogue), built once and
// kept in a process-wide cache (SparseGemm24::get). With tuning on, the first tune() of a
// problem runs cusparseLtMatmulSearch once and records the chosen configuration
// (algorithm id, split-k, split-k mode, split-k buffers) in a JSON tuning cache keyed by
// GPU name, cuSPARSELt version and problem; later processes read it instead of searching.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "sparse/cuda/cusparselt.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "sparse/cuda/cusparselt_tuning_cache.h"

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------------------------------
// The library

// True when libcusparseLt was found, every entry point used here resolved, and a handle
// could be created on the current device. Decided once per process (thread-safe).
bool cusparselt_available();
// Why it is not available (empty when it is): the library paths tried and dlerror(), a
// missing entry point, a failed cusparseLtInit, or a build without cusparseLt.h.
std::string cusparselt_unavailable_reason();
// The loaded library's version as major·1000 + minor·100 + patch (800 for 0.8.0); 0 when
// not available.
int cusparselt_version();
// For callers that fall back to dense GEMMs: prints "esplag: warning: <who> runs dense
// GEMMs: <why>" to stderr the first time a given `who` is passed, nothing afterwards. An
// empty `why` means cuSPARSELt is not available and prints its reason.
void warn_cusparselt_fallback_once(std::string_view who, std::string_view why = {});

// ---------------------------------------------------------------------------------------
// Problems

enum class SparseProduct : uint8_t { forward, backward_data, weight_grad, activation_forward, activation_weight_grad };
// The cuSPARSELt operand that holds the structured (2:4) matrix: W for forward and
// backward_data, S (the 2:4 estimate of dYᵀ) for weight_grad, the pruned input Xs for
// activation_forward and its transpose for activation_weight_grad, which take A only.
enum class SparseOperand : uint8_t { a, b };
enum class SparseActivation : uint8_t { none, relu, gelu };
// The element type of both input operands (the output is bf16 either way, accumulation
// fp32). e4m3 (fp8, 1 byte) runs the forward product with W as A only, without bias or
// activation, every dimension a multiple of 32: the product of a 2:4 weight whose values
// and inputs were quantised to fp8. fp8 training (semi_sparse and slope with
// train.precision fp8) runs its forward and its input gradient on it, the latter as the
// forward-form product dY · (Wᵀ)ᵀ with Wᵀ [in, out] as the structured operand, both scaled
// by the operands' inverse scales from device memory (SparseGemm24Problem::device_scale).
enum class SparseDtype : uint8_t { bf16, e4m3 };
const char* sparse_dtype_name(SparseDtype d);  // "bf16", "e4m3"

struct SparseGemm24Problem {
  SparseProduct product = SparseProduct::forward;
  int64_t out = 0, in = 0, tokens = 0;  // W [out, in], N = tokens
  SparseOperand weight_operand = SparseOperand::a;
  bool bias = false;                                   // forward, weight as A only; bf16 [out]
  SparseActivation activation = SparseActivation::none;  // forward only; after the bias
  SparseDtype dtype = SparseDtype::bf16;                 // of the input operands
  // e4m3 only: the product is multiplied by two scales read from device memory at every call
  // (matmul_scaled): fp8 training's inverse scales, without waiting for the host.
  bool device_scale = false;

  static SparseGemm24Problem linear_forward(int64_t out, int64_t in, int64_t tokens, bool bias = false,
                                            SparseActivation act = SparseActivation::none,
                                            SparseOperand op = SparseOperand::a);
  static SparseGemm24Problem linear_backward_data(int64_t out, int64_t in, int64_t tokens,
                                                  SparseOperand op = SparseOperand::a);
  // dW [out, in] = S [out, tokens] · X [tokens, in], S structured (operand A, op N).
  static SparseGemm24Problem linear_weight_grad(int64_t out, int64_t in, int64_t tokens);
  // Y [tokens, out] = Xs [tokens, in] · Wᵀ, Xs structured (operand A, op N), W dense.
  static SparseGemm24Problem linear_activation_forward(int64_t out, int64_t in, int64_t tokens);
  // dW [out, in] = dYᵀ [out, tokens] · Xs [tokens, in], Xsᵀ [in, tokens] structured (A, op N).
  static SparseGemm24Problem linear_activation_weight_grad(int64_t out, int64_t in, int64_t tokens);

  // Stable text naming every field (the key of both caches), e.g.
  // "fwd out=4096 in=4096 tokens=8192 w=A bias=1 act=gelu bf16",
  // "dw out=4096 in=4096 tokens=8192 w=A bias=0 act=none bf16" (w: the structured operand),
  // "xfwd out=4096 in=4096 tokens=8192 w=A bias=0 act=none bf16" (and "xdw ..."),
  // "fwd out=4096 in=4096 tokens=8192 w=A bias=0 act=none e4m3",
  // "fwd out=4096 in=4096 tokens=8192 w=A bias=0 act=none e4m3 alpha=vector".
  std::string key() const;
  // The reduction dimension K of the product.
  bool reduces_tokens() const {
    return product == SparseProduct::weight_grad || product == SparseProduct::activation_weight_grad;
  }
  int64_t k() const { return product == SparseProduct::backward_data ? out : reduces_tokens() ? tokens : in; }
  // The structured operand as the logical row-major matrix cuSPARSELt compresses (rows ×
  // cols): W [out, in] for forward and backward_data (whatever op applies to it), S
  // [out, tokens] for weight_grad, Xs [tokens, in] for activation_forward, Xsᵀ [in, tokens]
  // for activation_weight_grad.
  int64_t structured_rows() const {
    return product == SparseProduct::activation_forward       ? tokens
           : product == SparseProduct::activation_weight_grad ? in
                                                              : out;
  }
  int64_t structured_cols() const { return reduces_tokens() ? tokens : in; }
  double flops() const { return 2.0 * double(out) * double(in) * double(tokens); }
  size_t element_bytes() const { return dtype == SparseDtype::e4m3 ? 1 : 2; }  // of the inputs

  friend bool operator==(const SparseGemm24Problem&, const SparseGemm24Problem&) = default;
};

// Whether cuSPARSELt fuses this activation for bf16 operands (ReLU: yes; GELU: cuSPARSELt
// 0.8 refuses it). Decided once per activation by building a 16×16×16 plan; false when
// cuSPARSELt is not available. A SparseGemm24 with an unsupported activation throws.
bool sparse_gemm24_activation_supported(SparseActivation act);

// Throws esplag::Error saying which rule a problem breaks (sizes not positive or not
// multiples of 16, a matrix over 2^31 - 1 elements, bias or activation on any product but
// the forward, bias with W as B, any product but forward and backward_data with the
// structured operand as B).
void check_sparse_gemm24_problem(const SparseGemm24Problem& p);

// ---------------------------------------------------------------------------------------
// One problem's plan

class SparseGemm24 {
 public:
  enum class Algorithm {
    tuned,         // the tuning cache's configuration for this problem if there is one,
                   // else cuSPARSELt's default (tune() may then search)
    library_default  // always cuSPARSELt's default configuration; tune() does nothing
  };

  // The process-wide cached object of `p` (tuned), built on first use. Thread-safe; the
  // reference stays valid until clear_sparse_gemm24_cache().
  static SparseGemm24& get(const SparseGemm24Problem& p);

  // A new object outside the cache (benchmarks compare the default and the searched
  // configuration side by side). Throws Error if cuSPARSELt is not available or rejects
  // the problem (with its status and the problem).
  explicit SparseGemm24(const SparseGemm24Problem& p, Algorithm alg = Algorithm::tuned);
  ~SparseGemm24();
  SparseGemm24(const SparseGemm24&) = delete;
  SparseGemm24& operator=(const SparseGemm24&) = delete;

  const SparseGemm24Problem& problem() const;

  // Device bytes of the compressed structured operand, of the scratch compress() needs,
  // and of the workspace matmul() needs with the current configuration (may change after
  // tune()).
  size_t compressed_bytes() const;
  // What to allocate for the compressed operand: compressed_bytes() and a slack, because
  // cuSPARSELt 0.8's sm90 kernels read up to one bulk copy (seen: 1 KiB) past the size the
  // library reports (compute-sanitizer memcheck, during cusparseLtMatmulSearch).
  size_t compressed_allocation_bytes() const { return compressed_bytes() + kCompressedReadSlack; }
  static constexpr size_t kCompressedReadSlack = 4096;
  size_t compress_scratch_bytes() const;
  size_t workspace_bytes() const;

  // prune / is_pruned / compress work on the structured operand as it lies in memory:
  // W [out, in] for forward and backward_data, S [out, tokens] for weight_grad, Xs
  // [tokens, in] for activation_forward, Xsᵀ [in, tokens] for activation_weight_grad
  // (problem().structured_rows() × structured_cols(), row-major).
  // pruned = the operand with 2 of every 4 values zeroed along this product's K, by the
  // 4×4 tile rule (2 kept per row and per column of each tile, largest magnitude), so the
  // result is 2:4 along both dimensions. pruned may equal dense (in place).
  void prune(void* pruned, const void* dense, cudaStream_t stream) const;
  // Whether the operand is 2:4 along this product's K. Synchronises the stream.
  bool is_pruned(const void* w, cudaStream_t stream) const;
  // compressed (compressed_bytes()) = the compressed form of a pruned operand. Throws Error
  // when scratch_bytes < compress_scratch_bytes(). It must already be 2:4 (is_pruned).
  void compress(void* compressed, const void* pruned, void* scratch, size_t scratch_bytes,
                cudaStream_t stream) const;

  // forward:        out = Y [N, out],  dense = X [N, in],   bias bf16 [out] when the
  //                 problem has one (null otherwise; cuSPARSELt reads the bias in the
  //                 output's type, bf16);
  // backward_data:  out = dX [N, in],  dense = dY [N, out], bias null;
  // weight_grad:    out = dW [out, in] (bf16), dense = X [N, in], bias null;
  // activation_forward: out = Y [N, out], dense = W [out, in], bias null;
  // activation_weight_grad: out = dW [out, in] (bf16), dense = dY [N, out], bias null.
  // The structured and dense operands are of the problem's dtype (bf16 or e4m3), `out`
  // and the bias bf16. `out` is overwritten (never read). Throws Error when workspace_bytes <
  // workspace_bytes(). A plan is kept per bias pointer (see cusparselt.cu), so each
  // layer's bias costs one plan initialisation, once.
  void matmul(bf16* out, const void* compressed, const void* dense, const bf16* bias, void* workspace,
              size_t workspace_bytes, cudaStream_t stream) const;
  // The same for a problem with device_scale: out = (*scale_a · *scale_b) · (the product),
  // the scales two fp32 in device memory (fp8 training's inverse scales of the two operands),
  // read when the product runs: the product is rounded to bf16, then scaled by a pass over
  // the output and rounded again. cuSPARSELt 0.8.0 on an
  // H100 refuses its alpha vector for e4m3, and takes a scalar scale of A
  // (CUSPARSELT_MATMUL_A_SCALE_POINTER, SCALAR_32F) without applying it (the output came
  // back unscaled), so neither is used. matmul() and search() on such a problem do not scale:
  // matmul() leaves the scaling to an op that reads `out` (gpu::PendingScale{scale_a, scale_b}).
  void matmul_scaled(bf16* out, const void* compressed, const void* dense, const float* scale_a,
                     const float* scale_b, void* workspace, size_t workspace_bytes, cudaStream_t stream) const;

  // Runs cusparseLtMatmulSearch on these operands (it overwrites `out`), adopts the
  // configuration it finds and records it in the tuning cache (written to disk at once).
  // Synchronises the stream. Re-query workspace_bytes() afterwards.
  void search(bf16* out, const void* compressed, const void* dense, const bf16* bias, void* workspace,
              size_t workspace_bytes, cudaStream_t stream);
  // search() when tuning is on, the algorithm is `tuned` and the problem is not tuned yet
  // (by an earlier search or by the tuning cache); otherwise nothing. Returns whether it searched.
  bool tune(bf16* out, const void* compressed, const void* dense, const bf16* bias, void* workspace,
            size_t workspace_bytes, cudaStream_t stream);

  bool tuned() const;                 // configuration from a search or from the tuning cache
  bool from_tuning_cache() const;     // ... from the tuning cache
  SparseGemm24Config config() const;  // the configuration in use
  int max_alg_id() const;             // CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID of the problem
  double plan_build_ms() const;       // host time of descriptors + first plan (construction)
  double search_ms() const;           // host time of the last search (0 if none)
  size_t plans() const;               // plans held now (one per bias pointer seen)

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// dst (fp32) = or += (accumulate) the bf16 output of a product, n values (a weight
// gradient widened for the optimizer: one pass, both arrays read and written in order).
// Asynchronous on `stream`.
void widen_sparse_output(float* dst, const bf16* src, int64_t n, bool accumulate, cudaStream_t stream);

// Drops every cached SparseGemm24 (references from get() become invalid).
void clear_sparse_gemm24_cache();
size_t sparse_gemm24_cached_plans();

// ---------------------------------------------------------------------------------------
// Tuning cache (its file, path and switch: sparse/cuda/cusparselt_tuning_cache.h)

// The stored configuration of `p` for the current GPU and library, if any.
bool cusparselt_tuning_lookup(const SparseGemm24Problem& p, SparseGemm24Config* config);

}  // namespace esplag::gpu
