// Token shards, the byte tokenizer and GPT-2 byte-level helpers.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/byte_level.h"
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

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// An llm.c shard built byte by byte, independently of write_shard.
std::string llmc_shard(int32_t magic, int32_t version, int32_t count, const std::vector<uint32_t>& tokens,
                       int bytes_per_token) {
  std::string s(1024, '\0');
  auto put = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) s[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
  };
  put(0, static_cast<uint32_t>(magic));
  put(4, static_cast<uint32_t>(version));
  put(8, static_cast<uint32_t>(count));
  for (const uint32_t t : tokens)
    for (int i = 0; i < bytes_per_token; ++i) s += static_cast<char>((t >> (8 * i)) & 0xff);
  return s;
}

}  // namespace

// ---- shards ----------------------------------------------------------------------------

TEST(Shard, RoundTripUint16MatchesLlmcBytes) {
  TempDir dir;
  const std::vector<int32_t> tokens = {0, 1, 255, 256, 50256, 65535, 7};
  const std::string path = dir.file("a.bin");
  EXPECT_EQ(write_shard(path, tokens, 65536), 1);
  EXPECT_EQ(std::distance(fs::directory_iterator(fs::path(path).parent_path()), {}), 1);  // no temporary left
  const std::vector<uint32_t> u(tokens.begin(), tokens.end());
  EXPECT_EQ(read_bytes(path), llmc_shard(20240520, 1, 7, u, 2));
  const Shard s = read_shard(path);
  EXPECT_EQ(s.version, 1);
  EXPECT_EQ(s.tokens, tokens);
  EXPECT_EQ(read_shard_token_count(path), 7);
}

TEST(Shard, RoundTripUint32ForLargeVocabularies) {
  TempDir dir;
  const std::vector<int32_t> tokens = {0, 65535, 65536, 99999, 123, 70000};
  const std::string path = dir.file("b.bin");
  EXPECT_EQ(write_shard(path, tokens, 100000), 2);
  const std::vector<uint32_t> u(tokens.begin(), tokens.end());
  EXPECT_EQ(read_bytes(path), llmc_shard(20240520, 2, 6, u, 4));
  const Shard s = read_shard(path);
  EXPECT_EQ(s.version, 2);
  EXPECT_EQ(s.tokens, tokens);
}

TEST(Shard, ReadsAnLlmcFileWrittenByHand) {
  TempDir dir;
  const std::string path = dir.file("tinyshakespeare_val.bin");
  write_bytes(path, llmc_shard(20240520, 1, 4, {5024, 11, 198, 50256}, 2));
  EXPECT_EQ(read_shard(path).tokens, (std::vector<int32_t>{5024, 11, 198, 50256}));
}

TEST(Shard, EmptyShardRoundTrips) {
  TempDir dir;
  write_shard(dir.file("e.bin"), std::vector<int32_t>{}, 257);
  EXPECT_EQ(fs::file_size(dir.file("e.bin")), 1024u);
  EXPECT_TRUE(read_shard(dir.file("e.bin")).tokens.empty());
}

TEST(Shard, VersionFollowsVocabulary) {
  EXPECT_EQ(shard_version_for(257), 1);
  EXPECT_EQ(shard_version_for(65536), 1);
  EXPECT_EQ(shard_version_for(65537), 2);
}

TEST(Shard, WriteRejectsTokensOutsideTheVocabulary) {
  TempDir dir;
  const std::string msg = error_of([&] { write_shard(dir.file("x.bin"), std::vector<int32_t>{1, 300, 2}, 257); });
  EXPECT_NE(msg.find("token 1 is 300, outside the vocabulary [0, 257)"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(dir.file("x.bin")));
}

TEST(Shard, ReadChecksEveryTokenAgainstTheVocabulary) {
  TempDir dir;
  const std::string v1 = dir.file("v1.bin"), v2 = dir.file("v2.bin");
  write_shard(v1, std::vector<int32_t>{1, 2, 300, 5, 400}, 65536);
  EXPECT_EQ(read_shard(v1).tokens.size(), 5u);  // no vocabulary given: any id of the format
  EXPECT_EQ(error_of([&] { read_shard(v1, 257); }),
            "shard '" + v1 + "': token 2 (byte offset 1028) is 300, outside the vocabulary [0, 257)");
  write_shard(v2, std::vector<int32_t>{7, 69999}, 70000);
  EXPECT_EQ(error_of([&] { read_shard(v2, 66000); }),
            "shard '" + v2 + "': token 1 (byte offset 1028) is 69999, outside the vocabulary [0, 66000)");
  // A version-2 id beyond int32 (the in-memory type) is refused whatever the vocabulary.
  std::ifstream in(v2, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  bytes.replace(1024 + 4, 4, std::string("\xff\xff\xff\xf0", 4));
  write_bytes(v2, bytes);
  EXPECT_EQ(error_of([&] { read_shard(v2); }),
            "shard '" + v2 + "': token 1 (byte offset 1028) is 4043309055, outside the vocabulary [0, 2147483648)");
}

TEST(Shard, MissingFile) {
  TempDir dir;
  const std::string path = dir.file("nope.bin");
  EXPECT_EQ(error_of([&] { read_shard(path); }), "shard '" + path + "' does not exist");
}

TEST(Shard, ShorterThanHeader) {
  TempDir dir;
  const std::string path = dir.file("short.bin");
  write_bytes(path, std::string(100, '\0'));
  EXPECT_EQ(error_of([&] { read_shard(path); }),
            "shard '" + path + "' is 100 bytes, shorter than the 1024-byte shard header (not a token shard?)");
}

TEST(Shard, WrongMagic) {
  TempDir dir;
  const std::string path = dir.file("magic.bin");
  write_bytes(path, llmc_shard(20240521, 1, 0, {}, 2));
  EXPECT_EQ(error_of([&] { read_shard(path); }),
            "shard '" + path +
                "' has the wrong magic number: expected 20240520, got 20240521 (not an llm.c/esplag token shard)");
}

TEST(Shard, UnknownVersion) {
  TempDir dir;
  const std::string path = dir.file("version.bin");
  write_bytes(path, llmc_shard(20240520, 3, 0, {}, 2));
  EXPECT_EQ(error_of([&] { read_shard(path); }),
            "shard '" + path + "' has unknown version 3 (expected 1 = uint16 tokens or 2 = uint32 tokens)");
}

TEST(Shard, Truncated) {
  TempDir dir;
  const std::string path = dir.file("trunc.bin");
  write_bytes(path, llmc_shard(20240520, 1, 10, {1, 2, 3, 4, 5, 6, 7}, 2));
  const std::string expected = "truncated shard '" + path + "': header says 10 tokens, file holds 7";
  EXPECT_EQ(error_of([&] { read_shard(path); }), expected);
  EXPECT_EQ(error_of([&] { read_shard_token_count(path); }), expected);
  // A partial last token counts as missing.
  write_bytes(path, llmc_shard(20240520, 2, 3, {1, 2}, 4) + "\x01\x02");
  EXPECT_EQ(error_of([&] { read_shard(path); }), "truncated shard '" + path + "': header says 3 tokens, file holds 2");
}

TEST(Shard, TrailingBytes) {
  TempDir dir;
  const std::string path = dir.file("long.bin");
  write_bytes(path, llmc_shard(20240520, 1, 2, {1, 2, 3}, 2));
  EXPECT_EQ(error_of([&] { read_shard(path); }),
            "shard '" + path + "': header says 2 tokens, file holds 3 (2 bytes after the last token)");
}

// ---- byte tokenizer --------------------------------------------------------------------

TEST(ByteTokenizer, RoundTripsEveryByteAndUtf8) {
  ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const std::string utf8 = "naïve café — 日本語 😀 \xff\xfe broken \xc3";
  for (const std::string& s : {all, utf8, std::string()}) {
    const auto ids = tok.encode(s);
    ASSERT_EQ(ids.size(), s.size());
    for (size_t i = 0; i < s.size(); ++i) EXPECT_EQ(ids[i], static_cast<unsigned char>(s[i]));
    EXPECT_EQ(tok.decode(ids), s);
  }
  EXPECT_EQ(tok.vocab_size(), 257);
  EXPECT_EQ(tok.eot_token(), 256);
  EXPECT_EQ(tok.name(), "byte");
  EXPECT_EQ(tok.decode({'h', 'i', 256}), "hi<|endoftext|>");
}

TEST(ByteTokenizer, DecodeRejectsIdsOutsideTheVocabulary) {
  ByteTokenizer tok;
  EXPECT_EQ(error_of([&] {
              tok.decode({65, 257});
            }),
            "byte tokenizer: cannot decode token id 257: the vocabulary is 0..256");
  EXPECT_THROW(tok.decode({-1}), Error);
}

TEST(LoadTokenizer, ByteSpecAndErrors) {
  EXPECT_EQ(load_tokenizer("byte")->name(), "byte");
  const std::string msg = error_of([] { load_tokenizer("/nonexistent/tok.json"); });
  EXPECT_NE(msg.find("tokenizer '/nonexistent/tok.json': file '/nonexistent/tok.json' does not exist"),
            std::string::npos)
      << msg;
}

// ---- GPT-2 byte-level conventions ------------------------------------------------------

TEST(ByteLevel, Gpt2ByteAlphabet) {
  using byte_level::byte_to_unicode;
  EXPECT_EQ(byte_to_unicode(' '), "\u0120");   // Ġ
  EXPECT_EQ(byte_to_unicode('\n'), "\u010A");  // Ċ
  EXPECT_EQ(byte_to_unicode(0), "\u0100");     // Ā
  EXPECT_EQ(byte_to_unicode(0x7f), "\u0121");  // first byte after the 33 control bytes and space
  EXPECT_EQ(byte_to_unicode(0xAD), "\u0143");  // soft hyphen, the last byte without a glyph
  EXPECT_EQ(byte_to_unicode('A'), "A");
  EXPECT_EQ(byte_to_unicode(0xE9), "\u00E9");  // é stands for itself
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  std::string back;
  ASSERT_TRUE(byte_level::decode_to_bytes(byte_level::encode_bytes(all), &back));
  EXPECT_EQ(back, all);
  EXPECT_FALSE(byte_level::decode_to_bytes("\u65e5", &back));  // 日 stands for no byte
  EXPECT_FALSE(byte_level::decode_to_bytes("\u0144", &back));  // one past the last stand-in
}

TEST(ByteLevel, PretokenizeMatchesGpt2Pattern) {
  // Expected pieces from the GPT-2 regular expression (Python `regex` module).
  using V = std::vector<std::string_view>;
  EXPECT_EQ(byte_level::pretokenize("Hello world's  test\n\n  x 123abc!!? I'll go"),
            (V{"Hello", " world", "'s", " ", " test", "\n\n ", " x", " 123", "abc", "!!?", " I", "'ll", " go"}));
  EXPECT_EQ(byte_level::pretokenize("  café naïve 日本 ok  "), (V{" ", " café", " naïve", " 日本", " ok", "  "}));
  EXPECT_EQ(byte_level::pretokenize("it''s 'Re\tx "), (V{"it", "''", "s", " '", "Re", "\t", "x", " "}));
  EXPECT_TRUE(byte_level::pretokenize("").empty());
}

TEST(ByteLevel, SafeCutsDoNotChangePretokens) {
  std::string text;
  const char* lines[] = {"In the beginning\n", "  indented line\n", "\n", "x\n", "end.\n\n", "12 34\n", "'s\n"};
  for (int i = 0; i < 400; ++i) text += lines[(i * 7 + i / 3) % 7];
  const auto whole = byte_level::pretokenize(text);
  for (const size_t target : {1, 7, 50, 300}) {
    const auto cuts = byte_level::safe_cuts(text, target);
    ASSERT_GE(cuts.size(), 2u);
    EXPECT_EQ(cuts.front(), 0u);
    EXPECT_EQ(cuts.back(), text.size());
    if (target < 100) EXPECT_GT(cuts.size(), 10u);
    std::vector<std::string_view> pieces;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      for (auto p : byte_level::pretokenize(std::string_view(text).substr(cuts[i], cuts[i + 1] - cuts[i])))
        pieces.push_back(p);
    }
    EXPECT_EQ(pieces, whole) << "target " << target;
  }
}
