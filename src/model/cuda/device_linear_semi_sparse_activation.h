// semi_sparse_activation on the GPU (model/linear_semi_sparse.h's
// SemiSparseActivationLinear, with LinearKindSetting::activation's pattern): the weight stays
// dense and is trained densely; the layer's input is pruned 2:4 along the features at every
// forward (sparse/cuda/sparse_activation_linear.h), whose product is cuSPARSELt's 2:4 GEMM
// of the pruned input for full-size micro-batches where cuSPARSELt and the shape allow it
// (multiples of 16) and per-layer dispatch found it faster, else cuBLASLt's product of the
// pruned input; a bias is a separate pass after the 2:4 product, GELU too. dX is the dense
// dY·W (straight through, the dense kind's product), dW = dYᵀ·Xs with Xs pruned again from
// the saved input. Nothing is stored per layer: all such layers share one scratch (Xs and
// its compressed form) sized for the largest block Linear. Without cuSPARSELt the kind runs
// its cuBLASLt products after one warning. in_features must be a multiple of 4.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <memory>

#include "model/cuda/device_linear_dense.h"
#include "sparse/cuda/sparse_activation_linear.h"

namespace esplag {

class DeviceSemiSparseActivationLinear : public DeviceDenseLinear {
 public:
  explicit DeviceSemiSparseActivationLinear(const DeviceLinearSetup& s);
  ~DeviceSemiSparseActivationLinear() override;
  ActivationSparsity pattern() const { return act_->pattern(); }
  bool keeps(const Setting& s) const override;
  size_t device_bytes() const override { return act_->device_bytes() + DeviceDenseLinear::device_bytes(); }
  void shared_parts(std::set<std::string>& used) const override;
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override;
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  // The CPU twin is a SemiSparseActivationLinear (model/linear_semi_sparse.h): its pattern.
  // DeviceLinearKind::setting_from_twin for this kind.
  static void setting_from_twin(const Linear<float>& twin, int64_t step, bool masks, Setting& s, TwinMasks& held);

 protected:
  // Its products read the bf16 input (pruned 2:4 every step): no codes from producers.
  Fp8ProducedCodes* fp8_produced_codes() override { return nullptr; }

 private:
  std::unique_ptr<gpu::SparseActivationLinear> act_;
};

}  // namespace esplag
