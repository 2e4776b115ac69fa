// Data-parallel training end to end on the CPU reference (`esplag train --gpus N` with
// train.device=cpu): N ranks with grad_accum A train as one process with N·A, rank 0 alone
// speaks and writes, and the run resumes on another number of processes.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "cli_util.h"
#include "io/atomic_file.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

fs::path root() { return esplag::testing::scratch_root("test_cli_data_parallel"); }

Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }

struct Fixture {
  fs::path data, config;
  Fixture() {
    const fs::path d = root();
    data = esplag::testing::prepared_verses(d);
    config = d / "tiny.yaml";
    esplag::testing::write_text(
        config, "model: {preset: tiny, n_layer: 2, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 32}\n"
                "data: {path: " + data.string() + "}\n"
                "train: {device: cpu, batch_size: 4, seq_len: 32, steps: 6, log_every: 1, eval_every: 0,"
                " eval_batches: 2, checkpoint_every: 3}\n");
  }
};

const Fixture& fixture() {
  static Fixture f;
  return f;
}

}  // namespace

TEST(CliDataParallel, TwoRanksTrainAsOneProcessWithTwiceTheAccumulation) {
  const auto& f = fixture();
  const fs::path one = root() / "one", two = root() / "two";
  const Result a = run("train --config " + f.config.string() + " --out " + one.string() + " --set train.grad_accum=2");
  ASSERT_EQ(a.code, 0) << a.err;
  const Result b = run("train --gpus 2 --config " + f.config.string() + " --out " + two.string());
  ASSERT_EQ(b.code, 0) << b.err;

  const auto la = esplag::testing::logged_steps(one), lb = esplag::testing::logged_steps(two);
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) {
    // The same tokens and the same mean; only the order of the fp32 sums differs.
    EXPECT_NEAR(lb[i].loss, la[i].loss, 1e-5 * la[i].loss) << "step " << i + 1;
    EXPECT_NEAR(lb[i].grad_norm, la[i].grad_norm, 1e-4 * la[i].grad_norm) << "step " << i + 1;
    EXPECT_EQ(lb[i].tokens_seen, la[i].tokens_seen) << "step " << i + 1;
  }
  // The data position saved is the one-process run's.
  const auto state = [](const fs::path& ck) { return nlohmann::json::parse(esplag::read_file((ck / "state.json").string())); };
  EXPECT_EQ(state(two / "step-000006")["data"], state(one / "step-000006")["data"]);
  // Rank 0 alone prints the progress lines.
  size_t lines = 0;
  for (size_t at = b.out.find("step      3/6"); at != std::string::npos; at = b.out.find("step      3/6", at + 1)) ++lines;
  EXPECT_EQ(lines, 1u) << b.out;
  EXPECT_NE(b.out.find("data-parallel ranks"), std::string::npos) << b.out;

  // A run of two ranks resumes in one process (and goes on from the saved data position).
  const Result c = run("train --resume " + two.string() + " --steps 8");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_TRUE(fs::exists(two / "step-000008" / "model.safetensors"));
}

// Delayed fp8 scaling: the ranks' amax histories take the largest amax over the ranks, so
// they are the one process's (whose losses, and so dY, are scaled by 1/2 for its two
// micro-batches): to the bit after the first step (the same weights), then within what the
// gradients' other order of sums gives through the fp8 casts (0.9% at step 6). A rank that
// kept only its own batches' amaxes would differ at once (by 16%, and 26% at step 6).
TEST(CliDataParallel, DelayedFp8ScalingTrainsAsOneProcess) {
  const auto& f = fixture();
  const fs::path one = root() / "delayed-one", two = root() / "delayed-two";
  const std::string fp8 =
      " --set train.precision=fp8 --set train.fp8_scaling=delayed --set train.checkpoint_every=1"
      " --set train.keep_checkpoints=0";
  const Result a = run("train --config " + f.config.string() + " --out " + one.string() + fp8 +
                       " --set train.grad_accum=2");
  ASSERT_EQ(a.code, 0) << a.err;
  const Result b = run("train --gpus 2 --config " + f.config.string() + " --out " + two.string() + fp8);
  ASSERT_EQ(b.code, 0) << b.err;
  const auto la = esplag::testing::logged_steps(one), lb = esplag::testing::logged_steps(two);
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(lb[i].loss, la[i].loss, 1e-4 * la[i].loss) << "step " << i + 1;
  EXPECT_EQ(esplag::testing::amax_history_difference(one / "step-000001", two / "step-000001", 2.0f), 0.0);
  // Delayed scaling saturates the early steps' growing activations; the warning counts every
  // rank's casts, as the one process counts them all.
  const auto warnings = [](const std::string& out) {
    std::vector<std::string> lines;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);)
      if (line.find("warning: fp8 casts saturated") != std::string::npos) lines.push_back(line);
    return lines;
  };
  EXPECT_FALSE(warnings(a.out).empty()) << a.out;
  EXPECT_EQ(warnings(b.out), warnings(a.out));
  EXPECT_LT(esplag::testing::amax_history_difference(one / "step-000006", two / "step-000006", 2.0f), 3e-2);

  // Both ranks resume with rank 0's histories, which are every rank's.
  const Result c = run("train --gpus 2 --resume " + two.string() + " --steps 8");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_TRUE(fs::exists(two / "step-000008" / "optimizer.safetensors"));
}

TEST(CliDataParallel, ShardedParametersOnTheCpuAreRefusedWithTheReason) {
  const auto& f = fixture();
  const Result r = run("train --config " + f.config.string() + " --out " + (root() / "zero").string() +
                       " --set parallel.zero=3");
  esplag::testing::expect_one_line_error(r, "parallel.zero = 3 (sharded parameters) is built for train.device cuda");
  EXPECT_FALSE(fs::exists(root() / "zero" / "config.yaml"));
}
