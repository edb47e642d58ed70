#include "parallel/nccl_library.h"

#include "core/util/python_sites.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <glob.h>
#include <link.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <memory>

#include "core/util/error.h"

namespace primus::parallel::nccl {

std::string Library::version() const {
  // NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z from 2.9.
  const int c = version_code;
  if (c >= 10000) return fmt::format("{}.{}.{}", c / 10000, (c % 10000) / 100, c % 100);
  return fmt::format("{}.{}.{}", c / 1000, (c % 1000) / 100, c % 100);
}

namespace {


std::vector<std::string> run_glob(const std::string& pattern) {
  std::vector<std::string> out;
  glob_t g{};
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  }
  globfree(&g);
  return out;
}

constexpr const char* kSoname = "libnccl.so.2";

}  // namespace

SearchInputs default_search_inputs() {
  SearchInputs in;
  in.getenv = [](const std::string& n) -> std::optional<std::string> {
    const char* v = std::getenv(n.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
  in.python_site_dirs = primus::python_site_dirs;
  in.glob = run_glob;
  return in;
}

std::vector<Candidate> search_candidates(const SearchInputs& in) {
  std::vector<Candidate> out;
  std::set<std::string> seen;
  auto add = [&](const std::string& file, const std::string& how) {
    if (seen.insert(file).second) out.push_back({file, how});
  };
  if (auto v = in.getenv ? in.getenv("PRIMUS_NCCL_LIBRARY") : std::nullopt; v && !v->empty()) {
    std::string f = *v;
    // A folder (ends with '/' or names no .so file) gets the soname appended.
    const bool folder = f.back() == '/' || f.find(".so") == std::string::npos;
    if (folder) f = (f.back() == '/' ? f : f + "/") + kSoname;
    add(f, "PRIMUS_NCCL_LIBRARY");
    return out;  // an explicit choice is the only one tried
  }
  add(kSoname, "the loader's search path (LD_LIBRARY_PATH, ld.so.cache)");
  add("libnccl.so", "the loader's search path (LD_LIBRARY_PATH, ld.so.cache)");
  for (const char* d : {"/usr/local/cuda/lib64", "/usr/local/cuda/lib"}) add(fmt::format("{}/{}", d, kSoname), "CUDA toolkit folder");
  const std::string rel = std::string("/nvidia/nccl/lib/") + kSoname;
  if (in.python_site_dirs) {
    for (const auto& d : in.python_site_dirs()) add(d + rel, "python3's site-packages");
  }
  if (in.glob) {
    for (const char* pat : {"/usr/lib/python3*/site-packages", "/usr/lib/python3*/dist-packages",
                            "/usr/local/lib/python3*/site-packages", "/usr/local/lib/python3*/dist-packages"}) {
      for (const auto& d : in.glob(pat)) add(d + rel, "a python3 packages folder");
    }
  }
  return out;
}

Opener dlopen_opener() {
  Opener o;
  o.open = [](const std::string& file, std::string* error) -> void* {
    dlerror();
    void* h = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      *error = e ? e : "dlopen failed";
    }
    return h;
  };
  o.symbol = [](void* h, const char* name) { return dlsym(h, name); };
  o.resolved_path = [](void* h, const std::string& file) {
    link_map* lm = nullptr;
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && *lm->l_name) return std::string(lm->l_name);
    return file;
  };
  o.close = [](void* h) { dlclose(h); };
  return o;
}

Library load_library(const std::vector<Candidate>& candidates, const Opener& opener) {
  std::vector<std::string> tried;
  for (const auto& c : candidates) {
    std::string err;
    void* h = opener.open(c.file, &err);
    if (!h) {
      tried.push_back(fmt::format("  {} ({}): {}", c.file, c.how, err));
      continue;
    }
    Library lib;
    std::vector<std::string> missing;
    auto bind = [&](auto& fn, const char* name) {
      void* p = opener.symbol(h, name);
      if (!p) missing.push_back(name);
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    Api& a = lib.api;
    bind(a.GetVersion, "ncclGetVersion");
    bind(a.GetErrorString, "ncclGetErrorString");
    bind(a.GetUniqueId, "ncclGetUniqueId");
    bind(a.CommInitRank, "ncclCommInitRank");
    bind(a.CommInitRankConfig, "ncclCommInitRankConfig");
    bind(a.CommGetAsyncError, "ncclCommGetAsyncError");
    bind(a.CommAbort, "ncclCommAbort");
    bind(a.CommDestroy, "ncclCommDestroy");
    bind(a.AllReduce, "ncclAllReduce");
    bind(a.ReduceScatter, "ncclReduceScatter");
    bind(a.AllGather, "ncclAllGather");
    bind(a.Broadcast, "ncclBroadcast");
    bind(a.Send, "ncclSend");
    bind(a.Recv, "ncclRecv");
    bind(a.GroupStart, "ncclGroupStart");
    bind(a.GroupEnd, "ncclGroupEnd");
    if (!missing.empty()) {
      std::string names;
      for (const auto& m : missing) names += (names.empty() ? "" : ", ") + m;
      tried.push_back(fmt::format("  {} ({}): loaded, but lacks {} (NCCL >= 2.14 needed)", c.file, c.how, names));
      if (opener.close) opener.close(h);
      continue;
    }
    int v = 0;
    if (a.GetVersion(&v) != Success || v < 21400) {
      tried.push_back(fmt::format("  {} ({}): NCCL version code {} is older than 2.14 (non-blocking communicators)",
                                  c.file, c.how, v));
      if (opener.close) opener.close(h);
      continue;
    }
    lib.version_code = v;
    lib.path = opener.resolved_path ? opener.resolved_path(h, c.file) : c.file;
    lib.how = c.how;
    return lib;  // the handle stays open for the life of the process
  }
  std::string msg = "NCCL could not be loaded (it is opened at run time; nothing links it). Tried, in order:\n";
  for (const auto& t : tried) msg += t + "\n";
  if (candidates.empty()) msg += "  (no places)\n";
  msg +=
      "Install NCCL (e.g. `pip install nvidia-nccl-cu13`, or the distribution's libnccl2), or set "
      "PRIMUS_NCCL_LIBRARY to the libnccl.so.2 file or its folder.";
  throw RuntimeError(msg);
}

const Library& library() {
  static std::mutex mu;
  static std::unique_ptr<Library> lib;
  std::lock_guard<std::mutex> lock(mu);
  if (!lib) lib = std::make_unique<Library>(load_library(search_candidates(default_search_inputs()), dlopen_opener()));
  return *lib;
}

std::string disable_nvls_unless_set() {
  const char* v = std::getenv("NCCL_NVLS_ENABLE");
  if (v) return v;
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  return "0";
}

std::string describe(const Library& lib, Result r) {
  const char* s = lib.api.GetErrorString ? lib.api.GetErrorString(r) : nullptr;
  return fmt::format("{} (NCCL result {})", s ? s : "unknown error", static_cast<int>(r));
}

}  // namespace primus::parallel::nccl
