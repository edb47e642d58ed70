// metrics.jsonl: one JSON object per line, flushed after every line, appended to across resumed
// runs, so `tail -f` and plain line-by-line readers always see whole records.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

namespace primus::io {

class MetricsWriter {
 public:
  // Opens `path` for appending (creating its folder). When a crash cut the file's last line
  // short, that partial line is removed first (with a warning) so every line stays valid JSON.
  // Throws IoError naming the path.
  explicit MetricsWriter(const std::filesystem::path& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Appends `record` (must be a JSON object) as one line and flushes it. Non-finite floats
  // are written as null (JSON has no NaN). Thread-safe.
  void write(const nlohmann::json& record);
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  std::mutex mu_;
};

// Reads a JSONL file written by MetricsWriter; FormatError naming the file and line number for
// a line that is not a JSON object. Empty lines are skipped.
std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path);
// The same, with each record's 1-based line number, for readers whose own checks of a record
// must name its line.
struct JsonlRecord {
  int64_t line = 0;
  nlohmann::json value;
};
std::vector<JsonlRecord> read_jsonl_records(const std::filesystem::path& path);

}  // namespace primus::io
