#include "parallel/line_relay.h"

#include <unistd.h>

#include <cerrno>

namespace primus::parallel {

void LineRelay::feed(std::string_view bytes) {
  pending_.append(bytes);
  size_t start = 0;
  while (true) {
    size_t nl = pending_.find('\n', start);
    if (nl == std::string::npos) break;
    emit(std::string_view(pending_).substr(start, nl - start));
    start = nl + 1;
  }
  pending_.erase(0, start);
  while (pending_.size() >= kMaxLine) {
    emit(std::string_view(pending_).substr(0, kMaxLine));
    pending_.erase(0, kMaxLine);
  }
}

void LineRelay::finish() {
  if (!pending_.empty()) emit(pending_);
  pending_.clear();
}

void LineRelay::emit(std::string_view line) {
  std::string out;
  out.reserve(prefix_.size() + line.size() + 1);
  out.append(prefix_).append(line).push_back('\n');
  const char* p = out.data();
  size_t n = out.size();
  while (n > 0) {
    ssize_t w = ::write(out_fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // the launcher's own output is gone (closed pipe): keep supervising regardless
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace primus::parallel
