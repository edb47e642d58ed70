// The step loop every trainer runs: one step, the non-finite policy (stop naming the last good
// checkpoint, or skip with skip_nan_steps), progress and metrics, evaluation and checkpoint
// cadence, and preemption (a signal finishes the step, checkpoints and returns). Backends supply
// what differs (the step itself, extra metrics, how ranks agree to stop) as hooks, so the
// bookkeeping is written once and behaves the same in every backend.
#pragma once
#include <cstdint>
#include <functional>

#include "train/progress.h"
#include "train/training_args.h"

namespace primus::train {

struct StepLoopHooks {
  // Runs step `step` (0-based); returns the loss and sets the gradient norm and whether both
  // were finite (a non-finite step must leave weights and optimizer state untouched).
  std::function<double(int64_t step, double* grad_norm, bool* finite)> step;
  // Adds backend metrics (TFLOP/s, memory, ...) to a step's stats before they are reported.
  std::function<void(StepStats& stats)> decorate;
  // Validation loss (NaN when there is none).
  std::function<double()> evaluate;
  // Optional: the test data's loss (NaN when there is none), once after the last step and its
  // checkpoint, as Megatron-LM's do_test; not after a stop signal.
  std::function<double()> test;
  // Writes the checkpoint of `step` (and records it as the last good one).
  std::function<void(int64_t step)> save;
  // Whether any rank asked to stop, given this rank's answer (default: this rank's answer), so
  // every rank checkpoints and stops at the same step.
  std::function<bool(bool stop_here)> agree_stop;
  // Optional: `step` split in two, for a backend whose step runs asynchronously (a GPU stream).
  // launch(step) enqueues the step; finish(step, ...) waits for it and returns what `step`
  // returns. With both set, the loop launches step s + 1 before it finishes step s, so the
  // device has the next step queued while the host reads the last one's result, logs it and
  // stages the next batches. It does so only when nothing between the two steps needs the
  // state after step s (no evaluation, no checkpoint of it) and step s + 1 exists. A stop signal
  // lets the step in flight finish and checkpoints after it. A non-finite step s is reported
  // (or stops the run) as without the lag; step s + 1 may have run on the device by then, which
  // touches nothing saved. The decision depends on step counts only, so every rank of a job
  // launches the same steps.
  std::function<void(int64_t step)> launch;
  std::function<double(int64_t step, double* grad_norm, bool* finite)> finish;
};

// Whether the loop (with launch and finish hooks) may launch step `next` (0-based) before the
// step before it has finished: false when the state after step `next - 1` is evaluated or
// saved, or `next` is past the end.
bool may_launch_ahead(const TrainingArgs& args, int64_t next);

// Runs from *step until args.train_iters or a stop signal, advancing *step. `last_saved` is the
// step of the last good checkpoint (-1: none), named when a non-finite step stops the run.
// `progress` may be null (ranks other than 0). Returns true when a signal stopped the run (its
// checkpoint written). After the last step (not after a stop signal) rank 0 draws report.png
// beside metrics.jsonl when args.report_at_end (report/report.h; a warning when it cannot). A
// step's seconds are the wall time from the end of the previous step's bookkeeping (progress,
// evaluation, checkpoint) to the step's result. Throws RuntimeError on a non-finite step unless skip_nan_steps is set.
bool run_step_loop(const TrainingArgs& args, int64_t seq_length, int64_t* step, const int64_t& last_saved,
                   ProgressReporter* progress, const StepLoopHooks& hooks);

}  // namespace primus::train
