// Writes bytes to a FILE* while keeping their count and CRC-32C, so a checkpoint's manifest is
// computed from what was written, without reading the file back.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace primus::io {

// Size in bytes and CRC-32C of a whole file.
struct FileDigest {
  uint64_t size = 0;
  uint32_t crc32c = 0;
  bool operator==(const FileDigest&) const = default;
};

class DigestWriter {
 public:
  // `where` names the file in error messages. The FILE* stays owned by the caller.
  DigestWriter(std::FILE* f, std::string where) : f_(f), where_(std::move(where)) {}

  // Throws IoError naming the file on a short write.
  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  const FileDigest& digest() const { return digest_; }

 private:
  std::FILE* f_;
  std::string where_;
  FileDigest digest_;
};

}  // namespace primus::io
