// The trainer state every backend checkpoints beside the weights (trainer_state.json): step,
// data positions, the sampling RNG, and the config it ran with. One implementation, so a
// checkpoint of one backend resumes in another.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "core/config/value.h"
#include "data/dataset/data_config.h"

namespace primus::train {

struct TrainerStateInfo {
  std::string backend;
  std::string tokenizer;
  const config::Value* params = nullptr;  // the resolved config, saved for reference
  std::string experiment_file;
  // The training step at which the optimizer state began (no_load_optim started it afresh there;
  // 0 otherwise): AdamW's bias correction counts its own steps from it. Written when not 0.
  int64_t optimizer_step_base = 0;
  // false (Megatron-LM's no_save_optim): the checkpoint holds no optimizer state; the state says
  // "optimizer_state": false, and a resume needs no_load_optim (check_optimizer_state).
  bool optimizer_saved = true;
};

// save_rng false (Megatron-LM's no_save_rng): the state holds no RNG.
nlohmann::json make_trainer_state(int64_t step, const TrainerStateInfo& info, const data::DataIterators& data,
                                  const std::mt19937_64& rng, bool save_rng = true);

// Restores data positions and, with load_rng, the RNG; returns the step. Throws FormatError naming
// `dir` when the state is incomplete, and ConfigError when load_rng asks for an RNG the checkpoint
// was saved without (no_save_rng; Megatron-LM's no_load_rng: true reads past it).
int64_t restore_trainer_state(const nlohmann::json& state, const std::filesystem::path& dir,
                              data::DataIterators& data, std::mt19937_64& rng, bool load_rng = true);

// The checkpoint's TrainerStateInfo::optimizer_step_base (0 when it has none).
int64_t optimizer_step_base(const nlohmann::json& state);

// ConfigError naming `dir` when the checkpoint was saved without its optimizer state
// (no_save_optim) and the resume would read it (no_load_optim false).
void check_optimizer_state(const nlohmann::json& state, const std::filesystem::path& dir, bool no_load_optim);

// The optimizer states a checkpoint drops under no_save_optim (AdamW's moments, Muon's momentum);
// what else it holds beside them (the FP8 delayed-scaling history) stays.
inline const char* const kOptimizerStateNames[] = {"exp_avg", "exp_avg_sq", "muon_momentum"};

}  // namespace primus::train
