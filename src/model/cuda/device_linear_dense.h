// dense on the GPU: cuBLASLt's products of W with their epilogues (bias, GELU and its
// gradient, the bias gradient), in bf16 or fp8 (GpuModelOptions::precision). The base of
// masked and vnm.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include "model/device_linear.h"

namespace esplag {

class DeviceDenseLinear : public DeviceLinear {
 public:
  explicit DeviceDenseLinear(const DeviceLinearSetup& s, const std::string& kind = "dense");
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override;
  void backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) override;
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  void shared_parts(std::set<std::string>& used) const override;
  // Device bytes of the scratch the fp8 products share (GpuModelOptions::precision), for
  // block Linear shapes [out, in] and micro-batches of `tokens` rows.
  static size_t fp8_scratch_bytes(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t tokens);

 private:
  // The fp8 products (GpuModelOptions::precision): each casts its operands (amax, scale and
  // cast on the device; the backward's transposed copies, as cuBLASLt's fp8 GEMMs take
  // their operands K-major) into a scratch all fp8 layers share, then multiplies them.
  struct Fp8Scratch;
  Fp8Scratch& fp8_scratch();
  bool fp8_ = false;
};

}  // namespace esplag
