// vnm on the GPU (model/linear_vnm.h: VENOM's layers after kernel replacement, the mask
// frozen): trained as masked is, with the mask it is given when it becomes vnm, but without
// zeroing the pruned weights after each step (steps_keep_pruned_zero). The CPU trains its
// kept values, a new tensor: its moments start from zero (the kind table's
// trains_own_tensor); AdamW is elementwise and the pruned entries' gradients, moments and
// weights stay 0, so the kept values take the CPU's updates. Its products are the dense
// ones of the masked weight, not the V:N:M kernel (sparse/cuda/vnm_gemm.h), which measured
// slower than cuBLASLt's on the GPU (0.55-0.96x), except a forward on cuSPARSELt's 2:4 where
// the mask allows it (DeviceMaskedLinear).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include "model/cuda/device_linear_masked.h"

namespace esplag {

class DeviceVnmLinear : public DeviceMaskedLinear {
 public:
  explicit DeviceVnmLinear(const DeviceLinearSetup& s) : DeviceMaskedLinear(s, "vnm") {}
  // The same mask again keeps the layer; another is an Error (steps_keep_pruned_zero needs
  // the mask frozen).
  bool keeps(const Setting& s) const override;

  // The CPU twin is a VnmLinear (model/linear_vnm.h), which trains its kept values
  // "<weight>.values" (here the masked dense weight, zero where pruned).
  // DeviceLinearKind::setting_from_twin for this kind.
  static void setting_from_twin(const Linear<float>& twin, int64_t step, bool masks, Setting& s, TwinMasks& held);
  void to_twin(Linear<float>& twin, const TwinCopy& c) const override;
  bool moments_from_twin(const Linear<float>& twin, const NamedValues& m, const NamedValues& v, float* dense_m,
                         float* dense_v) const override;

 protected:
  // The pruned entries' moments are zero: the model zeroes the weight's moments when a layer
  // becomes vnm (trains_own_tensor), a twin's are scattered with zeros there, and the mask
  // never changes while the layer is vnm (the CPU's vnm keeps its compressed weight). With
  // their gradients masked, AdamW's update of a zero weight is then exactly zero, weight
  // decay included: the per-step pass over the weights is not needed.
  bool steps_keep_pruned_zero() const override { return true; }
};

}  // namespace esplag
