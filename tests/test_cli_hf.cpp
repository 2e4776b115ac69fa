// esplag import --hf and export --hf end to end: what a user types and sees.
#include <gtest/gtest.h>

#include <filesystem>

#include "cli_util.h"

namespace {

namespace fs = std::filesystem;
using esplag::testing::expect_one_line_error;
using esplag::testing::run_esplag;

const std::string kFixtures = std::string(ESPLAG_SOURCE_DIR) + "/tests/fixtures/hf/";

fs::path root() { return esplag::testing::scratch_root("test_cli_hf"); }

TEST(CliHf, ImportThenExportAndTheirRefusals) {
  const fs::path run = root() / "run", out = root() / "out";
  auto r = run_esplag("import --hf " + kFixtures + "gpt2 --out " + run.string(), root());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("imported gpt2 (gpt2 family): 2 layers, d_model 16"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(run / "latest"));
  expect_one_line_error(run_esplag("import --hf " + kFixtures + "gpt2 --out " + run.string(), root()),
                        "is not empty; give a new directory");
  expect_one_line_error(run_esplag("import --hf " + root().string() + " --out " + (root() / "r2").string(), root()),
                        "has no config.json");
  EXPECT_FALSE(fs::exists(root() / "r2"));

  r = run_esplag("export --checkpoint " + run.string() + " --hf " + out.string(), root());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("gpt2 (GPT2LMHeadModel)"), std::string::npos) << r.out;
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"}) EXPECT_TRUE(fs::exists(out / f)) << f;
  expect_one_line_error(run_esplag("export --checkpoint " + run.string() + " --hf " + out.string(), root()),
                        "is not empty; give --force");
  EXPECT_EQ(run_esplag("export --checkpoint " + run.string() + " --hf " + out.string() + " --force", root()).code, 0);
  expect_one_line_error(run_esplag("export --checkpoint " + run.string() + " --hf " + (run / "x").string(), root()),
                        "is inside the run directory");
  expect_one_line_error(
      run_esplag("export --checkpoint " + run.string() + " --hf " + out.string() + " --dense", root()),
      "--dense and --out are for the single-file export");
  // The export imports back.
  EXPECT_EQ(run_esplag("import --hf " + out.string() + " --out " + (root() / "back").string(), root()).code, 0);
}

TEST(CliHf, Sparse24ExportRefusesWeightsThatAreNot2of4) {
  const fs::path run = root() / "dense-llama", out = root() / "sparse-out";
  ASSERT_EQ(run_esplag("import --hf " + kFixtures + "llama-gqa --out " + run.string(), root()).code, 0);
  expect_one_line_error(run_esplag("export --checkpoint " + run.string() + " --hf " + out.string() + " --sparse-24",
                                   root()),
                        "export --hf --sparse-24: layer 'blocks.0.attn.qkv' is not 2:4");
  EXPECT_FALSE(fs::exists(out));
  expect_one_line_error(
      run_esplag("export --checkpoint " + run.string() + " --dense --out " + (root() / "x.safetensors").string() +
                     " --sparse-24",
                 root()),
      "--sparse-24 is a layout of the --hf DIR export");
}

TEST(CliHf, SampleDrawsOnlyWhatTheTokenizerDecodes) {
  // The fixtures' embedding has 48 rows, their tokenizer 31 ids (transformers pads the
  // embedding the same way): ids 31..47 must never be drawn.
  const fs::path run = root() / "sample-run";
  ASSERT_EQ(run_esplag("import --hf " + kFixtures + "gpt2 --out " + run.string(), root()).code, 0);
  for (const char* how : {"--temperature 0", "--temperature 5 --top-k 0", "--temperature 1 --top-k 40"}) {
    SCOPED_TRACE(how);
    const auto r = run_esplag("sample --checkpoint " + run.string() + " --prompt the --tokens 40 " + how, root());
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.err.find("error"), std::string::npos) << r.err;
  }
}

}  // namespace
