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

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "core/util/error.h"
#include "train/projection_rates.h"
#include "turbo/bench/benchmark.h"

namespace primus::cli {
namespace {

void setup_benchmark(CLI::App& app) {
  struct Opts {
    turbo::bench::BenchConfig cfg;
    std::string dtype = "bf16";
    std::string commit;
    std::string ab;
    bool cache = false;
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
  app.add_option("--idle-ms", o->cfg.idle_ms,
                 "GPU: idle this long before each timed series (after its warm-up calls), as a harness we "
                 "compare with does (bench/fp8/gemm_torch.py: ~10 ms of torch.cuda._sleep); default 0")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--idle-on", o->cfg.idle_on,
                 "Where --idle-ms idles: device (a spin kernel the timed calls queue behind; default) or host "
                 "(the GPU idles, the host then launches the calls with no lead)")
      ->check(CLI::IsMember({"device", "host"}));
  app.add_flag("--cpu-only", o->cfg.cpu_only, "Run the CPU kernels even where a GPU is present");
  app.add_option("--ab", o->ab,
                 "In-process A/B: time every product under each value of an environment variable in turn "
                 "(VAR=A,B[,...]; for switches read on every call), reported per value as '<name> [VAR=value]'");
  app.add_flag("--cache", o->cache,
               "Also distil this run's rates per part of a training step (GEMMs, grouped GEMMs, attention, "
               "memory-bound ops, AdamW) into the rates cache `primus projection performance` reads "
               "($PRIMUS_RATES_CACHE, else ~/.cache/primus/rates.json), keyed by device name");
  app.add_option("--ab-rounds", o->cfg.ab_rounds, "Rounds of --ab (each value once per round; the median is reported; default 3)")
      ->check(CLI::PositiveNumber);
  app.callback([o] {
    if (!o->ab.empty()) turbo::bench::parse_ab(o->ab, o->cfg);
    o->cfg.dtype = turbo::parse_dtype(o->dtype);
    o->cfg.commit = o->commit.empty() ? current_commit() : o->commit;
    // --cache reads back this run's JSON lines: those after the file's current end, or a
    // temporary file when no --json was asked for.
    std::filesystem::path lines = o->cfg.json_path;
    std::uintmax_t start = 0;
    bool temporary = false;
    if (o->cache) {
      if (!o->cfg.ab_var.empty()) throw UsageError("benchmark: --cache takes the default kernels' rates; drop --ab");
      if (lines.empty()) {
        lines = std::filesystem::temp_directory_path() / fmt::format("primus-benchmark-{}.jsonl", ::getpid());
        o->cfg.json_path = lines.string();
        temporary = true;
      } else if (std::filesystem::exists(lines)) {
        start = std::filesystem::file_size(lines);
      }
    }
    turbo::bench::run_benchmarks(o->cfg, stdout);
    if (!o->cache) return;
    std::ifstream in(lines);
    in.seekg(static_cast<std::streamoff>(start));
    const train::DeviceRates r = train::rates_from_benchmark_lines(in);
    in.close();
    if (temporary) {
      std::error_code ec;
      std::filesystem::remove(lines, ec);
    }
    const std::filesystem::path file = train::default_rates_cache();
    train::store_rates(file, r);
    std::printf("\nrates of %s cached in %s: GEMM %.4g, grouped GEMM %.4g, attention %.4g TFLOP/s; memory-bound %.4g, "
                "AdamW %.4g GB/s; ceilings %.4g TFLOP/s, %.4g GB/s\n",
                r.device.c_str(), file.c_str(), r.gemm_tflops, r.grouped_gemm_tflops, r.attention_tflops, r.memory_gbs,
                r.optimizer_gbs, r.peak_tflops, r.hbm_gbs);
  });
}

CommandRegistrar reg_benchmark({"benchmark",
                                "Time Turbo's ops per kernel backend against the device's measured ceilings",
                                setup_benchmark});

}  // namespace
}  // namespace primus::cli
#endif
