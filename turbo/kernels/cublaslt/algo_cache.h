// The persistent cache of cuBLASLt's timed algorithm choices (gemm_cublaslt.cpp's search): one
// JSON file per machine that maps a problem key to the algorithm the search kept and its time.
// With it, every process on the same machine, cuBLASLt version and file runs each GEMM shape
// with the same algorithm, so a resumed run reproduces an uninterrupted one bit for bit.
//
// Host code only (no CUDA types): the algorithm is cublasLtMatmulAlgo_t's 64 opaque bytes,
// which NVIDIA documents as serialisable for reuse with the same cuBLASLt version. The key
// therefore names the device, its compute capability and the cuBLASLt version beside the plan
// key (shapes, dtypes, layouts, epilogue, alignments, workspace size).
//
// File (format 1):
//   {"format": "primus-cublaslt-algos", "version": 1,
//    "entries": {"<key>": {"algo": "<128 hex digits>", "ms": 0.0123}, ...}}
// A missing file is an empty cache. An unreadable or malformed one is logged once (with its
// path) and ignored; the next write replaces it with a valid file.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

namespace primus::turbo::cublaslt {

struct CachedAlgo {
  std::array<uint64_t, 8> data{};  // cublasLtMatmulAlgo_t's bytes
  double ms = 0;                   // the search's time for 5 runs of the problem (informational)
  bool operator==(const CachedAlgo& o) const { return data == o.data && ms == o.ms; }
};

inline constexpr const char* kAlgoCacheFileName = "cublaslt_algos.json";

// The cache file from the environment: PRIMUS_TURBO_CUBLASLT_ALGO_CACHE=0 (or off, false, no,
// none) disables the cache (empty path); any other non-empty value is the file. Otherwise
// $PRIMUS_CACHE_DIR/cublaslt_algos.json, else $XDG_CACHE_HOME/primus/cublaslt_algos.json, else
// $HOME/.cache/primus/cublaslt_algos.json; empty when none of those is set.
std::filesystem::path algo_cache_path_from_env();

// "<device>|sm_<major><minor>|cublasLt <version>|<plan key>".
std::string algo_cache_key(const std::string& plan_key, const std::string& device_name, int cc_major, int cc_minor,
                           size_t cublaslt_version);

std::string algo_to_hex(const std::array<uint64_t, 8>& data);
// False unless `hex` is exactly 128 hex digits.
bool algo_from_hex(const std::string& hex, std::array<uint64_t, 8>* data);

// One cache file as this process sees it. Not thread-safe: gemm_cublaslt.cpp calls it under its
// context mutex.
class AlgoCacheFile {
 public:
  explicit AlgoCacheFile(std::filesystem::path path);
  const std::filesystem::path& path() const { return path_; }

  // Reads the file the first time it is called (later calls do nothing). Never throws: a
  // corrupt file leaves the cache empty, sets load_error() and is logged once per path and
  // process.
  void load();
  const std::string& load_error() const { return load_error_; }

  std::optional<CachedAlgo> find(const std::string& key) const;
  size_t size() const { return entries_.size(); }

  // Records `key` and writes the whole file: what is on disk at this moment (when it parses)
  // merged with every entry this process stored (ours win on the same key), written to a
  // temporary file in the same folder and renamed over the file, so a reader sees the old file
  // or the new one, never a partial one; of concurrent writers (the ranks of a multi-GPU job)
  // the last rename wins and every writer's file is complete. Creates the folder. Returns false
  // (logged once per path) when the file cannot be written; the entry is kept in memory.
  bool store(const std::string& key, const CachedAlgo& algo);

 private:
  std::filesystem::path path_;
  bool loaded_ = false;
  std::string load_error_;
  std::map<std::string, CachedAlgo> entries_;  // the file's entries and ours
  std::map<std::string, CachedAlgo> mine_;     // the entries this process stored
};

// Parses a cache file's text into `out`; returns an empty string or the reason it is not a
// cache file. Exposed for the tests.
std::string parse_algo_cache(const std::string& text, std::map<std::string, CachedAlgo>* out);
std::string format_algo_cache(const std::map<std::string, CachedAlgo>& entries);

}  // namespace primus::turbo::cublaslt
