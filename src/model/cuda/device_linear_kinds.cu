// The kinds of block Linear the GPU trains (model/device_linear.h's kind table).
#include <algorithm>

#include "core/error.h"
#include "model/cuda/device_linear_dense.h"
#include "model/cuda/device_linear_masked.h"
#include "model/cuda/device_linear_semi_sparse.h"
#include "model/cuda/device_linear_semi_sparse_fp8.h"
#include "model/cuda/device_linear_semi_sparse_activation.h"
#include "model/cuda/device_linear_slope.h"
#include "model/cuda/device_linear_vnm.h"
#include "model/linear_registry.h"

namespace esplag {

namespace {

template <typename L>
std::function<std::unique_ptr<DeviceLinear>(const DeviceLinearSetup&)> maker() {
  return [](const DeviceLinearSetup& s) -> std::unique_ptr<DeviceLinear> { return std::make_unique<L>(s); };
}

std::vector<DeviceLinearKind> make_kinds() {
  std::vector<DeviceLinearKind> kinds(6);
  DeviceLinearKind& dense = kinds[0];
  dense.name = "dense";
  dense.make = maker<DeviceDenseLinear>();

  DeviceLinearKind& masked = kinds[1];
  masked.name = "masked";
  masked.takes_mask = true;
  masked.dispatch_times = "prepare + forward";  // 2:4 masks: the forward alone (Rows24Forward)
  masked.make = maker<DeviceMaskedLinear>();
  masked.setting_from_twin = DeviceMaskedLinear::setting_from_twin;

  DeviceLinearKind& vnm = kinds[2];
  vnm.name = "vnm";
  vnm.takes_mask = true;
  vnm.trains_own_tensor = true;
  vnm.dispatch_times = masked.dispatch_times;
  vnm.make = maker<DeviceVnmLinear>();
  vnm.setting_from_twin = DeviceVnmLinear::setting_from_twin;

  DeviceLinearKind& semi = kinds[3];
  semi.name = "semi_sparse";
  semi.takes_sparse_dw = true;
  semi.needs_cusparselt = true;
  semi.build_order = 2;  // reads the weight where the new layout put it
  semi.make = [](const DeviceLinearSetup& s) -> std::unique_ptr<DeviceLinear> {
    if (s.context->precision.fp8) return std::make_unique<DeviceSemiSparseFp8Linear>(s);
    return std::make_unique<DeviceSemiSparseLinear>(s);
  };
  semi.setting_from_twin = DeviceSemiSparseLinear::setting_from_twin;

  DeviceLinearKind& act = kinds[4];
  act.name = "semi_sparse_activation";
  act.build_order = 3;
  act.dispatch_times = "input pruning + forward";
  act.check_change = [](const GpuTransformer::LinearKindSetting& st, int64_t, int64_t in) {
    ESPLAG_CHECK(in % 4 == 0, "GpuTransformer: ", st.weight_name, ": semi_sparse_activation needs ",
                 "the layer's input features (", in, ") to be a multiple of 4 (2:4 groups of the input)");
  };
  act.make = maker<DeviceSemiSparseActivationLinear>();
  act.setting_from_twin = DeviceSemiSparseActivationLinear::setting_from_twin;

  DeviceLinearKind& slope = kinds[5];
  slope.name = "slope";
  slope.takes_slope_masks = true;
  slope.takes_adapter = true;
  slope.takes_sparse_dw = true;
  slope.needs_cusparselt = true;
  slope.stores_other_weight = true;
  slope.trains_own_tensor = true;
  slope.build_order = 0;  // its masks define the new layout
  slope.check = [](const GpuTransformer::LinearKindSetting& st, int64_t out, int64_t in) {
    if (st.slope_masks) DeviceSlopeLinear::check_masks(st.weight_name, *st.slope_masks, out, in);
  };
  slope.make = maker<DeviceSlopeLinear>();
  slope.setting_from_twin = DeviceSlopeLinear::setting_from_twin;
  return kinds;
}

// The table and the kind registry (model/linear_registry.h) name the same kinds: each entry
// a registered kind whose `gpu` flag is set, and an entry for every such kind (registered
// later ones included), so the trainer's device rule and this table cannot disagree.
void check_against_registry(const std::deque<DeviceLinearKind>& kinds) {
  for (const auto& k : kinds)
    ESPLAG_CHECK(find_linear_kind(k.name, "the GPU's kind table").gpu, "the GPU's kind table has '", k.name,
                 "', whose registry entry does not say the GPU trains it (LinearKindInfo::gpu)");
  for (const auto& k : linear_kinds())
    ESPLAG_CHECK(!k.gpu || std::any_of(kinds.begin(), kinds.end(), [&](const auto& d) { return d.name == k.name; }),
                 "Linear kind '", k.name, "' says the GPU trains it (LinearKindInfo::gpu) but the GPU's kind table "
                 "(model/cuda/device_linear_kinds.cu) has no entry for it");
}

std::deque<DeviceLinearKind>& kind_table() {
  static std::deque<DeviceLinearKind> kinds = [] {
    std::vector<DeviceLinearKind> built_in = make_kinds();
    return std::deque<DeviceLinearKind>(std::make_move_iterator(built_in.begin()),
                                        std::make_move_iterator(built_in.end()));
  }();
  return kinds;
}

}  // namespace

const std::deque<DeviceLinearKind>& device_linear_kinds() {
  check_against_registry(kind_table());
  return kind_table();
}

void register_device_linear_kind(DeviceLinearKind kind) {
  const LinearKindInfo* info = lookup_linear_kind(kind.name);
  ESPLAG_CHECK(info && info->gpu, "register_device_linear_kind: '", kind.name,
               "' is not a kind of the registry whose `gpu` flag is set (register_linear_kind first)");
  for (const auto& k : kind_table())
    ESPLAG_CHECK(k.name != kind.name, "register_device_linear_kind: the GPU has kind '", kind.name, "' already");
  ESPLAG_CHECK(kind.make, "register_device_linear_kind: kind '", kind.name, "' has no `make`");
  kind_table().push_back(std::move(kind));
}

}  // namespace esplag
