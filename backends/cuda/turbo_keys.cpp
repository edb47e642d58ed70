#include "backends/cuda/turbo_keys.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <tuple>

#include "backends/cuda/fixed_switch.h"
#include "backends/cuda/step_graph.h"
#include "core/util/error.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/dispatch/backend_spec.h"

namespace primus::backends::cuda {

namespace {

// Switches whose other value is not built here (fixed_switch.h).
constexpr FixedSwitch kTurboSwitches[] = {
    {"enable_primus_turbo", true,
     "the cuda backend's operators are Turbo's (cuBLASLt, cuDNN and Turbo's own kernels behind one dispatcher)",
     "there is no other operator set to run"},
    {"use_turbo_rms_norm", true, "the norms (RMSNorm and LayerNorm) run Turbo's norm op",
     "there is no norm outside Turbo's"},
    {"moe_use_fused_router_with_aux_score", true,
     "the MoE router and its load-balancing scores are one fused kernel (as moe_router_fusion)",
     "the cuda backend has no unfused router"},
    {"use_turbo_fused_act_with_probs", true,
     "the routing weights are applied inside a fused kernel, Turbo's unpermute, not as a separate multiply",
     "there is no separate multiply by the routing weights"},
    {"use_turbo_deepep", false,
     "expert parallelism exchanges tokens with NCCL's send / recv, planned from counts read on the host",
     "DeepEP is not implemented"},
    {"turbo_deepep_use_comm_stream", false, "no DeepEP", "DeepEP is not implemented"},
    {"turbo_fused_grouped_gemm", false,
     "the experts' up projection, SwiGLU and down projection are two grouped GEMMs with the SwiGLU in their "
     "epilogues",
     "the experts' MLP is not one op"},
    {"turbo_grouped_gemm_without_padding", false,
     "the permutation pads each expert's rows to the grouped GEMM's 64-row alignment",
     "the grouped GEMM takes aligned groups only"},
    {"use_turbo_mega_moe", false, "the MoE layer runs as its router, permutation and grouped GEMMs",
     "the fused MegaMoE layer is not implemented"},
    {"use_sink_attention", false, "no attention sinks", "GPT-OSS's attention sinks are not implemented"},
    {"sink_window_even_layers_only", true, "no attention sinks",
     "GPT-OSS's attention sinks are not implemented"},
    {"enable_turbo_attention_float8", false, "attention in bf16", "FP8 attention is not implemented"},
    {"use_turbo_norm_te_linear", false,
     "the norm and the qkv GEMM after it are both Turbo's ops (there is no Transformer Engine here)",
     "there is no Transformer Engine linear to keep"},
    {"mxfp4_gradient_stochastic_rounding", false, "no MXFP4", "MXFP4 is not implemented (Hopper has no FP4 tensor cores)"},
};

// A number or word accepted at its default only.
struct TurboFixed {
  const char* key;
  const char* value;  // the default, as written
  const char* why;    // why another value is refused
};
constexpr TurboFixed kTurboFixed[] = {
    {"turbo_deepep_num_cu", "32", "DeepEP, which it tunes, is not implemented"},
    {"sink_sliding_window", "0",
     "attention sinks, whose window it is, are not implemented; sliding_window is the plain sliding-window "
     "attention"},
    {"mxfp4_scale_rounding_mode", "0", "MXFP4 is not implemented (Hopper has no FP4 tensor cores)"},
    {"turbo_mega_moe_precision", "bf16", "the fused MegaMoE layer, whose precision it is, is not implemented"},
};

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// Parses a turbo_*_backend value ("default", or the dispatcher's text form) and checks every
// choice against what `op` can take in this run.
std::string check_backend(const config::Value& p, const char* key, const char* op, bool graph_off) {
  const config::Value& v = *p.find_path(key);
  const std::string text = v.as_string();
  if (lower(text) == "default") return "";
  const std::string where = fmt::format("{}: {}", v.origin().str(), key);
  turbo::BackendSpec spec;
  try {
    spec = turbo::parse_backend_spec(text, where);
  } catch (const ConfigError&) {
    const std::string t = lower(text);
    for (const char* amd : {"hipblaslt", "triton", "aiter", "ck", "fp4"})
      if (t.find(amd) != std::string::npos)
        throw ConfigError(fmt::format("{}: '{}' names Primus-Turbo's AMD backends or precisions ({}); here the {} op "
                                      "runs {}, for every precision or per precision of fp32, fp16, bf16, fp8 "
                                      "(fp8:TURBO,other:CUBLASLT)",
                                      where, text, amd, op, std::string(op) == "gemm" ? "CUBLASLT, TURBO or AUTOTUNE"
                                                                                     : "TURBO or CUBLASLT"));
    throw;
  }
  const bool grouped = std::string(op) == "grouped_gemm";
  auto check = [&](const std::optional<turbo::BackendChoice>& c) {
    if (!c) return;
    if (c->is_autotune()) {
      if (grouped)
        throw ConfigError(fmt::format("{}: AUTOTUNE: the grouped GEMM is not timed per shape (its weight gradient "
                                      "accumulates in place); name TURBO or CUBLASLT",
                                      where));
      return;
    }
    const turbo::BackendType b = c->backend;
    if (b != turbo::BackendType::TURBO && b != turbo::BackendType::CUBLASLT)
      throw ConfigError(fmt::format("{}: {} does not run the {} op on the GPU (CUBLASLT, TURBO{})", where,
                                    turbo::backend_name(b), op, grouped ? "" : " or AUTOTUNE"));
    if (grouped && b == turbo::BackendType::CUBLASLT && !graph_off)
      throw ConfigError(fmt::format("{}: CUBLASLT runs one GEMM per expert from sizes read on the host, which a CUDA "
                                    "graph cannot capture: set cuda_graph: false with it",
                                    where));
  };
  for (const auto& c : spec.per_precision) check(c);
  check(spec.other);
  return text;
}

}  // namespace

void add_turbo_schema(config::Schema& s) {
  add_fixed_switches(s, kTurboSwitches, "Primus-Turbo");
  s.flag("use_turbo_attention", true,
         "Primus-Turbo's switch between its attention op and Transformer Engine's, which on NVIDIA GPUs run the same "
         "kernels (cuDNN's fused attention): true set in a config asks for Turbo's op, as attention_backend: turbo; "
         "false leaves attention_backend as it is")
      .flag("use_turbo_gemm", true,
            "Primus-Turbo's switch between its gemm op and Transformer Engine's linear GEMMs: true, the linear layers' "
            "GEMMs run Turbo's gemm op (turbo_gemm_backend picks its backend); false, cuBLASLt's GEMMs, which "
            "Transformer Engine runs on NVIDIA GPUs (turbo_gemm_backend: CUBLASLT)")
      .flag("use_turbo_parallel_linear", true, "an older name of use_turbo_gemm (the same values; both set must agree)")
      .flag("use_turbo_grouped_mlp", true,
            "Primus-Turbo's switch for the MoE experts: true, Turbo's grouped GEMM runs them (turbo_grouped_gemm_backend "
            "picks its backend); false is refused where there are experts (the grouped GEMM outside Turbo's kernel here "
            "is turbo_grouped_gemm_backend: CUBLASLT, one cuBLASLt GEMM per expert) and does nothing without them")
      .flag("use_turbo_grouped_gemm", true, "the newer name of use_turbo_grouped_mlp (the same values; both set must agree)")
      .text("turbo_gemm_backend", "default",
            "Primus-Turbo's backend of the gemm op: default (cuBLASLt, or Turbo's kernel where the dispatcher prefers "
            "it), or the dispatcher's text form in this project's names: CUBLASLT, TURBO or AUTOTUNE, for every "
            "precision or per precision (fp8:TURBO,other:CUBLASLT), as PRIMUS_TURBO_GEMM_BACKEND, which wins when set")
      .text("turbo_grouped_gemm_backend", "default",
            "Primus-Turbo's backend of the grouped_gemm op (the MoE experts): default (Turbo's sm90 kernel), TURBO, or "
            "CUBLASLT (one GEMM per expert; needs cuda_graph: false), as PRIMUS_TURBO_GROUPED_GEMM_BACKEND, which "
            "wins when set")
      .flag("use_turbo_autotune", false,
            "Primus-Turbo's autotuning: true times every capable backend of the gemm and attention ops once per "
            "shape and keeps the fastest (as PRIMUS_TURBO_AUTO_TUNE=1, which wins when set); false: each op's "
            "default or the backend named for it")
      .integer("turbo_sync_free_moe_stage", 0,
               "Primus-Turbo's sync-free MoE stage (0 off, 1-3 more of the MoE without host synchronisation): the "
               "one-GPU MoE with grouped GEMMs never synchronises with the host at any stage (device-side group "
               "offsets, one CUDA graph), so every stage runs it; a stage above 0 is refused with expert parallelism "
               "(its dispatch reads the token counts on the host) or moe_grouped_gemm: false (the group sizes are read "
               "on the host)",
               0, 3)
      .integer("turbo_deepep_num_cu", 32, "Primus-Turbo's DeepEP compute units: accepted at 32 only (no DeepEP here)", 1)
      .integer("sink_sliding_window", 0, "GPT-OSS's attention-sink window: accepted at 0 only (no attention sinks)", 0)
      .integer("mxfp4_scale_rounding_mode", 0, "Primus-Turbo's MXFP4 scale rounding: accepted at 0 only (no MXFP4)",
               0, 2)
      .text("turbo_mega_moe_precision", "bf16",
            "Primus-Turbo's MegaMoE precision: accepted as bf16 only (no MegaMoE layer)", {"bf16", "mxfp8"})
      .text("te_precision_config_file", std::nullopt,
            "Transformer Engine's per-module precision file (Megatron-LM's --te-precision-config-file): refused when "
            "set (no Transformer Engine here; fp8_first_last_bf16_layers keeps the edge layers in bf16)");
}

TurboSelection check_turbo_keys(const config::Value& p, std::string& attention_backend) {
  auto where = [&](const char* k) { return p.find_path(k)->origin().str(); };
  check_fixed_switches(p, kTurboSwitches);
  for (const TurboFixed& f : kTurboFixed)
    if (const std::string v = p.find_path(f.key)->scalar_text(); v != f.value)
      throw ConfigError(fmt::format("{}: {}: {} is not implemented ({}); remove the key or set it {}", where(f.key),
                                    f.key, v, f.why, f.value));
  if (const config::Value* te = p.find_path("te_precision_config_file"); te && !te->is_null())
    throw ConfigError(fmt::format("{}: te_precision_config_file: there is no Transformer Engine here to read it; "
                                  "fp8_first_last_bf16_layers keeps the first and last layers' GEMMs in bf16",
                                  te->origin().str()));

  const config::Value& ta = *p.find_path("use_turbo_attention");
  if (config::set_by_a_layer(&ta) && ta.as_bool()) {
    if (attention_backend == "fallback")
      throw ConfigError(fmt::format("{}: use_turbo_attention: true asks for Turbo's attention op and {} sets "
                                    "attention_backend: fallback, the unfused path: keep one of them",
                                    ta.origin().str(), where("attention_backend")));
    attention_backend = "turbo";
  }

  const int64_t stage = p.find_path("turbo_sync_free_moe_stage")->as_int();
  if (stage > 0 && p.find_path("num_experts")->as_int() > 0) {
    if (p.find_path("expert_model_parallel_size")->as_int() > 1)
      throw ConfigError(fmt::format("{}: turbo_sync_free_moe_stage {}: with expert parallelism the token dispatch reads "
                                    "each layer's counts on the host (set it 0)",
                                    where("turbo_sync_free_moe_stage"), stage));
    if (!p.find_path("moe_grouped_gemm")->as_bool())
      throw ConfigError(fmt::format("{}: turbo_sync_free_moe_stage {}: moe_grouped_gemm: false reads the group sizes on "
                                    "the host (set it 0, or moe_grouped_gemm: true)",
                                    where("turbo_sync_free_moe_stage"), stage));
  }

  // Two names of one switch each (Primus-Turbo renamed them): both set must agree.
  // Returns the name set (b where a layer set it, else a) and its value.
  auto one_of = [&](const char* a, const char* b) -> std::pair<const char*, const config::Value*> {
    const config::Value& va = *p.find_path(a);
    const config::Value& vb = *p.find_path(b);
    if (config::set_by_a_layer(&va) && config::set_by_a_layer(&vb) && va.as_bool() != vb.as_bool())
      throw ConfigError(fmt::format("{}: {}: {} and {}: {}: {} are one switch with two names", va.origin().str(), a,
                                    va.as_bool(), vb.origin().str(), b, vb.as_bool()));
    return config::set_by_a_layer(&vb) ? std::pair{b, &vb} : std::pair{a, &va};
  };
  const auto [grouped_name, grouped] = one_of("use_turbo_grouped_mlp", "use_turbo_grouped_gemm");
  if (!grouped->as_bool() && p.find_path("num_experts")->as_int() > 0)
    throw ConfigError(fmt::format("{}: {}: false with experts is not implemented as such: the "
                                  "experts' GEMMs outside Turbo's grouped kernel are turbo_grouped_gemm_backend: "
                                  "CUBLASLT (one cuBLASLt GEMM per expert; needs cuda_graph: false); set that, or "
                                  "remove the key for Turbo's kernel",
                                  grouped->origin().str(), grouped_name));
  const auto [linear_name, linear] = one_of("use_turbo_gemm", "use_turbo_parallel_linear");

  TurboSelection sel;
  const bool graph_off = parse_cuda_graph(*p.find_path("cuda_graph")) == GraphMode::Off;
  sel.gemm_backend = check_backend(p, "turbo_gemm_backend", "gemm", graph_off);
  if (!linear->as_bool()) {
    if (!sel.gemm_backend.empty() && lower(sel.gemm_backend) != "cublaslt")
      throw ConfigError(fmt::format("{}: {}: false asks for cuBLASLt's GEMMs and {} sets turbo_gemm_backend: {}: keep "
                                    "one of them",
                                    linear->origin().str(), linear_name, where("turbo_gemm_backend"), sel.gemm_backend));
    sel.gemm_backend = "CUBLASLT";
    sel.gemm_key = fmt::format("{}: false", linear_name);
  }
  sel.grouped_gemm_backend = check_backend(p, "turbo_grouped_gemm_backend", "grouped_gemm", graph_off);
  sel.autotune = p.find_path("use_turbo_autotune")->as_bool();
  return sel;
}

void apply_turbo_selection(const TurboSelection& sel) {
  auto& m = turbo::GlobalBackendManager::instance();
  const std::string grouped_key = "turbo_grouped_gemm_backend";
  const std::tuple<const char*, const std::string*, const std::string*> ops[] = {
      {"gemm", &sel.gemm_backend, &sel.gemm_key}, {"grouped_gemm", &sel.grouped_gemm_backend, &grouped_key}};
  for (const auto& [op, text, key] : ops) {
    m.clear_backend(op);
    if (text->empty()) continue;
    const std::string var = turbo::GlobalBackendManager::env_var_for(op);
    if (const char* env = std::getenv(var.c_str()); env && *env) {
      spdlog::info("[cuda] {} backend: {}={} wins over the config's {}", op, var, env, *text);
      continue;
    }
    const turbo::BackendSpec spec = turbo::parse_backend_spec(*text, var);
    if (spec.other) m.set_backend(op, *spec.other);  // every precision, before the per-precision entries
    for (turbo::Precision pr : turbo::kAllPrecisions)
      if (const auto& c = spec.per_precision[static_cast<size_t>(pr)]) m.set_backend(op, *c, pr);
    spdlog::info("[cuda] {} backend: {} ({})", op, *text, *key);
  }
  const char* env = std::getenv("PRIMUS_TURBO_AUTO_TUNE");
  if (env && *env) {
    m.set_auto_tune(std::nullopt);
    if (sel.autotune) spdlog::info("[cuda] autotune: PRIMUS_TURBO_AUTO_TUNE={} wins over use_turbo_autotune", env);
  } else {
    m.set_auto_tune(sel.autotune ? std::optional<bool>(true) : std::nullopt);
    if (sel.autotune) spdlog::info("[cuda] autotune: gemm and attention backends timed per shape (use_turbo_autotune)");
  }
}

}  // namespace primus::backends::cuda
