// metrics.jsonl: one JSON object per line, flushed after every line, appended to across resumed
// runs, so `tail -f` and plain line-by-line readers always see whole records.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
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
// Calls `fn(line, text)` for each line of `path` that is not blank (line: 1-based), reading
// the file as a stream, so a long run's metrics are never held whole in memory. For readers that
// parse records their own way and must name the line of a bad one. Throws IoError naming the path.
void for_each_jsonl_line(const std::filesystem::path& path,
                         const std::function<void(int64_t line, const std::string& text)>& fn);

}  // namespace primus::io
