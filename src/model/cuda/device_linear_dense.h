// dense on the GPU: cuBLASLt's products of W with their epilogues (bias, GELU and its
// gradient, the bias gradient), in bf16 or fp8 (GpuModelOptions::precision). The base of
// masked and vnm.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include "core/device_arena.h"
#include "model/cuda/fp8_grad_codes.h"
#include "model/cuda/fp8_histories.h"
#include "model/cuda/fp8_produced_codes.h"
#include "model/device_linear.h"

namespace esplag {

class DeviceDenseLinear : public DeviceLinear {
 public:
  explicit DeviceDenseLinear(const DeviceLinearSetup& s, const std::string& kind = "dense");
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override;
  void backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) override;
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  void shared_parts(std::set<std::string>& used) const override;
  // fp8: the weight's codes, cast once per weight change (see below).
  bool prepares() const override { return fp8_; }
  void prepare(bool refresh) override;
  void bind(const DeviceLinearParams& p) override;
  // fp8: the weight cast's amax from AdamW instead of a pass over the weight.
  bool takes_weight_amax() const override { return fp8_; }
  void weight_amax_taken(const float* amax) override { weight_amax_ = amax; }
  size_t device_bytes() const override { return fp8_own_.capacity(); }
  void begin_backward() override;
  // Device bytes of the scratch the fp8 products share (GpuModelOptions::precision), for
  // block Linear shapes [out, in] and micro-batches of `tokens` rows.
  // `swiglu_grad_codes`: with the second pair of dY codes that SwiGLU's backward writes
  // (DeviceLinearContext::swiglu_grad_codes, Fp8GradCodes::made).
  static size_t fp8_scratch_bytes(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t tokens,
                                  bool swiglu_grad_codes);
  // Device bytes an fp8 layer [out, in] holds itself (device_bytes): its weight's codes in
  // both orientations and its scales.
  static size_t fp8_layer_bytes(int64_t out, int64_t in);

 protected:
  // fp8: X's, Xᵀ's and dY's codes from their producers (delayed scaling, warm); dY's into
  // the shared scratch's second pair.
  Fp8ProducedCodes* fp8_produced_codes() override { return fp8_ ? &produced_ : nullptr; }

 private:
  // The fp8 products (GpuModelOptions::precision), cuBLASLt's fp8 GEMMs, which take their
  // operands K-major, so the backward's need transposed copies:
  // - W: its amax (AdamW's, weight_amax_taken, after a step) and one pass writing W [out,
  //   in] (forward) and Wᵀ [in, out] (dX) into the layer's own codes, at every prepare()
  //   (after each optimizer step and weight change), not per micro-batch;
  // - X: amax and cast in the forward, into a scratch all fp8 layers share; its transposed
  //   cast in dW with the forward's amax (the saved input is unchanged until then);
  // - dY: amax and one pass writing dY (dX) and dYᵀ (dW) into the shared scratch, by the
  //   first of backward_dx and backward_dw for it; the second takes them over.
  // With delayed scaling X's and dY's casts scale by their histories and record their
  // amaxes (x_amax_, dy_amax_): no amax pass.
  struct Fp8Scratch;
  Fp8Scratch& fp8_scratch();
  // This layer's amax and inverse scale of X, W and dY (Fp8Scratch::Role), 256 bytes apart.
  float* fp8_amax(int role) const;
  float* fp8_inv(int role) const;
  // The weight's codes (w8_, wt8_) from the bound weight.
  void cast_weight();
  // dout's codes in both orientations, cast unless the other product of this layer and
  // dout just did, or its producer wrote them.
  Fp8GradCodes::Codes grad_codes(const bf16* dout, int N);
  bool fp8_ = false;
  DeviceArena fp8_own_;                     // the scales, w8_ and wt8_
  uint8_t *w8_ = nullptr, *wt8_ = nullptr;  // W [out, in] and Wᵀ [in, out], e4m3
  bool w8_current_ = false;                 // they hold the bound weight's codes (prepare() since the last bind)
  const float* weight_amax_ = nullptr;      // the bound weight's amax, taken by AdamW (null: none since the cast)
  Fp8OperandAmax x_amax_, dy_amax_;
  Fp8ProducedCodes produced_;  // with delayed scaling
};

}  // namespace esplag
