// The esplag binary's options: every command answers --help and -h with its usage and every
// option its parser accepts; numeric options are range-checked and parsed strictly before
// any work, with one error naming the option, the value and the accepted range.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cli_util.h"

namespace fs = std::filesystem;

namespace {

using Result = esplag::testing::CommandResult;

fs::path root() { return esplag::testing::scratch_root("test_cli_options"); }
Result run(const std::string& args) { return esplag::testing::run_esplag(args, root()); }
void expect_error(const Result& r, const std::string& needle) { esplag::testing::expect_one_line_error(r, needle); }

// The options each command's parser accepted before the help existed (and still must).
const std::map<std::string, std::vector<std::string>> kOptions = {
    {"data prepare", {"input", "out", "tokenizer", "val-fraction", "shard-tokens"}},
    {"tokenizer train", {"input", "vocab-size", "out"}},
    {"train", {"config", "set", "out", "resume", "steps", "device"}},
    {"eval", {"checkpoint", "data", "split", "batches", "batch", "seq", "device", "json"}},
    {"sample", {"checkpoint", "prompt", "tokens", "temperature", "top-k", "seed"}},
    {"profile",
     {"config", "set", "out", "warmup", "steps", "calibration-steps", "validate", "what-if", "what-if-from"}},
    {"sparsity", {"checkpoint", "json", "mask-quality"}},
    {"export", {"checkpoint", "out", "dense", "force"}},
    {"bench train",
     {"model", "device", "batch", "seq", "steps", "warmup", "vocab", "peak-tflops", "csv", "semi-sparse", "slope",
      "masked", "activation", "pattern", "op-profile", "lora-rank", "always-sparse", "no-baseline", "sparse-dw"}},
    {"bench gemm", {"shapes", "products", "operand", "dtype", "tuning-cache", "warmup", "iters", "csv", "no-search"}},
    {"bench layer", {"kinds", "activation", "shapes", "tuning-cache", "warmup", "iters", "csv", "sparse-dw"}},
    {"bench sparsify", {"csv"}},
    {"bench attention", {"csv"}},
    {"bench vnm", {"csv"}},
    {"bench sparse-adamw", {"csv"}},
    {"bench slope-merged", {"shapes", "ranks", "warmup", "iters", "csv"}},
};

// The option names the help lists (lines "  --name ...").
std::vector<std::string> listed_options(const std::string& help) {
  std::vector<std::string> names;
  std::istringstream lines(help);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("  --", 0) != 0) continue;
    const size_t end = line.find(' ', 4);
    names.push_back(line.substr(4, end == std::string::npos ? std::string::npos : end - 4));
  }
  return names;
}

}  // namespace

TEST(CliOptions, EveryCommandAnswersHelpWithEachOptionItAccepts) {
  for (const auto& [command, options] : kOptions) {
    for (const std::string flag : {"--help", "-h"}) {
      const Result r = run(command + " " + flag);
      ASSERT_EQ(r.code, 0) << command << " " << flag << ": " << r.err;
      EXPECT_EQ(r.out.rfind("usage: esplag " + command, 0), 0u) << r.out;
      EXPECT_TRUE(r.err.empty()) << r.err;
      const std::vector<std::string> listed = listed_options(r.out);
      for (const std::string& o : options)
        EXPECT_NE(std::find(listed.begin(), listed.end(), o), listed.end()) << command << " --help lacks --" << o;
      EXPECT_NE(std::find(listed.begin(), listed.end(), "threads"), listed.end()) << command;
    }
    // Every option the help lists is one the parser accepts (an unknown one is an error even
    // with --help, which otherwise takes the place of the option's value).
    const Result help = run(command + " --help");
    for (const std::string& o : listed_options(help.out)) {
      if (o == "threads" || o == "help") continue;
      const Result r = run(command + " --" + o + " --help");
      EXPECT_EQ(r.code, 0) << command << " --" << o << ": " << r.err;
    }
  }
  // Defaults and ranges come from the same table as the parser.
  const std::string eval = run("eval --help").out;
  EXPECT_NE(eval.find("--batches N"), std::string::npos) << eval;
  EXPECT_NE(eval.find("An integer in [1, 2147483647]"), std::string::npos) << eval;
  EXPECT_NE(run("sample --help").out.find("A number in [0, 100], default 0.8."), std::string::npos);
  expect_error(run("eval --bogus --help"), "eval: unknown option --bogus");
}

TEST(CliOptions, GroupsAndTheOverviewListTheirCommands) {
  const Result all = run("--help");
  ASSERT_EQ(all.code, 0);
  for (const auto& [command, options] : kOptions)
    EXPECT_NE(all.out.find("esplag " + command + " "), std::string::npos) << command << "\n" << all.out;
  for (const std::string group : {"data", "tokenizer", "bench"}) {
    const Result r = run(group + " --help");
    ASSERT_EQ(r.code, 0) << group << ": " << r.err;
    for (const auto& [command, options] : kOptions)
      EXPECT_EQ(r.out.find("esplag " + command + " ") != std::string::npos, command.rfind(group + " ", 0) == 0)
          << group << " / " << command << "\n" << r.out;
  }
  const Result missing = run("data");
  EXPECT_NE(missing.code, 0);
  EXPECT_NE(missing.err.find("data: missing subcommand; one of:\n  esplag data prepare"), std::string::npos)
      << missing.err;
}

TEST(CliOptions, IntegersOutsideTheirRangeAreErrorsNotOtherValues) {
  const std::string input = (root() / "missing.txt").string();
  expect_error(run("tokenizer train --input " + input + " --out x.json --vocab-size 99999999999"),
               "tokenizer train: --vocab-size must be an integer in [257, 2147483647], got '99999999999'");
  expect_error(run("tokenizer train --input " + input + " --out x.json --vocab-size 256"),
               "--vocab-size must be an integer in [257, 2147483647], got '256'");
  expect_error(run("sample --checkpoint nowhere --tokens 4294967297"),
               "sample: --tokens must be an integer in [0, 1000000], got '4294967297'");
  expect_error(run("eval --checkpoint nowhere --batches 4294967298"),
               "eval: --batches must be an integer in [1, 2147483647], got '4294967298'");
  expect_error(run("eval --checkpoint nowhere --batches -3"),
               "eval: --batches must be an integer in [1, 2147483647], got '-3'");
  expect_error(run("eval --checkpoint nowhere --batches 99999999999999999999"),
               "--batches must be an integer in [1, 2147483647], got '99999999999999999999'");
  expect_error(run("eval --checkpoint nowhere --batches 1e3"), "--batches must be an integer in [1, 2147483647]");
  expect_error(run("eval --checkpoint nowhere --batches ' 3'"), "--batches must be an integer");
  expect_error(run("data prepare --input a --out b --shard-tokens 4294967297"),
               "data prepare: --shard-tokens must be an integer in [1, 2147483647], got '4294967297'");
  // --threads (run_esplag passes --threads 2 first; a second --threads goes to the command).
  const std::string binary = ESPLAG_BINARY;
  for (const std::string n : {"4294967297", "100000", "0", "-1", "two"}) {
    const Result r = esplag::testing::run_command(binary + " --threads " + n + " eval --checkpoint nowhere",
                                                  root() / "out.txt", root() / "err.txt");
    expect_error(r, "--threads must be an integer in [1, 1024], got '" + n + "'");
  }
  const Result ok = esplag::testing::run_command(binary + " --threads=1024 eval --help", root() / "out.txt",
                                                 root() / "err.txt");
  EXPECT_EQ(ok.code, 0) << ok.err;
}

TEST(CliOptions, NumbersAreFiniteAndWhole) {
  expect_error(run("sample --checkpoint nowhere --temperature nan"),
               "sample: --temperature must be a finite number, got 'nan'");
  expect_error(run("sample --checkpoint nowhere --temperature inf"), "--temperature must be a finite number");
  expect_error(run("sample --checkpoint nowhere --temperature -1"),
               "--temperature must be a number in [0, 100], got '-1'");
  expect_error(run("sample --checkpoint nowhere --temperature 0.5x"),
               "--temperature must be a number in [0, 100], got '0.5x'");
  expect_error(run("sample --checkpoint nowhere --temperature ''"), "--temperature must be a number in [0, 100]");
  expect_error(run("data prepare --input a --out b --val-fraction 1"),
               "data prepare: --val-fraction must be a number in [0, 1), got '1'");
  expect_error(run("bench train --peak-tflops 1e400"), "bench train: --peak-tflops must be");
}

TEST(CliOptions, RequiredOptionsAndUnknownArguments) {
  expect_error(run("eval"), "eval: --checkpoint is required");
  expect_error(run("export --checkpoint x --dense"), "export: --out is required");
  expect_error(run("train"), "train: --config is required (or --resume RUN_DIR");
  expect_error(run("train --resume x --out y"), "--config, --set and --out do not apply");
  expect_error(run("eval --checkpoint x --json=1"), "eval: --json takes no value");
  expect_error(run("eval --checkpoint x --batches"), "eval: --batches needs a value (N)");
  expect_error(run("eval --checkpoint x --split val --split train"), "eval: --split given twice");
  expect_error(run("eval stray"), "eval: unexpected argument 'stray'");
}
