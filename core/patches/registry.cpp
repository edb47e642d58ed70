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

bool is_word(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_';
  });
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t pos; (pos = s.find(sep, start)) != std::string::npos; start = pos + 1)
    out.push_back(s.substr(start, pos - start));
  out.push_back(s.substr(start));
  return out;
}

std::string trim(std::string s) {
  s.erase(0, s.find_first_not_of(" \t"));
  s.erase(s.find_last_not_of(" \t") + 1);
  return s;
}

// The clauses version_in_range understands: [op] N(.N)*, op one of >= <= == != > <.
bool valid_range(const std::string& range) {
  if (range.empty() || range == "*") return true;
  for (std::string clause : split(range, ',')) {
    clause = trim(clause);
    for (const char* op : {">=", "<=", "==", "!=", ">", "<"}) {
      if (clause.rfind(op, 0) == 0) {
        clause = trim(clause.substr(std::string(op).size()));
        break;
      }
    }
    for (const std::string& part : split(clause, '.')) {
      if (part.empty() || !std::all_of(part.begin(), part.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
        return false;
    }
  }
  return true;
}

// Why a spec cannot be registered, or "" when it can.
std::string spec_error(const PatchSpec& s) {
  const std::vector<std::string> parts = split(s.id, '.');
  if (parts.size() != 3 || !(is_word(parts[0]) || parts[0] == "*") || !is_word(parts[1]) || !is_word(parts[2]))
    return "the id must be <backend>.<area>.<name> (lower case, digits, _; backend `*` for all)";
  if (s.description.empty()) return "no description (one line a customer can read)";
  if (!s.apply) return "no body (apply)";
  const std::string& backend = parts[0];
  for (size_t i = 0; i < s.slots.size(); ++i) {
    const std::string& slot = s.slots[i];
    if (backend != "*" && slot.rfind(backend + ".", 0) != 0)
      return fmt::format("slot '{}' is not a slot of backend {}", slot, backend);
    if (std::find(s.slots.begin(), s.slots.begin() + i, slot) != s.slots.begin() + i)
      return fmt::format("slot '{}' declared twice", slot);
  }
  if (s.slots.empty() && s.logic.empty() && (s.phase == Phase::Setup || s.phase == Phase::BuildArgs))
    return fmt::format("a {} patch must say what it changes: its slots or its logic", phase_name(s.phase));
  if (!valid_range(s.backend_versions))
    return fmt::format("backend_versions '{}' is not a list of [>=|<=|==|!=|>|<]N.N clauses", s.backend_versions);
  return "";
}
}  // namespace

void PatchRegistry::add(PatchSpec spec, std::source_location where) {
  const std::string file = repo_relative(where.file_name());
  const int line = static_cast<int>(where.line());
  std::string why = spec_error(spec);
  if (const Patch* other = why.empty() ? find(spec.id) : nullptr)
    why = fmt::format("the id is taken (registered at {}:{})", other->file, other->line);
  if (!why.empty()) throw std::logic_error(fmt::format("patch '{}' ({}:{}): {}", spec.id, file, line, why));
  Patch p{std::move(spec)};
  p.backend = p.id.substr(0, p.id.find('.'));
  p.file = file;
  p.line = line;
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
    id = trim(id);
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
                        const PatchFilter& filter, bool quiet) {
  const spdlog::level::level_enum level = quiet ? spdlog::level::debug : spdlog::level::info;
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
      spdlog::log(level, "[patches:{}] applied {}: {} ({})", phase_name(phase), p->id, p->description, d.reason);
    } else {
      spdlog::log(level, "[patches:{}] skipped {}: {}", phase_name(phase), p->id, d.reason);
    }
    report.decisions.push_back(std::move(d));
  }
  return report;
}

}  // namespace primus::patches
