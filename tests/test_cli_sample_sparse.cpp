// esplag sample --sparse (the GPU generator's 2:4 prefill): a bad value, and on with the CPU
// generator, are one-line errors naming the option, before the checkpoint is read.
#include <gtest/gtest.h>

#include <string>

#include "cli_util.h"

namespace {

using Result = esplag::testing::CommandResult;

Result run(const std::string& args) {
  return esplag::testing::run_esplag(args, esplag::testing::scratch_root("test_cli_sample_sparse"));
}

void expect_error(const Result& r, const std::string& message) {
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("esplag: error: " + message), std::string::npos) << r.err;
}

}  // namespace

TEST(CliSampleSparse, ABadValueIsAnErrorBeforeTheCheckpointIsRead) {
  expect_error(run("sample --checkpoint /nonexistent --sparse yes"),
               "sample: --sparse must be auto, on or off, got 'yes'");
}

TEST(CliSampleSparse, OnWithTheCpuGeneratorIsAnError) {
  expect_error(run("sample --checkpoint /nonexistent --device cpu --sparse on"),
               "sample: --sparse on needs --device cuda (the cpu generator runs dense products)");
}

TEST(CliSampleSparse, AutoAndOffPassTheOptionChecks) {
  for (const std::string v : {"auto", "off"}) {
    const Result r = run("sample --checkpoint /nonexistent --device cpu --sparse " + v);
    EXPECT_NE(r.code, 0);
    EXPECT_EQ(r.err.find("--sparse"), std::string::npos) << r.err;  // the missing checkpoint is the error
  }
}
