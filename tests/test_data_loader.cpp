// Preparing datasets and loading batches from them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/bpe_trainer.h"
#include "data/loader.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace esplag;

using esplag::testing::contains;
using esplag::testing::error_of;
using esplag::testing::TempDir;
using esplag::testing::write_text;

namespace {

// Shards whose tokens are their global positions plus `base`, so a window is known by
// its first token. Sizes 100 and 61 with T = 7 give 12 + 7 = 19 windows of 8 tokens.
void write_position_shards(const TempDir& dir, const std::string& split, int32_t base) {
  std::vector<int32_t> a(100), b(61);
  std::iota(a.begin(), a.end(), base);
  std::iota(b.begin(), b.end(), base + 1000);
  write_shard(dir.file(split + "_000000.bin"), a, 65536);
  write_shard(dir.file(split + "_000001.bin"), b, 65536);
}

// Window starts (first token) in file order for the shards above.
std::vector<int32_t> window_firsts(int32_t base) {
  std::vector<int32_t> w;
  for (int i = 0; i + 8 <= 100; i += 8) w.push_back(base + i);
  for (int i = 0; i + 8 <= 61; i += 8) w.push_back(base + 1000 + i);
  return w;
}

struct Batch {
  std::vector<int32_t> x, y;
  bool operator==(const Batch&) const = default;
};

Batch next(DataLoader& dl, int B, int T) {
  Batch b{std::vector<int32_t>(size_t(B) * T, -7), std::vector<int32_t>(size_t(B) * T, -7)};
  dl.next_batch(b.x.data(), b.y.data());
  return b;
}

std::vector<int32_t> read_split(const std::string& dir, const std::string& split) {
  std::vector<int32_t> all;
  for (const auto& p : find_shards(dir, split)) {
    const auto t = read_shard(p).tokens;
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

}  // namespace

// ---- loader ----------------------------------------------------------------------------

TEST(DataLoader, TargetsAreInputsShiftedByOne) {
  TempDir dir;
  write_position_shards(dir, "train", 0);
  DataLoader dl(dir.str(), "train", 4, 7, 1);
  EXPECT_EQ(dl.num_windows(), 19);
  EXPECT_EQ(dl.num_tokens(), 161);
  EXPECT_EQ(dl.num_batches(), 4);
  EXPECT_EQ(dl.max_token(), 1060);
  const auto firsts = window_firsts(0);
  for (int k = 0; k < 10; ++k) {
    const Batch b = next(dl, 4, 7);
    for (int r = 0; r < 4; ++r) {
      EXPECT_TRUE(std::count(firsts.begin(), firsts.end(), b.x[r * 7]) == 1) << b.x[r * 7];
      for (int t = 0; t < 7; ++t) {
        EXPECT_EQ(b.x[r * 7 + t], b.x[r * 7] + t);  // a window is contiguous data
        EXPECT_EQ(b.y[r * 7 + t], b.x[r * 7 + t] + 1);
      }
    }
  }
}

TEST(DataLoader, EveryWindowOncePerEpochInASeededOrder) {
  TempDir dir;
  write_position_shards(dir, "train", 0);
  DataLoader dl(dir.str(), "train", 4, 7, 1);
  // 19 batches of 4 rows = exactly 4 epochs of 19 windows.
  std::vector<int32_t> rows;
  for (int k = 0; k < 19; ++k) {
    const Batch b = next(dl, 4, 7);
    for (int r = 0; r < 4; ++r) rows.push_back(b.x[r * 7]);
  }
  EXPECT_EQ(dl.state().epoch, 4);
  EXPECT_EQ(dl.state().position, 0);
  auto sorted_firsts = window_firsts(0);
  std::vector<std::vector<int32_t>> epochs;
  for (int e = 0; e < 4; ++e) {
    std::vector<int32_t> ep(rows.begin() + 19 * e, rows.begin() + 19 * (e + 1));
    // The epoch's order is the documented one.
    const auto order = dl.epoch_order(e);
    for (int i = 0; i < 19; ++i) EXPECT_EQ(ep[i], sorted_firsts[order[i]]);
    epochs.push_back(ep);
    std::sort(ep.begin(), ep.end());
    EXPECT_EQ(ep, sorted_firsts) << "epoch " << e;
  }
  EXPECT_NE(epochs[0], epochs[1]);  // reshuffled each epoch
  EXPECT_NE(epochs[0], sorted_firsts);

  // The same seed gives the same batches; another seed another order.
  DataLoader same(dir.str(), "train", 4, 7, 1), other(dir.str(), "train", 4, 7, 2);
  DataLoader again(dir.str(), "train", 4, 7, 1);
  bool differs = false;
  for (int k = 0; k < 8; ++k) {
    const Batch a = next(same, 4, 7), b = next(again, 4, 7), c = next(other, 4, 7);
    EXPECT_EQ(a, b);
    differs |= !(a == c);
  }
  EXPECT_TRUE(differs);
}

TEST(DataLoader, ResumingFromStateGivesIdenticalBatches) {
  TempDir dir;
  write_position_shards(dir, "train", 0);
  DataLoader a(dir.str(), "train", 3, 7, 42);
  for (int k = 0; k < 5; ++k) next(a, 3, 7);  // 15 rows: epoch 0, position 15
  const DataLoader::State s = a.state();
  EXPECT_EQ(s.epoch, 0);
  EXPECT_EQ(s.position, 15);
  std::vector<Batch> expected;
  for (int k = 0; k < 9; ++k) expected.push_back(next(a, 3, 7));  // crosses into epoch 1

  DataLoader b(dir.str(), "train", 3, 7, 42);
  b.set_state(s);
  for (int k = 0; k < 9; ++k) EXPECT_EQ(next(b, 3, 7), expected[k]) << "batch " << k;
  EXPECT_EQ(b.state().epoch, a.state().epoch);
  EXPECT_EQ(b.state().position, a.state().position);

  // A state from a later epoch also resumes exactly.
  DataLoader c(dir.str(), "train", 3, 7, 42);
  for (int k = 0; k < 30; ++k) next(c, 3, 7);
  const auto s2 = c.state();
  const Batch want = next(c, 3, 7);
  DataLoader d(dir.str(), "train", 3, 7, 42);
  d.set_state(s2);
  EXPECT_EQ(next(d, 3, 7), want);

  EXPECT_TRUE(contains(error_of([&] { d.set_state({0, 19}); }), "state (epoch 0, position 19) does not fit"));
  EXPECT_THROW(d.set_state({-1, 0}), Error);
}

// A data-parallel rank skips the other ranks' micro-batches: skipping k batches leaves the
// loader where k reads would, across epochs (19 windows, batches of 3).
TEST(DataLoader, SkippingBatchesEqualsReadingThem) {
  TempDir dir;
  write_position_shards(dir, "train", 0);
  DataLoader read(dir.str(), "train", 3, 7, 42), skip(dir.str(), "train", 3, 7, 42);
  for (const int k : {0, 1, 5, 7, 13}) {
    for (int i = 0; i < k; ++i) next(read, 3, 7);
    skip.skip_batches(k);
    EXPECT_EQ(skip.state().epoch, read.state().epoch) << "after skipping " << k;
    EXPECT_EQ(skip.state().position, read.state().position) << "after skipping " << k;
    EXPECT_EQ(next(skip, 3, 7), next(read, 3, 7)) << "the batch after skipping " << k;
  }
  EXPECT_THROW(skip.skip_batches(-1), Error);
}

TEST(DataLoader, ValidationIsInOrderAndResets) {
  TempDir dir;
  write_position_shards(dir, "train", 0);
  write_position_shards(dir, "val", 30000);
  DataLoader val(dir.str(), "val", 4, 7, 1);
  EXPECT_FALSE(val.shuffled());
  EXPECT_EQ(val.num_batches(), 4);
  const auto firsts = window_firsts(30000);
  for (int pass = 0; pass < 2; ++pass) {
    val.reset();
    for (int k = 0; k < 4; ++k) {
      const Batch b = next(val, 4, 7);
      for (int r = 0; r < 4; ++r) EXPECT_EQ(b.x[r * 7], firsts[k * 4 + r]);
    }
  }
  for (const auto& p : val.shard_paths()) EXPECT_TRUE(contains(fs::path(p).filename().string(), "val_"));
  DataLoader train(dir.str(), "train", 4, 7, 1);
  EXPECT_EQ(train.shard_paths().size(), 2u);
  for (const auto& p : train.shard_paths()) EXPECT_TRUE(contains(fs::path(p).filename().string(), "train_"));
}

TEST(DataLoader, FindsLlmcNamesThroughPatterns) {
  TempDir dir;
  std::vector<int32_t> t(50);
  std::iota(t.begin(), t.end(), 0);
  write_shard(dir.file("tiny_train.bin"), t, 50257);
  write_shard(dir.file("tiny_val.bin"), std::vector<int32_t>(t.begin(), t.begin() + 20), 50257);
  write_shard(dir.file("fineweb_train_000001.bin"), t, 50257);
  write_text(dir.file("notes.txt"), "not a shard");
  EXPECT_EQ(find_shards(dir.file("*.bin"), "train"),
            (std::vector<std::string>{dir.file("fineweb_train_000001.bin"), dir.file("tiny_train.bin")}));
  EXPECT_EQ(find_shards(dir.file("tiny_*"), "val"), (std::vector<std::string>{dir.file("tiny_val.bin")}));
  EXPECT_EQ(find_shards(dir.str(), "val"), (std::vector<std::string>{dir.file("tiny_val.bin")}));
  DataLoader dl(dir.file("tiny_train.bin"), "train", 2, 9, 0);
  EXPECT_EQ(dl.num_windows(), 5);
}

TEST(DataLoader, TooLittleDataOrNoShards) {
  TempDir dir;
  EXPECT_EQ(error_of([&] { DataLoader dl(dir.str(), "train", 2, 8, 0); }),
            "no 'train' shards found in '" + dir.str() +
                "' (expected files such as train_000000.bin; prepare data with `esplag data prepare`)");
  EXPECT_TRUE(contains(error_of([&] { DataLoader dl(dir.file("missing"), "train", 2, 8, 0); }),
                       "data path '" + dir.file("missing") + "' does not exist"));
  write_shard(dir.file("train_000000.bin"), std::vector<int32_t>(30, 1), 257);
  EXPECT_EQ(error_of([&] { DataLoader dl(dir.str(), "train", 4, 7, 0); }),
            "split 'train' of '" + dir.str() +
                "' holds 30 tokens in 1 shard(s) (3 windows of T+1 = 8), a batch needs B*(T+1) = 4*8 = 32 tokens "
                "(B whole windows within shards)");
  DataLoader ok(dir.str(), "train", 3, 7, 0);
  EXPECT_EQ(ok.num_batches(), 1);
}

// ---- prepare ---------------------------------------------------------------------------

TEST(DataLoader, OpenScansEveryShardAgainstTheDatasetVocabulary) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "a line of text number " + std::to_string(i) + "\n";
  write_text(dir.file("in.txt"), text);
  const std::string data = dir.file("data");
  prepare_dataset(dir.file("in.txt"), ByteTokenizer(), data, 0.1, 1000);
  const std::string shard = data + "/train_000002.bin";
  EXPECT_NO_THROW(DataLoader(data, "train", 2, 8, 1));
  // Id 300 (beyond the byte vocabulary of meta.json, within the uint16 format) at token 17
  // of the third shard, a batch that the first ones would not reach.
  std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(kShardHeaderBytes + 2 * 17);
  f.write("\x2c\x01", 2);
  f.close();
  const std::string expected =
      "shard '" + shard + "': token 17 (byte offset 1058) is 300, outside the vocabulary [0, 257)";
  EXPECT_EQ(error_of([&] { DataLoader(data, "train", 2, 8, 1); }), expected);
  EXPECT_EQ(error_of([&] { DataLoader(shard, "train", 2, 8, 1); }), expected);  // one file: its directory's meta.json
  // A vocabulary given by the caller wins over meta.json.
  EXPECT_NO_THROW(DataLoader(data, "train", 2, 8, 1, 301));
}

TEST(Prepare, ByteLevelShardsMetaAndHeldOutValidation) {
  TempDir dir;
  std::string doc1, doc2;
  for (int i = 0; i < 300; ++i) doc1 += "line " + std::to_string(i) + " of the first document\n";
  for (int i = 0; i < 100; ++i) doc2 += "zweite Seite " + std::to_string(i) + " — ünïcödé\n";
  write_text(dir.file("in.txt"), doc1 + "<|endoftext|>" + doc2 + "<|endoftext|>\n");
  const std::string out = dir.file("data");
  fs::create_directories(out);
  write_shard(out + "/train_000099.bin", std::vector<int32_t>{1, 2, 3}, 257);  // stale, from an older run
  std::vector<std::string> lines;
  PrepareOptions opt;
  opt.input = dir.file("in.txt");
  opt.out_dir = out;
  opt.val_fraction = 0.1;
  opt.shard_tokens = 4000;
  const PrepareResult r = prepare_dataset(opt, [&](const std::string& s) { lines.push_back(s); });
  EXPECT_FALSE(lines.empty());
  EXPECT_FALSE(fs::exists(out + "/train_000099.bin"));

  // Expected tokens: end-of-text before each document, the separator itself dropped.
  std::vector<int32_t> expected{256};
  for (const char c : doc1) expected.push_back(static_cast<unsigned char>(c));
  expected.push_back(256);
  for (const char c : doc2) expected.push_back(static_cast<unsigned char>(c));
  const int64_t n = static_cast<int64_t>(expected.size());
  const int64_t val = std::llround(n * 0.1);
  EXPECT_EQ(r.documents, 2);  // the trailing "\n" after the last separator is whitespace only
  EXPECT_EQ(r.train_tokens, n - val);
  EXPECT_EQ(r.val_tokens, val);
  EXPECT_EQ(r.vocab_size, 257);
  EXPECT_EQ(r.train_shards, static_cast<int>((n - val + 3999) / 4000));
  EXPECT_EQ(r.val_shards, 1);

  const auto train = read_split(out, "train"), held = read_split(out, "val");
  EXPECT_EQ(train, std::vector<int32_t>(expected.begin(), expected.end() - val));
  EXPECT_EQ(held, std::vector<int32_t>(expected.end() - val, expected.end()));
  EXPECT_EQ(read_shard(out + "/train_000000.bin").tokens.size(), 4000u);

  std::ifstream in(out + "/meta.json");
  const auto meta = nlohmann::json::parse(in);
  EXPECT_EQ(meta["tokenizer"], "byte");
  EXPECT_EQ(meta["vocab_size"], 257);
  EXPECT_EQ(meta["eot_token"], 256);
  EXPECT_EQ(meta["train_tokens"], n - val);
  EXPECT_EQ(meta["val_tokens"], val);
  EXPECT_EQ(meta["train_shards"].size(), size_t(r.train_shards));
  EXPECT_EQ(meta["val_shards"][0], "val_000000.bin");
  EXPECT_EQ(meta["shard_version"], 1);

  // Loaders over the result: validation windows come only from the held-out tail.
  const int T = 31, B = 4;
  DataLoader tl(out, "train", B, T, 3), vl(out, "val", B, T, 3);
  EXPECT_EQ(tl.num_tokens() + vl.num_tokens(), n);
  EXPECT_EQ(vl.num_tokens(), val);
  std::vector<int32_t> x(B * T), y(B * T);
  vl.next_batch(x.data(), y.data());
  EXPECT_TRUE(std::equal(x.begin(), x.begin() + T, expected.end() - val));
}

TEST(Prepare, BpeTokenizerSeparatorsAndParallelPieces) {
  TempDir dir;
  // About 2.4 MB, so the text is tokenised in several pieces in parallel.
  std::string text;
  const char* words[] = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "naïve", "'s"};
  uint32_t s = 7;
  while (text.size() < 2'400'000) {
    s = s * 1664525u + 1013904223u;
    text += words[(s >> 10) % 10];
    const uint32_t r = (s >> 20) % 12;
    text += r == 0 ? "\n" : r == 1 ? "\n\n" : r == 2 ? ",  " : " ";
  }
  write_text(dir.file("in.txt"), text);
  save_tokenizer_json(dir.file("tok.json"), train_bpe(text.substr(0, 200000), 300));
  BpeTokenizer tok(dir.file("tok.json"));

  PrepareOptions opt;
  opt.input = dir.file("in.txt");
  opt.out_dir = dir.file("bpe");
  opt.tokenizer = dir.file("tok.json");
  opt.val_fraction = 0.02;
  const PrepareResult r = prepare_dataset(opt);
  EXPECT_EQ(r.tokenizer, fs::weakly_canonical(dir.file("tok.json")).string());
  EXPECT_EQ(r.vocab_size, tok.vocab_size());
  EXPECT_TRUE(fs::exists(dir.file("bpe/tokenizer.json")));
  std::vector<int32_t> all = read_split(opt.out_dir, "train");
  const auto val = read_split(opt.out_dir, "val");
  all.insert(all.end(), val.begin(), val.end());
  std::vector<int32_t> expected{tok.eot_token()};
  const auto ids = tok.encode(text);
  expected.insert(expected.end(), ids.begin(), ids.end());
  EXPECT_EQ(all, expected);  // pieces tokenised in parallel join up exactly

  // "\n\n" as separator: one document per paragraph, each after an end-of-text token.
  write_text(dir.file("para.txt"), "first para\nstill first\n\nsecond\n\n\n\nthird");
  const PrepareResult p = prepare_dataset(dir.file("para.txt"), tok, dir.file("para"), 0.0, 1000, {}, "\n\n");
  EXPECT_EQ(p.documents, 3);
  const auto paras = read_split(dir.file("para"), "train");
  std::vector<int32_t> want;
  for (const char* d : {"first para\nstill first", "second", "third"}) {
    want.push_back(tok.eot_token());
    const auto e = tok.encode(d);
    want.insert(want.end(), e.begin(), e.end());
  }
  EXPECT_EQ(paras, want);
  EXPECT_TRUE(read_split(dir.file("para"), "val").empty());
}

TEST(Prepare, Errors) {
  TempDir dir;
  PrepareOptions opt;
  opt.input = dir.file("missing.txt");
  opt.out_dir = dir.file("out");
  EXPECT_EQ(error_of([&] { prepare_dataset(opt); }), "input text '" + dir.file("missing.txt") + "' does not exist");
  write_text(dir.file("in.txt"), "some text");
  opt.input = dir.file("in.txt");
  opt.val_fraction = 1.0;
  EXPECT_EQ(error_of([&] { prepare_dataset(opt); }), "prepare: val_fraction must be in [0, 1), got 1");
  opt.val_fraction = 0.1;
  opt.tokenizer = dir.file("nope.json");
  EXPECT_TRUE(contains(error_of([&] { prepare_dataset(opt); }), "does not exist (expected \"byte\""));
  write_text(dir.file("blank.txt"), " \n\n ");
  opt.input = dir.file("blank.txt");
  opt.tokenizer = "byte";
  EXPECT_TRUE(contains(error_of([&] { prepare_dataset(opt); }), "holds no text"));
}

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Byte tokens, with every 'x' encoded as an id its vocabulary does not have.
class FaultyTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    for (const char c : text) ids.push_back(c == 'x' ? 999 : static_cast<unsigned char>(c));
    return ids;
  }
  std::string decode(const std::vector<int32_t>&) const override { return ""; }
  int vocab_size() const override { return 257; }
  int32_t eot_token() const override { return 256; }
  std::string name() const override { return "faulty"; }
};

}  // namespace

TEST(Prepare, RefusesIdsOutsideTheVocabularyBeforeTouchingTheOutput) {
  TempDir dir;
  write_text(dir.file("good.txt"), std::string(2000, 'a'));
  write_text(dir.file("bad.txt"), "abc x abc");
  const std::string out = dir.file("data");
  prepare_dataset(dir.file("good.txt"), ByteTokenizer(), out, 0.1, 1000);
  const std::string meta = slurp(out + "/meta.json");
  EXPECT_EQ(error_of([&] { prepare_dataset(dir.file("bad.txt"), FaultyTokenizer(), out, 0.1, 1000); }),
            "prepare: tokenizer 'faulty' produced id 999 at token 5, outside its vocabulary [0, 257); nothing was written");
  EXPECT_EQ(slurp(out + "/meta.json"), meta);  // the dataset there is intact
  EXPECT_NO_THROW(DataLoader(out, "train", 2, 8, 1));
}
