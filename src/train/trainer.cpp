#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/op_trace.h"
#include "io/atomic_file.h"
#include "ops/adamw.h"
#include "train/layer_kinds.h"

namespace esplag {

namespace fs = std::filesystem;

namespace {

struct DataMeta {
  int vocab_size = 0;
  std::string tokenizer;
};

DataMeta read_data_meta(const std::string& data_dir) {
  const std::string path = (fs::path(data_dir) / "meta.json").string();
  ESPLAG_CHECK(fs::exists(path), "data directory '", data_dir,
               "' has no meta.json: prepare it first with `esplag data prepare`");
  try {
    const auto js = nlohmann::json::parse(read_file(path));
    return {js.at("vocab_size").get<int>(), js.at("tokenizer").get<std::string>()};
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": invalid dataset metadata: ", e.what());
  }
}

std::string format_duration(double s) {
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%dh%02dm", int(s / 3600), int(std::fmod(s, 3600) / 60));
  else
    std::snprintf(buf, sizeof buf, "%dm%02ds", int(s / 60), int(std::fmod(s, 60)));
  return buf;
}

std::string format_rate(double tokens_per_s) {
  char buf[32];
  if (tokens_per_s >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", tokens_per_s / 1e6);
  else if (tokens_per_s >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fK", tokens_per_s / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", tokens_per_s);
  return buf;
}

std::string resolve_device(const std::string& requested) {
#ifdef ESPLAG_HAVE_CUDA
  if (requested == "cuda") fail("train.device=cuda: GPU training is not implemented yet; use device: cpu");
#else
  if (requested == "cuda") fail("train.device=cuda: this build has no CUDA backend (configure with the cuda preset)");
#endif
  return "cpu";  // "auto" runs where training is implemented: the CPU reference backend
}

// Mean loss over the first `max_batches` batches of `loader` (from its start).
EvalResult mean_loss(Transformer<float>& model, DataLoader& loader, int max_batches, int B, int T) {
  loader.reset();
  const int n = static_cast<int>(std::min<int64_t>(max_batches, loader.num_batches()));
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    loader.next_batch(x.data(), y.data());
    sum += model.forward_loss(x.data(), y.data(), B, T);
  }
  EvalResult r;
  r.batches = n;
  r.tokens = int64_t(n) * B * T;
  r.loss = sum / n;
  r.perplexity = std::exp(r.loss);
  return r;
}

}  // namespace

Trainer::Trainer(TrainConfig config, std::string run_dir, LogFn log)
    : cfg_(std::move(config)), run_dir_(std::move(run_dir)), log_(std::move(log)) {
  const DataMeta meta = read_data_meta(cfg_.data_path);
  tokenizer_ = meta.tokenizer;
  if (cfg_.model.vocab_size == 0) cfg_.model.vocab_size = meta.vocab_size;
  ESPLAG_CHECK(cfg_.model.vocab_size >= meta.vocab_size, "model.vocab_size (", cfg_.model.vocab_size,
               ") is smaller than the dataset's vocabulary (", meta.vocab_size, ")");
  cfg_.validate();
  resolve_device(cfg_.device);

  std::error_code ec;
  fs::create_directories(run_dir_, ec);
  ESPLAG_CHECK(!ec, "cannot create run directory '", run_dir_, "': ", ec.message());
  ESPLAG_CHECK(!fs::exists(fs::path(run_dir_) / "latest"), "run directory '", run_dir_,
               "' already holds checkpoints: continue it with --resume or choose another --out");
  write_file_atomic((fs::path(run_dir_) / "config.yaml").string(), to_yaml(cfg_));
  fs::remove(fs::path(run_dir_) / "metrics.jsonl", ec);

  model_ = std::make_unique<Transformer<float>>(cfg_.model);
  model_->init_weights(cfg_.seed);
  state_.rng = Rng(cfg_.seed).state();
  setup_recipe();
  setup_data();
}

std::unique_ptr<Trainer> Trainer::resume(const std::string& dir, LogFn log, int64_t steps) {
  const std::string ck = resolve_checkpoint(dir);
  CheckpointContents info = read_checkpoint_info(ck);
  std::unique_ptr<Trainer> t(new Trainer(std::move(log)));
  t->cfg_ = info.config;
  if (steps > 0) {
    t->cfg_.steps = steps;
    t->cfg_.schedule.total_steps = steps;
  }
  t->run_dir_ = fs::path(ck).parent_path().string();
  t->tokenizer_ = info.tokenizer;
  t->state_ = info.state;
  t->model_ = std::make_unique<Transformer<float>>(t->cfg_.model);
  t->setup_recipe();
  build_kinds_after(*t->model_, t->recipe_, t->state_.step, t->cfg_.seed);
  load_checkpoint_weights(ck, *t->model_, &t->m_, &t->v_);
  t->setup_data();
  t->train_data_->set_state(t->state_.data);
  t->last_checkpoint_ = ck;
  // Metrics logged after this checkpoint belong to a timeline that is being replaced.
  const fs::path metrics = fs::path(t->run_dir_) / "metrics.jsonl";
  if (fs::exists(metrics)) {
    std::ifstream in(metrics);
    std::string line, kept;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      try {
        if (nlohmann::json::parse(line).value("step", int64_t(0)) <= t->state_.step) kept += line + "\n";
      } catch (const nlohmann::json::exception&) {
        // a torn last line from an interrupted run: drop it
      }
    }
    write_file_atomic(metrics.string(), kept);
  }
  t->log_("resuming " + ck + " at step " + std::to_string(t->state_.step) + " of " + std::to_string(t->cfg_.steps));
  return t;
}

void Trainer::setup_recipe() {
  if (cfg_.recipe_yaml.empty()) return;
  recipe_ = Recipe::parse(cfg_.recipe_yaml, "recipe");
  recipe_.validate(linear_shapes(*model_), cfg_.steps);
  log_("sparsity recipe:\n" + recipe_.describe());
}

void Trainer::setup_data() {
  train_data_ = std::make_unique<DataLoader>(cfg_.data_path, "train", cfg_.batch_size, cfg_.seq_len, cfg_.seed);
  val_data_ = std::make_unique<DataLoader>(cfg_.data_path, "val", cfg_.batch_size, cfg_.seq_len, cfg_.seed);
}

void Trainer::append_metrics(const std::string& json_line) {
  std::ofstream out(fs::path(run_dir_) / "metrics.jsonl", std::ios::app);
  out << json_line << "\n";
  ESPLAG_CHECK(out.good(), "cannot append to ", (fs::path(run_dir_) / "metrics.jsonl").string());
}

EvalResult Trainer::evaluate() {
  return mean_loss(*model_, *val_data_, cfg_.eval_batches, cfg_.batch_size, cfg_.seq_len);
}

double Trainer::grad_norm() {
  double sq = 0;
  for (const auto& p : model_->trainable_params()) {
    const int64_t n = shape_numel(p.shape);
    ScopedOp op({p.name, "grad_norm"}, OpCategory::optimizer, -1, 2.0 * n, sizeof(float) * double(n), {p.grad}, {});
    sq += cpu::global_grad_norm_squared(p.grad, n);
  }
  return std::sqrt(sq);
}

void Trainer::ensure_moments() {
  // A tensor seen for the first time (a fresh run, or one a Linear kind just created)
  // starts with zero moments; tensors that no longer exist drop theirs.
  Moments m, v;
  for (const auto& p : model_->trainable_params()) {
    const size_t n = size_t(shape_numel(p.shape));
    auto& mp = m[p.name] = std::move(m_[p.name]);
    auto& vp = v[p.name] = std::move(v_[p.name]);
    if (mp.size() != n) mp.assign(n, 0.0f), vp.assign(n, 0.0f);
  }
  m_ = std::move(m);
  v_ = std::move(v);
}

void Trainer::step_optimizer(int64_t step, double grad_scale, double lr) {
  const auto& o = cfg_.optimizer;
  ensure_moments();
  for (const auto& p : model_->trainable_params()) {
    const int64_t n = shape_numel(p.shape);
    ScopedOp op({p.name, "adamw"}, OpCategory::optimizer, -1, 12.0 * n, 7.0 * sizeof(float) * n,
                {p.value, p.grad, m_[p.name].data(), v_[p.name].data()},
                {p.value, m_[p.name].data(), v_[p.name].data()});
    cpu::adamw_step(p.value, p.grad, m_[p.name].data(), v_[p.name].data(), shape_numel(p.shape), lr, o.beta1,
                    o.beta2, o.eps, p.decay ? o.weight_decay : 0.0, step + 1, grad_scale);
  }
  model_->after_optimizer_step();
}

void Trainer::save() {
  state_.data = train_data_->state();
  ensure_moments();
  last_checkpoint_ = save_checkpoint(run_dir_, *model_, cfg_, tokenizer_, state_, m_, v_);
  prune_checkpoints(run_dir_, cfg_.keep_checkpoints);
  log_("saved " + last_checkpoint_);
}

Trainer::StepStats Trainer::train_step() {
  const int B = cfg_.batch_size, T = cfg_.seq_len;
  batch_x_.resize(size_t(B) * T);
  batch_y_.resize(size_t(B) * T);
  const int64_t step = state_.step;
  if (!recipe_.empty()) apply_recipe_step(*model_, recipe_, step, cfg_.seed, log_);
  model_->on_step_begin(step);
  model_->zero_grad();
  StepStats st;
  for (int micro = 0; micro < cfg_.grad_accum; ++micro) {
    train_data_->next_batch(batch_x_.data(), batch_y_.data());
    st.loss += model_->forward_backward(batch_x_.data(), batch_y_.data(), B, T, 1.0 / cfg_.grad_accum);
  }
  st.loss /= cfg_.grad_accum;
  if (!std::isfinite(st.loss))
    fail("training diverged: loss is ", st.loss, " at step ", step + 1,
         " (try a lower optimizer.lr or a longer schedule.warmup_steps); checkpoints so far are intact");
  st.grad_norm = grad_norm();
  ESPLAG_CHECK(std::isfinite(st.grad_norm), "training diverged: gradient norm is ", st.grad_norm, " at step ",
               step + 1);
  st.lr = cfg_.schedule.at(step);
  step_optimizer(step, cpu::clip_scale(st.grad_norm, cfg_.optimizer.grad_clip), st.lr);
  state_.step = step + 1;
  state_.tokens_seen += int64_t(B) * T * cfg_.grad_accum;
  return st;
}

TrainResult Trainer::run() {
  using clock = std::chrono::steady_clock;
  const int64_t tokens_per_step = int64_t(cfg_.batch_size) * cfg_.seq_len * cfg_.grad_accum;
  TrainResult result;
  if (state_.step == 0) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "model %s: %.2fM parameters | %d layers, d=%d, %d heads | %lld tokens/step | device cpu",
                  cfg_.model.preset.c_str(), model_->num_params() / 1e6, cfg_.model.n_layer, cfg_.model.d_model,
                  cfg_.model.n_head, static_cast<long long>(tokens_per_step));
    log_(buf);
  }
  const int64_t first_step = state_.step;
  const auto t_start = clock::now();
  auto t_window = t_start;
  int64_t window_tokens = 0;
  bool first = true;
  while (state_.step < cfg_.steps) {
    const StepStats st = train_step();
    const double loss = st.loss, norm = st.grad_norm, lr = st.lr;
    window_tokens += tokens_per_step;
    if (first) result.first_loss = loss;
    first = false;
    result.last_loss = loss;

    const bool last = state_.step == cfg_.steps;
    if (state_.step % cfg_.log_every == 0 || last || state_.step == first_step + 1) {
      const auto now = clock::now();
      const double window_s = std::chrono::duration<double>(now - t_window).count();
      const double elapsed = std::chrono::duration<double>(now - t_start).count();
      const double tok_s = window_tokens / std::max(window_s, 1e-9);
      const double eta = elapsed / double(state_.step - first_step) * double(cfg_.steps - state_.step);
      char buf[256];
      std::snprintf(buf, sizeof buf, "step %6lld/%lld | loss %.4f | lr %.2e | norm %.3f | %s tok/s | ETA %s",
                    static_cast<long long>(state_.step), static_cast<long long>(cfg_.steps), loss, lr, norm,
                    format_rate(tok_s).c_str(), format_duration(eta).c_str());
      log_(buf);
      nlohmann::json js = {{"step", state_.step}, {"loss", loss},          {"lr", lr},
                           {"grad_norm", norm},   {"tokens_per_s", tok_s}, {"tokens_seen", state_.tokens_seen},
                           {"elapsed_s", elapsed}};
      append_metrics(js.dump());
      t_window = now;
      window_tokens = 0;
    }
    if ((cfg_.eval_every > 0 && state_.step % cfg_.eval_every == 0) || last) {
      const EvalResult ev = evaluate();
      char buf[160];
      std::snprintf(buf, sizeof buf, "eval step %lld | val loss %.4f | ppl %.2f (%d batches)",
                    static_cast<long long>(state_.step), ev.loss, ev.perplexity, ev.batches);
      log_(buf);
      append_metrics(nlohmann::json{{"step", state_.step}, {"val_loss", ev.loss}, {"val_ppl", ev.perplexity}}.dump());
      result.final_val_loss = ev.loss;
    }
    if ((cfg_.checkpoint_every > 0 && state_.step % cfg_.checkpoint_every == 0) || last) save();
  }
  result.steps = state_.step;
  result.last_checkpoint = last_checkpoint_;
  return result;
}

EvalResult evaluate_checkpoint(const std::string& checkpoint, const std::string& data_dir, const std::string& split,
                               int max_batches, int batch_size, int seq_len) {
  const std::string ck = resolve_checkpoint(checkpoint);
  const CheckpointContents info = read_checkpoint_info(ck);
  const DataMeta meta = read_data_meta(data_dir);
  ESPLAG_CHECK(meta.tokenizer == info.tokenizer, "data '", data_dir, "' was tokenized with '", meta.tokenizer,
               "' but the checkpoint was trained with '", info.tokenizer, "'");
  auto model = load_model(ck);
  const int B = batch_size > 0 ? batch_size : info.config.batch_size;
  const int T = seq_len > 0 ? seq_len : info.config.seq_len;
  DataLoader loader(data_dir, split, B, T, info.config.seed);
  return mean_loss(*model, loader, max_batches > 0 ? max_batches : INT32_MAX, B, T);
}

}  // namespace esplag
