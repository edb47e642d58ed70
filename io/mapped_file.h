// A whole file mapped read-only into memory: the zero-copy source behind safetensors reads and
// checkpoint verification. The mapping lives as long as the object; hand out
// std::shared_ptr<const MappedFile> to let views outlive the code that opened it.
#pragma once
#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>

namespace primus::io {

class MappedFile {
 public:
  // Maps `path` (MAP_PRIVATE, PROT_READ). Throws IoError naming the path when it cannot be
  // opened or mapped. An empty file maps to an empty span.
  static std::shared_ptr<const MappedFile> open(const std::filesystem::path& path);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  MappedFile() = default;
  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace primus::io
