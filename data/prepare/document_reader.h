// Reads documents from `primus data prepare` inputs, in file order: plain text gives one
// document per non-empty line (a trailing \r is dropped); .jsonl and .json give one document
// per JSON record, the string under a key ("text"); a .json file whose first non-blank byte is
// '[' is one JSON array of records, any other .json is JSON lines (as in Megatron).
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace primus::data {

class DocumentReader {
 public:
  // Throws IoError naming a file that cannot be opened.
  DocumentReader(std::vector<std::string> files, std::string json_key);
  ~DocumentReader();
  DocumentReader(const DocumentReader&) = delete;
  DocumentReader& operator=(const DocumentReader&) = delete;

  // Appends the next document to `out` (which it does not clear); false when none is left.
  // Throws FormatError naming the file and line for a malformed JSON record.
  bool next(std::string& out);

  uint64_t bytes_read() const { return bytes_read_; }    // input bytes consumed so far
  uint64_t total_bytes() const { return total_bytes_; }  // size of all inputs

 private:
  bool open_next_file();
  bool next_line(std::string_view* line);

  std::vector<std::string> files_;
  std::string key_;
  size_t file_index_ = 0;
  std::FILE* f_ = nullptr;
  bool json_ = false;
  uint64_t line_no_ = 0;
  char* line_buf_ = nullptr;
  size_t line_cap_ = 0;
  // A .json file holding one array: its records, handed out one by one.
  std::vector<std::string> array_docs_;
  size_t array_pos_ = 0;
  uint64_t bytes_read_ = 0, total_bytes_ = 0;
};

}  // namespace primus::data
