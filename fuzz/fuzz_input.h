// What the fuzz targets share: the input handed to the engine's readers as a file (they
// take paths, as the engine calls them), and the rule of every target: an esplag::Error is
// a correct rejection of bad input; anything else (another exception, a sanitizer report,
// a hang, a leak) is a bug that crashes the run.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"

namespace esplag::fuzz {

// A directory of this process's own under $TMPDIR, removed at a normal exit.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const auto d = std::filesystem::temp_directory_path() / ("esplag-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch_dir(), ec);
    });
    return d;
  }();
  return dir;
}

// Writes the input to `path`, replacing what was there.
inline void write_bytes(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// Writes the input to `name` in the scratch directory and returns its path.
inline std::string write_input(const uint8_t* data, size_t size, const std::string& name) {
  const std::string path = (scratch_dir() / name).string();
  write_bytes(path, data, size);
  return path;
}

// Runs `read`; an esplag::Error is the expected answer to bad input, so it is swallowed.
// Returns whether `read` succeeded.
template <typename Fn>
bool accepts(Fn&& read) {
  try {
    read();
    return true;
  } catch (const Error&) {
    return false;
  }
}

// A property every accepted input must have; its failure is a bug, reported as a crash.
inline void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz: property violated: %s\n", what);
  std::abort();
}

}  // namespace esplag::fuzz
