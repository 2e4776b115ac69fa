#include "data/loader.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/rng.h"
#include "data/prepare.h"
#include "data/shard.h"

namespace esplag {

namespace fs = std::filesystem;

namespace {

bool belongs_to_split(const std::string& stem, const std::string& split) {
  if (stem == split || stem.rfind(split + "_", 0) == 0) return true;
  const std::string mid = "_" + split;
  for (size_t p = stem.find(mid); p != std::string::npos; p = stem.find(mid, p + 1)) {
    const size_t after = p + mid.size();
    if (after == stem.size() || stem[after] == '_') return true;
  }
  return false;
}

// Shell-style match of `name` against `pattern` with * and ?.
bool wildcard_match(const char* pattern, const char* name) {
  const char *star = nullptr, *resume = nullptr;
  while (*name) {
    if (*pattern == '?' || *pattern == *name) {
      ++pattern, ++name;
    } else if (*pattern == '*') {
      star = pattern++;
      resume = name;
    } else if (star) {
      pattern = star + 1;
      name = ++resume;
    } else {
      return false;
    }
  }
  while (*pattern == '*') ++pattern;
  return *pattern == '\0';
}

}  // namespace

std::vector<std::string> find_shards(const std::string& dir_or_glob, const std::string& split) {
  std::vector<std::string> out;
  std::error_code ec;
  const fs::path p(dir_or_glob);
  const std::string last = p.filename().string();
  if (last.find_first_of("*?") != std::string::npos) {
    const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
    ESPLAG_CHECK(dir.string().find_first_of("*?") == std::string::npos, "data path '", dir_or_glob,
                 "': wildcards are supported only in the last path component");
    ESPLAG_CHECK(fs::is_directory(dir, ec), "data path '", dir_or_glob, "': directory '", dir.string(),
                 "' does not exist");
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string name = e.path().filename().string();
      if (e.is_regular_file() && wildcard_match(last.c_str(), name.c_str()) &&
          belongs_to_split(e.path().stem().string(), split))
        out.push_back(e.path().string());
    }
  } else if (fs::is_directory(p, ec)) {
    for (const auto& e : fs::directory_iterator(p)) {
      if (e.is_regular_file() && e.path().extension() == ".bin" && belongs_to_split(e.path().stem().string(), split))
        out.push_back(e.path().string());
    }
  } else if (fs::is_regular_file(p, ec)) {
    out.push_back(p.string());
  } else {
    fail("data path '", dir_or_glob, "' does not exist (expected a directory written by `esplag data prepare`, ",
         "a shard file, or a pattern such as dir/*.bin)");
  }
  std::sort(out.begin(), out.end());
  return out;
}

DataLoader::DataLoader(const std::string& dir_or_glob, const std::string& split, int batch_size, int seq_len,
                       uint64_t seed, int64_t vocab_size)
    : source_(dir_or_glob),
      split_(split),
      batch_size_(batch_size),
      seq_len_(seq_len),
      seed_(seed),
      shuffle_(split == "train") {
  ESPLAG_CHECK(batch_size > 0 && seq_len > 0, "data loader for '", dir_or_glob, "': batch size and sequence length ",
               "must be positive, got B=", batch_size, " T=", seq_len);
  shards_ = find_shards(dir_or_glob, split);
  ESPLAG_CHECK(!shards_.empty(), "no '", split, "' shards found in '", dir_or_glob, "' (expected files such as ", split,
               "_000000.bin; prepare data with `esplag data prepare`)");
  if (vocab_size == 0) {
    const fs::path dir = fs::path(shards_.front()).parent_path();
    if (fs::exists(dir / "meta.json")) vocab_size = read_dataset_meta(dir.string()).vocab_size;
  }
  const int64_t window = int64_t(seq_len) + 1;
  for (const auto& path : shards_) {
    Shard s = read_shard(path, vocab_size);
    const int64_t base = static_cast<int64_t>(tokens_.size());
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    for (int64_t w = 0; w + window <= n; w += window) window_start_.push_back(base + w);
    for (const int32_t t : s.tokens) max_token_ = std::max(max_token_, t);
    tokens_.insert(tokens_.end(), s.tokens.begin(), s.tokens.end());
  }
  const int64_t need = int64_t(batch_size) * window;
  ESPLAG_CHECK(num_windows() >= batch_size, "split '", split, "' of '", dir_or_glob, "' holds ", num_tokens(),
               " tokens in ", shards_.size(), " shard(s) (", num_windows(), " windows of T+1 = ", window,
               "), a batch needs B*(T+1) = ", batch_size, "*", window, " = ", need,
               " tokens (B whole windows within shards)");
  ESPLAG_CHECK(num_windows() <= int64_t(UINT32_MAX), "split '", split, "' of '", dir_or_glob, "' has ", num_windows(),
               " windows, more than the loader's limit of ", UINT32_MAX);
  build_order();
}

std::vector<uint32_t> DataLoader::epoch_order(int64_t epoch) const {
  const uint32_t n = static_cast<uint32_t>(num_windows());
  std::vector<uint32_t> order(n);
  for (uint32_t i = 0; i < n; ++i) order[i] = i;
  if (shuffle_) {
    Rng rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch));
    for (uint32_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  }
  return order;
}

void DataLoader::build_order() {
  if (order_epoch_ == state_.epoch) return;
  if (!shuffle_ && !order_.empty()) {  // the same order every epoch
    order_epoch_ = state_.epoch;
    return;
  }
  order_ = epoch_order(state_.epoch);
  order_epoch_ = state_.epoch;
}

void DataLoader::set_state(const State& s) {
  ESPLAG_CHECK(s.epoch >= 0 && s.position >= 0 && s.position < num_windows(), "data loader for split '", split_,
               "' of '", source_, "': state (epoch ", s.epoch, ", position ", s.position,
               ") does not fit this data, which has ", num_windows(), " windows per epoch");
  state_ = s;
  build_order();
}

void DataLoader::next_batch(int32_t* inputs, int32_t* targets) {
  const size_t T = static_cast<size_t>(seq_len_);
  for (int b = 0; b < batch_size_; ++b) {
    const int32_t* w = tokens_.data() + window_start_[order_[state_.position]];
    std::memcpy(inputs + b * T, w, T * sizeof(int32_t));
    std::memcpy(targets + b * T, w + 1, T * sizeof(int32_t));
    if (++state_.position == num_windows()) {
      state_.position = 0;
      ++state_.epoch;
      build_order();
    }
  }
}

void DataLoader::skip_batches(int64_t n) {
  ESPLAG_CHECK(n >= 0, "DataLoader::skip_batches: negative count ", n);
  const int64_t windows = state_.position + n * batch_size_;
  state_.epoch += windows / num_windows();
  state_.position = windows % num_windows();
  build_order();
}

}  // namespace esplag
