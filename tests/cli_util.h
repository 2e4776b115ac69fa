// Helpers of the tests that run programs end to end (the esplag binary, a browser): one
// scratch directory per test process, a shell command with its exit code, stdout and
// stderr captured, whole-file reads and writes (test_util.h's write_text for paths), and the
// one-line-error expectation.
//
// ctest runs the cases of a file as parallel processes, so the scratch directory is named
// by the process. run_esplag needs ESPLAG_BINARY, which tests/CMakeLists.txt defines for
// the tests named test_cli*.
#pragma once
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "test_util.h"

namespace esplag::testing {

namespace cli_fs = std::filesystem;

// The directory esplag_<tag>_<pid> under the system temp directory, created on first use
// and removed when the process ends.
inline const cli_fs::path& scratch_root(const std::string& tag) {
  struct ScratchDir {
    cli_fs::path path;
    explicit ScratchDir(const std::string& t)
        : path(cli_fs::temp_directory_path() / ("esplag_" + t + "_" + std::to_string(::getpid()))) {
      cli_fs::remove_all(path);
      cli_fs::create_directories(path);
    }
    ~ScratchDir() {
      std::error_code ec;
      cli_fs::remove_all(path, ec);
    }
  };
  static const ScratchDir dir(tag);
  return dir.path;
}

inline std::string read_text(const cli_fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_text(const cli_fs::path& p, const std::string& text) { write_text(p.string(), text); }

struct CommandResult {
  int code = -1;  // the exit status, -1 when the command did not exit normally
  std::string out, err;
};

// Runs `cmd` through the shell with stdin from /dev/null, stdout and stderr going to
// out_file and err_file, and returns the exit status and both texts.
inline CommandResult run_command(const std::string& cmd, const cli_fs::path& out_file, const cli_fs::path& err_file) {
  const std::string full = cmd + " >'" + out_file.string() + "' 2>'" + err_file.string() + "' </dev/null";
  const int status = std::system(full.c_str());
  CommandResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(out_file);
  r.err = read_text(err_file);
  return r;
}

// Expects failure with exactly one line on stderr that contains `needle`.
inline void expect_one_line_error(const CommandResult& r, const std::string& needle) {
  EXPECT_NE(r.code, 0) << "stdout: " << r.out;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "stderr: " << r.err;
}

// The training lines of a run's metrics.jsonl, in order.
struct LoggedStep {
  double loss, grad_norm;
  int64_t tokens_seen;
};
inline std::vector<LoggedStep> logged_steps(const cli_fs::path& run_dir) {
  std::vector<LoggedStep> out;
  std::istringstream in(read_text(run_dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back({j["loss"], j["grad_norm"], j["tokens_seen"]});
  }
  return out;
}

// The largest relative difference between the delayed fp8 amax histories of two checkpoints
// (optimizer.safetensors' fp8_amax_history.<module> [2, N + 1]: X's row, then dY's), each
// of a's dY values multiplied by dy_ratio first (runs that scale their losses differently).
// A failure when they hold different modules, or none.
inline double amax_history_difference(const cli_fs::path& a, const cli_fs::path& b, float dy_ratio) {
  const auto histories = [](const cli_fs::path& ck) {
    std::map<std::string, Tensor> out;
    for (auto& [name, t] : load_safetensors((ck / "optimizer.safetensors").string()).tensors)
      if (name.rfind("fp8_amax_history.", 0) == 0) out.emplace(name, std::move(t));
    return out;
  };
  const auto ha = histories(a), hb = histories(b);
  EXPECT_FALSE(ha.empty()) << a;
  EXPECT_EQ(ha.size(), hb.size());
  double worst = 0;
  for (const auto& [name, x] : ha) {
    const auto it = hb.find(name);
    if (it == hb.end() || it->second.numel() != x.numel()) {
      ADD_FAILURE() << name << ": missing from " << b << " or of another length";
      continue;
    }
    const int64_t per = x.numel() / 2;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double u = x.data<float>()[i] * (i >= per ? dy_ratio : 1.0f), v = it->second.data<float>()[i];
      if (u != v) worst = std::max(worst, std::abs(u - v) / std::max(std::abs(u), std::abs(v)));
    }
  }
  return worst;
}

#ifdef ESPLAG_BINARY
// `esplag --threads 2 <args>`, its output captured in files under `dir`.
inline CommandResult run_esplag(const std::string& args, const cli_fs::path& dir) {
  return run_command(std::string(ESPLAG_BINARY) + " --threads 2 " + args, dir / "stdout.txt", dir / "stderr.txt");
}

// A byte-level dataset of 400 numbered verses prepared by `esplag data prepare` under
// `dir`/data (10% validation); returns that folder.
inline cli_fs::path prepared_verses(const cli_fs::path& dir) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "And God said, Let there be light: and there was light " + std::to_string(i) + ".\n";
  write_text(dir / "corpus.txt", text);
  const cli_fs::path data = dir / "data";
  const CommandResult r = run_esplag("data prepare --input " + (dir / "corpus.txt").string() + " --out " +
                                     data.string() + " --val-fraction 0.1", dir);
  EXPECT_EQ(r.code, 0) << r.err;
  return data;
}
#endif

}  // namespace esplag::testing
