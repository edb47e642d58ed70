#include "backends/cuda/profile.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::ZeroGrad: return "zero grad";
    case Phase::Embedding: return "embedding";
    case Phase::Norm: return "norm (+ residual add)";
    case Phase::QkvGemm: return "qkv GEMM";
    case Phase::Rope: return "rope";
    case Phase::Attention: return "attention";
    case Phase::ProjGemm: return "attention proj GEMM";
    case Phase::MlpUpGemm: return "MLP up GEMM";
    case Phase::Activation: return "activation";
    case Phase::MlpDownGemm: return "MLP down GEMM";
    case Phase::HeadGemm: return "head GEMM";
    case Phase::Loss: return "loss (fused softmax cross-entropy)";
    case Phase::HeadGemmBwd: return "bwd head GEMM";
    case Phase::NormBwd: return "bwd norm";
    case Phase::MlpDownGemmBwd: return "bwd MLP down GEMM";
    case Phase::ActivationBwd: return "bwd activation";
    case Phase::MlpUpGemmBwd: return "bwd MLP up GEMM";
    case Phase::ProjGemmBwd: return "bwd attention proj GEMM";
    case Phase::AttentionBwd: return "bwd attention";
    case Phase::RopeBwd: return "bwd rope";
    case Phase::QkvGemmBwd: return "bwd qkv GEMM";
    case Phase::EmbeddingBwd: return "bwd embedding";
    case Phase::MoeRouter: return "MoE router (GEMM, top-k, row plan)";
    case Phase::MoePermute: return "MoE permute / unpermute";
    case Phase::MoeRouterBwd: return "bwd MoE router";
    case Phase::MoePermuteBwd: return "bwd MoE permute / unpermute";
    case Phase::Recompute: return "recompute (activations)";
    case Phase::GradNorm: return "grad norm";
    case Phase::StepCheck: return "non-finite check";
    case Phase::Optimizer: return "optimizer (AdamW)";
    case Phase::Count: break;
  }
  return "?";
}

int64_t profile_env_steps() {
  const char* v = std::getenv("PRIMUS_CUDA_PROFILE");
  if (!v || !*v || std::string(v) == "0") return 0;
  if (std::string(v) == "1") return std::numeric_limits<int64_t>::max();
  throw ConfigError(fmt::format("PRIMUS_CUDA_PROFILE='{}': use 1 (time every step's phases after the first) or 0; "
                                "profile_steps: N in the config times N steps",
                                v));
}

StepProfiler::StepProfiler(cudaStream_t stream, int64_t steps) : stream_(stream), host_(stream == nullptr), steps_(steps) {}

StepProfiler::~StepProfiler() {
  for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);  // no throwing from a destructor
}

void StepProfiler::begin_step(bool record, bool count) {
  active_ = true;
  recording_ = record;
  counting_ = count;
  if (record) sequence_.clear();
}

void StepProfiler::record(size_t i) {
  if (host_) {
    if (host_times_.size() <= i) host_times_.resize(i + 1);
    host_times_[i] = std::chrono::steady_clock::now();
    return;
  }
  // Events are created in the warm-up step, so a capture only records them (as external event
  // nodes: the graph then records them on every replay).
  while (events_.size() <= i) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  const bool capturing = turbo::cuda_stream_is_capturing(stream_);
  CUDA_CHECK(cudaEventRecordWithFlags(events_[i], stream_, capturing ? cudaEventRecordExternal : cudaEventRecordDefault));
}

void StepProfiler::mark(Phase p) {
  if (!active_ || !recording_) return;
  sequence_.push_back(p);
  record(sequence_.size() - 1);
}

void StepProfiler::end_step() {
  if (!active_) return;
  if (recording_) record(sequence_.size());
  active_ = false;
  pending_ = true;
}

double StepProfiler::elapsed_ms(size_t a, size_t b) const {
  if (host_) return std::chrono::duration<double, std::milli>(host_times_[b] - host_times_[a]).count();
  float ms = 0;
  const cudaError_t err = cudaEventElapsedTime(&ms, events_[a], events_[b]);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw RuntimeError(fmt::format("phase '{}' (mark {}) has no time: {}", phase_name(sequence_[a]), a,
                                   cudaGetErrorString(err)));
  }
  return ms;
}

void StepProfiler::collect() {
  if (!pending_) return;
  pending_ = false;
  if (!counting_ || done()) return;
  std::array<double, static_cast<size_t>(Phase::Count)> step{};
  try {
    for (size_t i = 0; i < sequence_.size(); ++i) step[static_cast<size_t>(sequence_[i])] += elapsed_ms(i, i + 1);
  } catch (const RuntimeError& e) {
    // Profiling must not stop training: report why it stopped and keep the steps already timed.
    failure_ = fmt::format("step profiler stopped after {} step(s): {}", steps_done_, e.what());
    spdlog::warn("[profile] {}", failure_);
    steps_ = steps_done_;
    return;
  }
  for (size_t i = 0; i < sequence_.size(); ++i) ++marks_[static_cast<size_t>(sequence_[i])];
  for (size_t p = 0; p < step.size(); ++p) ms_[p] += step[p];
  ++steps_done_;
}

double StepProfiler::total_ms() const {
  double t = 0;
  for (double v : ms_) t += v;
  return t;
}

namespace {
struct Row {
  Phase phase;
  double ms_per_step, share;
  int64_t marks_per_step;
};
std::vector<Row> rows(const StepProfiler& p, const std::array<int64_t, size_t(Phase::Count)>& marks) {
  std::vector<Row> r;
  const double steps = static_cast<double>(std::max<int64_t>(1, p.steps_done()));
  const double total = p.total_ms();
  for (size_t i = 0; i < size_t(Phase::Count); ++i) {
    if (marks[i] == 0) continue;
    const Phase ph = static_cast<Phase>(i);
    r.push_back({ph, p.ms(ph) / steps, total > 0 ? p.ms(ph) / total : 0.0, marks[i] / std::max<int64_t>(1, p.steps_done())});
  }
  std::stable_sort(r.begin(), r.end(), [](const Row& a, const Row& b) { return a.ms_per_step > b.ms_per_step; });
  return r;
}
}  // namespace

std::string StepProfiler::table() const {
  const double steps = static_cast<double>(std::max<int64_t>(1, steps_done_));
  std::string s = fmt::format("GPU time per phase over {} step(s): {:.3f} ms per step{}\n", steps_done_,
                              total_ms() / steps, host_ ? " (host mode: host clock)" : "");
  if (!failure_.empty()) s += "  (" + failure_ + ")\n";
  s += fmt::format("  {:<36} {:>10} {:>7} {:>7}\n", "phase", "ms/step", "share", "marks");
  for (const Row& r : rows(*this, marks_))
    s += fmt::format("  {:<36} {:>10.3f} {:>6.1f}% {:>7}\n", phase_name(r.phase), r.ms_per_step, 100.0 * r.share,
                     r.marks_per_step);
  return s;
}

std::string StepProfiler::json() const {
  nlohmann::json j;
  j["steps"] = steps_done_;
  j["clock"] = host_ ? "host" : "cuda events";
  j["step_ms"] = total_ms() / static_cast<double>(std::max<int64_t>(1, steps_done_));
  if (!failure_.empty()) j["failure"] = failure_;
  j["phases"] = nlohmann::json::array();
  for (const Row& r : rows(*this, marks_)) {
    j["phases"].push_back({{"phase", phase_name(r.phase)},
                           {"ms_per_step", r.ms_per_step},
                           {"share", r.share},
                           {"marks_per_step", r.marks_per_step}});
  }
  return j.dump(2);
}

void StepProfiler::write_json(const std::filesystem::path& file) const {
  const auto tmp = file.string() + ".tmp";
  {
    std::ofstream f(tmp);
    f << json() << "\n";
    if (!f) throw RuntimeError(fmt::format("step profiler: cannot write {}", tmp));
  }
  std::filesystem::rename(tmp, file);
}

}  // namespace primus::backends::cuda
