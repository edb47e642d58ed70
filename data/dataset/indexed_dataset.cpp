#include "data/dataset/indexed_dataset.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "core/util/error.h"
#include "core/util/fs.h"

namespace primus::data {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;  // 34

template <class T>
T load(const unsigned char* p) {  // the .idx arrays start at offset 34: not aligned
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

bool known_dtype(uint8_t code) { return code >= 1 && code <= 8; }
bool integer_dtype(DType d) { return d != DType::Float32 && d != DType::Float64; }

}  // namespace

size_t dtype_size(DType d) {
  switch (d) {
    case DType::UInt8:
    case DType::Int8:
      return 1;
    case DType::Int16:
    case DType::UInt16:
      return 2;
    case DType::Int32:
    case DType::Float32:
      return 4;
    case DType::Int64:
    case DType::Float64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::UInt8: return "uint8";
    case DType::Int8: return "int8";
    case DType::Int16: return "int16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::Float64: return "float64";
    case DType::Float32: return "float32";
    case DType::UInt16: return "uint16";
  }
  return "?";
}

DType dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < 65500 ? DType::UInt16 : DType::Int32;
}

std::string idx_path(const std::string& prefix) { return prefix + ".idx"; }
std::string bin_path(const std::string& prefix) { return prefix + ".bin"; }

// ---------------------------------------------------------------------------------------------
// Writer

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, DType dtype)
    : prefix_(std::move(prefix)), dtype_(dtype) {
  if (!integer_dtype(dtype_)) {
    throw ConfigError(fmt::format("{}: token files need an integer dtype, not {}", prefix_,
                                  dtype_name(dtype_)));
  }
  auto dir = std::filesystem::path(prefix_).parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir);
  bin_tmp_ = fmt::format("{}.tmp.{}", bin_path(prefix_), ::getpid());
  bin_ = std::fopen(bin_tmp_.c_str(), "wb");
  if (!bin_) throw IoError(fmt::format("cannot create '{}': {}", bin_tmp_, std::strerror(errno)));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_) std::fclose(bin_);
  if (!finalized_) std::remove(bin_tmp_.c_str());
}

namespace {
template <class T>
void append_tokens(std::span<const int32_t> tokens, std::vector<char>& buf, const std::string& prefix,
                   uint64_t doc) {
  size_t at = buf.size();
  buf.resize(at + tokens.size() * sizeof(T));
  for (size_t i = 0; i < tokens.size(); ++i) {
    int32_t t = tokens[i];
    if (t < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
        t > static_cast<int64_t>(std::numeric_limits<T>::max())) {
      throw RuntimeError(fmt::format("{}: token {} of document {} is {}, which does not fit the "
                                     "dataset's dtype",
                                     prefix, i, doc, t));
    }
    T v = static_cast<T>(t);
    std::memcpy(buf.data() + at + i * sizeof(T), &v, sizeof(T));
  }
}
}  // namespace

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  PRIMUS_CHECK(!finalized_, "{}: add_document after finalize", prefix_);
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw RuntimeError(fmt::format("{}: document {} has {} tokens; the format allows 2^31-1", prefix_,
                                   lengths_.size(), tokens.size()));
  }
  uint64_t doc = lengths_.size();
  switch (dtype_) {
    case DType::UInt8: append_tokens<uint8_t>(tokens, buffer_, prefix_, doc); break;
    case DType::Int8: append_tokens<int8_t>(tokens, buffer_, prefix_, doc); break;
    case DType::Int16: append_tokens<int16_t>(tokens, buffer_, prefix_, doc); break;
    case DType::UInt16: append_tokens<uint16_t>(tokens, buffer_, prefix_, doc); break;
    case DType::Int32: append_tokens<int32_t>(tokens, buffer_, prefix_, doc); break;
    case DType::Int64: append_tokens<int64_t>(tokens, buffer_, prefix_, doc); break;
    default: break;
  }
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  tokens_ += tokens.size();
  if (buffer_.size() >= (4u << 20)) {
    if (std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) != buffer_.size()) {
      throw IoError(fmt::format("cannot write '{}': {}", bin_tmp_, std::strerror(errno)));
    }
    buffer_.clear();
  }
}

void IndexedDatasetWriter::finalize() {
  PRIMUS_CHECK(!finalized_, "{}: finalize twice", prefix_);
  if (!buffer_.empty() && std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) != buffer_.size()) {
    throw IoError(fmt::format("cannot write '{}': {}", bin_tmp_, std::strerror(errno)));
  }
  buffer_.clear();
  if (std::fflush(bin_) != 0 || ::fsync(::fileno(bin_)) != 0 || std::fclose(bin_) != 0) {
    bin_ = nullptr;
    throw IoError(fmt::format("cannot flush '{}': {}", bin_tmp_, std::strerror(errno)));
  }
  bin_ = nullptr;

  const uint64_t n = lengths_.size();
  std::string idx;
  idx.reserve(kHeaderBytes + n * 20 + 8);
  idx.append(kMagic, sizeof(kMagic));
  put<uint64_t>(idx, kVersion);
  put<uint8_t>(idx, static_cast<uint8_t>(dtype_));
  put<uint64_t>(idx, n);
  put<uint64_t>(idx, n + 1);
  for (int32_t len : lengths_) put<int32_t>(idx, len);
  int64_t ptr = 0;
  for (int32_t len : lengths_) {
    put<int64_t>(idx, ptr);
    ptr += static_cast<int64_t>(len) * static_cast<int64_t>(dtype_size(dtype_));
  }
  for (uint64_t d = 0; d <= n; ++d) put<int64_t>(idx, static_cast<int64_t>(d));

  fs::atomic_rename(bin_tmp_, bin_path(prefix_));
  fs::atomic_write_file(idx_path(prefix_), idx);
  finalized_ = true;
}

// ---------------------------------------------------------------------------------------------
// Reader

struct IndexedDataset::Mapping {
  std::string path;
  int fd = -1;
  const unsigned char* data = nullptr;
  size_t size = 0;

  explicit Mapping(std::string p) : path(std::move(p)) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw IoError(fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throw IoError(fmt::format("cannot stat '{}': {}", path, std::strerror(errno)));
    }
    size = static_cast<size_t>(st.st_size);
    if (size > 0) {
      void* p2 = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (p2 == MAP_FAILED) {
        ::close(fd);
        throw IoError(fmt::format("cannot mmap '{}': {}", path, std::strerror(errno)));
      }
      data = static_cast<const unsigned char*>(p2);
    }
  }
  ~Mapping() {
    if (data) ::munmap(const_cast<unsigned char*>(data), size);
    if (fd >= 0) ::close(fd);
  }
};

IndexedDataset::~IndexedDataset() = default;

IndexedDataset::IndexedDataset(std::string prefix) : prefix_(std::move(prefix)) {
  idx_ = std::make_unique<Mapping>(idx_path(prefix_));
  bin_ = std::make_unique<Mapping>(bin_path(prefix_));
  const std::string& ip = idx_->path;
  const std::string& bp = bin_->path;
  const unsigned char* p = idx_->data;
  const size_t size = idx_->size;
  if (size < kHeaderBytes) {
    throw FormatError(fmt::format("{}: truncated header: {} bytes, the header alone is {}", ip, size,
                                  kHeaderBytes));
  }
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) {
    throw FormatError(fmt::format("{}: bad magic: not a Megatron MMIDIDX index file", ip));
  }
  if (uint64_t v = load<uint64_t>(p + 9); v != kVersion) {
    throw FormatError(fmt::format("{}: version is {}, only version {} is known", ip, v, kVersion));
  }
  uint8_t code = p[17];
  if (!known_dtype(code)) throw FormatError(fmt::format("{}: dtype code {} is unknown (1..8)", ip, code));
  dtype_ = static_cast<DType>(code);
  if (!integer_dtype(dtype_)) {
    throw FormatError(fmt::format("{}: dtype code {} ({}) cannot hold token ids", ip, code,
                                  dtype_name(dtype_)));
  }
  seq_count_ = load<uint64_t>(p + 18);
  doc_idx_count_ = load<uint64_t>(p + 26);
  // Sizes in 128 bits: a corrupt count must not wrap around into a plausible size.
  unsigned __int128 expected = static_cast<unsigned __int128>(kHeaderBytes) +
                               static_cast<unsigned __int128>(seq_count_) * 12 +
                               static_cast<unsigned __int128>(doc_idx_count_) * 8;
  if (expected != size) {
    std::string hint = expected + seq_count_ == size
                           ? " (it has one more byte per sequence: a multimodal index, which is not supported)"
                           : expected > size ? " (truncated?)" : "";
    throw FormatError(fmt::format(
        "{}: sequence_count {} and document_count {} need {} bytes, the file has {}{}", ip,
        seq_count_, doc_idx_count_, static_cast<uint64_t>(std::min<unsigned __int128>(expected, UINT64_MAX)),
        size, hint));
  }
  if (doc_idx_count_ < 1) throw FormatError(fmt::format("{}: document_count is 0, expected at least 1", ip));
  lengths_ = p + kHeaderBytes;
  pointers_ = lengths_ + seq_count_ * 4;
  doc_idx_ = pointers_ + seq_count_ * 8;

  const int64_t isz = static_cast<int64_t>(dtype_size(dtype_));
  const auto bin_size = static_cast<int64_t>(bin_->size);
  int64_t prev_end = 0;
  for (uint64_t i = 0; i < seq_count_; ++i) {
    int32_t len = sequence_length(i);
    int64_t ptr = sequence_pointer(i);
    if (len < 0) throw FormatError(fmt::format("{}: sequence_lengths[{}] = {} is negative", ip, i, len));
    if (ptr < prev_end || ptr % isz != 0) {
      throw FormatError(fmt::format(
          "{}: sequence_pointers[{}] = {} is not a multiple of {} at or after the end of sequence "
          "{} (byte {})",
          ip, i, ptr, isz, i == 0 ? 0 : i - 1, prev_end));
    }
    if (ptr > bin_size || len * isz > bin_size - ptr) {
      // Unsigned: a pointer near 2^63 must not overflow the message (ptr >= 0 and len >= 0 here).
      throw FormatError(fmt::format("{}: sequence {} spans bytes [{}, {}) but the file has {} bytes "
                                    "(truncated .bin?)",
                                    bp, i, ptr, static_cast<uint64_t>(ptr) + static_cast<uint64_t>(len * isz),
                                    bin_size));
    }
    prev_end = ptr + len * isz;
    total_tokens_ += static_cast<uint64_t>(len);
  }
  if (document_index(0) != 0) {
    throw FormatError(fmt::format("{}: document_indices[0] = {}, expected 0", ip, document_index(0)));
  }
  for (uint64_t d = 1; d < doc_idx_count_; ++d) {
    if (document_index(d) < document_index(d - 1)) {
      throw FormatError(fmt::format("{}: document_indices[{}] = {} is less than the one before ({})",
                                    ip, d, document_index(d), document_index(d - 1)));
    }
  }
  if (static_cast<uint64_t>(document_index(doc_idx_count_ - 1)) != seq_count_) {
    throw FormatError(fmt::format("{}: document_indices[{}] = {}, expected sequence_count {}", ip,
                                  doc_idx_count_ - 1, document_index(doc_idx_count_ - 1), seq_count_));
  }
}

int32_t IndexedDataset::sequence_length(uint64_t i) const { return load<int32_t>(lengths_ + i * 4); }
int64_t IndexedDataset::sequence_pointer(uint64_t i) const { return load<int64_t>(pointers_ + i * 8); }
int64_t IndexedDataset::document_index(uint64_t i) const { return load<int64_t>(doc_idx_ + i * 8); }

uint64_t IndexedDataset::document_length(uint64_t d) const {
  uint64_t n = 0;
  for (auto s = static_cast<uint64_t>(document_index(d)); s < static_cast<uint64_t>(document_index(d + 1)); ++s) {
    n += static_cast<uint64_t>(sequence_length(s));
  }
  return n;
}

uint64_t IndexedDataset::document_of_sequence(uint64_t seq) const {
  uint64_t lo = 0, hi = doc_idx_count_ - 1;  // find d with doc[d] <= seq < doc[d+1]
  while (hi - lo > 1) {
    uint64_t mid = lo + (hi - lo) / 2;
    if (static_cast<uint64_t>(document_index(mid)) <= seq) lo = mid;
    else hi = mid;
  }
  return lo;
}

void IndexedDataset::bad_token(uint64_t seq, uint64_t pos, int64_t value, int64_t vocab) const {
  std::string range = vocab > 0 ? fmt::format("[0, {}) (the vocabulary)", vocab)
                                : fmt::format("[0, {}]", std::numeric_limits<int32_t>::max());
  throw FormatError(fmt::format("{}: document {} (sequence {}) token {} is {}, outside {}",
                                bin_->path, document_of_sequence(seq), seq, pos, value, range));
}

namespace {
template <class T>
int64_t convert(const unsigned char* src, uint64_t count, int32_t* out, int64_t limit) {
  for (uint64_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    auto w = static_cast<int64_t>(v);
    if (w < 0 || w >= limit) return static_cast<int64_t>(i);
    out[i] = static_cast<int32_t>(w);
  }
  return -1;
}
}  // namespace

void IndexedDataset::read(uint64_t seq, uint64_t offset, uint64_t count, int32_t* out,
                          int64_t vocab_size) const {
  PRIMUS_CHECK(seq < seq_count_, "{}: sequence {} out of range ({})", prefix_, seq, seq_count_);
  PRIMUS_CHECK(offset + count <= static_cast<uint64_t>(sequence_length(seq)),
               "{}: tokens [{}, {}) of sequence {} out of range ({})", prefix_, offset,
               offset + count, seq, sequence_length(seq));
  const size_t isz = dtype_size(dtype_);
  const unsigned char* src = bin_->data + sequence_pointer(seq) + offset * isz;
  const int64_t limit = vocab_size > 0 ? vocab_size : int64_t{std::numeric_limits<int32_t>::max()} + 1;
  int64_t bad = -1;
  switch (dtype_) {
    case DType::UInt8: bad = convert<uint8_t>(src, count, out, limit); break;
    case DType::Int8: bad = convert<int8_t>(src, count, out, limit); break;
    case DType::Int16: bad = convert<int16_t>(src, count, out, limit); break;
    case DType::UInt16: bad = convert<uint16_t>(src, count, out, limit); break;
    case DType::Int32: bad = convert<int32_t>(src, count, out, limit); break;
    case DType::Int64: bad = convert<int64_t>(src, count, out, limit); break;
    default: break;
  }
  if (bad >= 0) {
    int64_t value = 0;
    std::memcpy(&value, src + bad * isz, isz);  // little-endian: the low bytes
    if (isz < 8 && dtype_ != DType::UInt8 && dtype_ != DType::UInt16) {
      value = (value << (64 - 8 * isz)) >> (64 - 8 * isz);  // sign-extend
    }
    bad_token(seq, offset + bad, value, vocab_size);
  }
}

void IndexedDataset::check_token_range(int64_t vocab_size) const {
  std::vector<int32_t> buf;
  for (uint64_t s = 0; s < seq_count_; ++s) {
    auto len = static_cast<uint64_t>(sequence_length(s));
    for (uint64_t off = 0; off < len; off += 1 << 20) {
      uint64_t n = std::min<uint64_t>(len - off, 1 << 20);
      buf.resize(n);
      read(s, off, n, buf.data(), vocab_size);
    }
  }
}

}  // namespace primus::data
