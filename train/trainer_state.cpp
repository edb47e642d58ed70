#include "train/trainer_state.h"

#include <fmt/format.h>

#include <sstream>

#include "core/util/error.h"

namespace primus::train {

nlohmann::json make_trainer_state(int64_t step, const TrainerStateInfo& info, const data::DataIterators& data,
                                  const std::mt19937_64& rng, bool save_rng) {
  nlohmann::json s = {{"step", step},
                      {"backend", info.backend},
                      {"tokenizer", info.tokenizer},
                      {"data_train", data.train->state()},
                      {"config", info.params ? info.params->to_json() : nlohmann::json()},
                      {"experiment", info.experiment_file}};
  if (info.optimizer_step_base != 0) s["optimizer_step_base"] = info.optimizer_step_base;
  if (!info.optimizer_saved) s["optimizer_state"] = false;
  if (save_rng) {
    std::ostringstream r;
    r << rng;
    s["rng"] = r.str();
  }
  if (data.valid) s["data_valid"] = data.valid->state();
  return s;
}

int64_t restore_trainer_state(const nlohmann::json& s, const std::filesystem::path& dir, data::DataIterators& data,
                              std::mt19937_64& rng, bool load_rng) {
  if (load_rng && s.is_object() && !s.contains("rng")) {
    throw ConfigError(fmt::format("checkpoint {} holds no RNG state (saved with no_save_rng: true): resume it with "
                                  "no_load_rng: true (the run's own seed then draws the samples)",
                                  dir.string()));
  }
  try {
    int64_t step = s.at("step").get<int64_t>();
    data.train->load_state(s.at("data_train"));
    if (data.valid && s.contains("data_valid")) data.valid->load_state(s.at("data_valid"));
    if (load_rng) {
      std::istringstream r(s.at("rng").get<std::string>());
      r >> rng;
    }
    return step;
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("checkpoint {}: trainer_state.json is incomplete: {}", dir.string(), e.what()));
  }
}

int64_t optimizer_step_base(const nlohmann::json& state) {
  return state.is_object() ? state.value("optimizer_step_base", int64_t{0}) : 0;
}

void check_optimizer_state(const nlohmann::json& state, const std::filesystem::path& dir, bool no_load_optim) {
  if (no_load_optim || !state.is_object() || state.value("optimizer_state", true)) return;
  throw ConfigError(fmt::format("checkpoint {} holds no optimizer state (saved with no_save_optim: true): resume it "
                                "with no_load_optim: true (the optimizer then starts afresh), or start from its "
                                "weights with finetune: true",
                                dir.string()));
}

}  // namespace primus::train
