// Small helpers shared by the CPU tests: a scratch directory per test, whole-file writes,
// the message of the Error a call throws, and the process's resident memory.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "core/error.h"

namespace esplag::testing {

// The process's resident memory in MiB (Linux's /proc/self/statm), or -1 without it.
inline double resident_mib() {
  std::ifstream statm("/proc/self/statm");
  size_t total = 0, resident = 0;
  if (!(statm >> total >> resident)) return -1;
  return double(resident) * double(sysconf(_SC_PAGESIZE)) / double(1 << 20);
}

// A fresh directory for the running test (named by test and process, so ctest can run
// cases in parallel), removed when the object goes away.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() / ("esplag_test_" + std::to_string(::getpid()) + "_" +
                                                      info->test_suite_name() + "_" + info->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// The message of the esplag::Error that fn throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace esplag::testing
