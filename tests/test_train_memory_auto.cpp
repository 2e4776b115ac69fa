// train.memory in a run: the trainer applies it before anything is allocated, its first log
// line says what auto chose, the saved config records it, and resume chooses again.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/prepare.h"
#include "test_util.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

using namespace esplag;
using esplag::testing::contains;
using esplag::testing::TempDir;
using esplag::testing::write_text;
namespace fs = std::filesystem;

namespace {

std::string make_dataset(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 300; ++i)
    text += "In the beginning God created the heaven and the earth " + std::to_string(i) + ".\n";
  write_text(dir.file("corpus.txt"), text);
  prepare_dataset(dir.file("corpus.txt"), ByteTokenizer(), dir.file("data"), 0.1, 1 << 20);
  return dir.file("data");
}

// Written with full checkpointing, which train.memory auto replaces: so little fits anywhere.
TrainConfig auto_config(const std::string& data) {
  return parse_train_config(R"(
model: {preset: tiny, n_layer: 2, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 32}
train: {batch_size: 2, seq_len: 32, steps: 2, log_every: 1, eval_every: 2, eval_batches: 1,
        checkpoint_every: 2, device: cpu, memory: auto, checkpointing: full}
)",
                            "test", {"data.path=" + data});
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST(TrainMemoryAuto, TheFirstLineSaysWhatAutoChoseAndTheConfigRecordsIt) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  const fs::path run = dir.file("run");
  std::vector<std::string> lines;
  const auto log = [&](const std::string& line) { lines.push_back(line); };
  Trainer(auto_config(data), run.string(), log).run();
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0].rfind("memory auto: train.checkpointing=none (it needs ", 0), 0u) << lines[0];
  EXPECT_TRUE(contains(lines[0], " of host memory, ")) << lines[0];
  const std::string saved = read_text(run / "config.yaml");
  EXPECT_TRUE(contains(saved, "memory: auto")) << saved;
  EXPECT_TRUE(contains(saved, "checkpointing: none")) << saved;

  // Resuming chooses again, before anything is loaded, and says so first.
  lines.clear();
  Trainer::resume(run.string(), log, 4)->run();
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0].rfind("memory auto: train.checkpointing=none (it needs ", 0), 0u) << lines[0];
}

TEST(TrainMemoryAuto, FixedRunsTheSettingsAsWrittenAndSaysNothing) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  TrainConfig c = auto_config(data);
  c.memory = "fixed";
  std::vector<std::string> lines;
  Trainer(c, dir.file("run"), [&](const std::string& line) { lines.push_back(line); }).run();
  for (const std::string& line : lines) EXPECT_FALSE(contains(line, "memory auto")) << line;
  const std::string saved = read_text(fs::path(dir.file("run")) / "config.yaml");
  EXPECT_TRUE(contains(saved, "memory: fixed")) << saved;
  EXPECT_TRUE(contains(saved, "checkpointing: full")) << saved;
}

TEST(TrainMemoryAuto, TheTrainerPlansWithTheMemoryAtHand) {
  const MemoryBudget at_hand = memory_at_hand("cpu", 0);
  EXPECT_EQ(at_hand.gpu, 0u);
  EXPECT_EQ(at_hand.host_source, at_hand.host ? "available now" : "not readable");
  // What the trainer calls is the planner's choice on that memory.
  TrainConfig c = parse_train_config("model: {vocab_size: 257}\ntrain: {device: cpu, memory: auto}", "test");
  TrainConfig same = c;
  const std::string line = apply_train_memory(c, "cpu", 0);
  const std::string expected =
      apply_train_memory(same, memory_at_hand("cpu", 0), [](const TrainConfig& t) { return plan_memory(t, "cpu"); });
  // The available memory moves between the two calls; the choice does not.
  EXPECT_EQ(line.substr(0, line.find(" (")), expected.substr(0, expected.find(" (")));
  EXPECT_EQ(c.checkpointing.mode, same.checkpointing.mode);
}
