// GpuStep: train.device=cuda (see train/gpu_step.h).
#include "train/gpu_step.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/gpu_transformer.h"
#include "model/linear_kinds.h"
#include "model/linear_masked.h"
#include "model/linear_registry.h"
#include "model/linear_semi_sparse.h"
#include "model/linear_slope.h"
#include "model/linear_vnm.h"
#include "sparse/masks.h"

namespace esplag {

namespace {

// What the device keeps of the steps between two reads by the host.
struct StepHealth {
  double loss_sum;     // Σ of the running step's micro-batch losses
  double loss;         // mean loss of the last finished step
  long long bad_step;  // first step (1-based) whose loss was not finite; 0: none
  double bad_loss;     // its loss
};

// One thread each: the bookkeeping of a step costs two tiny launches per micro-batch
// instead of a host round trip.
__global__ void add_micro_loss_kernel(StepHealth* h, const double* micro_loss, int first) {
  h->loss_sum = (first ? 0.0 : h->loss_sum) + *micro_loss;
}

__global__ void finish_step_kernel(StepHealth* h, int micro_batches, long long step) {
  const double loss = h->loss_sum / micro_batches;  // as the CPU: the sum in order, then one division
  h->loss = loss;
  if (!isfinite(loss) && h->bad_step == 0) {
    h->bad_step = step;
    h->bad_loss = loss;
  }
}

SlopeLinear<float>* host_slope(Transformer<float>& host, const std::string& name) {
  return dynamic_cast<SlopeLinear<float>*>(&host.linear(name));
}

// A host layer that trains its kept values ("<weight>.values": slope, vnm) instead of its
// flat weight: where they sit in the dense weight, and the values themselves. Null for
// the others.
struct KeptValues {
  linear_detail::SlotIndex slots;
  std::vector<float>* values = nullptr;
};
std::optional<KeptValues> host_kept_values(Transformer<float>& host, const std::string& name) {
  if (SlopeLinear<float>* sl = host_slope(host, name))
    return KeptValues{linear_detail::slot_index(sl->forward_weight()), &sl->values()};
  if (auto* vl = dynamic_cast<VnmLinear<float>*>(&host.linear(name)))
    return KeptValues{linear_detail::slot_index(vl->weight()), &vl->values()};
  return std::nullopt;
}

// The sparse dW estimator of a host layer (semi_sparse or slope), or null for the others.
const MvueWeightGrad<float>* host_weight_grad(Transformer<float>& host, const std::string& name) {
  if (const auto* sl = host_slope(host, name)) return &sl->weight_grad();
  if (const auto* ss = dynamic_cast<const SemiSparseLinear<float>*>(&host.linear(name))) return &ss->weight_grad();
  return nullptr;
}

// Sets a host layer's sparse dW draw count (through its saved state, as a checkpoint would).
void set_host_draws(Linear<float>& l, const std::string& name, uint64_t draws) {
  std::map<std::string, Tensor> state = l.state();
  Tensor t = Tensor::zeros({1}, DType::f64, name + ".sparse_dw_draws");
  t.data<double>()[0] = double(draws);
  state[name + ".sparse_dw_draws"] = t;
  l.load_state(state);
}

// A host slope layer's masks and schedule as the GPU model takes them; a layer built for
// the step about to run (refresh step -1) counts as refreshed at it, as on_step_begin does.
GpuTransformer::SlopeState gpu_slope_state(const SlopeLinear<float>& l, int64_t step) {
  const int64_t rows = l.forward_weight().rows, cols = l.forward_weight().cols;
  GpuTransformer::SlopeState st;
  st.forward_tiles = cpu::tile_bits(l.forward_mask(), rows, cols);
  st.backward_tiles = cpu::tile_bits(l.backward_mask(), rows, cols);
  st.refresh_step = l.refresh_step() < 0 ? step : l.refresh_step();
  st.mask_change_freq = l.mask_change_freq();
  return st;
}

// The GPU layer `name` into the host slope layer (the kept values, "<name>.values", and its
// masks): the values and their moments are W1's, m's and v's at the forward mask's slots
// (the GPU's host copies in the flat layout, dense with zeros where pruned: [rows, cols]
// at the weight's offset), the backward mask the GPU's. Without m (null) the moments are
// left alone.
void slope_to_host(SlopeLinear<float>& l, const std::string& name, const GpuTransformer::SlopeState& st,
                   uint64_t dw_draws, const float* w1, const float* m, const float* v, std::vector<float>* m_values,
                   std::vector<float>* v_values) {
  using namespace linear_detail;
  const int64_t rows = l.forward_weight().rows, cols = l.forward_weight().cols;
  const SlotIndex slots = slot_index(l.forward_weight());
  gather(l.values().data(), slots, w1, nullptr);
  if (m) {
    m_values->resize(l.values().size());
    v_values->resize(l.values().size());
    gather(m_values->data(), slots, m, nullptr);
    gather(v_values->data(), slots, v, nullptr);
  }
  // The backward mask as the CPU keeps it: the metadata of W2ᵀ [cols, rows].
  const cpu::Mask bwd = cpu::mask_from_tile_bits(st.backward_tiles, rows, cols);
  cpu::Mask bwd_t(bwd.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) bwd_t[c * rows + r] = bwd[r * cols + c];
  const std::vector<float> zeros(bwd.size(), 0.f);
  const Compressed24T<float> w2t = compress_24_masked(zeros.data(), bwd_t.data(), cols, rows, name);
  std::map<std::string, Tensor> state = l.state();
  state[name + ".backward_meta"] = u16_tensor(name + ".backward_meta", w2t.meta, {cols, w2t.meta_stride()});
  Tensor step = Tensor::zeros({1}, DType::f64, name + ".refresh_step");
  step.data<double>()[0] = double(st.refresh_step);
  state[name + ".refresh_step"] = step;
  if (l.sparse_dw()) {
    Tensor draws = Tensor::zeros({1}, DType::f64, name + ".sparse_dw_draws");
    draws.data<double>()[0] = double(dw_draws);
    state[name + ".sparse_dw_draws"] = draws;
  }
  l.load_state(state);  // rebuilds the flat weight and the backward copy from the values
}

// The masks the settings of host_kind_settings point into.
struct HeldMasks {
  std::vector<GpuTransformer::SlopeState> slope;
  std::vector<std::vector<uint8_t>> vnm;
};

// The GPU kinds of the host model's block linears, for one set_linear_kinds call (`who`
// names the caller in errors). Slope, masked and vnm layers for which `give_masks(name)`
// holds take the host's masks (slope: refresh step `step` when the host has not refreshed
// yet), kept in `held` (or the host layer's own), which the settings point into and which
// must outlive them.
std::vector<GpuTransformer::LinearKindSetting> host_kind_settings(
    Transformer<float>& host, const char* who, int64_t step, const std::function<bool(const std::string&)>& give_masks,
    HeldMasks& held) {
  const auto names = host.linear_names();
  std::vector<GpuTransformer::LinearKindSetting> settings;
  std::vector<bool> gives(names.size());
  for (size_t i = 0; i < names.size(); ++i) gives[i] = give_masks(names[i]);
  // The slope layers' masks in tile bits, layers in parallel (a pass over every weight).
  std::vector<GpuTransformer::SlopeState>& masks = held.slope;
  masks.assign(names.size(), {});  // by layer; the settings point into them
  parallel_tasks(int64_t(names.size()), [&](int64_t i) {
    if (SlopeLinear<float>* sl = gives[size_t(i)] ? host_slope(host, names[size_t(i)]) : nullptr)
      masks[size_t(i)] = gpu_slope_state(*sl, step);
  });
  held.vnm.clear();
  held.vnm.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    const std::string kind = host.linear(name).kind();
    ESPLAG_CHECK(gpu_trains_kind(kind), who, ": ", name, " is of kind ", kind, "; ", gpu_kinds_note());
    if (SlopeLinear<float>* sl = host_slope(host, name)) {
      const GpuTransformer::SlopeState* st = gives[i] ? &masks[i] : nullptr;
      settings.push_back({name, kind, sl->mask_change_freq(), st});
      settings.back().lora_rank = sl->lora_rank();  // its values follow (adapter_to_gpu)
    } else if (const auto* ml = dynamic_cast<const MaskedLinear<float>*>(&host.linear(name))) {
      settings.push_back({name, kind});
      if (gives[i]) settings.back().mask = &ml->mask();
    } else if (const auto* vl = dynamic_cast<const VnmLinear<float>*>(&host.linear(name))) {
      settings.push_back({name, kind});
      if (gives[i]) settings.back().mask = &held.vnm.emplace_back(vl->mask());
    } else {
      settings.push_back({name, kind});
      if (const auto* al = dynamic_cast<const SemiSparseActivationLinear<float>*>(&host.linear(name)))
        settings.back().activation = al->activation();
    }
    // sparse_dw: the host's base seed and draws, so the GPU goes on with the CPU's sequence.
    if (const MvueWeightGrad<float>* dw = host_weight_grad(host, name); dw && dw->on()) {
      settings.back().sparse_dw = true;
      settings.back().dw_seed = dw->base_seed();
      settings.back().dw_draws = dw->draws();
    }
  }
  return settings;
}

// The names of a host slope layer's adapter tensors (its owned parameters "<module>.lora_l"
// and "<module>.lora_r"), as the trainer keys their moments.
std::pair<std::string, std::string> lora_names(SlopeLinear<float>& l) {
  std::pair<std::string, std::string> names;
  for (const auto& p : l.owned_params()) {
    if (p.value == l.lora_l().data()) names.first = p.name;
    if (p.value == l.lora_r().data()) names.second = p.name;
  }
  return names;
}

// A host slope layer's adapter into the GPU model: its values, and its moments where the
// maps hold them (else zero, as for an adapter the trainer has not stepped yet).
void adapter_to_gpu(GpuTransformer& g, SlopeLinear<float>& l, const std::string& name, const Moments* m = nullptr,
                    const Moments* v = nullptr) {
  GpuTransformer::LoraState st;
  st.rank = l.lora_rank();
  st.l = l.lora_l();
  st.r = l.lora_r();
  const auto [ln, rn] = lora_names(l);
  auto moment = [](const Moments* ms, const std::string& n) {
    if (!ms) return std::vector<float>{};
    const auto it = ms->find(n);
    return it == ms->end() ? std::vector<float>{} : it->second;
  };
  st.m_l = moment(m, ln);
  st.v_l = moment(v, ln);
  st.m_r = moment(m, rn);
  st.v_r = moment(v, rn);
  g.set_lora_state(name, st);
}

GpuModelOptions model_options(const TrainConfig& cfg) {
  GpuModelOptions o;
  o.extra_arena_bytes = 2 * DeviceArena::kDefaultAlignment;  // the StepHealth record
  o.checkpointing = cfg.checkpointing;
  return o;
}

class GpuStep final : public StepBackend {
 public:
  GpuStep(const TrainConfig& cfg, Transformer<float>& host, Moments m, Moments v, int64_t steps_done)
      : cfg_(cfg),
        host_(host),
        linears_([&] {
          const std::vector<std::string> names = host.linear_names();
          return std::set<std::string>(names.begin(), names.end());
        }()),
        model_(cfg.model, cfg.batch_size, cfg.seq_len, model_options(cfg)) {
    check_layout();
    model_.set_params(host_.params(), host_.num_params());
    host_step_ = steps_done;
    follow_host_kinds();
    if (!m.empty() || !v.empty()) {
      std::vector<float> mf(host_.num_params()), vf(host_.num_params());
      for (const auto& info : host_.param_infos()) {
        if (const auto kept = is_linear_weight(info.name) ? host_kept_values(host_, info.name) : std::nullopt) {
          // The kept values' moments, spread over the dense weight (zero where pruned).
          auto mi = m.find(info.name + ".values"), vi = v.find(info.name + ".values");
          const size_t n = kept->values->size();
          if (mi == m.end() && vi == v.end()) continue;  // the layer became slope or vnm at this step
          ESPLAG_CHECK(mi != m.end() && vi != v.end() && mi->second.size() == n && vi->second.size() == n,
                       "GPU training: the optimizer state for '", info.name, ".values' is missing or has the wrong size");
          linear_detail::scatter(mf.data() + info.offset, kept->slots, mi->second.data());
          linear_detail::scatter(vf.data() + info.offset, kept->slots, vi->second.data());
          continue;
        }
        auto mi = m.find(info.name), vi = v.find(info.name);
        ESPLAG_CHECK(mi != m.end() && vi != v.end() && mi->second.size() == info.numel &&
                         vi->second.size() == info.numel,
                     "GPU training: the optimizer state for '", info.name, "' is missing or has the wrong size");
        std::copy(mi->second.begin(), mi->second.end(), mf.begin() + info.offset);
        std::copy(vi->second.begin(), vi->second.end(), vf.begin() + info.offset);
      }
      model_.set_optimizer_state(mf.data(), vf.data(), mf.size(), steps_done);
      for (const auto& name : host_.linear_names())
        if (SlopeLinear<float>* sl = host_slope(host_, name); sl && sl->lora_rank() > 0)
          adapter_to_gpu(model_, *sl, name, &m, &v);
    } else {
      ESPLAG_CHECK(steps_done == 0, "GPU training: no optimizer state given after ", steps_done, " steps");
    }
    health_ = model_.arena().allocate_array<StepHealth>("train.step_health", 1);
    CUDA_CHECK(cudaMemsetAsync(health_, 0, sizeof(StepHealth), model_.stream()));
    x_.resize(size_t(cfg_.batch_size) * cfg_.seq_len);
    y_.resize(x_.size());
    gpu_name_ = current_gpu_name();
    model_.synchronize();
    CUDA_CHECK(cudaMallocHost(&host_health_, sizeof(StepHealth)));  // last: nothing throws after it
  }
  ~GpuStep() override {
    if (host_health_) cudaFreeHost(host_health_);
  }

  std::string device() const override { return "cuda"; }
  std::string describe() const override {
    const double gib = double(model_.plan().total()) / double(size_t(1) << 30);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.2f GiB", gib);
    return "cuda (" + gpu_name_ + ", " + buf + " of device memory for the model)";
  }

  void step(int64_t step, double lr, DataLoader& data) override {
    ESPLAG_CHECK(model_.optimizer_steps() == step, "GPU training: the optimizer has taken ", model_.optimizer_steps(),
                 " steps but the trainer is at step ", step);
    const int B = cfg_.batch_size, T = cfg_.seq_len, accum = cfg_.grad_accum;
    cudaStream_t s = model_.stream();
    follow_host_kinds();  // the trainer applied the recipe's plan for this step to the host model
    model_.zero_grad();
    for (int micro = 0; micro < accum; ++micro) {
      data.next_batch(x_.data(), y_.data());
      model_.upload_batch(x_.data(), y_.data(), B, T);
      model_.forward_backward_device(model_.device_tokens(), model_.device_targets(), B, T, 1.0 / accum);
      add_micro_loss_kernel<<<1, 1, 0, s>>>(health_, model_.device_loss(), micro == 0);
      CUDA_CHECK_LAUNCH("GPU training (loss accumulation)");
    }
    finish_step_kernel<<<1, 1, 0, s>>>(health_, accum, static_cast<long long>(step + 1));
    CUDA_CHECK_LAUNCH("GPU training (step loss)");
    const auto& o = cfg_.optimizer;
    GpuAdamW hyper;
    hyper.lr = lr;
    hyper.beta1 = o.beta1;
    hyper.beta2 = o.beta2;
    hyper.eps = o.eps;
    hyper.weight_decay = o.weight_decay;  // the model applies it to decaying tensors only
    hyper.grad_clip = o.grad_clip;
    hyper.grad_scale = 1.0;  // the micro-batches already scaled their losses by 1/grad_accum
    model_.step_adamw(hyper);
  }

  Stats last_stats() override {
    CUDA_CHECK(cudaMemcpyAsync(host_health_, health_, sizeof(StepHealth), cudaMemcpyDeviceToHost, model_.stream()));
    const double norm = model_.last_grad_norm();  // waits for the stream, so for the copy too
    const StepHealth h = *host_health_;
    if (h.bad_step != 0) diverged("loss", h.bad_loss, h.bad_step);
    if (!std::isfinite(norm)) diverged("gradient norm", norm, model_.optimizer_steps());
    return {h.loss, norm};
  }

  double eval_loss(const int32_t* inputs, const int32_t* targets, int B, int T) override {
    return model_.forward_loss(inputs, targets, B, T);
  }

  // The moments of every tensor the host trains: the flat tensors' slices, and the kept
  // values of each slope layer (which the host trains instead of its flat weight).
  HostMoments state_to_host() override {
    write_back(true);
    return {m_, v_};
  }
  // A recipe update's write-back: the weights (slope's and vnm's kept values, adapters and
  // draw counts included) without the moments, two thirds of the bytes (llama-1b: 11.2 s
  // of a 15 s recipe update with the moments).
  // The copy is skipped when the host holds the weights of this step already (a run's
  // first step, or no step since the last write-back); either way the host may choose new
  // masks from them next (written_back_).
  void weights_to_host() override {
    if (host_step_ != model_.optimizer_steps()) write_back(false);
    written_back_ = true;
  }

 private:
  // The weights into the host model, and with `moments` the moments into m_ / v_.
  void write_back(bool moments) {
    written_back_ = true;
    host_step_ = model_.optimizer_steps();
    const std::vector<float> p = model_.params_to_host();
    std::copy(p.begin(), p.end(), host_.params());
    std::vector<float> mf, vf;
    if (moments) model_.optimizer_state_to_host(mf, vf);
    m_.clear();
    v_.clear();
    struct SlopeJob {
      SlopeLinear<float>* layer;
      const ParamInfo* info;
      GpuTransformer::SlopeState state;
      uint64_t dw_draws;
      std::vector<float>*m, *v;
    };
    std::vector<SlopeJob> slope;
    for (const auto& info : host_.param_infos()) {
      const bool linear = is_linear_weight(info.name);
      const uint64_t draws = linear && model_.sparse_dw(info.name) ? model_.sparse_dw_draws(info.name) : 0;
      if (SlopeLinear<float>* sl = linear ? host_slope(host_, info.name) : nullptr) {
        const std::string values = info.name + ".values";
        slope.push_back({sl, &info, model_.slope_state(info.name), draws, moments ? &m_[values] : nullptr,
                         moments ? &v_[values] : nullptr});
        if (sl->lora_rank() > 0) {  // the adapter's values and moments (the trainer's "<module>.lora_l", ...)
          GpuTransformer::LoraState a = model_.lora_state(info.name);
          const auto [ln, rn] = lora_names(*sl);
          sl->lora_l() = std::move(a.l);
          sl->lora_r() = std::move(a.r);
          if (!moments) continue;
          m_[ln] = std::move(a.m_l);
          v_[ln] = std::move(a.v_l);
          m_[rn] = std::move(a.m_r);
          v_[rn] = std::move(a.v_r);
        }
        continue;
      }
      if (auto* vl = linear ? dynamic_cast<VnmLinear<float>*>(&host_.linear(info.name)) : nullptr) {
        // The kept values and their moments from the dense (masked) GPU copies.
        const auto slots = linear_detail::slot_index(vl->weight());
        const std::string values = info.name + ".values";
        linear_detail::gather(vl->values().data(), slots, p.data() + info.offset, nullptr);
        if (!moments) continue;
        m_[values].resize(vl->values().size());
        v_[values].resize(vl->values().size());
        linear_detail::gather(m_[values].data(), slots, mf.data() + info.offset, nullptr);
        linear_detail::gather(v_[values].data(), slots, vf.data() + info.offset, nullptr);
        continue;
      }
      if (linear && model_.sparse_dw(info.name)) set_host_draws(host_.linear(info.name), info.name, draws);
      if (!moments) continue;
      m_[info.name].assign(mf.begin() + info.offset, mf.begin() + info.offset + info.numel);
      v_[info.name].assign(vf.begin() + info.offset, vf.begin() + info.offset + info.numel);
    }
    // Layers in parallel (their conversions are mostly single-threaded loops): each job
    // touches only its own layer, its slice of the host's flat weight and its own moment
    // vectors (created above); the layers' own parallel loops run inline.
    parallel_tasks(int64_t(slope.size()), [&](int64_t i) {
      const SlopeJob& j = slope[size_t(i)];
      const size_t at = j.info->offset;
      slope_to_host(*j.layer, j.info->name, j.state, j.dw_draws, p.data() + at, moments ? mf.data() + at : nullptr,
                    moments ? vf.data() + at : nullptr, j.m, j.v);
    });
  }

  // The GPU model promises the CPU model's flat layout; the copies in both directions
  // rely on it, so a difference is an Error here rather than scrambled weights later.
  void check_layout() const {
    const auto& a = host_.param_infos();
    const auto& b = model_.param_infos();
    ESPLAG_CHECK(a.size() == b.size() && host_.num_params() == model_.num_params(),
                 "GPU training: the GPU model has ", b.size(), " tensors (", model_.num_params(),
                 " parameters), the host model ", a.size(), " (", host_.num_params(), ")");
    for (size_t i = 0; i < a.size(); ++i)
      ESPLAG_CHECK(a[i].name == b[i].name && a[i].offset == b[i].offset && a[i].numel == b[i].numel &&
                       a[i].decay == b[i].decay,
                   "GPU training: parameter ", i, " is '", a[i].name, "' on the host but '", b[i].name,
                   "' on the GPU (or differs in offset, size or decay)");
    for (const auto& name : host_.linear_names())
      ESPLAG_CHECK(gpu_trains_kind(host_.linear(name).kind()), "GPU training: ", name, " is of kind ",
                   host_.linear(name).kind(), "; ", gpu_kinds_note(), " (use train.device=cpu)");
  }
  // Gives every block Linear of the GPU model the kind of its host twin (a no-op when
  // nothing changed; a change is rare: the recipe's start and end steps).
  void follow_host_kinds() {
    // A layer that becomes slope takes the host's masks (chosen from the fp32 weights);
    // later steps leave the GPU's own (converting them costs a pass over the weight). One
    // call: the layers that become slope lay the parameter state out again once. A masked
    // layer takes the host's mask when it becomes masked and after every write-back (which
    // comes before each recipe update, where gradual magnitude pruning chooses new masks
    // from the weights written back).
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    HeldMasks masks;
    std::set<std::string> had_adapter;
    for (const auto& name : linears_)
      if (model_.lora_rank(name) > 0) had_adapter.insert(name);
    const auto settings = host_kind_settings(
        host_, "GPU training", model_.optimizer_steps(),
        [&](const std::string& name) {
          const std::string kind = host_.linear(name).kind();
          return model_.linear_kind(name) != kind ||
                 (find_linear_kind(kind, "GPU training").host_rechooses_mask && written_back_);  // vnm's is frozen
        },
        masks);
    const auto t1 = clock::now();
    const std::string before = model_.kind_change_report();
    model_.set_linear_kinds(settings);
    const auto t2 = clock::now();
    written_back_ = false;
    // An adapter enabled for this step starts from the host's (L drawn, R zero), moments zero.
    for (const auto& name : linears_)
      if (SlopeLinear<float>* sl = host_slope(host_, name); sl && sl->lora_rank() > 0 && !had_adapter.count(name))
        adapter_to_gpu(model_, *sl, name);
    const auto t3 = clock::now();
    if (model_.kind_change_report() != before || t3 - t0 > std::chrono::milliseconds(500)) {
      const auto s = [](auto d) { return std::chrono::duration<double>(d).count(); };
      char buf[160];
      std::snprintf(buf, sizeof buf, "kinds to the device %.2f s (host settings %.2f s, model %.2f s, adapters %.2f s): ",
                    s(t3 - t0), s(t1 - t0), s(t2 - t1), s(t3 - t2));
      notes_.push_back(buf + model_.kind_change_report());
    }
    if (model_.sparse_dispatch().size() != dispatch_seen_) {
      dispatch_seen_ = model_.sparse_dispatch().size();
      notes_.push_back(model_.sparse_dispatch_summary());
    }
  }
  std::vector<std::string> take_notes() override { return std::exchange(notes_, {}); }

  bool is_linear_weight(const std::string& name) const { return linears_.count(name) != 0; }

  const TrainConfig cfg_;
  Transformer<float>& host_;
  const std::set<std::string> linears_;  // the host's block Linear weights
  GpuTransformer model_;
  size_t dispatch_seen_ = 0;        // dispatch decisions already reported
  bool written_back_ = false;       // state_to_host ran since the kinds were last followed
  int64_t host_step_ = -1;          // the host model holds the weights after this many steps
  std::vector<std::string> notes_;  // for take_notes
  StepHealth* health_ = nullptr;
  StepHealth* host_health_ = nullptr;  // pinned
  std::vector<int32_t> x_, y_;
  Moments m_, v_;  // host copies of the moments, filled by state_to_host
  std::string gpu_name_;
};

}  // namespace

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: leave no error behind for later checks
    if (why) *why = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    return 0;
  }
  if (n == 0 && why) *why = "the CUDA runtime reports no device";
  return n;
}

std::function<double(const int32_t*, const int32_t*, int, int)> gpu_batch_loss(const ModelConfig& config,
                                                                             Transformer<float>& host_model, int B,
                                                                             int T) {
  auto model = std::make_shared<GpuTransformer>(config, B, T);
  model->set_params(host_model.params(), host_model.num_params());
  HeldMasks masks;
  model->set_linear_kinds(host_kind_settings(
      host_model, "GPU evaluation", 0, [](const std::string&) { return true; }, masks));
  for (const auto& name : host_model.linear_names())
    if (SlopeLinear<float>* sl = host_slope(host_model, name); sl && sl->lora_rank() > 0)
      adapter_to_gpu(*model, *sl, name);
  return [model](const int32_t* tokens, const int32_t* targets, int b, int t) {
    return model->forward_loss(tokens, targets, b, t);
  };
}

std::unique_ptr<StepBackend> make_gpu_step(const TrainConfig& config, Transformer<float>& host_model, Moments m,
                                           Moments v, int64_t steps_done) {
  return std::make_unique<GpuStep>(config, host_model, std::move(m), std::move(v), steps_done);
}

}  // namespace esplag
