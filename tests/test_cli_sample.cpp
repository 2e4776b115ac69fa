// esplag sample end to end, on a model imported from the committed Hugging Face fixtures
// (LLaMA-shaped, grouped-query, max_seq_len 32): a batch of prompts prints what each prompt
// prints alone, --prompts-file is --prompt a line, tokens/s go to stderr, a sequence stops
// at max_seq_len with a note, and bad options are one-line errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>

#include "cli_util.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

fs::path root() { return esplag::testing::scratch_root("test_cli_sample"); }
Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }

// The imported checkpoint (once per process).
const std::string& model() {
  static const std::string dir = [] {
    const fs::path out = root() / "llama";
    const Result r = run("import --hf " + std::string(ESPLAG_SOURCE_DIR) + "/tests/fixtures/hf/llama-gqa --out " +
                         out.string());
    EXPECT_EQ(r.code, 0) << r.err;
    return out.string();
  }();
  return dir;
}

Result sample(const std::string& args) { return run("sample --checkpoint " + model() + " --tokens 12 " + args); }

// The completion printed for a run of one prompt (its line, without the newline).
std::string alone(const std::string& prompt, const std::string& args) {
  const Result r = sample("--prompt '" + prompt + "' " + args);
  EXPECT_EQ(r.code, 0) << r.err;
  return r.out.substr(0, r.out.size() - 1);
}

}  // namespace

TEST(CliSample, ABatchPrintsWhatEachPromptPrintsAlone) {
  for (const std::string how : {"--temperature 0", "--temperature 1 --top-k 0 --top-p 0.9 --seed 3"}) {
    SCOPED_TRACE(how);
    const Result r = sample("--prompt the --prompt 'a cat the' " + how);
    ASSERT_EQ(r.code, 0) << r.err;
    // Prompt 2 of a batch seeded 3 draws as prompt 1 seeded 4.
    const std::string second = how == "--temperature 0" ? how : "--temperature 1 --top-k 0 --top-p 0.9 --seed 4";
    EXPECT_EQ(r.out, "--- 1 of 2 ---\n" + alone("the", how) + "\n--- 2 of 2 ---\n" + alone("a cat the", second) + "\n");
    EXPECT_TRUE(std::regex_match(r.err, std::regex("prefill: 8 tokens in [0-9.]+ s \\([0-9.]+ tokens/s\\); decode: "
                                                   "[0-9]+ tokens in [0-9.]+ s \\([0-9.]+ tokens/s\\)\n")))
        << r.err;
    // The same prompts from a file, one a line (a CRLF line end is not part of the prompt).
    esplag::testing::write_text(root() / "prompts.txt", "the\r\na cat the\n");
    EXPECT_EQ(sample("--prompts-file " + (root() / "prompts.txt").string() + " " + how).out, r.out);
  }
}

TEST(CliSample, ASequenceStopsAtMaxSeqLenWithANote) {
  // Greedy from "the" meets no end of text before the 32 positions are full.
  const Result r = run("sample --checkpoint " + model() + " --prompt the --tokens 100 --temperature 0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("sample: prompt 1 stopped at the model's max_seq_len=32\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("prefill: 1 tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("decode: 31 tokens"), std::string::npos) << r.err;
  esplag::testing::expect_one_line_error(sample("--prompt '" + std::string(40, 'a') + "'"),
                                         "sample: prompt 1 has 40 tokens, more than the model's max_seq_len=32");
}

TEST(CliSample, BadOptionsAreOneLineErrors) {
  using esplag::testing::expect_one_line_error;
  esplag::testing::write_text(root() / "empty.txt", "");
  expect_one_line_error(sample("--prompts-file " + (root() / "empty.txt").string()), "holds no prompt");
  expect_one_line_error(sample("--prompts-file " + (root() / "missing.txt").string()), "cannot read --prompts-file");
  expect_one_line_error(sample("--top-p 0"), "sample: --top-p must be in (0, 1], got 0");
  expect_one_line_error(sample("--top-p 1.5"), "sample: --top-p must be a number in [0, 1], got '1.5'");
  expect_one_line_error(sample("--temperature -1"), "sample: --temperature must be a number in [0, 100], got '-1'");
}
