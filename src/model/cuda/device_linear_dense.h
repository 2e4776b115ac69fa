// dense on the GPU: cuBLASLt's products of W with their epilogues (bias, GELU and its
// gradient, the bias gradient), in bf16 or fp8 (GpuModelOptions::precision). The base of
// masked and vnm.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include "core/device_arena.h"
#include "model/device_linear.h"

namespace esplag {

class DeviceDenseLinear : public DeviceLinear {
 public:
  explicit DeviceDenseLinear(const DeviceLinearSetup& s, const std::string& kind = "dense");
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override;
  void backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) override;
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  void shared_parts(std::set<std::string>& used) const override;
  void begin_backward() override { dy_amax_of_ = nullptr; }
  // Device bytes of the scratch the fp8 products share (GpuModelOptions::precision), for
  // block Linear shapes [out, in] and micro-batches of `tokens` rows.
  static size_t fp8_scratch_bytes(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t tokens);

 private:
  // The fp8 products (GpuModelOptions::precision): each casts its operands (amax, scale and
  // cast on the device; the backward's transposed copies, as cuBLASLt's fp8 GEMMs take
  // their operands K-major) into a scratch all fp8 layers share, then multiplies them. Each
  // tensor's amax is taken once: X's and W's in the forward (the backward's transposed casts
  // reuse them: the saved input and the weight are unchanged until then), dY's by the first
  // of backward_dx and backward_dw for it.
  struct Fp8Scratch;
  Fp8Scratch& fp8_scratch();
  // This layer's amax and inverse scale of X, W and dY (Fp8Scratch::Role), 256 bytes apart.
  float* fp8_amax(int role) const;
  float* fp8_inv(int role) const;
  // dY's fp8 copy into out, as it is or transposed; its amax taken by the first of the two
  // backward products of dout only.
  void cast_grad(uint8_t* out, const bf16* dout, int N, bool transposed);
  bool fp8_ = false;
  DeviceArena fp8_scales_;
  const bf16* dy_amax_of_ = nullptr;  // the dY whose amax fp8_amax(grad) holds, until consumed
  int dy_amax_rows_ = 0;
};

}  // namespace esplag
