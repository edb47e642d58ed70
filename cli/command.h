// How a `primus` subcommand plugs into the CLI: each cli/cmd_*.cpp registers itself with a
// static CommandRegistrar (the CLI's sources are compiled into the executable, so the static
// objects always run). The command adds its options and a callback to the CLI11 subcommand it
// is given; callbacks report failure by throwing primus::Error (exit 2 or 3, see error.h).
#pragma once
#include <CLI/CLI.hpp>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace primus::cli {

struct CommandSpec {
  std::string name;
  std::string help;
  std::function<void(CLI::App& sub)> setup;
};

std::vector<CommandSpec>& command_specs();

// The commit benchmark rows record (`benchmark --json`, `generate --bench --json`): $PRIMUS_COMMIT,
// else git's short hash of the working directory, else "unknown".
inline std::string current_commit() {
  if (const char* c = std::getenv("PRIMUS_COMMIT"); c && *c) return c;
  std::string out;
  if (FILE* p = popen("git rev-parse --short HEAD 2>/dev/null", "r")) {
    std::array<char, 64> buf{};
    while (fgets(buf.data(), buf.size(), p)) out += buf.data();
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

struct CommandRegistrar {
  explicit CommandRegistrar(CommandSpec spec) { command_specs().push_back(std::move(spec)); }
};

}  // namespace primus::cli
