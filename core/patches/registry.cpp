#include "core/patches/registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "core/config/schema.h"
#include "core/util/error.h"

namespace primus::patches {

PatchRegistry& PatchRegistry::global() {
  static PatchRegistry r;
  return r;
}

namespace {
// Shows registration sites relative to the repository (…/backends/x/patches/y.cpp).
std::string repo_relative(const std::string& file) {
  for (const char* top : {"/backends/", "/tests/", "/core/", "/turbo/", "/train/"}) {
    auto pos = file.rfind(top);
    if (pos != std::string::npos) return file.substr(pos + 1);
  }
  return file;
}
}  // namespace

void PatchRegistry::add(Patch p, std::source_location where) {
  if (p.id.empty() || p.id.find('.') == std::string::npos) {
    throw std::logic_error("patch id must be dotted <backend>.<area>.<name>: '" + p.id + "'");
  }
  if (find(p.id)) throw std::logic_error("patch registered twice: " + p.id);
  if (!p.apply) throw std::logic_error("patch has no body: " + p.id);
  if (p.backend.empty()) throw std::logic_error("patch has no backend: " + p.id);
  if (p.file.empty()) {
    p.file = repo_relative(where.file_name());
    p.line = static_cast<int>(where.line());
  }
  p.order = static_cast<int>(patches_.size());
  patches_.push_back(std::move(p));
}

const Patch* PatchRegistry::find(const std::string& id) const {
  for (auto& p : patches_)
    if (p.id == id) return &p;
  return nullptr;
}

const Patch& PatchRegistry::get(const std::string& id) const {
  if (const Patch* p = find(id)) return *p;
  std::string best;
  size_t bd = SIZE_MAX;
  for (auto& p : patches_) {
    size_t d = config::edit_distance(id, p.id);
    if (d < bd) bd = d, best = p.id;
  }
  throw ConfigError(fmt::format("unknown patch id '{}'{}", id,
                                bd <= std::max<size_t>(3, id.size() / 3)
                                    ? fmt::format("; did you mean '{}'?", best)
                                    : " (see `primus patches list`)"));
}

std::vector<const Patch*> PatchRegistry::for_backend(const std::string& backend) const {
  std::vector<const Patch*> out;
  for (auto& p : patches_)
    if (backend.empty() || p.backend == backend || p.backend == "*") out.push_back(&p);
  return out;
}

PatchFilter PatchFilter::parse(const std::string& spec, const PatchRegistry& reg) {
  PatchFilter f;
  if (spec.empty() || spec == "all") return f;
  if (spec == "none") {
    f.mode = Mode::None;
    return f;
  }
  f.mode = Mode::List;
  std::stringstream ss(spec);
  std::string id;
  while (std::getline(ss, id, ',')) {
    id.erase(0, id.find_first_not_of(" \t"));
    id.erase(id.find_last_not_of(" \t") + 1);
    if (id.empty()) continue;
    try {
      reg.get(id);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("PRIMUS_PATCHES: {}", e.what()));
    }
    f.ids.insert(id);
  }
  return f;
}

PatchFilter PatchFilter::from_env(const PatchRegistry& reg) {
  const char* v = std::getenv("PRIMUS_PATCHES");
  return parse(v ? v : "all", reg);
}

bool PatchFilter::allows(const std::string& id) const {
  switch (mode) {
    case Mode::All: return true;
    case Mode::None: return false;
    case Mode::List: return ids.count(id) > 0;
  }
  return false;
}

namespace {
std::vector<long> parse_version(const std::string& v) {
  std::vector<long> out;
  std::stringstream ss(v);
  std::string part;
  while (std::getline(ss, part, '.')) {
    size_t n = 0;
    while (n < part.size() && isdigit(static_cast<unsigned char>(part[n]))) ++n;
    out.push_back(n ? std::stol(part.substr(0, n)) : 0);
  }
  return out;
}
int compare_versions(const std::string& a, const std::string& b) {
  auto x = parse_version(a), y = parse_version(b);
  size_t n = std::max(x.size(), y.size());
  x.resize(n, 0);
  y.resize(n, 0);
  return x < y ? -1 : (x > y ? 1 : 0);
}
}  // namespace

bool version_in_range(const std::string& version, const std::string& range) {
  if (range.empty() || range == "*") return true;
  std::stringstream ss(range);
  std::string clause;
  while (std::getline(ss, clause, ',')) {
    clause.erase(0, clause.find_first_not_of(" "));
    clause.erase(clause.find_last_not_of(" ") + 1);
    std::string op;
    for (const char* o : {">=", "<=", "==", "!=", ">", "<"}) {
      if (clause.rfind(o, 0) == 0) {
        op = o;
        break;
      }
    }
    if (op.empty()) op = "==";
    std::string v = clause.substr(clause.rfind(op, 0) == 0 ? op.size() : 0);
    v.erase(0, v.find_first_not_of(" "));
    int c = compare_versions(version, v);
    bool ok = op == ">=" ? c >= 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0
              : op == "<" ? c < 0 : op == "!=" ? c != 0 : c == 0;
    if (!ok) return false;
  }
  return true;
}

Decision decide(const Patch& p, PatchContext& ctx, const PatchFilter& filter) {
  Decision d;
  d.patch = &p;
  if (p.backend != "*" && p.backend != ctx.backend()) {
    d.reason = fmt::format("for backend {}", p.backend);
    return d;
  }
  if (!filter.allows(p.id)) {
    d.reason = "not in PRIMUS_PATCHES";
    return d;
  }
  if (!version_in_range(ctx.backend_version(), p.backend_versions)) {
    d.reason = fmt::format("backend version {} not in {}", ctx.backend_version(), p.backend_versions);
    return d;
  }
  if (!p.condition) {
    d.applies = true;
    d.reason = "always";
    return d;
  }
  ctx.begin_patch(p, p.phase);
  bool ok = false;
  try {
    ok = p.condition(ctx);
  } catch (const Error& e) {
    throw Error(e.kind(), fmt::format("patch {} condition: {}", p.id, e.what()));
  }
  d.keys = ctx.keys_read();
  d.applies = ok;
  std::string keys = d.keys.empty() ? "" : fmt::format(" ({})", fmt::join(d.keys, ", "));
  d.reason = (ok ? "condition true" : "condition false") + keys;
  return d;
}

std::vector<const Patch*> ordered(const PatchRegistry& reg, const std::string& backend, Phase phase) {
  std::vector<const Patch*> ps;
  for (const Patch* p : reg.for_backend(backend))
    if (p->phase == phase) ps.push_back(p);
  std::stable_sort(ps.begin(), ps.end(), [](const Patch* a, const Patch* b) {
    return a->priority != b->priority ? a->priority < b->priority : a->order < b->order;
  });
  return ps;
}

PhaseReport run_patches(PhaseKey, const PatchRegistry& reg, PatchContext& ctx, Phase phase,
                        const PatchFilter& filter) {
  PhaseReport report{phase, {}};
  ctx.set_phase(phase);
  for (const Patch* p : ordered(reg, ctx.backend(), phase)) {
    Decision d = decide(*p, ctx, filter);
    if (d.applies) {
      ctx.begin_patch(*p, phase);
      try {
        p->apply(ctx);
      } catch (const Error& e) {
        throw Error(e.kind(), fmt::format("patch {} failed in phase {}: {}", p->id,
                                          phase_name(phase), e.what()));
      } catch (const std::exception& e) {
        throw RuntimeError(fmt::format("patch {} failed in phase {}: {}", p->id,
                                       phase_name(phase), e.what()));
      }
      spdlog::info("[patches:{}] applied {}: {} ({})", phase_name(phase), p->id, p->description,
                   d.reason);
    } else {
      spdlog::info("[patches:{}] skipped {}: {}", phase_name(phase), p->id, d.reason);
    }
    report.decisions.push_back(std::move(d));
  }
  return report;
}

}  // namespace primus::patches
