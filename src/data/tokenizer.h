// Tokenizers: text <-> token ids.
//
//   ByteTokenizer  ids 0..255 are the bytes, 256 is end-of-text; vocabulary 257.
//   BpeTokenizer   GPT-2-style byte-level BPE loaded from a Hugging Face tokenizer.json.
//
// load_tokenizer(spec) picks one from a spec string: "byte", a path to a tokenizer.json,
// or a directory holding one. The spec is what datasets and checkpoints record.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace esplag {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Safe to call from several threads at once.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Throws for an id outside the vocabulary.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int vocab_size() const = 0;
  // The end-of-text id, or -1 when the vocabulary has none.
  virtual int32_t eot_token() const = 0;
  // A spec that load_tokenizer() turns back into this tokenizer ("byte" or a path).
  virtual std::string name() const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kEot = 256;
  std::vector<int32_t> encode(std::string_view text) const override;
  // End-of-text decodes to "<|endoftext|>".
  std::string decode(const std::vector<int32_t>& ids) const override;
  int vocab_size() const override { return 257; }
  int32_t eot_token() const override { return kEot; }
  std::string name() const override { return "byte"; }
};

// Byte-level BPE as GPT-2 defines it, read from a Hugging Face tokenizer.json:
//   model.type "BPE", model.vocab {token: id}, model.merges as "a b" strings or [a, b]
//   pairs (rank = position in the list), added_tokens (matched literally in the input
//   before pre-tokenisation, as Hugging Face does, and decoded to their content).
// Pre-tokenisation is always the GPT-2 pattern (see byte_level.h for the approximation
// of its Unicode classes); within a pre-token the applicable merge of lowest rank is
// applied first (leftmost first among equal ranks) until none applies. Supported options:
// pre_tokenizer ByteLevel (alone or in a Sequence) with add_prefix_space, model
// ignore_merges. A normalizer, a subword prefix/suffix or a non-byte-level vocabulary is
// rejected with an Error rather than silently tokenised differently.
class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(const std::string& tokenizer_json_path);
  ~BpeTokenizer() override;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int vocab_size() const override { return vocab_size_; }
  int32_t eot_token() const override { return eot_; }
  std::string name() const override { return path_; }

  int num_merges() const { return num_merges_; }
  // Id of the token whose raw bytes are `bytes` (added tokens: their content), or -1.
  int32_t token_id(std::string_view bytes) const;

 private:
  void load(const std::string& json_text);
  // The id tables (id_bytes_, id_valid_, added_, bytes_to_id_, byte_id_) from the vocabulary
  // and the added tokens, refusing clashes.
  void build_id_tables(const std::unordered_map<std::string, int32_t>& vocab,
                       const std::unordered_map<int32_t, std::string>& added_by_id);
  void encode_segment(std::string_view text, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  std::vector<int32_t> merge_word(std::string_view word) const;

  std::string path_;
  int vocab_size_ = 0;
  int num_merges_ = 0;
  int32_t eot_ = -1;
  bool add_prefix_space_ = false;
  bool ignore_merges_ = false;
  std::vector<std::string> id_bytes_;  // raw bytes of each id
  std::vector<char> id_valid_;         // ids may have holes
  std::unordered_map<std::string, int32_t> bytes_to_id_;
  std::array<int32_t, 256> byte_id_{};  // id of each single byte, -1 if the vocab lacks it
  struct Merge {
    int32_t rank, result;
  };
  std::unordered_map<uint64_t, Merge> merges_;          // (left << 32 | right) -> merge
  std::vector<std::pair<std::string, int32_t>> added_;  // content, id; longest first

  // Per-word cache, split into independently locked parts so parallel encoders rarely wait.
  struct CachePart;
  static constexpr int kCacheParts = 16;
  std::unique_ptr<CachePart[]> cache_;
};

// "byte" -> ByteTokenizer; a tokenizer.json path, or a directory holding tokenizer.json,
// -> BpeTokenizer (name() is then the file's absolute path).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

}  // namespace esplag
