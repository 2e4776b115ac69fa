// Token shards in llm.c's format, so data prepared by llm.c's scripts loads as is:
//
//   header: 256 little-endian int32
//     header[0] = 20240520 (magic)
//     header[1] = version: 1 = tokens are uint16 (llm.c), 2 = tokens are uint32
//     header[2] = number of tokens
//     header[3..255] = 0
//   body: the tokens, little-endian, 2 bytes each (version 1) or 4 bytes each (version 2)
//
// Version 2 is this engine's extension for vocabularies larger than 65536 tokens; llm.c
// itself reads only version 1. Writers choose version 1 whenever every id fits in 16 bits.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace esplag {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int kShardHeaderInts = 256;
inline constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

struct Shard {
  std::vector<int32_t> tokens;
  int version = 0;  // 1 (uint16 tokens) or 2 (uint32 tokens)
};

// Shard version needed for token ids in [0, vocab_size): 1 up to 65536 tokens, else 2.
int shard_version_for(int64_t vocab_size);

// Writes `tokens` (each in [0, vocab_size)) to `path` (via path + ".tmp" and a rename).
// Returns the version written.
int write_shard(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size);

// Reads a whole shard, checking the header against the file size and, when `vocab_size` is
// positive, every token against [0, vocab_size) (the error names the token's index, byte
// offset and id).
Shard read_shard(const std::string& path, int64_t vocab_size = 0);

// Reads only the header (checked against the file size); returns the token count.
int64_t read_shard_token_count(const std::string& path);

}  // namespace esplag
