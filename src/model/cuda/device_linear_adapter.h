// slope's lazy low-rank adapter on the GPU (lora_rank > 0; model/linear_slope.h), a wrapper
// around its layer as LoraLinear is on the CPU: the output becomes X·W1ᵀ + (X·Rᵀ)·Lᵀ with
// L [out, r] and R [r, in] trained next to the layer's state (extra tensors
// "<module>.lora_l" and "<module>.lora_r": fp32 master, gradient and moments, with weight
// decay). A new adapter starts as SlopeLinear::enable_lora starts it from lora_seed
// (L = N(0, 1/r) from that seed, R = 0: the output is unchanged) with zero moments. The inner
// products stay as they are; the adapter adds cuBLASLt products of rank r: T = X·Rᵀ and
// Y += T·Lᵀ in the forward (before a GELU MLP's activation), dT = dY·L, dX += dT·R (before the
// GELU gradient), dL += dYᵀ·T and dR += dTᵀ·X in the backward. Each adapter keeps its T
// [tokens, r] bf16 from the forward for the backward; dT is one buffer shared by all
// adapters, of the largest rank made so far (a layer's dX and dW run one after the other).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include "core/device_arena.h"
#include "model/device_linear.h"

namespace esplag {

class DeviceAdapterLinear : public DeviceLinear {
 public:
  DeviceAdapterLinear(const DeviceLinearSetup& s, DeviceLinear& inner);
  int adapter_rank() const override { return rank_; }

  Shape stored_weight_shape() const override { return inner_.stored_weight_shape(); }
  int64_t stored_row_group() const override { return inner_.stored_row_group(); }
  void weight_to_stored(float* stored, const float* dense, int64_t row0, int64_t rows) const override {
    inner_.weight_to_stored(stored, dense, row0, rows);
  }
  void weight_from_stored(float* dense, const float* stored, int64_t row0, int64_t rows) const override {
    inner_.weight_from_stored(dense, stored, row0, rows);
  }
  std::vector<DeviceLinearTensor> extra_tensors() const override;
  std::vector<float> initial_extra(size_t i) const override;
  void bind(const DeviceLinearParams& p) override;
  size_t device_bytes() const override { return inner_.device_bytes() + t_arena_.capacity(); }
  void shared_parts(std::set<std::string>& used) const override;

  bool prepares() const override { return inner_.prepares(); }
  bool refresh_due(int64_t step) const override { return inner_.refresh_due(step); }
  void prepare(bool refresh) override { inner_.prepare(refresh); }
  void masks_refreshed(int64_t step) override { inner_.masks_refreshed(step); }
  const char* after_optimizer_step_op() const override { return inner_.after_optimizer_step_op(); }
  void after_optimizer_step() override { inner_.after_optimizer_step(); }
  void begin_backward() override;
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override;
  void backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) override;
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  bool sparse_dw() const override { return inner_.sparse_dw(); }
  uint64_t sparse_dw_draws() const override { return inner_.sparse_dw_draws(); }
  // The twin's owned parameters of the extra tensors' names ("<module>.lora_l", ...) carry
  // the adapter; the rest is the inner layer's.
  void to_twin(Linear<float>& twin, const TwinCopy& c) const override;
  bool moments_from_twin(const Linear<float>& twin, const NamedValues& m, const NamedValues& v, float* dense_m,
                         float* dense_v) const override {
    return inner_.moments_from_twin(twin, m, v, dense_m, dense_v);
  }
  void extras_from_twin(Linear<float>& twin, const NamedValues* m, const NamedValues* v) override;

 private:
  struct SharedDt;
  // dT = dout [N, out] · L, computed once for the layer's dX and dW.
  const bf16* dt(const bf16* dout, int N);

  DeviceLinear& inner_;
  const int rank_;
  const uint64_t seed_;
  DeviceArena t_arena_;
  bf16* t_ = nullptr;  // T = X·Rᵀ [tokens, rank], saved by the forward for the backward
  SharedDt& shared_;
  DeviceTensorView l_, r_;
};

}  // namespace esplag
