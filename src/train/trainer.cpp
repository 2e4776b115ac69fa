#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/op_trace.h"
#include "data/prepare.h"
#include "io/atomic_file.h"
#include "model/linear_registry.h"
#include "ops/adamw.h"
#include "train/distill_teacher.h"
#include "train/layer_kinds.h"
#include "train/memory_plan.h"
#include "train/progress.h"
#include "train/stop_signal.h"
#include "train/zero_optimizer.h"
#ifdef ESPLAG_HAVE_CUDA
#include "train/gpu_step.h"
#endif

namespace esplag {

namespace fs = std::filesystem;

namespace {

constexpr const char* kDivergedHint =
    " (try a lower optimizer.lr or a longer schedule.warmup_steps); checkpoints so far are intact";

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

// Mean loss over the first `max_batches` batches of `loader` (from its start).
using BatchLoss = std::function<double(const int32_t* inputs, const int32_t* targets, int B, int T)>;

EvalResult mean_loss(const BatchLoss& batch_loss, DataLoader& loader, int max_batches, int B, int T) {
  loader.reset();
  const int n = static_cast<int>(std::min<int64_t>(max_batches, loader.num_batches()));
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    loader.next_batch(x.data(), y.data());
    sum += batch_loss(x.data(), y.data(), B, T);
  }
  EvalResult r;
  r.batches = n;
  r.tokens = int64_t(n) * B * T;
  r.loss = sum / n;
  r.perplexity = std::exp(r.loss);
  return r;
}

// The CPU reference step, on the host model itself: every Linear kind, every recipe.
class CpuStep final : public StepBackend {
 public:
  // `ranks`: the other data-parallel ranks (null for a single process). `teacher`: the model
  // to distill from where `recipe` distills (null: none).
  CpuStep(Transformer<float>& model, const TrainConfig& cfg, Moments m, Moments v, HostChannel* ranks,
          std::unique_ptr<Transformer<float>> teacher = nullptr, const Recipe* recipe = nullptr)
      : model_(model), cfg_(cfg), ranks_(ranks), teacher_(std::move(teacher)), recipe_(recipe) {
    // ZeRO shards the optimizer state among several ranks; one process keeps it whole at any stage.
    if (ranks_ && cfg_.parallel.zero > 0)
      zero_ = std::make_unique<ZeroCpuOptimizer>(cfg_.parallel.zero, *ranks_, std::move(m), std::move(v));
    else
      m_ = std::move(m), v_ = std::move(v);
    model_.set_checkpointing(cfg_.checkpointing);
    x_.resize(size_t(cfg_.batch_size) * cfg_.seq_len);
    y_.resize(x_.size());
  }
  std::string device() const override { return "cpu"; }
  int64_t fp8_saturated() override { return model_.fp8_saturated(); }
  std::string describe() const override {
    if (!zero_) return "cpu";
    return "cpu, ZeRO stage " + std::to_string(cfg_.parallel.zero) + " (each rank keeps the AdamW moments of 1/" +
           std::to_string(ranks_->size()) + " of the trained elements)";
  }

  void step(int64_t step, double lr, DataLoader& data) override {
    model_.on_step_begin(step);
    model_.zero_grad();
    Stats st;
    const bool distill = teacher_ && recipe_->distills_at(step);
    double ce = 0, kl = 0;
    for (int micro = 0; micro < cfg_.grad_accum; ++micro) {
      data.next_batch(x_.data(), y_.data());
      const double scale = 1.0 / cfg_.grad_accum;
      if (!distill) {
        st.loss += model_.forward_backward(x_.data(), y_.data(), cfg_.batch_size, cfg_.seq_len, scale);
        continue;
      }
      // The teacher keeps its final hidden states; its logits are made chunk by chunk as the
      // student's loss needs them.
      teacher_->forward_hidden(x_.data(), cfg_.batch_size, cfg_.seq_len);
      const Recipe::Modifier& d = *recipe_->distill();
      const DistillTarget<float> target{d.alpha, d.temperature, [&](int row0, int rows, float* out) {
                                          teacher_->head_logits(row0, rows, out);
                                        }};
      const LossParts parts = model_.forward_backward(x_.data(), y_.data(), cfg_.batch_size, cfg_.seq_len, scale, target);
      st.loss += parts.loss, ce += parts.ce, kl += parts.kl;
    }
    // The step's means (loss, and distillation's parts), over the ranks too: one collective.
    double means[3] = {st.loss / cfg_.grad_accum, ce / cfg_.grad_accum, kl / cfg_.grad_accum};
    if (ranks_) {
      ranks_->all_reduce_sum(means, distill ? 3 : 1);
      for (double& m : means) m /= ranks_->size();
    }
    st.loss = means[0];
    if (distill) st.distill_ce = means[1], st.distill_kl = means[2];
    if (ranks_ && !zero_) average_gradients_over_ranks();
    if (!std::isfinite(st.loss)) diverged("loss", st.loss, step + 1);
    const auto params = model_.trainable_params();
    st.grad_norm = zero_ ? zero_->reduce_gradients(params) : grad_norm();
    if (!std::isfinite(st.grad_norm)) diverged("gradient norm", st.grad_norm, step + 1);
    const double grad_scale = cpu::clip_scale(st.grad_norm, cfg_.optimizer.grad_clip);
    if (zero_) {
      zero_->step(params, step, lr, grad_scale, cfg_.optimizer);
      model_.after_optimizer_step();
    } else {
      step_optimizer(step, grad_scale, lr);
    }
    if (ranks_) max_fp8_amaxes_over_ranks();
    model_.roll_fp8_histories();
    last_ = st;
  }
  Stats last_stats() override { return last_; }
  double eval_loss(const int32_t* inputs, const int32_t* targets, int B, int T) override {
    return model_.forward_loss(inputs, targets, B, T);
  }
  // Under ZeRO a collective: every rank sends rank 0 its range of the moments.
  HostMoments state_to_host() override {
    if (!zero_) {
      ensure_moments();
      return {views_of(m_), views_of(v_)};
    }
    zero_->gather_moments();
    return {views_of(zero_->gathered_m()), views_of(zero_->gathered_v())};
  }

 private:
  // Data parallel: every rank's mean loss and gradients become the means over the ranks (the
  // sums in rank order, so every rank holds the same bits and takes the same step).
  void average_gradients_over_ranks() {
    const double inv = 1.0 / ranks_->size();
    std::vector<float>& flat = flat_grads_;  // kept from step to step: no allocation per step
    flat.clear();
    const auto params = model_.trainable_params();
    for (const auto& p : params) flat.insert(flat.end(), p.grad, p.grad + shape_numel(p.shape));
    {
      ScopedOp op("gradients.all_reduce", OpCategory::comm, -1, 0, sizeof(float) * double(flat.size()));
      ranks_->all_reduce_sum(flat.data(), flat.size());
    }
    const float* at = flat.data();
    for (const auto& p : params)
      for (int64_t i = 0, n = shape_numel(p.shape); i < n; ++i) p.grad[i] = static_cast<float>(*at++ * inv);
  }

  // Delayed fp8 scaling: the step's amaxes become their largest over the ranks before the
  // histories roll, so that every rank scales alike, as one process running every rank's
  // batches would (and a checkpoint's histories, rank 0's, are every rank's).
  void max_fp8_amaxes_over_ranks() {
    if (!model_.linear_precision().delayed()) return;
    constexpr ProductOperand kOperands[] = {ProductOperand::input, ProductOperand::grad};
    std::vector<float> amax;
    for (const Fp8AmaxHistory& h : model_.fp8_histories())
      for (ProductOperand role : kOperands) amax.push_back(h.step_amax(role));
    ranks_->all_reduce_max(amax.data(), amax.size());
    const float* at = amax.data();
    for (Fp8AmaxHistory& h : model_.fp8_histories())
      for (ProductOperand role : kOperands) h.record(role, *at++);
  }

  // Global L2 norm of every trained gradient (deterministic order).
  double grad_norm() {
    double sq = 0;
    for (const auto& p : model_.trainable_params()) {
      const int64_t n = shape_numel(p.shape);
      ScopedOp op({p.name, "grad_norm"}, OpCategory::optimizer, -1, 2.0 * n, sizeof(float) * double(n), {p.grad}, {});
      sq += cpu::global_grad_norm_squared(p.grad, n);
    }
    return std::sqrt(sq);
  }

  void ensure_moments() {
    // A tensor seen for the first time (a fresh run, or one a Linear kind just created)
    // starts with zero moments; tensors that no longer exist drop theirs.
    Moments m, v;
    for (const auto& p : model_.trainable_params()) {
      const size_t n = size_t(shape_numel(p.shape));
      auto& mp = m[p.name] = std::move(m_[p.name]);
      auto& vp = v[p.name] = std::move(v_[p.name]);
      if (mp.size() != n) mp.assign(n, 0.0f), vp.assign(n, 0.0f);
    }
    m_ = std::move(m);
    v_ = std::move(v);
  }

  void step_optimizer(int64_t step, double grad_scale, double lr) {
    const auto& o = cfg_.optimizer;
    ensure_moments();
    for (const auto& p : model_.trainable_params()) {
      const int64_t n = shape_numel(p.shape);
      ScopedOp op({p.name, "adamw"}, OpCategory::optimizer, -1, 12.0 * n, 7.0 * sizeof(float) * n,
                  {p.value, p.grad, m_[p.name].data(), v_[p.name].data()},
                  {p.value, m_[p.name].data(), v_[p.name].data()});
      cpu::adamw_step(p.value, p.grad, m_[p.name].data(), v_[p.name].data(), n, lr, o.beta1, o.beta2, o.eps,
                      p.decay ? o.weight_decay : 0.0, step + 1, grad_scale);
    }
    model_.after_optimizer_step();
  }

  Transformer<float>& model_;
  const TrainConfig cfg_;
  Moments m_, v_;  // without ZeRO: the whole moments
  HostChannel* ranks_;
  std::unique_ptr<ZeroCpuOptimizer> zero_;  // ZeRO stages 1 and 2 over several ranks
  std::unique_ptr<Transformer<float>> teacher_;  // forward only: never trained, no moments
  const Recipe* recipe_;
  std::vector<int32_t> x_, y_;
  std::vector<float> flat_grads_;  // data parallel: the gradients packed for the all-reduce
  Stats last_;
};

}  // namespace

void StepBackend::diverged(const char* what, double value, int64_t step) {
  fail("training diverged: ", what, " is ", value, " at step ", step, kDivergedHint);
}

DeviceProbe probe_devices() {
  DeviceProbe p;
#ifdef ESPLAG_HAVE_CUDA
  p.cuda_build = true;
  p.gpus = cuda_device_count(&p.why_none);
#endif
  return p;
}

bool gpu_trains_kind(const std::string& kind) {
  const LinearKindInfo* k = lookup_linear_kind(kind);
  return k && k->gpu;
}

std::string gpu_kinds_note() {
  return "the GPU trains " + linear_kind_list([](const LinearKindInfo& k) { return k.gpu; }) +
         " Linear layers only so far";
}

namespace {

// Why semi_sparse or slope modifier `m` cannot run on the GPU's 2:4 products, "" when it can:
// cuSPARSELt needs the claimed layers' dimensions and the micro-batch's tokens to be
// multiples of 16 (the CPU reference needs multiples of 4).
std::string sparse_24_gpu_shape_problem(const TrainConfig& config, const Recipe::Modifier& m) {
  const ModelConfig& c = config.model;
  const int64_t tokens = int64_t(config.batch_size) * config.seq_len;
  if (tokens % 16 != 0)
    return detail::concat("train.batch_size x train.seq_len = ", tokens, " tokens, not a multiple of 16");
  const std::pair<const char*, std::pair<int64_t, int64_t>> roles[] = {
      {"attn.qkv", {c.qkv_dim(), c.d_model}},
      {"attn.proj", {c.d_model, int64_t(c.n_head) * c.head_dim()}},
      {"mlp.fc", {c.fc_dim(), c.d_model}},
      {"mlp.proj", {c.d_model, c.d_ff}}};
  for (int l = 0; l < c.n_layer; ++l)
    for (const auto& [role, shape] : roles) {
      const std::string name = "blocks." + std::to_string(l) + "." + role + ".weight";
      if (m.claims(name) && (shape.first % 16 != 0 || shape.second % 16 != 0))
        return detail::concat(name, " is ", shape.first, "x", shape.second, ", not multiples of 16");
      // The fused MVUE kernel works on 64×64 tiles of dY [tokens, out].
      if (m.sparse_dw && m.claims(name) && shape.first % 64 != 0)
        return detail::concat(name, " has ", shape.first, " outputs, not a multiple of 64 (sparse_dw)");
    }
  if (m.sparse_dw && tokens % 64 != 0)
    return detail::concat("train.batch_size x train.seq_len = ", tokens, " tokens, not a multiple of 64 (sparse_dw)");
  return "";
}

}  // namespace

std::string gpu_training_blocker(const TrainConfig& config, Transformer<float>* model) {
  // Parsed once and kept: modifiers() and distill() refer into the Recipe.
  const std::optional<Recipe> recipe =
      config.recipe_yaml.empty() ? std::nullopt : std::optional<Recipe>(config.recipe());
  const std::vector<Recipe::Modifier> none;
  const std::vector<Recipe::Modifier>& modifiers = recipe ? recipe->modifiers() : none;
  std::string why;
  const auto add = [&](const std::string& reason) { why += (why.empty() ? "" : "; ") + reason; };

  std::vector<std::string> parts;
  for (const auto& m : modifiers) {
    if (m.kind().empty()) continue;  // distill: no layers (its own reason below)
    const std::string what = "modifier " + m.type + (m.lora_rank > 0 ? " with LoRA adapters" : "") +
                             (m.sparse_dw ? " with sparse_dw" : "") + " on " + join(m.params, ", ");
    // The GPU has no LoRA wrapper (only adapters of a kind's own, slope's).
    const LinearKindInfo& kind = find_linear_kind(m.kind(), "recipe");
    if (!kind.gpu || (m.lora_rank > 0 && kind.adapter == AdapterStyle::wrapper))
      parts.push_back(what);
    else if (const std::string shape = kind.gpu_needs_16 ? sparse_24_gpu_shape_problem(config, m) : "";
             !shape.empty())
      parts.push_back(what + ": " + shape + " (cuSPARSELt's 2:4 products need multiples of 16)");
  }
  if (model)
    for (const auto& name : model->linear_names())
      if (const std::string kind = model->linear(name).kind(); !gpu_trains_kind(kind))
        parts.push_back(name + " of kind " + kind);
  if (!parts.empty())
    add("the run needs sparse Linear kinds that the GPU does not train yet (" + join(parts, "; ") + ")");

  // fp8 on the GPU: the dense products (masked and vnm layers multiply their masked weight
  // with them), and slope's and semi_sparse's 2:4 ones, whose input-gradient products take
  // e4m3 gradients only (model/cuda/device_linear_fp8_sparse.h).
  if (config.precision == "fp8") {
    std::set<std::string> kinds;
    bool sparse_dw = false;
    for (const auto& m : modifiers) {
      if (!m.kind().empty()) kinds.insert(m.kind());
      sparse_dw = sparse_dw || m.sparse_dw;
    }
    if (model)
      for (const auto& name : model->linear_names()) kinds.insert(model->linear(name).kind());
    std::vector<std::string> others, two_four;
    for (const auto& k : kinds) {
      if (k == "slope" || k == "semi_sparse") two_four.push_back(k);
      if (k != "dense" && k != "masked" && k != "vnm" && k != "slope" && k != "semi_sparse") others.push_back(k);
    }
    if (!others.empty())
      add("train.precision is fp8 with sparse Linear kinds (" + join(others, ", ") +
          ") whose fp8 products only the CPU's emulation trains so far (the GPU's fp8 products are the dense ones, "
          "masked's and vnm's, slope's and semi_sparse's; docs/fp8.md)");
    if (!two_four.empty() && config.fp8_grad != "e4m3")
      add("train.precision is fp8 with " + join(two_four, " and ") + " layers and train.fp8_grad is " +
          config.fp8_grad +
          ", but their fp8 input-gradient products on the GPU take e4m3 gradients only (cuSPARSELt; set "
          "train.fp8_grad: e4m3)");
    if (sparse_dw) add("train.precision is fp8 with sparse_dw, which only the CPU's emulation trains so far");
  }
  return why;
}

DeviceChoice choose_train_device(const std::string& requested, const DeviceProbe& probe,
                                 const std::string& gpu_blocker) {
  ESPLAG_CHECK(requested == "auto" || requested == "cpu" || requested == "cuda",
               "train.device must be auto, cpu or cuda, got '", requested, "'");
  if (requested == "cpu") return {"cpu", ""};
  const std::string none = probe.why_none.empty() ? "" : " (" + probe.why_none + ")";
  if (requested == "cuda") {
    ESPLAG_CHECK(probe.cuda_build, "train.device=cuda: this esplag was built without the CUDA backend (configure with "
                                   "-DESPLAG_CUDA=ON, the cuda preset); use train.device=cpu");
    ESPLAG_CHECK(probe.gpus > 0, "train.device=cuda: no CUDA device is visible", none, "; use train.device=cpu");
    ESPLAG_CHECK(gpu_blocker.empty(), "train.device=cuda: ", gpu_blocker, "; ", gpu_kinds_note(),
                 "; use train.device=cpu");
    return {"cuda", ""};
  }
  if (!probe.cuda_build) return {"cpu", ""};
  if (probe.gpus == 0) return {"cpu", "auto: no CUDA device is visible" + none};
  if (!gpu_blocker.empty()) return {"cpu", "auto: " + gpu_blocker + "; " + gpu_kinds_note()};
  return {"cuda", ""};
}

Trainer::Trainer(TrainConfig config, std::string run_dir, LogFn log)
    : cfg_(std::move(config)), run_dir_(std::move(run_dir)), log_(std::move(log)) {
  join_world();
  const DatasetMeta meta = read_dataset_meta(cfg_.data_path);
  tokenizer_ = meta.tokenizer;
  if (!cfg_.init_from.empty()) cfg_.model = init_from_model(cfg_, meta.tokenizer);
  if (cfg_.model.vocab_size == 0) cfg_.model.vocab_size = meta.vocab_size;
  ESPLAG_CHECK(cfg_.model.vocab_size >= meta.vocab_size, "model.vocab_size (", cfg_.model.vocab_size,
               ") is smaller than the dataset's vocabulary (", meta.vocab_size, ")");
  cfg_.validate();
  resolve_device();
  check_no_checkpoints();  // before the minutes a large model's initialisation can take
  if (const std::string memory = apply_train_memory(cfg_, device_, world_.local_rank, world_.size, world_.local_size);
      !memory.empty())
    log_(memory);

  // Initialised on the host whatever the device, so a CPU and a GPU run of one config
  // start from the same weights.
  model_ = std::make_unique<Transformer<float>>(cfg_.model);
  model_->set_linear_precision(cfg_.linear_precision());
  model_->init_weights(cfg_.seed);
  if (!cfg_.init_from.empty()) load_init_weights(cfg_.init_from, *model_);
  state_.rng = Rng(cfg_.seed).state();
  setup_recipe();
  setup_data();
  // The recipe's update at step 0 before the backend exists, so that a GPU run lays its
  // state out for the kinds it starts with: a slope run never holds the dense state next to
  // its layers' twins (for llama-7b with the offload they would not fit the host together).
  if (!recipe_.empty() && recipe_.is_update_step(0)) {
    apply_recipe_step(*model_, recipe_, 0, cfg_.seed, log_);
    first_update_applied_ = true;
  }
  make_backend({}, {});

  // Everything the run needs is checked: only now is anything created or written (by the
  // leading rank only).
  if (leader()) {
    std::error_code ec;
    fs::create_directories(run_dir_, ec);
    ESPLAG_CHECK(!ec, "cannot create run directory '", run_dir_, "': ", ec.message());
    claim_run_dir();
    check_no_checkpoints();  // again under the lock: another run may have saved meanwhile
    write_file_atomic((fs::path(run_dir_) / "config.yaml").string(), to_yaml(cfg_));
    fs::remove(fs::path(run_dir_) / "metrics.jsonl", ec);
  }
  if (ranks_) ranks_->barrier();  // every rank is ready (or the run ends on all of them)
}

void Trainer::join_world() {
  world_ = world_from_env();
  if (!world_.distributed()) return;
  if (!leader()) log_ = [](const std::string&) {};  // the leading rank speaks for the run
  log_("data parallel: " + world_.describe() + "; waiting for the other ranks");
  ranks_ = HostChannel::connect(world_);
}

void Trainer::check_no_checkpoints() const {
  ESPLAG_CHECK(!fs::exists(fs::path(run_dir_) / "latest"), "run directory '", run_dir_,
               "' already holds checkpoints: continue it with --resume or choose another --out");
}

void Trainer::claim_run_dir() {
  lock_ = std::make_unique<RunLock>(run_dir_);
  const RemovedLeftovers removed = remove_dead_writers(run_dir_);
  if (!removed.names.empty())
    log_("removed unfinished writes of processes no longer running from " + run_dir_ + ": " +
         join(removed.names, ", ") + " (" + format_bytes(removed.bytes) + ")");
}

std::unique_ptr<Trainer> Trainer::resume(const std::string& dir, LogFn log, const ResumeOptions& options) {
  using StateFile = CheckpointContents::StateFile;
  const std::string ck = resolve_checkpoint(dir);
  const CheckpointContents info = read_checkpoint_info(ck);
  ESPLAG_CHECK(info.state_file != StateFile::invalid, info.state_problem,
               ": the run cannot resume from this checkpoint (eval, sample and export still read its weights)");
  ESPLAG_CHECK(info.state_file == StateFile::valid || options.allow_inexact, info.state_problem,
               ": resuming would lose the data position and the RNG state; allow an inexact resume "
               "(--allow-inexact) to continue from the weights, moments and step alone, or resume another checkpoint");
  std::unique_ptr<Trainer> t(new Trainer(std::move(log)));
  t->join_world();
  t->cfg_ = info.config;
  t->tokenizer_ = info.tokenizer;
  t->state_ = info.state;
  t->last_checkpoint_ = ck;
  fs::path ck_path(ck);
  if (!ck_path.has_filename()) ck_path = ck_path.parent_path();  // "run/step-000100/"
  t->run_dir_ = ck_path.parent_path().string();
  if (t->run_dir_.empty()) t->run_dir_ = ".";

  const int64_t saved = t->state_.step;
  const int64_t total = options.steps > 0 ? options.steps : t->cfg_.steps;
  if (saved < total) {
    if (options.steps > 0 && options.steps != t->cfg_.steps && !t->cfg_.recipe_yaml.empty()) {
      // A fraction resolves against train.steps: another total would move the recipe's
      // phases under a run already part-way through them (a layer back to sparse, say).
      const auto moved = t->cfg_.recipe().fractional_steps();
      ESPLAG_CHECK(moved.empty(), "train --resume --steps ", options.steps,
                   ": the recipe gives steps as fractions of train.steps (", join(moved, "; "),
                   "), which would move from the ", t->cfg_.steps, "-step schedule the run follows; ",
                   "keep --steps ", t->cfg_.steps, " or write those steps as step numbers in a new run");
    }
    if (options.steps > 0) {
      t->cfg_.steps = options.steps;
      if (options.schedule == ScheduleOnResume::stretch) t->cfg_.schedule.total_steps = options.steps;
    }
  } else {
    // Nothing to train: the checkpoint is still loaded in full (and so checked), and
    // nothing is written.
    t->nothing_to_do_ = "nothing to do: " + ck + " is at step " + std::to_string(saved) + ", and the run " +
                        (options.steps > 0 ? "is asked for " + std::to_string(total) + " steps in all"
                                           : "ends at train.steps = " + std::to_string(total)) +
                        "; to train further, resume with a total above " + std::to_string(saved) + " (--steps)";
  }
  if (!options.device.empty()) t->cfg_.device = options.device;
  t->resolve_device();  // without the model's kinds yet: enough to know what host memory it takes
  if (const std::string memory = apply_train_memory(t->cfg_, t->device_, t->world_.local_rank, t->world_.size,
                                                   t->world_.local_size);
      !memory.empty())
    t->log_(memory);
  t->model_ = std::make_unique<Transformer<float>>(t->cfg_.model);
  t->model_->set_linear_precision(t->cfg_.linear_precision());
  t->setup_recipe();
  build_kinds_after(*t->model_, t->recipe_, saved, t->cfg_.seed);
  Moments m, v;
  load_checkpoint_weights(ck, *t->model_, &m, &v);
  if (!t->nothing_to_do_.empty()) return t;
  t->resolve_device();
  t->setup_data();
  if (info.state_file == StateFile::valid) {
    t->train_data_->set_state(t->state_.data);
  } else {
    t->state_.tokens_seen = saved * t->cfg_.batch_size * t->cfg_.seq_len * t->cfg_.grad_accum;
    t->state_.rng = Rng(t->cfg_.seed).state();
    t->log_("inexact resume: " + info.state_problem + ", so the data restarts from its first batch (the batches of " +
            "the first " + std::to_string(saved) + " steps are seen again) and the RNG state from train.seed; " +
            "weights, optimizer moments and schedule continue exactly");
  }
  t->make_backend(std::move(m), std::move(v));

  // Everything is checked: only now is the run directory touched (by the leading rank).
  if (t->leader()) t->claim_run_dir();
  if (t->ranks_) t->ranks_->barrier();
  // Metrics logged after this checkpoint belong to a timeline that is being replaced.
  const fs::path metrics = fs::path(t->run_dir_) / "metrics.jsonl";
  if (t->leader() && fs::exists(metrics)) {
    std::ifstream in(metrics);
    std::string line, kept;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      try {
        if (nlohmann::json::parse(line).value("step", int64_t(0)) <= saved) kept += line + "\n";
      } catch (const nlohmann::json::exception&) {
        // a torn last line from an interrupted run: drop it
      }
    }
    write_file_atomic(metrics.string(), kept);
  }
  const LrSchedule& schedule = t->cfg_.schedule;
  std::string plan = "schedule over " + std::to_string(schedule.total_steps) + " steps";
  if (t->cfg_.steps > schedule.total_steps) {
    char rate[32];
    std::snprintf(rate, sizeof rate, "%.2e", schedule.at(schedule.total_steps));
    plan += " (kept; steps past it at its final lr " + std::string(rate) + ")";
  }
  t->log_("resuming " + ck + " at step " + std::to_string(saved) + " of " + std::to_string(t->cfg_.steps) + " | " +
          plan + " | device " + t->backend_->describe() +
          (t->device_note_.empty() ? "" : " (" + t->device_note_ + ")"));
  return t;
}

int64_t Trainer::fp8_saturated_over_ranks() {
  int64_t saturated = backend_->fp8_saturated();
  if (!ranks_ || !cfg_.linear_precision().fp8) return saturated;
  double total = double(saturated);  // exact below 2^53
  ranks_->all_reduce_sum(&total, 1);
  return int64_t(total);
}

void Trainer::resolve_device() {
  // Only `auto` and `cuda` look for a GPU (starting the CUDA runtime takes a moment).
  const DeviceProbe probe = cfg_.device == "cpu" ? DeviceProbe{} : probe_devices();
  const DeviceChoice choice = choose_train_device(cfg_.device, probe, gpu_training_blocker(cfg_, model_.get()));
  device_ = choice.device;
  device_note_ = choice.note;
  ESPLAG_CHECK(cfg_.offload == "none" || device_ == "cuda", "train.offload is ", cfg_.offload,
               ", which moves GPU training's optimizer state to the host; this run trains on the CPU, whose state "
               "is in host memory already: set train.offload none");
  ESPLAG_CHECK(cfg_.parallel.zero <= 2 || device_ == "cuda", "parallel.zero = 3 (sharded parameters) is built for ",
               "train.device cuda; this run trains on the CPU, whose reference trains stages 0 to 2 (the numbers ",
               "stage 3 gives)");
}

void Trainer::make_backend(Moments m, Moments v) {
  std::unique_ptr<Transformer<float>> teacher;
  if (const Recipe::Modifier* d = recipe_.distill()) {
    const int index = static_cast<int>(d - recipe_.modifiers().data());
    teacher = load_teacher(*d, recipe_.source() + ": recipe[" + std::to_string(index) + "] (distill)", cfg_.model,
                           tokenizer_, cfg_.seq_len);
    log_("distilling from " + d->teacher + " (" + std::to_string(teacher->config().n_layer) + " layers, d=" +
         std::to_string(teacher->config().d_model) + ", forward only on the " +
         (device_ == "cuda" ? "GPU, dense bf16)" : "CPU)"));
  }
  if (device_ == "cuda") {
#ifdef ESPLAG_HAVE_CUDA
    if (world_.distributed()) use_cuda_device(world_.local_rank);
    backend_ = make_gpu_step(cfg_, *model_, std::move(m), std::move(v), state_.step, ranks_.get(), std::move(teacher),
                             &recipe_);
    return;
#else
    fail("train.device=cuda: this esplag was built without the CUDA backend");  // choose_train_device refuses first
#endif
  }
  backend_ = std::make_unique<CpuStep>(*model_, cfg_, std::move(m), std::move(v), ranks_.get(), std::move(teacher),
                                       &recipe_);
}

void Trainer::setup_recipe() {
  if (cfg_.recipe_yaml.empty()) return;
  recipe_ = cfg_.recipe();
  recipe_.validate(linear_shapes(*model_), cfg_.steps);
  log_("sparsity recipe:\n" + recipe_.describe());
}

void Trainer::setup_data() {
  train_data_ = std::make_unique<DataLoader>(cfg_.data_path, "train", cfg_.batch_size, cfg_.seq_len, cfg_.seed);
  val_data_ = std::make_unique<DataLoader>(cfg_.data_path, "val", cfg_.batch_size, cfg_.seq_len, cfg_.seed);
}

void Trainer::append_metrics(const std::string& json_line) {
  if (!leader()) return;
  std::ofstream out(fs::path(run_dir_) / "metrics.jsonl", std::ios::app);
  out << json_line << "\n";
  ESPLAG_CHECK(out.good(), "cannot append to ", (fs::path(run_dir_) / "metrics.jsonl").string());
}

EvalResult Trainer::evaluate() {
  const BatchLoss loss = [this](const int32_t* x, const int32_t* y, int B, int T) {
    return backend_->eval_loss(x, y, B, T);
  };
  return mean_loss(loss, *val_data_, cfg_.eval_batches, cfg_.batch_size, cfg_.seq_len);
}

void Trainer::save() {
  // Rank 0 alone writes; a sharded optimizer state (parallel.zero > 0) is gathered from every rank first.
  if (!leader()) {
    if (cfg_.parallel.zero > 0) backend_->state_to_leader();
    return;
  }
  state_.data = train_data_->state();
  const StepBackend::HostMoments moments = backend_->state_to_host();
  // A step can leave non-finite weights behind a finite loss (a huge learning rate):
  // they never become a checkpoint.
  for (const auto& p : model_->trainable_params()) {
    const int64_t n = shape_numel(p.shape);
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(p.value[i]))
        fail("training diverged: parameter '", p.name, "' holds ", p.value[i], " after step ", state_.step,
             kDivergedHint);
  }
  last_checkpoint_ = save_checkpoint(run_dir_, *model_, cfg_, tokenizer_, state_, moments.m, moments.v);
  prune_checkpoints(run_dir_, cfg_.keep_checkpoints);
  log_("saved " + last_checkpoint_);
}

double Trainer::advance() {
  using clock = std::chrono::steady_clock;
  const auto seconds_since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
  const int64_t step = state_.step;
  const bool update = !recipe_.empty() && recipe_.is_update_step(step) && !(step == 0 && first_update_applied_);
  const bool device = backend_->device() != "cpu";
  double write_back_s = 0, layers_s = 0;
  if (update) {
    // Kinds built from the weights (slope's masks) must see the trained ones: a device
    // backend writes them back to the host model first (not the moments, which only a
    // checkpoint needs). An update that only adds adapters or changes schedules reads
    // nothing of them (the next write-back brings the host up to date).
    auto t = clock::now();
    if (recipe_.reads_weights_at(step)) backend_->weights_to_host();
    write_back_s = seconds_since(t);
    t = clock::now();
    apply_recipe_step(*model_, recipe_, step, cfg_.seed, log_);
    layers_s = seconds_since(t);
  }
  const double lr = cfg_.schedule.at(step);
  const auto t_step = clock::now();
  // Data parallel: the step's global batch is world.size × grad_accum micro-batches, rank r
  // taking the r-th run of grad_accum of them (what one process with world.size times the
  // accumulation would read); every rank's loader ends the step at the same place.
  const int64_t accum = cfg_.grad_accum;
  train_data_->skip_batches(world_.rank * accum);
  backend_->step(step, lr, *train_data_);
  train_data_->skip_batches((world_.size - 1 - world_.rank) * accum);
  const double step_s = seconds_since(t_step);
  if (update) {
    // A recipe step stalls the run on the host: say where the time went. A device step
    // returns once its work is queued, so its time here is the host's part: handing the
    // device the layers' new kinds and masks.
    char buf[200];
    if (device)
      std::snprintf(buf, sizeof buf,
                    "step %lld: recipe update took %.1f s (write-back from the device %.1f s, host layers %.1f s, "
                    "new kinds to the device %.1f s)",
                    static_cast<long long>(step), write_back_s + layers_s + step_s, write_back_s, layers_s, step_s);
    else
      std::snprintf(buf, sizeof buf, "step %lld: recipe update: host layers rebuilt in %.2f s",
                    static_cast<long long>(step), layers_s);
    log_(buf);
  }
  for (const auto& note : backend_->take_notes()) log_("step " + std::to_string(step) + ": " + note);
  state_.step = step + 1;
  state_.tokens_seen += tokens_per_step();
  return lr;
}

Trainer::StepStats Trainer::train_step() {
  const double lr = advance();
  const StepBackend::Stats st = backend_->last_stats();
  return {st.loss, st.grad_norm, lr};
}

TrainResult Trainer::run() {
  using clock = std::chrono::steady_clock;
  const int64_t tokens_per_step = this->tokens_per_step();
  TrainResult result;
  result.steps = state_.step;
  result.last_checkpoint = last_checkpoint_;
  if (!nothing_to_do_.empty()) {
    log_(nothing_to_do_);
    return result;
  }
  if (!lock_ && leader()) lock_ = std::make_unique<RunLock>(run_dir_);  // run() again after a stop
  if (state_.step == 0) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "model %s: %.2fM parameters | %d layers, d=%d, %d heads | %lld tokens/step | device ",
                  cfg_.model.preset.c_str(), model_->num_params() / 1e6, cfg_.model.n_layer, cfg_.model.d_model,
                  cfg_.model.n_head, static_cast<long long>(tokens_per_step));
    log_(std::string(buf) + backend_->describe() + (device_note_.empty() ? "" : " (" + device_note_ + ")") +
         (world_.distributed() ? " on each of " + std::to_string(world_.size) + " data-parallel ranks" : ""));
  }
  const int64_t first_step = state_.step;
  const auto t_start = clock::now();
  auto t_window = t_start;
  int64_t window_tokens = 0;
  bool first = true;
  while (state_.step < cfg_.steps) {
    const double lr = advance();
    window_tokens += tokens_per_step;
    const bool last = state_.step == cfg_.steps;
    // A stop signal ends the run here, the step done: logged and saved, not evaluated. Data
    // parallel ranks stop together when any of them is signalled.
    const bool stop = (ranks_ ? ranks_->any(stop_requested()) : stop_requested()) && !last;
    const bool log_now = state_.step % cfg_.log_every == 0 || last || stop || state_.step == first_step + 1;
    const bool eval_now = (cfg_.eval_every > 0 && state_.step % cfg_.eval_every == 0 && !stop) || last;
    const bool save_now = (cfg_.checkpoint_every > 0 && state_.step % cfg_.checkpoint_every == 0) || last || stop;
    if (!log_now && !eval_now && !save_now) continue;
    // The loop waits for a device only here: the step's loss and norm are read (and every
    // step since the last read checked for divergence) before anything is reported,
    // evaluated or saved.
    const StepBackend::Stats st = backend_->last_stats();
    const double loss = st.loss, norm = st.grad_norm;
    if (first) result.first_loss = loss;  // the first step is always logged
    first = false;
    result.last_loss = loss;

    if (log_now) {
      const auto now = clock::now();
      const double window_s = std::chrono::duration<double>(now - t_window).count();
      const double elapsed = std::chrono::duration<double>(now - t_start).count();
      const double tok_s = window_tokens / std::max(window_s, 1e-9);
      const double eta = elapsed / double(state_.step - first_step) * double(cfg_.steps - state_.step);
      char buf[256];
      const bool distilled = !std::isnan(st.distill_kl);
      char parts[64] = "";
      if (distilled) std::snprintf(parts, sizeof parts, " (ce %.4f, kl %.4f)", st.distill_ce, st.distill_kl);
      std::snprintf(buf, sizeof buf, "step %6lld/%lld | loss %.4f%s | lr %.2e | norm %.3f | %s tok/s | ETA %s",
                    static_cast<long long>(state_.step), static_cast<long long>(cfg_.steps), loss, parts, lr, norm,
                    format_rate(tok_s).c_str(), format_duration(eta).c_str());
      log_(buf);
      nlohmann::json js = {{"step", state_.step}, {"loss", loss},          {"lr", lr},
                           {"grad_norm", norm},   {"tokens_per_s", tok_s}, {"tokens_seen", state_.tokens_seen},
                           {"elapsed_s", elapsed}};
      if (distilled) js["distill_ce"] = st.distill_ce, js["distill_kl"] = st.distill_kl;
      append_metrics(js.dump());
      t_window = now;
      window_tokens = 0;
      if (const int64_t saturated = fp8_saturated_over_ranks(); saturated > fp8_saturated_logged_) {
        log_("step " + std::to_string(state_.step) + ": warning: fp8 casts saturated " +
             std::to_string(saturated - fp8_saturated_logged_) +
             " values since the last line (clipped to the format's largest, or infinite; docs/fp8.md)");
        fp8_saturated_logged_ = saturated;
      }
    }
    if (eval_now && evaluates()) {
      const EvalResult ev = evaluate();
      char buf[160];
      std::snprintf(buf, sizeof buf, "eval step %lld | val loss %.4f | ppl %.2f (%d batches)",
                    static_cast<long long>(state_.step), ev.loss, ev.perplexity, ev.batches);
      log_(buf);
      append_metrics(nlohmann::json{{"step", state_.step}, {"val_loss", ev.loss}, {"val_ppl", ev.perplexity}}.dump());
      result.final_val_loss = ev.loss;
    }
    if (save_now) save();
    if (stop) {
      result.interrupted = true;
      log_(std::string("stopped by ") + (stop_signal() == SIGTERM ? "SIGTERM" : "SIGINT") + " after step " + std::to_string(state_.step) +
           " of " + std::to_string(cfg_.steps) + "; saved " + last_checkpoint_);
      break;
    }
  }
  result.steps = state_.step;
  result.steps_run = state_.step - first_step;
  result.last_checkpoint = last_checkpoint_;
  lock_.reset();  // the run's writes are over: another process or trainer may continue it
  return result;
}

EvalResult evaluate_checkpoint(const std::string& checkpoint, const std::string& data_dir, const std::string& split,
                               int max_batches, int batch_size, int seq_len, const std::string& device) {
  const std::string ck = resolve_checkpoint(checkpoint);
  const CheckpointContents info = read_checkpoint_info(ck);
  const DatasetMeta meta = read_dataset_meta(data_dir);
  ESPLAG_CHECK(same_tokenizer(meta.tokenizer, info.tokenizer), "data '", data_dir, "' was tokenized with '", meta.tokenizer,
               "' but the checkpoint was trained with '", info.tokenizer, "'");
  ESPLAG_CHECK(device == "cpu" || device == "cuda" || device == "auto",
               "eval: the device must be cpu, cuda or auto, got '", device, "'");
  auto model = load_model(ck);
  const int B = batch_size > 0 ? batch_size : info.config.batch_size;
  const int T = seq_len > 0 ? seq_len : info.config.seq_len;
  // The GPU runs what GPU training runs: the kinds the checkpoint rebuilt (its recipe's
  // future steps do not matter here).
  std::string where = "cpu";
  if (device != "cpu") {
    const DeviceProbe probe = probe_devices();
    TrainConfig kinds_only = info.config;
    kinds_only.recipe_yaml.clear();
    const std::string blocker = gpu_training_blocker(kinds_only, model.get());
    const std::string none = probe.why_none.empty() ? "" : " (" + probe.why_none + ")";
    if (device == "cuda") {
      ESPLAG_CHECK(probe.cuda_build,
                   "eval --device cuda: this esplag was built without the CUDA backend; use --device cpu");
      ESPLAG_CHECK(probe.gpus > 0, "eval --device cuda: no CUDA device is visible", none, "; use --device cpu");
      ESPLAG_CHECK(blocker.empty(), "eval --device cuda: ", blocker, "; ", gpu_kinds_note(), "; use --device cpu");
    }
    if (probe.cuda_build && probe.gpus > 0 && blocker.empty()) where = "cuda";
  }
  DataLoader loader(data_dir, split, B, T, info.config.seed);
  BatchLoss loss = [&](const int32_t* x, const int32_t* y, int b, int t) { return model->forward_loss(x, y, b, t); };
#ifdef ESPLAG_HAVE_CUDA
  if (where == "cuda") loss = gpu_batch_loss(info.config.model, *model, B, T);
#endif
  EvalResult r = mean_loss(loss, loader, max_batches > 0 ? max_batches : INT32_MAX, B, T);
  r.device = where;
  return r;
}

}  // namespace esplag
