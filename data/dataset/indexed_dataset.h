// Megatron-LM's indexed dataset (MMapIndexedDataset / IndexedDataset, "MMIDIDX"), byte for
// byte, so data prepared here trains in Megatron-LM and data prepared there trains here.
//
// A dataset is a pair of files sharing a prefix P:
//   P.bin  the tokens of every sequence, back to back, each token one `dtype` element
//   P.idx  little-endian:
//     offset 0   9 bytes   magic "MMIDIDX\0\0"
//            9   uint64    version, 1
//           17   uint8     dtype code (DType below)
//           18   uint64    S, the number of sequences
//           26   uint64    D, the number of document indices (documents + 1)
//           34   int32[S]  sequence lengths, in tokens
//                int64[S]  sequence pointers: byte offset of each sequence in P.bin
//                int64[D]  document indices: document i is sequences [doc[i], doc[i+1]);
//                          doc[0] = 0 and doc[D-1] = S
// Primus writes one sequence per document (as Megatron's preprocess_data.py does without
// sentence splitting), so document i is sequence i.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace primus::data {

// Megatron's dtype codes.
enum class DType : uint8_t {
  UInt8 = 1,
  Int8 = 2,
  Int16 = 3,
  Int32 = 4,
  Int64 = 5,
  Float64 = 6,
  Float32 = 7,
  UInt16 = 8,
};
size_t dtype_size(DType d);
const char* dtype_name(DType d);
// Megatron's choice for token files: uint16 when vocab_size < 65500, else int32.
DType dtype_for_vocab(int64_t vocab_size);

std::string idx_path(const std::string& prefix);  // prefix + ".idx"
std::string bin_path(const std::string& prefix);  // prefix + ".bin"

// Streams documents into P.bin and writes P.idx at finalize(). Both are written under
// temporary names and renamed into place by finalize(), so an interrupted run never leaves a
// truncated dataset under the final names.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(std::string prefix, DType dtype);
  ~IndexedDatasetWriter();  // without finalize(): removes the temporary files
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Appends one document (one sequence). Throws RuntimeError when a token does not fit dtype.
  void add_document(std::span<const int32_t> tokens);
  void finalize();

  const std::string& prefix() const { return prefix_; }
  uint64_t documents() const { return lengths_.size(); }
  uint64_t tokens() const { return tokens_; }

 private:
  std::string prefix_, bin_tmp_;
  DType dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<char> buffer_;
  uint64_t tokens_ = 0;
  bool finalized_ = false;
};

// Read-only view of a dataset through mmap. The constructor checks the whole index against
// the two file sizes (magic, version, dtype, counts, lengths, pointers in order and inside
// P.bin, document indices in order) and throws FormatError naming the file and the field, or
// IoError when a file cannot be opened. Thread-safe after construction.
class IndexedDataset {
 public:
  explicit IndexedDataset(std::string prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  DType dtype() const { return dtype_; }
  uint64_t sequence_count() const { return seq_count_; }
  uint64_t document_count() const { return doc_idx_count_ - 1; }
  uint64_t total_tokens() const { return total_tokens_; }

  int32_t sequence_length(uint64_t i) const;
  int64_t sequence_pointer(uint64_t i) const;  // byte offset in P.bin
  int64_t document_index(uint64_t i) const;    // i in [0, document_count()]
  // Tokens of document d: its sequences' tokens concatenated.
  uint64_t document_length(uint64_t d) const;

  // Copies `count` tokens of sequence `seq`, starting `offset` tokens in, to out as int32.
  // With vocab_size > 0 every token must lie in [0, vocab_size); a token outside (or any token
  // that does not fit int32) throws FormatError naming P.bin, the document, the position and
  // the value.
  void read(uint64_t seq, uint64_t offset, uint64_t count, int32_t* out,
            int64_t vocab_size = 0) const;

  // Reads every token and checks it against vocab_size (the same error as read()).
  void check_token_range(int64_t vocab_size) const;

 private:
  struct Mapping;
  uint64_t document_of_sequence(uint64_t seq) const;
  [[noreturn]] void bad_token(uint64_t seq, uint64_t pos, int64_t value, int64_t vocab) const;

  std::string prefix_;
  std::unique_ptr<Mapping> idx_, bin_;
  DType dtype_ = DType::UInt16;
  uint64_t seq_count_ = 0, doc_idx_count_ = 0, total_tokens_ = 0;
  const unsigned char* lengths_ = nullptr;   // int32[S], unaligned
  const unsigned char* pointers_ = nullptr;  // int64[S], unaligned
  const unsigned char* doc_idx_ = nullptr;   // int64[D], unaligned
};

}  // namespace primus::data
