// Learning a byte-level BPE vocabulary from a corpus (the GPT-2 recipe).
//
// The vocabulary is the 256 single bytes (id = byte value), then one token per merge in
// the order learned, then "<|endoftext|>" as the last id. Text is pre-tokenised with the
// GPT-2 pattern (byte_level.h) so merges never cross pre-token boundaries; occurrences of
// "<|endoftext|>" in the corpus are cut out and never merged into. Each step merges the
// most frequent adjacent pair, counted over the unique pre-tokens weighted by how often
// they occur; ties go to the pair with the smaller (left id, right id). Counts are kept
// up to date incrementally, touching only the words that contain the merged pair.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/progress.h"

namespace esplag {

struct BpeModel {
  struct Merge {
    int32_t left, right, result;
  };
  std::vector<std::string> tokens;  // raw bytes of each id
  std::vector<Merge> merges;        // in rank order
  int32_t eot_token = -1;           // id of "<|endoftext|>" (its bytes are that text)
  int vocab_size() const { return static_cast<int>(tokens.size()); }
};

// Learns merges until the vocabulary (bytes + merges + end-of-text) holds `vocab_size`
// tokens, or stops earlier when no pair occurs at least `min_frequency` times.
// vocab_size must be at least 257. A merge whose bytes already form a token reuses its id
// (possible when different pairs spell the same string), so merges.size() can exceed
// vocab_size - 257.
BpeModel train_bpe(std::string_view text, int vocab_size, const ProgressFn& progress = {}, int64_t min_frequency = 2);

// Writes `model` as a Hugging Face tokenizer.json (model.type BPE, vocab, merges as "a b"
// strings, added_tokens with <|endoftext|>, ByteLevel pre_tokenizer and decoder), which
// BpeTokenizer and the Hugging Face `tokenizers` library load.
void save_tokenizer_json(const std::string& path, const BpeModel& model);

}  // namespace esplag
