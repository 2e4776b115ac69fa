#include "model/cuda/device_linear_adapter.h"

#include "model/cuda/step_marks.h"
#include "model/linear_slope.h"

namespace esplag {

namespace {
constexpr const char* kSharedName = "adapter dT";
size_t aligned(size_t bytes) {
  const size_t a = DeviceArena::kDefaultAlignment;
  return (bytes + a - 1) / a * a;
}
}  // namespace

// dT of the largest rank, and the adapter whose dT it holds now.
struct DeviceAdapterLinear::SharedDt : SharedScratch::Part {
  DeviceArena arena;
  bf16* dt = nullptr;
  int rank = 0;
  const DeviceAdapterLinear* of = nullptr;
  size_t bytes() const override { return arena.capacity(); }
};

DeviceAdapterLinear::DeviceAdapterLinear(const DeviceLinearSetup& s, DeviceLinear& inner)
    : DeviceLinear(inner.kind(), s),
      inner_(inner),
      rank_(s.setting->lora_rank),
      seed_(s.setting->lora_seed),
      shared_(s.context->scratch.get<SharedDt>(kSharedName, [] { return std::make_unique<SharedDt>(); })) {
  const size_t tokens = size_t(ctx_.tokens);
  t_arena_ = DeviceArena(aligned(sizeof(bf16) * tokens * size_t(rank_)), "low-rank adapter T");
  t_ = t_arena_.allocate_array<bf16>(weight_name_ + " T", tokens * size_t(rank_));
  if (shared_.rank < rank_) {
    shared_.arena = DeviceArena();
    shared_.arena = DeviceArena(aligned(sizeof(bf16) * tokens * size_t(rank_)), "low-rank adapter dT");
    shared_.dt = shared_.arena.allocate_array<bf16>("dT", tokens * size_t(rank_));
    shared_.rank = rank_;
  }
  shared_.of = nullptr;
}

std::vector<DeviceLinearTensor> DeviceAdapterLinear::extra_tensors() const {
  auto t = inner_.extra_tensors();
  t.push_back({".lora_l", {out_, rank_}});
  t.push_back({".lora_r", {rank_, in_}});
  return t;
}

std::vector<float> DeviceAdapterLinear::initial_extra(size_t i) const {
  const size_t own = inner_.extra_tensors().size();
  if (i < own) return inner_.initial_extra(i);
  if (i == own) return SlopeLinear<float>::initial_lora_l(out_, rank_, seed_);
  return std::vector<float>(size_t(rank_) * size_t(in_), 0.f);
}

void DeviceAdapterLinear::bind(const DeviceLinearParams& p) {
  DeviceLinear::bind(p);
  DeviceLinearParams in = p;
  in.extra.resize(in.extra.size() - 2);
  inner_.bind(in);
  l_ = p.extra.at(p.extra.size() - 2);
  r_ = p.extra.back();
}

void DeviceAdapterLinear::shared_parts(std::set<std::string>& used) const {
  inner_.shared_parts(used);
  used.insert(kSharedName);
}

void DeviceAdapterLinear::begin_backward() {
  inner_.begin_backward();
  shared_.of = nullptr;  // dT holds one of the last micro-batch
}

const bf16* DeviceAdapterLinear::dt(const bf16* dout, int N) {
  if (shared_.of != this) ctx_.gemm->backward_input(shared_.dt, dout, l_.w, N, rank_, int(out_), false, ctx_.stream);
  shared_.of = this;
  return shared_.dt;
}

void DeviceAdapterLinear::forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) {
  const int K = int(in_), OC = int(out_), r = rank_;
  cudaStream_t s = ctx_.stream;
  const bool gelu = act == Act::gelu;
  bf16* y = gelu ? pre_act : out;
  inner_.forward(y, in, N, Act::none, nullptr, op);
  ctx_.marks->mark_part(s, "gemm lora fwd", 2.0 * N * r * (K + OC), op, ".lora");
  ctx_.gemm->forward(t_, in, r_.w, nullptr, N, K, r, s);
  ctx_.gemm->forward_strided(y, OC, t_, r, l_.w, N, r, OC, true, s);
  if (gelu) {
    ctx_.marks->mark(s, "gelu fwd");
    gpu::gelu_forward(out, y, int64_t(N) * OC, s);
  }
}

void DeviceAdapterLinear::backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) {
  const int K = int(in_), OC = int(out_), r = rank_;
  cudaStream_t s = ctx_.stream;
  inner_.backward_dx(dinp, dout, N, nullptr, op);
  ctx_.marks->mark_part(s, "gemm lora dX", 2.0 * N * r * (K + OC), op, ".lora");
  ctx_.gemm->backward_input(dinp, dt(dout, N), r_.w, N, K, r, true, s);
  if (pre_act) {
    ctx_.marks->mark(s, "gelu bwd");
    gpu::gelu_backward(dinp, pre_act, dinp, int64_t(N) * K, false, s);
  }
}

void DeviceAdapterLinear::backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad,
                                      const char* op) {
  // The adapter's gradients always add (zero_grad zeroes them).
  const int K = int(in_), OC = int(out_), r = rank_;
  cudaStream_t s = ctx_.stream;
  inner_.backward_dw(dout, inp, N, accumulate, bias_grad, op);
  ctx_.marks->mark_part(s, "gemm lora dW", 2.0 * N * r * (K + 2 * OC), op, ".lora");
  const bf16* d = dt(dout, N);
  ctx_.gemm->backward_weight(l_.grad, nullptr, dout, t_, N, r, OC, true, s);
  ctx_.gemm->backward_weight(r_.grad, nullptr, d, inp, N, K, r, true, s);
}

std::unique_ptr<DeviceLinear> make_device_adapter(const DeviceLinearSetup& setup, DeviceLinear& inner) {
  return std::make_unique<DeviceAdapterLinear>(setup, inner);
}

namespace {

// The twin's owned parameter of the layer's extra tensor `t` ("<module>" + t.suffix), of
// t's size (Error otherwise).
OwnedParam<float> twin_param(Linear<float>& twin, const DeviceLinearTensor& t) {
  const std::string name = twin.params().module + t.suffix;
  for (const auto& p : twin.owned_params())
    if (p.name == name) {
      ESPLAG_CHECK(shape_numel(p.shape) == shape_numel(t.shape), "GpuTransformer: ", name, ": ",
                   shape_numel(t.shape), " values on the GPU, ", shape_numel(p.shape), " in the CPU twin");
      return p;
    }
  fail("GpuTransformer: ", twin.params().name, ": the CPU twin (", twin.kind(), ") has no tensor '", name,
       "' for the low-rank adapter");
}

}  // namespace

void DeviceAdapterLinear::to_twin(Linear<float>& twin, const TwinCopy& c) const {
  inner_.to_twin(twin, c);
  const std::vector<DeviceLinearTensor> tensors = extra_tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const OwnedParam<float> p = twin_param(twin, tensors[i]);
    std::vector<float> w;
    p_.extra[i].to_host(size_t(shape_numel(p.shape)), &w, c.named_m ? &(*c.named_m)[p.name] : nullptr,
                        c.named_v ? &(*c.named_v)[p.name] : nullptr, ctx_.stream);
    std::copy(w.begin(), w.end(), p.value);
  }
}

void DeviceAdapterLinear::extras_from_twin(Linear<float>& twin, const NamedValues* m, const NamedValues* v) {
  const std::vector<DeviceLinearTensor> tensors = extra_tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const OwnedParam<float> p = twin_param(twin, tensors[i]);
    const size_t n = size_t(shape_numel(p.shape));
    auto moment = [&](const NamedValues* ms) -> const float* {  // none yet: zero
      const auto it = ms ? ms->find(p.name) : NamedValues::const_iterator();
      if (!ms || it == ms->end()) return nullptr;
      ESPLAG_CHECK(it->second.size() == n, "GPU training: the optimizer state for '", p.name, "' holds ",
                   it->second.size(), " values, not ", n);
      return it->second.data();
    };
    p_.extra[i].from_host(n, p.value, moment(m), moment(v), ctx_.stream);
  }
}

}  // namespace esplag
