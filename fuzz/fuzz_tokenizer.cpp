// The tokenizer.json loader (data/tokenizer.h) on arbitrary files, then the loaded
// tokenizer on a fixed text: ids inside the vocabulary, and decoding gives the text back
// (byte-level BPE is lossless) whenever encoding succeeds.
#include "data/tokenizer.h"
#include "fuzz_input.h"

using namespace esplag;

namespace {

// Words, spaces, digits, punctuation, UTF-8, a raw byte and an added token of GPT-2's.
const std::string kText = std::string("Hello world, it's 2024!\n  naïve café 日本 😀\t<|endoftext|>x") + '\xff';

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input(data, size, "tokenizer.json");
  std::unique_ptr<Tokenizer> tok;
  if (!fuzz::accepts([&] { tok = load_tokenizer(path); })) return 0;
  fuzz::require(tok->vocab_size() > 0, "an accepted tokenizer has an empty vocabulary");
  std::vector<int32_t> ids;
  // A vocabulary may lack bytes the text holds: that is an Error of encode, not a bug.
  if (!fuzz::accepts([&] { ids = tok->encode(kText); })) return 0;
  for (const int32_t id : ids)
    fuzz::require(id >= 0 && id < tok->vocab_size(), "encode gave an id outside the vocabulary");
  fuzz::require(tok->decode(ids) == kText, "decode(encode(text)) differs from the text");
  return 0;
}
