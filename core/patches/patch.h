// A patch: an optional behaviour layered over a backend without editing it. Registered with
// the fields of the original Primus (id, backend, phase, description, condition, priority,
// backend_versions, tags) plus what the inventory needs to be honest: the hook slots it may
// replace or wrap (checked when it runs) or, for patches that touch no slot, what it changes.
#pragma once
#include <functional>
#include <source_location>
#include <string>
#include <vector>

namespace primus::patches {

class PatchContext;

enum class Phase { Setup, BuildArgs, BeforeTrain, AfterTrain };
const char* phase_name(Phase p);
const std::vector<Phase>& all_phases();

struct Patch {
  std::string id;                 // unique, dotted: <backend>.<area>.<name>
  std::string backend;            // a backend name, or "*" for all
  Phase phase = Phase::Setup;
  std::string description;        // one line a customer can read
  std::function<bool(PatchContext&)> condition;  // empty: always applies
  int priority = 50;              // lower runs first; ties keep registration order
  std::string backend_versions;   // e.g. ">=0.1,<1.0"; empty: any version
  std::vector<std::string> tags;
  std::function<void(PatchContext&)> apply;
  // Inventory: the slots this patch replaces or wraps. A patch that changes a slot it did not
  // declare is stopped with an error, so this list cannot drift from the code.
  std::vector<std::string> slots;
  std::string logic;    // for patches without slots: "rewrites args: grad_accum_steps", ...
  std::string impl;     // where the real implementation lives, when not in the patch file
  std::string porting;  // how to port the idea into another framework
  // Filled at registration.
  std::string file;
  int line = 0;
  int order = 0;
};

}  // namespace primus::patches
