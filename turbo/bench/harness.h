// Internal to turbo/bench: how an op family describes its cases (cases_*.cpp) to the runner
// (benchmark.cpp).
#pragma once
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "turbo/bench/bench_device.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo::bench {

enum class Metric { Flops, Bytes };  // reported as TFLOP/s or GB/s

// One timed call: `work` flops or bytes per call of `run`.
struct Timed {
  std::string name;  // the measurement's case name in the results, e.g. "gemm/gpt2/qkv/fwd"
  Metric metric;
  double work;
  std::function<void()> run;
  std::string note;
  // What `run` writes, by name ("out", "dq", ...): after timing, each backend's values are set
  // against those of the first backend that ran the same measurement on the same inputs (the
  // cross-check; empty: none).
  std::vector<std::pair<std::string, TensorView>> outputs = {};
};

// What a case builds its tensors with: one device, one dtype (f32 on the host).
struct CaseEnv {
  BenchDevice& dev;
  DType dtype;
  ExecContext ctx;
  uint64_t seed = 1234;

  bool on_device() const { return dev.kind() == Device::CUDA; }
  TensorView empty(DType t, std::initializer_list<int64_t> shape);
  TensorView rand(DType t, std::initializer_list<int64_t> shape, float scale = 1.0f, float offset = 0.0f);
  TensorView zeros(DType t, std::initializer_list<int64_t> shape);
  TensorView ints(std::initializer_list<int64_t> shape, int32_t hi);
};

struct Case {
  std::string name;                                  // e.g. "gpt2/qkv" or "16384x2304x768"
  std::function<std::vector<Timed>(CaseEnv&)> build;  // allocates, runs setup, returns the calls
};

// Default cases are sized by where they run.
struct Scale {
  bool gpu;        // the training shapes (16384 tokens, GPT-2 and Llama) vs a small host version
  int64_t tokens;  // 16384 on a GPU, 256 on the host
};

// A kernel variant of one backend (--variants): the backend's dispatch with environment switches
// set for the whole case (its setup calls and its timing), reported under its own name (the JSON's
// "backend"), e.g. TURBO_SM80 = TURBO with PRIMUS_TURBO_ATTN_KERNEL=sm80 and _BWD_KERNEL=sm80.
struct KernelVariant {
  std::string name;
  BackendType backend;
  std::vector<std::pair<std::string, std::string>> env;
};

struct OpFamily {
  std::string name;                       // "gemm"
  std::string bench;                      // results file: "ops" or "attention"
  std::vector<std::string> dispatch_ops;  // the dispatcher names whose backend is forced
  std::vector<BackendType> backends;      // device backends first, then CPU; {CPU} alone: a host-only family
  std::vector<KernelVariant> variants;    // run only when named with --variants
  // Pairs (ours, anchor) of backends compared per case after the family has run: a table of
  // both times and anchor ms / ours ms (above 1: ours is faster), same run, same device.
  std::vector<std::pair<BackendType, BackendType>> compare;
  std::string shape_syntax;               // "MxNxK"
  // The cross-check's gate (relative L2 error of Timed::outputs): above it a line is flagged.
  double check_gate = 1e-2;
  std::function<std::vector<Case>(const Scale&)> defaults;
  // A case from one --shapes entry; throws UsageError naming the entry and the syntax.
  std::function<Case(const std::string& shape)> from_shape;
};

OpFamily gemm_family();
OpFamily gemm_fp8_family();
OpFamily norm_family();
OpFamily activation_family();
OpFamily loss_family();
OpFamily optimizer_family();
OpFamily rope_family();
OpFamily head_norm_family();
OpFamily embedding_family();
OpFamily attention_family();
OpFamily quantize_family();
OpFamily layer_family();
OpFamily grouped_gemm_family();
OpFamily grouped_gemm_fp8_family();
OpFamily moe_family();

// "16384x768" -> {16384, 768}: exactly `n` positive integers joined by 'x', else UsageError
// naming the op, the entry and `syntax`.
std::vector<int64_t> parse_dims(const std::string& op, const std::string& entry, size_t n, const std::string& syntax);

}  // namespace primus::turbo::bench
