// Megatron-LM's profiling window on the cuda backend (backends/cuda/profile_window.h), without a
// GPU: the keys as the cuda schema reads them (defaults, Primus' example values, the refusals), and
// when the window opens and closes against the step loop's calls, stepping one step at a time and
// with launch-ahead (step s + 1 launched before step s is finished), on the ranks it names.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/profile_window.h"
#include "core/util/error.h"
#include "tests/cuda_gpu/cuda_schema.h"

namespace primus::backends::cuda {
namespace {

ProfileWindowArgs read_window(const std::string& yaml) {
  const config::Value v = testing::cuda_config(yaml);
  return profile_window_args([&v](const std::string& k) { return v.find_path(k); });
}

std::string window_refusal(const std::string& yaml) {
  try {
    read_window(yaml);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(ProfileWindowKeys, ReadMegatronsDefaultsAndPrimusExamplesAndRefuseWhatIsNotBuilt) {
  const ProfileWindowArgs d = read_window("lr: 0.1\n");
  EXPECT_FALSE(d.profile);
  EXPECT_EQ(d.start, 10);
  EXPECT_EQ(d.end, 12);
  EXPECT_EQ(d.ranks, std::vector<int64_t>{0});
  // Primus' examples: the torch.profiler switch and its options beside profile: false.
  const ProfileWindowArgs off = read_window(
      "profile: false\nuse_pytorch_profiler: true\nprofile_ranks: [0,1,2,3]\nprofile_step_start: 6\n"
      "profile_step_end: 7\ntorch_profiler_record_shapes: true\ntorch_profiler_with_stack: true\n"
      "torch_profiler_use_gzip: false\nrecord_shapes: false\ndisable_profiler_activity_cpu: false\n");
  EXPECT_FALSE(off.profile);
  EXPECT_EQ(off.ranks, (std::vector<int64_t>{0, 1, 2, 3}));
  const ProfileWindowArgs on = read_window("profile: true\nuse_pytorch_profiler: false\nprofile_step_start: 9\n"
                                    "profile_step_end: 11\nprofile_ranks: [1]\n");
  EXPECT_TRUE(on.profile);
  EXPECT_EQ(on.start, 9);
  EXPECT_EQ(on.end, 11);
  EXPECT_EQ(on.ranks, std::vector<int64_t>{1});
  const std::string torch = window_refusal("profile: true\nuse_pytorch_profiler: true\n");
  EXPECT_NE(torch.find("exp.yaml:2:"), std::string::npos) << torch;
  EXPECT_NE(torch.find("use_pytorch_profiler: true beside profile: true is not implemented"), std::string::npos) << torch;
  EXPECT_NE(torch.find("--capture-range=cudaProfilerApi"), std::string::npos) << torch;
  const std::string empty = window_refusal("profile: true\nprofile_step_start: 12\nprofile_step_end: 12\n");
  EXPECT_NE(empty.find("profile_step_end 12 must be larger than profile_step_start 12"), std::string::npos) << empty;
  EXPECT_EQ(window_refusal("profile: false\nprofile_step_start: 12\nprofile_step_end: 12\n"), "(accepted)");
  const std::string rank = window_refusal("profile_ranks: [0, -1]\n");
  EXPECT_NE(rank.find("profile_ranks holds ranks"), std::string::npos) << rank;
}

// The toggles the window makes, each with the step the loop was at.
struct ToggleRecorder {
  std::vector<std::pair<bool, int64_t>> calls;
  int64_t at = -1;
  std::function<void(bool)> toggle() {
    return [this](bool start) { calls.push_back({start, at}); };
  }
};

TEST(ProfileWindow, OpensBeforeTheStartStepAndClosesAfterTheEndStepOnItsRanks) {
  ProfileWindowArgs a;
  a.profile = true;
  a.start = 3;
  a.end = 5;
  a.ranks = {0, 2};
  // One step at a time: step 3 (the 4th) and step 4 (the 5th) inside.
  ToggleRecorder one;
  ProfileWindow w(a, 2, one.toggle());
  EXPECT_TRUE(w.active());
  for (int64_t s = 0; s < 8; ++s) {
    one.at = s;
    w.before_step(s);
    EXPECT_EQ(w.open(), s >= 3 && s < 5) << s;
    w.after_step(s);
  }
  w.finish();
  EXPECT_EQ(one.calls, (std::vector<std::pair<bool, int64_t>>{{true, 3}, {false, 4}}));
  // Launch-ahead: launch(s + 1) comes before finish(s); the window opens at the launch of step 3
  // and closes once step 4 is finished (step 5 already queued).
  ToggleRecorder ahead;
  ProfileWindow wa(a, 0, ahead.toggle());
  ahead.at = 0;
  wa.before_step(0);
  for (int64_t s = 0; s < 8; ++s) {
    if (s + 1 < 8) {
      ahead.at = s + 1;
      wa.before_step(s + 1);
    }
    ahead.at = s;
    wa.after_step(s);
  }
  wa.finish();
  EXPECT_EQ(ahead.calls, (std::vector<std::pair<bool, int64_t>>{{true, 3}, {false, 4}}));
  // Another rank: nothing.
  ToggleRecorder other;
  ProfileWindow wo(a, 1, other.toggle());
  EXPECT_FALSE(wo.active());
  for (int64_t s = 0; s < 8; ++s) {
    wo.before_step(s);
    wo.after_step(s);
  }
  wo.finish();
  EXPECT_TRUE(other.calls.empty());
  // A run that ends inside the window closes it at the end, once; one that resumes past the
  // start never opens it.
  ToggleRecorder cut;
  ProfileWindow wc(a, 0, cut.toggle());
  for (int64_t s = 0; s < 4; ++s) {
    cut.at = s;
    wc.before_step(s);
    wc.after_step(s);
  }
  cut.at = 99;
  wc.finish();
  wc.finish();
  EXPECT_EQ(cut.calls, (std::vector<std::pair<bool, int64_t>>{{true, 3}, {false, 99}}));
  ToggleRecorder late;
  ProfileWindow wl(a, 0, late.toggle());
  for (int64_t s = 4; s < 8; ++s) {
    wl.before_step(s);
    wl.after_step(s);
  }
  wl.finish();
  EXPECT_TRUE(late.calls.empty());
  // profile: false: never active.
  a.profile = false;
  ToggleRecorder none;
  ProfileWindow wn(a, 0, none.toggle());
  EXPECT_FALSE(wn.active());
  wn.before_step(3);
  wn.after_step(4);
  EXPECT_TRUE(none.calls.empty());
}

}  // namespace
}  // namespace primus::backends::cuda
