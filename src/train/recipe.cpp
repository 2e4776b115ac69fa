#include "train/recipe.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "core/error.h"
#include "io/utf8.h"
#include "model/linear_registry.h"

namespace esplag {

namespace {

constexpr int64_t kForever = std::numeric_limits<int64_t>::max();

const char* const kGmp = "gradual_magnitude";
const char* const kKernel = "kernel_replacement";
const char* const kSemi = "semi_sparse";
const char* const kSemiAct = "semi_sparse_activation";
const char* const kSlope = "slope";
const char* const kDistill = "distill";

struct TypeKeys {
  std::vector<std::string> keys;      // every key the type knows, in to_yaml order
  std::vector<std::string> required;  // (final_sparsity is required only for unstructured masks)
};

// The keys of a modifier type: gradual_magnitude's and kernel_replacement's own, a kind's
// params, start and its registry entry's recipe_keys; none for an unknown type.
std::optional<TypeKeys> find_type(const std::string& type) {
  if (type == kGmp)
    return TypeKeys{{"params", "mask_type", "init_sparsity", "final_sparsity", "start", "end", "update_every"},
                    {"params", "start", "end", "update_every"}};
  if (type == kKernel) return TypeKeys{{"params", "start", "lora_rank", "lora_start"}, {"params", "start"}};
  if (type == kDistill) return TypeKeys{{"teacher", "alpha", "temperature", "start", "until"}, {"teacher"}};
  const LinearKindInfo* kind = lookup_linear_kind(type);
  if (!kind || !kind->recipe_modifier) return std::nullopt;
  TypeKeys t{{"params", "start"}, {"params"}};
  t.keys.insert(t.keys.end(), kind->recipe_keys.begin(), kind->recipe_keys.end());
  return t;
}

bool type_knows(const std::string& type, const std::string& key) {
  const auto t = find_type(type);
  return t && std::find(t->keys.begin(), t->keys.end(), key) != t->keys.end();
}

// The modifier types, for errors: gradual_magnitude, kernel_replacement, distill, then the
// kinds with recipe_modifier in registry order.
std::vector<std::string> type_names() {
  std::vector<std::string> names{kGmp, kKernel, kDistill};
  for (const auto& k : linear_kinds())
    if (k.recipe_modifier) names.push_back(k.name);
  return names;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

// Shortest text that reads back to the same double.
std::string number_text(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

bool is_integer_text(const std::string& s) {
  size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  if (i == s.size()) return false;
  for (; i < s.size(); ++i)
    if (s[i] < '0' || s[i] > '9') return false;
  return true;
}

bool parse_double(const std::string& s, double& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(out);
}

int parse_int(const std::string& where, const std::string& key, const std::string& text, int min) {
  constexpr int max = std::numeric_limits<int>::max();
  ESPLAG_CHECK(is_integer_text(text), where, ": key '", key, "' must be an integer, got '", text, "'");
  const bool fits = text.size() <= 18 && std::stoll(text) >= min && std::stoll(text) <= max;
  ESPLAG_CHECK(fits, where, ": key '", key, "' must be in [", min, ", ", max, "], got ", text);
  return static_cast<int>(std::stoll(text));
}

// A YAML boolean (true / false, and YAML's other spellings of them, as the config's keys).
bool parse_bool(const std::string& where, const std::string& key, const YAML::Node& node) {
  bool v = false;
  ESPLAG_CHECK(YAML::convert<bool>::decode(node, v), where, ": key '", key, "' must be true or false, got '",
               node.Scalar(), "'");
  return v;
}

double parse_sparsity(const std::string& where, const std::string& key, const std::string& text) {
  double v = 0;
  ESPLAG_CHECK(parse_double(text, v), where, ": key '", key, "' must be a number, got '", text, "'");
  ESPLAG_CHECK(v >= 0.0 && v < 1.0, where, ": key '", key, "' must be in [0, 1), got ", text);
  return v;
}

StepValue parse_step(const std::string& where, const std::string& key, const std::string& text) {
  StepValue s;
  s.text = text;
  if (is_integer_text(text)) {
    ESPLAG_CHECK(text.size() <= 18, where, ": key '", key, "': step '", text, "' is too large");
    s.steps = std::stoll(text);
    ESPLAG_CHECK(s.steps >= 0, where, ": key '", key, "' must not be negative, got ", text);
    s.text = std::to_string(s.steps);
    return s;
  }
  double f = 0;
  ESPLAG_CHECK(parse_double(text, f), where, ": key '", key,
               "' must be a step (an integer) or a fraction of train.steps (a number with a '.', in [0, 1]), got '",
               text, "'");
  ESPLAG_CHECK(f >= 0.0 && f <= 1.0, where, ": key '", key, "': ", text,
               " is read as a fraction of train.steps (it is not an integer) and must be in [0, 1]; write a whole "
               "number for a step index");
  s.is_fraction = true;
  s.fraction = f;
  return s;
}

StepValue integer_step(int64_t v) {
  StepValue s;
  s.steps = v;
  s.text = std::to_string(v);
  return s;
}

StepValue fraction_step(double f) {
  StepValue s;
  s.is_fraction = true;
  s.fraction = f;
  s.text = number_text(f);
  return s;
}

// Sparsity of gradual_magnitude at step t (sparseml's cubic GMP schedule).
double cubic_sparsity(double si, double sf, int64_t start, int64_t end, int64_t t) {
  if (t >= end) return sf;  // first, so that start == end prunes to the target at once
  if (t <= start) return si;
  const double x = 1.0 - double(t - start) / double(end - start);
  return sf + (si - sf) * x * x * x;
}

// The masks a structured gradual_magnitude ramps through, densest first, ending with the
// target. N:M: dense, (M-1):M, ..., N:M. V:N:M: dense, then V:2:M' for every M' >= 4 that
// divides M, increasing (so every level fits any shape the target fits).
std::vector<SparsityPattern> ramp_levels(const SparsityPattern& target) {
  std::vector<SparsityPattern> out{SparsityPattern::dense()};
  if (target.kind == SparsityPattern::Kind::nm) {
    for (int n = target.m - 1; n >= target.n; --n) out.push_back(SparsityPattern::nm(n, target.m));
  } else if (target.kind == SparsityPattern::Kind::vnm) {
    for (int mp = SparsityPattern::kVnmSelected; mp <= target.m; ++mp)
      if (target.m % mp == 0) out.push_back(SparsityPattern::vnm(target.v, SparsityPattern::kVnmN, mp));
  }
  return out;
}

// The level whose density is closest to `density`; ties go to the denser level. Because
// the schedule's density never rises and the rounding is one fixed function, the chosen
// level never gets denser from one update to the next.
const SparsityPattern& closest_level(const std::vector<SparsityPattern>& levels, double density) {
  size_t best = 0;
  for (size_t i = 1; i < levels.size(); ++i)
    if (std::abs(levels[i].density() - density) < std::abs(levels[best].density() - density)) best = i;
  return levels[best];
}

bool is_handoff_target(const SparsityPattern& p) {
  return p.kind == SparsityPattern::Kind::vnm || (p.kind == SparsityPattern::Kind::nm && p.n == 2 && p.m == 4);
}

std::string range_text(int64_t begin, int64_t end) {
  if (end == kForever) return detail::concat("from step ", begin, " on");
  return detail::concat("steps [", begin, ", ", end, ")");
}

std::string step_text(const StepValue& v, int64_t resolved) {
  if (!v.is_fraction) return std::to_string(resolved);
  return detail::concat(resolved, " (", v.text, " of train.steps)");
}

}  // namespace

int64_t StepValue::resolve(int64_t total_steps) const {
  if (!is_fraction) return steps;
  return std::llround(fraction * double(total_steps));
}

namespace {

// One `params` entry against a weight name: an exact name, or "re:REGEX" (full match).
bool param_matches(const std::string& param, const std::string& name) {
  if (param.rfind("re:", 0) != 0) return param == name;
  return std::regex_match(name, std::regex(param.substr(3), std::regex::ECMAScript));
}

// Why matching `rx` could take exponential time in a backtracking matcher (libstdc++'s
// std::regex is one), or "": a repetition (*, + or {n,m}) of something that is itself
// quantified, as in 'a**' or '(a+)*'. Weight names never need one; a recipe that had one
// would hang the run's start.
std::string nested_repetition(const std::string& rx) {
  std::vector<bool> group_quantified{false};  // per open group: holds a quantifier
  bool after_quantifier = false, after_quantified_group = false;
  for (size_t i = 0; i < rx.size(); ++i) {
    const char c = rx[i];
    const bool brace = c == '{' && i + 1 < rx.size() && std::isdigit(static_cast<unsigned char>(rx[i + 1]));
    if (c == '*' || c == '+' || c == '?' || brace) {
      if (c == '?' && after_quantifier) continue;  // lazy: *? +? ??
      if (brace) i = std::min(rx.find('}', i), rx.size() - 1);
      if (c != '?' && (after_quantifier || after_quantified_group))
        return after_quantifier ? "a repetition of a quantifier" : "a repetition of a group that holds a quantifier";
      group_quantified.back() = true;
      after_quantifier = true;
      after_quantified_group = false;
      continue;
    }
    after_quantifier = after_quantified_group = false;
    if (c == '\\') {
      ++i;
    } else if (c == '[') {  // a class: up to its closing bracket (a first ']' is literal)
      size_t j = i + 1 + (i + 1 < rx.size() && rx[i + 1] == '^');
      if (j < rx.size() && rx[j] == ']') ++j;
      while (j < rx.size() && rx[j] != ']') j += rx[j] == '\\' ? 2 : 1;
      i = j;
    } else if (c == '(') {
      group_quantified.push_back(false);
      if (i + 1 < rx.size() && rx[i + 1] == '?') i += 2;  // (?: (?= (?!
    } else if (c == ')' && group_quantified.size() > 1) {
      after_quantified_group = group_quantified.back();
      group_quantified.pop_back();
      if (after_quantified_group) group_quantified.back() = true;
    }
  }
  return "";
}

}  // namespace

bool Recipe::Modifier::claims(const std::string& weight_name) const {
  return std::any_of(params.begin(), params.end(), [&](const std::string& p) { return param_matches(p, weight_name); });
}

std::vector<std::string> Recipe::fractional_steps() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < modifiers_.size(); ++i) {
    const Modifier& m = modifiers_[i];
    const std::pair<const char*, const StepValue*> steps[] = {{"start", &m.start},       {"end", &m.end},
                                                              {"update_every", &m.update_every},
                                                              {"until", &m.until},       {"lora_start", &m.lora_start}};
    for (const auto& [key, v] : steps)
      if (v->is_fraction) out.push_back(detail::concat("recipe[", i, "] (", m.type, ") ", key, " ", v->text));
  }
  return out;
}

std::vector<std::string> Recipe::modifier_keys(const std::string& type) {
  const auto t = find_type(type);
  return t ? t->keys : std::vector<std::string>{};
}

std::string Recipe::where(int i) const {
  return detail::concat(source_, ": recipe[", i, "] (", modifiers_[i].type, ")");
}

// ---------------------------------------------------------------------------------------
// parse

Recipe Recipe::parse(const std::string& yaml_list_text, const std::string& source) {
  const size_t bad = invalid_utf8_at(yaml_list_text);
  ESPLAG_CHECK(bad == std::string::npos, source, ": recipe: not UTF-8 text (byte ", bad, ")");
  YAML::Node n;
  try {
    n = YAML::Load(yaml_list_text);
  } catch (const YAML::Exception& e) {
    fail(source, ": recipe: invalid YAML: ", e.what());
  }
  return parse(n, source);
}

Recipe Recipe::parse(const YAML::Node& list, const std::string& source) {
  Recipe r;
  r.source_ = source;
  if (!list || list.IsNull()) return r;
  ESPLAG_CHECK(list.IsSequence(), source,
               ": `recipe` must be a list of modifiers, e.g. `- gradual_magnitude: {params: [...], ...}` (see "
               "docs/recipes.md)");
  try {
    r.parse_items(list);
  } catch (const YAML::Exception& e) {
    fail(source, ": recipe: ", e.what());
  }
  return r;
}

void Recipe::parse_items(const YAML::Node& list) {
  Recipe& r = *this;
  const std::string& source = source_;
  const std::vector<std::string> types = type_names();

  for (size_t i = 0; i < list.size(); ++i) {
    const YAML::Node item = list[i];
    ESPLAG_CHECK(item.IsMap() && item.size() == 1, source, ": recipe[", i,
                 "] must be a mapping with one key, the modifier type (", join(types, ", "),
                 "), whose value holds the modifier's keys");
    const auto entry = item.begin();
    const std::string type = entry->first.as<std::string>();
    const std::optional<TypeKeys> tk = find_type(type);
    ESPLAG_CHECK(tk, source, ": recipe[", i, "]: unknown modifier type '", type, "' (known: ", join(types, ", "), ")");
    Modifier m;
    m.type = type;
    m.LinearOptions::kind = type == kGmp ? "masked" : type == kKernel ? "vnm" : type == kDistill ? "" : type;
    if (type == kSemi || type == kSemiAct || type == kSlope) m.pattern = SparsityPattern::nm(2, 4);
    r.modifiers_.push_back(m);
    Modifier& mod = r.modifiers_.back();
    const std::string w = r.where(static_cast<int>(i));
    const YAML::Node body = entry->second;
    ESPLAG_CHECK(body.IsMap(), w, ": the modifier's value must be a mapping of keys (", join(tk->keys, ", "), ")");

    std::map<std::string, YAML::Node> kv;
    for (const auto& k : body) {
      const std::string key = k.first.as<std::string>();
      ESPLAG_CHECK(std::find(tk->keys.begin(), tk->keys.end(), key) != tk->keys.end(), w, ": unknown key '", key,
                   "' (known: ", join(tk->keys, ", "), ")");
      ESPLAG_CHECK(key == "params" || k.second.IsScalar(), w, ": key '", key, "' must be a single value");
      kv[key] = k.second;
    }
    for (const auto& key : tk->required) ESPLAG_CHECK(kv.count(key), w, ": missing required key '", key, "'");
    auto text = [&](const std::string& key) { return kv.at(key).Scalar(); };

    mod.start = kv.count("start") ? parse_step(w, "start", text("start")) : integer_step(0);
    if (kv.count("until")) {
      mod.has_until = true;
      mod.until = parse_step(w, "until", text("until"));
    }
    if (type == kDistill) {
      parse_distill(w, kv, static_cast<int>(i));
      continue;
    }

    // params: a non-empty list of exact names and "re:" patterns.
    const YAML::Node& params = kv.at("params");
    ESPLAG_CHECK(params.IsSequence() && params.size() > 0, w,
                 ": key 'params' must be a non-empty list of weight names or 're:REGEX' patterns");
    for (const auto& p : params) {
      ESPLAG_CHECK(p.IsScalar() && !p.Scalar().empty(), w,
                   ": key 'params': every entry must be a weight name or 're:REGEX' pattern");
      const std::string s = p.Scalar();
      if (s.rfind("re:", 0) == 0) {
        ESPLAG_CHECK(s.size() > 3, w, ": key 'params': empty regex 're:'");
        // libstdc++'s regex compiler overflows (undefined behaviour) on counts and
        // back-references of more digits; no weight name needs them.
        ESPLAG_CHECK(!std::regex_search(s, std::regex("[0-9]{10}")), w, ": key 'params': regex '", s.substr(3),
                     "' holds a number of 10 or more digits");
        const std::string nested = nested_repetition(s.substr(3));
        ESPLAG_CHECK(nested.empty(), w, ": key 'params': regex '", s.substr(3), "' holds ", nested,
                     ", whose matching can take exponential time; write it without");
        try {
          std::regex rx(s.substr(3), std::regex::ECMAScript);
        } catch (const std::regex_error& e) {
          fail(w, ": key 'params': invalid regex '", s.substr(3), "': ", e.what());
        }
      }
      if (std::find(mod.params.begin(), mod.params.end(), s) == mod.params.end()) mod.params.push_back(s);
    }

    if (type == kGmp) {
      const std::string mask_text = kv.count("mask_type") ? text("mask_type") : "unstructured";
      try {
        mod.mask = SparsityPattern::parse(mask_text);
      } catch (const Error& e) {
        fail(w, ": key 'mask_type': ", e.what());
      }
      ESPLAG_CHECK(mod.mask.kind != SparsityPattern::Kind::dense, w,
                   ": key 'mask_type': 'dense' prunes nothing; use unstructured, N:M (e.g. 2:4) or V:N:M (e.g. 64:2:8)");
      if (kv.count("init_sparsity")) mod.init_sparsity = parse_sparsity(w, "init_sparsity", text("init_sparsity"));
      mod.final_given = kv.count("final_sparsity") > 0;
      if (mod.final_given) mod.final_sparsity = parse_sparsity(w, "final_sparsity", text("final_sparsity"));
      if (mod.mask.kind == SparsityPattern::Kind::unstructured) {
        ESPLAG_CHECK(mod.final_given, w, ": missing required key 'final_sparsity' (an unstructured mask needs a target)");
        mod.mask = SparsityPattern::unstructured(mod.final_sparsity);
      } else {
        const double implied = 1.0 - mod.mask.density();
        ESPLAG_CHECK(!mod.final_given || std::abs(mod.final_sparsity - implied) < 1e-9, w, ": key 'final_sparsity': ",
                     text("final_sparsity"), " conflicts with mask_type ", mod.mask.to_string(), ", which implies ",
                     number_text(implied), " (leave final_sparsity out for N:M and V:N:M masks)");
        mod.final_sparsity = implied;
      }
      ESPLAG_CHECK(mod.init_sparsity <= mod.final_sparsity, w, ": key 'init_sparsity' (",
                   number_text(mod.init_sparsity), ") is larger than the final sparsity (",
                   number_text(mod.final_sparsity), ")");
      mod.end = parse_step(w, "end", text("end"));
      mod.update_every = parse_step(w, "update_every", text("update_every"));
      ESPLAG_CHECK(mod.update_every.is_fraction || mod.update_every.steps > 0, w,
                   ": key 'update_every' must be positive, got ", text("update_every"));
    }
    // The keys of kernel_replacement and of the kinds' modifiers, each where the type knows it
    // (the others were refused above).
    if (kv.count("activation")) {
      const std::string a = text("activation");
      ESPLAG_CHECK(a == "row_24" || a == "tile_24", w, ": key 'activation' must be row_24 (2 of every 4 input ",
                   "features per token) or tile_24 (transposable 2:4 over 4x4 tiles of tokens x features), got '", a,
                   "'");
      mod.activation = parse_activation_sparsity(a);
    }
    if (kv.count("mask_change_freq")) mod.mask_change_freq = parse_int(w, "mask_change_freq", text("mask_change_freq"), 1);
    if (kv.count("lora_rank")) mod.lora_rank = parse_int(w, "lora_rank", text("lora_rank"), 0);
    if (type_knows(type, "lora_start"))
      mod.lora_start = kv.count("lora_start") ? parse_step(w, "lora_start", text("lora_start")) : fraction_step(0.99);
    if (kv.count("sparse_dw")) mod.sparse_dw = parse_bool(w, "sparse_dw", kv.at("sparse_dw"));
  }
}

void Recipe::parse_distill(const std::string& w, const std::map<std::string, YAML::Node>& kv, int index) {
  Modifier& mod = modifiers_[size_t(index)];
  for (int j = 0; j < index; ++j)
    ESPLAG_CHECK(modifiers_[size_t(j)].type != kDistill, w, ": a recipe distills from one teacher; recipe[", j,
                 "] is a distill entry already");
  mod.teacher = kv.at("teacher").Scalar();
  ESPLAG_CHECK(!mod.teacher.empty(), w, ": key 'teacher' must be a checkpoint or run directory");
  if (kv.count("alpha")) {
    const std::string a = kv.at("alpha").Scalar();
    ESPLAG_CHECK(parse_double(a, mod.alpha), w, ": key 'alpha' must be a number, got '", a, "'");
    ESPLAG_CHECK(mod.alpha >= 0.0 && mod.alpha <= 1.0, w, ": key 'alpha' must be in [0, 1] (the weight of the KL "
                 "term; 1 - alpha weighs the cross-entropy), got ", a);
  }
  if (kv.count("temperature")) {
    const std::string t = kv.at("temperature").Scalar();
    ESPLAG_CHECK(parse_double(t, mod.temperature), w, ": key 'temperature' must be a number, got '", t, "'");
    ESPLAG_CHECK(mod.temperature > 0.0, w, ": key 'temperature' must be positive, got ", t);
  }
}

const Recipe::Modifier* Recipe::distill() const {
  for (const auto& m : modifiers_)
    if (m.type == kDistill) return &m;
  return nullptr;
}

bool Recipe::distills_at(int64_t step) const {
  ESPLAG_CHECK(validated_, source_, ": recipe: distills_at called before validate");
  for (size_t i = 0; i < modifiers_.size(); ++i)
    if (modifiers_[i].type == kDistill)
      return step >= bound_[i].start && (!modifiers_[i].has_until || step < bound_[i].until);
  return false;
}

// ---------------------------------------------------------------------------------------
// validate

void Recipe::validate(const LinearShapes& shapes, int64_t total_steps) {
  validated_ = false;
  bound_.clear();
  claims_.clear();
  if (modifiers_.empty()) {
    total_steps_ = total_steps;
    validated_ = true;
    return;
  }
  ESPLAG_CHECK(total_steps > 0, source_, ": recipe: train.steps must be positive to schedule a recipe, got ",
               total_steps);
  const std::string example = shapes.empty() ? "blocks.0.attn.qkv.weight" : shapes.begin()->first;
  std::vector<Bound> bound(modifiers_.size());
  std::map<std::string, std::vector<Claim>> claims;

  for (size_t i = 0; i < modifiers_.size(); ++i) {
    const Modifier& m = modifiers_[i];
    Bound& b = bound[i];
    const std::string w = where(static_cast<int>(i));
    auto resolve = [&](const StepValue& v, const char* key) {
      const int64_t s = v.resolve(total_steps);
      ESPLAG_CHECK(s <= total_steps, w, ": key '", key, "': step ", s, " is beyond the end of training (train.steps = ",
                   total_steps, "); a step number does not scale with train.steps: write the recipe's steps as ",
                   "fractions of train.steps (e.g. 0.8) for a recipe that fits any run length");
      return s;
    };

    if (m.type == kDistill) {  // no weights: only its steps
      b.start = resolve(m.start, "start");
      if (m.has_until) {
        b.until = resolve(m.until, "until");
        ESPLAG_CHECK(b.until > b.start, w, ": until (", step_text(m.until, b.until), ") must be after start (",
                     step_text(m.start, b.start), ")");
      }
      continue;
    }
    // Weights: exact names must exist, every regex must match something (full match).
    std::set<std::string> names;
    for (const auto& p : m.params) {
      if (p.rfind("re:", 0) == 0) {
        size_t hits = 0;
        for (const auto& [name, shape] : shapes)
          if (param_matches(p, name)) names.insert(name), ++hits;
        ESPLAG_CHECK(hits > 0, w, ": key 'params': '", p, "' matches no linear weight of the model (names look like '",
                     example, "'; the regex must match the whole name)");
      } else {
        ESPLAG_CHECK(shapes.count(p), w, ": key 'params': '", p, "' is not a linear weight of the model (names look like '",
                     example, "')");
        names.insert(p);
      }
    }
    b.names.assign(names.begin(), names.end());

    b.start = resolve(m.start, "start");
    int64_t claim_end = kForever;
    auto shape_of = [&](const std::string& n) { return shapes.at(n); };
    auto shape_text = [&](const std::string& n) {
      return detail::concat("'", n, "' of shape [", shape_of(n).first, ", ", shape_of(n).second, "]");
    };

    if (m.type == kGmp) {
      b.end = resolve(m.end, "end");
      ESPLAG_CHECK(b.start <= b.end, w, ": start (", step_text(m.start, b.start), ") is after end (",
                   step_text(m.end, b.end), ")");
      b.update_every = m.update_every.resolve(total_steps);
      ESPLAG_CHECK(b.update_every > 0, w, ": key 'update_every': ", m.update_every.text, " of train.steps (",
                   total_steps, ") is ", b.update_every, " steps; it must be positive");
      for (const auto& n : b.names) {
        try {
          check_divisible(m.mask, shape_of(n).first, shape_of(n).second, n);
        } catch (const Error& e) {
          fail(w, ": ", e.what());
        }
      }
    } else if (m.type == kSemi || m.type == kSlope) {
      for (const auto& n : b.names)
        ESPLAG_CHECK(shape_of(n).first % 4 == 0 && shape_of(n).second % 4 == 0, w, ": ", shape_text(n), ": ", m.type,
                     " needs rows and cols that are multiples of 4 (2:4 of W along cols and of Wᵀ along rows)");
    } else if (m.type == kSemiAct) {
      for (const auto& n : b.names)
        ESPLAG_CHECK(shape_of(n).second % 4 == 0, w, ": ", shape_text(n),
                     ": semi_sparse_activation needs cols (in features) that are a multiple of 4 (2:4 of the input "
                     "activations along K)");
    }
    if (m.has_until) {
      b.until = resolve(m.until, "until");
      ESPLAG_CHECK(b.until > b.start, w, ": until (", step_text(m.until, b.until), ") must be after start (",
                   step_text(m.start, b.start), ")");
      claim_end = b.until;
    }
    if (type_knows(m.type, "lora_start")) {
      b.lora_start = resolve(m.lora_start, "lora_start");
      ESPLAG_CHECK(m.lora_rank == 0 || b.lora_start >= b.start, w, ": lora_start (", step_text(m.lora_start, b.lora_start),
                   ") is before start (", step_text(m.start, b.start), ")");
      for (const auto& n : b.names)
        ESPLAG_CHECK(m.lora_rank <= std::min(shape_of(n).first, shape_of(n).second), w, ": key 'lora_rank': ",
                     m.lora_rank, " exceeds min(rows, cols) of ", shape_text(n));
    }
    for (const auto& n : b.names) claims[n].push_back({static_cast<int>(i), b.start, claim_end});
  }

  // No weight may be held by two modifiers at once, except gradual_magnitude handing its
  // final mask over to kernel_replacement.
  auto is_handoff_pair = [&](const Claim& a, const Claim& c) {
    return (modifiers_[a.modifier].type == kGmp && modifiers_[c.modifier].type == kKernel) ||
           (modifiers_[a.modifier].type == kKernel && modifiers_[c.modifier].type == kGmp);
  };
  for (auto& [name, cl] : claims) {
    for (size_t a = 0; a < cl.size(); ++a)
      for (size_t c = a + 1; c < cl.size(); ++c) {
        const Claim& x = cl[a];
        const Claim& y = cl[c];
        if (std::max(x.begin, y.begin) >= std::min(x.end, y.end) || is_handoff_pair(x, y)) continue;
        fail(source_, ": recipe[", x.modifier, "] (", modifiers_[x.modifier].type, ") and recipe[", y.modifier, "] (",
             modifiers_[y.modifier].type, ") both claim '", name, "' at step ", std::max(x.begin, y.begin), " (",
             range_text(x.begin, x.end), " and ", range_text(y.begin, y.end), " overlap)");
      }
  }
  for (size_t i = 0; i < modifiers_.size(); ++i) {
    if (modifiers_[i].type != kKernel) continue;
    const std::string w = where(static_cast<int>(i));
    for (const auto& n : bound[i].names) {
      auto& cl = claims[n];
      auto gmp = std::find_if(cl.begin(), cl.end(), [&](const Claim& c) { return modifiers_[c.modifier].type == kGmp; });
      ESPLAG_CHECK(gmp != cl.end(), w, ": '", n, "' is not pruned by any gradual_magnitude modifier; kernel_replacement ",
                   "needs a V:N:M or 2:4 mask in place by its start (step ", bound[i].start, ")");
      const Modifier& g = modifiers_[gmp->modifier];
      const Bound& gb = bound[gmp->modifier];
      ESPLAG_CHECK(is_handoff_target(g.mask), w, ": '", n, "' is pruned by recipe[", gmp->modifier,
                   "] (gradual_magnitude) with mask_type ", g.mask.to_string(),
                   "; kernel_replacement needs a V:N:M or 2:4 mask");
      ESPLAG_CHECK(gb.end <= bound[i].start, w, ": '", n, "' is still being pruned by recipe[", gmp->modifier,
                   "] (gradual_magnitude) until step ", gb.end, "; kernel_replacement must start at or after it, not at step ",
                   bound[i].start);
      gmp->end = bound[i].start;  // the hand-off
    }
  }
  for (auto& [name, cl] : claims)
    std::sort(cl.begin(), cl.end(), [](const Claim& a, const Claim& c) { return a.begin < c.begin; });

  bound_ = std::move(bound);
  claims_ = std::move(claims);
  total_steps_ = total_steps;
  validated_ = true;
}

// ---------------------------------------------------------------------------------------
// schedule

LayerPlan Recipe::plan_of(int i, int64_t step) const {
  const Modifier& m = modifiers_[i];
  const Bound& b = bound_[i];
  LayerPlan p;
  p.modifier = i;
  if (m.type == kGmp) {
    // Updates at start, start + k·update_every (< end) and end; the plan between two
    // updates is the one computed at the earlier.
    const int64_t span = b.end - b.start;
    const int64_t last = span > 0 ? (span + b.update_every - 1) / b.update_every : 0;
    const int64_t k = step >= b.end ? last : (step - b.start) / b.update_every;
    const int64_t u = k == last ? b.end : b.start + k * b.update_every;
    const double s = cubic_sparsity(m.init_sparsity, m.final_sparsity, b.start, b.end, u);
    if (m.mask.kind == SparsityPattern::Kind::unstructured) {
      p.pattern = s > 0.0 ? SparsityPattern::unstructured(s) : SparsityPattern::dense();
    } else {
      p.pattern = k == last ? m.mask : closest_level(ramp_levels(m.mask), 1.0 - s);
    }
    p.kind = p.pattern.kind == SparsityPattern::Kind::dense ? "dense" : "masked";
  } else {  // a kind's modifier (kernel_replacement's plan is plan_at's)
    static_cast<LinearOptions&>(p) = m;
    p.lora_enabled = m.lora_rank > 0 && step >= b.lora_start;
  }
  p.sparsity = 1.0 - p.pattern.density();
  return p;
}

std::vector<int64_t> Recipe::kind_boundaries() const {
  ESPLAG_CHECK(validated_, source_, ": recipe: kind_boundaries called before validate");
  std::set<int64_t> steps{0};
  for (const auto& [name, cl] : claims_)
    for (const Claim& c : cl) {
      steps.insert(c.begin);
      if (c.end != INT64_MAX) steps.insert(c.end);
    }
  return {steps.begin(), steps.end()};
}

std::map<std::string, LayerPlan> Recipe::plan_at(int64_t step) const {
  ESPLAG_CHECK(validated_, source_, ": recipe: plan_at called before validate");
  ESPLAG_CHECK(step >= 0, source_, ": recipe: plan_at needs a step >= 0, got ", step);
  std::map<std::string, LayerPlan> out;
  for (const auto& [name, cl] : claims_) {
    LayerPlan p;
    for (const Claim& c : cl) {
      if (c.begin > step || step >= c.end) continue;
      if (modifiers_[c.modifier].type == kKernel) {
        // The mask comes from the gradual_magnitude modifier that handed the weight over.
        const auto gmp = std::find_if(cl.begin(), cl.end(), [&](const Claim& g) { return modifiers_[g.modifier].type == kGmp; });
        const Modifier& k = modifiers_[c.modifier];
        static_cast<LinearOptions&>(p) = k;  // vnm, and its lora_rank
        p.pattern = modifiers_[gmp->modifier].mask;
        p.sparsity = 1.0 - p.pattern.density();
        p.lora_enabled = k.lora_rank > 0 && step >= bound_[c.modifier].lora_start;
        p.modifier = c.modifier;
      } else {
        p = plan_of(c.modifier, step);
      }
      break;
    }
    out.emplace(name, p);
  }
  return out;
}

std::map<std::string, LayerPlan> Recipe::plan_before(int64_t step,
                                                     const std::map<std::string, LayerPlan>& now) const {
  if (step > 0) return plan_at(step - 1);
  std::map<std::string, LayerPlan> dense;
  for (const auto& [name, p] : now) dense.emplace(name, LayerPlan());
  return dense;
}

std::vector<std::string> Recipe::changed_at(int64_t step) const {
  const auto now = plan_at(step), before = plan_before(step, now);
  std::vector<std::string> out;
  for (const auto& [name, p] : now)
    if (!p.same_effect(before.at(name))) out.push_back(name);
  return out;
}

bool Recipe::reads_weights_at(int64_t step) const {
  const auto now = plan_at(step), before = plan_before(step, now);
  for (const auto& [name, p] : now) {
    const LayerPlan& q = before.at(name);
    if (p.kind != q.kind || !(p.pattern == q.pattern) || p.sparsity != q.sparsity) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------
// describe / to_yaml

std::string Recipe::describe() const {
  std::ostringstream os;
  if (modifiers_.empty()) return "recipe: none (dense training)\n";
  os << "recipe (" << source_ << "): " << modifiers_.size() << " modifier" << (modifiers_.size() == 1 ? "" : "s");
  if (validated_) os << ", train.steps = " << total_steps_;
  os << "\n";
  for (size_t i = 0; i < modifiers_.size(); ++i) {
    const Modifier& m = modifiers_[i];
    os << "  [" << i << "] " << m.type;
    if (m.type == kDistill) {
      os << " from " << m.teacher << ": alpha " << number_text(m.alpha) << ", temperature " << number_text(m.temperature);
      if (validated_) os << ", " << range_text(bound_[i].start, m.has_until ? bound_[i].until : kForever);
      os << "\n";
      continue;
    }
    if (validated_) {
      const Bound& b = bound_[i];
      os << " on " << b.names.size() << " weight" << (b.names.size() == 1 ? "" : "s") << ":";
      if (m.type == kGmp) {
        os << " " << (m.mask.kind == SparsityPattern::Kind::unstructured ? "unstructured" : m.mask.to_string())
           << ", sparsity " << number_text(m.init_sparsity) << " -> " << number_text(m.final_sparsity)
           << " (cubic), steps " << b.start << ".." << b.end << " updating every " << b.update_every;
        if (m.mask.is_structured()) {
          std::vector<std::string> seq;
          for (int64_t s = b.start;; s = std::min(s + b.update_every, b.end)) {
            const std::string t = plan_of(static_cast<int>(i), s).pattern.to_string();
            if (seq.empty() || seq.back() != t) seq.push_back(t);
            if (s >= b.end) break;
          }
          os << ", masks " << join(seq, " -> ");
        }
      } else if (m.type == kKernel) {
        os << " compressed (vnm) from step " << b.start;
        if (m.lora_rank > 0) os << ", rank-" << m.lora_rank << " adapters from step " << b.lora_start;
      } else if (m.type == kSlope) {
        os << " 2:4 from step " << b.start << ", Wᵀ mask refreshed every " << m.mask_change_freq << " steps";
        if (m.lora_rank > 0)
          os << ", rank-" << m.lora_rank << " adapters from step " << b.lora_start;
        else
          os << ", no adapters";
      } else if (m.type == kSemi || m.type == kSemiAct) {
        os << " 2:4 " << range_text(b.start, m.has_until ? b.until : kForever);
        if (m.type == kSemiAct) os << " (" << activation_sparsity_name(m.activation) << " of the input)";
        if (m.has_until) os << ", dense after";
      } else {
        os << " " << range_text(b.start, m.has_until ? b.until : kForever);
        if (m.has_until) os << ", dense after";
      }
      if (m.sparse_dw) os << ", sparse dW (MVUE 2:4 of dYᵀ)";
    } else {
      os << " params [" << join(m.params, ", ") << "] from step " << m.start.text;
    }
    os << "\n";
  }
  return os.str();
}

std::string Recipe::to_yaml() const {
  if (modifiers_.empty()) return "[]\n";
  YAML::Emitter e;
  e << YAML::BeginSeq;
  for (const Modifier& m : modifiers_) {
    e << YAML::BeginMap << YAML::Key << m.type << YAML::Value << YAML::BeginMap;
    if (m.type == kDistill) {
      e << YAML::Key << "teacher" << YAML::Value << YAML::DoubleQuoted << m.teacher;
      e << YAML::Key << "alpha" << YAML::Value << number_text(m.alpha);
      e << YAML::Key << "temperature" << YAML::Value << number_text(m.temperature);
      e << YAML::Key << "start" << YAML::Value << m.start.text;
      if (m.has_until) e << YAML::Key << "until" << YAML::Value << m.until.text;
      e << YAML::EndMap << YAML::EndMap;
      continue;
    }
    e << YAML::Key << "params" << YAML::Value << YAML::Flow << YAML::BeginSeq;
    for (const auto& p : m.params) e << YAML::SingleQuoted << p;
    e << YAML::EndSeq;
    if (m.type == kGmp) {
      e << YAML::Key << "mask_type" << YAML::Value << YAML::DoubleQuoted
        << (m.mask.kind == SparsityPattern::Kind::unstructured ? std::string("unstructured") : m.mask.to_string());
      e << YAML::Key << "init_sparsity" << YAML::Value << number_text(m.init_sparsity);
      e << YAML::Key << "final_sparsity" << YAML::Value << number_text(m.final_sparsity);
    }
    e << YAML::Key << "start" << YAML::Value << m.start.text;
    if (m.type == kGmp) {
      e << YAML::Key << "end" << YAML::Value << m.end.text;
      e << YAML::Key << "update_every" << YAML::Value << m.update_every.text;
    } else {
      // The type's other keys in its order: until where given, kernel_replacement's adapter
      // keys where it has an adapter, every other key with its value.
      const std::vector<std::string> keys = find_type(m.type)->keys;
      for (const auto& key : keys) {
        if (key == "params" || key == "start" || (key == "until" && !m.has_until)) continue;
        if ((key == "lora_rank" || key == "lora_start") && m.type == kKernel && m.lora_rank == 0) continue;
        e << YAML::Key << key << YAML::Value;
        if (key == "until") e << m.until.text;
        else if (key == "activation") e << activation_sparsity_name(m.activation);
        else if (key == "mask_change_freq") e << m.mask_change_freq;
        else if (key == "lora_rank") e << m.lora_rank;
        else if (key == "lora_start") e << m.lora_start.text;
        else if (key == "sparse_dw") e << m.sparse_dw;
      }
    }
    e << YAML::EndMap << YAML::EndMap;
  }
  e << YAML::EndSeq;
  return std::string(e.c_str()) + "\n";
}

}  // namespace esplag
