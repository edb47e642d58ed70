// The shared step loop (train/step_loop.h) with launch/finish hooks: a fake asynchronous device
// queue checks that step s + 1 is launched before step s finishes where that is allowed, and
// that nothing is in flight when the loop evaluates, checkpoints, stops on a signal or stops on
// a non-finite step.
#include <gtest/gtest.h>

#include <csignal>
#include <deque>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "train/signals.h"
#include "train/step_loop.h"

using namespace primus;
using namespace primus::train;

namespace {

struct FakeDevice {
  std::deque<int64_t> queue;  // launched, not finished
  std::vector<std::string> log;
  int64_t ahead = 0;          // launches made while another step was in flight
  size_t max_in_flight = 0;
  int64_t nonfinite_step = -1;
  int64_t signal_in_finish = -1;

  StepLoopHooks hooks() {
    StepLoopHooks h;
    h.launch = [this](int64_t s) {
      if (!queue.empty()) {
        EXPECT_EQ(queue.back() + 1, s) << "launches must be consecutive";
        ++ahead;
      }
      queue.push_back(s);
      max_in_flight = std::max(max_in_flight, queue.size());
      log.push_back("L" + std::to_string(s));
    };
    h.finish = [this](int64_t s, double* norm, bool* finite) {
      EXPECT_FALSE(queue.empty());
      EXPECT_EQ(queue.front(), s) << "finish must take the oldest step in flight";
      queue.pop_front();
      log.push_back("F" + std::to_string(s));
      *norm = 1.0;
      *finite = s != nonfinite_step;
      if (s == signal_in_finish) std::raise(SIGUSR1);
      return 2.0;
    };
    h.evaluate = [this] {
      EXPECT_TRUE(queue.empty()) << "evaluation with a step in flight";
      log.push_back("E");
      return 1.5;
    };
    h.test = [this] {
      EXPECT_TRUE(queue.empty()) << "test evaluation with a step in flight";
      log.push_back("T");
      return 1.25;
    };
    h.save = [this](int64_t done) {
      EXPECT_TRUE(queue.empty()) << "checkpoint with a step in flight";
      log.push_back("S" + std::to_string(done));
    };
    return h;
  }
};

TrainingArgs args(int64_t iters) {
  TrainingArgs t;
  t.train_iters = iters;
  t.global_batch_size = 1;
  t.ckpt.save_interval = 0;
  t.ckpt.save_at_end = false;
  return t;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

}  // namespace

TEST(StepLoop, LaunchesTheNextStepBeforeFinishingThisOne) {
  TrainingArgs t = args(4);
  FakeDevice d;
  int64_t step = 0;
  EXPECT_FALSE(run_step_loop(t, 8, &step, -1, nullptr, d.hooks()));
  EXPECT_EQ(step, 4);
  EXPECT_EQ(join(d.log), "L0 L1 F0 L2 F1 L3 F2 F3 T");
  EXPECT_EQ(d.ahead, 3);
  EXPECT_EQ(d.max_in_flight, 2u);
  EXPECT_TRUE(d.queue.empty());
}

TEST(StepLoop, NothingInFlightAtEvaluationsAndCheckpoints) {
  TrainingArgs t = args(7);
  t.eval_interval = 3;
  t.ckpt.save_interval = 2;
  t.ckpt.save_at_end = true;
  FakeDevice d;
  int64_t step = 0;
  run_step_loop(t, 8, &step, -1, nullptr, d.hooks());
  // After step counts 2 (save), 3 (eval), 4 (save), 6 (eval + save), 7 (eval + save at the end)
  // the next step is launched only once the state has been used; the test data is evaluated once,
  // after the last checkpoint.
  EXPECT_EQ(join(d.log), "L0 L1 F0 F1 S2 L2 F2 E L3 F3 S4 L4 L5 F4 F5 E S6 L6 F6 E S7 T");
  EXPECT_TRUE(d.queue.empty());
}

TEST(StepLoop, ResumesMidRunAndWithoutSplitHooksRunsOneStepAtATime) {
  TrainingArgs t = args(5);
  FakeDevice d;
  int64_t step = 3;  // resumed
  run_step_loop(t, 8, &step, 3, nullptr, d.hooks());
  EXPECT_EQ(join(d.log), "L3 L4 F3 F4 T");

  FakeDevice plain;
  StepLoopHooks h = plain.hooks();
  auto launch = h.launch;
  auto finish = h.finish;
  h.step = [&](int64_t s, double* norm, bool* finite) {
    launch(s);
    return finish(s, norm, finite);
  };
  h.launch = nullptr;  // only `step`: the loop never has two steps out
  step = 0;
  run_step_loop(t, 8, &step, -1, nullptr, h);
  EXPECT_EQ(join(plain.log), "L0 F0 L1 F1 L2 F2 L3 F3 L4 F4 T");
  EXPECT_EQ(plain.ahead, 0);
}

TEST(StepLoop, NonFiniteStepStopsOrIsSkippedAsWithoutTheLag) {
  TrainingArgs t = args(6);
  FakeDevice d;
  d.nonfinite_step = 2;
  int64_t step = 0;
  try {
    run_step_loop(t, 8, &step, -1, nullptr, d.hooks());
    FAIL() << "a non-finite step must stop the run";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("at step 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("skip_nan_steps"), std::string::npos) << e.what();
  }
  EXPECT_EQ(step, 2);  // the steps before it count; nothing was saved after it
  EXPECT_EQ(join(d.log), "L0 L1 F0 L2 F1 L3 F2") << "no test after a failed run";

  t.skip_nan_steps = true;
  FakeDevice s;
  s.nonfinite_step = 2;
  step = 0;
  EXPECT_FALSE(run_step_loop(t, 8, &step, -1, nullptr, s.hooks()));
  EXPECT_EQ(step, 6);
}

TEST(StepLoop, SignalLetsTheStepInFlightFinishThenCheckpointsAfterIt) {
  install_exit_signal_handlers();
  reset_exit_request();
  TrainingArgs t = args(10);
  FakeDevice d;
  d.signal_in_finish = 3;  // while step 4 is in flight
  int64_t step = 0;
  const bool stopped = run_step_loop(t, 8, &step, -1, nullptr, d.hooks());
  reset_exit_request();
  EXPECT_TRUE(stopped);
  EXPECT_EQ(step, 5);
  EXPECT_EQ(join(d.log), "L0 L1 F0 L2 F1 L3 F2 L4 F3 F4 S5") << "no test evaluation after a stop signal";
  EXPECT_TRUE(d.queue.empty());
}

// Megatron-LM's exit_interval: after a step that is a multiple of it, the loop checkpoints and
// stops, and it launches no step past it (nothing in flight at the checkpoint, no test evaluation).
TEST(StepLoop, ExitIntervalCheckpointsAndStopsAtAMultiple) {
  reset_exit_request();
  TrainingArgs t = args(10);
  t.exit_interval = 3;
  FakeDevice d;
  int64_t step = 0;
  EXPECT_TRUE(run_step_loop(t, 8, &step, -1, nullptr, d.hooks()));
  EXPECT_EQ(step, 3);
  EXPECT_EQ(join(d.log), "L0 L1 F0 L2 F1 F2 S3");
  EXPECT_FALSE(may_launch_ahead(t, 6));
  EXPECT_TRUE(may_launch_ahead(t, 5));
  // A resumed run stops at the next multiple.
  FakeDevice r;
  EXPECT_TRUE(run_step_loop(t, 8, &step, 3, nullptr, r.hooks()));
  EXPECT_EQ(step, 6);
  EXPECT_EQ(join(r.log), "L3 L4 F3 L5 F4 F5 S6");
}

// Megatron-LM's exit_duration_in_mins: once training has run that long, the step in flight
// finishes and the checkpoint follows it, as after a stop signal.
TEST(StepLoop, ExitDurationLetsTheStepInFlightFinishThenCheckpoints) {
  reset_exit_request();
  TrainingArgs t = args(10);
  t.exit_duration_mins = 1e-9;  // passed by the end of the first step
  FakeDevice d;
  int64_t step = 0;
  EXPECT_TRUE(run_step_loop(t, 8, &step, -1, nullptr, d.hooks()));
  EXPECT_EQ(step, 2);
  EXPECT_EQ(join(d.log), "L0 L1 F0 F1 S2");
  EXPECT_TRUE(d.queue.empty());
}
