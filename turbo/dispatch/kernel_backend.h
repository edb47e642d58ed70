// KernelBackend<Args>: one implementation of one op. `Args` is the op's argument struct
// (tensors, scalars, stream); it must provide
//   std::string key() const;        everything that changes which kernel is fastest: shapes,
//                                   dtypes, layouts, epilogue (never pointers)
//   Precision precision() const;    the precision class a per-precision choice keys on
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "turbo/dispatch/backend_type.h"

namespace primus::turbo {

template <class Args>
class KernelBackend {
 public:
  virtual ~KernelBackend() = default;
  virtual BackendType type() const = 0;
  // Whether this backend can run `args`. Returns false (with the reason in *why when non-null)
  // for anything it does not support; never throws: the dispatcher calls it to choose.
  virtual bool can_handle(const Args& args, std::string* why) const noexcept = 0;
  // Runs the op. May throw primus::RuntimeError on a runtime failure (CUDA error).
  virtual void execute(const Args& args) const = 0;
};

// A backend from two callables, for ops whose backends are plain functions.
//   can_handle: std::string(const Args&)  -> empty when supported, else the reason
//   execute:    void(const Args&)
template <class Args>
class FunctionBackend final : public KernelBackend<Args> {
 public:
  using Check = std::function<std::string(const Args&)>;
  using Run = std::function<void(const Args&)>;
  // Plain function pointers, for helpers that take an op's file-local functions by name: a name
  // overloaded on Args (every op's source has its own `cpu_check`) resolves against these.
  using CheckFn = std::string (*)(const Args&);
  using RunFn = void (*)(const Args&);
  FunctionBackend(BackendType type, Check check, Run run)
      : type_(type), check_(std::move(check)), run_(std::move(run)) {}

  BackendType type() const override { return type_; }
  bool can_handle(const Args& args, std::string* why) const noexcept override {
    try {
      std::string reason = check_(args);
      if (reason.empty()) return true;
      if (why) *why = std::move(reason);
      return false;
    } catch (const std::exception& e) {  // a checker that throws still only says "no"
      if (why) *why = std::string("check failed: ") + e.what();
      return false;
    } catch (...) {
      if (why) *why = "check failed";
      return false;
    }
  }
  void execute(const Args& args) const override { run_(args); }

 private:
  BackendType type_;
  Check check_;
  Run run_;
};

template <class Args>
std::unique_ptr<KernelBackend<Args>> make_backend(BackendType type,
                                                  typename FunctionBackend<Args>::Check check,
                                                  typename FunctionBackend<Args>::Run run) {
  return std::make_unique<FunctionBackend<Args>>(type, std::move(check), std::move(run));
}

}  // namespace primus::turbo
