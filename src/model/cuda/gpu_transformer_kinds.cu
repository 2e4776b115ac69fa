// GpuTransformer's Linear layers: making them, kind changes (set_linear_kinds) and the
// kind-specific parts of its interface (see model/gpu_transformer.h).
#include <chrono>
#include <cstdio>
#include <set>
#include <tuple>

#include "core/cuda_check.h"
#include "model/cuda/device_linear_semi_sparse_activation.h"
#include "model/cuda/device_linear_slope.h"
#include "model/cuda/gpu_transformer_impl.h"

namespace esplag {

using namespace gpu_model;

void GpuTransformer::make_linears() {
  Impl& im = *impl_;
  DeviceLinearContext& ctx = im.ctx;
  ctx.gemm = im.gemm.get();
  ctx.stream = stream_;
  ctx.marks = &im.marks;
  ctx.tokens = int64_t(max_b_) * max_t_;
  ctx.gelu_mlp = cfg_.mlp == MlpKind::gelu;
  ctx.sparse_dispatch = opt_.sparse_dispatch;
  ctx.precision = opt_.precision;
  ctx.fp8_producers = fp8_producers_run(opt_);
  ctx.swiglu_grad_codes = swiglu_grad_codes(cfg_, opt_);
  ctx.colsum_scratch = im.colsum_scratch;
  ctx.colsum_scratch_bytes = im.colsum_scratch_bytes;
  ctx.fp8_saturated = im.fp8_saturated;
  ctx.fp8_histories = im.fp8_histories.get();
  const DeviceLinearKind& first = device_linear_kinds().front();  // every layer starts as the first kind
  for (int l = 0; l < cfg_.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    Impl::Block& blk = im.blocks[l];
    for (auto [module, slot] : {std::pair{"attn.qkv", &blk.qkv}, std::pair{"attn.proj", &blk.proj},
                                std::pair{"mlp.fc", &blk.fc}, std::pair{"mlp.proj", &blk.mproj}}) {
      const ParamInfo& info = info_named(infos_, b + module + ".weight");
      const int64_t out = info.shape.at(0), in = info.shape.at(1);
      ctx.shapes.push_back({out, in});
      const LinearKindSetting st(info.name, {.kind = first.name});
      *slot = &im.linears[info.name];
      (*slot)->base = first.make({&st, &ctx, out, in, cfg_.bias, {}, 0, nullptr});
    }
  }
}

void GpuTransformer::check_kind_change_allowed() const {
  ESPLAG_CHECK(!(opt_.shard_parameters && state_written_),
               "GpuTransformer: under ZeRO stage 3 (sharded parameters) a layer's kind cannot change once the "
               "weights are set (a recipe's kind changes and adapters need parallel.zero <= 2)");
}

void GpuTransformer::check_shardable(const std::string& weight_name, const DeviceLinear& layer) const {
  // A mask's zeros live in the whole weight, which stage 3 holds only as gathered copies.
  const bool masked = device_linear_kind(layer.kind(), weight_name).takes_mask;
  ESPLAG_CHECK(!opt_.shard_parameters ||
                   (!masked && !layer.after_optimizer_step_op() && layer.extra_tensors().empty()),
               "GpuTransformer: ", weight_name, " is of kind ", layer.kind(), ", which ZeRO stage 3 (sharded ",
               "parameters) cannot train: it keeps a mask over its weights, rewrites them after the update or owns ",
               "extra tensors (use parallel.zero <= 2)");
}

bool GpuTransformer::set_linear_kinds(const std::vector<LinearKindSetting>& settings) {
  check_trains("set_linear_kinds");  // its layers are dense: a teacher takes their dense weights
  Impl& im = *impl_;
  const int64_t tokens = int64_t(max_b_) * max_t_;
  // Where a change spends its time (kind_change_report): each phase ends in a synchronize.
  using clock = std::chrono::steady_clock;
  auto mark = clock::now();
  double phase_s[4] = {};  // checks and state out, layers made, state in, attached
  auto lap = [&](int phase) {
    synchronize();
    const auto now = clock::now();
    phase_s[phase] += std::chrono::duration<double>(now - mark).count();
    mark = now;
  };
  // Everything is checked before anything changes.
  struct Change {
    const LinearKindSetting* setting;
    Impl::Slot* slot;
    const DeviceLinearKind *kind, *was;
    int64_t out, in;
    bool rebuild;  // a new layer (else only its adapter changes)
  };
  std::vector<Change> changes;
  bool relayout = false;  // the stored form of a weight, or an adapter, changes
  for (const auto& st : settings) {
    Impl::Slot* slot = im.find_linear(st.weight_name);
    ESPLAG_CHECK(slot, "GpuTransformer: '", st.weight_name, "' is not the weight of a block Linear layer");
    const DeviceLinearKind& kind = device_linear_kind(st.kind, st.weight_name);
    const ParamInfo& info = info_named(infos_, st.weight_name);
    const int64_t out = info.shape.at(0), in = info.shape.at(1);
    check_device_linear_setting(st, kind, out, in, tokens);
    const DeviceLinearKind& was = device_linear_kind(slot->base->kind(), st.weight_name);
    const bool adapter_change = st.lora_rank != slot->top().adapter_rank();
    const bool keep = slot->base->keeps(st);
    if (keep && !adapter_change) continue;
    if (!keep) check_device_linear_change(st, kind, out, in, tokens);
    relayout = relayout || adapter_change || (!keep && (was.stores_other_weight || kind.stores_other_weight));
    changes.push_back({&st, slot, &kind, &was, out, in, !keep});
  }
  for (const auto& st : settings)  // options that change without a rebuild (slope's schedule)
    if (Impl::Slot* slot = im.find_linear(st.weight_name); slot->base->kind() == st.kind) slot->base->update(st);
  const bool laid_out = !im.stored.empty();  // else deferred (GpuModelOptions::defer_state): laid out now
  if (changes.empty()) {
    if (!laid_out) lay_out_state();
    return false;
  }
  relayout = relayout || !laid_out;
  check_kind_change_allowed();
  synchronize();  // nothing queued may still use a layer that goes away

  // A new layout: the state moves into it on the device, the old one kept until then with
  // the layers whose stored forms it holds. Where the device has no room for both, it goes
  // to the host in the flat layout (the layers' own tensors by name) and comes back.
  // Before any weights were given (state_written_ false) the state is zero: the new layout
  // starts from zero too, with nothing to move.
  const bool moves = relayout && state_written_;
  const bool on_device = moves && room_for_second_state();
  RetiredState old;
  if (on_device)
    for (const auto& [weight, slot] : im.linears) old.layers[weight] = &slot.top();
  auto retire = [&](std::unique_ptr<DeviceLinear>& layer) {
    if (on_device && layer) old.replaced.push_back(std::move(layer));
    layer.reset();
  };
  if (moves) gather_optimizer_state();  // sharded moments move whole (a collective: `moves` is the same on every rank)
  if (moves && !on_device) state_to_host(old);
  lap(0);
  auto setup = [&](const Change& c, const DeviceLinear* previous) {
    return DeviceLinearSetup{c.setting, &im.ctx, c.out, c.in, cfg_.bias,
                             linear_views(c.setting->weight_name, nullptr), step_, previous};
  };
  // The old layers go; a kind made after the new layout stands in as the first kind until
  // then, one that defines the layout is made now (from the layer it replaces).
  for (Change& c : changes) {
    retire(c.slot->adapter);
    if (!c.rebuild || c.kind->build_order == 0) continue;
    std::unique_ptr<DeviceLinear> stand_in = device_linear_kinds().front().make(setup(c, nullptr));
    retire(c.slot->base);
    c.slot->base = std::move(stand_in);
  }
  for (Change& c : changes)
    if (c.rebuild && c.kind->build_order == 0) {
      std::unique_ptr<DeviceLinear> made = c.kind->make(setup(c, c.slot->base.get()));
      retire(c.slot->base);
      c.slot->base = std::move(made);
    }
  for (Change& c : changes)
    if (c.setting->lora_rank > 0) c.slot->adapter = make_device_adapter(setup(c, nullptr), *c.slot->base);
  for (const Change& c : changes)
    if (!c.rebuild) check_shardable(c.setting->weight_name, c.slot->top());
  lap(1);

  if (relayout) {
    lay_out_state(on_device ? &old : nullptr);
    if (on_device)
      move_state_from(old);
    else
      state_from_host(old);  // with nothing to move, the layers' own tensors start at their initial values
    old = RetiredState();
  }
  // A layer that becomes or stops being a kind whose CPU layer trains another tensor (its
  // kept values, "<weight>.values") starts its moments from zero, as the CPU trainer's do.
  for (const Change& c : changes)
    if (c.rebuild && c.kind != c.was && (c.kind->trains_own_tensor || c.was->trains_own_tensor)) {
      const ParamInfo& at = info_named(im.stored, c.setting->weight_name);
      zero_moments(at.offset, at.numel);
    }
  lap(2);
  // The layers made after the layout, in their kinds' order; every new layer attached
  // (masks applied, per-layer dispatch).
  std::vector<const Change*> made;
  for (const Change& c : changes)
    if (c.rebuild) made.push_back(&c);
  std::stable_sort(made.begin(), made.end(),
                   [](const Change* a, const Change* b) { return a->kind->build_order < b->kind->build_order; });
  for (const Change* c : made) {
    if (c->kind->build_order > 0) c->slot->base = c->kind->make(setup(*c, nullptr));
    check_shardable(c->setting->weight_name, c->slot->top());
    c->slot->base->attach();
  }
  // Scratch nobody needs any more.
  std::set<std::string> used;
  for (const auto& [weight, slot] : im.linears) slot.top().shared_parts(used);
  im.ctx.scratch.keep_only(used);
  // The captured steps baked the old products in.
  im.step_graphs.clear();
  im.adam_graphs.clear();
  lap(3);
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%zu layers changed in %.2f s (checks and state out %.2f s, layers made %.2f s, state %s %.2f s, "
                "attached %.2f s)",
                changes.size(), phase_s[0] + phase_s[1] + phase_s[2] + phase_s[3], phase_s[0], phase_s[1],
                on_device ? "moved on the device" : moves ? "back from the host" : relayout ? "laid out" : "kept",
                phase_s[2], phase_s[3]);
  kind_change_report_ = buf;
  return true;
}

DeviceLinear& GpuTransformer::linear(const std::string& weight_name) {
  Impl::Slot* slot = impl_->find_linear(weight_name);
  ESPLAG_CHECK(slot, "GpuTransformer: '", weight_name, "' is not the weight of a block Linear layer");
  return slot->top();
}

std::string GpuTransformer::linear_kind(const std::string& weight_name) const {
  const Impl::Slot* slot = impl_->find_linear(weight_name);
  ESPLAG_CHECK(slot, "GpuTransformer: '", weight_name, "' is not the weight of a block Linear layer");
  return slot->base->kind();
}

ActivationSparsity GpuTransformer::activation_sparsity(const std::string& weight_name) const {
  const Impl::Slot* slot = impl_->find_linear(weight_name);
  const auto* layer = slot ? dynamic_cast<const DeviceSemiSparseActivationLinear*>(slot->base.get()) : nullptr;
  ESPLAG_CHECK(layer, "GpuTransformer: ", weight_name, " is not a semi_sparse_activation layer");
  return layer->pattern();
}

GpuTransformer::SlopeState GpuTransformer::slope_state(const std::string& weight_name) const {
  const Impl::Slot* slot = impl_->find_linear(weight_name);
  const auto* layer = slot ? dynamic_cast<const DeviceSlopeLinear*>(slot->base.get()) : nullptr;
  ESPLAG_CHECK(layer, "GpuTransformer: ", weight_name, " is not a slope layer");
  return layer->state();
}

int GpuTransformer::lora_rank(const std::string& weight_name) const {
  const Impl::Slot* slot = impl_->find_linear(weight_name);
  ESPLAG_CHECK(slot, "GpuTransformer: '", weight_name, "' is not the weight of a block Linear layer");
  return slot->top().adapter_rank();
}

namespace {

// The storage layout's entries of a layer's adapter: L, then R.
std::pair<const ParamInfo*, const ParamInfo*> lora_entries(const std::vector<ParamInfo>& stored,
                                                           const std::string& weight_name) {
  const std::string module = module_of(weight_name);
  return {&info_named(stored, module + ".lora_l"), &info_named(stored, module + ".lora_r")};
}

}  // namespace

GpuTransformer::LoraState GpuTransformer::lora_state(const std::string& weight_name) const {
  const int rank = lora_rank(weight_name);
  ESPLAG_CHECK(rank > 0, "GpuTransformer: ", weight_name, " has no low-rank adapter");
  const auto [l, r] = lora_entries(impl_->stored, weight_name);
  LoraState st;
  st.rank = rank;
  for (const auto& [info, value, m, v, grad] :
       {std::tuple{l, &st.l, &st.m_l, &st.v_l, &st.grad_l}, std::tuple{r, &st.r, &st.m_r, &st.v_r, &st.grad_r}})
    for (const auto& [field, out] : {std::pair{StateField::weight, value}, std::pair{StateField::m, m},
                                     std::pair{StateField::v, v}, std::pair{StateField::grad, grad}}) {
      if (field == StateField::grad && impl_->grad_shard) continue;  // sharded: no rank holds them
      out->resize(info->numel);
      stored_to_host(field, info->offset, info->numel, out->data());
    }
  return st;
}

void GpuTransformer::set_lora_state(const std::string& weight_name, const LoraState& st) {
  const int rank = lora_rank(weight_name);
  ESPLAG_CHECK(rank > 0 && st.rank == rank, "GpuTransformer: ", weight_name, ": adapter of rank ", st.rank,
               " given for a layer whose adapter has rank ", rank);
  const auto [l, r] = lora_entries(impl_->stored, weight_name);
  for (const auto& [info, value, m, v, what] : {std::tuple{l, &st.l, &st.m_l, &st.v_l, "L"},
                                                std::tuple{r, &st.r, &st.m_r, &st.v_r, "R"}}) {
    ESPLAG_CHECK(value->size() == info->numel && (m->empty() || m->size() == info->numel) &&
                     (v->empty() || v->size() == info->numel),
                 "GpuTransformer: ", weight_name, ": adapter ", what, " of ", value->size(), " values (moments ",
                 m->size(), ", ", v->size(), ") for ", info->numel);
    const std::vector<float> zeros(m->empty() || v->empty() ? info->numel : 0, 0.f);
    stored_from_host(StateField::weight, info->offset, info->numel, value->data());
    stored_from_host(StateField::m, info->offset, info->numel, m->empty() ? zeros.data() : m->data());
    stored_from_host(StateField::v, info->offset, info->numel, v->empty() ? zeros.data() : v->data());
  }
  synchronize();
}

const std::vector<GpuTransformer::SparseDispatch>& GpuTransformer::sparse_dispatch() const {
  return impl_->ctx.dispatch;
}

std::string GpuTransformer::sparse_dispatch_summary() const {
  return esplag::sparse_dispatch_summary(impl_->ctx.dispatch);
}

bool GpuTransformer::sparse_dw(const std::string& weight_name) const {
  const Impl::Slot* slot = impl_->find_linear(weight_name);
  ESPLAG_CHECK(slot, "GpuTransformer: '", weight_name, "' is not the weight of a block Linear layer");
  return slot->base->sparse_dw();
}

uint64_t GpuTransformer::sparse_dw_draws(const std::string& weight_name) const {
  const Impl::Slot* slot = impl_->find_linear(weight_name);
  ESPLAG_CHECK(slot, "GpuTransformer: '", weight_name, "' is not the weight of a block Linear layer");
  return slot->base->sparse_dw_draws();
}

size_t GpuTransformer::sparse_device_bytes() const {
  size_t n = impl_->ctx.scratch.bytes();
  for (const auto& [weight, slot] : impl_->linears) n += slot.top().device_bytes();
  return n;
}

}  // namespace esplag
