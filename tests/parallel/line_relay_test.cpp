// Prefixed line relay: random lines fed in random chunks come out whole, in order, each with the
// prefix; a trailing partial line is flushed at the end; an endless line is cut, not hoarded.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <random>
#include <sstream>

#include "parallel/line_relay.h"

namespace primus::parallel {
namespace {

// Feeds `input` in random chunks through a relay into a pipe and returns what came out.
std::string relay(const std::string& input, std::mt19937& rng, const std::string& prefix) {
  int p[2];
  EXPECT_EQ(::pipe(p), 0);
  ::fcntl(p[1], F_SETPIPE_SZ, 1 << 20);  // the whole output fits; nobody reads concurrently
  {
    LineRelay r(prefix, p[1]);
    size_t pos = 0;
    while (pos < input.size()) {
      size_t n = std::min<size_t>(input.size() - pos, 1 + rng() % 300);
      r.feed(std::string_view(input).substr(pos, n));
      pos += n;
    }
    r.finish();
  }
  ::close(p[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(p[0], buf, sizeof buf)) > 0) out.append(buf, n);
  ::close(p[0]);
  return out;
}

TEST(LineRelay, WholePrefixedLinesInOrder) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<std::string> lines;
    std::string input;
    int count = 1 + rng() % 50;
    for (int i = 0; i < count; ++i) {
      std::string line;
      bool last = i + 1 == count;
      int len = last ? 1 + rng() % 200 : rng() % 200;  // an empty last line without '\n' is no line
      for (int j = 0; j < len; ++j) line += static_cast<char>(' ' + rng() % 95);
      lines.push_back(line);
      input += line;
      if (!last || rng() % 2) input += '\n';  // sometimes no newline at the very end
    }
    std::string want;
    for (auto& l : lines) want += "[rank 7] " + l + "\n";
    EXPECT_EQ(relay(input, rng, "[rank 7] "), want);
  }
}

TEST(LineRelay, EndlessLineIsCut) {
  std::mt19937 rng(std::random_device{}());
  std::string input(LineRelay::kMaxLine * 2 + 10, 'x');
  std::string out = relay(input, rng, "> ");
  std::string piece = "> " + std::string(LineRelay::kMaxLine, 'x') + "\n";
  EXPECT_EQ(out, piece + piece + "> " + std::string(10, 'x') + "\n");
}

}  // namespace
}  // namespace primus::parallel
