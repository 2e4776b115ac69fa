// The cuSPARSELt tuning cache (namespace esplag::gpu): the configurations cusparseLtMatmulSearch
// chose, persisted so that later processes read them instead of searching again.
//
// A JSON file {"format": "esplag-cusparselt-tuning", "version": 1, "entries": [{"gpu",
// "cusparselt", "problem", "alg_id", "split_k", "split_k_mode", "split_k_buffers",
// "max_alg_id", "search_ms"}, ...]}. Path: set_cusparselt_tuning_path(), else $ESPLAG_CUSPARSELT_TUNING, else
// $XDG_CACHE_HOME/esplag/cusparselt-tuning.json, else ~/.cache/esplag/cusparselt-tuning.json.
// Loaded on first use; every new entry rewrites the file atomically (temporary file +
// rename), folders created as needed. A file that cannot be read or parsed gives one
// warning on stderr and is treated as empty (problems are searched again and the file is
// rewritten); a failed write warns and tuning continues in memory.
//
// Plain C++ without CUDA: built in the CPU build too, where tests/test_sparse_tuning_cache.cpp
// checks the file format. sparse/cuda/cusparselt.h includes it; cusparselt.cu searches and
// records.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace esplag::gpu {

// The algorithm configuration of a plan (what the tuning cache stores).
struct SparseGemm24Config {
  int alg_id = 0;
  int split_k = 1;
  int split_k_mode = 0;  // cusparseLtSplitKMode_t
  int split_k_buffers = 1;
  friend bool operator==(const SparseGemm24Config&, const SparseGemm24Config&) = default;
};

std::string cusparselt_tuning_path();
// Sets the path ("" = the default) and reloads the cache from it.
void set_cusparselt_tuning_path(const std::string& path);
// Re-reads the file (dropping entries not written to it).
void reload_cusparselt_tuning_cache();
// Tuning on (default) or off ($ESPLAG_CUSPARSELT_SEARCH=0 turns it off at start).
void set_cusparselt_search(bool on);
bool cusparselt_search_enabled();
// Entries in memory (all GPUs and versions).
size_t cusparselt_tuning_entries();

// One search's result: the configuration of `problem` (SparseGemm24Problem::key()) on the GPU
// named `gpu` with cuSPARSELt `version` (cusparselt_version()).
struct CusparseltTuningEntry {
  std::string gpu;
  int version = 0;
  std::string problem;
  SparseGemm24Config config;
  int max_alg_id = 0;
  double search_ms = 0;
  friend bool operator==(const CusparseltTuningEntry&, const CusparseltTuningEntry&) = default;
};

// The entry of (gpu, version, problem) in memory (the file loaded on first use), if any.
bool find_cusparselt_tuning(const std::string& gpu, int version, const std::string& problem,
                            CusparseltTuningEntry* entry);
// Adds or replaces the entry of (gpu, version, problem) and rewrites the file.
void store_cusparselt_tuning(const CusparseltTuningEntry& entry);

// The file's text holding `entries`, and the entries of a file's text (throws esplag::Error
// saying what is wrong with the text: invalid JSON and where, another format or version, an
// entry's missing or mistyped field).
std::string cusparselt_tuning_json(const std::vector<CusparseltTuningEntry>& entries);
std::vector<CusparseltTuningEntry> parse_cusparselt_tuning_json(const std::string& text);

}  // namespace esplag::gpu
