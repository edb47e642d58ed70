// A patch: an optional behaviour layered over a backend without editing it. It is written in one
// place, as a PatchSpec with designated initializers handed to PatchRegistry::add:
//
//   reg.add({
//       .id = "cuda.attention.flash",        // <backend>.<area>.<name>; the backend comes from here
//       .description = "runs attention with the in-house flash kernel",
//       .slots = {"cuda.attention.forward"},
//       .condition = [](PatchContext& c) { return c.flag("use_flash"); },
//       .apply = [](PatchContext& c) { c.replace<AttnFn>("cuda.attention.forward", flash); },
//   });
//
// Fields go in the order declared below (C++ requires it); every field but id, description and
// apply has a default. Besides the original Primus fields (phase, condition, priority,
// backend_versions, tags) a patch says what the inventory needs to be honest: the hook slots it
// may replace or wrap (checked when it runs) or, for patches that touch no slot, what it changes.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace primus::patches {

class PatchContext;

enum class Phase { Setup, BuildArgs, BeforeTrain, AfterTrain };
const char* phase_name(Phase p);
const std::vector<Phase>& all_phases();

// What a patch's author writes. Every member has an initializer so that fields left out of a
// designated initializer take their default without a -Wmissing-field-initializers warning.
struct PatchSpec {
  // Unique, `<backend>.<area>.<name>` in lower case, digits and `_`. The first part names the
  // backend the patch is for (`*`: every backend); `area` groups the inventory.
  std::string id{};
  std::string description{};            // one line a customer can read
  Phase phase = Phase::BuildArgs;       // most patches rewrite args or slots before the model is built
  int priority = 50;                    // lower runs first; ties keep registration order
  std::string backend_versions{};       // e.g. ">=0.1,<1.0"; empty: any version
  std::vector<std::string> tags{};
  // The slots this patch replaces or wraps. A patch that changes a slot it did not declare is
  // stopped with an error, so this list cannot drift from the code.
  std::vector<std::string> slots{};
  std::string logic{};    // for what is not a slot: "rewrites args: grad_accum_steps", "sets env ..."
  std::string impl{};     // where the real implementation lives, when not in the patch file
  std::string porting{};  // how to port the idea into another framework
  std::function<bool(PatchContext&)> condition{};  // empty: always applies
  std::function<void(PatchContext&)> apply{};
};

// A registered patch: the spec plus what registration derives from it.
struct Patch : PatchSpec {
  std::string backend{};  // the id's first part: a backend name, or "*" for all
  std::string file{};     // the registration site, relative to the repository
  int line = 0;
  int order = 0;          // registration order, the tie-break among equal priorities
};

}  // namespace primus::patches
