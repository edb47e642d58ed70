// PrimusRuntime drives every run, and is the only caller of run_patches:
//   load config -> resolve backend -> setup patches -> prepare backend -> convert config
//   -> build_args patches -> trainer.setup/init -> before_train patches -> trainer.train
//   -> after_train patches -> trainer.cleanup (always, with on_error after a failure).
#pragma once
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/backend/backend.h"
#include "core/config/experiment.h"
#include "core/patches/registry.h"

namespace primus {

struct RunOptions {
  std::string module;            // empty: the experiment's first module
  std::string stage = "pretrain";
  bool dry_run = false;          // resolve config and patches, print the plan, run nothing
  // Called at the end of a dry run's plan, e.g. to print the projected memory (cli/cmd_train.cpp).
  std::function<void(std::ostream&)> dry_run_extra;
};

// The args a run would train with and the hook table its patches leave, without the backend's
// prepare() (no device is touched) or a trainer: what `primus projection` sizes.
struct PlannedArgs {
  std::unique_ptr<BackendAdapter> adapter;
  std::shared_ptr<BackendArgs> args;
  std::unique_ptr<patches::HookTable> hooks;
};

class PrimusRuntime {
 public:
  PrimusRuntime(const BackendRegistry& backends = BackendRegistry::global(),
                const patches::PatchRegistry& patches = patches::PatchRegistry::global());

  // Runs (or plans) one module. Errors are primus::Error (exit 2 for config, 3 for runtime).
  void run(const config::Experiment& exp, const RunOptions& opts, std::ostream& out);
  // Resolves the module and converts its config, then runs the build_args patches over the args
  // and hooks (the setup phase is left out: its patches act on this process, e.g. its threads).
  PlannedArgs plan_args(const config::Experiment& exp, const std::string& module);

  // What happened, in order ("patches:setup", "prepare", "trainer.init", ...), for tests and logs.
  const std::vector<std::string>& events() const { return events_; }
  const std::vector<patches::PhaseReport>& reports() const { return reports_; }

 private:
  void phase(patches::PatchContext& ctx, patches::Phase ph, const patches::PatchFilter& f, bool quiet = false);
  const BackendRegistry& backends_;
  const patches::PatchRegistry& patches_;
  std::vector<std::string> events_;
  std::vector<patches::PhaseReport> reports_;
};

}  // namespace primus
