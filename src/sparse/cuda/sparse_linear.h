// One Linear layer's training step on the GPU with explicit forward and backward, for the
// kinds whose 2:4 GEMMs run through cuSPARSELt (sparse/cuda/cusparselt.h). The CPU
// references are model/linear_semi_sparse.h and model/linear_slope.h.
//
// The layer reads the caller's weight W [out, in] (bf16, row-major, device memory; the
// copy the caller's optimizer rewrites after each step) and computes, over N = tokens rows:
//   forward   Y [N, out] = X [N, in] · Weffᵀ
//   backward  dX [N, in] = dY [N, out] · Wbwd        dW [out, in] (fp32) = dYᵀ · X (dense;
//                                                    with sparse_dw, MVUE(dYᵀ) · X: below)
//
//   dense        Weff = Wbwd = W (cuBLASLt, gpu::Gemm).
//   semi_sparse  per step: the transposable greedy 2:4 of the current W (gpu::transposable_24,
//                one pass), Ws, 2:4 along rows and along columns; Ws compressed twice
//                (the forward's and the input-gradient product's cuSPARSELt layouts);
//                Weff = Wbwd = Ws; dW straight through (dense, unmasked).
//   slope        the row-wise 2:4 mask of W is taken once, at construction (the static
//                forward mask of SLoPe). Per step: W1 = W ⊙ mask; the double pruning of W1
//                (gpu::double_prune_24) gives W2ᵀ, W1 pruned again 2:4 down every column;
//                W1 compressed for the forward, W2ᵀ for the input gradient, which is then
//                the forward-form product dY · (W2ᵀ)ᵀ; Weff = W1, Wbwd = W2; dW dense (the
//                optimizer keeps what it needs of it). prepare(s, true) chooses the backward
//                mask again from the current W1 (the CPU reference's refresh);
//                prepare(s, false) keeps the last one and only refills W2's values from W1
//                (the CPU's steps between refreshes, mask_change_freq > 1).
//
// slope's prepare() with cuSPARSELt's layout checked for both products: W1's layout, and
// the transposed layout of W2 = W1 ⊙ backward mask (which is W2ᵀ's), by the one-pass
// writer; a refresh first runs double_prune_24 for the mask alone.
//
// prepare() does the per-step weight work (nothing for dense): call it after every
// optimizer step and before the next forward; the benchmark counts it in the step's time.
// The compressed copies are written by sparse/cuda/cusparselt_layout.h's one-pass writer
// (semi_sparse: both copies from one read of Ws) wherever its layout was checked equal to
// cusparseLtSpMMACompress's for the layer's problem (once per problem and process, at
// construction, which then synchronises the device); elsewhere, and when
// $ESPLAG_CUSPARSELT_OWN_LAYOUT=0, cusparseLtSpMMACompress itself. With the own layout,
// semi_sparse's input gradient is the forward-form product dY · (Wsᵀ)ᵀ, as slope's (the
// writer produces Wsᵀ's buffer from Ws without a transpose); without it, backward_data.
//
// Without cuSPARSELt (cusparselt_available() false) the sparse kinds run the dense
// products of the unpruned W, after one warning on stderr (warn_cusparselt_fallback_once);
// sparse() then says false.
//
// Sizes: the sparse kinds need out, in and tokens to be multiples of 16 (cuSPARSELt), the
// dense one positive sizes that fit the dense GEMM's int arguments; anything else throws
// esplag::Error naming the layer's shape. tokens is fixed at construction (the cuSPARSELt
// plans are per problem). Every device buffer is allocated at construction, except that the
// first forward and the first backward tune their cuSPARSELt product
// (SparseGemm24::tune: a search, once per problem and process, or the tuning cache's
// entry) and may then enlarge the workspace once. All calls are asynchronous on the given
// stream apart from that first tuning, which synchronises. The layer holds references
// to the process-wide cached plans (SparseGemm24::get), so clear_sparse_gemm24_cache()
// must not be called while a sparse SparseLinear exists.
//
// sparse_dw (off by default; semi_sparse and slope): the weight gradient as a 2:4 product.
// dW = dYᵀ · X reduces over the tokens, so its structured operand is S = MVUE(dYᵀ)
// [out, N], the minimum-variance unbiased 2:4 estimate of dYᵀ along the tokens (groups of
// 4 consecutive tokens of one output feature; sparse/mvue.h), as cuSPARSELt's operand A
// with op N (SparseProduct::weight_grad). E[S] = dYᵀ, so E[dW] is the dense dW; each draw
// adds variance instead of bias. Per backward that computes dW:
//   1. cusparselt24_compress_mvue_t (cusparselt_layout.h): one read of dY [N, out] in
//      64×64 tiles, the MVUE per group, and S's compressed buffer written directly (no
//      transposed dY, no dense S, no cusparseLtSpMMACompress);
//   2. the 2:4 product dW_bf16 [out, in] = S · X, X read as it lies (no transposed copy);
//   3. dW (fp32) = or += the bf16 result, one pass.
// Costs: device memory for S's buffer (out·N·9/8 bytes) and the bf16 dW (2 bytes per
// weight), allocated at construction or taken from SparseLinearOptions::dw_scratch (the
// cuSPARSELt workspace is shared with the other products); per step, one read of dY and a write of S's buffer (9/16 of dY's bytes), and
// a bf16 read plus an fp32 write (and read, when accumulating) of dW beyond the product.
// dW is rounded to bf16 once before it is widened (the dense path accumulates in fp32
// straight into dW), a small error next to the estimate's own spread.
// The seed: the k-th backward of the layer that computes a sparse dW (k = 0, 1, ...) uses
// sparse_dw_mvue_seed(dw_seed, k); SparseLinearOptions::dw_seed sets the base and
// set_dw_seed() sets it again and the next k (0 unless given: a resumed run's count), so a run is reproducible from the base
// seeds and the number of steps. k lives in device memory and is advanced by a one-thread
// kernel ahead of the MVUE kernel, which reads its seed there: a CUDA graph that captures
// backward() takes a new draw at every replay. The base seed is a kernel argument, so a
// graph keeps the base it was captured with (capture again after set_dw_seed()).
// Rules: the 2:4 kinds only (the dense kind refuses it), out and tokens multiples of 64
// (the fused kernel's tile), and, with cuSPARSELt, the compressed layout of the
// weight_grad problem checked equal to the library's at construction
// (cusparselt24_layout_matches; with $ESPLAG_CUSPARSELT_OWN_LAYOUT=0 the check fails, as
// nothing else can compress S); anything else throws Error naming the layer and the rule.
// Without cuSPARSELt the layer runs all its products dense (dW the exact dYᵀ · X) after
// the usual warning, and sparse_dw() says false.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "sparse/cuda/sparse_linear.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

enum class SparseLinearKind : uint8_t { dense, semi_sparse, slope };
std::string sparse_linear_kind_name(SparseLinearKind k);  // "dense", "semi_sparse", "slope"
// Throws Error naming the accepted kinds.
SparseLinearKind parse_sparse_linear_kind(const std::string& name);

// The MVUE seed of a layer's `draw`-th sparse dW (0-based) from its base seed: splitmix64's
// finaliser of (finaliser(base) + draw), so consecutive draws and layers with different
// bases get unrelated uniforms (sparse/mvue.h mixes the seed with each group's index).
uint64_t sparse_dw_mvue_seed(uint64_t base, uint64_t draw);

// Bytes of the buffers a sparse_dw layer of this shape needs for one backward (S's
// compressed buffer and the bf16 dW), for SparseLinearOptions::dw_scratch; 0 where
// sparse_dw does not apply (out or tokens not multiples of 64).
size_t sparse_dw_scratch_bytes(int64_t out, int64_t in, int64_t tokens);

struct SparseLinearOptions {
  SparseLinearKind kind = SparseLinearKind::dense;
  // dW as the 2:4 product of the MVUE of dYᵀ (see above); the 2:4 kinds only.
  bool sparse_dw = false;
  uint64_t dw_seed = 0;  // sparse_dw: the base seed of the layer's MVUE draws
  // sparse_dw: sparse_dw_scratch_bytes(out, in, tokens) bytes of device memory (256-byte
  // aligned), owned by the caller, for the buffers only backward() uses: layers whose calls
  // run in one stream order may share one. Null: the layer allocates its own.
  void* dw_scratch = nullptr;
  // The forward adds a bias [out] (bf16): cuSPARSELt's bias epilogue on the 2:4 product
  // (one plan per bias address), cuBLASLt's on the dense one.
  bool bias = false;
  // semi_sparse: false lets prepare() skip the pruned dense Ws where the one-pass
  // preparation runs (cuSPARSELt's layout checked for both products): a third less
  // traffic and no Ws buffer (2 bytes per weight). pruned_weight() is then null, except
  // with use_dense_products, which needs Ws and allocates it.
  bool keep_pruned = true;
  // slope: 2·out·in bf16 of device memory, owned by the caller, for W1 / W2 and W2ᵀ
  // (pruned_weight(), backward_weight_t()), which only prepare() and
  // refill_backward_weight_t() need: layers whose calls run in one stream order may
  // share one scratch (a model's slope layers hold no dense copies then). Null: the
  // layer allocates its own.
  bf16* slope_scratch = nullptr;
  // slope: the caller keeps the weight at W1 (zero wherever the forward mask prunes, as
  // GpuTransformer's slope layers are), so prepare() reads it as W1 instead of applying
  // the mask first. A weight that is not gives wrong products.
  bool slope_weight_is_w1 = false;
};

class SparseLinear {
 public:
  // weight: device bf16 [out, in], owned by the caller, read by every prepare() (and by
  // every product for the dense kind and the fallback). slope reads it here for its mask,
  // on `stream`. Throws Error for shapes the kind cannot run.
  SparseLinear(const SparseLinearOptions& options, int64_t out, int64_t in, int64_t tokens, const bf16* weight,
               cudaStream_t stream);
  ~SparseLinear();
  SparseLinear(const SparseLinear&) = delete;
  SparseLinear& operator=(const SparseLinear&) = delete;

  SparseLinearKind kind() const;
  bool sparse() const;  // 2:4 products (false for dense and for the fallback)
  int64_t out_features() const;
  int64_t in_features() const;
  int64_t tokens() const;

  // Points the layer at another copy of its weight (same shape and alignment rules), for a
  // caller that moves its weights; the next prepare() reads it. Masks already taken stay.
  void set_weight(const bf16* weight);

  // The per-step weight preparation from the current weight (see above);
  // refresh_backward_mask matters to slope only.
  void prepare(cudaStream_t stream, bool refresh_backward_mask = true);

  // slope: prepare(stream, false) from W1's kept values [out, in/2] (bf16, 4-byte aligned,
  // sparse/cuda/kept_values.h's order: the form GpuTransformer stores a slope weight in)
  // instead of the dense weight: both compressed copies in one pass over the kept values
  // and the masks (cusparselt24_compress_kept). Only where our writer serves both products
  // (own_layout_forward() and own_layout_backward()); returns false and does nothing
  // elsewhere (the caller then runs prepare() on the dense W1).
  bool prepare_from_kept(const bf16* kept_values, cudaStream_t stream);

  // Per-layer dispatch (semi_sparse with cuSPARSELt only, else Error): with dense products
  // on, prepare() only prunes (Ws, one pass) and the forward and input-gradient products
  // multiply Ws on cuBLASLt: the same function, for shapes where the 2:4 products and
  // their compression cost more than they save. sparse_products(): the 2:4 products run.
  void use_dense_products(bool on);
  bool sparse_products() const;
  // Both ways timed on this layer's shape (median of `iters` of prepare + forward +
  // input gradient after two untimed rounds that tune the products), on scratch inputs
  // allocated for the call; the layer's mode is kept and its buffers are prepared again
  // from its weight. Synchronises the stream.
  struct ProductTimes {
    double sparse_ms = 0, dense_ms = 0;
  };
  ProductTimes time_products(cudaStream_t stream, int iters = 10);
  // y [tokens, out] (overwritten) = x [tokens, in] · Weffᵀ (+ bias, which must be given
  // exactly when the options ask for one).
  void forward(bf16* y, const bf16* x, cudaStream_t stream, const bf16* bias = nullptr);
  // dx [tokens, in] (overwritten; may be null) = dy · Wbwd;
  // dw [out, in] fp32 (= or += when accumulate_dw; may be null) = dyᵀ · x, or with
  // sparse_dw() its unbiased estimate MVUE(dyᵀ) · x (one draw per call that computes dw;
  // dy then 16-byte aligned).
  void backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, bool accumulate_dw, cudaStream_t stream);

  // Whether backward's dW is the 2:4 product of the MVUE of dYᵀ (sparse_dw with
  // cuSPARSELt; false for the dense fallback).
  bool sparse_dw() const;
  // Sets the base seed of the MVUE draws and the draw count: the next sparse dW uses
  // sparse_dw_mvue_seed(seed, draws). The draws made so far: dw_draws(). Both synchronise
  // the device (the count lives there).
  void set_dw_seed(uint64_t seed, uint64_t draws = 0);
  uint64_t dw_draws() const;

  // What the last prepare() produced (device pointers, null when the kind has none):
  // Weff pruned dense [out, in] (semi_sparse: Ws; slope: W2, the weight pruned by both
  // masks), W2ᵀ pruned dense [in, out] (slope; written by prepare() only where
  // cuSPARSELt's own compression needs it, and by refill_backward_weight_t), and slope's
  // masks as 4×4 tile bits ([out/4, in/4] uint16, bit 4·r + c = element (r, c) of the
  // tile, 1 = kept, sparse/masks.h's tile_bits): the static forward mask (W1's) and the
  // backward one (W2's, in W's orientation).
  const bf16* pruned_weight() const;
  const bf16* backward_weight_t() const;
  const uint16_t* forward_tile_mask() const;
  const uint16_t* backward_tile_mask() const;
  // slope with cuSPARSELt (else Error): replaces both masks (host or device arrays of
  // [out/4, in/4] tile bits; the backward mask must lie inside the forward one, with at
  // most 2 kept of every 4 down each column) and waits for the copies; the next prepare(s,
  // false) uses them. For a run that continues masks chosen elsewhere (a checkpoint).
  void set_tile_masks(const uint16_t* forward, const uint16_t* backward, cudaStream_t stream);
  // slope with cuSPARSELt (else Error): W2ᵀ [in, out] dense from the current weight and
  // the kept masks, without compressing it (what prepare(s, false) multiplies), for a
  // dense input-gradient product at another token count. Returns backward_weight_t().
  const bf16* refill_backward_weight_t(cudaStream_t stream);
  // Whether prepare() writes the forward's / the input gradient's compressed weight itself
  // (cusparselt_layout.h) rather than through cusparseLtSpMMACompress.
  bool own_layout_forward() const;
  bool own_layout_backward() const;
  // Device bytes the layer holds (its buffers and its GEMM workspace).
  size_t device_bytes() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace esplag::gpu
