// OpDispatcher<Args>: picks the backend for each call of one op, then runs it.
//
// Order (high to low): user choice from GlobalBackendManager (code setter, then
// PRIMUS_TURBO_<OP>_BACKEND) -> autotune (per-op AUTOTUNE choice or the global switch) -> the
// op's default backend (a per-call default rule first, where the op has one: a measured
// preference such as "this backend for these epilogues") -> fallback over the registered backends, in registration order,
// whose can_handle says yes (with a warning given once per op and backend pair).
//
// A backend the user forced that cannot handle the call is an error naming the op, the backend,
// where the choice came from and the backend's reason: silently running something else would
// hide a misconfiguration. Autotune times every capable backend once per Args::key() with the
// dispatcher's timer and keeps the winner in a bounded LRU cache; while a CUDA graph is being
// captured (GlobalBackendManager::capturing() or the op's capture probe) nothing can be timed,
// so a cache miss then uses the default order and caches nothing. Ops that write in place set
// autotune=false: timing them would run them several times.
#pragma once
#include <fmt/format.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/dispatch/kernel_backend.h"
#include "turbo/dispatch/lru_cache.h"

namespace primus::turbo {

// What a forced backend's refusal of one call throws (the backend lacks that epilogue, layout or
// shape): a RuntimeError like every other failure, distinguishable by callers that can carry on
// without that call (the benchmark, which skips such a product of a case and times the rest).
struct BackendRefusedError : RuntimeError {
  explicit BackendRefusedError(const std::string& w) : RuntimeError(w) {}
};

struct DispatcherOptions {
  bool autotune = true;          // false for ops that are not idempotent (in-place writes)
  size_t cache_capacity = 1024;  // autotune entries kept (one per shape key)
};

template <class Args>
class OpDispatcher {
 public:
  // Runs `run` (one execution of a backend on `args`) as often as it likes and returns a cost
  // (lower is faster, e.g. milliseconds). The CUDA ops install an event timer on the args' stream.
  using Timer = std::function<double(const Args&, const std::function<void()>& run)>;
  using CaptureProbe = std::function<bool(const Args&)>;
  // The default for one call, where it differs from the op's default (nullopt: no preference).
  // A preferred backend that cannot handle the call is passed over for the op's default.
  using DefaultRule = std::function<std::optional<BackendType>(const Args&)>;

  OpDispatcher(std::string op, BackendType default_backend, DispatcherOptions opt = {})
      : op_(std::move(op)), default_(default_backend), opt_(opt), cache_(opt.cache_capacity),
        timer_(host_clock_timer) {
    hook_ = GlobalBackendManager::instance().add_reset_hook([this] { clear_autotune_cache(); });
  }
  ~OpDispatcher() { GlobalBackendManager::instance().remove_reset_hook(hook_); }
  OpDispatcher(const OpDispatcher&) = delete;
  OpDispatcher& operator=(const OpDispatcher&) = delete;

  // Adds a backend (replacing one of the same type). Registration order is fallback order.
  void register_backend(std::unique_ptr<KernelBackend<Args>> b) {
    std::lock_guard lock(mu_);
    for (auto& have : backends_)
      if (have->type() == b->type()) { have = std::move(b); return; }
    backends_.push_back(std::move(b));
  }
  void set_timer(Timer t) { std::lock_guard lock(mu_); timer_ = std::move(t); }
  void set_capture_probe(CaptureProbe p) { std::lock_guard lock(mu_); probe_ = std::move(p); }
  void set_default_backend(BackendType b) { std::lock_guard lock(mu_); default_ = b; }
  void set_default_rule(DefaultRule r) { std::lock_guard lock(mu_); rule_ = std::move(r); }

  // Chooses the backend for `args` (running candidates only when autotuning a new key).
  // Throws RuntimeError when a forced backend cannot handle the call or no backend can, and
  // ConfigError when the environment is malformed.
  BackendType select(const Args& args) { return choose(args).type(); }

  // select() then execute; returns the backend that ran.
  BackendType dispatch(const Args& args) {
    const KernelBackend<Args>& b = choose(args);
    b.execute(args);
    return b.type();
  }

  bool has_backend(BackendType t) const { std::lock_guard lock(mu_); return find(t) != nullptr; }
  const std::string& op() const { return op_; }
  BackendType default_backend() const { std::lock_guard lock(mu_); return default_; }
  size_t autotune_runs() const { std::lock_guard lock(mu_); return tune_runs_; }
  size_t autotune_cache_size() const { std::lock_guard lock(mu_); return cache_.size(); }
  size_t autotune_evictions() const { std::lock_guard lock(mu_); return cache_.evictions(); }
  void clear_autotune_cache() { std::lock_guard lock(mu_); cache_.clear(); }

 private:
  static double host_clock_timer(const Args&, const std::function<void()>& run) {
    run();  // warm-up: first-call costs (allocation, plan creation) do not decide the race
    double best = 1e300;
    for (int i = 0; i < 3; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      best = ms < best ? ms : best;
    }
    return best;
  }

  const KernelBackend<Args>* find(BackendType t) const {
    for (const auto& b : backends_)
      if (b->type() == t) return b.get();
    return nullptr;
  }

  std::string registered_names() const {
    std::string s;
    for (const auto& b : backends_) s += (s.empty() ? "" : ", ") + std::string(backend_name(b->type()));
    return s.empty() ? "none" : s;
  }

  const KernelBackend<Args>& choose(const Args& args) {
    auto& mgr = GlobalBackendManager::instance();
    const Precision prec = args.precision();
    const std::optional<UserChoice> user = mgr.user_choice(op_, prec);
    std::unique_lock lock(mu_);

    // 1-2. A backend the user named.
    if (user && !user->choice.is_autotune()) {
      const KernelBackend<Args>* b = find(user->choice.backend);
      if (!b)
        throw RuntimeError(fmt::format(
            "turbo op '{}': backend {} (chosen by {}) is not available for this op (available: {})",
            op_, backend_name(user->choice.backend), user->source, registered_names()));
      std::string why;
      if (!b->can_handle(args, &why))
        throw BackendRefusedError(fmt::format(
            "turbo op '{}': backend {} (chosen by {}) cannot handle this call [{}]: {}", op_,
            backend_name(b->type()), user->source, args.key(), why));
      return *b;
    }

    // 3. Autotune.
    lock.unlock();
    const bool tune_wanted = (user && user->choice.is_autotune()) || mgr.auto_tune_enabled();
    lock.lock();
    if (tune_wanted && opt_.autotune) {
      const std::string key = args.key();
      if (auto hit = cache_.get(key)) {
        if (const KernelBackend<Args>* b = find(*hit)) return *b;
      }
      const bool capturing = mgr.capturing() || (probe_ && probe_(args));
      if (!capturing) {
        std::vector<const KernelBackend<Args>*> capable;
        for (const auto& b : backends_)
          if (b->can_handle(args, nullptr)) capable.push_back(b.get());
        if (!capable.empty()) {
          const KernelBackend<Args>* best = capable.front();
          if (capable.size() > 1) {
            double best_cost = 1e300;
            for (const KernelBackend<Args>* b : capable) {
              const double cost = timer_(args, [&] { b->execute(args); });
              if (cost < best_cost) { best_cost = cost; best = b; }
            }
          }
          ++tune_runs_;
          cache_.put(key, best->type());
          return *best;
        }
      }
    }

    // 4. The op's default: the per-call rule's preference, then the op's default backend.
    if (rule_) {
      if (const std::optional<BackendType> want = rule_(args); want && *want != default_) {
        if (const KernelBackend<Args>* b = find(*want); b && b->can_handle(args, nullptr)) return *b;
      }
    }
    std::string default_why = "not registered";
    if (const KernelBackend<Args>* b = find(default_)) {
      if (b->can_handle(args, &default_why)) return *b;
    }

    // 5. Fallback, in registration order.
    std::string reasons = fmt::format("{}: {}", backend_name(default_), default_why);
    for (const auto& b : backends_) {
      if (b->type() == default_) continue;
      std::string why;
      if (b->can_handle(args, &why)) {
        const BackendType from = default_;
        lock.unlock();
        mgr.warn_once(fmt::format("{}:{}->{}", op_, backend_name(from), backend_name(b->type())),
                      fmt::format("turbo op '{}': default backend {} cannot handle [{}] ({}); "
                                  "falling back to {} (warned once)",
                                  op_, backend_name(from), args.key(), default_why,
                                  backend_name(b->type())));
        return *b;
      }
      reasons += fmt::format("; {}: {}", backend_name(b->type()), why);
    }
    throw RuntimeError(fmt::format("turbo op '{}': no backend can handle [{}] ({})", op_,
                                   args.key(), reasons));
  }

  std::string op_;
  BackendType default_;
  DispatcherOptions opt_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<KernelBackend<Args>>> backends_;
  LruCache<std::string, BackendType> cache_;
  Timer timer_;
  CaptureProbe probe_;
  DefaultRule rule_;
  size_t tune_runs_ = 0;
  int hook_ = -1;
};

}  // namespace primus::turbo
