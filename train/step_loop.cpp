#include "train/step_loop.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <string>

#include "core/util/error.h"
#include "io/checkpoint.h"
#include "report/report.h"
#include "train/lr_schedule.h"
#include "train/signals.h"

namespace primus::train {

namespace {
bool saves_at(const TrainingArgs& t, int64_t done) {  // done: steps completed
  return (t.ckpt.save_interval > 0 && done % t.ckpt.save_interval == 0) || (done == t.train_iters && t.ckpt.save_at_end);
}
bool evaluates_at(const TrainingArgs& t, int64_t done) {
  return t.eval_interval > 0 && (done % t.eval_interval == 0 || done == t.train_iters);
}
}  // namespace

bool may_launch_ahead(const TrainingArgs& t, int64_t next) {
  return next < t.train_iters && !saves_at(t, next) && !evaluates_at(t, next) &&
         !(t.exit_interval > 0 && next % t.exit_interval == 0);
}

bool run_step_loop(const TrainingArgs& t, int64_t seq_length, int64_t* step, const int64_t& last_saved,
                   ProgressReporter* progress, const StepLoopHooks& h) {
  const double tokens_per_step = static_cast<double>(t.global_batch_size * seq_length);
  const bool split = h.launch && h.finish;
  int64_t launched = -1;  // split: the last step launched (finished or not)
  bool stopping = false;  // split: a stop was agreed while a step was in flight
  const auto start = std::chrono::steady_clock::now();
  // Why this rank asks to stop after step *step (empty: it does not): a signal, exit_interval,
  // exit_duration_in_mins. The duration is read on each rank; agree_stop makes any rank's stop everyone's.
  auto own_stop = [&]() -> std::string {
    if (exit_requested()) return fmt::format("received signal {}", exit_signal());
    if (t.exit_interval > 0 && *step % t.exit_interval == 0)
      return fmt::format("step {} is a multiple of exit_interval {}", *step, t.exit_interval);
    const double mins = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 60.0;
    if (t.exit_duration_mins > 0 && mins > t.exit_duration_mins)
      return fmt::format("training has run {:.2f} minutes, past exit_duration_in_mins {}", mins, t.exit_duration_mins);
    return "";
  };
  while (*step < t.train_iters) {
    const auto t0 = std::chrono::steady_clock::now();  // the previous step's bookkeeping is done
    double norm = 0;
    bool finite = true;
    double loss = 0;
    if (split) {
      if (launched < *step) {
        h.launch(*step);
        launched = *step;
      }
      if (!stopping && launched == *step && may_launch_ahead(t, *step + 1)) {
        h.launch(*step + 1);
        launched = *step + 1;
      }
      loss = h.finish(*step, &norm, &finite);
    } else {
      loss = h.step(*step, &norm, &finite);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!finite) {
      const std::string last = last_saved >= 0 ? io::checkpoint_dir(t.ckpt.save, last_saved).string() : "none";
      if (!t.skip_nan_steps) {
        throw RuntimeError(fmt::format("non-finite loss {} or gradient norm {} at step {}; the last good checkpoint is "
                                       "{} (set skip_nan_steps: true to skip such steps)",
                                       loss, norm, *step + 1, last));
      }
      spdlog::warn("step {}: non-finite loss {} / grad norm {}: step skipped (skip_nan_steps)", *step + 1, loss, norm);
    }
    ++*step;
    StepStats st;
    st.step = *step;
    st.loss = loss;
    st.lr = lr_at(t.optim, *step - 1);
    st.grad_norm = norm;
    st.tokens = tokens_per_step;
    st.seconds = secs;
    st.skipped = !finite;
    if (h.decorate) h.decorate(st);
    if (progress) progress->step(st);
    if (evaluates_at(t, *step)) {  // never with a step in flight (may_launch_ahead)
      const double vl = h.evaluate();
      if (std::isfinite(vl) && progress) progress->eval(*step, vl);
    }
    const std::string mine = own_stop();
    const bool stop = h.agree_stop ? h.agree_stop(!mine.empty()) : !mine.empty();
    if (stop && launched >= *step) {  // the step in flight finishes first; the checkpoint follows it
      stopping = true;
      continue;
    }
    if (saves_at(t, *step) || stop) h.save(*step);
    if (stop) {
      const std::string why = !mine.empty()             ? mine
                              : t.exit_duration_mins > 0 ? "another rank received a stop signal or passed "
                                                           "exit_duration_in_mins"
                                                         : "another rank received a stop signal";
      spdlog::info("[{}] {}: checkpoint of step {} saved in {}; resume with auto_continue_train=true (or load={})",
                   exit_requested() || mine.empty() ? "signal" : "stop", why, *step, t.ckpt.save.string(),
                   t.ckpt.save.string());
      return true;
    }
  }
  if (h.test) {  // every rank: the evaluation may have collectives
    const double tl = h.test();
    if (std::isfinite(tl) && progress) progress->test(*step, tl);
  }
  // Rank 0 only (the others have no progress); a report that cannot be drawn is a warning.
  if (progress && t.report_at_end) report::write_end_of_run_report(progress->metrics_path());
  return false;
}

}  // namespace primus::train
