#include "train/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "io/utf8.h"
#include "train/layer_kinds.h"

namespace esplag {

namespace {

// One entry per config key: how to read it from text (type and range checked), how to
// print it, and how to check a value set in code against the same range.
struct Field {
  std::string key;
  std::function<void(TrainConfig&, const std::string&)> set;
  std::function<std::string(const TrainConfig&)> get;
  std::function<void(const TrainConfig&)> check;
};

template <typename V>
using Ref = std::function<V&(TrainConfig&)>;

template <typename V>
Ref<V> ref(V TrainConfig::*member) {
  return [member](TrainConfig& c) -> V& { return c.*member; };
}
template <typename S, typename V>
Ref<V> ref(S TrainConfig::*section, V S::*member) {
  return [section, member](TrainConfig& c) -> V& { return c.*section.*member; };
}
template <typename V>
const V& read(const Ref<V>& r, const TrainConfig& c) {
  return r(const_cast<TrainConfig&>(c));
}

std::string real_text(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

bool is_integer_text(const std::string& s) {
  const size_t first = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  return s.size() > first && std::all_of(s.begin() + first, s.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

// An integer key (int, int64_t or uint64_t member) whose values lie in [min, max].
template <typename V>
Field integer(const std::string& key, Ref<V> r, V min, V max) {
  const std::string range = detail::concat("[", min, ", ", max, "]");
  auto out_of_range = [key, range](const std::string& got) {
    fail("config key '", key, "' must be an integer in ", range, ", got ", got);
  };
  auto set = [=](TrainConfig& c, const std::string& text) {
    ESPLAG_CHECK(is_integer_text(text), "config key '", key, "' must be an integer in ", range, ", got '", text, "'");
    const char* begin = text.data() + (text[0] == '+' ? 1 : 0);
    V v{};
    const auto [end, ec] = std::from_chars(begin, text.data() + text.size(), v);
    // A negative value of an unsigned key, or one beyond the member's type, is out of range too.
    if (ec != std::errc() || end != text.data() + text.size() || v < min || v > max) out_of_range(text);
    r(c) = v;
  };
  auto check = [=](const TrainConfig& c) {
    const V v = read(r, c);
    if (v < min || v > max) out_of_range(std::to_string(v));
  };
  return {key, set, [r](const TrainConfig& c) { return std::to_string(read(r, c)); }, check};
}

// A real-number key in the interval from `min` to `max` (open at an end marked so); NaN is never in it.
struct Interval {
  double min, max;
  bool min_open, max_open;
  bool contains(double v) const {
    return (min_open ? v > min : v >= min) && (max_open ? v < max : v <= max);
  }
  std::string text() const {
    return detail::concat(min_open ? "(" : "[", real_text(min), ", ", real_text(max), max_open ? ")" : "]");
  }
};
constexpr double kInf = std::numeric_limits<double>::infinity();

Field real(const std::string& key, Ref<double> r, Interval in) {
  auto out_of_range = [key, in](const std::string& got) {
    fail("config key '", key, "' must be a number in ", in.text(), ", got ", got);
  };
  auto set = [=](TrainConfig& c, const std::string& text) {
    double v = 0;
    try {
      v = YAML::Load(text).as<double>();
    } catch (const YAML::Exception&) {
      fail("config key '", key, "' must be a number in ", in.text(), ", got '", text, "'");
    }
    if (!in.contains(v)) out_of_range(text);
    r(c) = v;
  };
  auto check = [=](const TrainConfig& c) {
    if (!in.contains(read(r, c))) out_of_range(real_text(read(r, c)));
  };
  return {key, set, [r](const TrainConfig& c) { return real_text(read(r, c)); }, check};
}

Field boolean(const std::string& key, Ref<bool> r) {
  auto set = [=](TrainConfig& c, const std::string& text) {
    try {
      r(c) = YAML::Load(text).as<bool>();
    } catch (const YAML::Exception&) {
      fail("config key '", key, "' must be true or false, got '", text, "'");
    }
  };
  return {key, set, [r](const TrainConfig& c) { return read(r, c) ? "true" : "false"; }, {}};
}

// A text key; with `choices`, one of them.
Field text(const std::string& key, Ref<std::string> r, std::vector<std::string> choices = {}) {
  auto check = [=](const TrainConfig& c) {
    const std::string& v = read(r, c);
    if (choices.empty() || std::find(choices.begin(), choices.end(), v) != choices.end()) return;
    std::string list;
    for (size_t i = 0; i < choices.size(); ++i)
      list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
    fail("config key '", key, "' must be ", list, ", got '", v, "'");
  };
  auto set = [=](TrainConfig& c, const std::string& t) {
    r(c) = t;
    check(c);
  };
  return {key, set, [r](const TrainConfig& c) { return read(r, c); }, check};
}

template <typename E>
Field choice(const std::string& key, Ref<E> r, E (*from)(const std::string&), std::string (*to)(E)) {
  return {key, [r, from](TrainConfig& c, const std::string& t) { r(c) = from(t); },
          [r, to](const TrainConfig& c) { return to(read(r, c)); }, {}};
}

constexpr int kIntMax = std::numeric_limits<int>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// Every config key with its type and range: the one place that declares them.
const std::vector<Field>& fields() {
  using M = ModelConfig;
  using T = TrainConfig;
  using O = OptimizerConfig;
  using S = LrSchedule;
  static const std::vector<Field> f = {
      // model.preset is applied first (it resets the model section), see parse_train_config.
      text("model.preset", ref(&T::model, &M::preset)),
      integer("model.vocab_size", ref(&T::model, &M::vocab_size), 0, kIntMax),  // 0: from the dataset
      integer("model.max_seq_len", ref(&T::model, &M::max_seq_len), 1, kIntMax),
      integer("model.n_layer", ref(&T::model, &M::n_layer), 1, kIntMax),
      integer("model.n_head", ref(&T::model, &M::n_head), 1, kIntMax),
      integer("model.n_kv_head", ref(&T::model, &M::n_kv_head), 1, kIntMax),
      integer("model.d_model", ref(&T::model, &M::d_model), 1, kIntMax),
      integer("model.d_ff", ref(&T::model, &M::d_ff), 1, kIntMax),
      choice("model.norm", ref(&T::model, &M::norm), norm_kind_from, to_string),
      choice("model.pos", ref(&T::model, &M::pos), pos_kind_from, to_string),
      choice("model.mlp", ref(&T::model, &M::mlp), mlp_kind_from, to_string),
      boolean("model.tie_embeddings", ref(&T::model, &M::tie_embeddings)),
      boolean("model.bias", ref(&T::model, &M::bias)),
      real("model.rope_theta", ref(&T::model, &M::rope_theta), {0, kInf, true, true}),
      real("model.norm_eps", ref(&T::model, &M::norm_eps), {0, M::kMaxNormEps, true, false}),
      real("model.init_std", ref(&T::model, &M::init_std), {0, kInf, false, true}),
      text("data.path", ref(&T::data_path)),
      integer("train.batch_size", ref(&T::batch_size), 1, kIntMax),
      integer("train.seq_len", ref(&T::seq_len), 1, kIntMax),
      integer("train.grad_accum", ref(&T::grad_accum), 1, kIntMax),
      integer<int64_t>("train.steps", ref(&T::steps), 1, kInt64Max),
      integer<uint64_t>("train.seed", ref(&T::seed), 0, std::numeric_limits<uint64_t>::max()),
      text("train.device", ref(&T::device), {"auto", "cpu", "cuda"}),
      integer<int64_t>("train.log_every", ref(&T::log_every), 1, kInt64Max),
      integer<int64_t>("train.eval_every", ref(&T::eval_every), 0, kInt64Max),
      integer("train.eval_batches", ref(&T::eval_batches), 1, kIntMax),
      integer<int64_t>("train.checkpoint_every", ref(&T::checkpoint_every), 0, kInt64Max),
      integer("train.keep_checkpoints", ref(&T::keep_checkpoints), 0, kIntMax),
      choice("train.checkpointing", ref(&T::checkpointing, &ActivationCheckpointing::mode), checkpoint_mode_from,
             to_string),
      integer("train.checkpointing_every", ref(&T::checkpointing, &ActivationCheckpointing::every), 1, kIntMax),
      text("train.memory", ref(&T::memory), {"fixed", "auto"}),
      text("train.offload", ref(&T::offload), {"none", "optimizer", "optimizer+master"}),
      text("train.precision", ref(&T::precision), {"bf16", "fp8"}),
      text("train.fp8_grad", ref(&T::fp8_grad), {"e5m2", "e4m3"}),
      text("train.fp8_scaling", ref(&T::fp8_scaling), {"current", "delayed"}),
      integer("train.fp8_amax_history", ref(&T::fp8_amax_history), 1, 1024),
      text("train.sparse_dispatch", ref(&T::sparse_dispatch), {"measure", "sparse"}),
      text("train.init_from", ref(&T::init_from)),
      real("optimizer.lr", ref(&T::optimizer, &O::lr), {0, kInf, true, true}),
      real("optimizer.beta1", ref(&T::optimizer, &O::beta1), {0, 1, false, true}),
      real("optimizer.beta2", ref(&T::optimizer, &O::beta2), {0, 1, false, true}),
      real("optimizer.eps", ref(&T::optimizer, &O::eps), {0, kInf, true, true}),
      real("optimizer.weight_decay", ref(&T::optimizer, &O::weight_decay), {0, kInf, false, true}),
      real("optimizer.grad_clip", ref(&T::optimizer, &O::grad_clip), {-kInf, kInf, true, true}),  // <= 0: off
      integer("parallel.zero", ref(&T::parallel, &ParallelConfig::zero), 0, 3),
      real("parallel.bucket_mb", ref(&T::parallel, &ParallelConfig::bucket_mb), {0, 1 << 20, false, false}),
      integer<int64_t>("schedule.warmup_steps", ref(&T::schedule, &S::warmup_steps), 0, kInt64Max),
      choice("schedule.decay", ref(&T::schedule, &S::decay), decay_kind_from, to_string),
      real("schedule.min_lr_ratio", ref(&T::schedule, &S::min_lr_ratio), {0, 1, false, false}),
  };
  return f;
}

const Field* find_field(const std::string& key) {
  for (const auto& f : fields())
    if (f.key == key) return &f;
  return nullptr;
}

// A config key and its value, with where it was given ("run.yaml" or "--set k=v") for errors.
struct Entry {
  std::string key, value, origin;
};

// Walks a YAML mapping two levels deep (section -> key -> scalar) into dotted keys; the
// `recipe` section, a list of modifiers, is kept whole.
void collect(const YAML::Node& root, const std::string& source, std::vector<Entry>& out, YAML::Node& recipe) {
  if (!root || root.IsNull()) return;
  ESPLAG_CHECK(root.IsMap(), source, ": the config must be a mapping of sections (model, data, train, ...)");
  for (const auto& sec : root) {
    ESPLAG_CHECK(sec.first.IsScalar(), source, ": a config section name must be a plain word (model, data, ...)");
    const std::string section = sec.first.as<std::string>();
    if (section == "recipe") {
      ESPLAG_CHECK(sec.second.IsSequence() || sec.second.IsNull(), source,
                   ": `recipe` must be a list of modifiers (see docs/recipes.md)");
      if (sec.second.IsSequence()) recipe = sec.second;
      continue;
    }
    ESPLAG_CHECK(sec.second.IsMap(), source, ": config section '", section, "' must be a mapping of keys");
    for (const auto& kv : sec.second) {
      ESPLAG_CHECK(kv.first.IsScalar(), source, ": a key of config section '", section, "' must be a plain word");
      const std::string key = section + "." + kv.first.as<std::string>();
      ESPLAG_CHECK(find_field(key), source, ": unknown config key '", key, "'");
      ESPLAG_CHECK(kv.second.IsScalar(), source, ": config key '", key, "' must be a single value");
      out.push_back({key, kv.second.Scalar(), source});
    }
  }
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

bool is_recipe_key(const std::string& key) { return key.rfind("recipe.", 0) == 0 || key.rfind("recipe[", 0) == 0; }

// `--set recipe.<i>.<type>.<key>=V` (or `recipe[<i>].<type>.<key>=V`): sets one key of the
// recipe's modifier i, which must be of that type and know the key. V is YAML (a scalar, or
// a list for params).
void apply_recipe_override(YAML::Node& recipe, const std::string& override_text, const std::string& key,
                           const std::string& value) {
  const std::string origin = "--set " + override_text;
  std::string path = key;
  if (path.rfind("recipe[", 0) == 0) {  // recipe[i].rest -> recipe.i.rest
    const size_t close = path.find("].");
    ESPLAG_CHECK(close != std::string::npos, origin, ": a recipe key is recipe.<index>.<modifier>.<key>, e.g. ",
                 "recipe.0.gradual_magnitude.end=0.8");
    path = "recipe." + path.substr(7, close - 7) + path.substr(close + 1);
  }
  std::vector<std::string> parts;
  for (size_t begin = 0;;) {
    const size_t dot = path.find('.', begin);
    parts.push_back(path.substr(begin, dot - begin));
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  ESPLAG_CHECK(parts.size() == 4 && !parts[1].empty() && std::all_of(parts[1].begin(), parts[1].end(), ::isdigit) &&
                   parts[1].size() < 10 && !parts[2].empty() && !parts[3].empty(),
               origin, ": a recipe key is recipe.<index>.<modifier>.<key>, e.g. recipe.0.gradual_magnitude.end=0.8");
  const size_t index = std::stoul(parts[1]);
  const std::string& type = parts[2];
  const std::string& name = parts[3];
  const size_t n = recipe.IsSequence() ? recipe.size() : 0;
  ESPLAG_CHECK(index < n, origin, ": the config's recipe has ", n, " modifier", n == 1 ? "" : "s",
               n == 0 ? "" : detail::concat(" (recipe.0 to recipe.", n - 1, ")"));
  YAML::Node item = recipe[index];
  const std::string actual = item.IsMap() && item.size() == 1 ? item.begin()->first.as<std::string>() : "";
  ESPLAG_CHECK(actual == type, origin, ": recipe[", index, "] is a '", actual, "' modifier, not '", type, "'");
  const std::vector<std::string> keys = Recipe::modifier_keys(type);
  ESPLAG_CHECK(std::find(keys.begin(), keys.end(), name) != keys.end(), origin, ": unknown key '", name, "' of ", type,
               " (known: ", join(keys), ")");
  YAML::Node v;
  try {
    v = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    fail(origin, ": invalid value: ", e.what());
  }
  item.begin()->second[name] = v;
}

}  // namespace

void TrainConfig::validate_settings() const {
  for (const auto& f : fields())
    if (f.check) f.check(*this);
  ESPLAG_CHECK(schedule.warmup_steps <= steps, "schedule.warmup_steps (", schedule.warmup_steps,
               ") is larger than train.steps (", steps, "): the run would end before the learning rate is reached");
  ESPLAG_CHECK(parallel.zero <= 2 || device != "cpu", "parallel.zero = 3 (sharded parameters) is built for ",
               "train.device cuda; the CPU reference trains stages 0 to 2, whose numbers stage 3 gives");
}

namespace {

// ZeRO stage 3 keeps each layer's kind from the start (GpuModelOptions::shard_parameters):
// error for a recipe modifier that would change one mid-run or rewrite its weights.
void check_zero3_recipe(const Recipe& recipe, int64_t steps) {
  for (const Recipe::Modifier& m : recipe.modifiers()) {
    if (m.type == "distill") continue;
    const int64_t start = m.start.resolve(steps);
    std::string why;
    if (m.kind() == "masked" || m.kind() == "vnm")
      why = "its layers rewrite their weights after every update";
    else if (m.lora_rank > 0)
      why = "it adds adapters (lora_rank)";
    else if (m.has_until)
      why = "its layers turn dense at `until`";
    else if (start > 0)
      why = "its layers change kind at step " + std::to_string(start);
    ESPLAG_CHECK(why.empty(), "parallel.zero = 3: the recipe's ", m.type, " modifier cannot train under ZeRO stage 3 (",
                 why, "); use parallel.zero 2, or a recipe whose kinds hold from step 0");
  }
}

}  // namespace

void TrainConfig::validate() const {
  validate_settings();
  ESPLAG_CHECK(seq_len <= model.max_seq_len, "train.seq_len (", seq_len, ") exceeds model.max_seq_len (",
               model.max_seq_len, ")");
  if (model.vocab_size == 0)
    model.validate_shape();  // the dataset's vocabulary fills it in
  else
    model.validate();
  if (!recipe_yaml.empty()) recipe().validate(linear_shapes(model), steps);
  if (parallel.zero == 3 && !recipe_yaml.empty()) check_zero3_recipe(recipe(), steps);
}

Recipe TrainConfig::recipe() const { return Recipe::parse(recipe_yaml, source); }

LinearPrecision TrainConfig::linear_precision() const {
  LinearPrecision p;
  p.fp8 = precision == "fp8";
  p.grad = fp8_format_from(fp8_grad, "train.fp8_grad");
  p.scaling = fp8_scaling == "delayed" ? Fp8Scaling::delayed : Fp8Scaling::current;
  p.amax_history = fp8_amax_history;
  return p;
}

TrainConfig parse_train_config(const std::string& yaml_text, const std::string& source,
                               const std::vector<std::string>& overrides) {
  const size_t bad = invalid_utf8_at(yaml_text);
  ESPLAG_CHECK(bad == std::string::npos, source, ": not UTF-8 text (byte ", bad, ")");
  for (const auto& o : overrides)
    ESPLAG_CHECK(invalid_utf8_at(o) == std::string::npos, "--set ", o, ": not UTF-8 text");
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    fail(source, ": invalid YAML: ", e.what());
  }
  std::vector<Entry> entries;
  YAML::Node recipe;
  collect(root, source, entries, recipe);
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    ESPLAG_CHECK(eq != std::string::npos && eq > 0, "--set expects key=value, got '", o, "'");
    const std::string key = o.substr(0, eq);
    if (is_recipe_key(key)) {
      apply_recipe_override(recipe, o, key, o.substr(eq + 1));
      continue;
    }
    ESPLAG_CHECK(find_field(key), "--set ", o, ": unknown config key '", key, "'");
    entries.push_back({key, o.substr(eq + 1), "--set " + o});
  }
  TrainConfig c;
  c.source = source;
  if (recipe && recipe.IsSequence() && recipe.size() > 0) {
    YAML::Emitter e;
    e << recipe;
    c.recipe_yaml = e.c_str();
  }
  // The preset (last one given wins) sets the whole model section before any model.* key.
  for (const auto& [k, v, origin] : entries) {
    try {
      if (k == "model.preset") c.model = model_preset(v);
    } catch (const Error& e) {
      fail(origin, ": ", e.what());
    }
  }
  for (const auto& [k, v, origin] : entries) {
    if (k.rfind("model.", 0) == 0) c.model_keys_given.push_back(k);
    try {
      if (k != "model.preset") find_field(k)->set(c, v);
    } catch (const Error& e) {
      fail(origin, ": ", e.what());
    }
  }
  c.schedule.lr = c.optimizer.lr;
  c.schedule.total_steps = c.steps;
  try {
    // With train.init_from the model section is the checkpoint's, checked when the run starts.
    if (c.init_from.empty())
      c.validate();
    else
      c.validate_settings();
  } catch (const Error& e) {
    // Recipe errors already start with the source.
    const std::string what = e.what();
    if (what.rfind(source + ":", 0) == 0) throw;
    fail(source, ": ", what);
  }
  return c;
}

TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  ESPLAG_CHECK(!std::filesystem::is_directory(path, ec), "config file '", path, "' is a directory");
  std::string text;
  try {
    YAML::Node n = YAML::LoadFile(path);
    ESPLAG_CHECK(n && !n.IsNull() && !(n.IsMap() && n.size() == 0), "config file '", path,
                 "' is empty: give at least the data and the model to train (see configs/tiny.yaml and "
                 "docs/config.md)");
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
