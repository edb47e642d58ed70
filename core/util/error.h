// Errors that carry their context (file, key, shape, rank) and map to the CLI's exit codes.
// Exit codes: 0 success, 2 usage or config error, 3 runtime error (see core/runtime).
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace primus {

enum class ErrorKind {
  Usage,    // bad command line                     -> exit 2
  Config,   // bad config file, key, value          -> exit 2
  Io,       // a file cannot be opened, read or written -> exit 3
  Format,   // a file's contents are corrupt or inconsistent -> exit 3
  Runtime,  // anything that fails while running    -> exit 3
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  int exit_code() const { return kind_ == ErrorKind::Usage || kind_ == ErrorKind::Config ? 2 : 3; }

 private:
  ErrorKind kind_;
};

struct UsageError : Error {
  explicit UsageError(const std::string& w) : Error(ErrorKind::Usage, w) {}
};
struct ConfigError : Error {
  explicit ConfigError(const std::string& w) : Error(ErrorKind::Config, w) {}
};
struct IoError : Error {
  explicit IoError(const std::string& w) : Error(ErrorKind::Io, w) {}
};
struct FormatError : Error {
  explicit FormatError(const std::string& w) : Error(ErrorKind::Format, w) {}
};
struct RuntimeError : Error {
  explicit RuntimeError(const std::string& w) : Error(ErrorKind::Runtime, w) {}
};

}  // namespace primus

// PRIMUS_CHECK(cond, "fmt", args...): throws primus::RuntimeError naming the source location.
#define PRIMUS_CHECK(cond, ...)                                                           \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      throw ::primus::RuntimeError(fmt::format("{} ({}:{}; check `{}` failed)",           \
                                               fmt::format(__VA_ARGS__), __FILE__,        \
                                               __LINE__, #cond));                         \
    }                                                                                     \
  } while (0)
