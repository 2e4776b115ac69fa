#include "core/shared_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

namespace esplag {

void* open_shared_library(const char* env_var, const char* soname, std::string* why) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(env_var); env && *env) {
    std::error_code ec;
    const std::filesystem::path p(env);
    candidates.push_back(std::filesystem::is_directory(p, ec) ? (p / soname).string() : p.string());
  }
  candidates.push_back(soname);
  std::string tried;
  for (const std::string& c : candidates) {
    if (void* so = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL)) return so;
    const char* err = ::dlerror();
    tried += (tried.empty() ? "" : "; ") + (err ? std::string(err) : c + ": not found");
  }
  if (why)
    *why = "cannot load " + std::string(soname) + " (" + tried + "); put its folder on LD_LIBRARY_PATH or name the " +
           "file or folder in " + env_var;
  return nullptr;
}

}  // namespace esplag
