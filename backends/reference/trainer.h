// The reference backend's trainer: assembles model, optimizer, data, checkpointing and
// progress from train/ and runs the step loop on the CPU.
#pragma once
#include <memory>
#include <random>

#include "backends/reference/args.h"
#include "backends/reference/model.h"
#include "core/trainer/trainer.h"
#include "data/dataset/data_config.h"
#include "data/tokenizer/tokenizer.h"
#include "train/progress.h"

namespace primus::backends::reference {

class ReferenceTrainer : public Trainer {
 public:
  explicit ReferenceTrainer(std::shared_ptr<ReferenceArgs> args);
  void setup() override;
  void init() override;
  void train() override;
  void cleanup(bool on_error) override;

 private:
  double train_step(int64_t step, double* grad_norm, bool* finite);
  double evaluate();
  void save(int64_t step);
  void load(const std::filesystem::path& dir);
  nlohmann::json state_json(int64_t step) const;

  std::shared_ptr<ReferenceArgs> args_;
  std::unique_ptr<GptModel<float>> model_;
  std::unique_ptr<data::Tokenizer> tokenizer_;
  data::DataIterators data_;
  std::unique_ptr<train::ProgressReporter> progress_;
  std::vector<float> m_, v_;
  std::vector<int32_t> batch_, inputs_, targets_;
  std::mt19937_64 sample_rng_;
  int64_t step_ = 0;  // optimizer steps done
  int64_t last_saved_ = -1;
  nlohmann::json valid_start_;  // the validation iterator at its start: every eval begins there
};

}  // namespace primus::backends::reference
