// File access for the data layer, on top of io/atomic_file.h: reads whose errors name the
// file's role ("shard 'x.bin' does not exist"), and writes that replace a file only once
// its new content is complete, so a reader never sees a half-written shard or meta.json.
#pragma once
#include <string>
#include <string_view>

namespace esplag::data_files {

// Returns the bytes of `path`; `what` names the file's role in the error ("shard",
// "tokenizer file", "input text").
std::string read_all(const std::string& path, const char* what);

// Replaces `path` with `bytes` (written to a temporary file beside it, then renamed).
void write_replacing(const std::string& path, std::string_view bytes);

}  // namespace esplag::data_files
