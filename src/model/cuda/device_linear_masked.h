// masked on the GPU (model/linear_masked.h: gradual magnitude pruning on dense kernels): the
// mask given (LinearKindSetting::mask, u8 [out, in], 1 = kept) held as bits on the device
// (1/8 byte per weight); the products are the dense ones of the masked weight (bf16 or fp8),
// the weight gradient is masked after each dW product, and the pruned weights are zeroed
// when the layer is attached and after every AdamW step (MaskedLinear::after_optimizer_step).
// The parameter state stays dense.
//
// In bf16, a mask that keeps at most 2 of every aligned 4 in each row (2:4, VENOM's 64:2:8)
// makes the masked weight 2:4 as it lies: full-size micro-batches then run the forward on
// cuSPARSELt's 2:4 product (Rows24Forward, compressed at every prepare), where the per-layer
// dispatch finds it faster than cuBLASLt's (the dispatch's kind is the layer's). Such a layer
// also zeroes its pruned weights before compressing weights it did not zero itself
// (set_params, init_weights), where the dense products would read them as given until the
// next step.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <memory>
#include <vector>

#include "core/device_arena.h"
#include "model/cuda/device_linear_dense.h"
#include "model/cuda/rows_24_forward.h"

namespace esplag {

class DeviceMaskedLinear : public DeviceDenseLinear {
 public:
  explicit DeviceMaskedLinear(const DeviceLinearSetup& s, const std::string& kind = "masked");
  size_t device_bytes() const override;
  const char* after_optimizer_step_op() const override {
    return steps_keep_pruned_zero() ? nullptr : "masked weights";
  }
  void after_optimizer_step() override;
  // Its prepare may zero pruned weights after AdamW took the amax.
  bool takes_weight_amax() const override { return false; }
  // The pruned weights zeroed; with a 2:4 mask, the dispatch and the compressed copy.
  void attach() override;
  void bind(const DeviceLinearParams& p) override;
  bool prepares() const override { return fwd24_ || steps_keep_pruned_zero() || DeviceDenseLinear::prepares(); }
  void prepare(bool refresh) override;
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override;
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  // The CPU twin is a MaskedLinear (model/linear_masked.h): its mask.
  // DeviceLinearKind::setting_from_twin for this kind.
  static void setting_from_twin(const Linear<float>& twin, int64_t step, bool masks, Setting& s, TwinMasks& held);

 protected:
  // Whether AdamW leaves the pruned weights at zero by itself, so that after_optimizer_step
  // has nothing to zero: their gradients are masked, and their moments zero (vnm).
  virtual bool steps_keep_pruned_zero() const { return false; }
  // The mask's bits, copied to the host (synchronises), and a mask's ([out, in], 1 = kept):
  // bit c % 32 of word c / 32 of row r for column c, rows of ceil(in / 32) words.
  std::vector<uint32_t> mask_bits() const;
  static std::vector<uint32_t> mask_to_bits(const std::vector<uint8_t>& mask, int64_t out, int64_t in);
  // Whether such bits keep at most 2 of every aligned 4 inputs in each row (in a multiple of 4).
  static bool bits_are_rows_24(const std::vector<uint32_t>& bits, int64_t in);

 private:
  // Zeroes the pruned weights (both halves of the split master).
  void zero_pruned_weights();
  // The 2:4 way of the per-layer dispatch (prepare + forward) and the dense forward, timed.
  DeviceLinearContext::ProductTimes time_forward();
  void prepare_24();

  DeviceArena bits_;
  const uint32_t* mask_ = nullptr;  // the kept positions as bits, [out, ceil(in / 32)] words
  const bool bias_;
  bool rows_24_ = false;  // bf16, and the mask and shape allow the 2:4 forward
  std::unique_ptr<Rows24Forward> fwd24_;  // the 2:4 forward runs (attach decided)
  bool w24_current_ = false;  // fwd24_'s copy is the bound weight's (prepare since the last bind)
  // after_optimizer_step ran since the last prepare, so the pruned weights are zero (any
  // other prepare may follow weights that came otherwise: set_params, init_weights).
  bool stepped_ = false;
};

}  // namespace esplag
