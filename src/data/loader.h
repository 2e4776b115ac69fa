// Batches of (inputs, targets) from token shards.
//
// The shards of one split are cut into non-overlapping windows of T+1 tokens (a window
// never spans two shards; a shard's tail shorter than T+1 is unused). A window gives one
// row of a batch: inputs are its first T tokens, targets the same shifted by one.
//
// Windows are visited in epochs: every window exactly once per epoch, batches running on
// from one epoch into the next without dropping any. The training split is visited in a
// shuffled order, a pure function of (seed, epoch): a Fisher-Yates shuffle driven by
// Rng(seed * 0x9E3779B97F4A7C15 + epoch). Every other split ("val", "test") is visited in
// file order, without shuffling. State {epoch, position} is all a resumed run needs to
// continue with exactly the batches the uninterrupted run would have seen.
//
// Which files belong to a split: given a directory, its *.bin files whose name (without
// .bin) is SPLIT, starts with "SPLIT_", or contains "_SPLIT" followed by "_" or the end
// (train_000000.bin, tinyshakespeare_val.bin, fineweb_train_000001.bin); given a pattern
// with * or ? in its last component, the matching files that belong to the split; given a
// single file, that file. Files are read in name order.
//
// Opening reads every shard whole and checks every token id against the vocabulary: the
// one given, else the meta.json of the directory holding the shards (what `esplag data
// prepare` writes), else only that ids fit an int32. A bad id is an error naming the shard,
// the token's byte offset and the id, before any batch is made (docs/config.md, "data", gives the cost).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace esplag {

class DataLoader {
 public:
  struct State {
    int64_t epoch = 0;
    int64_t position = 0;  // windows already taken in this epoch
  };

  // `vocab_size` 0: the vocabulary of the shards' meta.json, where there is one.
  DataLoader(const std::string& dir_or_glob, const std::string& split, int batch_size, int seq_len, uint64_t seed,
             int64_t vocab_size = 0);

  // Fills inputs[B*T] and targets[B*T] (row-major, row b = one window) and advances.
  void next_batch(int32_t* inputs, int32_t* targets);
  // Advances past n batches as n calls of next_batch would, without reading them (a
  // data-parallel rank skips the other ranks' micro-batches).
  void skip_batches(int64_t n);

  State state() const { return state_; }
  void set_state(const State& s);  // Throws if the state does not fit this data.
  void reset() { set_state({}); }  // back to the first batch of epoch 0

  int64_t num_batches() const { return num_windows() / batch_size_; }  // whole batches per epoch
  int64_t num_windows() const { return static_cast<int64_t>(window_start_.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int32_t max_token() const { return max_token_; }  // largest id in the split
  bool shuffled() const { return shuffle_; }
  const std::vector<std::string>& shard_paths() const { return shards_; }

  // The order in which epoch `epoch` visits the windows (indices into file order).
  std::vector<uint32_t> epoch_order(int64_t epoch) const;

 private:
  void build_order();

  std::string source_, split_;
  int batch_size_, seq_len_;
  uint64_t seed_;
  bool shuffle_;
  std::vector<std::string> shards_;
  std::vector<int32_t> tokens_;        // all shards, concatenated
  std::vector<int64_t> window_start_;  // offset into tokens_ of each window, file order
  int32_t max_token_ = -1;
  State state_{};
  int64_t order_epoch_ = -1;
  std::vector<uint32_t> order_;
};

// The shard files of `split` under `dir_or_glob`, sorted by name (see above).
std::vector<std::string> find_shards(const std::string& dir_or_glob, const std::string& split);

}  // namespace esplag
