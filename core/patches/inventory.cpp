#include "core/patches/inventory.h"

#include <map>
#include <sstream>

namespace primus::patches {

namespace {
std::string area_of(const std::string& id) {
  auto a = id.find('.');
  auto b = id.find('.', a + 1);
  return b == std::string::npos ? "general" : id.substr(a + 1, b - a - 1);
}

std::string logic_of(const Patch& p) {
  std::vector<std::string> parts;
  for (auto& s : p.slots) parts.push_back("replaces/wraps hook `" + s + "`");
  if (!p.logic.empty()) parts.push_back(p.logic);
  if (parts.empty()) return "N/A (lifecycle hook)";
  return fmt::format("{}", fmt::join(parts, "; "));
}

std::string key_names(const std::vector<std::string>& keys) {
  std::vector<std::string> names;
  for (auto& k : keys) names.push_back("`" + k.substr(0, k.find('=')) + "`");
  return fmt::format("{}", fmt::join(names, ", "));
}

std::string md_cell(std::string s) {
  for (size_t pos = 0; (pos = s.find('|', pos)) != std::string::npos; pos += 2) s.replace(pos, 1, "\\|");
  return s;
}
}  // namespace

std::vector<InventoryRow> inventory(const PatchRegistry& reg, const std::string& backend,
                                    const std::string& version, const config::Value& params,
                                    bool with_config, const PatchFilter& filter) {
  std::vector<InventoryRow> rows;
  for (Phase ph : all_phases()) {
    for (const Patch* p : ordered(reg, backend, ph)) {
      InventoryRow r;
      r.patch = p;
      r.area = area_of(p->id);
      r.logic = logic_of(*p);
      r.location = p->file + ":" + std::to_string(p->line) + (p->impl.empty() ? "" : " (+ " + p->impl + ")");
      PatchContext ctx(params, p->backend == "*" ? backend : p->backend, version);
      Decision d = decide(*p, ctx, filter);
      std::string gate = p->condition ? (d.keys.empty() ? "condition" : key_names(d.keys)) : "always";
      r.enable = fmt::format("{}; phase={}", gate, phase_name(p->phase));
      if (!p->backend_versions.empty()) r.enable += "; backend " + p->backend_versions;
      if (with_config) {
        r.evaluated = true;
        r.applies = d.applies;
        r.reason = d.reason;
      }
      rows.push_back(std::move(r));
    }
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const InventoryRow& a, const InventoryRow& b) { return a.area < b.area; });
  return rows;
}

std::string inventory_markdown(const std::vector<InventoryRow>& rows, const std::string& backend,
                               bool with_config) {
  std::ostringstream out;
  out << "# Patches" << (backend.empty() ? "" : " for backend `" + backend + "`") << "\n";
  std::string area;
  for (auto& r : rows) {
    if (r.area != area) {
      area = r.area;
      out << "\n## " << area << "\n\n| Patch | What it does | Patch logic | Code location | How to enable |"
          << (with_config ? " Applies with this config |" : "") << "\n|---|---|---|---|---|"
          << (with_config ? "---|" : "") << "\n";
    }
    out << "| `" << r.patch->id << "` | " << md_cell(r.patch->description) << " | " << md_cell(r.logic)
        << " | " << md_cell(r.location) << " | " << md_cell(r.enable) << " |";
    if (with_config) out << " " << (r.applies ? "yes" : "no") << ": " << md_cell(r.reason) << " |";
    out << "\n";
  }
  if (rows.empty()) out << "\n(no patches registered)\n";
  out << "\n`PRIMUS_PATCHES` (all | none | id1,id2) is a global allow-list applied on top of each "
         "patch's own condition.\n";
  return out.str();
}

nlohmann::json inventory_json(const std::vector<InventoryRow>& rows) {
  auto arr = nlohmann::json::array();
  for (auto& r : rows) {
    nlohmann::json j = {{"id", r.patch->id},           {"backend", r.patch->backend},
                        {"phase", phase_name(r.patch->phase)},
                        {"area", r.area},              {"description", r.patch->description},
                        {"logic", r.logic},            {"slots", r.patch->slots},
                        {"location", r.location},      {"enable", r.enable},
                        {"priority", r.patch->priority}, {"backend_versions", r.patch->backend_versions},
                        {"tags", r.patch->tags}};
    if (r.evaluated) {
      j["applies"] = r.applies;
      j["reason"] = r.reason;
    }
    arr.push_back(j);
  }
  return arr;
}

std::string patch_details(const InventoryRow& r) {
  const Patch& p = *r.patch;
  std::ostringstream out;
  out << "# " << p.id << "\n\n"
      << "What it does: " << p.description << "\n"
      << "Backend: " << p.backend
      << (p.backend_versions.empty() ? "" : " (versions " + p.backend_versions + ")") << "\n"
      << "Phase: " << phase_name(p.phase) << ", priority " << p.priority << "\n"
      << "Tags: " << (p.tags.empty() ? "-" : fmt::format("{}", fmt::join(p.tags, ", "))) << "\n\n"
      << "## Patch logic\n" << r.logic << "\n\n"
      << "## Gate\n" << r.enable << "\n";
  if (r.evaluated) out << "With this config: " << (r.applies ? "applies" : "skipped") << " (" << r.reason << ")\n";
  out << "\n## Code location\n" << p.file << ":" << p.line << "\n";
  if (!p.impl.empty()) out << p.impl << " (implementation)\n";
  out << "\n## Porting to another framework\n";
  if (!p.porting.empty()) {
    out << p.porting << "\n";
  } else {
    out << "1. Copy the implementation named above.\n"
        << "2. " << (p.slots.empty() ? "Apply the same change where your framework builds its arguments or runs this phase ("
                                        + std::string(phase_name(p.phase)) + ")."
                                     : "Install it where your framework calls the slot's function, before the model is built.")
        << "\n3. Gate it on the same keys: " << r.enable << ".\n";
  }
  return out.str();
}

}  // namespace primus::patches
