#include "train/training_args.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <tuple>

#include "core/util/error.h"
#include "data/tokenizer/tokenizer.h"

namespace primus::train {

using config::KeyType;

void add_training_schema(config::Schema& s) {
  s.integer("train_iters", 1000, "optimizer steps to run", 0)
      .integer("micro_batch_size", 8, "samples per forward/backward pass (per data-parallel rank)", 1)
      .integer("global_batch_size", 8, "samples per optimizer step across all ranks", 1)
      .number("lr", 3e-4, "peak learning rate", 0.0)
      .number("min_lr", 0.0, "learning rate at the end of decay", 0.0)
      .integer("lr_warmup_iters", 0, "linear warmup steps", 0)
      .number("lr_warmup_fraction", std::nullopt,
              "Megatron-LM's warmup as a fraction of lr_decay_iters (rounded down to steps), in place of the module "
              "config's lr_warmup_iters; refused beside a non-zero lr_warmup_iters of the experiment or command line",
              0.0, 1.0)
      .integer("lr_decay_iters", std::nullopt, "step where decay ends (default: train_iters)", 1)
      .text("lr_decay_style", "cosine", "cosine, linear, constant or WSD (warmup-stable-decay)",
            {"cosine", "linear", "constant", "WSD"})
      .integer("lr_wsd_decay_iters", std::nullopt, "WSD: length of the final decay, ending at lr_decay_iters", 1)
      .text("lr_wsd_decay_style", "exponential", "WSD: shape of the final decay",
            {"linear", "cosine", "exponential", "minus_sqrt"})
      .text("optimizer", "adamw", "adamw, or muon (Newton-Schulz orthogonalised momentum for the layers' "
            "weight matrices, AdamW for the rest)", {"adamw", "muon"})
      .number("muon_momentum", 0.95, "Muon momentum coefficient", 0.0, 1.0)
      .flag("muon_nesterov", true, "Muon: orthogonalise g + momentum * m (Nesterov) instead of m")
      .integer("muon_ns_steps", 5, "Muon: quintic Newton-Schulz iterations", 1)
      .text("muon_scale_mode", "spectral", "Muon's update scale: spectral sqrt(max(rows, cols)), shape_scaling "
            "sqrt(max(1, rows/cols)) or unit_rms_norm sqrt(rows/cols), times muon_extra_scale_factor",
            {"spectral", "shape_scaling", "unit_rms_norm"})
      .number("muon_extra_scale_factor", 0.2, "Muon: factor on the update scale (0.2 with spectral: AdamW's update "
              "RMS, Moonlight)", 0.0)
      .number("muon_lr", std::nullopt, "Muon's peak learning rate (default: lr; the schedule's shape applies)", 0.0)
      .number("weight_decay", 0.1, "decoupled weight decay (not on norms and biases)", 0.0)
      .number("adam_beta1", 0.9, "Adam beta1", 0.0, 1.0)
      .number("adam_beta2", 0.95, "Adam beta2", 0.0, 1.0)
      .number("adam_eps", 1e-8, "Adam epsilon", 0.0)
      .number("clip_grad", 1.0, "global gradient-norm clip (0: off)", 0.0)
      .flag("use_precision_aware_optimizer", false,
            "Megatron's switch for the optimizer state dtypes below (exp_avg_dtype, exp_avg_sq_dtype); with fp32 "
            "moments it changes nothing")
      .text("exp_avg_dtype", "fp32",
            "dtype AdamW keeps its first moment in: fp32, or bf16 (computed in fp32 and stored rounded "
            "stochastically, so small updates are kept on average; 2 bytes a parameter less memory, 4 less optimizer "
            "traffic); needs use_precision_aware_optimizer: true. fp16 and fp8 (Transformer Engine's scaled moments) "
            "are not implemented",
            {"fp32", "bf16", "fp16", "fp8"})
      .text("exp_avg_sq_dtype", "fp32", "dtype AdamW keeps its second moment in, as exp_avg_dtype",
            {"fp32", "bf16", "fp16", "fp8"})
      .integer("seed", 1234, "seed of init, data order and sampling", 0)
      .integer("log_interval", 10, "steps between progress lines", 1)
      .integer("log_avg_skip_iterations", 2,
               "Primus' name: the first steps of a run (warm-up, graph capture) left out of the average tokens/s "
               "each progress line shows beside its own",
               0)
      .integer("log_avg_reset_interval", 10,
               "Primus' name: the progress lines that average covers before it starts afresh", 1)
      .text("stderr_sink_level", std::nullopt,
            "Primus' name: the console's log level, TRACE, DEBUG, INFO, SUCCESS (as INFO), WARNING, ERROR or "
            "CRITICAL (any case; spdlog's warn and off too); PRIMUS_LOG_LEVEL, when set, wins")
      .integer("eval_interval", 100, "steps between validation runs (0: never)", 0)
      .integer("eval_iters", 10, "batches per validation run", 0)
      .integer("save_interval", 0, "steps between checkpoints (0: only at the end)", 0)
      .integer("keep_last_k", 2, "checkpoints to keep", 1)
      .flag("save_at_end", true, "checkpoint after the last step (false: only every save_interval steps and on a stop signal)")
      .alias("disable_last_saving", "save_at_end", config::Value::boolean(false), config::Value::boolean(true),
             "Primus' name (its Megatron-LM trainer): true is save_at_end: false")
      .text("save", std::nullopt, "checkpoint folder (default: <output>/checkpoints)")
      .text("load", std::nullopt, "checkpoint folder to resume from")
      .flag("auto_continue_train", false, "resume from the latest checkpoint in `save` when there is one")
      .flag("finetune", false,
            "Megatron-LM's finetune: start from the weights of the checkpoint in `load` (a training run's or "
            "`primus import hf`'s) with a fresh optimizer at step 0, the data from its start; nothing else of it is "
            "read. A checkpoint in `save` is still resumed first under auto_continue_train")
      .flag("no_load_optim", false,
            "Megatron-LM's switch: true resumes the weights, step, data position and learning-rate schedule but not "
            "the optimizer state, which starts afresh (zero moments; AdamW's bias correction counts from the resumed "
            "step)")
      .flag("no_load_rng", false,
            "Megatron-LM's switch: true resumes without the checkpoint's RNG state (the sampling RNG after training "
            "is drawn from the run's seed; the data order is the seed's and the step's either way)")
      .flag("no_save_optim", false,
            "Megatron-LM's switch: true writes checkpoints without the optimizer state (AdamW's moments, Muon's "
            "momentum); resuming one needs no_load_optim: true")
      .flag("no_save_rng", false,
            "Megatron-LM's switch: true writes checkpoints without the RNG state (resuming one needs no_load_rng: "
            "true)")
      .text("tokenizer_type", "gpt2",
            "gpt2, bytes, or a path to a Hugging Face tokenizer.json; Megatron-LM's HuggingFaceTokenizer (with "
            "tokenizer_model) and GPT2BPETokenizer (gpt2) too")
      .text("tokenizer_model", std::nullopt,
            "Megatron-LM's model of tokenizer_type HuggingFaceTokenizer: a folder holding tokenizer.json (or the "
            "file), or a Hub id (org/name) found offline in the Hugging Face cache")
      .any("data_path", KeyType::List, "Megatron-style [weight, prefix, ...] or [prefix] (.bin/.idx); a .txt file is prepared on first use")
      .any("valid_data_path", KeyType::List, "validation datasets (default: split off data_path)")
      .any("test_data_path", KeyType::List,
           "Megatron-LM's test datasets (.bin/.idx prefixes, [weight, prefix, ...] or [prefix]), evaluated once "
           "after the last step (eval_iters batches; default: the test part of a three-part split, if any)")
      .any("train_data_path", KeyType::List,
           "Megatron-LM's separate training datasets (.bin/.idx prefixes, [weight, prefix, ...] or [prefix]) instead "
           "of data_path: every document trains (split does not apply), validation only from valid_data_path")
      .any("split", KeyType::Any,
           "when valid_data_path is unset: the fraction of each dataset's documents that trains (the rest "
           "validates), or Megatron-LM's weights 'train,valid,test' (e.g. 969,30,1 or 99/1/0: normalised, the "
           "test part held out)",
           config::Value::floating(0.9))
      .flag("mock_data", false, "synthetic tokens instead of a dataset")
      .flag("reset_attention_mask", false,
            "packed samples: a token attends only within its document (documents end at the tokenizer's "
            "end-of-document token)")
      .flag("reset_position_ids", false, "packed samples: positions restart at 0 after each end-of-document token")
      .flag("eod_mask_loss", false,
            "no loss where the input is the end-of-document token (the next document's first token); the mean "
            "is over the tokens that keep a loss")
      .flag("skip_nan_steps", false, "skip a step whose loss or gradients are not finite instead of stopping")
      .flag("exit_signal_handler", true, "on SIGTERM/SIGUSR1 finish the step, checkpoint and exit 0")
      .integer("exit_interval", std::nullopt,
               "Megatron-LM's: after a step that is a multiple of this, checkpoint and exit 0 (as a stop signal "
               "does; resume with auto_continue_train)",
               1)
      .number("exit_duration_in_mins", std::nullopt,
              "Megatron-LM's: after the first step to end this many minutes after training started (on any rank), "
              "checkpoint and exit 0, so a job within a time limit leaves a checkpoint to resume from",
              0.0)
      .flag("check_for_nan_in_loss_and_grad", true,
            "Megatron-LM's switch, accepted as true: every step checks its loss and gradient norm and stops (or "
            "skips, skip_nan_steps) when one is not finite; false is refused (the check is always on)")
      .flag("manual_gc", false,
            "Megatron-LM's switch for Python's garbage collector: accepted either way, there is no garbage collector "
            "here to pause a step")
      .integer("manual_gc_interval", 0, "Megatron-LM's garbage-collection interval: accepted, no collector here", 0)
      .flag("manual_gc_eval", false, "Megatron-LM's garbage collection at evaluations: accepted, no collector here")
      .text("tensorboard_dir", std::nullopt, "TensorBoard event folder (default: derived from the workspace)")
      .flag("disable_tensorboard", false,
            "Primus' switch: true writes no TensorBoard events (metrics.jsonl still has every scalar)")
      .flag("disable_wandb", true,
            "Primus' switch, true only (its default): Weights & Biases logging is not built in (false is refused)")
      .text("wandb_project", std::nullopt, "Primus' / Megatron-LM's W&B project: unused while disable_wandb is true")
      .text("wandb_exp_name", std::nullopt, "Megatron-LM's W&B run name: unused while disable_wandb is true")
      .text("wandb_save_dir", std::nullopt, "Megatron-LM's W&B folder: unused while disable_wandb is true")
      .text("wandb_entity", std::nullopt, "Megatron-LM's W&B entity: unused while disable_wandb is true")
      .text("ckpt_format", std::nullopt,
            "Megatron-LM's checkpoint format: refused when set (Primus writes and reads its own format, "
            "docs/checkpoints.md)")
      .flag("report_at_end", true, "after the last step, draw report.png (charts of metrics.jsonl) beside metrics.jsonl")
      .text("sample_prompt", std::nullopt, "after training, generate from this prompt")
      .integer("sample_tokens", 200, "tokens to generate for the sample", 0)
      .number("sample_temperature", 0.8, "sampling temperature", 0.0)
      .integer("sample_top_k", 0, "top-k sampling (0: off)", 0)
      .integer("data_parallel_size", 1, "data-parallel ranks (set by the launcher)", 1);
  parallel::add_parallel_schema(s);
}

namespace {
std::vector<std::string> strings_of(const config::Value* v) {
  std::vector<std::string> out;
  if (!v || v->is_null()) return out;
  if (!v->is_list()) return {v->scalar_text()};
  for (auto& it : v->items()) out.push_back(it.scalar_text());
  return out;
}
// Relative data paths are looked up in the working folder first, then beside the experiment
// file (so an example runs from any folder). Weights in a blend list stay as they are.
std::vector<std::string> resolve_data_paths(std::vector<std::string> paths, const std::filesystem::path& exp_file) {
  for (auto& p : paths) {
    std::filesystem::path path(p);
    // Absolute paths, and blend weights such as "0.7" or ".3", are not relative data paths.
    if (p.empty() || path.is_absolute()) continue;
    const bool weight = std::isdigit(static_cast<unsigned char>(p[0])) ||
                        (p[0] == '.' && p.size() > 1 && std::isdigit(static_cast<unsigned char>(p[1])));
    if (weight) continue;
    auto exists = [](const std::filesystem::path& x) {
      std::error_code ec;  // non-throwing: an unusable name is simply not there
      return std::filesystem::exists(x, ec) || std::filesystem::exists(x.string() + ".idx", ec);
    };
    if (exists(path)) continue;
    auto beside = exp_file.parent_path() / path;
    if (exists(beside)) p = beside.lexically_normal().string();
  }
  return paths;
}

// `split`: a training fraction in (0, 1] (validation the rest), or Megatron-LM's weights
// "train,valid,test" ("/" also separates; missing parts are 0), normalised. Returns the training
// fraction and the end of the validation one.
std::pair<double, double> parse_split(const config::Value& v) {
  const std::string where = v.origin().str();
  if (v.kind() == config::Value::Kind::Int || v.kind() == config::Value::Kind::Float) {
    const double f = v.as_double();
    if (!(f > 0.0 && f <= 1.0)) throw ConfigError(fmt::format("{}: split {} must lie in (0, 1]", where, v.scalar_text()));
    return {f, 1.0};
  }
  // Megatron-LM reads the numbers between any separators; here ',' '/' or blanks, each part a number.
  std::string text = v.kind() == config::Value::Kind::String ? v.as_string() : "";
  for (char& c : text)
    if (c == ',' || c == '/' || c == '\t') c = ' ';
  std::istringstream parts(text);
  std::vector<double> w;
  bool bad = false;
  for (std::string part; parts >> part && !bad;) {
    char* stop = nullptr;
    const double x = std::strtod(part.c_str(), &stop);
    bad = stop != part.c_str() + part.size() || !(x >= 0.0) || !std::isfinite(x);
    w.push_back(x);
  }
  // One part would be Megatron-LM's "all documents train": refused, as a quoted fraction ('0.9')
  // would otherwise silently drop the validation data.
  if (bad || w.size() < 2 || w.size() > 3 || w[0] <= 0.0) {
    throw ConfigError(fmt::format("{}: split '{}': expected a training fraction in (0, 1] (a number) or Megatron-LM's "
                                  "weights 'train,valid,test' (two or three parts, e.g. 969,30,1), the training one "
                                  "above 0",
                                  where, v.scalar_text()));
  }
  w.resize(3, 0.0);
  const double total = w[0] + w[1] + w[2];
  return {w[0] / total, (w[0] + w[1]) / total};
}

std::string text_or(const config::Value& p, const char* k, const std::string& def) {
  const config::Value* v = p.find_path(k);
  return v && !v->is_null() ? v->scalar_text() : def;
}
}  // namespace

std::optional<int> console_log_level(const std::string& name) {
  std::string n;
  for (char ch : name) n += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  // loguru's names (Primus' logger), then spdlog's own where they differ.
  static const std::pair<const char*, spdlog::level::level_enum> kNames[] = {
      {"trace", spdlog::level::trace}, {"debug", spdlog::level::debug},     {"info", spdlog::level::info},
      {"success", spdlog::level::info}, {"warning", spdlog::level::warn},   {"warn", spdlog::level::warn},
      {"error", spdlog::level::err},    {"critical", spdlog::level::critical}, {"off", spdlog::level::off}};
  for (auto& [k, level] : kNames)
    if (n == k) return static_cast<int>(level);
  return std::nullopt;
}

TrainingArgs TrainingArgs::from_config(const config::Value& p, const config::Experiment& exp) {
  auto i = [&](const char* k) { return p.find_path(k)->as_int(); };
  auto d = [&](const char* k) { return p.find_path(k)->as_double(); };
  auto b = [&](const char* k) { return p.find_path(k)->as_bool(); };
  TrainingArgs a;
  a.train_iters = i("train_iters");
  a.micro_batch_size = i("micro_batch_size");
  a.global_batch_size = i("global_batch_size");
  a.data_parallel_size = i("data_parallel_size");
  a.model_parallel = parallel::ParallelSizes::from_config(p);
  if (const config::Value* sp = p.find_path("sequence_parallel");
      sp && !sp->is_null() && sp->as_bool() && !a.model_parallel.sequence_parallel)
    spdlog::warn("{}: sequence_parallel: true has no effect with tensor_model_parallel_size 1 and is turned off, as "
                 "Megatron-LM does",
                 sp->origin().str());
  // A layout the model cannot take, then one not implemented yet: clear errors before anything
  // starts (the dry run prints the mesh first, cli/cmd_train.cpp).
  if (const config::Value* h = p.find_path("num_attention_heads"); h && !h->is_null()) {
    const config::Value* g = p.find_path("num_query_groups");
    const config::Value* sl = p.find_path("seq_length");
    a.model_parallel.check_model(h->as_int(), g && !g->is_null() ? g->as_int() : h->as_int(),
                                 sl && !sl->is_null() ? sl->as_int() : 0);
  }
  a.model_parallel.check_implemented(parallel::kAnyBackendMesh);
  a.seed = static_cast<uint64_t>(i("seed"));
  a.log_interval = i("log_interval");
  a.log_avg_skip_iterations = i("log_avg_skip_iterations");
  a.log_avg_reset_interval = i("log_avg_reset_interval");
  if (const config::Value* v = p.find_path("stderr_sink_level"); v && !v->is_null()) {
    a.stderr_sink_level = v->scalar_text();
    if (!console_log_level(a.stderr_sink_level)) {
      throw ConfigError(fmt::format("{}: stderr_sink_level '{}' is not one of TRACE, DEBUG, INFO, SUCCESS, WARNING, "
                                    "ERROR, CRITICAL (any case), warn or off",
                                    v->origin().str(), a.stderr_sink_level));
    }
  }
  a.eval_interval = i("eval_interval");
  a.eval_iters = i("eval_iters");
  a.skip_nan_steps = b("skip_nan_steps");
  a.exit_on_signal = b("exit_signal_handler");
  if (const config::Value* v = p.find_path("exit_interval"); v && !v->is_null()) a.exit_interval = v->as_int();
  if (const config::Value* v = p.find_path("exit_duration_in_mins"); v && !v->is_null()) {
    a.exit_duration_mins = v->as_double();
    if (a.exit_duration_mins <= 0)
      throw ConfigError(fmt::format("{}: exit_duration_in_mins must be positive (unset: no limit)", v->origin().str()));
  }
  if (const config::Value* v = p.find_path("check_for_nan_in_loss_and_grad"); v && !v->is_null() && !v->as_bool())
    throw ConfigError(fmt::format("{}: check_for_nan_in_loss_and_grad: false is not implemented (every step checks its "
                                  "loss and gradient norm; skip_nan_steps: true skips a non-finite step instead of "
                                  "stopping); remove the key",
                                  v->origin().str()));
  a.optim.lr = d("lr");
  a.optim.min_lr = d("min_lr");
  a.optim.warmup_iters = i("lr_warmup_iters");
  const config::Value* di = p.find_path("lr_decay_iters");
  a.optim.decay_iters = di && !di->is_null() ? di->as_int() : a.train_iters;
  if (const config::Value* wf = p.find_path("lr_warmup_fraction"); wf && !wf->is_null()) {
    // The fraction replaces the module config's default warmup; beside a warmup the experiment or
    // the command line sets, the two contradict (Megatron-LM refuses both as well).
    const config::Value& wi = *p.find_path("lr_warmup_iters");
    const std::string from = wi.origin().file;
    if (a.optim.warmup_iters != 0 && (from == exp.file.string() || from.rfind("<command line", 0) == 0))
      throw ConfigError(fmt::format("{}: lr_warmup_fraction and {} lr_warmup_iters {}: set one of them",
                                    wf->origin().str(), wi.origin().str(), a.optim.warmup_iters));
    a.optim.warmup_iters = static_cast<int64_t>(wf->as_double() * static_cast<double>(a.optim.decay_iters));
  }
  a.optim.decay_style = p.find_path("lr_decay_style")->as_string();
  a.optim.wsd_decay_style = p.find_path("lr_wsd_decay_style")->as_string();
  const config::Value* wi = p.find_path("lr_wsd_decay_iters");
  if (a.optim.decay_style == "WSD") {
    if (!wi || wi->is_null()) {
      throw ConfigError(fmt::format("{}: lr_decay_style WSD needs lr_wsd_decay_iters (the length of the final decay)",
                                    p.find_path("lr_decay_style")->origin().str()));
    }
    a.optim.wsd_decay_iters = wi->as_int();
    if (a.optim.wsd_decay_iters > a.optim.decay_iters - a.optim.warmup_iters) {
      throw ConfigError(fmt::format("{}: lr_wsd_decay_iters {} is longer than the schedule after warmup "
                                    "(lr_decay_iters {} - lr_warmup_iters {})",
                                    wi->origin().str(), a.optim.wsd_decay_iters, a.optim.decay_iters,
                                    a.optim.warmup_iters));
    }
  }
  a.optim.optimizer = p.find_path("optimizer")->as_string();
  a.optim.muon_momentum = d("muon_momentum");
  a.optim.muon_nesterov = b("muon_nesterov");
  a.optim.muon_ns_steps = i("muon_ns_steps");
  a.optim.muon_scale_mode = p.find_path("muon_scale_mode")->as_string();
  a.optim.muon_extra_scale_factor = d("muon_extra_scale_factor");
  const config::Value* ml = p.find_path("muon_lr");
  a.optim.muon_lr = ml && !ml->is_null() ? ml->as_double() : -1.0;
  a.optim.weight_decay = d("weight_decay");
  a.optim.beta1 = d("adam_beta1");
  a.optim.beta2 = d("adam_beta2");
  a.optim.eps = d("adam_eps");
  a.optim.clip_grad = d("clip_grad");
  for (auto [key, out] : {std::pair{"exp_avg_dtype", &a.optim.exp_avg_bf16}, {"exp_avg_sq_dtype", &a.optim.exp_avg_sq_bf16}}) {
    const config::Value* v = p.find_path(key);
    const std::string dt = v->as_string();
    if (dt == "fp16" || dt == "fp8") {
      throw ConfigError(fmt::format("{}: {}: {} is not implemented: its range needs the per-tensor scaling of "
                                    "Transformer Engine's precision-aware optimizer, which Primus does not have; use "
                                    "bf16 (the same 2 bytes, stochastically rounded) or fp32",
                                    v->origin().str(), key, dt));
    }
    *out = dt == "bf16";
    if (*out && !b("use_precision_aware_optimizer")) {
      throw ConfigError(fmt::format("{}: {}: bf16 needs use_precision_aware_optimizer: true (as in Megatron-LM)",
                                    v->origin().str(), key));
    }
  }
  a.data.tokenizer = text_or(p, "tokenizer_type", "gpt2");
  {
    // Megatron-LM's names: HuggingFaceTokenizer reads tokenizer_model; GPT2BPETokenizer is GPT-2's
    // BPE, built in here (Megatron-LM reads it from vocab_file / merge_file).
    const config::Value* tm = p.find_path("tokenizer_model");
    const bool has_model = tm && !tm->is_null();
    const std::string where = p.find_path("tokenizer_type")->origin().str();
    if (a.data.tokenizer == "HuggingFaceTokenizer") {
      if (!has_model) {
        throw ConfigError(fmt::format("{}: tokenizer_type HuggingFaceTokenizer needs tokenizer_model (a folder holding "
                                      "tokenizer.json, or a Hub id in the Hugging Face cache)",
                                      where));
      }
      try {
        a.data.tokenizer = data::resolve_hf_tokenizer_model(tm->scalar_text()).string();
      } catch (const ConfigError& e) {
        throw ConfigError(fmt::format("{}: {}", tm->origin().str(), e.what()));
      }
    } else if (has_model) {
      throw ConfigError(fmt::format("{}: tokenizer_model is read with tokenizer_type HuggingFaceTokenizer only, not "
                                    "'{}' ({})",
                                    tm->origin().str(), a.data.tokenizer, where));
    } else if (a.data.tokenizer == "GPT2BPETokenizer") {
      a.data.tokenizer = "gpt2";
    }
  }
  a.data.data_path = resolve_data_paths(strings_of(p.find_path("data_path")), exp.file);
  a.data.valid_data_path = resolve_data_paths(strings_of(p.find_path("valid_data_path")), exp.file);
  a.data.test_data_path = resolve_data_paths(strings_of(p.find_path("test_data_path")), exp.file);
  if (auto train = resolve_data_paths(strings_of(p.find_path("train_data_path")), exp.file); !train.empty()) {
    const std::string where = p.find_path("train_data_path")->origin().str();
    if (!a.data.data_path.empty()) {
      throw ConfigError(fmt::format("{}: train_data_path and data_path ({}) are exclusive, as in Megatron-LM: give one "
                                    "of them",
                                    where, p.find_path("data_path")->origin().str()));
    }
    a.data.data_path = std::move(train);
    a.data.train_whole = true;
  }
  std::tie(a.data.split, a.data.valid_end) = parse_split(*p.find_path("split"));
  a.data.reset_attention_mask = b("reset_attention_mask");
  a.data.reset_position_ids = b("reset_position_ids");
  a.data.eod_mask_loss = b("eod_mask_loss");
  // mock_data is switched on by the backend's args patch (train/common_patches.cpp).
  a.output_dir = exp.output_dir();
  a.ckpt.save = text_or(p, "save", (a.output_dir / "checkpoints").string());
  a.ckpt.load = text_or(p, "load", "");
  a.ckpt.auto_continue_train = b("auto_continue_train");
  a.ckpt.finetune = b("finetune");
  if (a.ckpt.finetune && a.ckpt.load.empty()) {
    throw ConfigError(fmt::format("{}: finetune: true needs load, the checkpoint whose weights the run starts from",
                                  p.find_path("finetune")->origin().str()));
  }
  if (a.ckpt.finetune) {
    // The run's own checkpoints beside the ones it starts from would be pruned with them, and
    // auto_continue_train would resume the source run whole instead of finetuning from it.
    std::error_code ec;
    const auto canon = [&ec](const std::filesystem::path& x) { return std::filesystem::weakly_canonical(x, ec); };
    const std::filesystem::path save = canon(a.ckpt.save), load = canon(a.ckpt.load);
    if (!ec && (load == save || load.parent_path() == save)) {
      throw ConfigError(fmt::format("{}: finetune: true saves into {}, where load ({}) is: give the finetuning run a "
                                    "save folder of its own",
                                    p.find_path("finetune")->origin().str(), a.ckpt.save.string(),
                                    a.ckpt.load.string()));
    }
  }
  a.ckpt.no_load_rng = b("no_load_rng");
  a.ckpt.no_save_rng = b("no_save_rng");
  a.ckpt.no_load_optim = b("no_load_optim");
  a.ckpt.no_save_optim = b("no_save_optim");
  a.ckpt.save_interval = i("save_interval");
  a.ckpt.keep_last_k = i("keep_last_k");
  a.ckpt.save_at_end = b("save_at_end");
  a.tensorboard_dir = text_or(p, "tensorboard_dir", "");
  if (b("disable_tensorboard") && !a.tensorboard_dir.empty()) {
    throw ConfigError(fmt::format("{}: disable_tensorboard is true but tensorboard_dir is set ({}): set one of them",
                                  p.find_path("disable_tensorboard")->origin().str(),
                                  p.find_path("tensorboard_dir")->origin().str()));
  }
  // Without a sharded optimizer no rank gathers weights, so there is nothing to overlap: true is
  // Primus' example default and holds trivially. With one, the gather is not overlapped yet.
  if (const config::Value* o = p.find_path("overlap_param_gather"); o && !o->is_null() && o->as_bool()) {
    if (const parallel::DpSharding s = parallel::dp_sharding_from_config(p); parallel::shards_optimizer(s)) {
      throw ConfigError(fmt::format("{}: overlap_param_gather: true with a sharded optimizer ({}) is not implemented: "
                                    "the updated weights are all-gathered after the update, before the next forward "
                                    "(the gradients' reduction does overlap the backward: overlap_grad_reduce)",
                                    o->origin().str(), parallel::dp_sharding_name(s)));
    }
  }
  if (!b("disable_wandb")) {
    throw ConfigError(fmt::format("{}: disable_wandb: false: Weights & Biases logging is not built in; every scalar "
                                  "goes to metrics.jsonl and TensorBoard (tensorboard_dir), which `primus report` "
                                  "charts",
                                  p.find_path("disable_wandb")->origin().str()));
  }
  if (const config::Value* f = p.find_path("ckpt_format"); f && !f->is_null()) {
    throw ConfigError(fmt::format("{}: ckpt_format: {}: Primus writes its own checkpoints (safetensors with a "
                                  "manifest, any layout resumes any other; docs/checkpoints.md) and reads no "
                                  "Megatron-LM format: remove the key (primus export hf / import hf convert to "
                                  "and from Hugging Face)",
                                  f->origin().str(), f->scalar_text()));
  }
  a.report_at_end = b("report_at_end");
  a.sample_prompt = text_or(p, "sample_prompt", "");
  a.sample_tokens = i("sample_tokens");
  a.sample_temperature = d("sample_temperature");
  a.sample_top_k = i("sample_top_k");
  if (a.optim.min_lr > a.optim.lr) {
    throw ConfigError(fmt::format("{}: min_lr {} is larger than lr {}", p.find_path("min_lr")->origin().str(),
                                  a.optim.min_lr, a.optim.lr));
  }
  return a;
}

void TrainingArgs::check_data() const {
  if (!data.mock_data && data.data_path.empty()) {
    throw ConfigError("no training data: set `data_path` (a Megatron .bin/.idx prefix or a .txt file) "
                      "or `mock_data: true`");
  }
}

parallel::ParallelSizes TrainingArgs::parallel_sizes() const {
  parallel::ParallelSizes s = model_parallel;
  const int64_t ep = s[parallel::Dim::EP];
  if (ep < 1 || data_parallel_size % ep != 0) {
    throw ConfigError(fmt::format("expert_model_parallel_size {} must divide data_parallel_size {} (the experts' ranks "
                                  "are carved from the data-parallel ones)",
                                  ep, data_parallel_size));
  }
  s[parallel::Dim::DP] = data_parallel_size / ep;
  return s;
}

void TrainingArgs::check_batch() const {
  if (micro_batch_size * grad_accum_steps * data_parallel_size != global_batch_size) {
    throw ConfigError(fmt::format(
        "global_batch_size {} != micro_batch_size {} x gradient accumulation {} x data-parallel size {} "
        "(global_batch_size must be a multiple of micro_batch_size x data_parallel_size; the args patch "
        "derives the accumulation)",
        global_batch_size, micro_batch_size, grad_accum_steps, data_parallel_size));
  }
}

std::string OptimizerArgs::moment_dtypes() const {
  return fmt::format("exp_avg {}, exp_avg_sq {}", exp_avg_bf16 ? "bf16" : "fp32", exp_avg_sq_bf16 ? "bf16" : "fp32");
}

std::vector<std::pair<std::string, std::string>> TrainingArgs::describe() const {
  std::vector<std::pair<std::string, std::string>> d = {{"train_iters", std::to_string(train_iters)},
          {"micro_batch_size", std::to_string(micro_batch_size)},
          {"global_batch_size", std::to_string(global_batch_size)},
          {"grad_accum_steps", std::to_string(grad_accum_steps)},
          {"data_parallel_size", std::to_string(data_parallel_size)},
          {"lr", fmt::format("{} -> {} ({}, warmup {})", optim.lr, optim.min_lr, optim.decay_style, optim.warmup_iters)},
          {"data", data.mock_data ? std::string("mock") : fmt::format("{}", fmt::join(data.data_path, " "))},
          {"tokenizer", data.tokenizer},
          {"save", ckpt.save.string()},
          {"tensorboard_dir", tensorboard_dir.empty() ? "(none)" : tensorboard_dir.string()}};
  if (data.reset_attention_mask || data.reset_position_ids || data.eod_mask_loss) {  // after "tokenizer": its eod
    d.insert(d.begin() + 8, {"document masks", fmt::format("reset_attention_mask {}, reset_position_ids {}, eod_mask_loss {}",
                                                           data.reset_attention_mask, data.reset_position_ids,
                                                           data.eod_mask_loss)});
  }
  if (optim.exp_avg_bf16 || optim.exp_avg_sq_bf16) {  // after "lr": the optimizer's state
    d.insert(d.begin() + 6, {"adamw moments", optim.moment_dtypes() + " (bf16 stochastically rounded)"});
  }
  return d;
}

}  // namespace primus::train
