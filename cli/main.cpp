// primus: the command-line entry point. Thin by design: each subcommand lives in its own
// cli/cmd_*.cpp and registers itself (cli/command.h); this file parses and maps errors to
// exit codes (0 ok, 2 usage/config, 3 runtime) without stack traces.
#include <spdlog/spdlog.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "cli/command.h"
#include "core/util/error.h"

namespace primus::cli {
std::vector<CommandSpec>& command_specs() {
  static std::vector<CommandSpec> specs;
  return specs;
}
}  // namespace primus::cli

int main(int argc, char** argv) {
  using namespace primus;
  // OpenMP threads that spin at barriers make the CPU kernels ~10x slower whenever another
  // process holds a core (measured: 1,500 vs 15,000 tokens/s on 2 shared cores). libgomp reads
  // OMP_WAIT_POLICY when it is loaded, before main, so the default is set by re-executing once.
  // Set OMP_WAIT_POLICY=ACTIVE yourself on dedicated machines.
  if (!std::getenv("OMP_WAIT_POLICY")) {
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    ::execv("/proc/self/exe", argv);  // returns only on failure: then run as we are
  }
  spdlog::set_pattern("[%H:%M:%S] %v");
  // PRIMUS_LOG_LEVEL: trace|debug|info|warn|error|critical|off (spdlog's names).
  if (const char* lvl = std::getenv("PRIMUS_LOG_LEVEL"); lvl && *lvl) {
    auto level = spdlog::level::from_str(lvl);
    if (level == spdlog::level::off && std::string(lvl) != "off") {
      std::fprintf(stderr, "primus: error: PRIMUS_LOG_LEVEL=%s is not one of trace, debug, info, warn, error, "
                   "critical, off\n", lvl);
      return 2;
    }
    spdlog::set_level(level);
  }
  CLI::App app{"Primus: pretraining large language models, from one GPU to a cluster"};
  app.set_version_flag("--version", std::string("primus ") + PRIMUS_VERSION);
  app.require_subcommand(1);
  app.fallthrough(false);
  for (auto& spec : cli::command_specs()) {
    CLI::App* sub = app.add_subcommand(spec.name, spec.help);
    spec.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  } catch (const Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "primus: error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "primus: error: %s\n", e.what());
    return 3;
  }
  return 0;
}
