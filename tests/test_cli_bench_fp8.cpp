// `esplag bench gemm --fp8-dense` (cuBLASLt fp8 dense against bf16 dense, docs/fp8.md):
// its option errors, checked before any GPU work, and in a CPU build the refusal.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "cli_util.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

fs::path root() { return esplag::testing::scratch_root("test_cli_bench_fp8"); }
Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }
void expect_error(const Result& r, const std::string& needle) { esplag::testing::expect_one_line_error(r, needle); }

TEST(CliBenchFp8, Fp8DenseOptionErrors) {
  expect_error(run("bench gemm --fp8-dense --dtype e4m3"),
               "bench gemm: --fp8-dense times the dense GEMMs only; --dtype is the 2:4 product's type");
  expect_error(run("bench gemm --fp8-dense=1"), "--fp8-dense takes no value");
  expect_error(run("bench gemm --fp8-dense --products up"), "--products must be fwd, bwd or fwd,bwd");
}

#ifndef ESPLAG_HAVE_CUDA
TEST(CliBenchFp8, CpuBuildRefuses) {
  expect_error(run("bench gemm --fp8-dense"), "bench gemm: needs a build configured with the cuda preset");
}
#endif

}  // namespace
