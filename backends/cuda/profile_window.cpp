#include "backends/cuda/profile_window.h"

#include <cuda_profiler_api.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {

ProfileWindowArgs profile_window_args(const std::function<const config::Value*(const std::string&)>& get) {
  ProfileWindowArgs a;
  auto where = [&get](const char* key) { return get(key)->origin().str(); };
  auto set = [&get](const char* key) {
    const config::Value* v = get(key);
    return v && !v->is_null();
  };
  a.profile = set("profile") && get("profile")->as_bool();
  if (set("profile_step_start")) a.start = get("profile_step_start")->as_int();
  if (set("profile_step_end")) a.end = get("profile_step_end")->as_int();
  if (set("profile_ranks")) {
    a.ranks.clear();
    const config::Value& r = *get("profile_ranks");
    if (r.is_list()) {
      for (const config::Value& x : r.items()) {
        if (x.kind() != config::Value::Kind::Int || x.as_int() < 0)
          throw ConfigError(fmt::format("{}: profile_ranks holds ranks (integers from 0), got '{}'", where("profile_ranks"),
                                        x.scalar_text()));
        a.ranks.push_back(x.as_int());
      }
    } else if (r.kind() == config::Value::Kind::Int && r.as_int() >= 0) {
      a.ranks.push_back(r.as_int());
    } else {
      throw ConfigError(fmt::format("{}: profile_ranks is a list of ranks, got '{}'", where("profile_ranks"),
                                    r.scalar_text()));
    }
  }
  if (!a.profile) return a;
  if (a.end <= a.start)
    throw ConfigError(fmt::format("{}: profile_step_end {} must be larger than profile_step_start {} ({}): the window "
                                  "holds the steps from the one after profile_step_start to profile_step_end",
                                  where("profile_step_end"), a.end, a.start, where("profile_step_start")));
  if (set("use_pytorch_profiler") && get("use_pytorch_profiler")->as_bool())
    throw ConfigError(fmt::format(
        "{}: use_pytorch_profiler: true beside profile: true is not implemented (there is no PyTorch profiler here): "
        "set it false to open the CUDA profiler's capture range for steps {}-{} (run under `nsys profile "
        "--capture-range=cudaProfilerApi`), or use profile_steps for the per-phase time table",
        where("use_pytorch_profiler"), a.start + 1, a.end));
  return a;
}

ProfileWindow::ProfileWindow(const ProfileWindowArgs& a, int64_t rank, std::function<void(bool)> toggle)
    : a_(a), toggle_(std::move(toggle)) {
  active_ = a.profile && std::find(a.ranks.begin(), a.ranks.end(), rank) != a.ranks.end();
  if (!toggle_) {
    toggle_ = [](bool start) {
      if (start) CUDA_CHECK(cudaProfilerStart());
      else CUDA_CHECK(cudaProfilerStop());
    };
  }
  if (active_) {
    spdlog::info("[profile] rank {}: the CUDA profiler's capture range holds steps {}-{} (profile_step_start {}, "
                 "profile_step_end {}); run under `nsys profile --capture-range=cudaProfilerApi`",
                 rank, a.start + 1, a.end, a.start, a.end);
  }
}

void ProfileWindow::before_step(int64_t step) {
  if (!active_ || open_ || step != a_.start) return;
  toggle_(true);
  open_ = true;
  spdlog::info("[profile] capture range opened before step {}", step + 1);
}

void ProfileWindow::after_step(int64_t step) {
  if (!open_ || step + 1 != a_.end) return;
  toggle_(false);
  open_ = false;
  active_ = false;
  spdlog::info("[profile] capture range closed after step {}", step + 1);
}

void ProfileWindow::finish() {
  if (!open_) return;
  toggle_(false);
  open_ = false;
  active_ = false;
  spdlog::info("[profile] capture range closed at the end of training (before profile_step_end {})", a_.end);
}

}  // namespace primus::backends::cuda
