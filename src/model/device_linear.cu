#include "model/device_linear.h"

#include <algorithm>
#include <cstdio>
#include <iterator>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/error.h"
#include "model/cuda/fp8_produced_codes.h"
#include "model/cuda/step_marks.h"
#include "model/linear.h"
#include "ops/gpu_fused.h"
#include "sparse/cuda/cusparselt.h"

namespace esplag {

void SharedScratch::keep_only(const std::set<std::string>& used) {
  for (auto it = parts_.begin(); it != parts_.end();)
    it = used.count(it->first) ? std::next(it) : parts_.erase(it);
}

size_t SharedScratch::bytes() const {
  size_t n = 0;
  for (const auto& [name, part] : parts_) n += part->bytes();
  return n;
}

size_t DeviceLinearContext::largest(const std::function<size_t(int64_t, int64_t)>& f) const {
  size_t n = 0;
  for (const auto& [out, in] : shapes) n = std::max(n, f(out, in));
  return n;
}

namespace {

// Median time of the separate GELU pass over n values (forward, or the gradient given the
// pre-activation), on scratch buffers; synchronises the stream.
double time_gelu_pass(int64_t n, bool forward, cudaStream_t s) {
  DeviceArena scratch(2 * sizeof(bf16) * size_t(n) + 2 * DeviceArena::kDefaultAlignment, "GELU timing");
  bf16* a = scratch.allocate_array<bf16>("a", size_t(n));
  bf16* b = scratch.allocate_array<bf16>("b", size_t(n));
  CUDA_CHECK(cudaMemsetAsync(a, 0x3C, sizeof(bf16) * size_t(n), s));
  CUDA_CHECK(cudaMemsetAsync(b, 0x3B, sizeof(bf16) * size_t(n), s));
  return median_event_ms(
      [&](int) {
        if (forward)
          gpu::gelu_forward(b, a, n, s);
        else
          gpu::gelu_backward(b, a, b, n, false, s);
      },
      2, 5, s);
}

}  // namespace

bool DeviceLinearContext::sparse_is_faster(const std::string& kind, const std::string& weight_name, int64_t out,
                                           int64_t in, GeluPasses gelu, const std::function<ProductTimes()>& time) {
  const bool is_fc = weight_name.find(".mlp.fc.") != std::string::npos;
  const bool gelu_pass = gelu_mlp && gelu != GeluPasses::none && weight_name.find(".mlp.") != std::string::npos &&
                         (is_fc || gelu == GeluPasses::fc_and_dx);
  auto it = std::find_if(dispatch.begin(), dispatch.end(), [&](const GpuTransformer::SparseDispatch& d) {
    return d.kind == kind && d.out == out && d.in == in && d.tokens == tokens && d.gelu_pass == gelu_pass;
  });
  if (it == dispatch.end()) {
    const ProductTimes t = time();
    const double extra = gelu_pass ? time_gelu_pass(tokens * (is_fc ? out : in), is_fc, stream) : 0.0;
    dispatch.push_back(
        {kind, out, in, tokens, gelu_pass, t.sparse_ms + extra, t.dense_ms, t.sparse_ms + extra < t.dense_ms});
    it = dispatch.end() - 1;
  }
  return it->sparse;
}

DeviceLinear::DeviceLinear(const std::string& kind, const DeviceLinearSetup& s)
    : kind_(kind), weight_name_(s.setting->weight_name), out_(s.out), in_(s.in), ctx_(*s.context), p_(s.params) {}

bool DeviceLinear::takes_produced_fp8() {
  const Fp8ProducedCodes* c = fp8_produced_codes();
  return c && c->on();
}

namespace {

Fp8ProducedCodes& produced_codes(Fp8ProducedCodes* c, const std::string& weight_name, const std::string& kind) {
  if (!c) fail(weight_name, " (", kind, "): its products take no fp8 codes from their producers");
  return *c;
}

}  // namespace

gpu::Fp8Target DeviceLinear::fp8_grad_target(const bf16* dout, int N) {
  return produced_codes(fp8_produced_codes(), weight_name_, kind_).grad(dout, N, p_.bias.w != nullptr);
}
gpu::Fp8Target DeviceLinear::fp8_input_target(const bf16* in, int N) {
  return produced_codes(fp8_produced_codes(), weight_name_, kind_).input(in, N);
}
gpu::Fp8Target DeviceLinear::fp8_input_t_target(int N) {
  return produced_codes(fp8_produced_codes(), weight_name_, kind_).input_t(N);
}

bool DeviceLinear::keeps(const Setting& s) const {
  return s.kind == kind_ && !s.slope_masks && !s.mask && s.sparse_dw == sparse_dw();
}

void DeviceLinear::forward_24(gpu::SparseLinear& sp, bf16* out, const bf16* in, int N, Act act, bf16* pre_act,
                              const char* op) {
  forward_24([&](bf16* y) { sp.forward(y, in, ctx_.stream, p_.bias.w); }, out, N, act, pre_act, op);
}

void DeviceLinear::forward_24(const std::function<void(bf16* y)>& product, bf16* out, int N, Act act, bf16* pre_act,
                              const char* op) {
  cudaStream_t s = ctx_.stream;
  const bool gelu = act == Act::gelu;
  bf16* y = gelu && pre_act ? pre_act : out;
  ctx_.marks->mark_product(s, op, 2.0 * N * in_ * out_, true);
  product(y);
  if (gelu) {
    ctx_.marks->mark(s, "gelu fwd");
    gpu::gelu_forward(out, y, int64_t(N) * out_, s);
  }
}

void DeviceLinear::backward_dx_24(gpu::SparseLinear& sp, bf16* dinp, const bf16* dout, int N, const bf16* pre_act,
                                  const char* op) {
  ctx_.marks->mark_product(ctx_.stream, op, 2.0 * N * in_ * out_, true);
  sp.backward(dinp, nullptr, dout, nullptr, false, ctx_.stream);
  gelu_backward_pass(dinp, pre_act, N);
}

void DeviceLinear::gelu_backward_pass(bf16* dinp, const bf16* pre_act, int N) {
  if (!pre_act) return;
  ctx_.marks->mark(ctx_.stream, "gelu bwd");
  gpu::gelu_backward(dinp, pre_act, dinp, int64_t(N) * in_, false, ctx_.stream);
}

// Copies of kind cudaMemcpyDefault: the master halves and moments may be offloaded (pinned
// host memory), which the runtime tells from the pointers.
void DeviceTensorView::to_host(size_t n, std::vector<float>* weights, std::vector<float>* m1, std::vector<float>* m2,
                               cudaStream_t s) const {
  std::vector<uint16_t> hi;
  std::vector<int16_t> lo;
  if (weights) {
    hi.resize(n);
    lo.resize(n);
    CUDA_CHECK(cudaMemcpyAsync(hi.data(), w, sizeof(bf16) * n, cudaMemcpyDefault, s));
    CUDA_CHECK(cudaMemcpyAsync(lo.data(), w_lo, sizeof(int16_t) * n, cudaMemcpyDefault, s));
  }
  for (auto [host, dev] : {std::pair{m1, m}, std::pair{m2, v}})
    if (host) {
      host->resize(n);
      CUDA_CHECK(cudaMemcpyAsync(host->data(), dev, sizeof(float) * n, cudaMemcpyDefault, s));
    }
  CUDA_CHECK(cudaStreamSynchronize(s));
  if (!weights) return;
  weights->resize(n);
  for (size_t i = 0; i < n; ++i) (*weights)[i] = gpu::master_join_bits(hi[i], lo[i]);
}

void DeviceTensorView::from_host(size_t n, const float* weights, const float* m1, const float* m2,
                                 cudaStream_t s) const {
  std::vector<uint16_t> hi(n);
  std::vector<int16_t> lo(n);
  for (size_t i = 0; i < n; ++i) {
    hi[i] = gpu::master_hi_bits(weights[i]);
    lo[i] = gpu::master_lo_bits(weights[i]);
  }
  CUDA_CHECK(cudaMemcpyAsync(w, hi.data(), sizeof(bf16) * n, cudaMemcpyDefault, s));
  CUDA_CHECK(cudaMemcpyAsync(w_lo, lo.data(), sizeof(int16_t) * n, cudaMemcpyDefault, s));
  for (auto [host, dev] : {std::pair{m1, m}, std::pair{m2, v}})
    if (host)
      CUDA_CHECK(cudaMemcpyAsync(dev, host, sizeof(float) * n, cudaMemcpyDefault, s));
    else
      CUDA_CHECK(cudaMemsetAsync(dev, 0, sizeof(float) * n, s));
  CUDA_CHECK(cudaStreamSynchronize(s));  // the host vectors go out of scope
}

void DeviceLinear::set_twin_draws(Linear<float>& twin, uint64_t draws) {
  const std::string key = twin.params().name + ".sparse_dw_draws";
  std::map<std::string, Tensor> state = twin.state();
  Tensor t = Tensor::zeros({1}, DType::f64, key);
  t.data<double>()[0] = double(draws);
  state[key] = t;
  twin.load_state(state);
}

void DeviceLinear::scatter_kept_moments(const std::string& weight_name, const linear_detail::SlotIndex& slots,
                                        size_t n, const NamedValues& m, const NamedValues& v, float* dense_m,
                                        float* dense_v) {
  const auto mi = m.find(weight_name + ".values"), vi = v.find(weight_name + ".values");
  if (mi == m.end() && vi == v.end()) return;
  ESPLAG_CHECK(mi != m.end() && vi != v.end() && mi->second.size() == n && vi->second.size() == n,
               "GPU training: the optimizer state for '", weight_name, ".values' is missing or has the wrong size");
  linear_detail::scatter(dense_m, slots, mi->second.data());
  linear_detail::scatter(dense_v, slots, vi->second.data());
}

const DeviceLinearKind& device_linear_kind(const std::string& kind, const std::string& weight_name) {
  for (const auto& k : device_linear_kinds())
    if (k.name == kind) return k;
  fail("GpuTransformer: ", weight_name, ": Linear kind '", kind, "' is not available on the GPU (",
       device_linear_kind_names([](const DeviceLinearKind&) { return true; }), " are)");
}

std::string device_linear_kind_names(const std::function<bool(const DeviceLinearKind&)>& pick) {
  std::vector<std::string> names;
  for (const auto& k : device_linear_kinds())
    if (pick(k)) names.push_back(k.name);
  std::string s;
  for (size_t i = 0; i < names.size(); ++i)
    s += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return s;
}

void check_device_linear_setting(const GpuTransformer::LinearKindSetting& st, const DeviceLinearKind& kind,
                                 int64_t out, int64_t in, int64_t tokens) {
  ESPLAG_CHECK(!st.slope_masks || kind.takes_slope_masks, "GpuTransformer: ", st.weight_name,
               ": masks given for kind ", st.kind);
  if (kind.check) kind.check(st, out, in);
  ESPLAG_CHECK(!st.mask || kind.takes_mask, "GpuTransformer: ", st.weight_name, ": a mask given for kind ", st.kind);
  ESPLAG_CHECK(!st.mask || st.mask->size() == size_t(out) * size_t(in), "GpuTransformer: ", st.weight_name,
               ": a mask of ", st.mask ? st.mask->size() : 0, " entries for a ", out, "x", in, " weight");
  ESPLAG_CHECK(st.lora_rank == 0 || kind.takes_adapter, "GpuTransformer: ", st.weight_name,
               ": a low-rank adapter (lora_rank ", st.lora_rank, ") is for kind ",
               device_linear_kind_names([](const DeviceLinearKind& k) { return k.takes_adapter; }), " only, not ",
               st.kind);
  ESPLAG_CHECK(st.lora_rank >= 0 && st.lora_rank <= std::min(out, in), "GpuTransformer: ", st.weight_name,
               ": adapter rank ", st.lora_rank, " is outside [0, min(out, in) = ", std::min(out, in), "]");
  ESPLAG_CHECK(!st.sparse_dw || kind.takes_sparse_dw, "GpuTransformer: ", st.weight_name,
               ": sparse_dw (the weight gradient from the MVUE 2:4 of dY^T) is for the kinds ",
               device_linear_kind_names([](const DeviceLinearKind& k) { return k.takes_sparse_dw; }));
  ESPLAG_CHECK(!st.sparse_dw || (out % 64 == 0 && tokens % 64 == 0), "GpuTransformer: ", st.weight_name,
               ": sparse_dw needs the layer's outputs (", out, ") and the micro-batch's tokens (", tokens,
               ") to be multiples of 64");
}

void check_device_linear_change(const GpuTransformer::LinearKindSetting& st, const DeviceLinearKind& kind,
                                int64_t out, int64_t in, int64_t tokens) {
  ESPLAG_CHECK(!kind.takes_mask || st.mask, "GpuTransformer: ", st.weight_name, ": kind ", st.kind,
               " needs its mask (LinearKindSetting::mask)");
  if (kind.check_change) kind.check_change(st, out, in);
  if (!kind.needs_cusparselt) return;
  ESPLAG_CHECK(gpu::cusparselt_available(), "GpuTransformer: ", st.weight_name, ": ", st.kind,
               " on the GPU needs cuSPARSELt: ", gpu::cusparselt_unavailable_reason());
  ESPLAG_CHECK(out % 16 == 0 && in % 16 == 0 && tokens % 16 == 0, "GpuTransformer: ", st.weight_name, ": ", st.kind,
               " needs the layer's shape (", out, "x", in, ") and the micro-batch's tokens (", tokens,
               ") to be multiples of 16 (cuSPARSELt)");
}

std::string sparse_dispatch_summary(const std::vector<GpuTransformer::SparseDispatch>& decisions) {
  // The kinds as the decisions name them, in the order they first appear: the fp8 ways are
  // recorded as "<kind> fp8" and time what their kind's entry says.
  std::vector<std::string> kinds;
  for (const auto& d : decisions)
    if (std::find(kinds.begin(), kinds.end(), d.kind) == kinds.end()) kinds.push_back(d.kind);
  std::string s;
  for (const std::string& kind : kinds) {
    const std::string base = kind.substr(0, kind.find(" fp8"));
    std::string times = DeviceLinearKind{}.dispatch_times;
    for (const auto& k : device_linear_kinds())
      if (k.name == base) times = k.dispatch_times;
    std::string shapes;
    for (const auto& d : decisions) {
      if (d.kind != kind) continue;
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s%lldx%lld: %s (2:4 %.3f ms%s, dense %.3f ms)", shapes.empty() ? "" : "; ",
                    static_cast<long long>(d.out), static_cast<long long>(d.in), d.sparse ? "2:4" : "dense",
                    d.sparse_ms, d.gelu_pass ? " with its GELU pass" : "", d.dense_ms);
      shapes += buf;
    }
    s += (s.empty() ? "" : " | ") + kind + " products by layer shape (" + times + " per step): " + shapes;
  }
  return s;
}

}  // namespace esplag
