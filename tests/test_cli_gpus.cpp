// esplag train --gpus N: its range, its refusal inside a launched world, and the ranks it
// starts running the same command line without --gpus.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "cli_util.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

fs::path root() { return esplag::testing::scratch_root("test_cli_gpus"); }
Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }

TEST(CliGpus, HelpDocumentsIt) {
  const Result r = run("train --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("--gpus N"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("torchrun --nproc-per-node N"), std::string::npos) << r.out;
}

TEST(CliGpus, OutOfRange) {
  esplag::testing::expect_one_line_error(run("train --gpus 0 --config x.yaml"),
                                         "train: --gpus must be an integer in [1, 1024], got '0'");
}

TEST(CliGpus, RefusedInsideALaunchedWorld) {
  const Result r = esplag::testing::run_command(
      "RANK=1 WORLD_SIZE=2 MASTER_PORT=4000 " + std::string(ESPLAG_BINARY) + " train --gpus 2 --config x.yaml",
      root() / "out.txt", root() / "err.txt");
  esplag::testing::expect_one_line_error(
      r, "train: --gpus 2 starts its own processes, but this one already is rank 1 of 2 (local 1 of 2), torchrun");
}

TEST(CliGpus, RanksRunTheCommandWithoutGpus) {
  // Each rank reads the (missing) config and fails: had it kept --gpus, it would have refused
  // to start inside the launched world instead. The launcher names the first rank that failed.
  const std::string missing = (root() / "missing.yaml").string();
  const Result r = run("train --gpus=2 --config " + missing + " --out --gpus");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find(missing), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("already is"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("of 2 failed (exit status 1); the other ranks were stopped"), std::string::npos) << r.err;
}

}  // namespace
