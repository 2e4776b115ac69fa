#include "train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "train/layer_kinds.h"

namespace esplag {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "esplag-checkpoint-1";

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%06lld", static_cast<long long>(step));
  return buf;
}

Tensor view(const OwnedParam<float>& p, const std::string& prefix = "") {
  return Tensor::borrow(p.value, p.shape, DType::f32, Device::cpu, prefix + p.name);
}

Tensor moment_view(const Moments& moments, const OwnedParam<float>& p, const std::string& prefix) {
  auto it = moments.find(p.name);
  ESPLAG_CHECK(it != moments.end() && it->second.size() == size_t(shape_numel(p.shape)),
               "optimizer state for '", p.name, "' is missing");
  return Tensor::borrow(const_cast<float*>(it->second.data()), p.shape, DType::f32, Device::cpu, prefix + p.name);
}

// Copies tensor `name` of `file` into dst (numel elements), checking its shape.
void read_tensor(const SafetensorsFile& file, const std::string& path, const std::string& name, const Shape& shape,
                 float* dst) {
  auto it = file.tensors.find(name);
  ESPLAG_CHECK(it != file.tensors.end(), path, ": tensor '", name, "' is missing");
  const Tensor& t = it->second;
  if (t.shape() != shape)
    fail(path, ": shape mismatch for tensor '", name, "': the model expects ", shape_str(shape),
         ", the file holds ", shape_str(t.shape()));
  const Tensor f32 = t.dtype() == DType::f32 ? t : t.to(DType::f32);
  std::copy_n(f32.data<float>(), shape_numel(shape), dst);
}

}  // namespace

std::string save_checkpoint(const std::string& run_dir, Transformer<float>& model, const TrainConfig& config,
                            const std::string& tokenizer, const TrainerState& state, const Moments& m,
                            const Moments& v) {
  const fs::path final_dir = fs::path(run_dir) / step_dir_name(state.step);
  const fs::path tmp_dir = fs::path(run_dir) / (step_dir_name(state.step) + ".tmp-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  ESPLAG_CHECK(!ec, "cannot create checkpoint directory '", tmp_dir.string(), "': ", ec.message());
  try {
    const auto trainable = model.trainable_params();
    std::vector<Tensor> weights;
    for (const auto& p : trainable) weights.push_back(view(p));
    // What the Linear kinds need beyond trained values (masks, indices, their kind).
    for (const auto& name : model.linear_names())
      for (const auto& [key, t] : model.linear(name).state()) {
        Tensor named = t;
        named.set_name(key);
        weights.push_back(named);
      }
    const std::map<std::string, std::string> meta = {{"format", kFormat},
                                                     {"config", to_yaml(config)},
                                                     {"tokenizer", tokenizer},
                                                     {"step", std::to_string(state.step)}};
    save_safetensors((tmp_dir / "model.safetensors").string(), weights, meta);
    std::vector<Tensor> moments;
    for (const auto& p : trainable) moments.push_back(moment_view(m, p, "m."));
    for (const auto& p : trainable) moments.push_back(moment_view(v, p, "v."));
    save_safetensors((tmp_dir / "optimizer.safetensors").string(), moments, {{"format", kFormat}});
    nlohmann::json js = {{"format", kFormat},
                         {"step", state.step},
                         {"tokens_seen", state.tokens_seen},
                         {"rng", state.rng},
                         {"data_epoch", state.data.epoch},
                         {"data_position", state.data.position}};
    write_file_atomic((tmp_dir / "state.json").string(), js.dump(2) + "\n");
    // Swap into place: an older checkpoint of the same step is only removed once the new
    // one is complete.
    const fs::path old_dir = fs::path(run_dir) / (step_dir_name(state.step) + ".old-" + std::to_string(::getpid()));
    const bool replacing = fs::exists(final_dir);
    if (replacing) fs::rename(final_dir, old_dir);
    fs::rename(tmp_dir, final_dir);
    if (replacing) fs::remove_all(old_dir, ec);
    write_file_atomic((fs::path(run_dir) / "latest").string(), step_dir_name(state.step) + "\n");
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp_dir, ec);
    fail("cannot write checkpoint '", final_dir.string(), "': ", e.what());
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }
  return final_dir.string();
}

std::string resolve_checkpoint(const std::string& dir) {
  const fs::path d(dir);
  ESPLAG_CHECK(fs::is_directory(d), "checkpoint '", dir, "' is not a directory");
  if (fs::exists(d / "model.safetensors")) return d.string();
  ESPLAG_CHECK(fs::exists(d / "latest"), "'", dir, "' holds neither model.safetensors nor a 'latest' file");
  std::string name = read_file((d / "latest").string());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  const fs::path ck = d / name;
  ESPLAG_CHECK(fs::exists(ck / "model.safetensors"), (d / "latest").string(), " names '", name,
               "', which holds no model.safetensors");
  return ck.string();
}

CheckpointContents read_checkpoint_info(const std::string& checkpoint_dir) {
  const std::string model_path = (fs::path(checkpoint_dir) / "model.safetensors").string();
  const auto meta = read_safetensors_metadata(model_path);
  auto get = [&](const char* key) {
    auto it = meta.find(key);
    ESPLAG_CHECK(it != meta.end(), model_path, ": metadata key '", key, "' is missing (not an esplag checkpoint?)");
    return it->second;
  };
  ESPLAG_CHECK(get("format") == kFormat, model_path, ": unsupported checkpoint format '", get("format"), "'");
  CheckpointContents c;
  c.config = parse_train_config(get("config"), model_path + " (config metadata)");
  c.tokenizer = get("tokenizer");
  c.state.step = std::stoll(get("step"));
  const fs::path state_path = fs::path(checkpoint_dir) / "state.json";
  if (fs::exists(state_path)) {
    nlohmann::json js;
    try {
      js = nlohmann::json::parse(read_file(state_path.string()));
      c.state.step = js.at("step").get<int64_t>();
      c.state.tokens_seen = js.at("tokens_seen").get<int64_t>();
      c.state.rng = js.at("rng").get<Rng::State>();
      c.state.data.epoch = js.at("data_epoch").get<int64_t>();
      c.state.data.position = js.at("data_position").get<int64_t>();
    } catch (const nlohmann::json::exception& e) {
      fail(state_path.string(), ": invalid trainer state: ", e.what());
    }
  }
  return c;
}

void load_checkpoint_weights(const std::string& checkpoint_dir, Transformer<float>& model, Moments* m, Moments* v) {
  const std::string model_path = (fs::path(checkpoint_dir) / "model.safetensors").string();
  const SafetensorsFile file = load_safetensors(model_path);
  const auto trainable = model.trainable_params();
  for (const auto& p : trainable) read_tensor(file, model_path, p.name, p.shape, p.value);
  std::set<std::string> used;
  for (const auto& p : trainable) used.insert(p.name);
  for (const auto& name : model.linear_names()) {
    Linear<float>& l = model.linear(name);
    const auto expected = l.state();
    if (expected.empty()) continue;
    std::map<std::string, Tensor> state;
    for (const auto& [key, t] : expected) {
      auto it = file.tensors.find(key);
      ESPLAG_CHECK(it != file.tensors.end(), model_path, ": tensor '", key, "' of the ", l.kind(),
                   " layer is missing (was the checkpoint saved with another recipe?)");
      state[key] = it->second;
      used.insert(key);
    }
    l.load_state(state);
  }
  for (const auto& [name, t] : file.tensors)
    ESPLAG_CHECK(used.count(name), model_path, ": tensor '", name,
                 "' does not belong to this model (another config or recipe?)");
  model.after_optimizer_step();  // kinds that store another form refresh their dense view
  if (!m) return;
  const std::string opt_path = (fs::path(checkpoint_dir) / "optimizer.safetensors").string();
  ESPLAG_CHECK(fs::exists(opt_path), "checkpoint '", checkpoint_dir,
               "' has no optimizer.safetensors: it cannot be resumed (weights-only export?)");
  const SafetensorsFile opt = load_safetensors(opt_path);
  m->clear();
  v->clear();
  for (const auto& p : trainable) {
    const size_t n = size_t(shape_numel(p.shape));
    auto& mp = (*m)[p.name];
    auto& vp = (*v)[p.name];
    mp.assign(n, 0.0f);
    vp.assign(n, 0.0f);
    read_tensor(opt, opt_path, "m." + p.name, p.shape, mp.data());
    read_tensor(opt, opt_path, "v." + p.name, p.shape, vp.data());
  }
}

std::unique_ptr<Transformer<float>> load_model(const std::string& checkpoint_dir, CheckpointContents* info_out) {
  const CheckpointContents info = read_checkpoint_info(checkpoint_dir);
  auto model = std::make_unique<Transformer<float>>(info.config.model);
  if (!info.config.recipe_yaml.empty()) {
    Recipe recipe = Recipe::parse(info.config.recipe_yaml, checkpoint_dir + " (recipe in the saved config)");
    recipe.validate(linear_shapes(*model), info.config.steps);
    build_kinds_after(*model, recipe, info.state.step, info.config.seed);
  }
  load_checkpoint_weights(checkpoint_dir, *model);
  if (info_out) *info_out = info;
  return model;
}

void prune_checkpoints(const std::string& run_dir, int keep) {
  if (keep <= 0) return;
  std::vector<fs::path> steps;
  for (const auto& e : fs::directory_iterator(run_dir)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("step-", 0) == 0 && n.find('.') == std::string::npos) steps.push_back(e.path());
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + keep < steps.size(); ++i) fs::remove_all(steps[i]);
}

}  // namespace esplag
