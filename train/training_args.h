// The training keys every backend shares (TorchTitan-style: one struct per component, built
// from the validated config), and their schema.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/config/experiment.h"
#include "core/config/schema.h"
#include "parallel/parallel_dims.h"

namespace primus::train {

struct OptimizerArgs {
  double lr = 3e-4, min_lr = 0;
  int64_t warmup_iters = 0, decay_iters = 0;  // decay_iters: end of decay (default train_iters)
  std::string decay_style = "cosine";          // cosine | linear | constant | WSD
  // WSD (warmup-stable-decay): lr stays at `lr` until decay_iters - wsd_decay_iters, then falls
  // to min_lr over the last wsd_decay_iters steps with this shape (Megatron's names).
  int64_t wsd_decay_iters = 0;
  std::string wsd_decay_style = "exponential";  // linear | cosine | exponential | minus_sqrt
  // Which update rule: "adamw" everywhere, or "muon" for the transformer layers' 2-D weight
  // matrices (AdamW for the rest; train/muon_layout.h says which tensors).
  std::string optimizer = "adamw";
  double muon_momentum = 0.95;
  bool muon_nesterov = true;
  int64_t muon_ns_steps = 5;
  // The update's scale (Megatron's names): spectral sqrt(max(rows, cols)), shape_scaling
  // sqrt(max(1, rows / cols)) or unit_rms_norm sqrt(rows / cols), times the extra factor;
  // spectral x 0.2 matches AdamW's update RMS (Moonlight).
  std::string muon_scale_mode = "spectral";
  double muon_extra_scale_factor = 0.2;
  double muon_lr = -1;            // < 0: lr (Moonlight: one lr for both rules); see muon_lr_at
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip_grad = 1.0;                      // global norm; 0 turns clipping off
  // AdamW's moments held in bf16 (Megatron's exp_avg_dtype / exp_avg_sq_dtype: bf16, which need
  // use_precision_aware_optimizer): computed in fp32, stored rounded stochastically
  // (turbo/core/stochastic_round.h); Muon's tensors keep their own momentum.
  bool exp_avg_bf16 = false, exp_avg_sq_bf16 = false;
  // "exp_avg bf16, exp_avg_sq fp32" (the logs and the dry run).
  std::string moment_dtypes() const;
};

struct DataArgs {
  std::string tokenizer;  // gpt2 | bytes | path to tokenizer.json
  std::vector<std::string> data_path;  // Megatron style: [w1, prefix1, w2, prefix2] or [prefix]
  std::vector<std::string> valid_data_path;
  // Megatron-LM's test data, evaluated after the last step (empty: the split's test part, if any).
  std::vector<std::string> test_data_path;
  // train_data_path (Megatron-LM's): data_path holds it and trains whole (no split); validation only
  // from valid_data_path.
  bool train_whole = false;
  double split = 0.9;      // the training documents: the first `split` of each dataset's
  double valid_end = 1.0;  // validation: [split, valid_end); beyond it Megatron-LM's test part
  bool mock_data = false;
  // Document masking in packed samples (Megatron's names; train/document_masks.h): attention
  // and positions restart after each end-of-document token of the tokenizer.
  bool reset_attention_mask = false;
  bool reset_position_ids = false;
  // eod_mask_loss: no loss where the input is the end-of-document token (mask_eod_targets).
  bool eod_mask_loss = false;
};

struct CheckpointArgs {
  std::filesystem::path save;   // where checkpoints go
  std::filesystem::path load;   // where to resume from (empty: nowhere)
  bool auto_continue_train = false;
  // Megatron-LM's finetune: `load` gives the initial weights only (fresh optimizer, step 0).
  bool finetune = false;
  // Megatron-LM's no_load_rng / no_save_rng: the sampling RNG is not restored (the run's seed draws)
  // / not written (trainer_state.json holds none).
  bool no_load_rng = false, no_save_rng = false;
  // Megatron-LM's no_load_optim: a resumed run takes the weights, step and data position but starts
  // the optimizer state afresh (zero moments, AdamW's bias correction counting from that step).
  bool no_load_optim = false;
  // Megatron-LM's no_save_optim: checkpoints without the optimizer state (weights, step, data
  // positions and schedule only); resuming one needs no_load_optim.
  bool no_save_optim = false;
  int64_t save_interval = 0;    // 0: only at the end
  bool save_at_end = true;      // a checkpoint after the last step
  int64_t keep_last_k = 2;
};

struct TrainingArgs {
  int64_t train_iters = 0;
  int64_t micro_batch_size = 1, global_batch_size = 1;
  // The ranks that each read their own slice of a global batch (Megatron's data_parallel_size:
  // world / (tp x cp x pp)); under expert parallelism ep x the mesh's dp.
  int64_t data_parallel_size = 1;
  // The model-parallel sizes (tensor, context, expert, pipeline); parallel_sizes() adds dp.
  parallel::ParallelSizes model_parallel;
  // The mesh: dp is data_parallel_size / expert_model_parallel_size (ConfigError naming both keys
  // when it does not divide).
  parallel::ParallelSizes parallel_sizes() const;
  int64_t grad_accum_steps = 1;  // derived by the backend's args patch
  uint64_t seed = 1234;
  int64_t log_interval = 10, eval_interval = 0, eval_iters = 0;
  // The average tokens/s of the progress lines: the run's first steps left out, and the lines it
  // covers before starting afresh (Primus' log_avg_skip_iterations / log_avg_reset_interval).
  int64_t log_avg_skip_iterations = 2, log_avg_reset_interval = 10;
  std::string stderr_sink_level;  // the console's log level as configured (empty: unchanged)
  bool skip_nan_steps = false;
  bool exit_on_signal = true;    // SIGTERM / SIGUSR1: checkpoint, then exit 0
  int64_t exit_interval = 0;         // > 0: checkpoint and exit 0 after a step that is a multiple of it
  double exit_duration_mins = 0;     // > 0: checkpoint and exit 0 once training has run this long
  OptimizerArgs optim;
  DataArgs data;
  CheckpointArgs ckpt;
  std::filesystem::path output_dir;       // workspace/work_group/user_name/exp_name
  std::filesystem::path tensorboard_dir;  // empty: no TensorBoard events
  bool report_at_end = true;              // report.png beside metrics.jsonl after the last step
  std::string sample_prompt;              // generated from at the end (empty: none)
  int64_t sample_tokens = 0;
  double sample_temperature = 1.0;
  int64_t sample_top_k = 0;

  static TrainingArgs from_config(const config::Value& params, const config::Experiment& exp);
  std::vector<std::pair<std::string, std::string>> describe() const;
  // Throws ConfigError when batch sizes, accumulation and data parallelism disagree.
  void check_batch() const;
  // Throws ConfigError when there is neither a dataset nor mock data.
  void check_data() const;
};

void add_training_schema(config::Schema& s);

// spdlog's level (as an int) for a console log level name: loguru's (TRACE ... CRITICAL, any
// case; SUCCESS is INFO) or spdlog's warn / off. nullopt for any other name.
std::optional<int> console_log_level(const std::string& name);

}  // namespace primus::train
