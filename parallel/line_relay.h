// Copies a rank's output to the launcher's stdout or stderr one whole line at a time, each line
// prefixed ("[rank 3] "), so the lines of concurrent ranks never interleave mid-line. A line is
// written with a single write(), atomic on pipes up to PIPE_BUF bytes.
#pragma once
#include <string>
#include <string_view>

namespace primus::parallel {

class LineRelay {
 public:
  LineRelay(std::string prefix, int out_fd) : prefix_(std::move(prefix)), out_fd_(out_fd) {}
  // Appends bytes; writes every completed line. A line longer than kMaxLine is cut and written
  // in pieces (each prefixed), so a rank that never prints '\n' cannot grow the buffer forever.
  void feed(std::string_view bytes);
  // Writes a trailing partial line (with a '\n'); call at end of stream.
  void finish();

  static constexpr size_t kMaxLine = 64 * 1024;

 private:
  void emit(std::string_view line);
  std::string prefix_;
  int out_fd_;
  std::string pending_;
};

}  // namespace primus::parallel
