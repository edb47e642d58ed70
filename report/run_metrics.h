// One training run's metrics.jsonl (io/metrics.h, written by train/progress.cpp) as series that
// can be charted: per key, the points by step, with the tokens seen by then so runs with
// different batch sizes can be aligned by tokens. A resumed run appends to the same file, so a
// step logged twice keeps its last record.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace primus::report {

struct Point {
  int64_t step = 0;
  double tokens = 0;  // tokens (all ranks) seen through this step; NaN when the run has no counts
  double value = 0;
};

struct RunData {
  std::string name;                 // unique among the runs of one report (see load_runs)
  std::filesystem::path metrics;    // the metrics.jsonl read
  std::map<std::string, std::vector<Point>> series;  // key -> finite points in step order
  bool has_tokens = false;          // tokens known for every point
  // Sum of step_s over steps and of the tokens they processed (tokens_per_s x step_s), without
  // the run's first logged step, which carries start-up (first-touch allocation, graph capture).
  double wall_s = 0, steady_s = 0, steady_tokens = 0;
  int64_t last_step = 0;

  const std::vector<Point>* find(const std::string& key) const;
};

struct RunSummary {
  std::string name;
  int64_t steps = 0;
  double final_loss = 0, final_val_loss = 0;  // NaN when never logged
  double mean_tokens_per_s = 0;               // NaN when unknown
  double wall_s = 0;                          // sum of step times (evaluation and start-up excluded)
};

// `path` is a run's output folder (holding metrics.jsonl) or a metrics.jsonl file. Throws
// IoError when there is no metrics file, FormatError naming the file and line of a record that is
// not a JSON object with an integer "step".
RunData load_run(const std::filesystem::path& path);
// Loads each path; names every run after its folder, adding parent folders where two would
// otherwise share a name.
std::vector<RunData> load_runs(const std::vector<std::filesystem::path>& paths);

RunSummary summarize(const RunData& run);
// The summary as an aligned text table (one header line, one line per run).
std::string summary_table(const std::vector<RunSummary>& rows);
std::vector<std::string> summary_header();
std::vector<std::string> summary_cells(const RunSummary& s);  // the table's cells of one run

}  // namespace primus::report
