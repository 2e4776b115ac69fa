// masked on the GPU (model/linear_masked.h: gradual magnitude pruning on dense kernels): the
// mask given (LinearKindSetting::mask, u8 [out, in], 1 = kept) held as bits on the device
// (1/8 byte per weight); the products are the dense ones of the masked weight, the weight
// gradient is masked after each dW product, and the pruned weights are zeroed when the
// layer is attached and after every AdamW step (MaskedLinear::after_optimizer_step). The
// parameter state stays dense.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include "core/device_arena.h"
#include "model/cuda/device_linear_dense.h"

namespace esplag {

class DeviceMaskedLinear : public DeviceDenseLinear {
 public:
  explicit DeviceMaskedLinear(const DeviceLinearSetup& s, const std::string& kind = "masked");
  size_t device_bytes() const override { return bits_.capacity() + DeviceDenseLinear::device_bytes(); }
  const char* after_optimizer_step_op() const override { return "masked weights"; }
  void after_optimizer_step() override;
  void attach() override { after_optimizer_step(); }
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  // The CPU twin is a MaskedLinear (model/linear_masked.h): its mask.
  // DeviceLinearKind::setting_from_twin for this kind.
  static void setting_from_twin(const Linear<float>& twin, int64_t step, bool masks, Setting& s, TwinMasks& held);

 private:
  DeviceArena bits_;
  const uint32_t* mask_ = nullptr;  // the kept positions as bits, [out, ceil(in / 32)] words
};

}  // namespace esplag
