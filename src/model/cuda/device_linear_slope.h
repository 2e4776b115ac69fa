// slope on the GPU (model/linear_slope.h's SLoPe): the forward mask is the row-wise 2:4 of W
// when the layer becomes slope (or the masks given: LinearKindSetting::slope_masks, or those
// of the slope layer it replaces), and never changes; the weight is W1 = W ⊙ that mask,
// stored as its kept values only ([out, in/2]: master, gradient and moments take half the
// memory; sparse/cuda/kept_values.h), so the gradient norm and AdamW over the stored state
// are the CPU's sparse AdamW over "<weight>.values". The forward is the 2:4 GEMM of W1, dX the
// 2:4 GEMM of W2 = W1 pruned again 2:4 down each column (the backward mask, chosen again from
// W1 every mask_change_freq steps as SlopeLinear::on_step_begin does; <= 0: never); dW is the
// dense GEMM into a scratch (or sparse_dw's 2:4 product), whose kept positions are gathered
// into the stored gradient. After each AdamW step both compressed copies are written from
// the kept values in one pass (W1 is expanded into a dense scratch for a refresh, for a
// product at another micro-batch size or where dispatch chose cuBLASLt, which run the dense
// products of W1 and of W2, and where cuSPARSELt's layout is not our writer's). All slope
// layers share one scratch of 10 bytes per weight of the largest (W1 expanded, W2 and W2ᵀ,
// the fp32 dW). With train.precision fp8 the three products are Fp8SparseProducts'
// (model/cuda/device_linear_fp8_sparse.h) on W1 and W2ᵀ, expanded at every prepare (no bf16
// compression but at a refresh, no per-layer dispatch, no sparse_dw).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <memory>

#include "model/cuda/device_linear_fp8_sparse.h"
#include "model/device_linear.h"
#include "sparse/cuda/sparse_linear.h"

namespace esplag {

class DeviceSlopeLinear : public DeviceLinear {
 public:
  explicit DeviceSlopeLinear(const DeviceLinearSetup& s);
  ~DeviceSlopeLinear() override;
  // The masks and schedule (GpuTransformer::slope_state; waits for the device).
  GpuTransformer::SlopeState state() const;

  Shape stored_weight_shape() const override { return {out_, in_ / 2}; }
  int64_t stored_row_group() const override { return 4; }
  void weight_to_stored(float* stored, const float* dense, int64_t row0, int64_t rows) const override;
  void weight_from_stored(float* dense, const float* stored, int64_t row0, int64_t rows) const override;
  size_t device_bytes() const override { return sp_->device_bytes() + (fp8_ ? fp8_->device_bytes() : 0); }
  void shared_parts(std::set<std::string>& used) const override;
  bool prepares() const override { return true; }
  bool refresh_due(int64_t step) const override {
    return mask_change_freq_ > 0 && step - refresh_step_ >= mask_change_freq_;
  }
  void prepare(bool refresh) override;
  void masks_refreshed(int64_t step) override { refresh_step_ = step; }
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override;
  void backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) override;
  gpu::PendingScale forward_leaving_scale(bf16* out, const bf16* in, int N, const char* op) override;
  gpu::PendingScale backward_dx_leaving_scale(bf16* dinp, const bf16* dout, int N, const char* op) override;
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  void begin_backward() override {
    if (fp8_) fp8_->begin_backward();
  }
  void update(const Setting& s) override { mask_change_freq_ = s.mask_change_freq; }
  void attach() override;
  bool sparse_dw() const override { return sp_->sparse_dw(); }
  uint64_t sparse_dw_draws() const override { return sp_->dw_draws(); }

  // Masks given for a slope layer [out, in] that it can take (Error naming the layer and the
  // first bad tile otherwise): the forward one row-wise 2:4 (exactly 2 of every 4 along each
  // row), the backward one inside it with at most 2 of every 4 down each column.
  static void check_masks(const std::string& weight_name, const GpuTransformer::SlopeState& st, int64_t out,
                          int64_t in);

  // The CPU twin is a SlopeLinear (model/linear_slope.h): its kept values "<weight>.values",
  // its masks, refresh step and draws; its adapter is the wrapper's (DeviceAdapterLinear).
  // DeviceLinearKind::setting_from_twin for this kind.
  static void setting_from_twin(const Linear<float>& twin, int64_t step, bool masks, Setting& s, TwinMasks& held);
  void to_twin(Linear<float>& twin, const TwinCopy& c) const override;
  bool moments_from_twin(const Linear<float>& twin, const NamedValues& m, const NamedValues& v, float* dense_m,
                         float* dense_v) const override;

 protected:
  Fp8ProducedCodes* fp8_produced_codes() override { return fp8_ ? &fp8_->produced() : nullptr; }

 private:
  struct Scratch;
  bool sparse_for(int N) const { return !dense_products_ && sp_->sparse_products() && sp_->tokens() == N; }
  // W1 [out, in] from the stored kept values, in the shared scratch.
  const bf16* expand_w1() const;
  // W2ᵀ [in, out] from W1 and the backward mask, in the shared scratch (W1 expanded first).
  const bf16* expand_w2t() const;
  gpu::SparseLinear::ProductTimes time_products();
  gpu::SparseLinear::ProductTimes time_fp8_products();

  Scratch& scratch_;
  std::unique_ptr<gpu::SparseLinear> sp_;
  std::unique_ptr<Fp8SparseProducts> fp8_;  // train.precision fp8
  bool dense_products_ = false;  // per-layer dispatch: cuBLASLt products of W1 and W2
  int mask_change_freq_ = 0;
  int64_t refresh_step_ = 0;  // the step whose forward first used the current backward mask
};

}  // namespace esplag
