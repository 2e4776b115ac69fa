#include "data/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <queue>

#include "core/error.h"
#include "data/byte_level.h"
#include "data/file_util.h"
#include "io/json.h"

namespace esplag {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kEotText = "<|endoftext|>";
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Words beyond this many distinct entries are encoded without being cached, bounding the
// memory of a long-running encoder on an open-ended corpus.
constexpr size_t kCacheEntriesPerPart = size_t(1) << 16;
// Ids above this are certainly a corrupt file, not a real vocabulary.
constexpr int64_t kMaxTokenId = int64_t(1) << 26;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

std::string printable(std::string_view s) {
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// ByteTokenizer

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  out.reserve(ids.size());
  for (const int32_t id : ids) {
    if (id >= 0 && id < 256)
      out += static_cast<char>(id);
    else if (id == kEot)
      out += kEotText;
    else
      fail("byte tokenizer: cannot decode token id ", id, ": the vocabulary is 0..256");
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// BpeTokenizer

struct BpeTokenizer::CachePart {
  std::mutex mu;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
};

BpeTokenizer::BpeTokenizer(const std::string& tokenizer_json_path) : cache_(new CachePart[kCacheParts]) {
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(fs::absolute(tokenizer_json_path), ec);
  path_ = ec ? tokenizer_json_path : canonical.string();
  const std::string text = data_files::read_all(tokenizer_json_path, "tokenizer file");
  try {
    load(text);
  } catch (const json::exception& e) {
    fail("tokenizer file '", tokenizer_json_path, "': ", json_error_text(e));
  }
}

BpeTokenizer::~BpeTokenizer() = default;

namespace {

// The "model" object of a tokenizer.json, after refusing what is not byte-level BPE (another
// model type, a normalizer).
const json& bpe_model(const json& js, const std::string& where) {
  ESPLAG_CHECK(js.is_object() && js.contains("model") && js["model"].is_object(), "tokenizer file '", where,
               "' has no \"model\" object (not a Hugging Face tokenizer.json?)");
  const json& model = js["model"];
  const std::string type = model.contains("type") ? model["type"].get<std::string>() : "BPE";
  ESPLAG_CHECK(type == "BPE", "tokenizer file '", where, "': unsupported model type \"", type,
               "\" (only \"BPE\", byte-level as in GPT-2, is supported)");
  if (js.contains("normalizer") && !js["normalizer"].is_null())
    fail("tokenizer file '", where, "': normalizer \"", js["normalizer"].value("type", "?"),
         "\" is not supported (only GPT-2-style byte-level BPE without a normalizer)");
  return model;
}

// Checks the pre_tokenizer and returns its ByteLevel step's add_prefix_space, or nothing when
// the file has no pre_tokenizer. Only GPT-2's pre-tokenisation is implemented; another pattern
// (Llama 3's, say) would give different ids, so it is refused rather than approximated.
std::optional<bool> byte_level_prefix_space(const json& js, const std::string& where) {
  if (!js.contains("pre_tokenizer")) return std::nullopt;
  const json& pre = js["pre_tokenizer"];
  ESPLAG_CHECK(!pre.is_null(), "tokenizer file '", where,
               "': pre_tokenizer is null; only byte-level BPE (pre_tokenizer ByteLevel) is supported");
  bool prefix_space = false;
  auto check_byte_level = [&](const json& p, bool split_before) {
    ESPLAG_CHECK(split_before || p.value("use_regex", true), "tokenizer file '", where,
                 "': ByteLevel pre_tokenizer with use_regex false and no GPT-2 Split before it is not supported");
    prefix_space = p.value("add_prefix_space", true);  // Hugging Face's default
  };
  const std::string type = pre.value("type", "");
  if (type == "ByteLevel") {
    check_byte_level(pre, false);
  } else if (type == "Sequence" && pre.contains("pretokenizers") && pre["pretokenizers"].is_array()) {
    bool split = false, byte_level_seen = false;
    for (const auto& p : pre["pretokenizers"]) {
      const std::string t = p.value("type", "");
      if (t == "Split") {
        const std::string pattern =
            p.contains("pattern") && p["pattern"].is_object() ? p["pattern"].value("Regex", "") : "";
        ESPLAG_CHECK(pattern == kGpt2Pattern, "tokenizer file '", where, "': pre_tokenizer Split pattern '", pattern,
                     "' is not GPT-2's; only GPT-2's pre-tokenisation is implemented");
        split = true;
      } else if (t == "ByteLevel") {
        check_byte_level(p, split);
        byte_level_seen = true;
      } else {
        fail("tokenizer file '", where, "': pre_tokenizer \"", t, "\" inside a Sequence is not supported");
      }
    }
    ESPLAG_CHECK(byte_level_seen, "tokenizer file '", where, "': the pre_tokenizer Sequence has no ByteLevel step");
  } else {
    fail("tokenizer file '", where, "': pre_tokenizer \"", type, "\" is not supported (only ByteLevel, as in GPT-2)");
  }
  return prefix_space;
}

// added_tokens: id -> literal content.
std::unordered_map<int32_t, std::string> read_added_tokens(const json& js, const std::string& where) {
  std::unordered_map<int32_t, std::string> added_by_id;
  if (js.contains("added_tokens") && js["added_tokens"].is_array()) {
    for (const auto& t : js["added_tokens"]) {
      const int64_t id = t.at("id").get<int64_t>();
      const std::string content = t.at("content").get<std::string>();
      ESPLAG_CHECK(id >= 0 && id < kMaxTokenId, "tokenizer file '", where, "': added token \"", content, "\" has id ",
                   id, ", outside [0, ", kMaxTokenId, ")");
      ESPLAG_CHECK(!content.empty(), "tokenizer file '", where, "': added token ", id, " has empty content");
      added_by_id[static_cast<int32_t>(id)] = content;
    }
  }
  return added_by_id;
}

// model.vocab: vocabulary string -> id.
std::unordered_map<std::string, int32_t> read_vocab(const json& model, const std::string& where) {
  ESPLAG_CHECK(model.contains("vocab") && model["vocab"].is_object(), "tokenizer file '", where,
               "': model.vocab is missing or not an object");
  std::unordered_map<std::string, int32_t> vocab;
  for (const auto& [k, v] : model["vocab"].items()) {
    ESPLAG_CHECK(v.is_number_integer(), "tokenizer file '", where, "': model.vocab[\"", k, "\"] is not an integer id");
    const int64_t id = v.get<int64_t>();
    ESPLAG_CHECK(id >= 0 && id < kMaxTokenId, "tokenizer file '", where, "': model.vocab[\"", k, "\"] = ", id,
                 " is outside [0, ", kMaxTokenId, ")");
    vocab[k] = static_cast<int32_t>(id);
  }
  return vocab;
}

struct MergeIds {
  int32_t left, right, result;
};

// model.merges in rank order, as vocabulary ids.
std::vector<MergeIds> read_merges(const json& model, const std::unordered_map<std::string, int32_t>& vocab,
                                  const std::string& where) {
  ESPLAG_CHECK(model.contains("merges") && model["merges"].is_array(), "tokenizer file '", where,
               "': model.merges is missing or not an array");
  std::vector<MergeIds> merges;
  int32_t rank = 0;
  for (const auto& m : model["merges"]) {
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      ESPLAG_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < s.size() && s.find(' ', sp + 1) == std::string::npos,
                   "tokenizer file '", where, "': merge ", rank, " \"", s, "\" is not of the form \"left right\"");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      ESPLAG_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(), "tokenizer file '", where,
                   "': merge ", rank, " is neither a \"left right\" string nor a [left, right] pair: ", m.dump());
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    ESPLAG_CHECK(ia != vocab.end(), "tokenizer file '", where, "': merge ", rank, " (\"", a, "\", \"", b,
                 "\") refers to unknown token \"", a, "\" (not in model.vocab)");
    ESPLAG_CHECK(ib != vocab.end(), "tokenizer file '", where, "': merge ", rank, " (\"", a, "\", \"", b,
                 "\") refers to unknown token \"", b, "\" (not in model.vocab)");
    ESPLAG_CHECK(iab != vocab.end(), "tokenizer file '", where, "': merge ", rank, " (\"", a, "\", \"", b,
                 "\") produces unknown token \"", a + b, "\" (not in model.vocab)");
    merges.push_back({ia->second, ib->second, iab->second});
    ++rank;
  }
  return merges;
}

}  // namespace

void BpeTokenizer::load(const std::string& text) {
  const std::string& where = path_;
  const json js = parse_json(text, "tokenizer file '" + where + "'");
  const json& model = bpe_model(js, where);
  if (const std::optional<bool> prefix_space = byte_level_prefix_space(js, where)) add_prefix_space_ = *prefix_space;
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty())
      fail("tokenizer file '", where, "': model.", key, " \"", model[key].get<std::string>(),
           "\" is not supported (byte-level BPE has none)");
  }
  ignore_merges_ =
      model.contains("ignore_merges") && model["ignore_merges"].is_boolean() && model["ignore_merges"].get<bool>();

  // Added tokens first: their vocabulary entries hold literal text, not byte stand-ins.
  const std::unordered_map<int32_t, std::string> added_by_id = read_added_tokens(js, where);
  const std::unordered_map<std::string, int32_t> vocab = read_vocab(model, where);
  build_id_tables(vocab, added_by_id);

  const std::vector<MergeIds> merges = read_merges(model, vocab, where);
  for (size_t rank = 0; rank < merges.size(); ++rank)  // first (lowest rank) wins
    merges_.emplace(pair_key(merges[rank].left, merges[rank].right), Merge{int32_t(rank), merges[rank].result});
  num_merges_ = int(merges.size());

  for (const char* name : {kEotText, "<|end_of_text|>", "</s>"}) {
    for (const auto& [content, id] : added_)
      if (content == name && eot_ < 0) eot_ = id;
  }
  if (eot_ < 0) eot_ = token_id(kEotText);
}

void BpeTokenizer::build_id_tables(const std::unordered_map<std::string, int32_t>& vocab,
                                   const std::unordered_map<int32_t, std::string>& added_by_id) {
  const std::string& where = path_;
  int64_t max_id = -1;
  for (const auto& [k, id] : vocab) max_id = std::max<int64_t>(max_id, id);
  for (const auto& [id, content] : added_by_id) max_id = std::max<int64_t>(max_id, id);
  ESPLAG_CHECK(max_id >= 0, "tokenizer file '", where, "': the vocabulary is empty");
  // Ids are dense in real vocabularies; a few entries with huge ids would make the tables
  // below (one slot per id) take gigabytes for a tiny file.
  const int64_t entries = int64_t(vocab.size() + added_by_id.size());
  ESPLAG_CHECK(max_id < 2 * entries + 1024, "tokenizer file '", where, "': ids go up to ", max_id, " for only ",
               entries, " tokens; a vocabulary's ids must be (nearly) contiguous from 0");
  vocab_size_ = static_cast<int>(max_id + 1);
  id_bytes_.assign(vocab_size_, std::string());
  id_valid_.assign(vocab_size_, 0);
  std::vector<const std::string*> id_source(vocab_size_, nullptr);
  std::string bytes;
  for (const auto& [k, id] : vocab) {
    auto added = added_by_id.find(id);
    if (added != added_by_id.end() && added->second == k) {
      bytes = k;
    } else {
      ESPLAG_CHECK(byte_level::decode_to_bytes(k, &bytes), "tokenizer file '", where, "': vocab entry \"", k, "\" (id ",
                   id,
                   ") is not a byte-level token (it uses characters outside GPT-2's byte alphabet); only "
                   "GPT-2-style byte-level BPE is supported");
    }
    ESPLAG_CHECK(!id_valid_[id], "tokenizer file '", where, "': id ", id, " is used by both \"", *id_source[id],
                 "\" and \"", k, "\"");
    id_valid_[id] = 1;
    id_bytes_[id] = bytes;
    id_source[id] = &k;
  }
  for (const auto& [id, content] : added_by_id) {
    if (id_valid_[id]) {
      ESPLAG_CHECK(id_bytes_[id] == content, "tokenizer file '", where, "': added token \"", content, "\" has id ", id,
                   ", which model.vocab gives to \"", *id_source[id], "\"");
    } else {
      id_valid_[id] = 1;
      id_bytes_[id] = content;
    }
    added_.emplace_back(content, id);
  }
  // Longest first, so that when two added tokens start at the same place the longer wins.
  std::sort(added_.begin(), added_.end(), [](const auto& a, const auto& b) {
    return a.first.size() != b.first.size() ? a.first.size() > b.first.size() : a < b;
  });
  for (int32_t id = 0; id < vocab_size_; ++id)
    if (id_valid_[id]) bytes_to_id_.emplace(id_bytes_[id], id);  // lowest id wins on a clash
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    byte_id_[b] = it == bytes_to_id_.end() ? -1 : it->second;
  }
}

int32_t BpeTokenizer::token_id(std::string_view bytes) const {
  auto it = bytes_to_id_.find(std::string(bytes));
  return it == bytes_to_id_.end() ? -1 : it->second;
}

std::vector<int32_t> BpeTokenizer::merge_word(std::string_view word) const {
  if (ignore_merges_) {
    auto it = bytes_to_id_.find(std::string(word));
    if (it != bytes_to_id_.end()) return {it->second};
  }
  const int n = static_cast<int>(word.size());
  struct Sym {
    int32_t id, prev, next;
  };
  std::vector<Sym> syms(n);
  for (int i = 0; i < n; ++i) {
    const auto b = static_cast<unsigned char>(word[i]);
    if (byte_id_[b] < 0) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", b);
      fail("tokenizer '", path_, "': cannot encode byte ", hex, " in \"", printable(word),
           "\": the vocabulary has no token for it");
    }
    syms[i] = {byte_id_[b], i - 1, i + 1 < n ? i + 1 : -1};
  }
  struct Cand {
    int32_t rank, pos, left, right, result;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto consider = [&](int32_t pos) {
    if (pos < 0) return;
    const int32_t next = syms[pos].next;
    if (next < 0) return;
    auto it = merges_.find(pair_key(syms[pos].id, syms[next].id));
    if (it != merges_.end()) heap.push({it->second.rank, pos, syms[pos].id, syms[next].id, it->second.result});
  };
  for (int i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& left = syms[c.pos];
    if (left.id != c.left || left.next < 0 || syms[left.next].id != c.right) continue;  // stale
    Sym& right = syms[left.next];
    left.id = c.result;
    left.next = right.next;
    if (right.next >= 0) syms[right.next].prev = c.pos;
    right.id = -1;
    consider(left.prev);
    consider(c.pos);
  }
  std::vector<int32_t> ids;
  for (int i = 0; i >= 0 && n > 0; i = syms[i].next) ids.push_back(syms[i].id);
  return ids;
}

void BpeTokenizer::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1 && !ignore_merges_) {
    const auto b = static_cast<unsigned char>(word[0]);
    if (byte_id_[b] >= 0) {
      out.push_back(byte_id_[b]);
      return;
    }
  }
  CachePart& part = cache_[std::hash<std::string_view>{}(word) % kCacheParts];
  {
    std::lock_guard<std::mutex> lock(part.mu);
    auto it = part.words.find(word);
    if (it != part.words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids = merge_word(word);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(part.mu);
  if (part.words.size() < kCacheEntriesPerPart) part.words.emplace(std::string(word), std::move(ids));
}

void BpeTokenizer::encode_segment(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::string prefixed;
  if (add_prefix_space_ && text[0] != ' ') {
    prefixed.reserve(text.size() + 1);
    prefixed.push_back(' ');
    prefixed.append(text);
    text = prefixed;
  }
  byte_level::for_each_pretoken(text, [&](std::string_view word) { encode_word(word, out); });
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  if (added_.empty()) {
    encode_segment(text, out);
    return out;
  }
  // Earliest next occurrence of each added token at or after `pos`, found lazily.
  std::vector<size_t> next(added_.size(), 0);
  std::vector<char> known(added_.size(), 0);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t best = std::string_view::npos;
    size_t best_k = 0;
    for (size_t k = 0; k < added_.size(); ++k) {
      if (!known[k] || (next[k] != std::string_view::npos && next[k] < pos)) {
        next[k] = text.find(added_[k].first, pos);
        known[k] = 1;
      }
      if (next[k] < best) {  // strict: the longer of two tokens at one place comes first
        best = next[k];
        best_k = k;
      }
    }
    if (best == std::string_view::npos) {
      encode_segment(text.substr(pos), out);
      break;
    }
    encode_segment(text.substr(pos, best - pos), out);
    out.push_back(added_[best_k].second);
    pos = best + added_[best_k].first.size();
  }
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (const int32_t id : ids) {
    ESPLAG_CHECK(id >= 0 && id < vocab_size_ && id_valid_[id], "tokenizer '", path_, "': cannot decode token id ", id,
                 (id >= 0 && id < vocab_size_ ? " (no token has this id)" : ""), ": the vocabulary is 0..",
                 vocab_size_ - 1);
    out += id_bytes_[id];
  }
  return out;
}

// ---------------------------------------------------------------------------------------

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  ESPLAG_CHECK(!spec.empty(), "empty tokenizer spec: expected \"byte\" or a path to a tokenizer.json");
  std::error_code ec;
  fs::path p(spec);
  if (fs::is_directory(p, ec)) p /= "tokenizer.json";
  ESPLAG_CHECK(fs::exists(p, ec), "tokenizer '", spec, "': file '", p.string(),
               "' does not exist (expected \"byte\" or a path to a Hugging Face tokenizer.json)");
  return std::make_unique<BpeTokenizer>(p.string());
}

}  // namespace esplag
