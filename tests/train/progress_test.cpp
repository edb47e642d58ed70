// The progress line's average tokens/s: the first steps of a run left out, started afresh after
// its number of lines (Primus' log_avg_skip_iterations / log_avg_reset_interval).
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/core/test_util.h"
#include "train/progress.h"
#include "train/training_args.h"

using primus::train::ProgressReporter;
using primus::train::StepStats;

namespace {
// The average each progress line shows (-1: none), captured from spdlog's default logger.
std::vector<double> averages(const std::string& log) {
  std::vector<double> out;
  std::istringstream in(log);
  static const std::regex avg(R"( tok/s \(avg (\d+)\))");
  for (std::string l; std::getline(in, l);) {
    if (l.find(" tok/s") == std::string::npos) continue;
    std::smatch m;
    out.push_back(std::regex_search(l, m, avg) ? std::stod(m[1].str()) : -1.0);
  }
  return out;
}

// Steps 1..n of `tokens` each, taking seconds[i].
void feed(ProgressReporter& p, const std::vector<double>& seconds, double tokens = 100) {
  for (size_t i = 0; i < seconds.size(); ++i) {
    StepStats s;
    s.step = static_cast<int64_t>(i) + 1;
    s.tokens = tokens;
    s.seconds = seconds[i];
    p.step(s);
  }
}

class CapturedLog {
 public:
  CapturedLog() : before_(spdlog::default_logger()) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(text_);
    sink->set_pattern("%v");
    auto logger = std::make_shared<spdlog::logger>("captured", sink);
    logger->set_level(spdlog::level::info);
    spdlog::set_default_logger(logger);
  }
  ~CapturedLog() { spdlog::set_default_logger(before_); }
  std::string text() const { return text_.str(); }

 private:
  std::shared_ptr<spdlog::logger> before_;
  std::ostringstream text_;
};
}  // namespace

TEST(ProgressReporter, AverageSkipsTheFirstStepsAndStartsAfreshAfterItsLines) {
  primus::testing::TempDir dir;
  CapturedLog log;
  {
    ProgressReporter p(dir.path() / "out", "", 8, 1, 0);
    p.set_average(/*skip_steps=*/2, /*lines=*/3);
    // Steps 1-2 are slow (left out); 3-5 run at 1000 tok/s, 6-7 at 2000, 8 at 4000.
    feed(p, {1.0, 0.5, 0.1, 0.1, 0.1, 0.05, 0.05, 0.025});
  }
  auto avg = averages(log.text());
  ASSERT_EQ(avg.size(), 8u) << log.text();
  EXPECT_EQ(avg[0], -1.0);
  EXPECT_EQ(avg[1], -1.0);
  EXPECT_EQ(avg[2], 1000.0);
  EXPECT_EQ(avg[4], 1000.0);  // three lines: steps 3-5
  EXPECT_EQ(avg[5], 2000.0);  // afresh: step 6 alone (with steps 3-5 it would read 1143)
  EXPECT_EQ(avg[6], 2000.0);
  // Steps 6-8: 300 tokens in 0.125 s.
  EXPECT_EQ(avg[7], 2400.0);
}

TEST(ProgressReporter, AverageOfALineOfSeveralStepsCountsOnlyThoseItKeeps) {
  primus::testing::TempDir dir;
  CapturedLog log;
  {
    // Lines every 4 steps; the first 2 steps left out: the first line averages steps 3-4 only.
    ProgressReporter p(dir.path() / "out", "", 8, 4, 0);
    p.set_average(2, 10);
    feed(p, {3.0, 3.0, 0.1, 0.1, 0.2, 0.2, 0.2, 0.2});
  }
  auto avg = averages(log.text());
  ASSERT_EQ(avg.size(), 2u) << log.text();
  EXPECT_EQ(avg[0], 1000.0);
  EXPECT_EQ(avg[1], 600.0);  // steps 3-8: 600 tokens in 1.0 s
}

TEST(ProgressReporter, ConsoleLevelNamesAreLogurusAndSpdlogs) {
  using primus::train::console_log_level;
  EXPECT_EQ(console_log_level("DEBUG"), static_cast<int>(spdlog::level::debug));
  EXPECT_EQ(console_log_level("Warning"), static_cast<int>(spdlog::level::warn));
  EXPECT_EQ(console_log_level("warn"), static_cast<int>(spdlog::level::warn));
  EXPECT_EQ(console_log_level("SUCCESS"), static_cast<int>(spdlog::level::info));
  EXPECT_EQ(console_log_level("CRITICAL"), static_cast<int>(spdlog::level::critical));
  EXPECT_EQ(console_log_level("off"), static_cast<int>(spdlog::level::off));
  EXPECT_FALSE(console_log_level("LOUD").has_value());
  EXPECT_FALSE(console_log_level("").has_value());
}
