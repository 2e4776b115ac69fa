// launch_local_ranks (`esplag train --gpus N`): the children's launch variables, the error
// naming the first rank that failed, the others stopped (SIGKILL after the grace period),
// and SIGINT forwarded to the children.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include "core/error.h"
#include "dist/launch.h"
#include "dist/world.h"

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// A scratch directory for this test process, removed when it ends.
fs::path scratch() {
  struct Dir {
    fs::path path = fs::temp_directory_path() / ("esplag_test_launch_" + std::to_string(::getpid()));
    Dir() { fs::create_directories(path); }
    ~Dir() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs `script` with /bin/sh in n ranks; the error message, or "" when it returned `code`.
std::string launch_error(const std::string& script, int n, double grace_s = 30) {
  try {
    esplag::launch_local_ranks({"/bin/sh", "-c", script}, n, grace_s);
    return "";
  } catch (const esplag::Error& e) {
    return e.what();
  }
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

TEST(Launch, EachRankGetsItsEnvironment) {
  const fs::path dir = scratch() / "env";
  fs::create_directories(dir);
  ::setenv("MASTER_ADDR", "10.9.9.9", 1);  // replaced, not inherited
  const int code = esplag::launch_local_ranks(
      {"/bin/sh", "-c",
       "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $ESPLAG_LAUNCHER $HOME > " + dir.string() +
           "/$RANK; echo $MASTER_PORT > " + dir.string() + "/port$RANK"},
      3);
  ::unsetenv("MASTER_ADDR");
  EXPECT_EQ(code, 0);
  const std::string home = std::getenv("HOME") ? std::getenv("HOME") : "";
  for (int r = 0; r < 3; ++r) {
    const std::string R = std::to_string(r);
    EXPECT_EQ(read(dir / R), R + " 3 " + R + " 3 127.0.0.1 esplag " + home + "\n");
    EXPECT_EQ(read(dir / ("port" + R)), read(dir / "port0"));
  }
  EXPECT_GT(std::stoi(read(dir / "port0")), 0);
}

TEST(Launch, ChildrenReadTheirWorld) {
  // What the children get is what world_from_env understands.
  const std::map<std::string, std::string> env = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                                                  {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                                  {"MASTER_PORT", "4242"}, {"ESPLAG_LAUNCHER", "esplag"}};
  const esplag::World w = esplag::world_from_env([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
  EXPECT_EQ(w.describe(), "rank 1 of 2 (local 1 of 2), esplag, rendezvous 127.0.0.1:4242");
}

TEST(Launch, FailureNamesTheFirstRankAndStopsTheOthers) {
  const auto start = Clock::now();
  const std::string error = launch_error("if [ $RANK = 1 ]; then exit 3; fi; exec sleep 30", 3);
  EXPECT_EQ(error, "rank 1 of 3 failed (exit status 3); the other ranks were stopped");
  EXPECT_LT(seconds_since(start), 10);  // the others got SIGTERM, not 30 s of sleep
}

TEST(Launch, SignalOfAKilledRank) {
  const std::string error = launch_error("if [ $RANK = 0 ]; then kill -9 $$; fi; exec sleep 30", 2);
  EXPECT_NE(error.find("rank 0 of 2 failed (signal 9"), std::string::npos) << error;
}

TEST(Launch, RanksIgnoringSigtermAreKilledAfterTheGracePeriod) {
  const auto start = Clock::now();
  const std::string error = launch_error("if [ $RANK = 2 ]; then exit 1; fi; trap '' TERM; exec sleep 30", 3, 0.5);
  EXPECT_EQ(error, "rank 2 of 3 failed (exit status 1); the other ranks were stopped");
  EXPECT_LT(seconds_since(start), 10);
}

TEST(Launch, AllSucceed) { EXPECT_EQ(launch_error("exit 0", 4), ""); }

TEST(Launch, ProgramNameWithoutPathRunsThisProgram) {
  // The test binary itself, found through /proc/self/exe, listing no test.
  EXPECT_EQ(esplag::launch_local_ranks({"test_launch", "--gtest_filter=NoSuchTest", "--gtest_list_tests"}, 2), 0);
}

TEST(Launch, MissingProgram) {
  try {
    esplag::launch_local_ranks({"/nonexistent/esplag"}, 2);
    FAIL();
  } catch (const esplag::Error& e) {
    EXPECT_NE(std::string(e.what()).find("failed (exit status 127)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(esplag::launch_local_ranks({"/bin/true"}, 0), esplag::Error);
}

TEST(Launch, SigintIsForwardedToEveryRank) {
  const fs::path dir = scratch() / "sigint";
  fs::create_directories(dir);
  const std::string d = dir.string();
  // Each rank says it started, then waits; on SIGINT it writes a file and exits 7.
  const std::string script = "trap 'echo $RANK > " + d + "/int$RANK; exit 7' INT; touch " + d +
                             "/started$RANK; while :; do sleep 0.05; done";
  std::thread interrupter([&] {
    const auto start = Clock::now();
    while (!(fs::exists(dir / "started0") && fs::exists(dir / "started1")) && seconds_since(start) < 20)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ::kill(::getpid(), SIGINT);
  });
  const int code = esplag::launch_local_ranks({"/bin/sh", "-c", script}, 2);
  interrupter.join();
  EXPECT_EQ(code, 7);  // the children's own exit code, not a failure
  EXPECT_EQ(read(dir / "int0"), "0\n");
  EXPECT_EQ(read(dir / "int1"), "1\n");
}

}  // namespace
