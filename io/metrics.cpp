#include "io/metrics.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/util/error.h"

namespace primus::io {
namespace fsys = std::filesystem;

namespace {

// Cuts the file back to its last newline when it does not end with one (a torn final record).
// Reads backwards from the end in small blocks, so a long history costs nothing at start-up.
void drop_torn_tail(const fsys::path& path) {
  std::error_code ec;
  uint64_t size = fsys::file_size(path, ec);
  if (ec || size == 0) return;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw IoError(fmt::format("cannot open '{}': {}", path.string(), std::strerror(errno)));
  uint64_t keep = 0, end = size;
  char buf[4096];
  bool found = false;
  while (end > 0 && !found) {
    uint64_t begin = end > sizeof buf ? end - sizeof buf : 0;
    std::fseek(f, static_cast<long>(begin), SEEK_SET);
    size_t n = std::fread(buf, 1, end - begin, f);
    for (size_t i = n; i-- > 0;) {
      if (buf[i] == '\n') {
        keep = begin + i + 1;
        found = true;
        break;
      }
    }
    end = begin;
  }
  std::fclose(f);
  if (keep == size) return;
  spdlog::warn("'{}': dropping a partial last line of {} bytes (an interrupted write)",
               path.string(), size - keep);
  fsys::resize_file(path, keep, ec);
  if (ec) throw IoError(fmt::format("cannot truncate '{}': {}", path.string(), ec.message()));
}

}  // namespace

MetricsWriter::MetricsWriter(const fsys::path& path) : path_(path) {
  std::error_code ec;
  if (path.has_parent_path()) fsys::create_directories(path.parent_path(), ec);
  drop_torn_tail(path);
  file_ = std::fopen(path.c_str(), "ab");
  if (!file_) throw IoError(fmt::format("cannot open '{}' for appending: {}", path.string(), std::strerror(errno)));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (!record.is_object()) {
    throw RuntimeError(fmt::format("metrics record for '{}' is not a JSON object: {}", path_.string(),
                                   record.dump()));
  }
  std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard lock(mu_);
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    throw IoError(fmt::format("cannot write to '{}': {}", path_.string(), std::strerror(errno)));
  }
}

void for_each_jsonl_line(const fsys::path& path, const std::function<void(int64_t, const std::string&)>& fn) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(fmt::format("cannot open '{}': {}", path.string(), std::strerror(errno)));
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    fn(n, line);
  }
  if (in.bad()) throw IoError(fmt::format("error while reading '{}'", path.string()));
}

std::vector<nlohmann::json> read_jsonl(const fsys::path& path) {
  std::vector<nlohmann::json> out;
  for_each_jsonl_line(path, [&](int64_t n, const std::string& line) {
    try {
      out.push_back(nlohmann::json::parse(line));
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(fmt::format("'{}' line {}: not JSON: {}", path.string(), n, e.what()));
    }
    if (!out.back().is_object()) {
      throw FormatError(fmt::format("'{}' line {}: not a JSON object", path.string(), n));
    }
  });
  return out;
}

}  // namespace primus::io
