#include "model/cuda/device_linear_slope.h"

#include <atomic>
#include <bit>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/cuda/device_linear_semi_sparse.h"
#include "model/cuda/step_marks.h"
#include "model/cuda/timing_operands.h"
#include "model/linear_slope.h"
#include "sparse/masks.h"
#include "ops/gpu_fused.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/kept_values.h"

namespace esplag {

namespace {

constexpr const char* kScratchName = "slope";

}  // namespace

// W1 expanded from the kept values (w1), W2 and W2ᵀ (SparseLinearOptions::slope_scratch)
// and the dense fp32 dW, for the largest block Linear; one stream orders their uses.
struct DeviceSlopeLinear::Scratch : SharedScratch::Part {
  DeviceArena arena;
  bf16 *w1 = nullptr, *w2 = nullptr;
  float* dw = nullptr;
  size_t bytes() const override { return arena.capacity(); }
};

DeviceSlopeLinear::DeviceSlopeLinear(const DeviceLinearSetup& s)
    : DeviceLinear("slope", s), scratch_(s.context->scratch.get<Scratch>(kScratchName, [&] {
        const size_t largest = s.context->largest([](int64_t out, int64_t in) { return size_t(out * in); });
        const size_t a = DeviceArena::kDefaultAlignment;
        auto p = std::make_unique<Scratch>();
        p->arena = DeviceArena(3 * (sizeof(bf16) * largest + a) + sizeof(float) * largest + a, "slope scratch");
        p->w2 = p->arena.allocate_array<bf16>("W2, W2^T", 2 * largest);
        p->w1 = p->arena.allocate_array<bf16>("W1", largest);
        p->dw = p->arena.allocate_array<float>("dW", largest);
        return p;
      })) {
  const Setting& st = *s.setting;
  cudaStream_t stream = ctx_.stream;
  if (ctx_.precision.fp8) {
    ESPLAG_CHECK(!st.sparse_dw, weight_name_,
                 ": sparse_dw with train.precision fp8 is trained by the CPU's emulation only so far (docs/fp8.md)");
    ESPLAG_CHECK(gpu::cusparselt_available(), weight_name_, ": slope with train.precision fp8 needs cuSPARSELt (",
                 gpu::cusparselt_unavailable_reason(), ")");
    fp8_ = std::make_unique<Fp8SparseProducts>(ctx_, weight_name_, out_, in_, s.bias);
  }
  gpu::SparseLinearOptions o;
  o.kind = gpu::SparseLinearKind::slope;
  o.bias = s.bias;
  o.slope_scratch = scratch_.w2;
  o.slope_weight_is_w1 = true;  // the layer reads w1, expanded from the kept values
  o.sparse_dw = st.sparse_dw;
  o.dw_seed = st.dw_seed;
  if (st.sparse_dw) o.dw_scratch = sparse_dw_scratch(ctx_);
  // A slope layer rebuilt as slope (sparse_dw turned on or off) keeps its masks unless given
  // new ones: its weight is stored as kept values, so they cannot be chosen again.
  const GpuTransformer::SlopeState* masks = st.slope_masks;
  GpuTransformer::SlopeState kept;
  if (auto* prev = dynamic_cast<const DeviceSlopeLinear*>(s.previous); prev && !masks) {
    kept = prev->state();
    masks = &kept;
  }
  // The masks come from W as it is now (dense: the layer was not slope), the forward one
  // row-wise 2:4, the backward one W1's double pruning, unless given.
  const size_t n_w = size_t(out_) * size_t(in_);
  if (masks)
    CUDA_CHECK(cudaMemsetAsync(scratch_.w1, 0, sizeof(bf16) * n_w, stream));
  else
    CUDA_CHECK(cudaMemcpyAsync(scratch_.w1, p_.weight.w, sizeof(bf16) * n_w, cudaMemcpyDeviceToDevice, stream));
  sp_ = std::make_unique<gpu::SparseLinear>(o, out_, in_, ctx_.tokens, scratch_.w1, stream);
  if (st.sparse_dw) sp_->set_dw_seed(st.dw_seed, st.dw_draws);
  if (masks) sp_->set_tile_masks(masks->forward_tiles.data(), masks->backward_tiles.data(), stream);
  mask_change_freq_ = st.mask_change_freq;
  refresh_step_ = masks ? masks->refresh_step : s.step;
}

DeviceSlopeLinear::~DeviceSlopeLinear() = default;

GpuTransformer::SlopeState DeviceSlopeLinear::state() const {
  const size_t tiles = size_t(out_ / 4) * size_t(in_ / 4);
  GpuTransformer::SlopeState st;
  st.forward_tiles.resize(tiles);
  st.backward_tiles.resize(tiles);
  CUDA_CHECK(cudaMemcpyAsync(st.forward_tiles.data(), sp_->forward_tile_mask(), 2 * tiles, cudaMemcpyDeviceToHost,
                             ctx_.stream));
  CUDA_CHECK(cudaMemcpyAsync(st.backward_tiles.data(), sp_->backward_tile_mask(), 2 * tiles, cudaMemcpyDeviceToHost,
                             ctx_.stream));
  CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  // A refresh over zero-valued W1 entries may keep pruned positions (ties among zeros):
  // their W2 is 0 either way, and the mask reported stays inside the forward one.
  for (size_t t = 0; t < tiles; ++t) st.backward_tiles[t] &= st.forward_tiles[t];
  st.refresh_step = refresh_step_;
  st.mask_change_freq = mask_change_freq_;
  return st;
}

void DeviceSlopeLinear::check_masks(const std::string& weight_name, const GpuTransformer::SlopeState& st,
                                    int64_t out, int64_t in) {
  const int64_t groups = in / 4;
  const size_t tiles = size_t(out / 4) * size_t(groups);
  ESPLAG_CHECK(st.forward_tiles.size() == tiles && st.backward_tiles.size() == tiles, "GpuTransformer: ", weight_name,
               ": slope masks of ", st.forward_tiles.size(), " and ", st.backward_tiles.size(), " tiles for a ", out,
               "x", in, " weight (", tiles, " tiles)");
  auto valid = [&](size_t t) {
    const unsigned f = st.forward_tiles[t], b = st.backward_tiles[t];
    bool ok = (b & ~f) == 0;
    for (int j = 0; j < 4 && ok; ++j)  // rows of the forward mask, columns of the backward one
      ok = std::popcount((f >> (4 * j)) & 0xFu) == 2 && std::popcount(b & (0x1111u << j)) <= 2;
    return ok;
  };
  // The first bad tile (in parallel: llama-1b's layers hold 70M tiles), then its message.
  std::atomic<size_t> first_bad{tiles};
  parallel_for(int64_t(tiles), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (!valid(size_t(t))) {
        size_t seen = first_bad.load();
        while (size_t(t) < seen && !first_bad.compare_exchange_weak(seen, size_t(t))) {
        }
        return;
      }
  }, 1 << 16);
  if (first_bad.load() < tiles) {
    const size_t t = first_bad.load();
    const unsigned f = st.forward_tiles[t], b = st.backward_tiles[t];
    fail("GpuTransformer: ", weight_name, ": slope mask tile ", t, " (row ", t / groups * 4, ", column ",
         t % groups * 4, ") is not 2:4 (forward 0x", std::hex, f, ", backward 0x", b, std::dec,
         "; the forward mask keeps exactly 2 of every 4 along each row, the backward one lies inside it, "
         "2 of every 4 down each column)");
  }
}

void DeviceSlopeLinear::weight_to_stored(float* stored, const float* dense, int64_t row0, int64_t rows) const {
  const uint16_t* tiles = sp_->forward_tile_mask() + (row0 / 4) * (in_ / 4);
  gpu::gather_kept_24(stored, dense, tiles, rows, in_, false, ctx_.stream);
}

void DeviceSlopeLinear::weight_from_stored(float* dense, const float* stored, int64_t row0, int64_t rows) const {
  const uint16_t* tiles = sp_->forward_tile_mask() + (row0 / 4) * (in_ / 4);
  gpu::scatter_kept_24(dense, stored, tiles, rows, in_, ctx_.stream);
}

void DeviceSlopeLinear::shared_parts(std::set<std::string>& used) const {
  used.insert(kScratchName);
  if (sp_->sparse_dw()) used.insert(kSparseDwScratch);
  if (fp8_) Fp8SparseProducts::shared_parts(used);
}

const bf16* DeviceSlopeLinear::expand_w1() const {
  gpu::scatter_kept_24(scratch_.w1, p_.weight.w, sp_->forward_tile_mask(), out_, in_, ctx_.stream);
  return scratch_.w1;
}

const bf16* DeviceSlopeLinear::expand_w2t() const {
  expand_w1();
  return sp_->refill_backward_weight_t(ctx_.stream);
}

void DeviceSlopeLinear::prepare(bool refresh) {
  if (fp8_) {  // from the kept values, or W1 and W2ᵀ dense (a refresh first chooses the backward mask)
    if (!refresh && fp8_->prepare_kept(p_.weight.w, sp_->forward_tile_mask(), sp_->backward_tile_mask())) return;
    cudaStream_t s = ctx_.stream;
    ctx_.marks->mark(s, "sparse prepare (2:4 prune)");
    expand_w1();
    if (refresh) sp_->prepare(s, true);
    fp8_->prepare(scratch_.w1, sp_->refill_backward_weight_t(s));
    return;
  }
  // From the stored kept values in one pass; a refresh (or the library's layouts) needs the
  // dense W1. With dense products they expand W1 and W2ᵀ themselves.
  if (dense_products_ && !refresh) return;
  if (refresh || !sp_->prepare_from_kept(p_.weight.w, ctx_.stream)) {
    expand_w1();
    sp_->prepare(ctx_.stream, refresh);
  }
}

void DeviceSlopeLinear::attach() {
  if (!ctx_.sparse_dispatch) return;  // now that the kept values are stored
  using Gelu = DeviceLinearContext::GeluPasses;
  if (!fp8_)
    dense_products_ =
        !ctx_.sparse_is_faster("slope", weight_name_, out_, in_, Gelu::fc_and_dx, [&] { return time_products(); });
  else if (fp8_->can_be_sparse())  // both fp8 ways run the GELU passes
    fp8_->set_dense(
        !ctx_.sparse_is_faster("slope fp8", weight_name_, out_, in_, Gelu::none, [&] { return time_fp8_products(); }));
}

// Both ways of the per-step fp8 work (Fp8SparseProducts::time_ways), prepare() as a step runs it.
gpu::SparseLinear::ProductTimes DeviceSlopeLinear::time_fp8_products() {
  return fp8_->time_ways([&] { prepare(false); }, [&] { return expand_w1(); }, [&] { return expand_w2t(); },
                         p_.bias.w);
}

// Both ways of the per-step products (median of 10 after two untimed rounds that tune them)
// on scratch inputs: the 2:4 way as prepare and the step run it (both compressed copies from
// the kept values, or W1 expanded and compressed; the forward and dX 2:4 products), the dense
// way as a layer with dense products runs it (W1 expanded for cuBLASLt's forward, W1 and W2ᵀ
// again for its dX). The 2:4 way runs last, so the layer's compressed copies are its weight's
// afterwards. Synchronises the stream.
gpu::SparseLinear::ProductTimes DeviceSlopeLinear::time_products() {
  gpu::SparseLinear& sp = *sp_;
  cudaStream_t s = ctx_.stream;
  const int N = static_cast<int>(sp.tokens()), out = static_cast<int>(out_), in = static_cast<int>(in_);
  const TimingOperands o(N, in, out, s);
  gpu::SparseLinear::ProductTimes t;
  t.dense_ms = median_event_ms(
      [&](int) {
        ctx_.gemm->forward(o.y, o.x, expand_w1(), p_.bias.w, N, in, out, s);
        ctx_.gemm->forward(o.dx, o.dy, expand_w2t(), nullptr, N, out, in, s);
      },
      2, 10, s);
  t.sparse_ms = median_event_ms(
      [&](int) {
        if (!sp.prepare_from_kept(p_.weight.w, s)) {
          expand_w1();
          sp.prepare(s, false);
        }
        sp.forward(o.y, o.x, s, p_.bias.w);
        sp.backward(o.dx, nullptr, o.dy, nullptr, false, s);
      },
      2, 10, s);
  return t;
}

void DeviceSlopeLinear::forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) {
  if (fp8_) return fp8_->forward(out, in, p_.bias.w, N, act, pre_act, [&] { return expand_w1(); }, op);
  if (sparse_for(N)) return forward_24(*sp_, out, in, N, act, pre_act, op);
  ctx_.marks->mark(ctx_.stream, op, 2.0 * N * in_ * out_);
  ctx_.gemm->forward(out, in, expand_w1(), p_.bias.w, N, int(in_), int(out_), ctx_.stream, act, pre_act);
}

void DeviceSlopeLinear::backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) {
  if (fp8_) {
    fp8_->backward_dx(dinp, dout, N, [&] { return expand_w2t(); }, op);
    return gelu_backward_pass(dinp, pre_act, N);
  }
  if (sparse_for(N)) return backward_dx_24(*sp_, dinp, dout, N, pre_act, op);
  // dinp = dout · W2 as the forward-form product of W2ᵀ [K, OC], made again now (the slope
  // layers share the scratch it lives in).
  cudaStream_t s = ctx_.stream;
  ctx_.marks->mark(s, "sparse prepare (2:4 prune + compress)");
  const bf16* w2t = expand_w2t();
  ctx_.marks->mark(s, op, 2.0 * N * in_ * out_);
  ctx_.gemm->forward(dinp, dout, w2t, nullptr, N, int(out_), int(in_), s);
  gelu_backward_pass(dinp, pre_act, N);
}

gpu::PendingScale DeviceSlopeLinear::forward_leaving_scale(bf16* out, const bf16* in, int N, const char* op) {
  if (!fp8_) return DeviceLinear::forward_leaving_scale(out, in, N, op);
  return fp8_->forward_leaving_scale(out, in, p_.bias.w, N, [&] { return expand_w1(); }, op);
}

gpu::PendingScale DeviceSlopeLinear::backward_dx_leaving_scale(bf16* dinp, const bf16* dout, int N, const char* op) {
  if (!fp8_) return DeviceLinear::backward_dx_leaving_scale(dinp, dout, N, op);
  return fp8_->backward_dx_leaving_scale(dinp, dout, N, [&] { return expand_w2t(); }, op);
}

void DeviceSlopeLinear::backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad,
                                    const char* op) {
  // The dense dW (or sparse_dw's 2:4 product of the MVUE of doutᵀ, one draw) into the
  // scratch, its kept positions gathered into the stored gradient; the bias gradient from
  // column sums.
  const int K = int(in_), OC = int(out_);
  cudaStream_t s = ctx_.stream;
  ctx_.marks->mark(s, op, 2.0 * N * K * OC);
  if (fp8_)
    fp8_->backward_dw(scratch_.dw, dout, inp, N, false, op);
  else if (sp_->sparse_dw() && sp_->tokens() == N)
    sp_->backward(nullptr, scratch_.dw, dout, inp, false, s);
  else
    ctx_.gemm->backward_weight(scratch_.dw, nullptr, dout, inp, N, K, OC, false, s);
  if (bias_grad && p_.bias.grad) {
    ctx_.marks->mark(s, "bias grad");
    gpu::column_sum_add(p_.bias.grad, dout, N, OC, ctx_.colsum_scratch, ctx_.colsum_scratch_bytes, s);
  }
  // Traced as part of the Linear's backward ("blocks.3.mlp.fc.bwd.dw.gather").
  ctx_.marks->mark_part(s, "slope grad gather", 0, op, ".gather");
  gpu::gather_kept_24(p_.weight.grad, scratch_.dw, sp_->forward_tile_mask(), OC, K, accumulate, s);
}

// --- the CPU twin -------------------------------------------------------------------------

void DeviceSlopeLinear::setting_from_twin(const Linear<float>& twin, int64_t step, bool masks, Setting& s,
                                          TwinMasks& held) {
  const SlopeLinear<float>& t = twin_as<SlopeLinear>(twin, "slope");
  s.mask_change_freq = t.mask_change_freq();
  s.lora_rank = t.lora_rank();  // its values follow (extras_from_twin)
  if (const MvueWeightGrad<float>& dw = t.weight_grad(); dw.on()) {
    s.sparse_dw = true;
    s.dw_seed = dw.base_seed();
    s.dw_draws = dw.draws();
  }
  if (!masks) return;
  // A twin built for the step about to run (refresh step -1) counts as refreshed at it, as
  // on_step_begin does.
  held.slope.forward_tiles = t.forward_tiles();  // from the metadata: the twin holds no byte mask
  held.slope.backward_tiles = t.backward_tiles();
  held.slope.refresh_step = t.refresh_step() < 0 ? step : t.refresh_step();
  held.slope.mask_change_freq = t.mask_change_freq();
  s.slope_masks = &held.slope;
}

void DeviceSlopeLinear::to_twin(Linear<float>& twin, const TwinCopy& c) const {
  using namespace linear_detail;
  SlopeLinear<float>& t = twin_as<SlopeLinear>(twin, "slope");
  const GpuTransformer::SlopeState st = state();
  // The kept values and their moments are W1's, m's and v's at the forward mask's slots.
  const int64_t rows = t.forward_weight().rows, cols = t.forward_weight().cols;
  const SlotIndex slots = slot_index(t.forward_weight());
  const std::string values = weight_name_ + ".values";
  gather(t.values().data(), slots, c.weight, nullptr);
  if (c.m) {
    for (auto [dense, named] : {std::pair{c.m, c.named_m}, std::pair{c.v, c.named_v}}) {
      std::vector<float>& out = (*named)[values];
      out.resize(t.values().size());
      gather(out.data(), slots, dense, nullptr);
    }
  }
  // The backward mask as the CPU keeps it: the metadata of W2ᵀ [cols, rows].
  const cpu::Mask bwd = cpu::mask_from_tile_bits(st.backward_tiles, rows, cols);
  cpu::Mask bwd_t(bwd.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t col = 0; col < cols; ++col) bwd_t[col * rows + r] = bwd[r * cols + col];
  const std::vector<float> zeros(bwd.size(), 0.f);
  const Compressed24T<float> w2t = compress_24_masked(zeros.data(), bwd_t.data(), cols, rows, weight_name_);
  std::map<std::string, Tensor> state = t.state();
  state[weight_name_ + ".backward_meta"] =
      u16_tensor(weight_name_ + ".backward_meta", w2t.meta, {cols, w2t.meta_stride()});
  Tensor step = Tensor::zeros({1}, DType::f64, weight_name_ + ".refresh_step");
  step.data<double>()[0] = double(st.refresh_step);
  state[weight_name_ + ".refresh_step"] = step;
  if (t.sparse_dw()) {
    Tensor draws = Tensor::zeros({1}, DType::f64, weight_name_ + ".sparse_dw_draws");
    draws.data<double>()[0] = double(sparse_dw_draws());
    state[weight_name_ + ".sparse_dw_draws"] = draws;
  }
  t.load_state(state);  // rebuilds the flat weight and the backward copy from the values
}

bool DeviceSlopeLinear::moments_from_twin(const Linear<float>& twin, const NamedValues& m, const NamedValues& v,
                                          float* dense_m, float* dense_v) const {
  const SlopeLinear<float>& t = twin_as<SlopeLinear>(twin, "slope");
  scatter_kept_moments(weight_name_, linear_detail::slot_index(t.forward_weight()), t.forward_weight().values.size(),
                       m, v, dense_m, dense_v);
  return true;
}

}  // namespace esplag
