// The CUDA backend's adapter: schema, hook slots, device selection, config -> args, trainer.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "turbo/ops/fp8_delayed.h"
#include "turbo/ops/gemm_fp8.h"
#include "backends/cuda/args.h"
#include "parallel/cuda/grad_reducer.h"
#include "backends/cuda/device.h"
#include "backends/cuda/fixed_switch.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/profile_window.h"
#include "backends/cuda/projection.h"
#include "backends/cuda/register.h"
#include "backends/cuda/step_graph.h"
#include "backends/cuda/trainer.h"
#include "backends/cuda/turbo_keys.h"
#include "core/util/error.h"
#include "parallel/launch_env.h"
#include "parallel/data_parallel.h"
#include "train/hf_import.h"

namespace primus::backends::cuda {

namespace {

// Megatron-LM's switches between a fused kernel and its unfused PyTorch path: the cuda backend has
// the fused kernel only.
constexpr FixedSwitch kMegatronSwitches[] = {
    {"moe_permute_fusion", true,
     "MoE token permutation and unpermutation are Turbo's fused kernels (the routing weights folded into the "
     "unpermute), as Megatron-LM's fused (Transformer Engine) permutation",
     "the cuda backend has no unfused permutation"},
    {"moe_router_fusion", true,
     "the MoE router (score function, expert bias, group-limited top-k, normalisation, aux- and z-loss terms, "
     "per-expert counts) runs as one fused kernel, forward and backward",
     "the cuda backend has no unfused router"},
    {"bias_swiglu_fusion", true,
     "SwiGLU runs fused: one kernel for the dense MLPs, the grouped GEMMs' epilogues for the MoE experts (the "
     "models have no biases)",
     "the cuda backend has no unfused SwiGLU"},
    {"apply_rope_fusion", true, "RoPE rotates q and k in one kernel, in place, forward and backward",
     "the cuda backend has no unfused RoPE"},
    {"cross_entropy_loss_fusion", true,
     "the output layer's softmax cross-entropy (loss and logits gradient) is one fused kernel",
     "the cuda backend has no unfused cross-entropy"},
    {"bf16", true,
     "bf16 compute with fp32 master weights (and FP8 GEMMs over it with fp8), the cuda backend's mixed precision",
     "the cuda backend has no fp32 compute; the reference backend trains in fp32"},
    {"fp16", false, "no fp16 compute (bf16 only)", "fp16 with loss scaling is not implemented"},
    {"moe_shared_expert_overlap", false,
     "the shared expert runs in order with the routed experts (Megatron-LM's true overlaps it with the token "
     "dispatch's communication under expert parallelism)",
     "the shared expert is not overlapped with the dispatch"},
};

}  // namespace

void add_cuda_schema(config::Schema& s) {
  add_fixed_switches(s, kMegatronSwitches, "Megatron-LM");
  s.integer("device", 0, "CUDA device index this process trains on", 0, 1023)
      .text("recompute_granularity", "none",
            "activation recomputation: none (keep every activation); norms (recompute the two norm outputs in the "
            "backward); selective (norms and the MLP activation); full (keep only each layer's input, rerun its "
            "forward in the backward)",
            {"none", "norms", "selective", "full"})
      .text("recompute_method", std::nullopt,
            "Megatron-LM's choice of the layers recompute_granularity full recomputes: block (the first "
            "recompute_num_layers layers, the rest keep their activations) or uniform (with recompute_num_layers 1: "
            "every layer, as full alone; chunks of more layers are not implemented); unset: every layer",
            {"uniform", "block"})
      .integer("recompute_num_layers", std::nullopt,
               "with recompute_method: block's layer count (Megatron-LM's default 1; 0: no layer, as Primus' examples "
               "tune it; at least num_layers is every layer), uniform's chunk (1 only)",
               0)
      .add({"cuda_graph", config::KeyType::Any, config::Value::string("auto"), {}, {}, {},
            "capture the whole training step (forward, backward, clip, AdamW) as one CUDA graph after a warm-up step "
            "and replay it: auto (capture where the step can be captured: one process on a GPU; eagerly with "
            "several data-parallel ranks), true (capture; a setting that cannot be captured is an error) or false"})
      .flag("launch_ahead", true,
            "queue step s + 1 on the device before reading step s's loss and grad norm, so the device runs steps back "
            "to back while the host logs and stages the next batches (not at evaluations, checkpoints or a stop "
            "signal, where the host needs the state after step s; one process, no profiler). "
            "PRIMUS_CUDA_LAUNCH_AHEAD=0|1 overrides it")
      .flag("gradient_accumulation_fusion", true,
            "Megatron-LM's switch for the linear layers' weight gradients (the transformer layers', the MoE experts', "
            "the output layer's): true, the weight-gradient GEMM adds into the fp32 gradient (beta 1) across "
            "micro-batches; false, as Megatron-LM without its fused kernel, the GEMM writes a product that is rounded "
            "to the weights' dtype (bf16) and then added to the fp32 gradient, at the cost of one more pass over each "
            "weight gradient and scratch for the largest one in f32 (patch cuda.grad.unfused_accumulation)")
      .flag("optimizer_in_bwd", false,
            "run each layer's AdamW in the backward as soon as its gradients are final, the layers sharing one "
            "gradient buffer (the gradients take one layer's memory instead of the model's; two layers' beside data "
            "or context parallelism, where each layer's gradients are averaged over the ranks while the layer below "
            "runs its backward); needs clip_grad: 0, one micro-batch per step (global_batch_size = micro_batch_size x "
            "data-parallel ranks) and the whole optimizer state on every rank (no ZeRO-1 or sharding)")
      .text("moe_expert_grad_dtype", "fp32",
            "dtype of the MoE experts' weight gradients: fp32, or bf16 (the grouped weight-gradient GEMM rounds its "
            "f32 sums once and AdamW reads them widened, as torch's autocast does for fp32 master weights; half the "
            "gradient bytes written and read); bf16 needs optimizer_in_bwd: true (a gradient written once, never "
            "accumulated), fp8: none and num_experts > 0",
            {"fp32", "bf16"})
      .number("moe_ep_buffer_factor", 2.0,
              "expert parallelism: the held-side buffers (this rank's experts' rows from every rank) are sized for "
              "this factor x one rank's permuted rows, at most ep x them (the dropless worst case, every rank's rows "
              "to one rank's experts). A step whose routing sends more rows to a rank stops with an error naming "
              "this key before any row moves; balanced routing needs about 1",
              1.0)
      .text("master_weights", "fp32",
            "how the fp32 master weights are held: fp32 (a buffer of their own beside the bf16 compute weights), or "
            "split (the bf16 weights are their high halves and a 16-bit buffer their low halves: the same fp32 values "
            "and the same AdamW arithmetic, 2 bytes a parameter less memory and optimizer traffic; the bf16 weights "
            "then round ties away from zero instead of to even, one ulp apart in the exact ties only); split needs the "
            "GPU, AdamW and the whole optimizer state on each GPU (no use_distributed_optimizer or sharded data "
            "parallelism)",
            {"fp32", "split"})
      .integer("gemm_algo_search", 8,
               "cuBLASLt algorithm per GEMM shape: k > 1 times the heuristic's top k candidates at the shape's first "
               "call and keeps the fastest, saved in a per-machine cache file that later runs reuse (the same "
               "machine, cuBLASLt and file give the same algorithms, so resumes are bit-identical); 0 or 1: the "
               "heuristic's first answer. PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH overrides it",
               0, 8)
      .flag("moe_grouped_gemm", true,
            "MoE experts as grouped GEMMs over the device-side group offsets (Turbo's sm90 kernel); false: one "
            "cuBLASLt GEMM per expert, the group sizes read on the host after each routing (a reference path for "
            "A/B runs; needs cuda_graph: false)")
      .text("cross_entropy_fusion_impl", "native",
            "Megatron-LM's choice between its two fused cross-entropy implementations (native, te), which compute the "
            "same loss and gradient: either value runs Turbo's one fused kernel here (cross_entropy_loss_fusion)",
            {"native", "te"})
      .flag("moe_use_legacy_grouped_gemm", false,
            "Megatron-LM's choice between its two grouped-GEMM expert modules (GroupedMLP, legacy, and TEGroupedMLP), "
            "which compute the same products: either value runs Turbo's grouped GEMM here (moe_grouped_gemm chooses "
            "grouped or per-expert GEMMs)")
      .flag("deterministic", false,
            "bit-identical runs and resumes on the GPU: the attention backward runs cuDNN's engine without "
            "run-dependent dQ accumulation (more scratch: batch x heads x seq_length^2 x 2 bytes; slower); every other "
            "kernel is deterministic already")
      .text("fp8", "none",
            "FP8 GEMMs for the transformer layers' linear layers (qkv, attention output, MLP; the output layer "
            "stays bf16), per-tensor current scaling: hybrid (E4M3 activations and weights, E5M2 gradients) or "
            "e4m3 (E4M3 everywhere); none: bf16",
            {"none", "hybrid", "e4m3"})
      .text("fp8_recipe", "tensorwise",
            "with fp8: the scaling granularity of the FP8 GEMMs' operands (current scaling: each scale from the "
            "amax of the data it scales). tensorwise: one scale per tensor (fastest, least robust to outliers); "
            "rowwise: one per row along K (torchao's rowwise: tokens for x and dy, features for w); blockwise: "
            "DeepSeek-V3's 1x128 tiles for activations and gradients, 128x128 blocks for weights (needs fp8: e4m3 "
            "and every linear size a multiple of 128); delayed: one scale per tensor from earlier steps' amax history "
            "(Transformer Engine's delayed scaling: one pass per quantization; fp8_amax_history_len, "
            "fp8_amax_compute_algo, fp8_margin; over several ranks (data, context, tensor or sharded data "
            "parallelism) the amaxes are max-reduced over them every step)",
            {"tensorwise", "rowwise", "blockwise", "delayed"})
      .integer("fp8_amax_history_len", 1,
               "fp8_recipe delayed: how many steps' amaxes each tensor's history keeps (Megatron's "
               "--fp8-amax-history-len; Transformer Engine's default is 1024)",
               1)
      .text("fp8_amax_compute_algo", "most_recent",
            "fp8_recipe delayed: the amax a scale is made from, the newest entry of the history or its largest "
            "(Megatron's --fp8-amax-compute-algo)",
            {"most_recent", "max"})
      .integer("fp8_margin", 0,
               "fp8_recipe delayed: scales are divided by 2^margin, headroom for amaxes that grow between steps "
               "(Megatron's --fp8-margin)",
               0)
      .flag("no_fp8_weight_transpose_cache", false,
            "Primus' switch (Transformer Engine's keep_fp8_weight_transpose_cache=False): with fp8 and gradient "
            "accumulation each weight's FP8 copy for the step keeps its forward layout only, and every input-gradient "
            "GEMM quantizes the weight's transpose again (the same bytes; half the copies' memory, one more "
            "quantization per weight and micro-batch); false keeps both layouts")
      .integer("fp8_first_last_bf16_layers", 0,
               "with fp8: the first and last N transformer layers keep their linear GEMMs in bf16 (the layers "
               "FP8 recipes find most sensitive; Megatron's --first-last-layers-bf16); at most (num_layers - 1) / 2",
               0)
      .integer("profile_steps", 0,
               "per-phase GPU time over this many steps after the first (table at the end, profile.json in the output "
               "folder); 0: off unless PRIMUS_CUDA_PROFILE=1 (then every step)",
               0)
      .flag("profile", false,
            "Megatron-LM's profiling window: the CUDA profiler's capture range (cudaProfilerStart / Stop) holds steps "
            "profile_step_start + 1 to profile_step_end on the ranks in profile_ranks, for `nsys profile "
            "--capture-range=cudaProfilerApi` (the trace carries NVTX ranges per step and layer)")
      .integer("profile_step_start", 10, "with profile: the capture range opens before the step after this many", 0)
      .integer("profile_step_end", 12, "with profile: the capture range closes after this many steps", 1)
      .add({"profile_ranks", config::KeyType::List, config::Value::null(), {}, {}, {},
            "with profile: the global ranks that open the capture range (unset: [0])"})
      .flag("use_pytorch_profiler", false,
            "Megatron-LM's switch to torch.profiler for the profile window: there is none here, so true is refused "
            "beside profile: true; with profile: false nothing is profiled either way")
      .flag("torch_profiler_record_shapes", false, "an option of torch.profiler (use_pytorch_profiler): unused here")
      .flag("torch_profiler_with_stack", false, "an option of torch.profiler (use_pytorch_profiler): unused here")
      .flag("torch_profiler_use_gzip", false, "an option of torch.profiler (use_pytorch_profiler): unused here")
      .flag("record_shapes", false, "an option of torch.profiler (use_pytorch_profiler): unused here")
      .flag("disable_profiler_activity_cpu", false,
            "an option of torch.profiler (use_pytorch_profiler): unused here")
      .text("attention_backend", "auto",
            "auto: Turbo's attention op (cuDNN / flash kernels) where built, else the fallback; turbo; fallback "
            "(GEMMs + softmax kernel, materialises [T,T] scores)",
            {"auto", "turbo", "fallback"})
      .number("peak_flops", 0.0, "dense bf16 peak FLOP/s per GPU for MFU (0: looked up from the GPU name)", 0.0)
      .flag("overlap_grad_reduce", true,
            "data parallelism: reduce each gradient bucket as soon as its layers' backward is done (false: all "
            "after the backward)")
      .flag("grad_reduce_in_bf16", false,
            "data parallelism: reduce gradient buckets in bf16 (half the traffic; each sum rounded to bf16) instead "
            "of fp32");
  s.alias("recompute_activations", "recompute_granularity", config::Value::string("selective"), config::Value::null(),
          "Megatron-LM's shortcut: true is recompute_granularity: selective; false leaves recompute_granularity as set")
      .alias("deterministic_mode", "deterministic", config::Value::boolean(true), config::Value::boolean(false),
             "Megatron-LM's name of deterministic");
  parallel::add_data_parallel_schema(s);  // use_distributed_optimizer, ddp_bucket_size_mb
  add_turbo_schema(s);                    // Primus-Turbo's switches (turbo_keys.h)
}

std::vector<std::pair<std::string, std::string>> CudaArgs::describe() const {
  auto d = train.describe();
  d.insert(d.begin(), {"model", model.summary()});
  d.push_back({"device", device_name.empty() ? std::to_string(device) : fmt::format("{} ({})", device, device_name)});
  d.push_back({"attention_backend", attention_backend});
  if (!turbo.gemm_backend.empty()) d.push_back({"turbo_gemm_backend", turbo.gemm_backend});
  if (!turbo.grouped_gemm_backend.empty()) d.push_back({"turbo_grouped_gemm_backend", turbo.grouped_gemm_backend});
  if (turbo.autotune) d.push_back({"use_turbo_autotune", "true (gemm and attention backends timed per shape)"});
  if (deterministic) d.push_back({"deterministic", "true (attention backward without atomics)"});
  if (fp8 != "none")
    d.push_back({"fp8", fmt::format("{}, {} scaling{} (transformer-layer linear GEMMs{}; output layer bf16)", fp8,
                                    fp8_recipe,
                                    fp8_recipe == "delayed"
                                        ? fmt::format(": amax history {}, {}, margin {}", fp8_amax_history_len,
                                                      fp8_amax_compute_algo, fp8_margin)
                                        : "",
                                    model.moe.enabled() ? " and the MoE experts' grouped GEMMs" : "")});
  d.push_back({"peak_flops", peak_flops > 0 ? fmt::format("{:.3g}", peak_flops) : "unknown (no MFU)"});
  // The step options the cuda.* build_args patches switch on (a dry run lists what they changed).
  std::vector<std::string> step;
  step.push_back(cuda_graph ? (cuda_graph_auto ? "CUDA graph (auto)" : "CUDA graph") : "eager");
  step.push_back(gemm_algo_search > 1 ? fmt::format("cuBLASLt search of {}", gemm_algo_search) : "cuBLASLt heuristic");
  if (optimizer_in_bwd) step.push_back("optimizer in the backward");
  if (split_master) step.push_back("split master weights");
  if (bf16_expert_grads) step.push_back("bf16 expert gradients");
  if (unfused_wgrad) step.push_back("weight gradients rounded to bf16, then added (unfused accumulation)");
  if (moe_swiglu_epilogue) step.push_back("experts' SwiGLU in the GEMM epilogues");
  if (launch_ahead) step.push_back("launch ahead");
  if (profile_steps > 0) step.push_back(fmt::format("phase profile of {} steps", profile_steps));
  if (profile_window.profile)
    step.push_back(fmt::format("CUDA profiler capture range over steps {}-{} on ranks {}", profile_window.start + 1,
                               profile_window.end, fmt::join(profile_window.ranks, ",")));
  d.push_back({"step", fmt::format("{}", fmt::join(step, ", "))});
  return d;
}

bool zero1_in_model(const CudaArgs& a) {
  const parallel::ParallelSizes& mp = a.train.model_parallel;
  return mp.sharding == parallel::DpSharding::Optim &&
         (mp[parallel::Dim::TP] > 1 || mp[parallel::Dim::CP] > 1 || mp[parallel::Dim::EP] > 1 || a.host_mode);
}

namespace {

class CudaAdapter : public BackendAdapter {
 public:
  CudaAdapter() {
    train::add_model_schema(schema_);
    train::add_training_schema(schema_);
    train::add_hf_import_schema(schema_);
    add_cuda_schema(schema_);
  }
  std::string name() const override { return kName; }
  std::string version() const override { return kVersion; }
  std::string description() const override {
    return "NVIDIA GPUs: bf16 compute with fp32 master weights, Turbo ops (cuBLASLt, cuDNN, fused kernels)";
  }
  const config::Schema& schema() const override { return schema_; }
  void define_hooks(patches::HookTable& hooks) const override { define_cuda_hooks(hooks); }

  void prepare(const config::ModuleConfig& cfg) override {
    device_ = select_device(parallel::rank_device(static_cast<int>(cfg.params.find_path("device")->as_int())));
    spdlog::info("[cuda] device {}: {} (sm_{}{}, {} SMs, {:.1f} GiB)", device_.index, device_.name, device_.cc_major,
                 device_.cc_minor, device_.sm_count, static_cast<double>(device_.total_bytes) / (1 << 30));
  }

  std::shared_ptr<BackendArgs> convert_config(const config::ModuleConfig& cfg, const config::Experiment& exp) override {
    // With load_hf the model keys (and the tokenizer) come from the Hugging Face folder.
    const config::Value p = train::resolve_load_hf(cfg.params, exp.file);
    auto where = [&](const char* k) { return p.find_path(k)->origin().str(); };
    auto a = std::make_shared<CudaArgs>();
    a->model = train::ModelSpec::from_config(p);
    a->train = train::TrainingArgs::from_config(p, exp);
    a->train.model_parallel.check_implemented(kCudaMesh);  // here, so a dry run refuses it too
    a->device = parallel::rank_device(static_cast<int>(p.find_path("device")->as_int()));
    const parallel::DataParallelArgs dpa = parallel::DataParallelArgs::from_config(p);
    a->use_distributed_optimizer = dpa.distributed_optimizer;
    a->ddp_bucket_size = dpa.bucket_elems(4);  // fp32 gradients
    a->overlap_grad_reduce = p.find_path("overlap_grad_reduce")->as_bool();
    a->grad_reduce_in_bf16 = p.find_path("grad_reduce_in_bf16")->as_bool();
    a->device_name = device_.name;
    a->attention_backend = p.find_path("attention_backend")->as_string();
    a->peak_flops = p.find_path("peak_flops")->as_double();
    a->moe_ep_buffer_factor = p.find_path("moe_ep_buffer_factor")->as_double();
    a->fp8_first_last_bf16_layers = p.find_path("fp8_first_last_bf16_layers")->as_int();
    a->no_fp8_weight_transpose_cache = p.find_path("no_fp8_weight_transpose_cache")->as_bool();
    if (a->no_fp8_weight_transpose_cache && p.find_path("fp8")->as_string() == "none")
      throw ConfigError(fmt::format("{}: no_fp8_weight_transpose_cache: true has no effect with fp8: none (there are "
                                    "no FP8 weight copies)",
                                    where("no_fp8_weight_transpose_cache")));
    if (a->fp8_first_last_bf16_layers > 0 && p.find_path("fp8")->as_string() == "none")
      throw ConfigError(fmt::format("{}: fp8_first_last_bf16_layers {} has no effect with fp8: none (set fp8: e4m3 or "
                                    "hybrid)",
                                    where("fp8_first_last_bf16_layers"), a->fp8_first_last_bf16_layers));
    check_fixed_switches(p, kMegatronSwitches);
    a->turbo = check_turbo_keys(p, a->attention_backend);
    a->params = p;
    a->experiment_file = exp.file.string();
    // recompute_granularity, cuda_graph, gemm_algo_search and profile_steps take effect through their patches
    // (patches/step_patches.cpp); checked here so a bad value fails even with PRIMUS_PATCHES=none.
    (void)parse_recompute(p.find_path("recompute_granularity")->as_string(), where("recompute_granularity"));
    a->recompute_layers = recompute_layers([&](const std::string& k) { return p.find_path(k); });
    (void)profile_env_steps();
    a->profile_window = profile_window_args([&](const std::string& k) { return p.find_path(k); });
    (void)parse_cuda_graph(*p.find_path("cuda_graph"));
    // The delayed recipe's keys (read by patch cuda.linear.fp8): within the device update's limits,
    // and refused with another recipe, where they would do nothing.
    a->fp8_amax_history_len = p.find_path("fp8_amax_history_len")->as_int();
    a->fp8_amax_compute_algo = p.find_path("fp8_amax_compute_algo")->as_string();
    a->fp8_margin = p.find_path("fp8_margin")->as_int();
    if (a->fp8_amax_history_len > turbo::kFp8MaxAmaxHistory)
      throw ConfigError(fmt::format("{}: fp8_amax_history_len {} (at most {})", where("fp8_amax_history_len"),
                                    a->fp8_amax_history_len, turbo::kFp8MaxAmaxHistory));
    if (a->fp8_margin > turbo::kFp8MaxMargin)
      throw ConfigError(fmt::format("{}: fp8_margin {} (at most {})", where("fp8_margin"), a->fp8_margin,
                                    turbo::kFp8MaxMargin));
    if (const std::string r = p.find_path("fp8_recipe")->as_string(); r != "delayed") {
      const std::pair<const char*, bool> delayed_keys[] = {{"fp8_amax_history_len", a->fp8_amax_history_len != 1},
                                                           {"fp8_amax_compute_algo", a->fp8_amax_compute_algo != "most_recent"},
                                                           {"fp8_margin", a->fp8_margin != 0}};
      for (const auto& [key, set] : delayed_keys)
        if (set)
          throw ConfigError(
              fmt::format("{}: {} applies to fp8_recipe delayed only (the recipe is {})", where(key), key, r));
    }
    // fp8_recipe takes effect through patch cuda.linear.fp8; checked here so that a recipe without
    // FP8 (which would do nothing) fails by name.
    if (const std::string r = p.find_path("fp8_recipe")->as_string(); r != "tensorwise") {
      if (p.find_path("fp8")->as_string() == "none")
        throw ConfigError(fmt::format("{}: fp8_recipe {} has no effect with fp8: none (set fp8: e4m3 or hybrid)",
                                      where("fp8_recipe"), r));
      (void)turbo::parse_fp8_recipe(p.find_path("fp8")->as_string(), r, where("fp8"), "fp8_recipe");
    }
    // With fp8 an MoE model's experts run FP8 too (patch cuda.moe.fp8), through the FP8 grouped
    // GEMM only: checked here so that a dry run already refuses.
    if (const std::string f = p.find_path("fp8")->as_string(); f != "none" && p.find_path("num_experts")->as_int() > 0) {
      if (!p.find_path("moe_grouped_gemm")->as_bool())
        throw ConfigError(fmt::format("{}: moe_grouped_gemm: false with fp8: the FP8 experts run Turbo's grouped GEMM "
                                      "only; set moe_grouped_gemm: true, or fp8: none for one GEMM per expert",
                                      where("moe_grouped_gemm")));
    }
    if (a->attention_backend == "turbo" && std::string(default_attention_name()) != "turbo") {
      throw ConfigError(fmt::format("{}: attention_backend turbo: this build has no Turbo attention op (use auto or "
                                    "fallback)",
                                    where("attention_backend")));
    }
    return a;
  }

  std::unique_ptr<Trainer> create_trainer(const std::string& stage, std::shared_ptr<BackendArgs> args,
                                          const patches::HookTable& hooks) override {
    if (stage != "pretrain") return nullptr;
    return std::make_unique<CudaTrainer>(std::static_pointer_cast<CudaArgs>(args), CudaOps::from(hooks));
  }

 private:
  config::Schema schema_;
  DeviceInfo device_;
};

}  // namespace

void register_backend(BackendRegistry& backends, patches::PatchRegistry& patches) {
  backends.add(kName, [] { return std::make_unique<CudaAdapter>(); });
  register_patches(patches);
  register_cuda_projection();  // `primus projection` and the dry run's memory line
}

}  // namespace primus::backends::cuda
