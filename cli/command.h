// How a `primus` subcommand plugs into the CLI: each cli/cmd_*.cpp registers itself with a
// static CommandRegistrar (the CLI's sources are compiled into the executable, so the static
// objects always run). The command adds its options and a callback to the CLI11 subcommand it
// is given; callbacks report failure by throwing primus::Error (exit 2 or 3, see error.h).
#pragma once
#include <CLI/CLI.hpp>

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

struct CommandRegistrar {
  explicit CommandRegistrar(CommandSpec spec) { command_specs().push_back(std::move(spec)); }
};

}  // namespace primus::cli
