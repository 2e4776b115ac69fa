// Incremental generation on the CPU: a key/value cache and a forward that runs only the new
// positions of each sequence against it, so a token costs one position's work (plus its
// attention over the cache) instead of the whole context's. It is the reference the GPU
// generator is tested against: the logits it returns are those Transformer<float>'s full
// forward gives at the same positions, through the model's own parameters and Linear layers
// (sparse kinds included).
//
//   Generator gen(model);
//   std::vector<float> logits = gen.prefill({{1, 2, 3}, {4, 5}});  // [2, vocab]: positions 2 and 1
//   logits = gen.decode_step({7, 8});                                // [2, vocab]: positions 3 and 2
//
// Sequences of a batch are independent: each has its own length, there is no padding, and
// a sequence's logits do not depend on the others (the layers' products are row by row
// bit-identical whatever the batch). Positions do not slide: appending past the model's
// max_seq_len is an Error, so callers stop there.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/transformer.h"

namespace esplag {

// Keys (after RoPE) and values of every layer for a batch of sequences, n_kv_head · head_dim
// floats per position (grouped-query models keep only their key/value heads).
class KvCache {
 public:
  KvCache(const ModelConfig& config, int batch);

  int batch() const { return static_cast<int>(length_.size()); }
  int row_size() const { return row_; }
  int max_length() const { return max_length_; }
  // Positions sequence b holds.
  int length(int b) const { return length_.at(b); }
  // Makes room for n more positions of sequence b in every layer; Error past max_length().
  void grow(int b, int n);
  // The key / value row of position pos (< length(b)) of sequence b in layer l.
  float* key(int l, int b, int pos) { return slot(k_, l, b, pos); }
  float* value(int l, int b, int pos) { return slot(v_, l, b, pos); }
  const float* key(int l, int b, int pos) const { return const_cast<KvCache*>(this)->key(l, b, pos); }
  const float* value(int l, int b, int pos) const { return const_cast<KvCache*>(this)->value(l, b, pos); }

 private:
  float* slot(std::vector<std::vector<float>>& kv, int l, int b, int pos);

  int n_layer_, row_, max_length_;
  std::vector<int> length_;
  std::vector<std::vector<float>> k_, v_;  // [layer · batch + b]: length(b) rows each
};

class Generator {
 public:
  // The model is read only, but Linear::forward is not const (kinds keep scratch buffers),
  // hence the non-const reference. It must outlive the generator.
  explicit Generator(Transformer<float>& model);

  // Starts a new batch: one sequence per prompt (each non-empty, at most max_seq_len ids),
  // and returns the logits of each prompt's last position, [prompts.size(), vocab_size].
  std::vector<float> prefill(const std::vector<std::vector<int32_t>>& prompts);
  // Appends next_ids[b] to sequence b and returns the logits at its new last position,
  // [batch, vocab_size]. A negative id leaves sequence b as it is (a sequence that has
  // finished) and its row of logits zero.
  std::vector<float> decode_step(const std::vector<int32_t>& next_ids);

  const KvCache& cache() const { return cache_; }

 private:
  // Runs tokens[b] at the next positions of sequence b (none: skipped) and returns the
  // logits of each sequence's last new position (zero rows for skipped sequences).
  std::vector<float> append(const std::vector<std::vector<int32_t>>& tokens);

  Transformer<float>& model_;
  KvCache cache_;
};

}  // namespace esplag
