// esplag sample --device: a bad value and cuda in a build or on a machine without it are
// one-line errors naming the option, before the checkpoint is read; bench generate checks
// its --batch list before it says that it needs the GPU.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "cli_util.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

Result run(const std::string& args) {
  return esplag::testing::run_esplag(args, esplag::testing::scratch_root("test_cli_sample_device"));
}

void expect_error(const Result& r, const std::string& message) {
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("esplag: error: " + message), std::string::npos) << r.err;
}

}  // namespace

TEST(CliSampleDevice, ABadDeviceIsAnErrorBeforeTheCheckpointIsRead) {
  expect_error(run("sample --checkpoint /nonexistent --device gpu"),
               "sample: --device must be auto, cpu or cuda, got 'gpu'");
}

#ifndef ESPLAG_HAVE_CUDA
TEST(CliSampleDevice, CudaWithoutTheCudaBuildIsAnError) {
  expect_error(run("sample --checkpoint /nonexistent --device cuda"),
               "sample: --device cuda: this esplag was built without the CUDA backend");
}
#endif

TEST(CliSampleDevice, BenchGenerateChecksItsBatchList) {
  expect_error(run("bench generate --batch 1,x"), "bench generate: --batch item 'x' is not a positive integer");
  expect_error(run("bench generate --batch 0"), "bench generate: --batch item '0' is not a positive integer");
  expect_error(run("bench generate --model bogus"), "unknown model preset 'bogus'");
}
