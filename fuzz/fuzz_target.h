// One fuzz target, two builds. Each fuzz/<target>_fuzz.cpp registers a function with
// PRIMUS_FUZZ_TARGET; it is compiled
//   - into a libFuzzer executable (fuzz/CMakeLists.txt, clang, PRIMUS_FUZZ=ON), and
//   - into tests/hardening's corpus replayer (any compiler), which runs every file of
//     fuzz/corpus/<target>/ through it, so the seeds and every crash that fuzzing found run in
//     the normal and the sanitizer CI too.
//
// The contract a target checks: malformed input is refused by throwing primus::Error (which
// the CLI turns into a message and exit code 2 or 3). Anything else is a finding: a crash or a
// sanitizer report, another exception type (a message without file or field), or a broken
// promise such as decode(encode(s)) != s.
#pragma once
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "core/util/error.h"

namespace primus::fuzz {

using TargetFn = void (*)(const uint8_t* data, size_t size);
struct Target {
  const char* name;
  TargetFn fn;
};
std::vector<Target>& targets();
struct Registrar {
  Registrar(const char* name, TargetFn fn) { targets().push_back({name, fn}); }
};

// Thrown instead of aborting when findings are replayed as tests (see set_throw_findings).
struct Finding : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// libFuzzer builds abort on a finding (so the input is saved); the replayer throws Finding.
void set_throw_findings(bool on);
[[noreturn]] void finding(const std::string& what);

// Findings reported to their owners but not fixed yet: the file named by $PRIMUS_FUZZ_KNOWN
// (scripts/fuzz.sh passes fuzz/known_findings.txt) lists message fragments, one a line ('#'
// starts a comment). An escaped exception whose message holds one is let through, so a long
// run goes past a shallow known bug. Crashes and sanitizer reports are never let through, and
// the replayer ignores the list.
bool is_known_finding(const std::string& message);

// Runs `body`: primus::Error is the documented way to refuse input; any other exception is a
// finding.
template <class F>
void refuse_only_with_primus_errors(F&& body) {
  try {
    body();
  } catch (const primus::Error&) {
  } catch (const Finding&) {
    throw;
  } catch (const std::exception& e) {
    if (!is_known_finding(e.what())) finding(std::string("non-primus exception escaped: ") + e.what());
  }
}

// A private folder for a target that reads files (one per target and process, so libFuzzer's
// -jobs/-fork and the replayer never share one), removed at exit. clear() empties it between
// inputs.
class Scratch {
 public:
  explicit Scratch(const std::string& tag);
  const std::filesystem::path& path() const { return path_; }
  void clear() const;
  std::filesystem::path write(const std::string& name, std::string_view bytes) const;

 private:
  std::filesystem::path path_;
};

// Splits `text` at each occurrence of `sep` into at most `max_parts` parts (the last part keeps
// any further separators).
std::vector<std::string_view> split_parts(std::string_view text, std::string_view sep, size_t max_parts);

}  // namespace primus::fuzz

#define PRIMUS_FUZZ_CONCAT2(a, b) a##b
#define PRIMUS_FUZZ_CONCAT(a, b) PRIMUS_FUZZ_CONCAT2(a, b)
// PRIMUS_FUZZ_TARGET(name) { ... uses data, size ... }
#define PRIMUS_FUZZ_TARGET(name)                                                                  \
  static void PRIMUS_FUZZ_CONCAT(fuzz_one_, name)(const uint8_t* data, size_t size);             \
  static ::primus::fuzz::Registrar PRIMUS_FUZZ_CONCAT(fuzz_reg_, name)(#name,                    \
                                                                       PRIMUS_FUZZ_CONCAT(fuzz_one_, name)); \
  static void PRIMUS_FUZZ_CONCAT(fuzz_one_, name)(const uint8_t* data, size_t size)
