// What a training run reports, per step and per log interval: a progress line on the console
// (step/total, loss, lr, grad norm, tokens/s, elapsed, ETA, plus backend extras such as MFU),
// a JSONL line per step in <output>/metrics.jsonl, and TensorBoard scalars.
#pragma once
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/metrics.h"
#include "io/tensorboard.h"

namespace primus::train {

struct StepStats {
  int64_t step = 0;  // 1-based: the number of optimizer steps done
  double loss = 0, lr = 0, grad_norm = 0;
  double tokens = 0;    // tokens processed in this step (all ranks)
  double seconds = 0;   // wall time of this step
  bool skipped = false; // a non-finite step that skip_nan_steps skipped
  std::vector<std::pair<std::string, double>> extras;  // e.g. {"mfu", 0.41}
  // Like extras, but only in metrics.jsonl and TensorBoard, not on the console (per-layer
  // figures such as MoE routing statistics, too many for a progress line).
  std::vector<std::pair<std::string, double>> details;
};

class ProgressReporter {
 public:
  // metrics.jsonl goes in `output_dir`; TensorBoard only when `tb_dir` is non-empty. With
  // `enabled` false (data-parallel ranks other than 0) nothing is written or printed.
  ProgressReporter(const std::filesystem::path& output_dir, const std::filesystem::path& tb_dir,
                   int64_t total_steps, int64_t log_interval, int64_t start_step, bool enabled = true);
  // The average tokens/s each progress line shows beside its own ("(avg N)"): over the lines
  // since it last started afresh, which it does after `lines` of them; the run's first
  // `skip_steps` steps (warm-up, graph capture) never count. Primus' log_avg_skip_iterations and
  // log_avg_reset_interval; the default is theirs (2, 10).
  void set_average(int64_t skip_steps, int64_t lines);
  void step(const StepStats& s);
  void eval(int64_t step, double val_loss);
  // The test data's loss after the last step: {"step", "test_loss"}, TensorBoard test/loss.
  void test(int64_t step, double test_loss);
  void flush();
  const std::filesystem::path& metrics_path() const;  // empty when disabled

 private:
  // A loss on held-out data: metrics.jsonl `key`, TensorBoard `tb_tag`, a "<what> loss" line.
  void held_out_loss(int64_t step, double loss, const char* key, const char* tb_tag, const char* what);
  std::unique_ptr<io::MetricsWriter> metrics_;  // null when disabled
  std::unique_ptr<io::TensorBoardWriter> tb_;
  int64_t total_, interval_, start_;
  std::chrono::steady_clock::time_point t0_;
  double window_tokens_ = 0, window_seconds_ = 0, window_loss_ = 0;
  int64_t window_steps_ = 0;
  int64_t avg_skip_ = 2, avg_lines_max_ = 10;
  double line_avg_tokens_ = 0, line_avg_seconds_ = 0;  // this line's steps past the skipped ones
  double avg_tokens_ = 0, avg_seconds_ = 0;
  int64_t avg_lines_ = 0;
};

std::string format_duration(double seconds);  // "1h02m", "3m05s", "12.3s"

}  // namespace primus::train
