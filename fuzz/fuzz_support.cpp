#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "fuzz/fuzz_target.h"

namespace primus::fuzz {

std::vector<Target>& targets() {
  static std::vector<Target> t;
  return t;
}

namespace {
bool g_throw = false;
}
void set_throw_findings(bool on) { g_throw = on; }

void finding(const std::string& what) {
  if (g_throw) throw Finding(what);
  std::fprintf(stderr, "primus fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

bool is_known_finding(const std::string& message) {
  if (g_throw) return false;  // the replayer reports everything
  static const std::vector<std::string> known = [] {
    std::vector<std::string> k;
    const char* file = std::getenv("PRIMUS_FUZZ_KNOWN");
    if (!file || !*file) return k;
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line[0] != '#') k.push_back(line);
    }
    return k;
  }();
  for (auto& k : known) {
    if (message.find(k) != std::string::npos) return true;
  }
  return false;
}

Scratch::Scratch(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("primus-fuzz-" + tag + "-XXXXXX")).string();
  if (!::mkdtemp(tmpl.data())) {
    std::perror("mkdtemp");
    std::abort();
  }
  path_ = tmpl;
  // Removed at exit. The list is leaked on purpose: the handler runs after static destructors.
  static auto* to_remove = new std::vector<std::string>;
  if (to_remove->empty()) {
    std::atexit([] {
      std::error_code ec;
      for (auto& p : *to_remove) std::filesystem::remove_all(p, ec);
    });
  }
  to_remove->push_back(tmpl);
}

void Scratch::clear() const {
  std::error_code ec;
  for (auto& e : std::filesystem::directory_iterator(path_, ec)) std::filesystem::remove_all(e.path(), ec);
}

std::filesystem::path Scratch::write(const std::string& name, std::string_view bytes) const {
  auto p = path_ / name;
  std::filesystem::create_directories(p.parent_path());
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) finding("cannot write scratch file " + p.string());
  return p;
}

std::vector<std::string_view> split_parts(std::string_view text, std::string_view sep, size_t max_parts) {
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    size_t at = text.find(sep);
    if (at == std::string_view::npos) break;
    parts.push_back(text.substr(0, at));
    text.remove_prefix(at + sep.size());
  }
  parts.push_back(text);
  return parts;
}

}  // namespace primus::fuzz
