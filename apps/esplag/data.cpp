// esplag data prepare and esplag tokenizer train: a text file to token shards, and a BPE
// vocabulary learned from a text file.
#include <chrono>
#include <cstdio>

#include "commands.h"
#include "data/bpe_trainer.h"
#include "data/prepare.h"
#include "io/atomic_file.h"

namespace esplag::cli {

namespace {

int data_prepare(const Args& a) {
  PrepareOptions opt;
  opt.input = a.get("input");
  opt.out_dir = a.get("out");
  opt.tokenizer = a.get("tokenizer");
  opt.val_fraction = a.number("val-fraction");
  opt.shard_tokens = a.integer("shard-tokens");
  const PrepareResult r = prepare_dataset(opt, print_line);
  std::printf("prepared %s: %lld train tokens, %lld val tokens, vocab %d\n", opt.out_dir.c_str(),
              static_cast<long long>(r.train_tokens), static_cast<long long>(r.val_tokens), r.vocab_size);
  return 0;
}

int tokenizer_train(const Args& a) {
  const std::string text = read_file(a.get("input"));
  const int asked = a.int32("vocab-size");
  const std::string out = a.get("out");
  const auto t0 = std::chrono::steady_clock::now();
  const BpeModel bpe = train_bpe(text, asked, print_line);
  save_tokenizer_json(out, bpe);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("wrote %s: vocabulary %d (%zu merges) in %.1f s\n", out.c_str(), bpe.vocab_size(), bpe.merges.size(), s);
  if (bpe.vocab_size() < asked)
    std::printf("note: %d tokens fewer than the %d asked for: %s\n", asked - bpe.vocab_size(), asked,
                text.empty() ? "the input is empty"
                             : "no pair of adjacent tokens occurs twice more in the input (a larger corpus has more)");
  return 0;
}

}  // namespace

const Command kDataPrepare = {
    "data prepare",
    "tokenize a text file into train and validation shards",
    "The shards and meta.json are described in docs/data.md.",
    {
        Option::text("input", "TEXT", "", "the text file").mandatory(),
        Option::text("out", "DIR", "", "the dataset directory to write").mandatory(),
        Option::text("tokenizer", "byte|TOKENIZER.json", "byte", "bytes as tokens, or a tokenizer.json"),
        Option::number("val-fraction", "0.05", 0, 1, "fraction of the tokens kept for validation").below_max(),
        Option::integer("shard-tokens", "100000000", 1, kIntMax, "tokens per shard file"),
    },
    data_prepare,
};

const Command kTokenizerTrain = {
    "tokenizer train",
    "learn a byte-level BPE vocabulary from a text file",
    "The vocabulary is the 256 bytes, the merges learned, then <|endoftext|>; learning stops early when no pair\n"
    "of adjacent tokens occurs at least twice (the vocabulary written is then smaller, and the output says so).",
    {
        Option::text("input", "TEXT", "", "the text file").mandatory(),
        Option::integer("vocab-size", "", 257, kIntMax, "tokens in the vocabulary (256 bytes + merges + 1)")
            .mandatory(),
        Option::text("out", "TOKENIZER.json", "", "the Hugging Face tokenizer.json to write").mandatory(),
    },
    tokenizer_train,
};

}  // namespace esplag::cli
