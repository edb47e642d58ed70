// The safetensors format (Hugging Face): an 8-byte little-endian header length N, N bytes of
// JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {str: str}}, then the data buffer. Offsets are relative to the start of the data buffer;
// tensors are row-major and little-endian, and together cover the buffer exactly.
//
// The reader maps the file read-only and validates it strictly before handing out anything:
// every problem is a FormatError naming the file and, where there is one, the tensor.
// The writer is deterministic (same tensors, same bytes) and writes atomically.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/digest_writer.h"
#include "io/dtype.h"
#include "io/tensor_blob.h"

namespace primus::io {

// A header larger than this is refused (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // bytes from the start of the data buffer
  uint64_t nbytes = 0;  // == numel(shape) * dtype_size(dtype)
};

class SafetensorsFile {
 public:
  // Maps and validates `path`. IoError when it cannot be read, FormatError when it is not a
  // valid safetensors file.
  static SafetensorsFile open(const std::filesystem::path& path);
  // Validates a file already in memory; `bytes` must stay valid while `owner` lives. `source`
  // names it in messages.
  static SafetensorsFile parse(std::span<const std::byte> bytes, std::shared_ptr<const void> owner,
                               std::string source);

  const std::string& source() const { return source_; }
  bool contains(std::string_view name) const { return index_.find(name) != index_.end(); }
  // Throws FormatError naming the file and a few of the names it has.
  const TensorInfo& info(std::string_view name) const;
  // Ordered by offset in the file.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // Sorted.
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor's bytes in the mapping (valid while this object or a blob from it lives).
  std::span<const std::byte> data(std::string_view name) const;
  // A zero-copy view that keeps the mapping alive on its own.
  TensorBlob blob(std::string_view name) const;
  // A copy of the elements; FormatError naming file and tensor if T does not fit the dtype
  // (see element_type_matches).
  template <class T>
  std::vector<T> read_as(std::string_view name) const;
  // The elements converted to fp32 (from F32, F64, BF16, F16).
  std::vector<float> read_fp32(std::string_view name) const;

 private:
  [[noreturn]] void throw_type_mismatch(const TensorInfo& info, DType want) const;

  std::string source_;
  std::shared_ptr<const void> owner_;
  std::span<const std::byte> buffer_;  // the data buffer, after the header
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

template <class T>
std::vector<T> SafetensorsFile::read_as(std::string_view name) const {
  const TensorInfo& i = info(name);
  if (!element_type_matches<T>(i.dtype)) throw_type_mismatch(i, dtype_of<T>());
  return blob(name).to_vector<T>();
}

class SafetensorsWriter {
 public:
  // Adds a tensor whose bytes stay owned by the caller and must stay valid until write()
  // returns: saving a trainer's weights costs no copy. nbytes must equal
  // numel(shape) * dtype_size(dtype). Names are unique, non-empty, valid UTF-8, and not
  // "__metadata__".
  void add(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t nbytes);
  // Same, but copies the bytes now.
  void add_copy(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
                size_t nbytes);
  // Adds a blob (it keeps its own bytes alive, or borrows under the blob's rules).
  void add(std::string name, TensorBlob blob);
  void set_metadata(std::string key, std::string value);

  size_t size() const { return tensors_.size(); }
  // The JSON header, padded with spaces to a multiple of 8 bytes, as it will be written.
  // Tensors are laid out by element size, largest first, then by name: deterministic, and with
  // an 8-aligned header every tensor is aligned to its element size in the file.
  std::string header() const;
  // Size of the whole file that write() produces.
  uint64_t file_size() const;

  // Writes the file atomically (temporary file, fsync, rename). Returns what was written.
  FileDigest write(const std::filesystem::path& path) const;
  // Streams the file into `f`; `where` names it in errors.
  FileDigest write_to(std::FILE* f, const std::string& where) const;

 private:
  using Entry = std::pair<const std::string, TensorBlob>;
  std::vector<const Entry*> layout() const;

  std::map<std::string, TensorBlob, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace primus::io
