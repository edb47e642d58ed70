// Runs the training step's device work: eagerly, or (cuda_graph: true) captured once as a CUDA
// graph and replayed, one launch per step instead of ~400 kernel launches.
//
// What makes the step capturable (CudaModel, model.h): every buffer comes from arenas planned at
// construction (no allocation in the step; scratch borrows are in the same order every step, so
// the same addresses), the per-step inputs are staged before the step into fixed device buffers
// (each micro-batch's tokens and targets; AdamW's learning rate and bias corrections), and there
// is no host decision inside: the non-finite check runs on the device and makes AdamW skip
// (check_step). The first step runs eagerly as a warm-up, so that everything created on first use
// exists before the capture: cuBLASLt's handle, workspace and plans, cuDNN's graphs, Turbo's
// autotuned choices (the dispatcher does not time kernels while capturing:
// GlobalBackendManager::CaptureScope). The second step is captured and launched; later steps
// launch the graph.
//
// Error handling: a call in the step that cannot be captured (a synchronisation, an allocation,
// a host copy from pageable memory) fails the capture; run() then throws RuntimeError naming the
// failing call and the way out (cuda_graph: false).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <filesystem>
#include <functional>

#include "backends/cuda/args.h"
#include "backends/cuda/profile.h"

namespace primus::backends::cuda {

// The config key cuda_graph: true, false or auto (a YAML boolean, or the text auto / true / false
// as a command-line override may give it). auto, the default, captures the step where it can be
// captured (one process on a GPU) and runs it eagerly elsewhere; true asks for the capture and
// makes a setting that cannot be captured a configuration error. Anything else: ConfigError
// naming the value's origin.
enum class GraphMode { Off, On, Auto };
GraphMode parse_cuda_graph(const config::Value& v);

// A setting that cannot be captured: host mode (no GPU), data parallelism (the gradient
// reduction's bookkeeping and the loss average run on the host). With cuda_graph from `auto`
// such a step runs eagerly (args.cuda_graph is cleared, with a log line); an explicit true
// throws ConfigError naming the reason.
void check_graph_config(CudaArgs& args);

class CudaModel;

// Logs how the step runs: eager or graph, the recompute policy and the activation bytes it
// leaves, profiling.
void log_step_setup(const CudaModel& model, const CudaArgs& args);
// At the end of training: the profiler's table to the log and <output_dir>/profile.json
// (nothing when profiler is null or timed no step).
void report_profile(const StepProfiler* profiler, const std::filesystem::path& output_dir);

class StepGraph {
 public:
  // enabled = false: every run() calls body eagerly. profiler may be nullptr; it brackets each
  // step's marks (eager steps and the capture record them; replays record them from the graph).
  StepGraph(cudaStream_t stream, bool enabled, StepProfiler* profiler);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Enqueues one step; body must enqueue all of its work on `stream` and nothing else.
  void run(const std::function<void()>& body);

  bool captured() const { return exec_ != nullptr; }
  bool will_capture() const { return enabled_ && !exec_ && steps_ >= 1; }  // the next run() captures
  int64_t steps() const { return steps_; }      // run() calls so far
  int64_t launches() const { return launches_; }  // graph launches (capture included)

 private:
  void capture(const std::function<void()>& body);

  cudaStream_t stream_;
  bool enabled_;
  StepProfiler* prof_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  int64_t steps_ = 0, launches_ = 0;
};

}  // namespace primus::backends::cuda
