#include "core/util/hf_cache.h"

#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "core/util/error.h"

namespace primus {

namespace fsys = std::filesystem;

fsys::path hf_hub_cache() {
  if (const char* c = std::getenv("HF_HUB_CACHE"); c && *c) return c;
  if (const char* h = std::getenv("HF_HOME"); h && *h) return fsys::path(h) / "hub";
  if (const char* home = std::getenv("HOME"); home && *home) return fsys::path(home) / ".cache/huggingface/hub";
  return {};
}

bool is_hub_id(const std::string& s) {
  const size_t slash = s.find('/');
  return slash != std::string::npos && slash > 0 && slash + 1 < s.size() && s.find('/', slash + 1) == std::string::npos;
}

fsys::path hf_cache_snapshot(const std::string& model, const std::string& file) {
  const fsys::path cache = hf_hub_cache();
  if (cache.empty() || !is_hub_id(model)) return {};
  const size_t slash = model.find('/');
  const fsys::path repo = cache / ("models--" + model.substr(0, slash) + "--" + model.substr(slash + 1));
  std::error_code ec;
  std::string rev;
  if (std::ifstream ref(repo / "refs" / "main"); ref) std::getline(ref, rev);
  if (!rev.empty() && fsys::is_regular_file(repo / "snapshots" / rev / file, ec)) return repo / "snapshots" / rev;
  fsys::path best;
  for (const auto& e : fsys::directory_iterator(repo / "snapshots", ec)) {
    if (fsys::is_regular_file(e.path() / file, ec) && (best.empty() || e.path() < best)) best = e.path();
  }
  return best;
}

fsys::path resolve_hf_path(const std::string& model, const std::string& file, const std::string& what) {
  std::error_code ec;
  if (fsys::exists(model, ec)) return model;
  if (fsys::path snap = hf_cache_snapshot(model, file); !snap.empty()) return snap;
  const fsys::path cache = hf_hub_cache();
  throw ConfigError(fmt::format(
      "{} '{}': no such folder or file{}; nothing is downloaded here: give a local path, or fetch it first (e.g. "
      "`huggingface-cli download {}`)",
      what, model,
      is_hub_id(model) ? fmt::format(", and no snapshot with {} for it in the Hugging Face cache ({})", file,
                                     cache.empty() ? std::string("unset: no HF_HUB_CACHE, HF_HOME or HOME")
                                                   : cache.string())
                       : std::string(),
      is_hub_id(model) ? model : std::string("ORG/NAME")));
}

}  // namespace primus
