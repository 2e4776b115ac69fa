#include "model/cuda/device_linear_semi_sparse.h"

#include "core/device_arena.h"
#include "core/error.h"
#include "model/cuda/step_marks.h"
#include "model/linear_semi_sparse.h"
#include "ops/gpu_fused.h"
#include "sparse/cuda/sparsify.h"

namespace esplag {

namespace {

constexpr const char* kPruneScratch = "semi_sparse prune";

struct ArenaPart : SharedScratch::Part {
  DeviceArena arena;
  void* base = nullptr;
  size_t bytes() const override { return arena.capacity(); }
};

}  // namespace

void* sparse_dw_scratch(DeviceLinearContext& ctx) {
  return ctx.scratch
      .get<ArenaPart>(kSparseDwScratch,
                      [&] {
                        const size_t largest = ctx.largest([&](int64_t out, int64_t in) {
                          return gpu::sparse_dw_scratch_bytes(out, in, ctx.tokens);
                        });
                        auto p = std::make_unique<ArenaPart>();
                        p->arena = DeviceArena(largest + 256, "sparse_dw scratch");
                        p->base = p->arena.allocate("sparse_dw buffers", largest, 256);
                        return p;
                      })
      .base;
}

DeviceSemiSparseLinear::DeviceSemiSparseLinear(const DeviceLinearSetup& s) : DeviceLinear("semi_sparse", s) {
  const Setting& st = *s.setting;
  ESPLAG_CHECK(!ctx_.precision.fp8, weight_name_, ": semi_sparse in fp8 is DeviceSemiSparseFp8Linear");
  gpu::SparseLinearOptions o;
  o.kind = gpu::SparseLinearKind::semi_sparse;
  o.bias = s.bias;
  o.keep_pruned = false;  // dense_weight prunes on demand
  o.sparse_dw = st.sparse_dw;
  o.dw_seed = st.dw_seed;
  if (st.sparse_dw) o.dw_scratch = sparse_dw_scratch(ctx_);
  sp_ = std::make_unique<gpu::SparseLinear>(o, out_, in_, ctx_.tokens, p_.weight.w, ctx_.stream);
  if (st.sparse_dw) sp_->set_dw_seed(st.dw_seed, st.dw_draws);
  if (ctx_.sparse_dispatch)
    sp_->use_dense_products(!ctx_.sparse_is_faster("semi_sparse", weight_name_, out_, in_,
                                                   DeviceLinearContext::GeluPasses::fc_and_dx,
                                                   [&] { return sp_->time_products(ctx_.stream); }));
  sp_->prepare(ctx_.stream);
  const size_t w_bytes = sizeof(bf16) * size_t(out_) * size_t(in_);
  if (!sp_->pruned_weight()) {  // the scratch grows to the largest layer that needs it
    auto& part = ctx_.scratch.get<ArenaPart>(kPruneScratch, [] { return std::make_unique<ArenaPart>(); });
    if (part.arena.capacity() < w_bytes + DeviceArena::kDefaultAlignment) {
      part.arena = DeviceArena(w_bytes + DeviceArena::kDefaultAlignment, "semi_sparse pruning scratch");
      part.base = part.arena.base();
    }
  }
}

DeviceSemiSparseLinear::~DeviceSemiSparseLinear() = default;

void DeviceSemiSparseLinear::bind(const DeviceLinearParams& p) {
  DeviceLinear::bind(p);
  sp_->set_weight(p_.weight.w);
}

size_t DeviceSemiSparseLinear::device_bytes() const { return sp_->device_bytes(); }

void DeviceSemiSparseLinear::shared_parts(std::set<std::string>& used) const {
  used.insert(kPruneScratch);
  if (sp_->sparse_dw()) used.insert(kSparseDwScratch);
}

void DeviceSemiSparseLinear::prepare(bool) { sp_->prepare(ctx_.stream); }

bool DeviceSemiSparseLinear::sparse_for(int N) const { return sp_->sparse_products() && sp_->tokens() == N; }

bool DeviceSemiSparseLinear::sparse_dw() const { return sp_->sparse_dw(); }

uint64_t DeviceSemiSparseLinear::sparse_dw_draws() const { return sp_->dw_draws(); }

const bf16* DeviceSemiSparseLinear::dense_weight() {
  if (const bf16* p = sp_->pruned_weight()) return p;
  bf16* ws = static_cast<bf16*>(ctx_.scratch.find<ArenaPart>(kPruneScratch)->base);
  gpu::transposable_24(p_.weight.w, out_, in_, gpu::Sparse24Out{ws}, gpu::Sparse24Out{}, nullptr, ctx_.stream);
  return ws;
}

void DeviceSemiSparseLinear::forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) {
  if (sparse_for(N)) return forward_24(*sp_, out, in, N, act, pre_act, op);
  ctx_.marks->mark(ctx_.stream, op, 2.0 * N * in_ * out_);
  ctx_.gemm->forward(out, in, dense_weight(), p_.bias.w, N, int(in_), int(out_), ctx_.stream, act, pre_act);
}

void DeviceSemiSparseLinear::backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) {
  if (sparse_for(N)) return backward_dx_24(*sp_, dinp, dout, N, pre_act, op);
  ctx_.marks->mark(ctx_.stream, op, 2.0 * N * in_ * out_);
  ctx_.gemm->backward_input(dinp, dout, dense_weight(), N, int(in_), int(out_), false, ctx_.stream, pre_act);
}

void DeviceSemiSparseLinear::backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad,
                                         const char* op) {
  const int K = int(in_), OC = int(out_);
  cudaStream_t s = ctx_.stream;
  ctx_.marks->mark(s, op, 2.0 * N * K * OC);
  float* db = bias_grad ? p_.bias.grad : nullptr;
  if (!(sp_->sparse_dw() && sp_->tokens() == N)) {
    ctx_.gemm->backward_weight(p_.weight.grad, db, dout, inp, N, K, OC, accumulate, s);
    return;
  }
  // The 2:4 product of the MVUE of doutᵀ (one draw), widened into dW.
  sp_->backward(nullptr, p_.weight.grad, dout, inp, accumulate, s);
  if (db) {
    ctx_.marks->mark(s, "bias grad");
    gpu::column_sum_add(db, dout, N, OC, ctx_.colsum_scratch, ctx_.colsum_scratch_bytes, s);
  }
}

void DeviceSemiSparseLinear::setting_from_twin(const Linear<float>& twin, int64_t, bool, Setting& s, TwinMasks&) {
  const MvueWeightGrad<float>& dw = twin_as<SemiSparseLinear>(twin, "semi_sparse").weight_grad();
  if (dw.on()) {  // the GPU goes on with the CPU's draws
    s.sparse_dw = true;
    s.dw_seed = dw.base_seed();
    s.dw_draws = dw.draws();
  }
}

void DeviceSemiSparseLinear::to_twin(Linear<float>& twin, const TwinCopy&) const {
  if (sparse_dw()) set_twin_draws(twin, sparse_dw_draws());
}

}  // namespace esplag
