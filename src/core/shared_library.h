// Vendor libraries opened at run time (dlopen) so that the binary starts where they are
// missing: cuSPARSELt, NCCL.
#pragma once
#include <string>

namespace esplag {

// The library `soname` ("libnccl.so.2"): the file, or `soname` in the folder, that the
// environment variable `env_var` names when it is set, else `soname` through the dynamic
// loader's search. Null when none loads, with *why saying what was tried and how to point
// at the library.
void* open_shared_library(const char* env_var, const char* soname, std::string* why);

}  // namespace esplag
