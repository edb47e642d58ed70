// The CUDA backend's trainer: assembles the device model, data, checkpointing and progress from
// train/ and runs the step loop (gradient accumulation, global-norm clipping, AdamW, eval,
// checkpoints, NaN stop/skip, preemption signals) as the reference trainer does, with the
// model on the GPU. Per step it also reports model TFLOP/s, MFU and device memory.
#pragma once
#include <memory>
#include <random>
#include <vector>

#include "backends/cuda/args.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/model.h"
#include "core/trainer/trainer.h"
#include "data/dataset/data_config.h"
#include "data/tokenizer/tokenizer.h"
#include "train/progress.h"

namespace primus::backends::cuda {

class CudaTrainer : public Trainer {
 public:
  CudaTrainer(std::shared_ptr<CudaArgs> args, CudaOps ops);
  void setup() override;
  void init() override;
  void train() override;
  void cleanup(bool on_error) override;

 private:
  double train_step(int64_t step, double* grad_norm, bool* finite);
  double evaluate();
  void next_batch(data::BatchIterator& it);  // fills inputs_ and targets_
  void save(int64_t step);
  void load(const std::filesystem::path& dir);
  nlohmann::json state_json(int64_t step) const;

  std::shared_ptr<CudaArgs> args_;
  CudaOps ops_;
  std::unique_ptr<CudaModel> model_;
  std::unique_ptr<data::Tokenizer> tokenizer_;
  data::DataIterators data_;
  std::unique_ptr<train::ProgressReporter> progress_;
  std::vector<int32_t> batch_, inputs_, targets_;
  std::mt19937_64 sample_rng_;
  int64_t step_ = 0;  // optimizer steps done
  int64_t last_saved_ = -1;
  nlohmann::json valid_start_;  // the validation iterator at its start: every eval begins there
  size_t peak_used_bytes_ = 0;
};

}  // namespace primus::backends::cuda
