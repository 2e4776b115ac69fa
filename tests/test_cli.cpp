// The esplag binary end to end: every bad input gives one clear error line and a non-zero
// exit, and never damages a checkpoint that already exists.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli_util.h"
#include "io/atomic_file.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

fs::path root() { return esplag::testing::scratch_root("test_cli"); }

Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }

void expect_error(const Result& r, const std::string& needle) { esplag::testing::expect_one_line_error(r, needle); }

void write(const fs::path& p, const std::string& text) { esplag::testing::write_text(p, text); }

// Prepares a byte-level dataset and trains a tiny run with checkpoints (once per process).
struct Fixture {
  fs::path data, run, config;
  Fixture() {
    const fs::path d = root();
    std::string text;
    for (int i = 0; i < 300; ++i) text += "In the beginning was the word, and the word was " + std::to_string(i) + ".\n";
    write(d / "corpus.txt", text);
    data = d / "data";
    Result r = run_checked("data prepare --input " + (d / "corpus.txt").string() + " --out " + data.string() +
                           " --val-fraction 0.1");
    config = d / "tiny.yaml";
    write(config, "model: {preset: tiny, n_layer: 1, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 32}\n"
                  "data: {path: " + data.string() + "}\n"
                  "train: {batch_size: 4, seq_len: 32, steps: 4, log_every: 1, eval_every: 2, eval_batches: 2,"
                  " checkpoint_every: 2}\n");
    run = d / "run";
    run_checked("train --config " + config.string() + " --out " + run.string());
  }
  static Result run_checked(const std::string& args) {
    Result r = ::run(args);
    EXPECT_EQ(r.code, 0) << args << "\n" << r.err;
    return r;
  }
};

const Fixture& fixture() {
  static Fixture f;
  return f;
}

std::string checkpoint_bytes() {
  const fs::path ck = fixture().run / "step-000004";
  return esplag::read_file((ck / "model.safetensors").string()) + esplag::read_file((ck / "optimizer.safetensors").string()) +
         esplag::read_file((ck / "state.json").string());
}

fs::path copy_data(const std::string& name) {
  const fs::path d = root() / name;
  fs::remove_all(d);
  fs::copy(fixture().data, d, fs::copy_options::recursive);
  return d;
}

}  // namespace

TEST(Cli, TrainsEvaluatesAndSamples) {
  const auto& f = fixture();
  EXPECT_TRUE(fs::exists(f.run / "metrics.jsonl"));
  EXPECT_TRUE(fs::exists(f.run / "config.yaml"));
  EXPECT_EQ(esplag::read_file((f.run / "latest").string()), "step-000004\n");
  Result ev = run("eval --checkpoint " + f.run.string() + " --json");
  ASSERT_EQ(ev.code, 0) << ev.err;
  EXPECT_NE(ev.out.find("\"perplexity\""), std::string::npos) << ev.out;
  EXPECT_NE(ev.out.find("\"device\""), std::string::npos) << ev.out;  // auto: where it ran
  // The CPU gives the same loss whatever the default picked when it picked the CPU.
  Result ev_cpu = run("eval --checkpoint " + f.run.string() + " --device cpu --json");
  ASSERT_EQ(ev_cpu.code, 0) << ev_cpu.err;
  EXPECT_NE(ev_cpu.out.find("\"device\":\"cpu\""), std::string::npos) << ev_cpu.out;
  if (ev.out.find("\"device\":\"cpu\"") != std::string::npos) EXPECT_EQ(ev.out, ev_cpu.out);
  expect_error(run("eval --checkpoint " + f.run.string() + " --device gpu"), "must be cpu, cuda or auto");
  Result s = run("sample --checkpoint " + f.run.string() + " --prompt \"In the\" --tokens 20 --seed 3");
  ASSERT_EQ(s.code, 0) << s.err;
  EXPECT_EQ(s.out.rfind("In the", 0), 0u) << s.out;
  EXPECT_EQ(run("sample --checkpoint " + f.run.string() + " --prompt \"In the\" --tokens 20 --seed 3").out, s.out);
}

TEST(Cli, ResumeContinuesTheRun) {
  const auto& f = fixture();
  const fs::path copy = root() / "resumed";
  fs::remove_all(copy);
  fs::copy(f.run, copy, fs::copy_options::recursive);
  Result r = run("train --resume " + copy.string() + " --steps 6");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("resuming"), std::string::npos);
  EXPECT_TRUE(fs::exists(copy / "step-000006" / "model.safetensors"));
}

TEST(Cli, MissingDataDirectory) {
  expect_error(run("train --config " + fixture().config.string() + " --set data.path=/nonexistent/data --out " +
                   (root() / "r1").string()),
               "meta.json");
}

TEST(Cli, TruncatedShard) {
  const fs::path d = copy_data("truncated");
  const fs::path shard = d / "train_000000.bin";
  fs::resize_file(shard, fs::file_size(shard) - 100);
  expect_error(run("train --config " + fixture().config.string() + " --set data.path=" + d.string() + " --out " +
                   (root() / "r2").string()),
               "truncated");
}

TEST(Cli, WrongMagic) {
  const fs::path d = copy_data("magic");
  std::fstream shard(d / "train_000000.bin", std::ios::in | std::ios::out | std::ios::binary);
  const int32_t bad = 12345;
  shard.write(reinterpret_cast<const char*>(&bad), 4);
  shard.close();
  expect_error(run("train --config " + fixture().config.string() + " --set data.path=" + d.string() + " --out " +
                   (root() / "r3").string()),
               "magic");
}

TEST(Cli, UnknownConfigKeyAndBadOptions) {
  const fs::path cfg = root() / "bad.yaml";
  write(cfg, "train: {batch_size: 4, learning_rate: 0.1}\n");
  expect_error(run("train --config " + cfg.string()), "unknown config key 'train.learning_rate'");
  expect_error(run("train --config " + fixture().config.string() + " --set optimizer.lr=fast"), "optimizer.lr");
  expect_error(run("train --config " + fixture().config.string() + " --bogus 1"), "unknown option --bogus");
  expect_error(run("eval"), "--checkpoint is required");
}

TEST(Cli, CorruptSafetensorsHeaderLeavesTheOriginalIntact) {
  const std::string before = checkpoint_bytes();
  const fs::path copy = root() / "corrupt_ck";
  fs::remove_all(copy);
  fs::copy(fixture().run / "step-000004", copy, fs::copy_options::recursive);
  std::string bytes = esplag::read_file((copy / "model.safetensors").string());
  for (int i = 8; i < 40; ++i) bytes[i] = '#';  // garbage in the JSON header
  write(copy / "model.safetensors", bytes);
  expect_error(run("eval --checkpoint " + copy.string()), "model.safetensors");
  expect_error(run("train --resume " + copy.string()), "model.safetensors");
  EXPECT_EQ(checkpoint_bytes(), before);
}

TEST(Cli, ShapeMismatchOnLoad) {
  // A checkpoint whose config says d_model=32 but whose weights come from a d_model=16 run.
  const auto& f = fixture();
  const fs::path other = root() / "other_run";
  fs::remove_all(other);
  ASSERT_EQ(run("train --config " + f.config.string() + " --set model.d_model=16 --set train.steps=2 --out " +
                other.string())
                .code,
            0);
  const fs::path mixed = root() / "mixed_ck";
  fs::remove_all(mixed);
  fs::copy(f.run / "step-000004", mixed, fs::copy_options::recursive);
  fs::copy_file(other / "step-000002" / "optimizer.safetensors", mixed / "optimizer.safetensors",
                fs::copy_options::overwrite_existing);
  expect_error(run("train --resume " + mixed.string()), "shape mismatch");
}

TEST(Cli, FailedResumeNeverDamagesTheCheckpoint) {
  // A run on its own copy of the data; then the data is damaged and the run resumed.
  const fs::path d = copy_data("resume_data");
  const fs::path run_dir = root() / "bad_resume";
  fs::remove_all(run_dir);
  ASSERT_EQ(run("train --config " + fixture().config.string() + " --set data.path=" + d.string() +
                " --set train.steps=2 --out " + run_dir.string())
                .code,
            0);
  const fs::path ck = run_dir / "step-000002";
  const std::string before = esplag::read_file((ck / "model.safetensors").string()) +
                             esplag::read_file((ck / "optimizer.safetensors").string()) +
                             esplag::read_file((ck / "state.json").string()) +
                             esplag::read_file((run_dir / "latest").string());
  fs::resize_file(d / "train_000000.bin", fs::file_size(d / "train_000000.bin") - 64);
  expect_error(run("train --resume " + run_dir.string() + " --steps 4"), "truncated");
  const std::string after = esplag::read_file((ck / "model.safetensors").string()) +
                            esplag::read_file((ck / "optimizer.safetensors").string()) +
                            esplag::read_file((ck / "state.json").string()) +
                            esplag::read_file((run_dir / "latest").string());
  EXPECT_EQ(after, before);
}

TEST(Cli, SparsityReportAndDenseExportOfASparseRun) {
  const auto& f = fixture();
  const fs::path cfg = root() / "sparse.yaml";
  write(cfg, esplag::read_file(f.config.string()) +
                 "recipe:\n"
                 "  - slope: {params: ['re:blocks\\.0\\.mlp\\..*'], mask_change_freq: 2}\n"
                 "  - semi_sparse: {params: [blocks.0.attn.proj.weight], until: 2}\n");
  const fs::path run_dir = root() / "sparse_run";
  fs::remove_all(run_dir);
  Result t = run("train --config " + cfg.string() + " --out " + run_dir.string());
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.out.find("blocks.0.mlp.fc.weight -> slope 2:4"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("step 2: blocks.0.attn.proj.weight -> dense"), std::string::npos) << t.out;
  Result s = run("sparsity --checkpoint " + run_dir.string());
  ASSERT_EQ(s.code, 0) << s.err;
  EXPECT_NE(s.out.find("blocks.0.mlp.proj.weight     slope"), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("0.5000  ok"), std::string::npos) << s.out;
  // The compressed layers are stored compressed: kept values, not a dense weight.
  const std::string model_file = esplag::read_file((run_dir / "step-000004" / "model.safetensors").string());
  EXPECT_NE(model_file.find("blocks.0.mlp.fc.weight.values"), std::string::npos);
  EXPECT_EQ(model_file.find("\"blocks.0.mlp.fc.weight\""), std::string::npos);
  // The dense export holds every parameter as a plain tensor, pruned entries as zeros.
  const fs::path out = root() / "dense.safetensors";
  Result e = run("export --checkpoint " + run_dir.string() + " --dense --out " + out.string());
  ASSERT_EQ(e.code, 0) << e.err;
  const std::string dense = esplag::read_file(out.string());
  EXPECT_NE(dense.find("\"blocks.0.mlp.fc.weight\""), std::string::npos);
  EXPECT_EQ(dense.find(".values"), std::string::npos);
  expect_error(run("export --checkpoint " + run_dir.string() + " --out " + out.string()), "--dense");
}

TEST(Cli, ExportNeverWritesIntoACheckpointOrRunNorOverAFileWithoutForce) {
  const auto& f = fixture();
  const std::string before = checkpoint_bytes();
  const fs::path ck = f.run / "step-000004";
  const std::string export_of = "export --checkpoint " + f.run.string() + " --dense --out ";
  for (const std::string force : {"", " --force"}) {
    expect_error(run(export_of + (ck / "model.safetensors").string() + force),
                 "export: --out '" + (ck / "model.safetensors").string() + "' is inside the checkpoint directory '" +
                     ck.string() + "'");
    expect_error(run(export_of + (ck / "dense.safetensors").string() + force), "is inside the checkpoint directory");
    expect_error(run(export_of + (f.run / "step-000002" / ".." / "dense.safetensors").string() + force),
                 "is inside the run directory '" + f.run.string() + "'");
    expect_error(run(export_of + (f.run / "latest").string() + force), "is inside the run directory");
  }
  expect_error(run(export_of + root().string()), "is a directory");
  EXPECT_EQ(checkpoint_bytes(), before);
  EXPECT_EQ(esplag::read_file((f.run / "latest").string()), "step-000004\n");
  EXPECT_FALSE(fs::exists(ck / "dense.safetensors"));
  EXPECT_FALSE(fs::exists(f.run / "dense.safetensors"));

  const fs::path out = root() / "export_twice.safetensors";
  fs::remove(out);
  ASSERT_EQ(run(export_of + out.string()).code, 0);
  write(out, "keep me");
  expect_error(run(export_of + out.string()), "export: --out '" + out.string() + "' already exists; give --force");
  EXPECT_EQ(esplag::read_file(out.string()), "keep me");
  const Result forced = run(export_of + out.string() + " --force");
  ASSERT_EQ(forced.code, 0) << forced.err;
  EXPECT_NE(esplag::read_file(out.string()), "keep me");
  Result ev = run("eval --checkpoint " + f.run.string());
  EXPECT_EQ(ev.code, 0) << ev.err;
}

TEST(Cli, TokenizerTrainPrintsTheVocabularyItWrote) {
  const fs::path empty = root() / "empty.txt", small = root() / "small.txt", out = root() / "tok.json";
  write(empty, "");
  Result r = run("tokenizer train --input " + empty.string() + " --vocab-size 512 --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote " + out.string() + ": vocabulary 257 (0 merges)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("note: 255 tokens fewer than the 512 asked for: the input is empty"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("vocabulary 512"), std::string::npos) << r.out;
  write(small, "abab abab");
  r = run("tokenizer train --input " + small.string() + " --vocab-size 300 --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("tokens fewer than the 300 asked for: no pair of adjacent tokens occurs twice"),
            std::string::npos)
      << r.out;
  // Asked for exactly what the corpus gives: no note.
  std::string text;
  for (int i = 0; i < 50; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  write(small, text);
  r = run("tokenizer train --input " + small.string() + " --vocab-size 260 --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(": vocabulary 260 ("), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("note:"), std::string::npos) << r.out;
}

// The first SIGINT finishes the step under way, saves it and exits with 130, saying how to
// continue; the run then resumes from that step.
TEST(Cli, SigintSavesTheStepReachedAndExitsWith130) {
  const auto& f = fixture();
  const fs::path run_dir = root() / "interrupted";
  fs::remove_all(run_dir);
  // Long enough never to finish; no periodic checkpoint, so only the signal's is saved.
  const std::string train = std::string(ESPLAG_BINARY) + " --threads 1 train --config " + f.config.string() +
                            " --set train.steps=100000 --set train.checkpoint_every=0 --set train.eval_every=0" +
                            " --out " + run_dir.string();
  const fs::path script = root() / "interrupt.sh";
  write(script, train + " &\npid=$!\nfor i in $(seq 600); do\n  grep -q step '" + (run_dir / "metrics.jsonl").string() +
                    "' 2>/dev/null && break\n  sleep 0.1\ndone\nkill -INT $pid\nwait $pid\n");
  Result r = esplag::testing::run_command("sh '" + script.string() + "'", root() / "sig.out", root() / "sig.err");
  EXPECT_EQ(r.code, 130) << r.err;
  EXPECT_NE(r.err.find("continue with: esplag train --resume " + run_dir.string()), std::string::npos) << r.err;
  const std::string latest = esplag::read_file((run_dir / "latest").string());
  ASSERT_EQ(latest.rfind("step-", 0), 0u) << latest;
  const int saved = std::stoi(latest.substr(5));
  EXPECT_GT(saved, 0);
  Result resumed = run("train --resume " + run_dir.string() + " --steps " + std::to_string(saved + 1));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_TRUE(fs::exists(run_dir / ("step-" + std::string(6 - std::to_string(saved + 1).size(), '0') +
                                    std::to_string(saved + 1))));
}

TEST(Cli, ResumeWithNothingToDoSaysSoAndWritesNothing) {
  const auto& f = fixture();
  const fs::path copy = root() / "nothing_to_do";
  fs::remove_all(copy);
  fs::copy(f.run, copy, fs::copy_options::recursive);
  const std::string metrics = esplag::read_file((copy / "metrics.jsonl").string());
  Result r = run("train --resume " + copy.string() + " --steps 3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("nothing to do"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("done:"), std::string::npos) << r.out;
  EXPECT_EQ(esplag::read_file((copy / "metrics.jsonl").string()), metrics);
}
