#include "train/config.h"

#include <yaml-cpp/yaml.h>

#include <functional>
#include <set>
#include <sstream>

#include "core/error.h"

namespace esplag {

namespace {

// One entry per config key: how to read it from text and how to print it.
struct Field {
  std::string key;
  std::function<void(TrainConfig&, const std::string&)> set;
  std::function<std::string(const TrainConfig&)> get;
};

template <typename V>
V parse_value(const std::string& key, const std::string& text) {
  try {
    return YAML::Load(text).as<V>();
  } catch (const YAML::Exception&) {
    const char* what = std::is_same_v<V, bool> ? "a boolean"
                       : std::is_integral_v<V> ? "an integer"
                       : std::is_floating_point_v<V> ? "a number"
                                                     : "a string";
    fail("config key '", key, "' must be ", what, ", got '", text, "'");
  }
}

template <typename V>
std::string print_value(const V& v) {
  if constexpr (std::is_same_v<V, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_floating_point_v<V>) {
    std::ostringstream os;
    os.precision(17);
    os << v;
    return os.str();
  } else if constexpr (std::is_same_v<V, std::string>) {
    return v;
  } else {
    return std::to_string(v);
  }
}

template <typename V>
Field field(const std::string& key, V TrainConfig::*member) {
  return {key, [key, member](TrainConfig& c, const std::string& t) { c.*member = parse_value<V>(key, t); },
          [member](const TrainConfig& c) { return print_value(c.*member); }};
}
template <typename S, typename V>
Field field(const std::string& key, S TrainConfig::*section, V S::*member) {
  return {key,
          [key, section, member](TrainConfig& c, const std::string& t) { c.*section.*member = parse_value<V>(key, t); },
          [section, member](const TrainConfig& c) { return print_value(c.*section.*member); }};
}
template <typename S, typename E>
Field enum_field(const std::string& key, S TrainConfig::*section, E S::*member, E (*from)(const std::string&),
                 std::string (*to)(E)) {
  return {key, [section, member, from](TrainConfig& c, const std::string& t) { c.*section.*member = from(t); },
          [section, member, to](const TrainConfig& c) { return to(c.*section.*member); }};
}

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      // model.preset is applied first (it resets the model section), see parse_train_config.
      field("model.preset", &TrainConfig::model, &ModelConfig::preset),
      field("model.vocab_size", &TrainConfig::model, &ModelConfig::vocab_size),
      field("model.max_seq_len", &TrainConfig::model, &ModelConfig::max_seq_len),
      field("model.n_layer", &TrainConfig::model, &ModelConfig::n_layer),
      field("model.n_head", &TrainConfig::model, &ModelConfig::n_head),
      field("model.n_kv_head", &TrainConfig::model, &ModelConfig::n_kv_head),
      field("model.d_model", &TrainConfig::model, &ModelConfig::d_model),
      field("model.d_ff", &TrainConfig::model, &ModelConfig::d_ff),
      enum_field("model.norm", &TrainConfig::model, &ModelConfig::norm, norm_kind_from, to_string),
      enum_field("model.pos", &TrainConfig::model, &ModelConfig::pos, pos_kind_from, to_string),
      enum_field("model.mlp", &TrainConfig::model, &ModelConfig::mlp, mlp_kind_from, to_string),
      field("model.tie_embeddings", &TrainConfig::model, &ModelConfig::tie_embeddings),
      field("model.bias", &TrainConfig::model, &ModelConfig::bias),
      field("model.rope_theta", &TrainConfig::model, &ModelConfig::rope_theta),
      field("model.init_std", &TrainConfig::model, &ModelConfig::init_std),
      field("data.path", &TrainConfig::data_path),
      field("train.batch_size", &TrainConfig::batch_size),
      field("train.seq_len", &TrainConfig::seq_len),
      field("train.grad_accum", &TrainConfig::grad_accum),
      field("train.steps", &TrainConfig::steps),
      field("train.seed", &TrainConfig::seed),
      field("train.device", &TrainConfig::device),
      field("train.log_every", &TrainConfig::log_every),
      field("train.eval_every", &TrainConfig::eval_every),
      field("train.eval_batches", &TrainConfig::eval_batches),
      field("train.checkpoint_every", &TrainConfig::checkpoint_every),
      field("train.keep_checkpoints", &TrainConfig::keep_checkpoints),
      field("optimizer.lr", &TrainConfig::optimizer, &OptimizerConfig::lr),
      field("optimizer.beta1", &TrainConfig::optimizer, &OptimizerConfig::beta1),
      field("optimizer.beta2", &TrainConfig::optimizer, &OptimizerConfig::beta2),
      field("optimizer.eps", &TrainConfig::optimizer, &OptimizerConfig::eps),
      field("optimizer.weight_decay", &TrainConfig::optimizer, &OptimizerConfig::weight_decay),
      field("optimizer.grad_clip", &TrainConfig::optimizer, &OptimizerConfig::grad_clip),
      field("schedule.warmup_steps", &TrainConfig::schedule, &LrSchedule::warmup_steps),
      enum_field("schedule.decay", &TrainConfig::schedule, &LrSchedule::decay, decay_kind_from, to_string),
      field("schedule.min_lr_ratio", &TrainConfig::schedule, &LrSchedule::min_lr_ratio),
  };
  return f;
}

const Field* find_field(const std::string& key) {
  for (const auto& f : fields())
    if (f.key == key) return &f;
  return nullptr;
}

// Walks a YAML mapping two levels deep (section -> key -> scalar) into dotted keys; the
// `recipe` section, a list of modifiers, is kept whole as YAML text.
void collect(const YAML::Node& root, const std::string& source, std::vector<std::pair<std::string, std::string>>& out,
             std::string& recipe) {
  if (!root || root.IsNull()) return;
  ESPLAG_CHECK(root.IsMap(), source, ": the config must be a mapping of sections (model, data, train, ...)");
  for (const auto& sec : root) {
    const std::string section = sec.first.as<std::string>();
    if (section == "recipe") {
      ESPLAG_CHECK(sec.second.IsSequence() || sec.second.IsNull(), source,
                   ": `recipe` must be a list of modifiers (see docs/recipes.md)");
      if (sec.second.IsSequence() && sec.second.size() > 0) {
        YAML::Emitter e;
        e << sec.second;
        recipe = e.c_str();
      }
      continue;
    }
    ESPLAG_CHECK(sec.second.IsMap(), source, ": config section '", section, "' must be a mapping of keys");
    for (const auto& kv : sec.second) {
      const std::string key = section + "." + kv.first.as<std::string>();
      ESPLAG_CHECK(find_field(key), source, ": unknown config key '", key, "'");
      ESPLAG_CHECK(kv.second.IsScalar(), source, ": config key '", key, "' must be a single value");
      out.emplace_back(key, kv.second.Scalar());
    }
  }
}

}  // namespace

void TrainConfig::validate() const {
  ESPLAG_CHECK(batch_size > 0, "train.batch_size must be positive, got ", batch_size);
  ESPLAG_CHECK(seq_len > 0, "train.seq_len must be positive, got ", seq_len);
  ESPLAG_CHECK(seq_len <= model.max_seq_len, "train.seq_len (", seq_len, ") exceeds model.max_seq_len (",
               model.max_seq_len, ")");
  ESPLAG_CHECK(grad_accum > 0, "train.grad_accum must be positive, got ", grad_accum);
  ESPLAG_CHECK(steps > 0, "train.steps must be positive, got ", steps);
  ESPLAG_CHECK(log_every > 0, "train.log_every must be positive, got ", log_every);
  ESPLAG_CHECK(eval_every >= 0 && checkpoint_every >= 0 && keep_checkpoints >= 0,
               "train.eval_every, train.checkpoint_every and train.keep_checkpoints must not be negative");
  ESPLAG_CHECK(eval_batches > 0, "train.eval_batches must be positive, got ", eval_batches);
  ESPLAG_CHECK(device == "auto" || device == "cpu" || device == "cuda", "train.device must be auto, cpu or cuda, got '",
               device, "'");
  ESPLAG_CHECK(optimizer.lr > 0, "optimizer.lr must be positive, got ", optimizer.lr);
  ESPLAG_CHECK(optimizer.beta1 >= 0 && optimizer.beta1 < 1 && optimizer.beta2 >= 0 && optimizer.beta2 < 1,
               "optimizer.beta1 and optimizer.beta2 must be in [0, 1)");
  ESPLAG_CHECK(optimizer.eps > 0, "optimizer.eps must be positive");
  ESPLAG_CHECK(optimizer.weight_decay >= 0, "optimizer.weight_decay must not be negative");
  ESPLAG_CHECK(schedule.warmup_steps >= 0, "schedule.warmup_steps must not be negative");
  ESPLAG_CHECK(schedule.min_lr_ratio >= 0 && schedule.min_lr_ratio <= 1, "schedule.min_lr_ratio must be in [0, 1]");
  if (model.vocab_size != 0) model.validate();
}

TrainConfig parse_train_config(const std::string& yaml_text, const std::string& source,
                               const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    fail(source, ": invalid YAML: ", e.what());
  }
  std::vector<std::pair<std::string, std::string>> entries;
  std::string recipe;
  collect(root, source, entries, recipe);
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    ESPLAG_CHECK(eq != std::string::npos && eq > 0, "--set expects key=value, got '", o, "'");
    const std::string key = o.substr(0, eq);
    ESPLAG_CHECK(find_field(key), "--set ", o, ": unknown config key '", key, "'");
    entries.emplace_back(key, o.substr(eq + 1));
  }
  TrainConfig c;
  c.recipe_yaml = recipe;
  // The preset (last one given wins) sets the whole model section before any model.* key.
  for (const auto& [k, v] : entries)
    if (k == "model.preset") c.model = model_preset(v);
  for (const auto& [k, v] : entries)
    if (k != "model.preset") find_field(k)->set(c, v);
  c.schedule.lr = c.optimizer.lr;
  c.schedule.total_steps = c.steps;
  c.validate();
  return c;
}

TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::string text;
  try {
    YAML::Node n = YAML::LoadFile(path);
    std::ostringstream os;
    os << n;
    text = os.str();
  } catch (const YAML::BadFile&) {
    fail("cannot read config file '", path, "'");
  } catch (const YAML::Exception& e) {
    fail(path, ": invalid YAML: ", e.what());
  }
  return parse_train_config(text, path, overrides);
}

FlatConfig flatten(const TrainConfig& c) {
  FlatConfig out;
  for (const auto& f : fields()) out.emplace_back(f.key, f.get(c));
  return out;
}

std::string to_yaml(const TrainConfig& c) {
  YAML::Emitter e;
  e << YAML::BeginMap;
  std::string section;
  for (const auto& [key, value] : flatten(c)) {
    const auto dot = key.find('.');
    const std::string s = key.substr(0, dot);
    if (s != section) {
      if (!section.empty()) e << YAML::EndMap;
      e << YAML::Key << s << YAML::Value << YAML::BeginMap;
      section = s;
    }
    e << YAML::Key << key.substr(dot + 1) << YAML::Value << value;
  }
  e << YAML::EndMap;
  if (!c.recipe_yaml.empty()) e << YAML::Key << "recipe" << YAML::Value << YAML::Load(c.recipe_yaml);
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

}  // namespace esplag
