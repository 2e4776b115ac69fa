#include "model/cuda/device_linear_semi_sparse_fp8.h"

#include "core/device_arena.h"
#include "core/error.h"
#include "model/cuda/step_marks.h"
#include "ops/gpu_fused.h"
#include "sparse/cuda/sparsify.h"

namespace esplag {

namespace {
constexpr const char* kScratchName = "semi_sparse fp8 prune";
}  // namespace

// Ws and Wsᵀ of the largest layer, bf16; one stream orders their uses.
struct DeviceSemiSparseFp8Linear::Scratch : SharedScratch::Part {
  DeviceArena arena;
  bf16 *ws = nullptr, *wst = nullptr;
  size_t bytes() const override { return arena.capacity(); }
};

DeviceSemiSparseFp8Linear::DeviceSemiSparseFp8Linear(const DeviceLinearSetup& s) : DeviceLinear("semi_sparse", s) {
  ESPLAG_CHECK(!s.setting->sparse_dw, weight_name_,
               ": sparse_dw with train.precision fp8 is trained by the CPU's emulation only so far (docs/fp8.md)");
  ESPLAG_CHECK(out_ % 4 == 0 && in_ % 4 == 0, weight_name_, " [out ", out_, ", in ", in_,
               "]: semi_sparse needs in and out features that are multiples of 4");
  fp8_ = std::make_unique<Fp8SparseProducts>(ctx_, weight_name_, out_, in_, s.bias);
  if (ctx_.sparse_dispatch && fp8_->can_be_sparse())
    fp8_->set_dense(!ctx_.sparse_is_faster(
        "semi_sparse fp8", weight_name_, out_, in_, DeviceLinearContext::GeluPasses::none,
        [&] { return fp8_->time_ways([&] { prepare(false); }, [&] { return pruned(false); },
                                     [&] { return pruned(true); }, p_.bias.w); }));
  prepare(false);
}

DeviceSemiSparseFp8Linear::~DeviceSemiSparseFp8Linear() = default;

DeviceSemiSparseFp8Linear::Scratch& DeviceSemiSparseFp8Linear::scratch() {
  return ctx_.scratch.get<Scratch>(kScratchName, [&] {
    const size_t largest = ctx_.largest([](int64_t out, int64_t in) { return size_t(out * in); });
    auto p = std::make_unique<Scratch>();
    p->arena = DeviceArena(2 * sizeof(bf16) * largest + 2 * DeviceArena::kDefaultAlignment, "semi_sparse fp8 prune");
    p->ws = p->arena.allocate_array<bf16>("Ws", largest);
    p->wst = p->arena.allocate_array<bf16>("Ws^T", largest);
    return p;
  });
}

void DeviceSemiSparseFp8Linear::shared_parts(std::set<std::string>& used) const {
  used.insert(kScratchName);
  Fp8SparseProducts::shared_parts(used);
}

const bf16* DeviceSemiSparseFp8Linear::pruned(bool transposed) {
  Scratch& sc = scratch();
  gpu::transposable_24(p_.weight.w, out_, in_, gpu::Sparse24Out{transposed ? nullptr : sc.ws},
                       gpu::Sparse24Out{transposed ? sc.wst : nullptr}, nullptr, ctx_.stream);
  return transposed ? sc.wst : sc.ws;
}

void DeviceSemiSparseFp8Linear::prepare(bool) {
  ctx_.marks->mark(ctx_.stream, "sparse prepare (2:4 prune)");
  if (fp8_->writes_own_layout()) return fp8_->prepare_transposable(pruned(false));
  Scratch& sc = scratch();
  gpu::transposable_24(p_.weight.w, out_, in_, gpu::Sparse24Out{sc.ws}, gpu::Sparse24Out{sc.wst}, nullptr,
                       ctx_.stream);
  fp8_->prepare(sc.ws, sc.wst);
}

void DeviceSemiSparseFp8Linear::forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) {
  fp8_->forward(out, in, p_.bias.w, N, act, pre_act, [&] { return pruned(false); }, op);
}

void DeviceSemiSparseFp8Linear::backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act,
                                            const char* op) {
  fp8_->backward_dx(dinp, dout, N, [&] { return pruned(true); }, op);
  gelu_backward_pass(dinp, pre_act, N);
}

gpu::PendingScale DeviceSemiSparseFp8Linear::forward_leaving_scale(bf16* out, const bf16* in, int N,
                                                                 const char* op) {
  return fp8_->forward_leaving_scale(out, in, p_.bias.w, N, [&] { return pruned(false); }, op);
}

gpu::PendingScale DeviceSemiSparseFp8Linear::backward_dx_leaving_scale(bf16* dinp, const bf16* dout, int N,
                                                                     const char* op) {
  return fp8_->backward_dx_leaving_scale(dinp, dout, N, [&] { return pruned(true); }, op);
}

void DeviceSemiSparseFp8Linear::backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad,
                                            const char* op) {
  fp8_->backward_dw(p_.weight.grad, dout, inp, N, accumulate, op);
  if (bias_grad && p_.bias.grad) {  // the exact sum of dY, as the CPU's (not an fp8 product)
    ctx_.marks->mark(ctx_.stream, "bias grad");
    gpu::column_sum_add(p_.bias.grad, dout, N, int(out_), ctx_.colsum_scratch, ctx_.colsum_scratch_bytes,
                        ctx_.stream);
  }
}

}  // namespace esplag
