// Per-phase GPU time of the training step (PRIMUS_CUDA_PROFILE=1 or `profile_steps: N`): where
// the step's milliseconds go, so a GPU session spends its time on the kernels that matter.
//
// The model calls mark(phase) before each op family (embedding, norm, qkv GEMM, attention, ...
// and their backward counterparts, grad norm, optimizer); a mark ends the running phase and
// starts the next. On the device each mark records a CUDA event on the model's stream, so a
// phase's time is the stream time between two consecutive events: the kernels of that phase
// plus any idle gap while the GPU waited for the host to enqueue them (none under a CUDA graph,
// where events are recorded by the graph's own event nodes). Marks are read after the step has
// synchronised (the trainer's one status read), so profiling adds no synchronisation; events
// cost a few microseconds each, which is why the profiler is off by default. In host mode the
// marks read the host clock (the ops run synchronously there).
//
// Times are summed over the layers (per-layer rows would be 12x longer and say the same) and
// over the profiled steps; the report gives ms per step and the share of the step.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace primus::backends::cuda {

enum class Phase : uint8_t {
  ZeroGrad,
  Embedding,
  Norm,
  QkvGemm,
  Rope,
  Attention,
  ProjGemm,
  MlpUpGemm,     // GPT-2: GELU fused in the epilogue
  Activation,    // SwiGLU (GPT-2's GELU only when recomputed)
  MlpDownGemm,
  HeadGemm,
  Loss,
  HeadGemmBwd,
  NormBwd,
  MlpDownGemmBwd,  // GPT-2: its input gradient has dGELU fused in the epilogue
  ActivationBwd,
  MlpUpGemmBwd,
  ProjGemmBwd,
  AttentionBwd,
  RopeBwd,
  QkvGemmBwd,
  EmbeddingBwd,
  MoeRouter,      // router GEMM, top-k and the row plan
  MoePermute,     // permute / unpermute of the tokens into expert groups
  MoeRouterBwd,   // router backward and its GEMMs
  MoePermuteBwd,
  Recompute,  // activation recomputation in the backward (recompute_granularity)
  GradNorm,
  StepCheck,  // the on-device non-finite check
  Optimizer,
  Count
};
const char* phase_name(Phase p);

// PRIMUS_CUDA_PROFILE: unset, empty or 0: 0; 1: every step (INT64_MAX). Anything else throws
// ConfigError naming the variable.
int64_t profile_env_steps();

class StepProfiler {
 public:
  // stream: the model's stream, or nullptr in host mode (host clock). steps: how many steps to
  // accumulate (the caller skips the warm-up step).
  StepProfiler(cudaStream_t stream, int64_t steps);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Brackets one step's enqueued work. record = true: the marks between begin and end define
  // the step's phase sequence (an eager step, or the step being captured into a graph); false:
  // a graph replay, whose event nodes record the sequence captured earlier. count = false: the
  // step's times are dropped (the warm-up step, which also creates the events a capture records).
  void begin_step(bool record, bool count = true);
  void mark(Phase p);  // no-op outside begin_step/end_step
  void end_step();
  // After the stream has synchronised: adds this step's phase times. When an event cannot be
  // read (cudaEventElapsedTime fails), profiling stops with a warning and failure() says why:
  // it never stops training.
  void collect();
  const std::string& failure() const { return failure_; }

  bool active() const { return active_; }
  bool done() const { return steps_done_ >= steps_; }
  int64_t steps_done() const { return steps_done_; }
  double ms(Phase p) const { return ms_[static_cast<size_t>(p)]; }  // summed over the profiled steps
  double total_ms() const;
  // The table (one row per phase that ran: ms per step, share of the step) and its JSON form,
  // {"steps", "step_ms", "phases": [{"phase", "ms_per_step", "share", "marks_per_step"}...]}.
  std::string table() const;
  std::string json() const;
  void write_json(const std::filesystem::path& file) const;

 private:
  void record(size_t i);
  double elapsed_ms(size_t a, size_t b) const;

  cudaStream_t stream_;
  bool host_;
  int64_t steps_, steps_done_ = 0;
  std::string failure_;
  bool active_ = false, recording_ = false, counting_ = false, pending_ = false;
  std::vector<cudaEvent_t> events_;                               // device: one per mark + the end
  std::vector<std::chrono::steady_clock::time_point> host_times_;  // host mode
  std::vector<Phase> sequence_;                                   // phase started by each mark
  std::array<double, static_cast<size_t>(Phase::Count)> ms_{};
  std::array<int64_t, static_cast<size_t>(Phase::Count)> marks_{};
};

}  // namespace primus::backends::cuda
