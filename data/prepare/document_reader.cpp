#include "data/prepare/document_reader.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/util/error.h"
#include "core/util/fs.h"

namespace primus::data {
namespace {

bool is_json_file(const std::string& path) {
  auto ext = std::filesystem::path(path).extension().string();
  return ext == ".jsonl" || ext == ".json";
}

std::string text_of(const nlohmann::json& record, const std::string& key, const std::string& where) {
  if (!record.is_object()) throw FormatError(fmt::format("{}: record is not a JSON object", where));
  auto it = record.find(key);
  if (it == record.end()) throw FormatError(fmt::format("{}: record has no key '{}'", where, key));
  if (!it->is_string()) throw FormatError(fmt::format("{}: '{}' is not a string", where, key));
  return it->get<std::string>();
}

}  // namespace

DocumentReader::DocumentReader(std::vector<std::string> files, std::string json_key)
    : files_(std::move(files)), key_(std::move(json_key)) {
  for (auto& f : files_) {
    std::error_code ec;
    auto size = std::filesystem::file_size(f, ec);
    if (ec) throw IoError(fmt::format("cannot read input '{}': {}", f, ec.message()));
    total_bytes_ += size;
  }
}

DocumentReader::~DocumentReader() {
  if (f_) std::fclose(f_);
  std::free(line_buf_);
}

bool DocumentReader::open_next_file() {
  if (f_) {
    std::fclose(f_);
    f_ = nullptr;
  }
  array_docs_.clear();
  array_pos_ = 0;
  if (file_index_ >= files_.size()) return false;
  const std::string& path = files_[file_index_++];
  json_ = is_json_file(path);
  line_no_ = 0;
  f_ = std::fopen(path.c_str(), "rb");
  if (!f_) throw IoError(fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
  if (!json_) return true;
  int c;
  while ((c = std::fgetc(f_)) != EOF && std::isspace(c)) {
  }
  if (c != '[') {
    std::rewind(f_);
    return true;
  }
  // One JSON array: parse it whole (such files are small; large corpora come as JSON lines).
  std::fclose(f_);
  f_ = nullptr;
  std::string text = fs::read_file(path);
  nlohmann::json arr;
  try {
    arr = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: not valid JSON: {}", path, e.what()));
  }
  for (size_t i = 0; i < arr.size(); ++i) {
    array_docs_.push_back(text_of(arr[i], key_, fmt::format("{}: record {}", path, i)));
  }
  bytes_read_ += text.size();
  return true;
}

bool DocumentReader::next_line(std::string_view* line) {
  ssize_t n = ::getline(&line_buf_, &line_cap_, f_);
  if (n < 0) {
    if (std::ferror(f_)) {
      throw IoError(fmt::format("error reading '{}': {}", files_[file_index_ - 1], std::strerror(errno)));
    }
    return false;
  }
  bytes_read_ += static_cast<uint64_t>(n);
  ++line_no_;
  size_t len = static_cast<size_t>(n);
  if (len && line_buf_[len - 1] == '\n') --len;
  if (len && line_buf_[len - 1] == '\r') --len;
  *line = std::string_view(line_buf_, len);
  return true;
}

bool DocumentReader::next(std::string& out) {
  for (;;) {
    if (array_pos_ < array_docs_.size()) {
      std::string& doc = array_docs_[array_pos_++];
      if (doc.empty()) continue;
      out += doc;
      return true;
    }
    std::string_view line;
    if (!f_ || !next_line(&line)) {
      if (!open_next_file()) return false;
      continue;
    }
    if (!json_) {
      if (line.empty()) continue;
      out += line;
      return true;
    }
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    std::string where = fmt::format("{}:{}", files_[file_index_ - 1], line_no_);
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(fmt::format("{}: not valid JSON: {}", where, e.what()));
    }
    std::string doc = text_of(record, key_, where);
    if (doc.empty()) continue;
    out += doc;
    return true;
  }
}

}  // namespace primus::data
