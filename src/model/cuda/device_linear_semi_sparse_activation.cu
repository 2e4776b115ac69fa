#include "model/cuda/device_linear_semi_sparse_activation.h"

#include "core/device_arena.h"
#include "core/error.h"
#include "model/cuda/step_marks.h"
#include "model/linear_semi_sparse.h"

namespace esplag {

namespace {

constexpr const char* kScratch = "semi_sparse_activation";

struct ScratchPart : SharedScratch::Part {
  DeviceArena arena;
  size_t bytes() const override { return arena.capacity(); }
};

}  // namespace

DeviceSemiSparseActivationLinear::DeviceSemiSparseActivationLinear(const DeviceLinearSetup& s)
    : DeviceDenseLinear(s, "semi_sparse_activation") {
  // One scratch for the largest block Linear and the pattern needing more (tile_24), made
  // with the first such layer.
  auto& part = ctx_.scratch.get<ScratchPart>(kScratch, [&] {
    const size_t largest = ctx_.largest([&](int64_t out, int64_t in) {
      return gpu::sparse_activation_scratch_bytes(out, in, ctx_.tokens, ActivationSparsity::tile_24);
    });
    auto p = std::make_unique<ScratchPart>();
    p->arena = DeviceArena(largest + DeviceArena::kDefaultAlignment, "semi_sparse_activation scratch");
    return p;
  });
  gpu::SparseActivationLinearOptions o;
  o.pattern = s.setting->activation;
  o.bias = s.bias;
  o.scratch = part.arena.base();
  o.gemm = ctx_.gemm;
  act_ = std::make_unique<gpu::SparseActivationLinear>(o, out_, in_, ctx_.tokens);
  if (ctx_.sparse_dispatch && act_->sparse())
    act_->use_dense_products(!ctx_.sparse_is_faster("semi_sparse_activation", weight_name_, out_, in_,
                                                    DeviceLinearContext::GeluPasses::fc,
                                                    [&] { return act_->time_products(p_.weight.w, ctx_.stream); }));
}

DeviceSemiSparseActivationLinear::~DeviceSemiSparseActivationLinear() = default;

bool DeviceSemiSparseActivationLinear::keeps(const Setting& s) const {
  return DeviceLinear::keeps(s) && act_->pattern() == s.activation;
}

void DeviceSemiSparseActivationLinear::shared_parts(std::set<std::string>& used) const { used.insert(kScratch); }

void DeviceSemiSparseActivationLinear::forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act,
                                               const char* op) {
  // The input pruned, then the 2:4 product (or cuBLASLt's of the pruned input).
  cudaStream_t s = ctx_.stream;
  ctx_.marks->mark_product(s, op, 2.0 * N * in_ * out_, act_->sparse_forward_for(N));
  const bool gelu = act == Act::gelu;
  bf16* y = gelu ? pre_act : out;
  act_->forward(y, in, p_.weight.w, p_.bias.w, N, s);
  if (gelu) {
    ctx_.marks->mark(s, "gelu fwd");
    gpu::gelu_forward(out, y, int64_t(N) * out_, s);
  }
}

void DeviceSemiSparseActivationLinear::backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate,
                                                   bool bias_grad, const char* op) {
  // dW = doutᵀ · the input pruned again (the forward's Xs), 2:4 where it can be.
  float* db = bias_grad ? p_.bias.grad : nullptr;
  ctx_.marks->mark_product(ctx_.stream, op, 2.0 * N * in_ * out_, act_->sparse_weight_grad_for(N, db != nullptr));
  act_->backward(nullptr, p_.weight.grad, db, dout, inp, nullptr, N, accumulate, ctx_.stream);
}

void DeviceSemiSparseActivationLinear::setting_from_twin(const Linear<float>& twin, int64_t, bool, Setting& s,
                                                         TwinMasks&) {
  s.activation = twin_as<SemiSparseActivationLinear>(twin, "semi_sparse_activation").activation();
}

}  // namespace esplag
