// A crash at any moment of a save leaves the previous checkpoint loadable and the tracker
// unchanged; the next save cleans up what the crashed one left.
#include <signal.h>

#include <chrono>
#include <thread>

#include "checkpoint_test_util.h"

namespace {

using namespace primus::io;

class CheckpointCrash : public primus::io::testing::CheckpointTest,
                        public ::testing::WithParamInterface<const char*> {};

TEST_P(CheckpointCrash, PreviousCheckpointSurvivesExitAtHook) {
  auto first = make_data(100);
  save_checkpoint(save_dir(), 100, first);

  const char* point = GetParam();
  int status = run_child([&] {
    ::setenv(kCrashHookEnv, point, 1);
    save_checkpoint(save_dir(), 200, make_data(200));
  });
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 77) << "the save did not stop at " << point;

  EXPECT_EQ(tracker(), "100");
  auto latest = find_latest(save_dir());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->iteration, 100);
  expect_same(first, load_checkpoint(latest->dir));
  bool renamed = std::string(point) == "before_tracker";
  EXPECT_EQ(entries(".iter_0000200.tmp-").size(), renamed ? 0u : 1u);
  // The crashed save's folder is complete iff it was renamed into place.
  std::vector<int64_t> want = renamed ? std::vector<int64_t>{100, 200} : std::vector<int64_t>{100};
  EXPECT_EQ(list_checkpoints(save_dir()), want);

  save_checkpoint(save_dir(), 300, make_data(300, 100));
  EXPECT_TRUE(entries(".").empty()) << "the stale temporary folder was not removed";
  EXPECT_EQ(find_latest(save_dir())->iteration, 300);
}

INSTANTIATE_TEST_SUITE_P(Points, CheckpointCrash,
                         ::testing::Values("after_model", "after_optimizer", "after_state",
                                           "before_rename", "before_tracker"));

// SIGKILL at an arbitrary moment of a stream of large saves: whatever the moment, find_latest
// names a checkpoint that loads and verifies, and the tracker (if any) names one too.
TEST_F(CheckpointCrash, SigkillAtRandomMomentsKeepsALoadableCheckpoint) {
  std::uniform_int_distribution<int> delay_ms(5, 400);
  int mid_write = 0;
  const int rounds = 4;
  for (int round = 0; round < rounds; ++round) {
    int pipefd[2];
    ASSERT_EQ(::pipe(pipefd), 0);
    std::fflush(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(pipefd[0]);
      try {
        SaveOptions opts;
        opts.keep_last = 2;
        CheckpointData data = make_data(0, 1'000'000);  // ~28 MB; made once, so saving is all
        for (int64_t it = 1;; ++it) {                     // the child does from here on
          data.state["iteration"] = it;
          save_checkpoint(save_dir(), round * 1000 + it, data, opts);
          if (it == 1) (void)!::write(pipefd[1], "x", 1);  // one complete checkpoint exists
        }
      } catch (...) {
        ::_exit(1);
      }
    }
    ::close(pipefd[1]);
    char c;
    ASSERT_EQ(::read(pipefd[0], &c, 1), 1) << "the child never completed a save";
    ::close(pipefd[0]);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng_)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child ended on its own, status " << status;
    mid_write += !entries(".iter_").empty();

    auto latest = find_latest(save_dir());
    ASSERT_TRUE(latest.has_value()) << "round " << round;
    CheckpointData back;
    ASSERT_NO_THROW(back = load_checkpoint(latest->dir)) << latest->dir;
    EXPECT_EQ(back.state["iteration"].get<int64_t>() + round * 1000, latest->iteration);
    std::string t = tracker();
    if (!t.empty()) {
      EXPECT_NO_THROW(verify_checkpoint(checkpoint_dir(save_dir(), std::stoll(t))))
          << "the tracker names " << t;
    }
  }
  std::printf("%d of %d kills landed while a temporary folder existed\n", mid_write, rounds);
  save_checkpoint(save_dir(), 99999, make_data(1, 100));
  EXPECT_TRUE(entries(".").empty()) << "stale temporaries left after the next save";
}

}  // namespace
