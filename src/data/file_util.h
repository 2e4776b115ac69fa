// File reads for the data layer, on top of io/atomic_file.h, whose errors name the file's
// role ("shard 'x.bin' does not exist"). Writes use write_file_atomic directly.
#pragma once
#include <string>
#include <string_view>

namespace esplag::data_files {

// Returns the bytes of `path`; `what` names the file's role in the error ("shard",
// "tokenizer file", "input text").
std::string read_all(const std::string& path, const char* what);

}  // namespace esplag::data_files
