// `primus benchmark`: Turbo's ops timed per case and kernel backend, against the device's own
// ceilings measured in the same run (a large GEMM for FLOP/s, a copy for bandwidth).
//
// Ops (families): gemm, norm, activation, loss, optimizer, rope, embedding, attention, quantize,
// gemm_fp8 (turbo::gemm on FP8 operands), grouped_gemm (the MoE expert GEMMs), and
// layer (a GPT-2 layer on the CPU reference kernels; host only). Each has default cases (the
// training shapes of GPT-2 124M and Llama-3.2-1B at 16384 tokens on a GPU; a small version on the
// host) or takes --shapes in its own syntax (see OpFamily::shape_syntax). Without a CUDA device
// only the CPU backends run, and the run says so. Where a case names its outputs (attention), every
// backend and kernel variant that ran it is cross-checked against the first one, same inputs.
//
// Results: a table on `out` and, with json_path, one JSON object per measurement appended to
// that file in DESIGN.md's "Measurements" format: the anchor of a measurement is the ceiling of
// its device measured in this run (ratio = share of the ceiling); the ceilings' own lines carry
// no anchor. Extra keys: backend, dtype, ms, work (flops or bytes); xcheck where cross-checked:
// {"vs": <backend>, "rel_l2": {<output>: <relative L2 error>, ...}}.
#pragma once
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "turbo/core/dtype.h"

namespace primus::turbo::bench {

struct BenchConfig {
  std::vector<std::string> ops;       // families, in order; at least one
  std::vector<std::string> shapes;    // empty: each op's default cases
  DType dtype = DType::BF16;          // of the device backends' tensors (the CPU backends use f32)
  std::string backend = "";           // "": the device's backends (CPU without a GPU); "all"; or one name
  int iters = 0;                      // timed calls per measurement; 0: 50 on a GPU, 5 on the host
  std::string json_path;              // "": no JSON
  std::string commit = "unknown", date;  // recorded in the JSON (date "" = today, UTC)
  bool cpu_only = false;              // ignore any GPU
  double memory_gib = 0;              // operand arena; 0: 24 GiB on a GPU, 2 GiB on the host
  // Idling before each timed series of the GPU (BenchDevice::set_idle): ms (0: none) and where,
  // "device" (a spin kernel the timed calls queue behind) or "host" (the device idles).
  double idle_ms = 0;
  std::string idle_on = "device";
  // In-process A/B (--ab VAR=A,B,...): every product timed under each value of environment variable
  // ab_var in turn, ab_rounds times, reported per value (median) as "<name> [VAR=value]"; for
  // switches read on every call. The variable is restored afterwards.
  std::string ab_var;
  std::vector<std::string> ab_values;
  int ab_rounds = 3;
  // Kernel variants (--variants A,B,... or "all"): each also timed, after its backend, under its
  // own name, e.g. attention's TURBO_SM80 (OpFamily::variants; benchmark_variant_help()).
  std::vector<std::string> variants;
};

// Parses --ab's "VAR=A,B[,...]" into cfg.ab_var / cfg.ab_values; throws primus::UsageError naming
// what is wrong (no '=', an empty name, fewer than two values, an empty value).
void parse_ab(const std::string& spec, BenchConfig& cfg);

class BenchDevice;
struct Timed;
// --ab's timing of one product: t.run timed (dev.time_ms, `iters` calls) under each of
// cfg.ab_values of cfg.ab_var in turn, cfg.ab_rounds rounds, so all values share the process's and
// the device's state; returns ("<t.name> [VAR=value]", median ms) per value. The variable's
// previous value (or its absence) is restored, also when a call throws.
std::vector<std::pair<std::string, double>> time_ab(const BenchConfig& cfg, BenchDevice& dev, const Timed& t, int iters);

// Runs the benchmark. Throws primus::UsageError for an unknown op, backend, dtype or a malformed
// shape (naming which and where), primus::RuntimeError when an explicitly named backend cannot
// run a case; with "all" or the default, a backend that cannot run a case is reported and
// skipped; a run in which every backend was skipped is a RuntimeError. Returns the number of
// measurements taken.
int run_benchmarks(const BenchConfig& cfg, std::FILE* out);

// The op families' names, each one's --shapes syntax ("MxNxK", ...), and the kernel variants of
// those that have some (name: what it sets).
std::vector<std::string> benchmark_op_names();
std::string benchmark_shape_help();
std::string benchmark_variant_help();

}  // namespace primus::turbo::bench
