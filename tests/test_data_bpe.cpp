// Byte-level BPE: loading tokenizer.json, encoding, and training.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "data/bpe_trainer.h"
#include "data/byte_level.h"
#include "data/tokenizer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace esplag;

using esplag::testing::contains;
using esplag::testing::error_of;
using esplag::testing::TempDir;
using esplag::testing::write_text;

namespace {

// A GPT-2-style file with a handful of merges. "Ġ" is the stand-in for a space.
const char* kTinyTokenizer = R"({
  "version": "1.0",
  "added_tokens": [{"id": 15, "content": "<|endoftext|>", "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
  "decoder": {"type": "ByteLevel"},
  "model": {
    "type": "BPE",
    "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "w": 5, "r": 6, "d": 7, "he": 8, "ll": 9,
              "hell": 10, "hello": 11, "Ġw": 12, "or": 13, "Ġwor": 14, "<|endoftext|>": 15},
    "merges": ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
  }
})";

std::string abc_tokenizer(const std::string& merges_json) {
  return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "aa": 5},
             "merges": )" +
         merges_json + "}}";
}

// A small corpus: made-up words of one to three syllables with a skewed distribution,
// a few very frequent words, punctuation, digits and UTF-8.
std::string training_corpus() {
  const char* syllables[] = {"ka", "lo", "mi", "ren", "ta", "vu", "sha", "el", "dor", "ni", "qui", "zé"};
  const char* common[] = {"the", "and", "of", "lord", "unto", "café"};
  std::string text;
  uint32_t x = 12345;
  auto next = [&] { return (x = x * 1664525u + 1013904223u) >> 8; };
  for (int i = 0; i < 4000; ++i) {
    if (next() % 3 == 0) {
      text += common[next() % 6];
    } else {
      const int n = 1 + next() % 3;
      for (int k = 0; k < n; ++k) text += syllables[std::min(next() % 12, next() % 12)];
    }
    const uint32_t r = next() % 16;
    text += r == 0 ? ".\n" : r == 1 ? ", " : r == 2 ? " 12 " : " ";
  }
  return text;
}

// Reference trainer: the textbook algorithm, recounting every pair before every merge.
std::vector<BpeModel::Merge> reference_merges(const std::string& text, int vocab_size) {
  std::map<std::string, int64_t> counts;
  for (auto w : byte_level::pretokenize(text)) ++counts[std::string(w)];
  std::vector<std::pair<std::vector<int32_t>, int64_t>> words;
  for (const auto& [w, c] : counts) {
    std::vector<int32_t> s;
    for (const char ch : w) s.push_back(static_cast<unsigned char>(ch));
    words.push_back({s, c});
  }
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  std::vector<BpeModel::Merge> merges;
  while (static_cast<int>(tokens.size()) < vocab_size - 1) {
    std::map<std::pair<int32_t, int32_t>, int64_t> pairs;
    for (const auto& [s, c] : words)
      for (size_t i = 0; i + 1 < s.size(); ++i) pairs[{s[i], s[i + 1]}] += c;
    std::pair<int32_t, int32_t> best{};
    int64_t best_count = 0;
    for (const auto& [p, c] : pairs)  // map order: the first of equal counts has the smaller pair
      if (c > best_count) best = p, best_count = c;
    if (best_count < 2) break;
    const std::string bytes = tokens[best.first] + tokens[best.second];
    int32_t id = static_cast<int32_t>(std::find(tokens.begin(), tokens.end(), bytes) - tokens.begin());
    if (id == static_cast<int32_t>(tokens.size())) tokens.push_back(bytes);
    merges.push_back({best.first, best.second, id});
    for (auto& [s, c] : words) {
      std::vector<int32_t> t;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == best.first && s[i + 1] == best.second) {
          t.push_back(id);
          i += 2;
        } else {
          t.push_back(s[i++]);
        }
      }
      s = t;
    }
  }
  return merges;
}

// Reference encoder for a trained model: apply the merges one after another, in order.
std::vector<int32_t> reference_encode(const BpeModel& m, const std::string& text) {
  std::vector<int32_t> out;
  for (auto w : byte_level::pretokenize(text)) {
    std::vector<int32_t> s;
    for (const char ch : w) s.push_back(static_cast<unsigned char>(ch));
    for (const auto& mg : m.merges) {
      std::vector<int32_t> t;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == mg.left && s[i + 1] == mg.right) {
          t.push_back(mg.result);
          i += 2;
        } else {
          t.push_back(s[i++]);
        }
      }
      s = t;
    }
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

}  // namespace

// ---- loading a hand-written tokenizer.json ----------------------------------------------

TEST(BpeTokenizer, HandWrittenFileEncodesToKnownIds) {
  TempDir dir;
  write_text(dir.file("tokenizer.json"), kTinyTokenizer);
  BpeTokenizer tok(dir.file("tokenizer.json"));
  EXPECT_EQ(tok.vocab_size(), 16);
  EXPECT_EQ(tok.num_merges(), 7);
  EXPECT_EQ(tok.eot_token(), 15);
  EXPECT_EQ(tok.encode("hello world"), (std::vector<int32_t>{11, 14, 2, 7}));
  EXPECT_EQ(tok.encode("hello<|endoftext|> world"), (std::vector<int32_t>{11, 15, 14, 2, 7}));
  EXPECT_EQ(tok.encode("<|endoftext|>hello"), (std::vector<int32_t>{15, 11}));
  EXPECT_EQ(tok.encode("hellow"), (std::vector<int32_t>{11, 5}));
  EXPECT_EQ(tok.encode(" hello"), (std::vector<int32_t>{4, 11}));  // no "Ġh" merge: space stays alone
  EXPECT_EQ(tok.decode({11, 15, 14, 2, 7}), "hello<|endoftext|> world");
  EXPECT_EQ(tok.token_id("hell"), 10);
  EXPECT_EQ(tok.token_id(" w"), 12);
  // load_tokenizer accepts the file or its directory; name() is the absolute path.
  EXPECT_EQ(load_tokenizer(dir.file("tokenizer.json"))->name(),
            fs::weakly_canonical(dir.file("tokenizer.json")).string());
  EXPECT_EQ(load_tokenizer(dir.file(""))->encode("hello"), (std::vector<int32_t>{11}));
  EXPECT_TRUE(contains(error_of([&] { tok.encode("hex"); }), "cannot encode byte 0x78 in \"hex\""));
  EXPECT_TRUE(contains(error_of([&] { tok.decode({16}); }), "cannot decode token id 16: the vocabulary is 0..15"));
}

TEST(BpeTokenizer, LowestRankMergesFirstInBothMergeForms) {
  TempDir dir;
  write_text(dir.file("a.json"), abc_tokenizer(R"(["b c", "a b"])"));
  write_text(dir.file("b.json"), abc_tokenizer(R"([["a", "b"], ["b", "c"]])"));
  write_text(dir.file("c.json"), abc_tokenizer(R"([["a", "a"]])"));
  EXPECT_EQ(BpeTokenizer(dir.file("a.json")).encode("abc"), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(BpeTokenizer(dir.file("b.json")).encode("abc"), (std::vector<int32_t>{3, 2}));
  // Equal ranks: leftmost first.
  EXPECT_EQ(BpeTokenizer(dir.file("c.json")).encode("aaa"), (std::vector<int32_t>{5, 0}));
  EXPECT_EQ(BpeTokenizer(dir.file("c.json")).encode("aaaa"), (std::vector<int32_t>{5, 5}));
  EXPECT_EQ(BpeTokenizer(dir.file("c.json")).eot_token(), -1);
}

TEST(BpeTokenizer, PrefixSpaceIgnoreMergesAndPreTokenizerChecks) {
  TempDir dir;
  std::string t = kTinyTokenizer;
  const std::string from = "\"add_prefix_space\": false";
  t.replace(t.find(from), from.size(), "\"add_prefix_space\": true");
  write_text(dir.file("prefix.json"), t);
  BpeTokenizer prefix(dir.file("prefix.json"));
  EXPECT_EQ(prefix.encode("hello"), (std::vector<int32_t>{4, 11}));
  EXPECT_EQ(prefix.encode(" hello"), (std::vector<int32_t>{4, 11}));

  // ignore_merges: a pre-token that is itself in the vocabulary is taken whole.
  write_text(dir.file("ignore.json"), R"({"model": {"type": "BPE", "ignore_merges": true,
      "vocab": {"a": 0, "b": 1, "c": 2, "abc": 3, "ab": 4}, "merges": ["a b"]}})");
  BpeTokenizer ignore(dir.file("ignore.json"));
  EXPECT_EQ(ignore.encode("abc"), (std::vector<int32_t>{3}));
  EXPECT_EQ(ignore.encode("abcc"), (std::vector<int32_t>{4, 2, 2}));

  // GPT-2's own Split + ByteLevel sequence is accepted; another pattern is refused.
  const std::string gpt2_split =
      R"({"type": "Split", "pattern": {"Regex": "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated"})";
  auto with_pre = [&](const std::string& pre) {
    return R"({"pre_tokenizer": )" + pre + R"(, "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})";
  };
  write_text(dir.file("seq.json"),
             with_pre(R"({"type": "Sequence", "pretokenizers": [)" + gpt2_split +
                      R"(, {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]})"));
  EXPECT_EQ(BpeTokenizer(dir.file("seq.json")).encode("aa"), (std::vector<int32_t>{0, 0}));
  write_text(dir.file("llama3.json"),
             with_pre(R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}},
                          {"type": "ByteLevel", "use_regex": false}]})"));
  EXPECT_TRUE(contains(error_of([&] { BpeTokenizer t(dir.file("llama3.json")); }),
                       "pre_tokenizer Split pattern '\\p{N}{1,3}' is not GPT-2's"));
  write_text(dir.file("meta.json"), with_pre(R"({"type": "Metaspace"})"));
  EXPECT_TRUE(contains(error_of([&] { BpeTokenizer t(dir.file("meta.json")); }),
                       "pre_tokenizer \"Metaspace\" is not supported"));
}

TEST(BpeTokenizer, LoadErrorsArePrecise) {
  TempDir dir;
  const std::string missing = dir.file("missing.json");
  EXPECT_EQ(error_of([&] { BpeTokenizer t(missing); }), "tokenizer file '" + missing + "' does not exist");

  write_text(dir.file("bad.json"), "{\"model\": {\"type\": \"BPE\", ");
  EXPECT_TRUE(contains(error_of([&] { BpeTokenizer t(dir.file("bad.json")); }),
                       "' is not valid JSON (the parser stopped at byte "));

  write_text(dir.file("wp.json"), R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})");
  EXPECT_TRUE(contains(error_of([&] { BpeTokenizer t(dir.file("wp.json")); }),
                       "unsupported model type \"WordPiece\" (only \"BPE\""));

  write_text(dir.file("unk.json"), abc_tokenizer(R"(["a b", "b q"])"));
  EXPECT_TRUE(contains(error_of([&] { BpeTokenizer t(dir.file("unk.json")); }),
                       "merge 1 (\"b\", \"q\") refers to unknown token \"q\" (not in model.vocab)"));

  write_text(dir.file("res.json"), abc_tokenizer(R"(["c a"])"));
  EXPECT_TRUE(contains(error_of([&] { BpeTokenizer t(dir.file("res.json")); }),
                       "merge 0 (\"c\", \"a\") produces unknown token \"ca\""));

  write_text(dir.file("form.json"), abc_tokenizer(R"(["abc"])"));
  EXPECT_TRUE(contains(error_of([&] { BpeTokenizer t(dir.file("form.json")); }),
                       "merge 0 \"abc\" is not of the form \"left right\""));

  write_text(dir.file("meta.json"), R"({"model": {"type": "BPE", "vocab": {"▁the": 0, "a": 1}, "merges": []}})");
  EXPECT_TRUE(contains(error_of([&] { BpeTokenizer t(dir.file("meta.json")); }), "is not a byte-level token"));

  write_text(dir.file("norm.json"),
             R"({"normalizer": {"type": "NFC"}, "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})");
  EXPECT_TRUE(
      contains(error_of([&] { BpeTokenizer t(dir.file("norm.json")); }), "normalizer \"NFC\" is not supported"));

  write_text(dir.file("dup.json"), R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 0}, "merges": []}})");
  EXPECT_TRUE(contains(error_of([&] { BpeTokenizer t(dir.file("dup.json")); }), "id 0 is used by both"));
}

// ---- training --------------------------------------------------------------------------

TEST(BpeTrainer, MatchesTheTextbookAlgorithm) {
  const std::string text = training_corpus();
  const BpeModel m = train_bpe(text, 420);
  const auto ref = reference_merges(text, 420);
  ASSERT_EQ(m.merges.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_EQ(m.merges[i].left, ref[i].left) << "merge " << i;
    EXPECT_EQ(m.merges[i].right, ref[i].right) << "merge " << i;
    EXPECT_EQ(m.merges[i].result, ref[i].result) << "merge " << i;
  }
  EXPECT_EQ(m.vocab_size(), 420);
  EXPECT_EQ(m.eot_token, 419);
  EXPECT_EQ(m.tokens[m.eot_token], "<|endoftext|>");
  // Deterministic: a second run learns the same merges.
  const BpeModel again = train_bpe(text, 420);
  ASSERT_EQ(again.merges.size(), m.merges.size());
  for (size_t i = 0; i < m.merges.size(); ++i) EXPECT_EQ(again.merges[i].result, m.merges[i].result);
}

TEST(BpeTrainer, SavedTokenizerLoadsBackAndRoundTrips) {
  TempDir dir;
  const std::string text = training_corpus();
  std::vector<std::string> lines;
  const BpeModel m = train_bpe(text, 300, [&](const std::string& s) { lines.push_back(s); });
  EXPECT_FALSE(lines.empty());
  save_tokenizer_json(dir.file("tokenizer.json"), m);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.file("")), {}), 1);  // no temporary left

  // The file has the Hugging Face layout.
  std::ifstream in(dir.file("tokenizer.json"));
  const auto js = nlohmann::json::parse(in);
  EXPECT_EQ(js["model"]["type"], "BPE");
  EXPECT_EQ(js["model"]["vocab"].size(), 300u);
  EXPECT_EQ(js["model"]["merges"].size(), m.merges.size());
  const auto the = std::find(m.tokens.begin(), m.tokens.end(), " the");
  ASSERT_NE(the, m.tokens.end());
  EXPECT_EQ(js["model"]["vocab"]["\u0120the"], the - m.tokens.begin());
  EXPECT_EQ(js["added_tokens"][0]["content"], "<|endoftext|>");
  EXPECT_EQ(js["added_tokens"][0]["id"], 299);
  EXPECT_EQ(js["pre_tokenizer"]["type"], "ByteLevel");
  EXPECT_EQ(js["decoder"]["type"], "ByteLevel");

  BpeTokenizer tok(dir.file("tokenizer.json"));
  EXPECT_EQ(tok.vocab_size(), 300);
  EXPECT_EQ(tok.eot_token(), 299);
  EXPECT_EQ(tok.num_merges(), static_cast<int>(m.merges.size()));
  for (int32_t id = 0; id < 299; ++id) EXPECT_EQ(tok.token_id(m.tokens[id]), id);

  // Frequent words become single tokens (with their leading space, as in GPT-2).
  for (const char* w : {" the", " and", " lord", " unto", "the"}) EXPECT_EQ(tok.encode(w).size(), 1u) << w;
  EXPECT_EQ(tok.encode(" café").size(), 1u);

  // Its length is sizeof less the final NUL (strlen would stop at the first byte, a NUL).
  static constexpr char kRawBytes[] = "\x00\x01\xff\xfe raw bytes";
  const std::vector<std::string> samples = {
      "And the lord said unto them, that day shall be 1234.\n\nThe end!",
      "naïve café — 日本語の文章 😀, Ünïcödé and tabs\tand  double  spaces \n",
      "  leading and trailing   ",
      "it's I'll we've they're 'quoted' \"double\" <tag> a_b-c",
      "<|endoftext|>the<|endoftext|>",
      std::string(kRawBytes, sizeof kRawBytes - 1),
  };
  for (const auto& s : samples) {
    const auto ids = tok.encode(s);
    EXPECT_EQ(tok.decode(ids), s);
    for (const int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 300);
  }
  EXPECT_EQ(tok.encode("<|endoftext|>"), (std::vector<int32_t>{299}));
  // Greedy lowest-rank encoding equals replaying the learned merges in order.
  for (const auto& s : samples) {
    if (s.find("<|endoftext|>") != std::string::npos) continue;
    EXPECT_EQ(tok.encode(s), reference_encode(m, s)) << s;
  }
  EXPECT_EQ(tok.encode(text.substr(0, 5000)), reference_encode(m, text.substr(0, 5000)));
}

TEST(BpeTrainer, EncodingFromSeveralThreadsAgrees) {
  TempDir dir;
  save_tokenizer_json(dir.file("t.json"), train_bpe(training_corpus(), 320));
  BpeTokenizer tok(dir.file("t.json"));
  const std::string text = training_corpus();
  const auto expected = tok.encode(text);
  std::vector<std::vector<int32_t>> got(4);
  {
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) threads.emplace_back([&, i] { got[i] = tok.encode(text); });
    for (auto& t : threads) t.join();
  }
  for (const auto& g : got) EXPECT_EQ(g, expected);
}

TEST(BpeTrainer, SkipsEndOfTextMarkersAndStopsWhenPairsRunOut) {
  const BpeModel m = train_bpe("ab ab ab<|endoftext|>ab ab", 1000);
  // Pairs: "a b" (5 times), then " ab" ... until no pair occurs twice.
  ASSERT_FALSE(m.merges.empty());
  EXPECT_EQ(m.tokens[m.merges[0].result], "ab");
  EXPECT_LT(m.vocab_size(), 1000);
  EXPECT_EQ(m.tokens.back(), "<|endoftext|>");
  for (size_t id = 256; id + 1 < m.tokens.size(); ++id) EXPECT_EQ(m.tokens[id].find('<'), std::string::npos) << id;
  EXPECT_THROW(train_bpe("abc", 256), Error);
}

// A few entries with huge ids would make the per-id tables take gigabytes for a tiny file
// (found by fuzzing: 2.7 GB for 67 bytes).
TEST(BpeTokenizer, SparseIdsAreRefusedBeforeAllocating) {
  TempDir dir;
  write_text(dir.file("gap.json"), R"({"model": {"type": "BPE", "vocab": {"a": 67108863}, "merges": []}})");
  EXPECT_NE(esplag::testing::error_of([&] { BpeTokenizer t(dir.file("gap.json")); })
                .find("ids go up to 67108863 for only 1 tokens"),
            std::string::npos);
  // Small gaps, as real vocabularies have around their special tokens, load.
  write_text(dir.file("small_gap.json"), R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 900}, "merges": []}})");
  EXPECT_EQ(BpeTokenizer(dir.file("small_gap.json")).vocab_size(), 901);
}
