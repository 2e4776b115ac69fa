#include "data/file_util.h"

#include <filesystem>

#include "core/error.h"
#include "io/atomic_file.h"

namespace esplag::data_files {

namespace fs = std::filesystem;

std::string read_all(const std::string& path, const char* what) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  ESPLAG_CHECK(fs::exists(status), what, " '", path, "' does not exist");
  ESPLAG_CHECK(!fs::is_directory(status), what, " '", path, "' is a directory, expected a file");
  return read_file(path);
}

}  // namespace esplag::data_files
