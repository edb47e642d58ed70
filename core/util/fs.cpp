#include "core/util/fs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/util/error.h"

namespace primus::fs {
namespace {

void fsync_dir(const std::filesystem::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw IoError(fmt::format("cannot open '{}': {}", path.string(), std::strerror(errno)));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw IoError(fmt::format("error while reading '{}'", path.string()));
  return std::move(ss).str();
}

void atomic_write_with(const std::filesystem::path& path,
                       const std::function<void(std::FILE*)>& writer) {
  auto dir = path.parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir);
  std::string tmp = path.string() + fmt::format(".tmp.{}", ::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw IoError(fmt::format("cannot create '{}': {}", tmp, std::strerror(errno)));
  try {
    writer(f);
    if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) {
      throw IoError(fmt::format("cannot flush '{}': {}", tmp, std::strerror(errno)));
    }
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  if (std::fclose(f) != 0) {
    std::remove(tmp.c_str());
    throw IoError(fmt::format("cannot close '{}': {}", tmp, std::strerror(errno)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw IoError(fmt::format("cannot rename '{}' to '{}': {}", tmp, path.string(),
                              std::strerror(errno)));
  }
  fsync_dir(dir);
}

void atomic_write_file(const std::filesystem::path& path, std::string_view data) {
  atomic_write_with(path, [&](std::FILE* f) {
    if (!data.empty() && std::fwrite(data.data(), 1, data.size(), f) != data.size()) {
      throw IoError(fmt::format("short write to '{}': {}", path.string(), std::strerror(errno)));
    }
  });
}

void atomic_rename(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    throw IoError(fmt::format("cannot rename '{}' to '{}': {}", from.string(), to.string(),
                              std::strerror(errno)));
  }
  fsync_dir(to.parent_path());
}

}  // namespace primus::fs
