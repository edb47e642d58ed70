#include "core/runtime/runtime.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>
#include <string>

#include "core/util/error.h"

namespace primus {

using patches::Phase;

PrimusRuntime::PrimusRuntime(const BackendRegistry& backends, const patches::PatchRegistry& p)
    : backends_(backends), patches_(p) {}

void PrimusRuntime::phase(patches::PatchContext& ctx, Phase ph, const patches::PatchFilter& f, bool quiet) {
  events_.push_back(std::string("patches:") + patches::phase_name(ph));
  reports_.push_back(patches::run_patches(patches::PhaseKey{}, patches_, ctx, ph, f, quiet));
}

void PrimusRuntime::run(const config::Experiment& exp, const RunOptions& opts, std::ostream& out) {
  events_.clear();
  reports_.clear();
  const config::ModuleSpec& spec = exp.module(opts.module.empty() ? exp.modules.front().name : opts.module);
  auto adapter = backends_.create(spec.framework);
  config::ModuleConfig cfg = config::resolve_module(exp, spec.name, adapter->schema());
  // Keys set in two layers: each at debug level with both places, and one info line naming
  // them (a dry run prints the full table below instead), so nothing is overwritten silently
  // and a normal run's log is not a page of expected preset overrides.
  if (!cfg.notes.empty()) {
    std::string keys;
    std::set<std::string> seen;
    for (auto& n : cfg.notes) {
      spdlog::debug("[config] {} = {} ({}) overrides {} ({})", n.key, n.later_value, n.later.str(), n.earlier_value,
                    n.earlier.str());
      if (seen.insert(n.key).second) keys += (keys.empty() ? " " : ", ") + n.key;
    }
    if (!opts.dry_run) {
      spdlog::info("[config] {} key(s) set in more than one layer, the last wins (where: `primus config show "
                   "--explain` or PRIMUS_LOG_LEVEL=debug):{}",
                   seen.size(), keys);
    }
  }
  auto filter = patches::PatchFilter::from_env(patches_);
  patches::HookTable hooks;
  adapter->define_hooks(hooks);
  patches::PatchContext ctx(cfg.params, adapter->name(), adapter->version(), &hooks);

  if (opts.dry_run) {
    out << "Plan for module '" << spec.name << "' (stage " << opts.stage << ")\n"
        << "  backend:   " << adapter->name() << " " << adapter->version() << "\n"
        << "  output:    " << exp.output_dir().string() << "\n"
        << "  layers:\n";
    for (auto& l : cfg.layers) out << "    - " << l << "\n";
    if (!cfg.notes.empty()) {
      out << "  keys set in two layers (last wins):\n";
      for (auto& n : cfg.notes) {
        out << "    - " << n.key << ": " << n.earlier_value << " (" << n.earlier.str() << ") -> "
            << n.later_value << " (" << n.later.str() << ")\n";
      }
    }
    out << "  patches:\n";
    for (Phase ph : patches::all_phases()) {
      for (const patches::Patch* p : patches::ordered(patches_, adapter->name(), ph)) {
        auto d = patches::decide(*p, ctx, filter);
        out << "    [" << patches::phase_name(ph) << "] " << (d.applies ? "apply " : "skip  ") << p->id
            << ": " << d.reason << "\n";
      }
    }
    auto args = adapter->convert_config(cfg, exp);
    const auto before = args->describe();
    out << "  backend args (before build_args patches):\n";
    for (auto& [k, v] : before) out << "    " << k << ": " << v << "\n";
    // The build_args patches rewrite the args the trainer gets (as plan_args runs them): run here
    // too, so the plan shows what they change and a patch that refuses the config fails the dry
    // run as it would fail the run. What else they do (hook replacements in this plan's table, a
    // process-wide op backend) ends with the process, which runs nothing after the plan.
    ctx.set_args(args);
    phase(ctx, Phase::BuildArgs, filter, /*quiet=*/true);
    out << "  backend args set by build_args patches:\n";
    int changed = 0;
    for (auto& [k, v] : args->describe()) {
      const auto was = std::find_if(before.begin(), before.end(), [&k = k](const auto& e) { return e.first == k; });
      if (was != before.end() && was->second == v) continue;
      const std::string old = was == before.end() ? "(unset)" : was->second.empty() ? "(empty)" : was->second;
      out << "    " << k << ": " << old << " -> " << (v.empty() ? "(empty)" : v) << "\n";
      ++changed;
    }
    if (changed == 0) out << "    (none)\n";
    if (opts.dry_run_extra) opts.dry_run_extra(out);
    out << "Dry run: nothing was run.\n";
    events_.push_back("dry_run");
    return;
  }

  phase(ctx, Phase::Setup, filter);
  events_.push_back("prepare");
  adapter->prepare(cfg);
  events_.push_back("convert_config");
  std::shared_ptr<BackendArgs> args = adapter->convert_config(cfg, exp);
  ctx.set_args(args);
  phase(ctx, Phase::BuildArgs, filter);
  events_.push_back("create_trainer");
  std::unique_ptr<Trainer> trainer = adapter->create_trainer(opts.stage, args, hooks);
  if (!trainer) throw RuntimeError(fmt::format("backend {} has no stage '{}'", adapter->name(), opts.stage));
  try {
    events_.push_back("trainer.setup");
    trainer->setup();
    events_.push_back("trainer.init");
    trainer->init();
    phase(ctx, Phase::BeforeTrain, filter);
    events_.push_back("trainer.train");
    trainer->train();
    phase(ctx, Phase::AfterTrain, filter);
  } catch (...) {
    events_.push_back("trainer.cleanup(on_error)");
    try {
      trainer->cleanup(true);
    } catch (const std::exception& e) {
      spdlog::error("cleanup after a failure also failed: {}", e.what());
    }
    throw;
  }
  events_.push_back("trainer.cleanup");
  trainer->cleanup(false);
}

PlannedArgs PrimusRuntime::plan_args(const config::Experiment& exp, const std::string& module) {
  const config::ModuleSpec& spec = exp.module(module.empty() ? exp.modules.front().name : module);
  PlannedArgs p;
  p.adapter = backends_.create(spec.framework);
  config::ModuleConfig cfg = config::resolve_module(exp, spec.name, p.adapter->schema());
  p.hooks = std::make_unique<patches::HookTable>();
  p.adapter->define_hooks(*p.hooks);
  patches::PatchContext ctx(cfg.params, p.adapter->name(), p.adapter->version(), p.hooks.get());
  p.args = p.adapter->convert_config(cfg, exp);
  ctx.set_args(p.args);
  phase(ctx, Phase::BuildArgs, patches::PatchFilter::from_env(patches_));
  return p;
}

}  // namespace primus
