// The token-shard reader (data/shard.h) on arbitrary files: the header-only count and the
// full read agree, and an accepted shard writes back and reads again to the same tokens.
#include <algorithm>

#include "data/shard.h"
#include "fuzz_input.h"

using namespace esplag;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input(data, size, "input.bin");
  int64_t count = -1;
  const bool count_ok = fuzz::accepts([&] { count = read_shard_token_count(path); });
  Shard shard;
  const bool read_ok = fuzz::accepts([&] { shard = read_shard(path); });
  // The count checks only the header, the read also checks every token (ids fit int32).
  fuzz::require(count_ok || !read_ok, "read_shard accepts a shard whose header read_shard_token_count refuses");
  if (!read_ok) return 0;
  fuzz::require(count == static_cast<int64_t>(shard.tokens.size()), "the header's count differs from the tokens read");

  int64_t vocab = 1;
  for (const int32_t t : shard.tokens) vocab = std::max<int64_t>(vocab, int64_t(t) + 1);
  const std::string copy = (fuzz::scratch_dir() / "copy.bin").string();
  write_shard(copy, shard.tokens, vocab);  // an Error here is a bug: it escapes
  fuzz::require(read_shard(copy).tokens == shard.tokens, "tokens changed through write and read");
  return 0;
}
