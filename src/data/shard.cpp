#include "data/shard.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "data/file_util.h"
#include "io/atomic_file.h"

namespace esplag {

namespace fs = std::filesystem;

namespace {

// Bytes are assembled explicitly so the on-disk order is little-endian on any host.
void put_u32(char* p, uint32_t v) {
  p[0] = static_cast<char>(v & 0xff);
  p[1] = static_cast<char>((v >> 8) & 0xff);
  p[2] = static_cast<char>((v >> 16) & 0xff);
  p[3] = static_cast<char>((v >> 24) & 0xff);
}
uint32_t get_u32(const unsigned char* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

int bytes_per_token(int version) { return version == 1 ? 2 : 4; }

struct Header {
  int version = 0;
  int64_t num_tokens = 0;
};

// Validates the header of `path` (whose size is `file_size`) and returns it.
Header check_header(const std::string& path, const unsigned char* bytes, int64_t file_size) {
  ESPLAG_CHECK(file_size >= kShardHeaderBytes, "shard '", path, "' is ", file_size, " bytes, shorter than the ",
               kShardHeaderBytes, "-byte shard header (not a token shard?)");
  const int32_t magic = static_cast<int32_t>(get_u32(bytes));
  ESPLAG_CHECK(magic == kShardMagic, "shard '", path, "' has the wrong magic number: expected ", kShardMagic, ", got ",
               magic, " (not an llm.c/esplag token shard)");
  const int32_t version = static_cast<int32_t>(get_u32(bytes + 4));
  ESPLAG_CHECK(version == 1 || version == 2, "shard '", path, "' has unknown version ", version,
               " (expected 1 = uint16 tokens or 2 = uint32 tokens)");
  const int32_t count = static_cast<int32_t>(get_u32(bytes + 8));
  ESPLAG_CHECK(count >= 0, "shard '", path, "' header gives a negative token count (", count, ")");
  const int64_t body = file_size - kShardHeaderBytes;
  const int bpt = bytes_per_token(version);
  const int64_t held = body / bpt;
  ESPLAG_CHECK(held >= count, "truncated shard '", path, "': header says ", count, " tokens, file holds ", held);
  ESPLAG_CHECK(body == int64_t(count) * bpt, "shard '", path, "': header says ", count, " tokens, file holds ", held,
               (body % bpt ? " and a partial token" : ""), " (", body - int64_t(count) * bpt,
               " bytes after the last token)");
  return {version, count};
}

}  // namespace

int shard_version_for(int64_t vocab_size) { return vocab_size <= 65536 ? 1 : 2; }

int write_shard(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size) {
  ESPLAG_CHECK(vocab_size > 0 && vocab_size <= int64_t(INT32_MAX) + 1, "write_shard '", path,
               "': vocab_size must be in [1, 2^31], got ", vocab_size);
  // The header stores the count as int32, as llm.c does.
  ESPLAG_CHECK(tokens.size() <= size_t(INT32_MAX), "write_shard '", path, "': ", tokens.size(),
               " tokens exceed the format's limit of ", INT32_MAX, " per shard");
  const int version = shard_version_for(vocab_size);
  const int bpt = bytes_per_token(version);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    ESPLAG_CHECK(t >= 0 && t < vocab_size, "write_shard '", path, "': token ", i, " is ", t,
                 ", outside the vocabulary [0, ", vocab_size, ")");
  }
  write_file_atomic(path, [&](FileSink& out) {
    char header[kShardHeaderBytes] = {};
    put_u32(header, static_cast<uint32_t>(kShardMagic));
    put_u32(header + 4, static_cast<uint32_t>(version));
    put_u32(header + 8, static_cast<uint32_t>(tokens.size()));
    out.write(header, sizeof header);
    // Streamed in blocks, so a shard of any size needs only a small buffer.
    constexpr size_t kBlock = size_t(1) << 16;
    std::string buf(kBlock * bpt, '\0');
    for (size_t begin = 0; begin < tokens.size(); begin += kBlock) {
      const size_t n = std::min(kBlock, tokens.size() - begin);
      char* p = buf.data();
      for (size_t i = 0; i < n; ++i) {
        const uint32_t t = static_cast<uint32_t>(tokens[begin + i]);
        if (version == 1) {
          p[2 * i] = static_cast<char>(t & 0xff);
          p[2 * i + 1] = static_cast<char>((t >> 8) & 0xff);
        } else {
          put_u32(p + 4 * i, t);
        }
      }
      out.write(buf.data(), n * bpt);
    }
  });
  return version;
}

Shard read_shard(const std::string& path, int64_t vocab_size) {
  const std::string bytes = data_files::read_all(path, "shard");
  const auto* u = reinterpret_cast<const unsigned char*>(bytes.data());
  const Header h = check_header(path, u, static_cast<int64_t>(bytes.size()));
  Shard s;
  s.version = h.version;
  s.tokens.resize(h.num_tokens);
  const unsigned char* p = u + kShardHeaderBytes;
  // Ids above INT32_MAX (version 2) read as negative: one scan below finds them with the rest.
  if (h.version == 1) {
    for (int64_t i = 0; i < h.num_tokens; ++i) s.tokens[i] = int32_t(p[2 * i]) | (int32_t(p[2 * i + 1]) << 8);
  } else {
    for (int64_t i = 0; i < h.num_tokens; ++i) s.tokens[i] = static_cast<int32_t>(get_u32(p + 4 * i));
  }
  const int64_t largest = int64_t(INT32_MAX) + 1;  // ids are int32 in memory
  const int64_t vocab = vocab_size > 0 ? std::min(vocab_size, largest) : largest;
  const auto limit = static_cast<uint32_t>(vocab);
  // A branch-free pass (it vectorises) over the whole shard, then a search only on failure.
  uint32_t top = 0;
  for (const int32_t t : s.tokens) top = std::max(top, static_cast<uint32_t>(t));
  if (top >= limit) {
    const auto bad = std::find_if(s.tokens.begin(), s.tokens.end(), [&](int32_t t) { return uint32_t(t) >= limit; });
    const int64_t i = bad - s.tokens.begin();
    const uint32_t id = h.version == 1 ? uint32_t(*bad) : get_u32(p + 4 * i);
    fail("shard '", path, "': token ", i, " (byte offset ", kShardHeaderBytes + i * bytes_per_token(h.version), ") is ",
         id, ", outside the vocabulary [0, ", vocab, ")");
  }
  return s;
}

int64_t read_shard_token_count(const std::string& path) {
  std::error_code ec;
  ESPLAG_CHECK(fs::exists(path, ec), "shard '", path, "' does not exist");
  const auto size = fs::file_size(path, ec);
  ESPLAG_CHECK(!ec, "cannot read the size of shard '", path, "': ", ec.message());
  std::array<unsigned char, kShardHeaderBytes> header{};
  std::FILE* f = std::fopen(path.c_str(), "rb");
  ESPLAG_CHECK(f != nullptr, "cannot open shard '", path, "'");
  const size_t n = std::fread(header.data(), 1, header.size(), f);
  std::fclose(f);
  (void)n;  // a short read means a short file, which check_header reports from the size
  return check_header(path, header.data(), static_cast<int64_t>(size)).num_tokens;
}

}  // namespace esplag
