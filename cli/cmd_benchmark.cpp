// primus benchmark OP... [--shapes S,...] [--dtype bf16] [--backend X|all] [--variants V,...|all] [--iters N]
//                        [--json FILE] [--ab VAR=A,B,... [--ab-rounds N]]
// Turbo's ops per case and kernel backend against the device's ceilings measured in the same run
// (turbo/bench/benchmark.h). Without a GPU the CPU kernels run, and the output says so.
#include <cstdio>
#include <memory>

#include "cli/command.h"

#ifdef PRIMUS_TURBO_BENCH
#include <array>
#include <cstdlib>

#include "turbo/bench/benchmark.h"

namespace primus::cli {
namespace {

// The commit recorded in the JSON: $PRIMUS_COMMIT, else git's short hash of the working
// directory, else "unknown".
std::string current_commit() {
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

void setup_benchmark(CLI::App& app) {
  struct Opts {
    turbo::bench::BenchConfig cfg;
    std::string dtype = "bf16";
    std::string commit;
    std::string ab;
  };
  auto o = std::make_shared<Opts>();
  std::string ops_help = "Op families:";
  for (const auto& n : turbo::bench::benchmark_op_names()) ops_help += " " + n;
  app.add_option("ops", o->cfg.ops, ops_help)->required();
  app.add_option("--shapes", o->cfg.shapes,
                 "Cases instead of the defaults, comma-separated, in the op's syntax:\n" + turbo::bench::benchmark_shape_help())
      ->delimiter(',');
  app.add_option("--dtype", o->dtype, "Tensor dtype of the device backends: bf16, f16 or f32 (the CPU backends use f32)");
  app.add_option("--backend", o->cfg.backend,
                 "One kernel backend (CPU, CUBLASLT, CUDNN, TURBO) or all; default: the device's backends, or CPU without a GPU");
  app.add_option("--variants", o->cfg.variants,
                 "Kernel variants to time too, each after its backend and cross-checked like it (comma-separated, or "
                 "all):\n" + turbo::bench::benchmark_variant_help())
      ->delimiter(',');
  app.add_option("--iters", o->cfg.iters, "Timed calls per measurement (default 50 on a GPU, 5 on the host)")
      ->check(CLI::PositiveNumber);
  app.add_option("--json", o->cfg.json_path, "Append one JSON line per measurement to FILE (DESIGN.md, Measurements)");
  app.add_option("--commit", o->commit, "Commit recorded in the JSON (default: $PRIMUS_COMMIT, else git's HEAD)");
  app.add_option("--memory-gib", o->cfg.memory_gib, "Operand arena in GiB (default 24 on a GPU, 2 on the host)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--cpu-only", o->cfg.cpu_only, "Run the CPU kernels even where a GPU is present");
  app.add_option("--ab", o->ab,
                 "In-process A/B: time every product under each value of an environment variable in turn "
                 "(VAR=A,B[,...]; for switches read on every call), reported per value as '<name> [VAR=value]'");
  app.add_option("--ab-rounds", o->cfg.ab_rounds, "Rounds of --ab (each value once per round; the median is reported; default 3)")
      ->check(CLI::PositiveNumber);
  app.callback([o] {
    if (!o->ab.empty()) turbo::bench::parse_ab(o->ab, o->cfg);
    o->cfg.dtype = turbo::parse_dtype(o->dtype);
    o->cfg.commit = o->commit.empty() ? current_commit() : o->commit;
    turbo::bench::run_benchmarks(o->cfg, stdout);
  });
}

CommandRegistrar reg_benchmark({"benchmark",
                                "Time Turbo's ops per kernel backend against the device's measured ceilings",
                                setup_benchmark});

}  // namespace
}  // namespace primus::cli
#endif
