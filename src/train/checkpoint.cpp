#include "train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <set>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/json.h"
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

Tensor moment_view(const MomentViews& moments, const OwnedParam<float>& p, const std::string& prefix) {
  auto it = moments.find(p.name);
  ESPLAG_CHECK(it != moments.end() && it->second.size() == size_t(shape_numel(p.shape)),
               "optimizer state for '", p.name, "' is missing");
  return Tensor::borrow(const_cast<float*>(it->second.data()), p.shape, DType::f32, Device::cpu, prefix + p.name);
}

bool floating(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16; }

// Throws when `values` holds a NaN or an infinity: loading must not hand damaged weights
// to training, evaluation or export.
template <typename T>
void check_finite(const T* values, int64_t n, const std::string& path, const std::string& name) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(values[i]))
      fail(path, ": tensor '", name, "' holds a non-finite value (", double(values[i]), " at element ", i,
           "): the checkpoint is damaged; use an earlier one");
}

// Copies tensor `name` of `file` into dst (numel elements), checking its shape, its dtype
// (a floating-point one, converted to f32: an integer tensor is not a weight) and its values.
void read_tensor(const SafetensorsFile& file, const std::string& path, const std::string& name, const Shape& shape,
                 float* dst) {
  auto it = file.tensors.find(name);
  ESPLAG_CHECK(it != file.tensors.end(), path, ": tensor '", name, "' is missing");
  const Tensor& t = it->second;
  if (t.shape() != shape)
    fail(path, ": shape mismatch for tensor '", name, "': the model expects ", shape_str(shape),
         ", the file holds ", shape_str(t.shape()));
  ESPLAG_CHECK(floating(t.dtype()), path, ": tensor '", name, "' is stored as ", dtype_safetensors(t.dtype()),
               ", but it is a trained tensor: expected F32 (or F64, BF16, F16)");
  const Tensor f32 = t.dtype() == DType::f32 ? t : t.to(DType::f32);
  std::copy_n(f32.data<float>(), shape_numel(shape), dst);
  check_finite(dst, shape_numel(shape), path, name);
}

// Delayed fp8 scaling: the amax history of the block linear of weight `weight_name` is the
// optimizer file's tensor "fp8_amax_history.<module>" (of a step since the first).
std::string fp8_history_key(const std::string& weight_name) {
  return "fp8_amax_history." + weight_name.substr(0, weight_name.size() - std::string(".weight").size());
}

std::vector<std::pair<std::string, Fp8AmaxHistory*>> fp8_histories_to_save(Transformer<float>& model) {
  std::vector<std::pair<std::string, Fp8AmaxHistory*>> out;
  if (!model.linear_precision().delayed()) return out;
  const std::vector<std::string> names = model.linear_names();
  for (size_t i = 0; i < names.size(); ++i)
    if (Fp8AmaxHistory& h = model.fp8_histories()[i]; h.warm()) out.emplace_back(fp8_history_key(names[i]), &h);
  return out;
}

// The step of a step directory's name ("step-000150" -> 150), or -1 for any other name.
int64_t step_of_dir_name(const std::string& name) {
  const std::string digits = name.rfind("step-", 0) == 0 ? name.substr(5) : "";
  if (digits.size() < 6 || digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos)
    return -1;
  return std::stoll(digits);
}

// A non-negative integer written as text (the metadata's values are strings).
int64_t parse_count(const std::string& text, const std::string& path, const char* key) {
  const bool digits = !text.empty() && text.size() <= 18 && text.find_first_not_of("0123456789") == std::string::npos;
  ESPLAG_CHECK(digits, path, ": metadata key '", key, "' must be a non-negative integer, got '", text, "'");
  return std::stoll(text);
}

// The trainer state of state.json; an Error of one sentence naming the file and the field.
TrainerState parse_trainer_state(const std::string& path, const std::string& text) {
  const nlohmann::json js = parse_json(text, path);
  ESPLAG_CHECK(js.is_object(), path, " must hold a JSON object, it holds ", js.type_name());
  auto count = [&](const char* key) {
    ESPLAG_CHECK(js.contains(key), path, ": field '", key, "' is missing");
    const auto& v = js[key];
    ESPLAG_CHECK(v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0) &&
                     v.get<uint64_t>() <= uint64_t(INT64_MAX),
                 path, ": field '", key, "' must be a non-negative integer, got ", v.dump());
    return v.get<int64_t>();
  };
  if (js.contains("format"))
    ESPLAG_CHECK(js["format"] == kFormat, path, ": field 'format' must be \"", kFormat, "\", got ",
                 js["format"].dump());
  TrainerState st;
  st.step = count("step");
  st.tokens_seen = count("tokens_seen");
  st.data.epoch = count("data_epoch");
  st.data.position = count("data_position");
  ESPLAG_CHECK(js.contains("rng"), path, ": field 'rng' is missing");
  const auto& rng = js["rng"];
  bool words = rng.is_array() && rng.size() == st.rng.size();
  for (size_t i = 0; words && i < rng.size(); ++i) words = rng[i].is_number_unsigned();
  ESPLAG_CHECK(words, path, ": field 'rng' must be a list of ", st.rng.size(), " unsigned integers, got ", rng.dump());
  for (size_t i = 0; i < rng.size(); ++i) st.rng[i] = rng[i].get<uint64_t>();
  return st;
}

// Fills c.state from the checkpoint's state.json (all but the step, already the
// metadata's) and says whether it can resume the run.
void read_state_file(const fs::path& checkpoint_dir, CheckpointContents& c) {
  using StateFile = CheckpointContents::StateFile;
  const int64_t step = c.state.step;
  const fs::path dir = checkpoint_dir.has_filename() ? checkpoint_dir : checkpoint_dir.parent_path();  // "ck/"
  const std::string model_path = (dir / "model.safetensors").string();
  const int64_t named = step_of_dir_name(dir.filename().string());
  if (named >= 0 && named != step) {
    c.state_file = StateFile::invalid;
    c.state_problem = "checkpoint directory '" + dir.string() + "' is named for step " +
                      std::to_string(named) + " but " + model_path + " says step " + std::to_string(step);
    return;
  }
  const fs::path path = dir / "state.json";
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    c.state_file = StateFile::missing;
    c.state_problem = path.string() + " is missing";
    return;
  }
  try {
    const TrainerState st = parse_trainer_state(path.string(), read_file(path.string()));
    ESPLAG_CHECK(st.step == step, path.string(), ": field 'step' is ", st.step, " but ", model_path, " says step ",
                 step);
    c.state = st;
    c.state_file = StateFile::valid;
  } catch (const Error& e) {
    c.state_file = StateFile::invalid;
    c.state_problem = e.what();
  }
}

}  // namespace

namespace {

// save_checkpoint, and without m and v save_weights_checkpoint.
std::string write_checkpoint(const std::string& run_dir, Transformer<float>& model, const TrainConfig& config,
                             const std::string& tokenizer, const TrainerState& state, const MomentViews* m,
                             const MomentViews* v) {
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
                                                     {"step", std::to_string(state.step)},
                                                     {"schedule_total_steps",
                                                      std::to_string(config.schedule.total_steps)}};
    save_safetensors((tmp_dir / "model.safetensors").string(), weights, meta);
    if (m && v) {
      std::vector<Tensor> moments;
      for (const auto& p : trainable) moments.push_back(moment_view(*m, p, "m."));
      for (const auto& p : trainable) moments.push_back(moment_view(*v, p, "v."));
      for (const auto& [name, h] : fp8_histories_to_save(model)) {
        Tensor t = Tensor::zeros({2, Fp8AmaxHistory::values_per_operand(h->length())}, DType::f32, name);
        const std::vector<float> values = h->values();
        std::copy(values.begin(), values.end(), t.data<float>());
        moments.push_back(std::move(t));
      }
      save_safetensors((tmp_dir / "optimizer.safetensors").string(), moments, {{"format", kFormat}});
    }
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

}  // namespace

MomentViews views_of(const Moments& m) {
  MomentViews out;
  for (const auto& [name, values] : m) out.emplace(name, std::span<const float>(values));
  return out;
}

std::string save_checkpoint(const std::string& run_dir, Transformer<float>& model, const TrainConfig& config,
                            const std::string& tokenizer, const TrainerState& state, const MomentViews& m,
                            const MomentViews& v) {
  return write_checkpoint(run_dir, model, config, tokenizer, state, &m, &v);
}

std::string save_weights_checkpoint(const std::string& run_dir, Transformer<float>& model, const TrainConfig& config,
                                    const std::string& tokenizer, const TrainerState& state) {
  return write_checkpoint(run_dir, model, config, tokenizer, state, nullptr, nullptr);
}

std::string resolve_checkpoint(const std::string& dir) {
  const fs::path d(dir);
  ESPLAG_CHECK(fs::is_directory(d), "checkpoint '", dir, "' is not a directory");
  if (fs::exists(d / "model.safetensors")) return d.string();
  ESPLAG_CHECK(fs::exists(d / "latest"), "'", dir, "' holds neither model.safetensors nor a 'latest' file");
  std::string name = read_file((d / "latest").string());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  // Anything else (an absolute path, "..") could point a resumed run at another run's files.
  ESPLAG_CHECK(step_of_dir_name(name) >= 0, (d / "latest").string(),
               " must hold the name of a step directory of its run (step-NNNNNN), it holds '", name, "'");
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
  // Checkpoints from before the schedule's total was saved ran a schedule of train.steps.
  if (meta.count("schedule_total_steps"))
    c.config.schedule.total_steps = parse_count(get("schedule_total_steps"), model_path, "schedule_total_steps");
  c.tokenizer = get("tokenizer");
  c.state.step = parse_count(get("step"), model_path, "step");
  read_state_file(fs::path(checkpoint_dir), c);
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
      const Tensor& saved = it->second;
      ESPLAG_CHECK(saved.dtype() == t.dtype(), model_path, ": tensor '", key, "' of the ", l.kind(),
                   " layer is stored as ", dtype_safetensors(saved.dtype()), ", expected ",
                   dtype_safetensors(t.dtype()));
      if (saved.dtype() == DType::f32) check_finite(saved.data<float>(), saved.numel(), model_path, key);
      if (saved.dtype() == DType::f64) check_finite(saved.data<double>(), saved.numel(), model_path, key);
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
  // A checkpoint of current scaling (or of a run's start) has no histories: the run then
  // starts them as a new run does.
  if (!model.linear_precision().delayed()) return;
  const std::vector<std::string> names = model.linear_names();
  const auto saved = [&](const std::string& name) { return opt.tensors.count(fp8_history_key(name)) > 0; };
  if (std::none_of(names.begin(), names.end(), saved)) return;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string key = fp8_history_key(names[i]);
    ESPLAG_CHECK(saved(names[i]), opt_path, ": tensor '", key, "' is missing, where the other layers' amax ",
                 "histories are there: the checkpoint is damaged; use an earlier one");
    Fp8AmaxHistory& h = model.fp8_histories()[i];
    const Shape shape = {2, Fp8AmaxHistory::values_per_operand(h.length())};
    ESPLAG_CHECK(opt.tensors.at(key).shape() == shape, opt_path, ": tensor '", key, "' is of shape ",
                 shape_str(opt.tensors.at(key).shape()), ", an amax history of another length than ",
                 "train.fp8_amax_history = ", h.length(), " (the setting changed?)");
    std::vector<float> values(size_t(shape_numel(shape)));
    read_tensor(opt, opt_path, key, shape, values.data());
    h.set_values(values, opt_path + ": tensor '" + key + "'");
  }
}

std::unique_ptr<Transformer<float>> load_model(const std::string& checkpoint_dir, CheckpointContents* info_out) {
  const CheckpointContents info = read_checkpoint_info(checkpoint_dir);
  auto model = std::make_unique<Transformer<float>>(info.config.model);
  model->set_linear_precision(info.config.linear_precision());  // eval and sample compute as training did
  if (!info.config.recipe_yaml.empty()) {
    Recipe recipe = Recipe::parse(info.config.recipe_yaml, checkpoint_dir + " (recipe in the saved config)");
    recipe.validate(linear_shapes(*model), info.config.steps);
    build_kinds_after(*model, recipe, info.state.step, info.config.seed);
  }
  load_checkpoint_weights(checkpoint_dir, *model);
  if (info_out) *info_out = info;
  return model;
}

ModelConfig init_from_model(const TrainConfig& config, const std::string& data_tokenizer) {
  const std::string& dir = config.init_from;
  const std::string what = "train.init_from '" + dir + "'";
  std::string ck;
  try {
    ck = resolve_checkpoint(dir);
  } catch (const Error& e) {
    fail(what, ": ", e.what());
  }
  const CheckpointContents info = read_checkpoint_info(ck);
  const auto& given = config.model_keys_given;
  const bool preset = std::find(given.begin(), given.end(), "model.preset") != given.end();
  TrainConfig theirs = config;
  theirs.model = info.config.model;
  const FlatConfig mine_flat = flatten(config), theirs_flat = flatten(theirs);
  for (size_t i = 0; i < mine_flat.size(); ++i) {
    const auto& [key, value] = mine_flat[i];
    if (key.rfind("model.", 0) != 0 || key == "model.preset" || key == "model.init_std") continue;
    if (key == "model.vocab_size" && config.model.vocab_size == 0) continue;
    if (!preset && std::find(given.begin(), given.end(), key) == given.end()) continue;
    ESPLAG_CHECK(value == theirs_flat[i].second, what, ": ", key, " is ", value, " in the config (",
                 preset && std::find(given.begin(), given.end(), key) == given.end() ? "from model.preset" : "given",
                 ") but ", theirs_flat[i].second, " in the checkpoint ", ck,
                 "; leave the model section out to train the checkpoint's model");
  }
  ESPLAG_CHECK(same_tokenizer(data_tokenizer, info.tokenizer), what, ": data '", config.data_path, "' was tokenized with '", data_tokenizer,
               "' but the checkpoint ", ck, " was trained with '", info.tokenizer,
               "' (prepare the data with the checkpoint's tokenizer)");
  return info.config.model;
}

bool same_tokenizer(const std::string& a, const std::string& b) {
  if (a == b) return true;
  std::error_code ec;
  return fs::is_regular_file(a, ec) && fs::is_regular_file(b, ec) && read_file(a) == read_file(b);
}

void load_init_weights(const std::string& init_from, Transformer<float>& model) {
  const auto source = load_model(resolve_checkpoint(init_from));
  for (const auto& info : model.param_infos()) {
    const ParamInfo& theirs = source->param_info(info.name);
    ESPLAG_CHECK(theirs.shape == info.shape, "train.init_from '", init_from, "': parameter '", info.name,
                 "' has shape ", shape_str(theirs.shape), " there, the model needs ", shape_str(info.shape));
    std::copy_n(source->params() + theirs.offset, info.numel, model.params() + info.offset);
  }
  // A Linear's weight is what it computes with: a sparse kind's effective dense weight.
  for (const auto& name : source->linear_names())
    source->linear(name).dense_weight(model.params() + model.param_info(name).offset);
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
