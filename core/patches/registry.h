// PatchRegistry holds every registered patch; run_patches applies one phase's patches and is
// callable only by the runtime (its PhaseKey can be made by core/runtime alone).
#pragma once
#include <optional>
#include <set>
#include <source_location>
#include <string>
#include <vector>

#include "core/patches/context.h"
#include "core/patches/patch.h"

namespace primus {
class PrimusRuntime;
}

namespace primus::patches {

class PatchRegistry {
 public:
  static PatchRegistry& global();
  // Registers a patch written as `reg.add({.id = ..., ...})`, recording the caller's file and line
  // for the inventory. The backend is the id's first part. A spec the engine could not honour is
  // a logic_error naming the id and the registration site: an id that is not
  // `<backend>.<area>.<name>` or is taken, no description or body, a slot of another backend or
  // declared twice, a setup/build_args patch that names neither slots nor logic, or a
  // backend_versions range that does not parse.
  void add(PatchSpec spec, std::source_location where = std::source_location::current());
  const Patch* find(const std::string& id) const;
  const Patch& get(const std::string& id) const;  // unknown id -> ConfigError with suggestion
  std::vector<const Patch*> for_backend(const std::string& backend) const;  // "" = all
  const std::vector<Patch>& all() const { return patches_; }

 private:
  std::vector<Patch> patches_;
};

// PRIMUS_PATCHES: "all" (default) | "none" | "id1,id2". An unknown id is a ConfigError.
struct PatchFilter {
  enum class Mode { All, None, List } mode = Mode::All;
  std::set<std::string> ids;
  static PatchFilter parse(const std::string& spec, const PatchRegistry& reg);
  static PatchFilter from_env(const PatchRegistry& reg);
  bool allows(const std::string& id) const;
};

// Whether a patch would apply, and if not, why.
struct Decision {
  const Patch* patch = nullptr;
  bool applies = false;
  std::string reason;              // why it was skipped, or "condition true" / "always"
  std::vector<std::string> keys;   // config keys its condition read, "key=value"
};

// Pure: evaluates backend, allow-list, version gate and condition without applying.
Decision decide(const Patch& p, PatchContext& ctx, const PatchFilter& filter);
bool version_in_range(const std::string& version, const std::string& range);

struct PhaseReport {
  Phase phase;
  std::vector<Decision> decisions;  // in the order they were considered
};

class PhaseKey {
  friend class primus::PrimusRuntime;
  PhaseKey() = default;
};

// Applies every patch of `phase` for ctx.backend(), lowest priority first. A patch that throws
// stops the run with an error naming the patch id. Logs what applied and what was skipped (at
// debug level when `quiet`: a dry run, which prints its own plan of them).
PhaseReport run_patches(PhaseKey, const PatchRegistry& reg, PatchContext& ctx, Phase phase,
                        const PatchFilter& filter, bool quiet = false);

// The phase's patches for a backend in the order they would run.
std::vector<const Patch*> ordered(const PatchRegistry& reg, const std::string& backend, Phase phase);

}  // namespace primus::patches
