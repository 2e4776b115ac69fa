#include "model/cuda/device_linear_vnm.h"

#include "core/error.h"
#include "model/linear_vnm.h"

namespace esplag {

bool DeviceVnmLinear::keeps(const Setting& s) const {
  if (s.kind != kind_ || !s.mask || s.slope_masks || s.sparse_dw != sparse_dw()) return DeviceLinear::keeps(s);
  ESPLAG_CHECK(mask_to_bits(*s.mask, out_, in_) == mask_bits(), weight_name_,
               ": a vnm layer's mask is frozen (the CPU's vnm keeps its compressed weight), and this one was given "
               "another; make the layer masked first");
  return true;
}

void DeviceVnmLinear::setting_from_twin(const Linear<float>& twin, int64_t, bool masks, Setting& s,
                                        TwinMasks& held) {
  if (masks) s.mask = &(held.mask = twin_as<VnmLinear>(twin, "vnm").mask());
}

void DeviceVnmLinear::to_twin(Linear<float>& twin, const TwinCopy& c) const {
  using namespace linear_detail;
  VnmLinear<float>& t = twin_as<VnmLinear>(twin, "vnm");
  // The kept values and their moments from the dense (masked) copies.
  const SlotIndex slots = slot_index(t.weight());
  gather(t.values().data(), slots, c.weight, nullptr);
  if (!c.m) return;
  for (auto [dense, named] : {std::pair{c.m, c.named_m}, std::pair{c.v, c.named_v}}) {
    std::vector<float>& out = (*named)[weight_name_ + ".values"];
    out.resize(t.values().size());
    gather(out.data(), slots, dense, nullptr);
  }
}

bool DeviceVnmLinear::moments_from_twin(const Linear<float>& twin, const NamedValues& m, const NamedValues& v,
                                        float* dense_m, float* dense_v) const {
  const VnmLinear<float>& t = twin_as<VnmLinear>(twin, "vnm");
  scatter_kept_moments(weight_name_, linear_detail::slot_index(t.weight()), t.weight().inner.values.size(), m, v,
                       dense_m, dense_v);
  return true;
}

}  // namespace esplag
