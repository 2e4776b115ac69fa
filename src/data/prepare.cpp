#include "data/prepare.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/parallel.h"
#include "data/byte_level.h"
#include "data/file_util.h"
#include "io/atomic_file.h"
#include "io/json.h"
#include "data/shard.h"

namespace esplag {

namespace fs = std::filesystem;

namespace {

bool only_whitespace(std::string_view s) {
  for (const char c : s)
    if (!(c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r')) return false;
  return true;
}

// Shards this function writes: train_NNNNNN.bin / val_NNNNNN.bin (and temporaries of them
// that an interrupted run left behind).
bool is_our_shard(const std::string& name) {
  for (const std::string prefix : {"train_", "val_"}) {
    if (name.rfind(prefix, 0) != 0) continue;
    size_t i = prefix.size(), digits = 0;
    while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i, ++digits;
    const std::string rest = name.substr(i);
    if (digits == 6 && (rest == ".bin" || rest.rfind(".bin.tmp", 0) == 0)) return true;
  }
  return false;
}

std::string shard_name(const std::string& split, int index) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s_%06d.bin", split.c_str(), index);
  return buf;
}

}  // namespace

PrepareResult prepare_dataset(const std::string& input_text_path, const Tokenizer& tokenizer,
                              const std::string& out_dir, double val_fraction, int64_t shard_tokens,
                              const ProgressFn& progress, const std::string& separator) {
  auto report = [&](const std::string& s) {
    if (progress) progress(s);
  };
  ESPLAG_CHECK(val_fraction >= 0 && val_fraction < 1, "prepare: val_fraction must be in [0, 1), got ", val_fraction);
  ESPLAG_CHECK(shard_tokens > 0 && shard_tokens <= INT32_MAX, "prepare: shard_tokens must be in [1, ", INT32_MAX,
               "], got ", shard_tokens);
  ESPLAG_CHECK(!out_dir.empty(), "prepare: no output directory given");
  const auto t0 = std::chrono::steady_clock::now();
  const std::string text = data_files::read_all(input_text_path, "input text");

  // Documents, then pieces of documents cut where tokenising piecewise is exact.
  std::vector<std::string_view> docs;
  const std::string_view all(text);
  if (separator.empty()) {
    if (!only_whitespace(all)) docs.push_back(all);
  } else {
    size_t pos = 0;
    while (pos <= all.size()) {
      size_t end = all.find(separator, pos);
      if (end == std::string_view::npos) end = all.size();
      const std::string_view doc = all.substr(pos, end - pos);
      if (!only_whitespace(doc)) docs.push_back(doc);
      pos = end + separator.size();
    }
  }
  ESPLAG_CHECK(!docs.empty(), "prepare: input text '", input_text_path, "' holds no text (", text.size(), " bytes)");
  struct Piece {
    std::string_view text;
    bool starts_document;
  };
  std::vector<Piece> pieces;
  const size_t target = std::max<size_t>(size_t(1) << 20, text.size() / (4 * size_t(num_threads())) + 1);
  for (const auto doc : docs) {
    const auto cuts = byte_level::safe_cuts(doc, target);
    for (size_t i = 0; i + 1 < cuts.size(); ++i) pieces.push_back({doc.substr(cuts[i], cuts[i + 1] - cuts[i]), i == 0});
  }
  report("prepare: " + std::to_string(text.size()) + " bytes, " + std::to_string(docs.size()) +
         " document(s), tokenizing with '" + tokenizer.name() + "' (vocabulary " +
         std::to_string(tokenizer.vocab_size()) + ")");

  std::vector<std::vector<int32_t>> encoded(pieces.size());
  parallel_for(static_cast<int64_t>(pieces.size()), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) encoded[i] = tokenizer.encode(pieces[i].text);
  });
  const int32_t eot = tokenizer.eot_token();
  std::vector<int32_t> tokens;
  {
    size_t total = 0;
    for (const auto& e : encoded) total += e.size() + 1;
    tokens.reserve(total);
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].starts_document && eot >= 0) tokens.push_back(eot);
    tokens.insert(tokens.end(), encoded[i].begin(), encoded[i].end());
    std::vector<int32_t>().swap(encoded[i]);
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  // Checked before anything in out_dir is touched, so a faulty tokenizer costs no dataset.
  const int64_t vocab = tokenizer.vocab_size();
  const auto bad = std::find_if(tokens.begin(), tokens.end(), [&](int32_t t) { return t < 0 || t >= vocab; });
  ESPLAG_CHECK(bad == tokens.end(), "prepare: tokenizer '", tokenizer.name(), "' produced id ", *bad, " at token ",
               bad - tokens.begin(), ", outside its vocabulary [0, ", vocab, "); nothing was written");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  char line[160];
  std::snprintf(line, sizeof line, "prepare: %lld tokens (%.3f per byte) in %.1f s", static_cast<long long>(n),
                double(n) / double(std::max<size_t>(text.size(), 1)), secs);
  report(line);

  const int64_t val_tokens = std::llround(double(n) * val_fraction);
  const int64_t train_tokens = n - val_tokens;
  ESPLAG_CHECK(train_tokens > 0, "prepare: '", input_text_path, "' gives ", n,
               " tokens, none left for training with val_fraction ", val_fraction);

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  ESPLAG_CHECK(!ec && fs::is_directory(out_dir), "prepare: cannot create output directory '", out_dir,
               "': ", ec ? ec.message() : "not a directory");
  // An older, larger dataset here must not leave shards behind for the loader to pick up.
  fs::remove(fs::path(out_dir) / "meta.json", ec);
  for (const auto& entry : fs::directory_iterator(out_dir)) {
    if (entry.is_regular_file() && is_our_shard(entry.path().filename().string())) fs::remove(entry.path(), ec);
  }

  PrepareResult r;
  r.vocab_size = tokenizer.vocab_size();
  r.tokenizer = tokenizer.name();
  r.documents = static_cast<int64_t>(docs.size());
  r.train_tokens = train_tokens;
  r.val_tokens = val_tokens;
  nlohmann::ordered_json train_list = nlohmann::ordered_json::array(), val_list = nlohmann::ordered_json::array();
  int version = shard_version_for(r.vocab_size);
  auto write_split = [&](const std::string& split, int64_t begin, int64_t end, nlohmann::ordered_json& list) {
    int index = 0;
    int64_t pos = begin;
    do {  // at least one shard, even an empty one, so the split exists
      const int64_t stop = std::min(end, pos + shard_tokens);
      const std::string name = shard_name(split, index++);
      version = write_shard((fs::path(out_dir) / name).string(),
                            std::span<const int32_t>(tokens.data() + pos, size_t(stop - pos)), r.vocab_size);
      report("prepare: wrote " + name + " (" + std::to_string(stop - pos) + " tokens)");
      list.push_back(name);
      pos = stop;
    } while (pos < end);
    return index;
  };
  r.train_shards = write_split("train", 0, train_tokens, train_list);
  r.val_shards = write_split("val", train_tokens, n, val_list);

  if (r.tokenizer != "byte" && fs::is_regular_file(r.tokenizer)) {
    const fs::path copy = fs::path(out_dir) / "tokenizer.json";
    if (!fs::exists(copy) || !fs::equivalent(copy, r.tokenizer))
      write_file_atomic(copy.string(), data_files::read_all(r.tokenizer, "tokenizer file"));
  }

  nlohmann::ordered_json meta;
  meta["format"] = "esplag-token-shards";
  meta["tokenizer"] = r.tokenizer;
  meta["vocab_size"] = r.vocab_size;
  meta["eot_token"] = eot;
  meta["shard_version"] = version;
  meta["source"] = fs::absolute(input_text_path).lexically_normal().string();
  meta["source_bytes"] = text.size();
  meta["separator"] = separator;
  meta["documents"] = r.documents;
  meta["val_fraction"] = val_fraction;
  meta["train_tokens"] = r.train_tokens;
  meta["val_tokens"] = r.val_tokens;
  meta["train_shards"] = std::move(train_list);
  meta["val_shards"] = std::move(val_list);
  write_file_atomic((fs::path(out_dir) / "meta.json").string(), meta.dump(2) + "\n");
  report("prepare: wrote " + (fs::path(out_dir) / "meta.json").string());
  return r;
}

DatasetMeta read_dataset_meta(const std::string& dir) {
  const std::string path = (fs::path(dir) / "meta.json").string();
  ESPLAG_CHECK(fs::exists(path), "data directory '", dir,
               "' has no meta.json: prepare it first with `esplag data prepare`");
  try {
    const auto js = parse_json(data_files::read_all(path, "dataset metadata"), path);
    const int64_t vocab = js.at("vocab_size").get<int64_t>();
    ESPLAG_CHECK(vocab > 0 && vocab <= INT32_MAX, path, ": vocab_size must be in [1, ", INT32_MAX, "], got ", vocab);
    return {static_cast<int>(vocab), js.at("tokenizer").get<std::string>()};
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": invalid dataset metadata: ", json_error_text(e));
  }
}

PrepareResult prepare_dataset(const PrepareOptions& options, const ProgressFn& progress) {
  ESPLAG_CHECK(!options.input.empty(), "prepare: no input text file given");
  const auto tokenizer = load_tokenizer(options.tokenizer);
  return prepare_dataset(options.input, *tokenizer, options.out_dir, options.val_fraction, options.shard_tokens,
                         progress, options.separator);
}

}  // namespace esplag
