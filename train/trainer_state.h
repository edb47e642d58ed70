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
};

nlohmann::json make_trainer_state(int64_t step, const TrainerStateInfo& info, const data::DataIterators& data,
                                  const std::mt19937_64& rng);

// Restores data positions and the RNG; returns the step. Throws FormatError naming `dir` when
// the state is incomplete.
int64_t restore_trainer_state(const nlohmann::json& state, const std::filesystem::path& dir,
                              data::DataIterators& data, std::mt19937_64& rng);

}  // namespace primus::train
