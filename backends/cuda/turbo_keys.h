// Primus-Turbo's switches, as Primus' Megatron-LM module config names them (primus_turbo.yaml:
// enable_primus_turbo, use_turbo_attention, turbo_gemm_backend, ...), on the cuda backend, whose
// operators are this project's Turbo. An experiment written for Primus carries them over:
//   - a switch that names what the backend does is accepted at that value, and the other value is
//     refused by name with the reason (there is no second operator set to fall back to); where
//     the other value names Transformer Engine's kernels, which on NVIDIA GPUs are the cuDNN
//     attention and cuBLASLt GEMMs Turbo's ops run (use_turbo_attention, use_turbo_gemm), both
//     values are accepted, and use_turbo_grouped_mlp: false only without experts;
//   - the backend selections (turbo_gemm_backend, turbo_grouped_gemm_backend, use_turbo_autotune)
//     set Turbo's dispatcher as PRIMUS_TURBO_<OP>_BACKEND / PRIMUS_TURBO_AUTO_TUNE do, in this
//     project's backend names (CUBLASLT, TURBO; AMD's hipblaslt, triton, aiter are refused);
//   - the switches of features not built here (DeepEP, MXFP4, attention sinks, FP8 attention,
//     Transformer Engine's precision file) are accepted at their off value only.
#pragma once
#include <string>

#include "core/config/schema.h"
#include "core/config/value.h"

namespace primus::backends::cuda {

void add_turbo_schema(config::Schema& s);

// What the keys ask of the dispatcher, checked (convert_config).
struct TurboSelection {
  std::string gemm_backend;          // PRIMUS_TURBO_GEMM_BACKEND's text form; empty: the op's default
  std::string grouped_gemm_backend;  // the same for grouped_gemm
  bool autotune = false;             // use_turbo_autotune
  std::string gemm_key = "turbo_gemm_backend";  // the key that chose gemm_backend, for the log
};

// Checks the keys of the resolved config `p` (a ConfigError naming the key's origin for a value
// not implemented, a malformed or foreign backend, or a choice this run cannot make) and returns
// the dispatcher settings. `attention_backend` is updated for use_turbo_attention: true.
TurboSelection check_turbo_keys(const config::Value& p, std::string& attention_backend);

// Applies a selection to Turbo's process-wide dispatcher settings (the trainer's init, on the
// device): the named backends as code settings, or the op's code settings cleared where the config
// names none, so an earlier run of the same process leaves nothing behind. An environment variable
// that is set wins over the config (PRIMUS_TURBO_GEMM_BACKEND, PRIMUS_TURBO_GROUPED_GEMM_BACKEND,
// PRIMUS_TURBO_AUTO_TUNE), as the environment does over every other key; each choice is logged.
void apply_turbo_selection(const TurboSelection& sel);

}  // namespace primus::backends::cuda
