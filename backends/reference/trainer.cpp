#include "backends/reference/trainer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <sstream>

#include "backends/reference/generate.h"
#include "core/util/error.h"
#include "io/checkpoint.h"
#include "train/checkpointing.h"
#include "train/data_setup.h"
#include "train/trainer_state.h"
#include "train/lr_schedule.h"
#include "train/signals.h"
#include "turbo/kernels/cpu/optimizer.h"
#include "turbo/kernels/cpu/reduce.h"

namespace primus::backends::reference {

namespace k = primus::turbo::cpu;
namespace fsys = std::filesystem;

ReferenceTrainer::ReferenceTrainer(std::shared_ptr<ReferenceArgs> args) : args_(std::move(args)) {}

void ReferenceTrainer::setup() {
  auto& t = args_->train;
  t.check_batch();
  t.check_data();
  fsys::create_directories(t.output_dir);
  if (t.exit_on_signal) train::install_exit_signal_handlers();
  spdlog::info("[reference] output folder {}", t.output_dir.string());
}


void ReferenceTrainer::init() {
  auto& t = args_->train;
  auto& spec = args_->model;
  tokenizer_ = data::make_tokenizer(t.data.tokenizer);
  if (tokenizer_->vocab_size() > spec.vocab_size) {
    throw ConfigError(fmt::format("tokenizer '{}' has {} tokens but the model's vocab_size is {}", t.data.tokenizer,
                                  tokenizer_->vocab_size(), spec.vocab_size));
  }
  data_ = train::build_data(t, spec);
  if (data_.valid) valid_start_ = data_.valid->state();

  model_ = std::make_unique<GptModel<float>>(spec, t.micro_batch_size, spec.seq_length);
  model_->init_weights(t.seed);
  m_.assign(model_->params.size(), 0.f);
  v_.assign(model_->params.size(), 0.f);
  batch_.resize(t.micro_batch_size * (spec.seq_length + 1));
  inputs_.resize(t.micro_batch_size * spec.seq_length);
  targets_.resize(inputs_.size());
  sample_rng_.seed(t.seed + 17);
  spdlog::info("[reference] {} model: {} layers, hidden {}, heads {} (kv {}), vocab {}: {:.2f}M parameters",
               spec.model_type, spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_query_groups,
               spec.vocab_size, spec.num_parameters() / 1e6);

  fsys::path load_dir = train::resume_dir(t.ckpt);
  if (!load_dir.empty()) load(load_dir);
  progress_ = std::make_unique<train::ProgressReporter>(t.output_dir, t.tensorboard_dir, t.train_iters,
                                                        t.log_interval, step_);
}

double ReferenceTrainer::train_step(int64_t step, double* grad_norm, bool* finite) {
  auto& t = args_->train;
  const int64_t B = t.micro_batch_size, T = args_->model.seq_length;
  model_->zero_grad();
  double loss_sum = 0;
  for (int64_t micro = 0; micro < t.grad_accum_steps; ++micro) {
    data_.train->next_batch(static_cast<int>(B), batch_.data());
    for (int64_t b = 0; b < B; ++b) {
      std::copy_n(&batch_[b * (T + 1)], T, &inputs_[b * T]);
      std::copy_n(&batch_[b * (T + 1) + 1], T, &targets_[b * T]);
    }
    double dloss = 1.0 / (static_cast<double>(B * T) * static_cast<double>(t.grad_accum_steps));
    loss_sum += model_->forward(inputs_.data(), targets_.data(), B, T, dloss);
    model_->backward();
  }
  double loss = loss_sum / static_cast<double>(t.grad_accum_steps);
  double norm = std::sqrt(k::sum_squares(model_->grads.data(), static_cast<int64_t>(model_->grads.size())));
  *grad_norm = norm;
  *finite = std::isfinite(loss) && std::isfinite(norm);
  if (!*finite) return loss;
  double scale = t.optim.clip_grad > 0 ? k::clip_scale(norm, t.optim.clip_grad) : 1.0;
  k::AdamWParams hp;
  hp.lr = train::lr_at(t.optim, step);
  hp.beta1 = t.optim.beta1;
  hp.beta2 = t.optim.beta2;
  hp.eps = t.optim.eps;
  hp.step = step + 1;
  hp.grad_scale = scale;
  for (auto& pt : model_->layout().tensors) {
    hp.weight_decay = pt.decay ? t.optim.weight_decay : 0.0;
    k::adamw_update(model_->params.data() + pt.offset, model_->grads.data() + pt.offset, m_.data() + pt.offset,
                    v_.data() + pt.offset, pt.numel, hp);
  }
  return loss;
}

double ReferenceTrainer::evaluate() {
  auto& t = args_->train;
  if (!data_.valid || t.eval_iters == 0) return NAN;
  const int64_t B = t.micro_batch_size, T = args_->model.seq_length;
  // Every evaluation reads the same first batches of the validation data, so values compare.
  nlohmann::json saved = data_.valid->state();
  data_.valid->load_state(valid_start_);
  double sum = 0;
  for (int64_t i = 0; i < t.eval_iters; ++i) {
    data_.valid->next_batch(static_cast<int>(B), batch_.data());
    for (int64_t b = 0; b < B; ++b) {
      std::copy_n(&batch_[b * (T + 1)], T, &inputs_[b * T]);
      std::copy_n(&batch_[b * (T + 1) + 1], T, &targets_[b * T]);
    }
    sum += model_->forward(inputs_.data(), targets_.data(), B, T);
  }
  data_.valid->load_state(saved);
  return sum / static_cast<double>(t.eval_iters);
}

nlohmann::json ReferenceTrainer::state_json(int64_t step) const {
  return train::make_trainer_state(
      step, {"reference", args_->train.data.tokenizer, &args_->params, args_->experiment_file}, data_, sample_rng_);
}

void ReferenceTrainer::save(int64_t step) {
  auto& t = args_->train;
  auto t0 = std::chrono::steady_clock::now();
  auto data = train::pack_checkpoint(args_->model, model_->layout(), model_->params.data(), m_.data(), v_.data(),
                                     state_json(step));
  io::SaveOptions so;
  so.keep_last = static_cast<int>(t.ckpt.keep_last_k);
  auto dir = io::save_checkpoint(t.ckpt.save, step, data, so);
  last_saved_ = step;
  spdlog::info("[checkpoint] saved step {} to {} ({:.2f}s)", step, dir.string(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

void ReferenceTrainer::load(const fsys::path& dir) {
  io::CheckpointData data = io::load_checkpoint(dir);
  train::unpack_checkpoint(data, dir, args_->model, model_->layout(), model_->params.data(), m_.data(), v_.data());
  step_ = train::restore_trainer_state(data.state, dir, data_, sample_rng_);
  last_saved_ = step_;
  spdlog::info("[checkpoint] resumed from {} at step {}", dir.string(), step_);
}

void ReferenceTrainer::train() {
  auto& t = args_->train;
  const double tokens_per_step = static_cast<double>(t.global_batch_size * args_->model.seq_length);
  spdlog::info("[reference] training {} steps from step {}: global batch {} x {} tokens (micro {} x {} accumulation)",
               t.train_iters, step_, t.global_batch_size, args_->model.seq_length, t.micro_batch_size,
               t.grad_accum_steps);
  while (step_ < t.train_iters) {
    auto t0 = std::chrono::steady_clock::now();
    double norm = 0;
    bool finite = true;
    double loss = train_step(step_, &norm, &finite);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!finite) {
      std::string last = last_saved_ >= 0 ? io::checkpoint_dir(t.ckpt.save, last_saved_).string() : "none";
      if (!t.skip_nan_steps) {
        throw RuntimeError(fmt::format("non-finite loss {} or gradient norm {} at step {}; the last good checkpoint is "
                                       "{} (set skip_nan_steps: true to skip such steps)",
                                       loss, norm, step_ + 1, last));
      }
      spdlog::warn("step {}: non-finite loss {} / grad norm {}: step skipped (skip_nan_steps)", step_ + 1, loss, norm);
    }
    ++step_;
    train::StepStats st;
    st.step = step_;
    st.loss = loss;
    st.lr = train::lr_at(t.optim, step_ - 1);
    st.grad_norm = norm;
    st.tokens = tokens_per_step;
    st.seconds = secs;
    st.skipped = !finite;
    progress_->step(st);
    if (t.eval_interval > 0 && (step_ % t.eval_interval == 0 || step_ == t.train_iters)) {
      double vl = evaluate();
      if (std::isfinite(vl)) progress_->eval(step_, vl);
    }
    bool stop = train::exit_requested();
    if ((t.ckpt.save_interval > 0 && step_ % t.ckpt.save_interval == 0) || step_ == t.train_iters || stop) {
      save(step_);
    }
    if (stop) {
      spdlog::info("[signal] received signal {}: checkpoint of step {} saved in {}; resume with auto_continue_train=true "
                   "(or load={})",
                   train::exit_signal(), step_, t.ckpt.save.string(), t.ckpt.save.string());
      return;
    }
  }
  if (!t.sample_prompt.empty() && t.sample_tokens > 0) {
    std::vector<int32_t> ids = tokenizer_->encode(t.sample_prompt);
    if (ids.empty()) ids.push_back(0);
    size_t n = ids.size();
    SampleOptions so;
    so.max_new_tokens = t.sample_tokens;
    so.temperature = t.sample_temperature;
    so.top_k = t.sample_top_k;
    GptModel<float> sampler(args_->model, 1, args_->model.seq_length);
    sampler.params = model_->params;
    sample_tokens(sampler, ids, so, sample_rng_);
    std::string text = printable(t.sample_prompt + tokenizer_->decode(std::span<const int32_t>(ids).subspan(n)));
    spdlog::info("[sample] temperature {}, top-k {}:\n{}\n", so.temperature, so.top_k, text);
  }
}

void ReferenceTrainer::cleanup(bool on_error) {
  if (progress_) progress_->flush();
  if (on_error) spdlog::error("[reference] run stopped by an error; metrics are in {}", args_->train.output_dir.string());
}

}  // namespace primus::backends::reference
