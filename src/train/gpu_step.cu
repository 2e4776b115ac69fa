// GpuStep: train.device=cuda (see train/gpu_step.h).
#include "train/gpu_step.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/error.h"
#include "core/op_trace.h"
#include "core/parallel.h"
#include "dist/cuda/nccl_comm.h"
#include "model/device_linear.h"
#include "model/gpu_transformer.h"
#include "model/linear_registry.h"
#include "train/gpu_memory_plan.h"

namespace esplag {

namespace {

// What the device keeps of the steps between two reads by the host. The loss, then a
// distillation's cross-entropy and KL parts (GpuTransformer::device_loss), `parts` of them.
struct StepHealth {
  double sum[3];       // Σ over the running step's micro-batches
  double mean[3];      // the means of the last finished step (NaN: not computed)
  long long bad_step;  // first step (1-based) whose loss was not finite; 0: none
  double bad_loss;     // its loss
};

// One thread each: the bookkeeping of a step costs two tiny launches per micro-batch
// instead of a host round trip.
__global__ void add_micro_loss_kernel(StepHealth* h, const double* micro_loss, int parts, int first) {
  for (int k = 0; k < parts; ++k) h->sum[k] = (first ? 0.0 : h->sum[k]) + micro_loss[k];
}

__global__ void finish_step_kernel(StepHealth* h, int parts, int micro_batches, long long step) {
  for (int k = 0; k < 3; ++k)  // as the CPU: the sum in order, then one division
    h->mean[k] = k < parts ? h->sum[k] / micro_batches : __longlong_as_double(0x7ff8000000000000ll);
  const double loss = h->mean[0];
  if (!isfinite(loss) && h->bad_step == 0) {
    h->bad_step = step;
    h->bad_loss = loss;
  }
}

// The GPU settings of the host model's block linears, for one set_linear_kinds call (`who`
// names the caller in errors): each layer's kind and what its CPU twin holds
// (DeviceLinearKind::setting_from_twin), with its masks where `give_masks(name)` holds (for
// slope, refresh step `step` when the host has not refreshed yet), kept in `held` by layer,
// which the settings point into and which must outlive them.
std::vector<GpuTransformer::LinearKindSetting> host_kind_settings(
    Transformer<float>& host, const char* who, int64_t step, const std::function<bool(const std::string&)>& give_masks,
    std::vector<TwinMasks>& held) {
  const auto names = host.linear_names();
  std::vector<GpuTransformer::LinearKindSetting> settings(names.size());
  std::vector<const DeviceLinearKind*> kinds(names.size());
  std::vector<bool> gives(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string kind = host.linear(names[i]).kind();
    ESPLAG_CHECK(gpu_trains_kind(kind), who, ": ", names[i], " is of kind ", kind, "; ", gpu_kinds_note());
    settings[i] = {names[i], {.kind = kind}};
    kinds[i] = &device_linear_kind(kind, names[i]);
    gives[i] = give_masks(names[i]);
  }
  held.assign(names.size(), {});
  // Layers in parallel: a twin's masks in the GPU's form take a pass over its weight.
  parallel_tasks(int64_t(names.size()), [&](int64_t i) {
    const size_t k = size_t(i);
    if (kinds[k]->setting_from_twin)
      kinds[k]->setting_from_twin(host.linear(names[k]), step, gives[k], settings[k], held[k]);
  });
  return settings;
}

// The GPU copy of a distillation teacher (loaded on the host by the trainer): forward only,
// on the student's stream, its block Linear layers dense with the weights its own kinds
// apply (Linear::dense_weight: a sparse teacher's masked weight, adapters merged in).
std::unique_ptr<GpuTransformer> gpu_teacher(Transformer<float>& host, const TrainConfig& cfg, GpuTransformer& student) {
  GpuModelOptions o = gpu_teacher_options(cfg);
  o.stream = student.stream();
  o.head_chunk_rows = student.head_chunk_rows();
  std::unique_ptr<GpuTransformer> teacher;
  try {
    teacher = std::make_unique<GpuTransformer>(host.config(), cfg.batch_size, cfg.seq_len, o);
  } catch (const Error& e) {
    fail("GPU training: the distillation teacher (forward only, beside the student): ", e.what());
  }
  std::vector<float> flat(host.params(), host.params() + host.num_params());
  for (const auto& name : host.linear_names())  // into the copy, at the flat weight's place
    host.linear(name).dense_weight(flat.data() + (host.linear_params(name).weight - host.params()));
  teacher->set_params(flat.data(), flat.size());
  return teacher;
}

class GpuStep final : public StepBackend {
 public:
  GpuStep(const TrainConfig& cfg, Transformer<float>& host, Moments m, Moments v, int64_t steps_done,
          HostChannel* ranks, std::unique_ptr<Transformer<float>> teacher, const Recipe* recipe)
      : cfg_(cfg),
        host_(host),
        comm_(ranks ? std::make_unique<NcclComm>(*ranks) : nullptr),
        linears_([&] {
          const std::vector<std::string> names = host.linear_names();
          return std::set<std::string>(names.begin(), names.end());
        }()),
        model_(cfg.model, cfg.batch_size, cfg.seq_len, [&] {
          GpuModelOptions o = gpu_model_options(cfg);
          o.defer_state = true;  // laid out by follow_host_kinds below, for the host's kinds
          set_data_parallel_options(o, cfg, comm_.get());
          return o;
        }()) {
    check_layout();
    host_step_ = steps_done;
    // The kinds first: a layer that stores its weight in another form (slope's kept values)
    // is laid out before any weight arrives, so nothing moves and no second copy of the
    // state exists even for a moment (llama-7b's offloaded state would not fit twice).
    follow_host_kinds();
    model_.set_params(host_.params(), host_.num_params());
    model_.fp8_histories_from_host(host_.fp8_histories());  // a resumed run's (delayed fp8 scaling)
    if (!m.empty() || !v.empty()) {
      std::vector<float> mf(host_.num_params()), vf(host_.num_params());
      for (const auto& info : host_.param_infos()) {
        // A layer whose twin trains its kept values spreads their moments over the dense weight.
        if (is_linear_weight(info.name) &&
            model_.linear(info.name)
                .moments_from_twin(host_.linear(info.name), m, v, mf.data() + info.offset, vf.data() + info.offset))
          continue;
        auto mi = m.find(info.name), vi = v.find(info.name);
        ESPLAG_CHECK(mi != m.end() && vi != v.end() && mi->second.size() == info.numel &&
                         vi->second.size() == info.numel,
                     "GPU training: the optimizer state for '", info.name, "' is missing or has the wrong size");
        std::copy(mi->second.begin(), mi->second.end(), mf.begin() + info.offset);
        std::copy(vi->second.begin(), vi->second.end(), vf.begin() + info.offset);
      }
      model_.set_optimizer_state(mf.data(), vf.data(), mf.size(), steps_done);
      for (const auto& name : linears_) model_.extras_from_twin(name, host_.linear(name), &m, &v);
    } else {
      ESPLAG_CHECK(steps_done == 0, "GPU training: no optimizer state given after ", steps_done, " steps");
    }
    if (teacher) {
      teacher_ = gpu_teacher(*teacher, cfg_, model_);
      const Recipe::Modifier& d = *recipe->distill();
      distill_ = {teacher_.get(), d.alpha, d.temperature};
      recipe_ = recipe;
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
    const auto gib = [](size_t bytes) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(size_t(1) << 30));
      return std::string(buf);
    };
    const auto mib = [](double m) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%g MiB", m);
      return std::string(buf);
    };
    const GpuMemoryPlan& plan = model_.plan();
    return "cuda (" + gpu_name_ + ", " + gib(plan.total()) + " of device memory for the model" +
           (teacher_ ? ", " + gib(teacher_->plan().total()) + " for the distillation teacher" : "") +
           (plan.host ? ", the optimizer offloaded (" + cfg_.offload + "): " + gib(plan.host) + " of pinned host memory"
                      : "") +
           ")" +
           (comm_ && cfg_.parallel.zero >= 1
                ? ", ZeRO stage " + std::to_string(cfg_.parallel.zero) + " (each rank keeps the " +
                      (cfg_.parallel.zero >= 3 && buckets() ? "master weights, the " : "") + "AdamW moments" +
                      (cfg_.parallel.zero >= 2 && buckets() ? " and the mean gradient" : "") + " of 1/" +
                      std::to_string(comm_->size()) + " of the stored elements" +
                      (cfg_.parallel.zero >= 2 && !buckets() ? "; without gradient buckets the whole gradients" : "") +
                      ")"
                : "") +
           (buckets() ? ", gradients averaged during the backward in buckets of at least " +
                            mib(cfg_.parallel.bucket_mb)
                      : "");
  }

  void step(int64_t step, double lr, DataLoader& data) override {
    ESPLAG_CHECK(model_.optimizer_steps() == step, "GPU training: the optimizer has taken ", model_.optimizer_steps(),
                 " steps but the trainer is at step ", step);
    const int B = cfg_.batch_size, T = cfg_.seq_len, accum = cfg_.grad_accum;
    cudaStream_t s = model_.stream();
    follow_host_kinds();  // the trainer applied the recipe's plan for this step to the host model
    model_.zero_grad();
    const bool distill = teacher_ && recipe_->distills_at(step);
    const int parts = distill ? 3 : 1;  // of device_loss(): the loss, and a distillation's CE and KL
    // With buckets (parallel.bucket_mb), the last micro-batch's backward averages the
    // gradients over the ranks as it produces them.
    const bool overlap = buckets();
    for (int micro = 0; micro < accum; ++micro) {
      data.next_batch(x_.data(), y_.data());
      model_.upload_batch(x_.data(), y_.data(), B, T);
      model_.forward_backward_device(model_.device_tokens(), model_.device_targets(), B, T, 1.0 / accum,
                                     distill ? &distill_ : nullptr, overlap && micro == accum - 1);
      add_micro_loss_kernel<<<1, 1, 0, s>>>(health_, model_.device_loss(), parts, micro == 0);
      CUDA_CHECK_LAUNCH("GPU training (loss accumulation)");
    }
    int micro_batches = accum;
    if (comm_) {  // every rank's sums, so that every rank takes the same step
      // (sharded without buckets, step_adamw reduce-scatters the gradients itself)
      if (!overlap && cfg_.parallel.zero == 0) {
        float* grads = model_.device_gradients();
        const size_t n = model_.stored_params();
        ScopedOp op("gradients.all_reduce", OpCategory::comm, -1, 0, sizeof(float) * double(n), {grads}, {grads},
                    OpStream(s));
        comm_->all_reduce_mean(grads, n, s);
      }
      comm_->all_reduce_sum(health_->sum, parts, s);
      micro_batches *= comm_->size();
    }
    finish_step_kernel<<<1, 1, 0, s>>>(health_, parts, micro_batches, static_cast<long long>(step + 1));
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
    if (comm_) comm_->synchronize(model_.stream(), "step " + std::to_string(model_.optimizer_steps()));
    CUDA_CHECK(cudaMemcpyAsync(host_health_, health_, sizeof(StepHealth), cudaMemcpyDeviceToHost, model_.stream()));
    const double norm = model_.last_grad_norm();  // waits for the stream, so for the copy too
    const StepHealth h = *host_health_;
    if (h.bad_step != 0) diverged("loss", h.bad_loss, h.bad_step);
    if (!std::isfinite(norm)) diverged("gradient norm", norm, model_.optimizer_steps());
    return {h.mean[0], norm, h.mean[1], h.mean[2]};
  }

  double eval_loss(const int32_t* inputs, const int32_t* targets, int B, int T) override {
    return model_.forward_loss(inputs, targets, B, T);
  }

  // The moments of every tensor the host trains: the flat tensors' slices, and the tensors
  // the host's layers train themselves (kept values, adapters; DeviceLinear::to_twin).
  HostMoments state_to_host() override {
    write_back(true);
    return {views_m_, views_v_};
  }
  // The leader's collectives, and the weights and twins into the host model as the leader's
  // write-back puts them (a later kind change reads the twins: their refresh steps, masks),
  // without the moments' host copies, which only the checkpoint's writer needs.
  void state_to_leader() override {
    model_.gather_optimizer_state(kLeader);
    write_back(false);
  }
  // A recipe update's write-back: the weights (with what each layer's twin takes: kept
  // values, masks, adapters, draw counts) without the moments, a third of the bytes. The
  // copy is skipped when the host holds the weights of this step already (a run's
  // first step, or no step since the last write-back); either way the host may choose new
  // masks from them next (written_back_).
  void weights_to_host() override {
    if (host_step_ != model_.optimizer_steps()) write_back(false);
    written_back_ = true;
  }

 private:
  static constexpr int kLeader = 0;                        // the rank that writes checkpoints (Trainer::leader)
  static constexpr size_t kDenseMomentBytes = 8ull << 30;  // write_back's host copies of dense moments at a time

  // Data parallel with parallel.bucket_mb: the backward averages the gradients in buckets.
  bool buckets() const { return comm_ && cfg_.parallel.bucket_mb > 0; }
  // The weights into the host model, and with `moments` the moments into views_m_ /
  // views_v_: of the offloaded state itself where a tensor is stored as it is, else of host
  // copies in m_ / v_. Nothing holds a second copy of all the weights or moments, which
  // for llama-7b would not fit the host next to an offloaded state.
  void write_back(bool moments) {
    written_back_ = true;
    host_step_ = model_.optimizer_steps();
    // Sharded: a collective; the other ranks join it in state_to_leader.
    if (moments) model_.gather_optimizer_state(kLeader);
    // First: sharded, it also gathers the master weights' low halves, which the layers'
    // to_twin below read (an adapter's).
    model_.params_to_host(host_.params());
    if (moments) model_.fp8_histories_to_host(host_.fp8_histories());  // a checkpoint's too
    m_.clear();
    v_.clear();
    views_m_.clear();
    views_v_.clear();
    std::map<std::string, size_t> index;
    const auto& infos = host_.param_infos();
    for (size_t k = 0; k < infos.size(); ++k) index[infos[k].name] = k;
    // What each layer's twin takes besides the flat layout, layers in parallel (their
    // conversions are mostly single-threaded loops): each touches only its own twin, its
    // slice of the host's flat weight and its own maps. A twin that trains its kept values
    // reads its moments in the dense form (a host copy of the layer's only).
    const std::vector<std::string> names(linears_.begin(), linears_.end());
    // In groups of layers whose dense moments take about kDenseMomentBytes: all at once,
    // llama-7b's slope layers would take 52 GB.
    std::vector<NamedValues> named_m(names.size()), named_v(names.size());
    std::vector<std::vector<float>> dense_m(names.size()), dense_v(names.size());
    for (size_t first = 0, end = 0; first < names.size(); first = end) {
      for (size_t bytes = 0; end < names.size() && (end == first || bytes < kDenseMomentBytes); ++end) {
        const ParamInfo& info = infos[index.at(names[end])];
        if (!moments || host_.linear(names[end]).trains_dense_weight()) continue;
        dense_m[end].resize(info.numel);
        dense_v[end].resize(info.numel);
        model_.tensor_moments_to_host(index.at(names[end]), dense_m[end].data(), dense_v[end].data());
        bytes += 2 * sizeof(float) * info.numel;
      }
      parallel_tasks(int64_t(end - first), [&](int64_t i) {
        const size_t k = first + size_t(i);
        const bool dense = dense_m[k].empty();
        const TwinCopy c{host_.params() + infos[index.at(names[k])].offset, dense ? nullptr : dense_m[k].data(),
                         dense ? nullptr : dense_v[k].data(), moments ? &named_m[k] : nullptr,
                         moments ? &named_v[k] : nullptr};
        model_.linear(names[k]).to_twin(host_.linear(names[k]), c);
      });
      for (size_t k = first; k < end; ++k) dense_m[k] = {}, dense_v[k] = {};
    }
    if (!moments) return;
    for (size_t k = 0; k < names.size(); ++k) {
      m_.merge(named_m[k]);
      v_.merge(named_v[k]);
    }
    model_.synchronize();  // the offloaded moments are read in place below
    for (size_t k = 0; k < infos.size(); ++k) {
      const ParamInfo& info = infos[k];
      if (is_linear_weight(info.name) && !host_.linear(info.name).trains_dense_weight()) continue;  // named above
      if (const auto [om, ov] = model_.offloaded_moments(k); om) {
        views_m_.emplace(info.name, std::span<const float>(om, info.numel));
        views_v_.emplace(info.name, std::span<const float>(ov, info.numel));
        continue;
      }
      std::vector<float>& mt = m_[info.name];
      std::vector<float>& vt = v_[info.name];
      mt.resize(info.numel);
      vt.resize(info.numel);
      model_.tensor_moments_to_host(k, mt.data(), vt.data());
    }
    for (const auto& [name, values] : m_) views_m_.emplace(name, std::span<const float>(values));
    for (const auto& [name, values] : v_) views_v_.emplace(name, std::span<const float>(values));
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
    // A layer that changes kind takes its twin's masks (chosen from the fp32 weights);
    // later steps leave the GPU's own (converting them costs a pass over the weight). One
    // call: the layers whose stored form changes lay the parameter state out again once. A
    // kind whose host rechooses its mask (masked, under gradual magnitude pruning) takes it
    // again after every write-back, which comes before each recipe update.
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    std::vector<TwinMasks> masks;
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
    const bool changed = model_.set_linear_kinds(settings);
    const auto t2 = clock::now();
    written_back_ = false;
    // An adapter enabled for this step starts from the host's (L drawn, R zero), moments zero.
    for (const auto& name : linears_)
      if (model_.lora_rank(name) > 0 && !had_adapter.count(name))
        model_.extras_from_twin(name, host_.linear(name), nullptr, nullptr);
    const auto t3 = clock::now();
    if (changed) {
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
  int64_t fp8_saturated() override { return model_.fp8_saturated(); }

  bool is_linear_weight(const std::string& name) const { return linears_.count(name) != 0; }

  const TrainConfig cfg_;
  Transformer<float>& host_;
  std::unique_ptr<NcclComm> comm_;  // data parallel: the other ranks' GPUs (before model_, which may shard over them)
  const std::set<std::string> linears_;  // the host's block Linear weights
  GpuTransformer model_;
  std::unique_ptr<GpuTransformer> teacher_;  // distillation (recipe distill), on model_'s stream
  GpuTransformer::Distillation distill_;
  const Recipe* recipe_ = nullptr;           // with a teacher: when it teaches
  size_t dispatch_seen_ = 0;        // dispatch decisions already reported
  bool written_back_ = false;       // state_to_host ran since the kinds were last followed
  int64_t host_step_ = -1;          // the host model holds the weights after this many steps
  std::vector<std::string> notes_;  // for take_notes
  StepHealth* health_ = nullptr;
  StepHealth* host_health_ = nullptr;  // pinned
  std::vector<int32_t> x_, y_;
  Moments m_, v_;                   // host copies of the moments, filled by state_to_host
  MomentViews views_m_, views_v_;  // every moment: of m_ / v_, or of the offloaded state
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
  std::vector<TwinMasks> masks;
  model->set_linear_kinds(host_kind_settings(
      host_model, "GPU evaluation", 0, [](const std::string&) { return true; }, masks));
  for (const auto& name : host_model.linear_names())
    model->linear(name).extras_from_twin(host_model.linear(name), nullptr, nullptr);
  return [model](const int32_t* tokens, const int32_t* targets, int b, int t) {
    return model->forward_loss(tokens, targets, b, t);
  };
}

void use_cuda_device(int index) {
  const int count = cuda_device_count();
  ESPLAG_CHECK(index >= 0 && index < count, "this rank is to use CUDA device ", index, " (its LOCAL_RANK) but ",
               count, " device(s) are visible; start at most as many ranks per node as it has GPUs");
  CUDA_CHECK(cudaSetDevice(index));
}

std::unique_ptr<StepBackend> make_gpu_step(const TrainConfig& config, Transformer<float>& host_model, Moments m,
                                           Moments v, int64_t steps_done, HostChannel* ranks,
                                           std::unique_ptr<Transformer<float>> teacher, const Recipe* recipe) {
  ESPLAG_CHECK(!teacher || (recipe && recipe->distill()), "GPU training: a teacher without the recipe's distill entry");
  return std::make_unique<GpuStep>(config, host_model, std::move(m), std::move(v), steps_done, ranks,
                                   std::move(teacher), recipe);
}

}  // namespace esplag
