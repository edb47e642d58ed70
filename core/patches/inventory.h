// The customer-facing patch inventory, built from the registry itself (never from grepping):
// Patch | What it does | Patch logic | Code location | How to enable, grouped by area.
#pragma once
#include <nlohmann/json.hpp>

#include <string>

#include "core/patches/registry.h"

namespace primus::patches {

struct InventoryRow {
  const Patch* patch;
  std::string area;     // second part of the id
  std::string logic;    // "replaces cuda.attention.forward", "rewrites args: ..."
  std::string location;
  std::string enable;   // keys the condition reads, the phase, the version gate
  // With a config: would it apply, and why not.
  bool evaluated = false;
  bool applies = false;
  std::string reason;
};

// `params` are the config values the conditions read (schema defaults when no config is given).
std::vector<InventoryRow> inventory(const PatchRegistry& reg, const std::string& backend,
                                    const std::string& version, const config::Value& params,
                                    bool with_config, const PatchFilter& filter = {});
std::string inventory_markdown(const std::vector<InventoryRow>& rows, const std::string& backend,
                               bool with_config);
nlohmann::json inventory_json(const std::vector<InventoryRow>& rows);
// The deep dive for one patch: what, slot, gate, files, porting guide.
std::string patch_details(const InventoryRow& row);

}  // namespace primus::patches
