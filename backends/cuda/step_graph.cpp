#include "backends/cuda/step_graph.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <exception>
#include <limits>
#include <string>

#include "backends/cuda/model.h"
#include "core/util/error.h"
#include "turbo/core/cuda_check.h"
#include "turbo/dispatch/backend_manager.h"

namespace primus::backends::cuda {

GraphMode parse_cuda_graph(const config::Value& v) {
  if (v.kind() == config::Value::Kind::Bool) return v.as_bool() ? GraphMode::On : GraphMode::Off;
  if (v.kind() == config::Value::Kind::String) {
    const std::string s = v.as_string();
    if (s == "auto") return GraphMode::Auto;
    if (s == "true") return GraphMode::On;
    if (s == "false") return GraphMode::Off;
  }
  throw ConfigError(fmt::format("{}: key 'cuda_graph' = '{}' is not one of: auto, true, false", v.origin().str(),
                                v.scalar_text()));
}

void check_graph_config(CudaArgs& a) {
  if (!a.cuda_graph) return;
  const int64_t tp = a.train.model_parallel[parallel::Dim::TP];
  const int64_t cp = a.train.model_parallel[parallel::Dim::CP];
  if (a.cuda_graph_auto && (a.host_mode || a.train.data_parallel_size > 1 || tp > 1 || cp > 1)) {
    a.cuda_graph = false;
    spdlog::info("[cuda] cuda_graph auto: the step runs eagerly ({})",
                 a.host_mode ? "host mode has no GPU"
                 : tp > 1    ? fmt::format("tensor_model_parallel_size {}: the tp collectives are not captured", tp)
                 : cp > 1    ? fmt::format("context_parallel_size {}: the cp collectives are not captured", cp)
                             : fmt::format("data_parallel_size {}: the gradient reduction runs on the host inside the "
                                           "step",
                                           a.train.data_parallel_size));
    return;
  }
  if (const int64_t ep = a.train.model_parallel[parallel::Dim::EP]; ep > 1 && !a.host_mode) {
    throw ConfigError(fmt::format("cuda_graph: true with expert_model_parallel_size {}: each MoE layer's token counts are "
                                  "read on the host to size its all-to-all (set cuda_graph: false)",
                                  ep));
  }
  const parallel::DpSharding sharding = a.train.model_parallel.sharding;
  if (a.train.data_parallel_size > 1 && !a.host_mode && parallel::shards_gradients(sharding)) {
    throw ConfigError(fmt::format("cuda_graph: true with data_parallel_sharding_strategy {}: the sharded collectives "
                                  "are not captured yet (set cuda_graph: false)",
                                  parallel::dp_sharding_name(sharding)));
  }
  if (cp > 1 && !a.host_mode) {
    throw ConfigError(fmt::format("cuda_graph: true with context_parallel_size {}: the cp collectives are not captured "
                                  "yet (set cuda_graph: false)",
                                  cp));
  }
  if (tp > 1 && !a.host_mode) {
    throw ConfigError(fmt::format("cuda_graph: true with tensor_model_parallel_size {}: the tp collectives are not "
                                  "captured yet (set cuda_graph: false)",
                                  tp));
  }
  if (a.host_mode) {
    throw ConfigError("cuda_graph: true needs a GPU: the model's host mode runs its ops on the CPU, where there is no "
                      "graph to capture (set cuda_graph: false)");
  }
  if (a.train.data_parallel_size > 1) {
    throw ConfigError(fmt::format("cuda_graph: true with data_parallel_size {}: the gradient reduction's bucket "
                                  "bookkeeping and the loss average run on the host inside the step, so the step "
                                  "cannot be captured yet (set cuda_graph: false)",
                                  a.train.data_parallel_size));
  }
}

void log_step_setup(const CudaModel& model, const CudaArgs& args) {
  const int64_t L = model.spec().num_layers;
  std::string policy = recompute_name(model.recompute(0));
  for (int64_t l = 1; l < L; ++l) {
    if (model.recompute(l) != model.recompute(0)) {
      policy = "per layer:";
      for (int64_t k = 0; k < L; ++k) policy += fmt::format(" {}", recompute_name(model.recompute(k)));
      break;
    }
  }
  spdlog::info("[cuda] step: {}; AdamW {}; activation recompute {} ({:.3f} GiB of activations reserved); phase "
               "profile {}",
               args.cuda_graph ? "CUDA graph (captured after a warm-up step)" : "eager",
               model.optimizer_in_backward() ? "in the backward, layer by layer (one layer's gradient buffer)"
                                             : "after the backward",
               policy,
               static_cast<double>(model.activation_bytes()) / double(size_t{1} << 30),
               args.profile_steps <= 0 ? std::string("off")
               : args.profile_steps == std::numeric_limits<int64_t>::max()
                   ? std::string("every step after the first")
                   : fmt::format("{} steps after the first", args.profile_steps));
}

void report_profile(const StepProfiler* p, const std::filesystem::path& dir) {
  if (!p) return;
  if (p->steps_done() == 0) {
    spdlog::warn("[profile] no step was timed{}", p->failure().empty() ? "" : ": " + p->failure());
    return;
  }
  spdlog::info("[profile] {}", p->table());
  const auto file = dir / "profile.json";
  p->write_json(file);
  spdlog::info("[profile] written to {}", file.string());
}

StepGraph::StepGraph(cudaStream_t stream, bool enabled, StepProfiler* profiler)
    : stream_(stream), enabled_(enabled), prof_(profiler) {
  if (enabled_ && !stream_) throw RuntimeError("StepGraph: a CUDA graph needs the model's device stream");
}

StepGraph::~StepGraph() {
  if (exec_) (void)cudaGraphExecDestroy(exec_);  // no throwing from a destructor
  if (graph_) (void)cudaGraphDestroy(graph_);
}

void StepGraph::capture(const std::function<void()>& body) {
  turbo::GlobalBackendManager::CaptureScope scope;  // the dispatcher must not time kernels now
  // Thread-local mode: another thread's CUDA calls (a data loader, a logger) cannot invalidate
  // the capture, while a forbidden call on this thread still fails it.
  CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  std::string failure;
  try {
    body();
    if (prof_) prof_->end_step();  // the end mark belongs to the graph
  } catch (const std::exception& e) {
    failure = e.what();
  }
  cudaGraph_t g = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream_, &g);
  if (failure.empty() && end != cudaSuccess) failure = fmt::format("cudaStreamEndCapture: {}", cudaGetErrorString(end));
  if (!failure.empty()) {
    if (g) (void)cudaGraphDestroy(g);
    (void)cudaGetLastError();  // the capture's error is reported here, not by the next call
    throw RuntimeError(fmt::format("cuda_graph: capturing the training step failed: {}. Something in the step "
                                   "synchronises, allocates or copies from pageable host memory; run with "
                                   "cuda_graph: false (and report it)",
                                   failure));
  }
  graph_ = g;
  size_t nodes = 0;
  CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &nodes));
  const cudaError_t inst = cudaGraphInstantiate(&exec_, graph_, 0);
  if (inst != cudaSuccess) {
    (void)cudaGetLastError();
    exec_ = nullptr;
    throw RuntimeError(fmt::format("cuda_graph: instantiating the captured step ({} nodes) failed: {}", nodes,
                                   cudaGetErrorString(inst)));
  }
  spdlog::info("[cuda] training step captured as a CUDA graph ({} nodes); replayed from now on", nodes);
}

void StepGraph::run(const std::function<void()>& body) {
  // The first step is the warm-up: its times are not profiled (it creates plans and workspaces).
  const bool count = steps_ >= 1;
  const bool profile = prof_ && !prof_->done();
  ++steps_;
  if (exec_) {
    if (profile) prof_->begin_step(false, count);
    CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    ++launches_;
    if (profile) prof_->end_step();
    return;
  }
  if (profile) prof_->begin_step(true, count);
  if (enabled_ && count) {
    capture(body);
    CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    ++launches_;
    return;
  }
  body();
  if (profile) prof_->end_step();
}

}  // namespace primus::backends::cuda
