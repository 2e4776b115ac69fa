// `esplag bench` subcommands end to end (the esplag binary of this build): the option
// errors of every GPU benchmark, which are checked before any GPU work and so behave the
// same in both builds, and, in a CPU build, the clear refusal of the GPU benchmarks. CSV
// appending is exercised through `bench train --device cpu` (a tiny model).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "cli_util.h"
#include "io/atomic_file.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

fs::path root() { return esplag::testing::scratch_root("test_cli_bench"); }
Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }
void expect_error(const Result& r, const std::string& needle) { esplag::testing::expect_one_line_error(r, needle); }

TEST(CliBench, UnknownOrMissingSubcommandPrintsUsage) {
  for (const std::string args : {"bench nope", "bench"}) {
    const Result r = run(args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.err.find(args == "bench" ? "missing subcommand" : "unknown subcommand 'nope'"), std::string::npos)
        << r.err;
    for (const char* sub : {"bench train", "bench gemm", "bench layer", "bench sparsify", "bench attention",
                            "bench vnm", "bench sparse-adamw", "bench slope-merged"})
      EXPECT_NE(r.err.find(sub), std::string::npos) << "usage lacks " << sub << ":\n" << r.err;
  }
}

TEST(CliBench, LayerOptionErrors) {
  expect_error(run("bench layer --kinds dense,bogus"),
               "--kinds item 'bogus' is not one of dense, semi_sparse, slope, semi_sparse_activation");
  expect_error(run("bench layer --kinds slope,slope"), "--kinds lists 'slope' twice");
  expect_error(run("bench layer --kinds ''"), "--kinds item '' is not one of");
  expect_error(run("bench layer --activation row_24,rows"), "--activation item 'rows' is not one of row_24, tile_24");
  expect_error(run("bench layer --shapes 16x16"), "--shapes item '16x16' is not OUTxINxTOKENS");
  expect_error(run("bench layer --shapes 16x16x16,0x16x16"), "--shapes item '0x16x16'");
  expect_error(run("bench layer --shapes 16x16x16,"), "--shapes item ''");
  expect_error(run("bench layer --shapes 16xAx16"), "--shapes item '16xAx16'");
  expect_error(run("bench layer --iters 0"), "--iters must be an integer in [1, 2147483647], got '0'");
  expect_error(run("bench layer --warmup -1"), "--warmup must be an integer in [0, 2147483647], got '-1'");
  expect_error(run("bench layer --iters many"), "--iters must be an integer in [1, 2147483647], got 'many'");
  expect_error(run("bench layer --iters 2.5"), "--iters must be an integer in [1, 2147483647], got '2.5'");
  expect_error(run("bench layer --bogus 1"), "bench layer: unknown option --bogus");
  expect_error(run("bench layer --sparse-dw=1"), "--sparse-dw takes no value");
  expect_error(run("bench layer --csv"), "--csv needs a value");
}

TEST(CliBench, OtherGpuBenchOptionErrors) {
  for (const std::string sub : {"sparsify", "attention", "vnm", "sparse-adamw"}) {
    expect_error(run("bench " + sub + " --iters 3"), "bench " + sub + ": unknown option --iters");
    expect_error(run("bench " + sub + " --csv"), "bench " + sub + ": --csv needs a value");
  }
  expect_error(run("bench gemm --products sideways"), "--products must be fwd, bwd or fwd,bwd");
  expect_error(run("bench gemm --operand C"), "--operand must be A or B");
  expect_error(run("bench gemm --dtype fp4"), "--dtype must be bf16 or e4m3");
  expect_error(run("bench gemm --dtype e4m3 --products fwd,bwd"), "--dtype e4m3 runs the forward product only");
  expect_error(run("bench slope-merged --ranks 16,x"), "--ranks item 'x' is not a positive integer");
  expect_error(run("bench slope-merged --ranks 0"), "--ranks item '0' is not a positive integer");
  expect_error(run("bench slope-merged --shapes 16x16"), "--shapes item '16x16' is not OUTxINxTOKENS");
  expect_error(run("bench slope-merged --warmup 0"), "--warmup must be an integer in [1, 2147483647], got '0'");
}

// The sparse layer kinds of `bench train` (checked before any GPU work).
TEST(CliBench, TrainSparseKindOptionErrors) {
  expect_error(run("bench train --slope all"), "--semi-sparse, --slope, --masked, --activation, --always-sparse, "
                                              "--no-baseline and --op-profile are for --device cuda");
  expect_error(run("bench train --masked all"), "are for --device cuda");
  expect_error(run("bench train --activation all"), "are for --device cuda");
  expect_error(run("bench train --device cuda --semi-sparse all --slope all"),
               "give one of --semi-sparse, --slope, --masked and --activation");
  expect_error(run("bench train --device cuda --masked all --activation all"), "give one of --semi-sparse");
  expect_error(run("bench train --device cuda --no-baseline"),
               "--no-baseline is for --semi-sparse, --slope, --masked or --activation");
  expect_error(run("bench train --device cuda --slope all --pattern tile_24"),
               "--pattern is for the layers of --activation");
  expect_error(run("bench train --device cuda --activation all --pattern cols"),
               "--pattern must be row_24 or tile_24, got 'cols'");
  expect_error(run("bench train --device cuda --semi-sparse all --lora-rank 8"),
               "--lora-rank is a positive rank for the adapters of --slope layers");
}

#ifndef ESPLAG_HAVE_CUDA
TEST(CliBench, GpuBenchesRefuseInACpuBuild) {
  for (const std::string sub : {"gemm", "layer", "sparsify", "attention", "vnm", "sparse-adamw", "slope-merged"}) {
    const fs::path csv = root() / ("refused_" + sub + ".csv");
    expect_error(run("bench " + sub + " --csv " + csv.string()),
                 "bench " + sub + ": needs a build configured with the cuda preset");
    EXPECT_FALSE(fs::exists(csv)) << sub;
  }
}
#endif

TEST(CliBench, TrainCsvGetsOneHeaderAndAppendedRows) {
  const fs::path csv = root() / "train.csv";
  const std::string args = "bench train --model tiny --batch 1 --seq 8 --steps 1 --warmup 0 --csv " + csv.string();
  for (int i = 0; i < 2; ++i) {
    const Result r = run(args);
    ASSERT_EQ(r.code, 0) << r.err;
  }
  const std::string text = esplag::read_file(csv.string());
  EXPECT_EQ(text.rfind("model,device,batch,seq,", 0), 0u) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3) << text;
  EXPECT_EQ(text.find("model,device", 1), std::string::npos) << text;
}

}  // namespace
