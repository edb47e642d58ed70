#include "train/progress.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cmath>

namespace primus::train {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  if (s < 60) return fmt::format("{:.1f}s", s);
  int64_t t = static_cast<int64_t>(s);
  if (t < 3600) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
}

ProgressReporter::ProgressReporter(const std::filesystem::path& output_dir,
                                   const std::filesystem::path& tb_dir, int64_t total_steps,
                                   int64_t log_interval, int64_t start_step, bool enabled)
    : total_(total_steps),
      interval_(std::max<int64_t>(1, log_interval)),
      start_(start_step),
      t0_(std::chrono::steady_clock::now()) {
  if (!enabled) return;
  metrics_ = std::make_unique<io::MetricsWriter>(output_dir / "metrics.jsonl");
  if (!tb_dir.empty()) tb_ = std::make_unique<io::TensorBoardWriter>(tb_dir);
}

const std::filesystem::path& ProgressReporter::metrics_path() const {
  static const std::filesystem::path none;
  return metrics_ ? metrics_->path() : none;
}

void ProgressReporter::set_average(int64_t skip_steps, int64_t lines) {
  avg_skip_ = std::max<int64_t>(0, skip_steps);
  avg_lines_max_ = std::max<int64_t>(1, lines);
}

void ProgressReporter::step(const StepStats& s) {
  if (!metrics_) return;
  double tok_s = s.seconds > 0 ? s.tokens / s.seconds : 0;
  nlohmann::json j = {{"step", s.step},       {"loss", s.loss},     {"lr", s.lr},
                      {"grad_norm", s.grad_norm}, {"tokens_per_s", tok_s}, {"step_s", s.seconds}};
  // Tokens seen through this step (the batch is the same every step), so `primus report --x
  // tokens` aligns runs with different batches, resumed or not.
  j["tokens"] = std::llround(static_cast<double>(s.step) * s.tokens);
  if (s.skipped) j["skipped"] = true;
  for (auto& [k, v] : s.extras) j[k] = v;
  for (auto& [k, v] : s.details) j[k] = v;
  metrics_->write(j);
  if (tb_) {
    std::vector<std::pair<std::string, float>> vals = {
        {"train/loss", static_cast<float>(s.loss)}, {"train/lr", static_cast<float>(s.lr)},
        {"train/grad_norm", static_cast<float>(s.grad_norm)}, {"train/tokens_per_s", static_cast<float>(tok_s)}};
    for (auto& [k, v] : s.extras) vals.emplace_back("train/" + k, static_cast<float>(v));
    for (auto& [k, v] : s.details) vals.emplace_back("train/" + k, static_cast<float>(v));
    tb_->add_scalars(s.step, vals);
  }
  window_tokens_ += s.tokens;
  window_seconds_ += s.seconds;
  window_loss_ += s.loss;
  ++window_steps_;
  if (s.step - start_ > avg_skip_) {
    line_avg_tokens_ += s.tokens;
    line_avg_seconds_ += s.seconds;
  }
  if (s.step % interval_ != 0 && s.step != total_) return;
  if (line_avg_seconds_ > 0) {
    if (avg_lines_ >= avg_lines_max_) avg_tokens_ = avg_seconds_ = 0, avg_lines_ = 0;
    avg_tokens_ += line_avg_tokens_;
    avg_seconds_ += line_avg_seconds_;
    ++avg_lines_;
  }
  line_avg_tokens_ = line_avg_seconds_ = 0;
  // The average stays out of the "<n> tok/s" field that scripts read from the line.
  const std::string avg = avg_seconds_ > 0 ? fmt::format(" (avg {:.0f})", avg_tokens_ / avg_seconds_) : "";
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  double per_step = elapsed / static_cast<double>(std::max<int64_t>(1, s.step - start_));
  double eta = per_step * static_cast<double>(total_ - s.step);
  std::string extras;
  for (auto& [k, v] : s.extras) extras += fmt::format(" | {} {:.4g}", k, v);
  spdlog::info("step {:>{}}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.3f} | {:.0f} tok/s{}{} | "
               "elapsed {} | ETA {}",
               s.step, std::to_string(total_).size(), total_, window_loss_ / window_steps_, s.lr,
               s.grad_norm, window_seconds_ > 0 ? window_tokens_ / window_seconds_ : 0.0, avg, extras,
               format_duration(elapsed), format_duration(eta));
  window_tokens_ = window_seconds_ = window_loss_ = 0;
  window_steps_ = 0;
}

void ProgressReporter::eval(int64_t step, double val_loss) {
  held_out_loss(step, val_loss, "val_loss", "valid/loss", "validation");
}

void ProgressReporter::test(int64_t step, double test_loss) {
  held_out_loss(step, test_loss, "test_loss", "test/loss", "test");
}

void ProgressReporter::held_out_loss(int64_t step, double loss, const char* key, const char* tb_tag,
                                     const char* what) {
  if (!metrics_) return;
  metrics_->write({{"step", step}, {key, loss}});
  if (tb_) tb_->add_scalar(tb_tag, static_cast<float>(loss), step);
  spdlog::info("step {} | {} loss {:.4f} (ppl {:.2f})", step, what, loss, std::exp(loss));
}

void ProgressReporter::flush() {
  if (tb_) tb_->flush();
}

}  // namespace primus::train
