// primus_ops_bench: every op family but attention at its default cases, as
// `primus benchmark gemm norm activation rope embedding loss optimizer` runs them (the code is
// turbo/bench, shared with the CLI); kept as a standalone binary for device runs that carry no
// full primus build. --out appends Measurements-format JSON lines (turbo/bench/benchmark.h);
// --only gemm|mem limits it to the GEMMs or to the memory-bound ops.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "turbo/bench/benchmark.h"

int main(int argc, char** argv) {
  primus::turbo::bench::BenchConfig cfg;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) cfg.json_path = argv[++i];
    else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
    else if (std::strcmp(argv[i], "--commit") == 0 && i + 1 < argc) cfg.commit = argv[++i];
    else {
      std::fprintf(stderr, "usage: primus_ops_bench [--out results.jsonl] [--only gemm|mem] [--commit C]\n");
      return 2;
    }
  }
  if (only.empty() || only == "gemm") cfg.ops.push_back("gemm");
  if (only.empty() || only == "mem")
    for (const char* op : {"norm", "activation", "rope", "embedding", "loss", "optimizer"}) cfg.ops.push_back(op);
  try {
    return primus::turbo::bench::run_benchmarks(cfg, stdout) > 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "primus_ops_bench: %s\n", e.what());
    return 1;
  }
}
