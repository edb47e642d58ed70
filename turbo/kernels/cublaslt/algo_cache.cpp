#include "turbo/kernels/cublaslt/algo_cache.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace primus::turbo::cublaslt {
namespace fs = std::filesystem;
namespace {

constexpr const char* kFormat = "primus-cublaslt-algos";
constexpr int kVersion = 1;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// Logs `msg` once per (kind, path) in this process: a corrupt or unwritable file is reported
// once, not at every GEMM shape.
void warn_once(const std::string& kind, const fs::path& path, const std::string& msg) {
  static std::mutex mu;
  static std::set<std::string>* seen = new std::set<std::string>();
  std::lock_guard lock(mu);
  if (seen->insert(kind + "\n" + path.string()).second) spdlog::warn("{}", msg);
}

bool read_text(const fs::path& path, std::string* text, bool* exists) {
  std::error_code ec;
  *exists = fs::exists(path, ec);
  if (!*exists) return true;
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  *text = ss.str();
  return !in.bad();
}

}  // namespace

fs::path algo_cache_path_from_env() {
  const std::string v = env("PRIMUS_TURBO_CUBLASLT_ALGO_CACHE");
  if (!v.empty()) {
    std::string low;
    for (char ch : v) low += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (low == "0" || low == "off" || low == "false" || low == "no" || low == "none") return {};
    return fs::path(v);
  }
  if (const std::string d = env("PRIMUS_CACHE_DIR"); !d.empty()) return fs::path(d) / kAlgoCacheFileName;
  if (const std::string d = env("XDG_CACHE_HOME"); !d.empty()) return fs::path(d) / "primus" / kAlgoCacheFileName;
  if (const std::string d = env("HOME"); !d.empty()) return fs::path(d) / ".cache" / "primus" / kAlgoCacheFileName;
  return {};
}

std::string algo_cache_key(const std::string& plan_key, const std::string& device_name, int cc_major, int cc_minor,
                           size_t cublaslt_version) {
  return fmt::format("{}|sm_{}{}|cublasLt {}|{}", device_name, cc_major, cc_minor, cublaslt_version, plan_key);
}

std::string algo_to_hex(const std::array<uint64_t, 8>& data) {
  unsigned char bytes[sizeof(data)];
  std::memcpy(bytes, data.data(), sizeof(data));
  static const char* digits = "0123456789abcdef";
  std::string s;
  s.reserve(2 * sizeof(bytes));
  for (unsigned char b : bytes) {
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

bool algo_from_hex(const std::string& hex, std::array<uint64_t, 8>* data) {
  unsigned char bytes[sizeof(*data)];
  if (hex.size() != 2 * sizeof(bytes)) return false;
  auto nibble = [](char ch) -> int {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < sizeof(bytes); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    bytes[i] = static_cast<unsigned char>(hi * 16 + lo);
  }
  std::memcpy(data->data(), bytes, sizeof(bytes));
  return true;
}

std::string parse_algo_cache(const std::string& text, std::map<std::string, CachedAlgo>* out) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return fmt::format("not JSON ({})", e.what());
  }
  if (!j.is_object()) return "not a JSON object";
  if (!j.contains("format") || j["format"] != kFormat) return fmt::format("no \"format\": \"{}\"", kFormat);
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int>() != kVersion)
    return fmt::format("not version {}", kVersion);
  if (!j.contains("entries") || !j["entries"].is_object()) return "no \"entries\" object";
  std::map<std::string, CachedAlgo> entries;
  for (const auto& [key, v] : j["entries"].items()) {
    CachedAlgo a;
    if (!v.is_object() || !v.contains("algo") || !v["algo"].is_string() ||
        !algo_from_hex(v["algo"].get<std::string>(), &a.data))
      return fmt::format("entry '{}': \"algo\" is not 128 hex digits", key);
    if (!v.contains("ms") || !v["ms"].is_number()) return fmt::format("entry '{}': no \"ms\" number", key);
    a.ms = v["ms"].get<double>();
    entries[key] = a;
  }
  *out = std::move(entries);
  return "";
}

std::string format_algo_cache(const std::map<std::string, CachedAlgo>& entries) {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  nlohmann::ordered_json e = nlohmann::ordered_json::object();
  for (const auto& [key, a] : entries) e[key] = {{"algo", algo_to_hex(a.data)}, {"ms", a.ms}};
  j["entries"] = std::move(e);
  return j.dump(1) + "\n";
}

AlgoCacheFile::AlgoCacheFile(fs::path path) : path_(std::move(path)) {}

void AlgoCacheFile::load() {
  if (loaded_) return;
  loaded_ = true;
  std::string text;
  bool exists = false;
  if (!read_text(path_, &text, &exists)) {
    load_error_ = "cannot be read";
  } else if (exists) {
    std::map<std::string, CachedAlgo> disk;
    load_error_ = parse_algo_cache(text, &disk);
    if (load_error_.empty()) {
      for (auto& [k, v] : disk) entries_.emplace(k, v);  // entries stored before load() stay
    }
  }
  if (!load_error_.empty()) {
    warn_once("corrupt", path_,
              fmt::format("[turbo] cuBLASLt algorithm cache {}: {}; ignored (searched algorithms will rewrite it; "
                          "PRIMUS_TURBO_CUBLASLT_ALGO_CACHE=0 disables the cache)",
                          path_.string(), load_error_));
  }
}

std::optional<CachedAlgo> AlgoCacheFile::find(const std::string& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

bool AlgoCacheFile::store(const std::string& key, const CachedAlgo& algo) {
  mine_[key] = algo;
  entries_[key] = algo;
  // What other processes wrote since we read the file, then ours over it.
  std::map<std::string, CachedAlgo> merged;
  std::string text;
  bool exists = false;
  if (read_text(path_, &text, &exists) && exists) {
    if (!parse_algo_cache(text, &merged).empty()) merged.clear();
  }
  for (const auto& [k, v] : entries_) merged.emplace(k, v);  // the file's entries we read keep theirs
  for (const auto& [k, v] : mine_) merged[k] = v;
  static std::atomic<uint64_t> serial{0};
  const fs::path dir = path_.parent_path();
  const fs::path tmp = (dir.empty() ? fs::path(".") : dir) /
                       fmt::format(".{}.tmp.{}.{}", path_.filename().string(), static_cast<long>(::getpid()),
                                   serial.fetch_add(1));
  std::error_code ec;
  if (!dir.empty()) fs::create_directories(dir, ec);
  std::string why;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      why = "cannot create " + tmp.string();
    } else {
      out << format_algo_cache(merged);
      out.flush();
      if (!out) why = "cannot write " + tmp.string();
    }
  }
  if (why.empty()) {
    fs::rename(tmp, path_, ec);
    if (ec) why = fmt::format("cannot rename {} to it ({})", tmp.string(), ec.message());
  }
  if (!why.empty()) {
    fs::remove(tmp, ec);
    warn_once("write", path_,
              fmt::format("[turbo] cuBLASLt algorithm cache {}: {}; the searched algorithms are not saved "
                          "(PRIMUS_TURBO_CUBLASLT_ALGO_CACHE=<file> names another file, =0 disables the cache)",
                          path_.string(), why));
    return false;
  }
  for (const auto& [k, v] : merged) entries_.emplace(k, v);
  return true;
}

}  // namespace primus::turbo::cublaslt
