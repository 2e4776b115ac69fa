// The cuSPARSELt tuning cache: its file (nlohmann-json), path and the search switch. See
// sparse/cuda/cusparselt_tuning_cache.h.
#include "sparse/cuda/cusparselt_tuning_cache.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/env.h"
#include "core/error.h"

namespace esplag::gpu {

namespace {

constexpr const char* kTuningFormat = "esplag-cusparselt-tuning";
constexpr int kTuningVersion = 1;

using Json = nlohmann::ordered_json;  // keys in the order written, as the file has always had them

}  // namespace

std::string cusparselt_tuning_json(const std::vector<CusparseltTuningEntry>& entries) {
  Json list = Json::array();
  for (const CusparseltTuningEntry& e : entries)
    list.push_back({{"gpu", e.gpu},
                    {"cusparselt", e.version},
                    {"problem", e.problem},
                    {"alg_id", e.config.alg_id},
                    {"split_k", e.config.split_k},
                    {"split_k_mode", e.config.split_k_mode},
                    {"split_k_buffers", e.config.split_k_buffers},
                    {"max_alg_id", e.max_alg_id},
                    {"search_ms", std::round(e.search_ms * 1000) / 1000}});  // µs are plenty
  const Json root = {{"format", kTuningFormat}, {"version", kTuningVersion}, {"entries", std::move(list)}};
  // GPU names and problem keys are ASCII; should a name not be UTF-8, it is written replaced, not refused.
  return root.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

std::vector<CusparseltTuningEntry> parse_cusparselt_tuning_json(const std::string& text) {
  Json root;
  try {
    root = Json::parse(text);
  } catch (const Json::parse_error& e) {
    fail("not valid JSON (at byte ", e.byte, ")");
  }
  ESPLAG_CHECK(root.is_object(), "the top level is not an object");
  const auto fmt = root.find("format");
  ESPLAG_CHECK(fmt != root.end() && fmt->is_string() && fmt->get<std::string>() == kTuningFormat,
               "\"format\" is not \"", kTuningFormat, "\"");
  const auto ver = root.find("version");
  ESPLAG_CHECK(ver != root.end() && ver->is_number() && ver->get<double>() == kTuningVersion, "\"version\" is not ",
               kTuningVersion);
  const auto list = root.find("entries");
  ESPLAG_CHECK(list != root.end() && list->is_array(), "\"entries\" is not an array");
  std::vector<CusparseltTuningEntry> entries;
  for (size_t i = 0; i < list->size(); ++i) {
    const Json& e = (*list)[i];
    ESPLAG_CHECK(e.is_object(), "entry ", i, " is not an object");
    auto str = [&](const char* k) {
      const auto v = e.find(k);
      ESPLAG_CHECK(v != e.end() && v->is_string(), "entry ", i, ": \"", k, "\" is missing or not a string");
      return v->get<std::string>();
    };
    auto num = [&](const char* k) {
      const auto v = e.find(k);
      ESPLAG_CHECK(v != e.end() && v->is_number(), "entry ", i, ": \"", k, "\" is missing or not a number");
      return v->get<double>();
    };
    // Integers as any JSON number of integral value (3 and 3.0 alike).
    auto integer = [&](const char* k) {
      const double d = num(k);
      ESPLAG_CHECK(d == std::floor(d) && std::fabs(d) < 1e9, "entry ", i, ": \"", k, "\" is not an integer");
      return static_cast<int>(d);
    };
    CusparseltTuningEntry t;
    t.gpu = str("gpu");
    t.version = integer("cusparselt");
    t.problem = str("problem");
    t.config.alg_id = integer("alg_id");
    t.config.split_k = integer("split_k");
    t.config.split_k_mode = integer("split_k_mode");
    t.config.split_k_buffers = integer("split_k_buffers");
    t.max_alg_id = integer("max_alg_id");
    t.search_ms = num("search_ms");
    ESPLAG_CHECK(t.config.alg_id >= 0 && t.config.split_k >= 1, "entry ", i, ": alg_id ", t.config.alg_id,
                 " / split_k ", t.config.split_k, " out of range");
    entries.push_back(std::move(t));
  }
  return entries;
}

namespace {

// The process's tuning cache: the entries of its file, keyed by GPU, library version and problem.
class TuningCache {
 public:
  static TuningCache& instance() {
    static TuningCache* c = new TuningCache();  // never destroyed: used until exit
    return *c;
  }

  std::string path() {
    std::lock_guard<std::mutex> lock(mu_);
    return path_locked();
  }
  void set_path(const std::string& p) {
    std::lock_guard<std::mutex> lock(mu_);
    explicit_path_ = p;
    load_locked();
  }
  void reload() {
    std::lock_guard<std::mutex> lock(mu_);
    load_locked();
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    ensure_loaded_locked();
    return entries_.size();
  }
  bool lookup(const std::string& gpu, int version, const std::string& problem, CusparseltTuningEntry* out) {
    std::lock_guard<std::mutex> lock(mu_);
    ensure_loaded_locked();
    auto it = entries_.find(key(gpu, version, problem));
    if (it == entries_.end()) return false;
    *out = it->second;
    return true;
  }
  void store(const CusparseltTuningEntry& e) {
    std::lock_guard<std::mutex> lock(mu_);
    ensure_loaded_locked();
    entries_[key(e.gpu, e.version, e.problem)] = e;
    write_locked();
  }

 private:
  static std::string key(const std::string& gpu, int version, const std::string& problem) {
    return gpu + "|" + std::to_string(version) + "|" + problem;
  }
  std::string path_locked() const {
    if (!explicit_path_.empty()) return explicit_path_;
    if (const char* e = std::getenv("ESPLAG_CUSPARSELT_TUNING"); e && *e) return e;
    if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
      return (std::filesystem::path(x) / "esplag" / "cusparselt-tuning.json").string();
    if (const char* h = std::getenv("HOME"); h && *h)
      return (std::filesystem::path(h) / ".cache" / "esplag" / "cusparselt-tuning.json").string();
    return "cusparselt-tuning.json";
  }
  void ensure_loaded_locked() {
    if (!loaded_) load_locked();
  }
  void warn(const std::string& msg) { std::cerr << "esplag: warning: " << msg << std::endl; }

  void load_locked() {
    loaded_ = true;
    entries_.clear();
    const std::string p = path_locked();
    std::error_code ec;
    if (!std::filesystem::exists(p, ec)) return;  // nothing tuned yet
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in.good() && !in.eof()) {
      warn("cannot read the cuSPARSELt tuning cache " + p + "; ignoring it (problems will be searched again)");
      return;
    }
    try {
      std::map<std::string, CusparseltTuningEntry> loaded;
      for (CusparseltTuningEntry& e : parse_cusparselt_tuning_json(ss.str()))
        loaded[key(e.gpu, e.version, e.problem)] = std::move(e);
      entries_ = std::move(loaded);
    } catch (const std::exception& e) {
      warn("the cuSPARSELt tuning cache " + p + " is corrupt (" + e.what() +
           "); ignoring it: problems will be searched again and the file rewritten");
    }
  }

  void write_locked() {
    const std::string p = path_locked();
    std::vector<CusparseltTuningEntry> list;
    for (const auto& [k, e] : entries_) list.push_back(e);
    const std::string text = cusparselt_tuning_json(list);
    // Atomic replacement: a reader sees the old file or the new one, never a torn write
    // (two processes tuning at once: the last rename wins, each file complete).
    const std::filesystem::path target(p);
    const std::string tmp = p + ".tmp." + std::to_string(::getpid());
    std::error_code ec;
    if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path(), ec);
    bool ok = false;
    if (std::FILE* f = std::fopen(tmp.c_str(), "wb")) {
      ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
      ok = (std::fflush(f) == 0) && ok;
      ok = (::fsync(::fileno(f)) == 0) && ok;
      ok = (std::fclose(f) == 0) && ok;
      if (ok) ok = std::rename(tmp.c_str(), p.c_str()) == 0;
      if (!ok) std::remove(tmp.c_str());
    }
    if (!ok)
      warn("cannot write the cuSPARSELt tuning cache " + p + " (" + std::strerror(errno) +
           "); the tuning is kept for this process only");
  }

  std::mutex mu_;
  std::string explicit_path_;
  bool loaded_ = false;
  std::map<std::string, CusparseltTuningEntry> entries_;
};

std::atomic<bool>& search_flag() {
  static std::atomic<bool> on(env_flag("ESPLAG_CUSPARSELT_SEARCH", true));
  return on;
}

}  // namespace

std::string cusparselt_tuning_path() { return TuningCache::instance().path(); }
void set_cusparselt_tuning_path(const std::string& path) { TuningCache::instance().set_path(path); }
void reload_cusparselt_tuning_cache() { TuningCache::instance().reload(); }
void set_cusparselt_search(bool on) { search_flag() = on; }
bool cusparselt_search_enabled() { return search_flag(); }
size_t cusparselt_tuning_entries() { return TuningCache::instance().size(); }

bool find_cusparselt_tuning(const std::string& gpu, int version, const std::string& problem,
                            CusparseltTuningEntry* entry) {
  return TuningCache::instance().lookup(gpu, version, problem, entry);
}
void store_cusparselt_tuning(const CusparseltTuningEntry& entry) { TuningCache::instance().store(entry); }

}  // namespace esplag::gpu
