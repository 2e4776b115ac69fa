// The fp8 products of a 2:4 layer on the GPU (train.precision fp8, docs/fp8.md): slope and
// semi_sparse (model/cuda/device_linear_semi_sparse_fp8.h) hand their pruned weights to their
// Fp8SparseProducts after every weight change.
//
//   forward  Y  = X · Wfᵀ   cuSPARSELt e4m3 2:4, Wf [out, in] structured (slope: W1)
//   dX       dX = dY · Wb   cuSPARSELt e4m3 2:4 in the forward form dY · (Wbᵀ)ᵀ, Wbᵀ [in, out]
//                           structured (slope: W2ᵀ)
//   dW       dW = dYᵀ · X   cuBLASLt fp8 (gpu::Fp8Gemm), dense, as the dense kind's
//
// Scaling as the CPU's emulation (model/linear_precision.h): per tensor from the current amax
// (X and dY from their amax histories with delayed scaling, model/cuda/fp8_histories.h),
// X and the weights e4m3, dY in train.fp8_grad, which must be e4m3 (cuSPARSELt's fp8
// products take e4m3 operands only). Wf and Wb each have their own scale (the CPU quantises
// W1's and W2ᵀ's kept values separately); X's and dY's amax are taken once per step and
// shared by the products that read them. dY is cast in both orientations in one pass (dX
// takes dY, dW dYᵀ) by the first of backward_dx and backward_dw, into a scratch all such
// layers share; the second takes the codes over. With delayed scaling, once warm, the ops
// that make X and dY may write their codes instead (produced(), as the dense kind's). The 2:4
// products leave both inverse scales, in device memory, to the op that reads their output
// next (forward_leaving_scale, backward_dx_leaving_scale), or apply them in a pass over it
// (apply_pending_scale).
//
// prepare_kept() (slope's kept values and masks) and prepare_transposable() (semi_sparse's Ws)
// cast and compress both copies in our own writer of cuSPARSELt's e4m3 layout
// (sparse/cuda/cusparselt_layout.h), where the loaded library's layout was found to be that
// one (shapes in multiples of 64); otherwise prepare() casts each
// pruned weight (a pass over its bf16 values) into a shared e4m3 scratch and compresses it
// with cusparseLtSpMMACompress. Either way the layer holds two e4m3 copies (5/8 byte per
// weight each).
// Where the 2:4 products do not apply, the same scaled products run dense on Fp8Gemm from
// the pruned weights the caller gives again: a micro-batch of another size than the full
// one, a bias (cuSPARSELt's e4m3 kernels are run without epilogues here), dimensions that
// are not multiples of 32, no cuSPARSELt, or the per-layer dispatch found the dense way
// faster (set_dense: the pass that scales each 2:4 product's bf16 output, and the per-step
// preparation of both copies, can cost more than the 2:4 products save).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <functional>
#include <memory>
#include <set>
#include <string>

#include "core/device_arena.h"
#include "model/cuda/fp8_grad_codes.h"
#include "model/cuda/fp8_histories.h"
#include "model/cuda/fp8_produced_codes.h"
#include "model/device_linear.h"
#include "sparse/cuda/workspace_24.h"

namespace esplag {

namespace gpu {
class SparseGemm24;
}

class Fp8SparseProducts {
 public:
  // Error naming the layer when train.fp8_grad is not e4m3.
  Fp8SparseProducts(DeviceLinearContext& ctx, const std::string& weight_name, int64_t out, int64_t in, bool bias);
  ~Fp8SparseProducts();

  // Whether full-size micro-batches run the 2:4 products.
  bool sparse() const { return fwd_ != nullptr && !dense_; }
  // Whether they could (the shapes fit and cuSPARSELt is there).
  bool can_be_sparse() const { return fwd_ != nullptr; }
  // The dense fp8 products at every size (or the 2:4 ones where they can be): the per-layer
  // dispatch's choice (DeviceSlopeLinear::attach, DeviceSemiSparseFp8Linear's constructor).
  // At once: a switch to the 2:4 products needs a prepare() before the next product, which
  // makes the compressed copies.
  void set_dense(bool dense) { dense_ = dense; }
  // The scales and (sparse()) the compressed e4m3 copies from the current pruned weights:
  // wf [out, in], wbt = Wbᵀ [in, out] (slope's W2ᵀ). Call after every weight change; the
  // pointers may be reused after.
  void prepare(const bf16* wf, const bf16* wbt);
  // The same from slope's stored form (W1's kept values [out, in/2] and its forward and
  // backward mask tile bits, cusparselt24_compress_kept_e4m3): both copies cast and written
  // in cuSPARSELt's e4m3 layout in two reads of the kept values. Returns false, doing
  // nothing, where that does not apply (the dense products, or a layout the loaded library
  // does not share): then prepare() is the way.
  bool prepare_kept(const bf16* values, const uint16_t* forward_tiles, const uint16_t* backward_tiles);
  // Whether prepare_kept and prepare_transposable apply: the 2:4 products run and our writer
  // serves both copies.
  bool writes_own_layout() { return sparse() && own_layout(); }
  // The same from a weight ws [out, in] that is 2:4 along both dimensions (semi_sparse's
  // transposable prune): Wf = ws, Wbᵀ = wsᵀ, one amax and scale for both
  // (cusparselt24_compress_e4m3). Only where writes_own_layout() (else Error).
  void prepare_transposable(const bf16* ws);
  // Both ways of the per-step fp8 work, timed (median of 10 after two untimed rounds that tune
  // the 2:4 products) on scratch inputs with the layer's `prepare` (which must call one of the
  // prepares above) and the pruned weights wf, wbt of the dense products: the 2:4 way
  // prepares both copies and runs the forward and dX 2:4 products; the dense way takes both
  // weights' amax and casts each weight for its dense product. X's and dY's casts are in
  // both. The 2:4 way runs last, so the compressed copies are the weight's afterwards.
  // Synchronises the stream.
  DeviceLinearContext::ProductTimes time_ways(const std::function<void()>& prepare,
                                              const std::function<const bf16*()>& wf,
                                              const std::function<const bf16*()>& wbt, const bf16* bias);
  // y [N, out] = X · Wfᵀ (+ bias). wf: the pruned weight as prepare() had it, read by the
  // dense products only (N other than the full size, or !sparse()).
  void forward(bf16* y, const bf16* x, const bf16* bias, int N, const std::function<const bf16*()>& wf,
               const char* op);
  // out = act(X · Wfᵀ + bias), a GELU as a pass after the product (through pre_act, which
  // keeps its input for the backward, when given).
  void forward(bf16* out, const bf16* x, const bf16* bias, int N, gpu::Gemm::Act act, bf16* pre_act,
               const std::function<const bf16*()>& wf, const char* op);
  // dx [N, in] = dY · Wb; wbt as for prepare(), read by the dense product only.
  void backward_dx(bf16* dx, const bf16* dy, int N, const std::function<const bf16*()>& wbt, const char* op);
  // forward (no activation) and backward_dx for a caller whose next op applies the output's
  // scale (DeviceLinear::forward_leaving_scale): a 2:4 product leaves its output unscaled and
  // returns the scale, the inverse scales of its operands (valid until this layer casts or
  // takes that operand again); the dense products scale their output and return none.
  gpu::PendingScale forward_leaving_scale(bf16* y, const bf16* x, const bf16* bias, int N,
                                          const std::function<const bf16*()>& wf, const char* op);
  gpu::PendingScale backward_dx_leaving_scale(bf16* dx, const bf16* dy, int N,
                                              const std::function<const bf16*()>& wbt, const char* op);
  // dw [out, in] fp32 (= or += when accumulate) = dYᵀ · X.
  void backward_dw(float* dw, const bf16* dy, const bf16* x, int N, bool accumulate, const char* op);
  // `op` names each product for the op timings ("sparse " + op for the 2:4 ones, as the bf16
  // products). Before each backward: dY's codes are made again.
  void begin_backward();
  // X's, Xᵀ's and dY's codes from their producers (delayed scaling, warm: the layer's
  // DeviceLinear::fp8_produced_codes); dY's into the shared scratch's second pair.
  Fp8ProducedCodes& produced() { return produced_; }

  size_t device_bytes() const { return own_.capacity() + workspace_.bytes(); }
  static void shared_parts(std::set<std::string>& used);

 private:
  struct Scratch;
  enum Slot { input, weight_fwd, weight_bwd, grad, slots };
  float* amax(Slot s) const;
  float* inv(Slot s) const;
  Scratch& scratch();
  // dy's codes in both orientations, cast unless the other product of this layer and dy just
  // did, or its producer wrote them.
  Fp8GradCodes::Codes grad_codes(const bf16* dy, int N);
  // Whether our writer of cuSPARSELt's e4m3 layout serves both 2:4 products (asked once).
  bool own_layout();
  // out = the 2:4 product of plan g (forward or dX) of the compressed weight and the codes,
  // unscaled; returns its scale, the inverse scales of their slots.
  gpu::PendingScale sparse_product(gpu::SparseGemm24& g, bool forward, bf16* out, const void* compressed,
                                   const uint8_t* codes, Slot codes_slot, Slot weight_slot, int N, const char* op);

  DeviceLinearContext& ctx_;
  const std::string name_;
  const int64_t out_, in_;
  const bool bias_;
  gpu::SparseGemm24 *fwd_ = nullptr, *bwd_ = nullptr;  // the 2:4 plans (process-wide cache)
  DeviceArena own_;        // scales, compressed copies
  gpu::Workspace24 workspace_;  // the 2:4 products'
  void *comp_fwd_ = nullptr, *comp_bwd_ = nullptr;
  bool tuned_fwd_ = false, tuned_bwd_ = false;
  int own_layout_ = -1;  // prepare_kept's writer serves both copies: -1 not asked yet, 0 no, 1 yes
  bool dense_ = false;
  Fp8OperandAmax x_amax_, dy_amax_;  // X's and dY's scaling (current, or delayed)
  Fp8ProducedCodes produced_;
};

}  // namespace esplag
