// The cuSPARSELt tuning cache's file on the CPU: the JSON round trip, files written by earlier
// versions, the errors of a bad file, and the cache's load / store / rewrite through its path.
#include "sparse/cuda/cusparselt_tuning_cache.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

using namespace esplag;
using esplag::gpu::CusparseltTuningEntry;
using esplag::testing::contains;
using esplag::testing::error_of;
using esplag::testing::TempDir;
using esplag::testing::write_text;

namespace {

CusparseltTuningEntry entry(const std::string& gpu, const std::string& problem, int alg_id, double search_ms) {
  CusparseltTuningEntry e;
  e.gpu = gpu;
  e.version = 800;
  e.problem = problem;
  e.config = {alg_id, 2, 1, 4};
  e.max_alg_id = 11;
  e.search_ms = search_ms;
  return e;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// What the cache's earlier hand-written writer produced, verbatim (one entry a line, search_ms with
// three decimals). Such files must keep loading.
const char* kEarlierFile = R"({
  "format": "esplag-cusparselt-tuning",
  "version": 1,
  "entries": [
    {"gpu": "NVIDIA H100 80GB HBM3", "cusparselt": 800, "problem": "fwd out=4096 in=4096 tokens=8192 w=A bias=1 act=relu bf16", "alg_id": 3, "split_k": 1, "split_k_mode": 0, "split_k_buffers": 1, "max_alg_id": 7, "search_ms": 41.250},
    {"gpu": "NVIDIA H100 80GB HBM3", "cusparselt": 800, "problem": "dw out=4096 in=11008 tokens=8192 w=A bias=0 act=none bf16", "alg_id": 0, "split_k": 4, "split_k_mode": 1, "split_k_buffers": 2, "max_alg_id": 5, "search_ms": 120.000}
  ]
}
)";

}  // namespace

TEST(CusparseltTuningFile, RoundTripsEveryField) {
  const std::vector<CusparseltTuningEntry> entries = {
      entry("NVIDIA H100 80GB HBM3", "fwd out=4096 in=4096 tokens=8192 w=A bias=1 act=gelu bf16", 3, 41.25),
      entry("a \"quoted\\\" name\twith\ncontrols", "xdw out=64 in=32 tokens=128 w=A bias=0 act=none bf16", 0, 0.001),
  };
  const std::string text = gpu::cusparselt_tuning_json(entries);
  EXPECT_TRUE(contains(text, "\"format\": \"esplag-cusparselt-tuning\"")) << text;
  EXPECT_TRUE(contains(text, "\"version\": 1")) << text;
  EXPECT_EQ(gpu::parse_cusparselt_tuning_json(text), entries) << text;
  EXPECT_TRUE(gpu::parse_cusparselt_tuning_json(gpu::cusparselt_tuning_json({})).empty());
}

TEST(CusparseltTuningFile, SearchTimesAreKeptToTheMicrosecond) {
  const std::string text = gpu::cusparselt_tuning_json({entry("g", "p", 1, 12.3456789)});
  EXPECT_TRUE(contains(text, "\"search_ms\": 12.346")) << text;
  EXPECT_EQ(gpu::parse_cusparselt_tuning_json(text).at(0).search_ms, 12.346);
}

TEST(CusparseltTuningFile, ReadsFilesOfTheEarlierWriter) {
  const auto entries = gpu::parse_cusparselt_tuning_json(kEarlierFile);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].gpu, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(entries[0].version, 800);
  EXPECT_EQ(entries[0].problem, "fwd out=4096 in=4096 tokens=8192 w=A bias=1 act=relu bf16");
  EXPECT_EQ(entries[0].config, (gpu::SparseGemm24Config{3, 1, 0, 1}));
  EXPECT_EQ(entries[0].max_alg_id, 7);
  EXPECT_EQ(entries[0].search_ms, 41.25);
  EXPECT_EQ(entries[1].config, (gpu::SparseGemm24Config{0, 4, 1, 2}));
  EXPECT_EQ(entries[1].search_ms, 120.0);
  // Integral values written as decimals count as integers, as they always did.
  const std::string decimals = R"({"format": "esplag-cusparselt-tuning", "version": 1.0, "entries": [{"gpu": "g",
    "cusparselt": 800.0, "problem": "p", "alg_id": 2.0, "split_k": 1, "split_k_mode": 0, "split_k_buffers": 1,
    "max_alg_id": 4, "search_ms": 3}]})";
  EXPECT_EQ(gpu::parse_cusparselt_tuning_json(decimals).at(0).config.alg_id, 2);
}

TEST(CusparseltTuningFile, BadFilesSayWhatIsWrong) {
  const std::string head = R"({"format": "esplag-cusparselt-tuning", "version": 1, "entries": [)";
  const std::string fields = R"("cusparselt": 800, "problem": "p", "split_k": 1, "split_k_mode": 0,
    "split_k_buffers": 1, "max_alg_id": 4, "search_ms": 3)";
  const std::pair<std::string, std::string> cases[] = {
      {"not json at all", "not valid JSON (at byte 2)"},
      {head + R"({"gpu": )", "not valid JSON"},
      {"[]", "the top level is not an object"},
      {R"({"format": "something-else", "version": 1, "entries": []})",
       "\"format\" is not \"esplag-cusparselt-tuning\""},
      {R"({"format": "esplag-cusparselt-tuning", "version": 2, "entries": []})", "\"version\" is not 1"},
      {R"({"format": "esplag-cusparselt-tuning", "entries": []})", "\"version\" is not 1"},
      {R"({"format": "esplag-cusparselt-tuning", "version": 1, "entries": {}})", "\"entries\" is not an array"},
      {head + "3]}", "entry 0 is not an object"},
      {head + R"({"gpu": 3}]})", "entry 0: \"gpu\" is missing or not a string"},
      {head + R"({"gpu": "g", "alg_id": "1", )" + fields + "}]}", "entry 0: \"alg_id\" is missing or not a number"},
      {head + R"({"gpu": "g", "alg_id": 1.5, )" + fields + "}]}", "entry 0: \"alg_id\" is not an integer"},
      {head + R"({"gpu": "g", "alg_id": -1, )" + fields + "}]}", "entry 0: alg_id -1 / split_k 1 out of range"},
  };
  for (const auto& [text, message] : cases) {
    SCOPED_TRACE(text);
    const std::string msg = error_of([&] { gpu::parse_cusparselt_tuning_json(text); });
    EXPECT_TRUE(contains(msg, message)) << msg;
    EXPECT_FALSE(contains(msg, "json.exception")) << msg;
  }
}

TEST(CusparseltTuningCache, StoresReloadsAndFinds) {
  TempDir dir;
  const std::string path = dir.file("sub/tuning.json");  // folders are created
  gpu::set_cusparselt_tuning_path(path);
  EXPECT_EQ(gpu::cusparselt_tuning_path(), path);
  EXPECT_EQ(gpu::cusparselt_tuning_entries(), 0u);
  const CusparseltTuningEntry a = entry("gpu A", "fwd p", 3, 1.5), b = entry("gpu B", "fwd p", 4, 2.5);
  gpu::store_cusparselt_tuning(a);
  gpu::store_cusparselt_tuning(b);
  ASSERT_TRUE(std::filesystem::exists(path));
  EXPECT_EQ(gpu::parse_cusparselt_tuning_json(read_text(path)).size(), 2u);

  gpu::reload_cusparselt_tuning_cache();  // a later process: the file read back
  EXPECT_EQ(gpu::cusparselt_tuning_entries(), 2u);
  CusparseltTuningEntry found;
  ASSERT_TRUE(gpu::find_cusparselt_tuning("gpu A", 800, "fwd p", &found));
  EXPECT_EQ(found, a);
  EXPECT_FALSE(gpu::find_cusparselt_tuning("gpu A", 801, "fwd p", &found));  // another library version
  EXPECT_FALSE(gpu::find_cusparselt_tuning("gpu A", 800, "bwd p", &found));

  CusparseltTuningEntry again = a;  // a new search of the same problem replaces its entry
  again.config.alg_id = 9;
  gpu::store_cusparselt_tuning(again);
  gpu::reload_cusparselt_tuning_cache();
  EXPECT_EQ(gpu::cusparselt_tuning_entries(), 2u);
  ASSERT_TRUE(gpu::find_cusparselt_tuning("gpu A", 800, "fwd p", &found));
  EXPECT_EQ(found.config.alg_id, 9);
}

TEST(CusparseltTuningCache, LoadsAFileOfTheEarlierWriter) {
  TempDir dir;
  write_text(dir.file("tuning.json"), kEarlierFile);
  ::testing::internal::CaptureStderr();
  gpu::set_cusparselt_tuning_path(dir.file("tuning.json"));
  EXPECT_EQ(gpu::cusparselt_tuning_entries(), 2u);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  CusparseltTuningEntry found;
  EXPECT_TRUE(gpu::find_cusparselt_tuning("NVIDIA H100 80GB HBM3", 800,
                                          "dw out=4096 in=11008 tokens=8192 w=A bias=0 act=none bf16", &found));
}

TEST(CusparseltTuningCache, CorruptOrOtherVersionFileWarnsAndIsRewritten) {
  TempDir dir;
  const std::string path = dir.file("tuning.json");
  const std::string other_version = R"({"format": "esplag-cusparselt-tuning", "version": 2, "entries": []})";
  for (const std::string& bad : {std::string("not json at all"), other_version}) {
    SCOPED_TRACE(bad);
    write_text(path, bad);
    ::testing::internal::CaptureStderr();
    gpu::set_cusparselt_tuning_path(path);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(contains(err, "esplag: warning: the cuSPARSELt tuning cache " + path + " is corrupt")) << err;
    EXPECT_TRUE(contains(err, "problems will be searched again and the file rewritten")) << err;
    EXPECT_EQ(gpu::cusparselt_tuning_entries(), 0u);

    gpu::store_cusparselt_tuning(entry("g", "p", 1, 1));  // a new search rewrites the file whole
    ::testing::internal::CaptureStderr();
    gpu::reload_cusparselt_tuning_cache();
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
    EXPECT_EQ(gpu::cusparselt_tuning_entries(), 1u);
  }
}

TEST(CusparseltTuningCache, UnwritablePathWarnsAndKeepsTheEntryInMemory) {
  TempDir dir;
  write_text(dir.file("blocker"), "x");  // a path under a regular file cannot be created
  gpu::set_cusparselt_tuning_path(dir.file("blocker/sub/tuning.json"));
  ::testing::internal::CaptureStderr();
  gpu::store_cusparselt_tuning(entry("g", "p", 1, 1));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(contains(err, "cannot write the cuSPARSELt tuning cache")) << err;
  EXPECT_EQ(gpu::cusparselt_tuning_entries(), 1u);
}

TEST(CusparseltTuningCache, SearchSwitch) {
  const bool was = gpu::cusparselt_search_enabled();
  gpu::set_cusparselt_search(false);
  EXPECT_FALSE(gpu::cusparselt_search_enabled());
  gpu::set_cusparselt_search(true);
  EXPECT_TRUE(gpu::cusparselt_search_enabled());
  gpu::set_cusparselt_search(was);
}
