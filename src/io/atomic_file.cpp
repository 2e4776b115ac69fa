#include "io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace esplag {

namespace fs = std::filesystem;

namespace {

std::string errno_text(int err) { return std::strerror(err); }

std::string parent_dir(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// Makes the rename durable. File systems that cannot fsync a directory (EINVAL) give
// no stronger guarantee to ask for, so that is not an error.
void sync_directory(const std::string& path) {
  const std::string dir = parent_dir(path);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // e.g. a directory we may write but not list: the data is in place
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL && err != EROFS)
    fail("cannot write '", path, "': fsync of directory '", dir, "' failed: ", errno_text(err));
}

}  // namespace

void FileSink::write(const void* data, size_t size) {
  if (size == 0) return;
  errno = 0;
  const size_t n = std::fwrite(data, 1, size, f_);
  if (n != size) {
    const int err = errno;
    fail("cannot write '", path_, "': writing ", size, " bytes to temporary file '", tmp_path_, "' at offset ",
         written_ + n, " failed: ", err != 0 ? errno_text(err) : std::string("short write"));
  }
  written_ += size;
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  write_file_atomic(path, [bytes](FileSink& sink) { sink.write(bytes); });
}

void write_file_atomic(const std::string& path, const std::function<void(FileSink&)>& writer) {
  ESPLAG_CHECK(!path.empty(), "write_file_atomic: empty file name");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());

  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) {
    const int err = errno;
    std::string hint;
    const std::string dir = parent_dir(path);
    std::error_code ec;
    if (err == ENOENT && !fs::exists(dir, ec)) hint = " (directory '" + dir + "' does not exist)";
    fail("cannot write '", path, "': cannot create temporary file '", tmp, "': ", errno_text(err), hint);
  }
  std::FILE* f = ::fdopen(fd, "wb");
  if (f == nullptr) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    fail("cannot write '", path, "': fdopen of '", tmp, "' failed: ", errno_text(err));
  }
  // Until the rename, every exit path must close and remove the temporary file.
  auto abandon = [&] {
    if (f != nullptr) std::fclose(f);
    f = nullptr;
    ::unlink(tmp.c_str());
  };
  try {
    // A replacement keeps the permissions of the file it replaces (a script stays
    // executable, a private file stays private).
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::fchmod(fd, st.st_mode & 07777) != 0)
      fail("cannot write '", path, "': cannot copy its permissions to '", tmp, "': ", errno_text(errno));
    std::setvbuf(f, nullptr, _IOFBF, size_t(1) << 20);

    FileSink sink(f, path, tmp);
    writer(sink);

    if (std::fflush(f) != 0)
      fail("cannot write '", path, "': flushing temporary file '", tmp, "' failed: ", errno_text(errno));
    if (::fsync(fd) != 0)
      fail("cannot write '", path, "': fsync of temporary file '", tmp, "' failed: ", errno_text(errno));
    const int rc = std::fclose(f);
    f = nullptr;
    if (rc != 0) fail("cannot write '", path, "': closing temporary file '", tmp, "' failed: ", errno_text(errno));
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      fail("cannot write '", path, "': renaming '", tmp, "' over it failed: ", errno_text(errno));
  } catch (...) {
    abandon();
    throw;
  }
  sync_directory(path);
}

std::string read_file(const std::string& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status)) fail("cannot read '", path, "': file does not exist");
  if (fs::is_directory(status)) fail("cannot read '", path, "': it is a directory, expected a file");
  std::FILE* f = std::fopen(path.c_str(), "rbe");
  if (f == nullptr) fail("cannot read '", path, "': ", errno_text(errno));
  std::string out;
  struct stat st;
  if (::fstat(::fileno(f), &st) == 0 && S_ISREG(st.st_mode)) out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed)
    fail("cannot read '", path, "': read failed after ", out.size(), " bytes: ", err != 0 ? errno_text(err) : "I/O error");
  return out;
}

}  // namespace esplag
