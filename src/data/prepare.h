// Turning a text file into token shards that DataLoader reads.
//
//   OUT/train_000000.bin, train_000001.bin, ...   the first (1 - val_fraction) of the tokens
//   OUT/val_000000.bin, ...                        the last val_fraction of the tokens
//   OUT/meta.json                                  tokenizer spec, vocabulary, counts, shards
//   OUT/tokenizer.json                             a copy of the BPE tokenizer (BPE only)
//
// Documents: the input is cut at every occurrence of `separator` (default
// "<|endoftext|>", so a plain text file is one document; "\n\n" makes each blank-line
// separated paragraph a document). The separators are dropped, documents holding only
// whitespace are skipped, and when the tokenizer has an end-of-text token it is written
// before every document (as llm.c does), so each document starts right after one.
// The split is by token position, so no validation token ever appears in training data.
// meta.json is written last: a directory with meta.json holds a complete dataset.
#pragma once
#include <cstdint>
#include <string>

#include "data/progress.h"
#include "data/tokenizer.h"

namespace esplag {

struct PrepareOptions {
  std::string input;  // text file
  std::string out_dir;
  std::string tokenizer = "byte";  // "byte" or a tokenizer.json path
  double val_fraction = 0.05;      // in [0, 1)
  int64_t shard_tokens = 100'000'000;
  std::string separator = "<|endoftext|>";  // empty: the whole file is one document
};

struct PrepareResult {
  int64_t train_tokens = 0, val_tokens = 0;
  int64_t documents = 0;
  int train_shards = 0, val_shards = 0;
  int vocab_size = 0;
  std::string tokenizer;  // the spec recorded in meta.json
};

PrepareResult prepare_dataset(const PrepareOptions& options, const ProgressFn& progress = {});

// What a dataset's meta.json says about its tokens.
struct DatasetMeta {
  int vocab_size = 0;
  std::string tokenizer;
};
// Reads DIR/meta.json; an Error naming the file when it is missing or malformed.
DatasetMeta read_dataset_meta(const std::string& dir);

// The same with a tokenizer already loaded; meta.json records tokenizer.name().
PrepareResult prepare_dataset(const std::string& input_text_path, const Tokenizer& tokenizer,
                              const std::string& out_dir, double val_fraction, int64_t shard_tokens,
                              const ProgressFn& progress = {}, const std::string& separator = "<|endoftext|>");

}  // namespace esplag
