// Whole-file reads and crash-safe replacement writes. A file written with
// write_file_atomic is either its old content or its complete new content, never a
// mixture: the bytes go to PATH.tmp.<pid> in the same directory, are flushed and
// fsync'ed, and only then renamed over PATH (rename within one file system is atomic),
// after which the directory is fsync'ed so the rename itself survives a power loss.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

namespace esplag {

// Where a write_file_atomic writer puts its bytes. Every write throws esplag::Error
// naming the file and the system's reason when it fails (disk full, I/O error).
class FileSink {
 public:
  void write(const void* data, size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  uint64_t bytes_written() const { return written_; }
  // The file being replaced (not the temporary one), for the writer's own messages.
  const std::string& path() const { return path_; }

  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

 private:
  friend void write_file_atomic(const std::string&, const std::function<void(FileSink&)>&);
  FileSink(std::FILE* f, std::string path, std::string tmp_path)
      : f_(f), path_(std::move(path)), tmp_path_(std::move(tmp_path)) {}

  std::FILE* f_;
  std::string path_;
  std::string tmp_path_;
  uint64_t written_ = 0;
};

// Replaces `path` with `bytes`.
void write_file_atomic(const std::string& path, std::string_view bytes);

// Replaces `path` with whatever `writer` writes into the sink, so large files are
// streamed instead of assembled in memory. If the writer throws, or any step fails, the
// temporary file is removed, `path` keeps its old content (or stays absent), and the
// exception propagates (the writer's own exception unchanged; failures of the file
// operations as esplag::Error naming the path and the system's reason). When `path`
// already exists, the new file gets its permission bits.
void write_file_atomic(const std::string& path, const std::function<void(FileSink&)>& writer);

// The whole content of `path`. Throws esplag::Error saying whether the file is missing,
// a directory, unreadable (with the system's reason), or failed mid-read.
std::string read_file(const std::string& path);

}  // namespace esplag
