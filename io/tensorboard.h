// TensorBoard event files without a protobuf dependency: each Event message is encoded by hand
// (only the fields scalars need) and framed as a TFRecord.
//
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
//   record  = uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
//
// The first record of a file carries file_version "brain.Event:2". The file is
// <dir>/events.out.tfevents.<unix seconds>.<hostname> (".<pid>.<n>" appended if that exists).
// Records are buffered and flushed every `flush_secs` seconds (checked when a scalar is added),
// on flush() and on close. Thread-safe.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace primus::io {

class TensorBoardWriter {
 public:
  // Creates `dir` if needed and a new event file in it. Throws IoError naming the file.
  explicit TensorBoardWriter(const std::filesystem::path& dir, double flush_secs = 10.0);
  ~TensorBoardWriter();  // close(); errors are logged, not thrown
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event holding one scalar, stamped with the current wall time (seconds since the epoch).
  void add_scalar(std::string_view tag, float value, int64_t step);
  // Same with an explicit wall time.
  void add_scalar(std::string_view tag, float value, int64_t step, double wall_time);
  // One event holding several scalars of the same step (as TensorBoard's own writers batch).
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& values);

  void flush();
  void close();  // flushes and closes; later adds throw RuntimeError
  const std::filesystem::path& path() const { return path_; }

 private:
  void write_event(double wall_time, int64_t step, const std::string& what);
  void flush_locked();

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  std::chrono::steady_clock::duration flush_every_;
  std::chrono::steady_clock::time_point last_flush_;
  std::mutex mu_;
};

}  // namespace primus::io
