// Megatron-LM's profiling window: `profile: true` opens the CUDA profiler's capture range
// (cudaProfilerStart) before step profile_step_start and closes it (cudaProfilerStop) once step
// profile_step_end - 1 has finished (0-based steps: the first step is 0, so 10 and 12 capture the
// 11th and 12th steps, as Megatron-LM's iteration counter does), on the ranks in profile_ranks. Run
// under `nsys profile --capture-range=cudaProfilerApi` the trace holds those steps, with the NVTX
// ranges the trainer and the model push (step, launch, layer forward / backward). A run that ends
// inside the window closes it at the end. Megatron-LM's other profiler (use_pytorch_profiler: true,
// torch.profiler) has no counterpart here: with profile: true it is refused, naming this window and
// profile_steps (the per-phase table); with profile: false it, and its options, select nothing.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/config/value.h"

namespace primus::backends::cuda {

struct ProfileWindowArgs {
  bool profile = false;
  int64_t start = 10, end = 12;  // 0-based steps [start, end)
  std::vector<int64_t> ranks{0};
};

// Reads profile, profile_step_start, profile_step_end, profile_ranks and use_pytorch_profiler
// through `get` (null: not set); a ConfigError names the key and its origin.
ProfileWindowArgs profile_window_args(const std::function<const config::Value*(const std::string&)>& get);

class ProfileWindow {
 public:
  // `toggle(true)` opens the capture range, toggle(false) closes it (cudaProfilerStart / Stop when
  // empty; host mode passes one that only logs).
  ProfileWindow(const ProfileWindowArgs& a, int64_t rank, std::function<void(bool)> toggle = {});
  void before_step(int64_t step);  // before step `step` is launched or run
  void after_step(int64_t step);   // after step `step`'s result was read
  void finish();                   // at the end of training: closes a window still open
  bool active() const { return active_; }
  bool open() const { return open_; }

 private:
  ProfileWindowArgs a_;
  bool active_ = false, open_ = false;
  std::function<void(bool)> toggle_;
};

}  // namespace primus::backends::cuda
