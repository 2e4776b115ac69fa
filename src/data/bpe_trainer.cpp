#include "data/bpe_trainer.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "core/error.h"
#include "core/parallel.h"
#include "data/byte_level.h"
#include "data/file_util.h"
#include "io/atomic_file.h"

namespace esplag {

namespace {

constexpr std::string_view kEotText = "<|endoftext|>";

uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
int32_t key_left(uint64_t k) { return static_cast<int32_t>(k >> 32); }
int32_t key_right(uint64_t k) { return static_cast<int32_t>(k & 0xffffffffu); }

using WordCounts = std::unordered_map<std::string_view, int64_t>;

// Unique pre-tokens of `text` with their counts, skipping "<|endoftext|>" markers.
// Pieces cut at safe places are counted in parallel; the sum does not depend on the cut.
WordCounts count_words(std::string_view text, int64_t* total_words) {
  std::vector<std::string_view> pieces;
  size_t pos = 0;
  const size_t target = std::max<size_t>(size_t(1) << 20, text.size() / (4 * size_t(num_threads())) + 1);
  while (pos <= text.size()) {
    size_t end = text.find(kEotText, pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view seg = text.substr(pos, end - pos);
    const auto cuts = byte_level::safe_cuts(seg, target);
    for (size_t i = 0; i + 1 < cuts.size(); ++i) pieces.push_back(seg.substr(cuts[i], cuts[i + 1] - cuts[i]));
    pos = end + kEotText.size();
  }
  std::vector<WordCounts> partial(pieces.size());
  std::vector<int64_t> partial_total(pieces.size(), 0);
  parallel_for(static_cast<int64_t>(pieces.size()), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      byte_level::for_each_pretoken(pieces[i], [&](std::string_view w) {
        ++partial[i][w];
        ++partial_total[i];
      });
    }
  });
  WordCounts all;
  *total_words = 0;
  for (size_t i = 0; i < partial.size(); ++i) {
    for (const auto& [w, c] : partial[i]) all[w] += c;
    *total_words += partial_total[i];
    WordCounts().swap(partial[i]);
  }
  return all;
}

struct HeapEntry {
  int64_t count;
  int32_t left, right;
  // Priority: higher count, then smaller (left, right).
  bool operator<(const HeapEntry& o) const {
    if (count != o.count) return count < o.count;
    if (left != o.left) return left > o.left;
    return right > o.right;
  }
};

std::string shown(const std::string& bytes) { return byte_level::encode_bytes(bytes); }

}  // namespace

BpeModel train_bpe(std::string_view text, int vocab_size, const ProgressFn& progress, int64_t min_frequency) {
  ESPLAG_CHECK(vocab_size >= 257, "train_bpe: vocab_size must be at least 257 (256 bytes + <|endoftext|>), got ",
               vocab_size);
  auto report = [&](const std::string& s) {
    if (progress) progress(s);
  };
  BpeModel model;
  for (int b = 0; b < 256; ++b) model.tokens.emplace_back(1, static_cast<char>(b));
  std::unordered_map<std::string, int32_t> token_id;
  for (int b = 0; b < 256; ++b) token_id.emplace(model.tokens[b], b);

  int64_t total_words = 0;
  const WordCounts counts = count_words(text, &total_words);
  std::vector<std::pair<std::string_view, int64_t>> words(counts.begin(), counts.end());
  std::sort(words.begin(), words.end());
  report("bpe: " + std::to_string(text.size()) + " bytes, " + std::to_string(total_words) + " pre-tokens, " +
         std::to_string(words.size()) + " unique");

  // Symbols of every word, stored contiguously; a word only ever shrinks in place.
  const int32_t num_words = static_cast<int32_t>(words.size());
  std::vector<int64_t> offset(num_words);
  std::vector<int32_t> length(num_words);
  std::vector<int64_t> weight(num_words);
  int64_t total_syms = 0;
  for (int32_t w = 0; w < num_words; ++w) {
    offset[w] = total_syms;
    length[w] = static_cast<int32_t>(words[w].first.size());
    weight[w] = words[w].second;
    total_syms += length[w];
  }
  std::vector<int32_t> syms(total_syms);
  for (int32_t w = 0; w < num_words; ++w)
    for (int32_t i = 0; i < length[w]; ++i) syms[offset[w] + i] = static_cast<unsigned char>(words[w].first[i]);

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words;  // may hold stale or repeated words
  for (int32_t w = 0; w < num_words; ++w) {
    const int32_t* s = syms.data() + offset[w];
    for (int32_t i = 0; i + 1 < length[w]; ++i) {
      const uint64_t k = pair_key(s[i], s[i + 1]);
      pair_count[k] += weight[w];
      auto& list = pair_words[k];
      if (list.empty() || list.back() != w) list.push_back(w);
    }
  }
  std::priority_queue<HeapEntry> heap;
  for (const auto& [k, c] : pair_count) heap.push({c, key_left(k), key_right(k)});

  const int target_tokens = vocab_size - 1;  // the last id is <|endoftext|>
  std::vector<int32_t> visited(num_words, -1);
  std::unordered_map<uint64_t, int64_t> delta;
  int32_t merge_index = 0;
  while (static_cast<int>(model.tokens.size()) < target_tokens) {
    HeapEntry best{};
    bool found = false;
    while (!heap.empty()) {
      best = heap.top();
      heap.pop();
      auto it = pair_count.find(pair_key(best.left, best.right));
      if (it != pair_count.end() && it->second == best.count) {  // otherwise a stale entry
        found = true;
        break;
      }
    }
    if (!found || best.count < std::max<int64_t>(min_frequency, 1)) {
      report("bpe: stopping at " + std::to_string(model.tokens.size() + 1) + " tokens: no pair occurs at least " +
             std::to_string(std::max<int64_t>(min_frequency, 1)) + " times");
      break;
    }
    const int32_t a = best.left, b = best.right;
    const uint64_t merged_key = pair_key(a, b);
    std::string bytes = model.tokens[a] + model.tokens[b];
    int32_t id;
    if (auto it = token_id.find(bytes); it != token_id.end()) {
      id = it->second;
    } else {
      id = static_cast<int32_t>(model.tokens.size());
      token_id.emplace(bytes, id);
      model.tokens.push_back(std::move(bytes));
    }
    model.merges.push_back({a, b, id});

    auto list_it = pair_words.find(merged_key);
    std::vector<int32_t> affected = std::move(list_it->second);
    pair_words.erase(list_it);
    pair_count.erase(merged_key);
    delta.clear();
    for (const int32_t w : affected) {
      if (visited[w] == merge_index) continue;
      visited[w] = merge_index;
      int32_t* s = syms.data() + offset[w];
      const int32_t len = length[w];
      bool has = false;
      for (int32_t i = 0; i + 1 < len && !has; ++i) has = s[i] == a && s[i + 1] == b;
      if (!has) continue;
      const int64_t c = weight[w];
      for (int32_t i = 0; i + 1 < len; ++i) delta[pair_key(s[i], s[i + 1])] -= c;
      int32_t j = 0;
      for (int32_t i = 0; i < len;) {
        if (i + 1 < len && s[i] == a && s[i + 1] == b) {
          s[j++] = id;
          i += 2;
        } else {
          s[j++] = s[i++];
        }
      }
      length[w] = j;
      for (int32_t i = 0; i + 1 < j; ++i) {
        const uint64_t k = pair_key(s[i], s[i + 1]);
        delta[k] += c;
        if (s[i] == id || s[i + 1] == id) {  // only pairs with the new token are new to this word
          auto& list = pair_words[k];
          if (list.empty() || list.back() != w) list.push_back(w);
        }
      }
    }
    for (const auto& [k, d] : delta) {
      if (d == 0 || k == merged_key) continue;
      auto it = pair_count.try_emplace(k, 0).first;
      it->second += d;
      if (it->second <= 0) {
        pair_count.erase(it);
      } else {
        heap.push({it->second, key_left(k), key_right(k)});
      }
    }
    ++merge_index;
    if (merge_index % 1000 == 0)
      report("bpe: merge " + std::to_string(merge_index) + ": '" + shown(model.tokens[a]) + "' + '" +
             shown(model.tokens[b]) + "' (" + std::to_string(best.count) + " times), vocabulary " +
             std::to_string(model.tokens.size() + 1) + "/" + std::to_string(vocab_size));
  }
  ESPLAG_CHECK(!token_id.count(std::string(kEotText)), "train_bpe: a learned token spells ", kEotText);
  model.eot_token = static_cast<int32_t>(model.tokens.size());
  model.tokens.emplace_back(kEotText);
  report("bpe: " + std::to_string(model.merges.size()) + " merges, vocabulary " + std::to_string(model.tokens.size()));
  return model;
}

void save_tokenizer_json(const std::string& path, const BpeModel& model) {
  using ojson = nlohmann::ordered_json;
  ESPLAG_CHECK(model.eot_token >= 0 && model.eot_token < model.vocab_size(), "save_tokenizer_json '", path,
               "': the model has no end-of-text token");
  ojson vocab = ojson::object();
  for (int32_t id = 0; id < model.vocab_size(); ++id) {
    const std::string key = id == model.eot_token ? model.tokens[id] : byte_level::encode_bytes(model.tokens[id]);
    ESPLAG_CHECK(!vocab.contains(key), "save_tokenizer_json '", path, "': token ", id, " (\"", key,
                 "\") repeats an earlier token");
    vocab[key] = id;
  }
  ojson merges = ojson::array();
  for (const auto& m : model.merges)
    merges.push_back(byte_level::encode_bytes(model.tokens[m.left]) + " " +
                     byte_level::encode_bytes(model.tokens[m.right]));
  const ojson byte_level_pre = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  ojson js;
  js["version"] = "1.0";
  js["truncation"] = nullptr;
  js["padding"] = nullptr;
  js["added_tokens"] = ojson::array({{{"id", model.eot_token},
                                      {"content", model.tokens[model.eot_token]},
                                      {"single_word", false},
                                      {"lstrip", false},
                                      {"rstrip", false},
                                      {"normalized", false},
                                      {"special", true}}});
  js["normalizer"] = nullptr;
  js["pre_tokenizer"] = byte_level_pre;
  js["post_processor"] = {
      {"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  js["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  js["model"] = {{"type", "BPE"},
                 {"dropout", nullptr},
                 {"unk_token", nullptr},
                 {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr},
                 {"fuse_unk", false},
                 {"byte_fallback", false},
                 {"ignore_merges", false},
                 {"vocab", std::move(vocab)},
                 {"merges", std::move(merges)}};
  write_file_atomic(path, js.dump(2) + "\n");
}

}  // namespace esplag
