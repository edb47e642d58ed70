#include "turbo/core/dynamic_library.h"

#include "core/util/python_sites.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "core/util/error.h"

namespace primus::turbo {
namespace {

// dlopen + the probe symbol; on failure *why says what went wrong and nothing stays open.
void* try_open(const std::string& candidate, const std::string& probe, std::string* why) {
  const bool is_path = candidate.find('/') != std::string::npos;
  if (is_path) {
    std::error_code ec;
    if (!std::filesystem::exists(candidate, ec)) {
      *why = "no such file";
      return nullptr;
    }
  }
  dlerror();
  void* h = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    *why = e ? e : "dlopen failed";
    return nullptr;
  }
  if (!probe.empty() && !dlsym(h, probe.c_str())) {
    *why = fmt::format("loaded, but it does not export {} (not the expected library)", probe);
    dlclose(h);
    return nullptr;
  }
  return h;
}

std::string join_path(const std::string& dir, const std::string& rel) {
  return (std::filesystem::path(dir) / rel).string();
}

}  // namespace

std::vector<std::string> python_site_dirs() { return primus::python_site_dirs(); }

LoadOutcome load_library(const LibrarySpec& spec, const std::function<std::vector<std::string>()>& site_dirs) {
  LoadOutcome r;
  std::set<std::string> seen;
  auto attempt = [&](const std::string& candidate, const std::string& label) {
    if (!seen.insert(candidate).second) return false;
    std::string why;
    if (void* h = try_open(candidate, spec.probe_symbol, &why)) {
      r.handle = h;
      r.path = candidate;
      return true;
    }
    r.attempts.push_back(fmt::format("{}{}: {}", candidate, label, why));
    return false;
  };
  auto fail = [&](const std::string& head) {
    std::string msg = head;
    for (const auto& a : r.attempts) msg += "\n  tried " + a;
    r.error = msg;
    return r;
  };

  const char* env = spec.env_var.empty() ? nullptr : std::getenv(spec.env_var.c_str());
  if (env && *env) {
    if (attempt(env, fmt::format(" (from {})", spec.env_var))) return r;
    return fail(fmt::format("{} ({}) could not be loaded from {}={} (unset it to search the usual places)",
                            spec.display, spec.soname, spec.env_var, env));
  }
  if (attempt(spec.soname, " (the dynamic loader's search: LD_LIBRARY_PATH, ld.so cache)")) return r;
  for (const auto& dir : spec.fixed_dirs)
    if (attempt(join_path(dir, spec.soname), "")) return r;
  // Python is started only for a library that pip wheels ship (Cairo's spec names none).
  std::vector<std::string> sites =
      site_dirs && !spec.wheel_subdirs.empty() ? site_dirs() : std::vector<std::string>{};
  for (const auto& site : sites)
    for (const auto& sub : spec.wheel_subdirs)
      if (attempt(join_path(join_path(site, sub), spec.soname), " (Python package)")) return r;
  std::string hint = spec.env_var.empty() ? "" : fmt::format("; set {} to its path", spec.env_var);
  if (sites.empty() && !spec.wheel_subdirs.empty()) hint += "; no Python site-packages found (python3 not on PATH?)";
  return fail(fmt::format("{} ({}) is not installed where primus looks{}", spec.display, spec.soname, hint));
}

void LazyLibrary::load() {
  std::call_once(once_, [this] { outcome_ = load_library(spec_); });
}

bool LazyLibrary::available() {
  load();
  return outcome_.handle != nullptr;
}

std::string LazyLibrary::error() {
  load();
  return outcome_.error;
}

std::string LazyLibrary::path() {
  load();
  return outcome_.path;
}

void* LazyLibrary::symbol(const char* name) {
  load();
  if (!outcome_.handle) throw RuntimeError(outcome_.error);
  dlerror();
  void* s = dlsym(outcome_.handle, name);
  if (!s)
    throw RuntimeError(fmt::format("{} loaded from {} does not export {} (a version older than the one primus "
                                   "was built against?)",
                                   spec_.display, outcome_.path, name));
  return s;
}

}  // namespace primus::turbo
