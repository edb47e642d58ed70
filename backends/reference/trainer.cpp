#include "backends/reference/trainer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>

#include "backends/reference/context_parallel.h"
#include "backends/reference/generate.h"
#include "core/util/error.h"
#include "parallel/socket_process_group.h"
#include "io/checkpoint.h"
#include "train/checkpointing.h"
#include "train/data_setup.h"
#include "train/hf_import.h"
#include "parallel/dist_checkpoint.h"
#include "train/trainer_state.h"
#include "train/lr_schedule.h"
#include "train/param_init.h"
#include "train/signals.h"
#include "train/step_loop.h"
#include "turbo/core/dtype.h"
#include "turbo/kernels/cpu/loss.h"
#include "turbo/kernels/cpu/optimizer.h"
#include "turbo/kernels/cpu/reduce.h"

namespace primus::backends::reference {

namespace k = primus::turbo::cpu;
namespace fsys = std::filesystem;

namespace {

// This process's peak resident set (VmHWM of /proc/self/status) in bytes; 0 without /proc. On the
// CPU this is the figure that decides whether a job fits: code, libraries, heap and the pages of
// the data files read, each counted once they are touched.
size_t reference_peak_resident_bytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return static_cast<size_t>(std::stoull(line.substr(6))) * 1024;  // in kB
  }
  return 0;
}

// Bytes malloc has handed out and not taken back: every arena (OpenMP threads get their own)
// and the blocks large enough to be mmapped, which is where the model's buffers live.
size_t reference_heap_in_use() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

double reference_gib(double bytes) { return bytes / double(size_t{1} << 30); }

}  // namespace

ReferenceTrainer::ReferenceTrainer(std::shared_ptr<ReferenceArgs> args) : args_(std::move(args)) {}

void ReferenceTrainer::setup() {
  auto& t = args_->train;
  env_ = parallel::read_dist_env();
  parallel::configure_rank_logging(env_.rank, env_.world_size);
  const parallel::ParallelSizes sizes = t.parallel_sizes();
  if (sizes.product() != env_.world_size) {
    throw ConfigError(fmt::format("the layout tensor_model_parallel_size {} x context_parallel_size {} x "
                                  "data_parallel_size {} needs {} processes but the job has {} ({}); launch a multiple "
                                  "of {} processes and leave data_parallel_size unset (the "
                                  "reference.args.data_parallel_size patch derives it)",
                                  sizes[parallel::Dim::TP], sizes[parallel::Dim::CP], t.data_parallel_size,
                                  sizes.product(), env_.world_size,
                                  parallel::describe(env_), sizes.model_parallel_product()));
  }
  dims_ = std::make_unique<parallel::ParallelDims>(
      parallel::ParallelDims::from_launch(sizes, env_, kReferenceMesh));
  t.check_batch();
  t.check_data();
  dp_ = args_->dp;
  fsys::create_directories(t.output_dir);
  if (t.exit_on_signal) train::install_exit_signal_handlers();
  const int64_t tp = dims_->size(parallel::Dim::TP), dp = dims_->size(parallel::Dim::DP);
  const int64_t cp = dims_->size(parallel::Dim::CP), ep = dims_->size(parallel::Dim::EP);
  if (ep > 1) {
    // The experts' replicas (dp) and the dense layers' (ep x dp) are different groups: ZeRO-1
    // shards the whole local buffer over the experts' (shard_pg()); the gradient-sharding
    // strategies, whose units are gathered over one group, would mix them.
    if (parallel::shards_gradients(sizes.sharding)) {
      throw ConfigError(fmt::format("expert_model_parallel_size {} with data_parallel_sharding_strategy {} is not "
                                    "implemented yet on the reference backend; use no_shard or optim (ZeRO-1)",
                                    ep, parallel::dp_sharding_name(sizes.sharding)));
    }
    // Muon beside ep: each expert's matrices are whole on the rank holding them; with ZeRO-1 each
    // Muon tensor is owned by one rank of those holding the same experts (shard_pg()).
  }
  if (env_.distributed()) {
    store_ = parallel::TcpStore::from_env(env_);
    world_pg_ = parallel::make_process_group(env_, *store_);
    // Every rank makes its tp group, its cp group, its ep group, then its gradient groups (the
    // same order everywhere). The gradient group is dp x cp (Megatron's data-parallel group with
    // context parallelism folded in): the cp ranks hold other tokens of the same sequences, so
    // their gradients are summed like another replica's. Under expert parallelism the dense
    // layers' replicas are ep x dp x cp and each expert's dp x cp.
    if (tp > 1) {
      tp_pg_ = world_pg_->new_subgroup(dims_->group_ranks(parallel::Dim::TP), dims_->group_name(parallel::Dim::TP));
    }
    if (cp > 1) {
      cp_pg_ = world_pg_->new_subgroup(dims_->group_ranks(parallel::Dim::CP), dims_->group_name(parallel::Dim::CP));
    }
    if (ep > 1) {
      ep_pg_ = world_pg_->new_subgroup(dims_->group_ranks(parallel::Dim::EP), dims_->group_name(parallel::Dim::EP));
    }
    auto group_of = [&](std::vector<int> ranks, const char* name) -> std::shared_ptr<parallel::ProcessGroup> {
      if (static_cast<int>(ranks.size()) == env_.world_size) return world_pg_;
      if (ranks.size() < 2) return nullptr;
      return world_pg_->new_subgroup(ranks, fmt::format("{}{}-{}", name, ranks.front(), ranks.back()));
    };
    pg_ = group_of(dims_->group_ranks({parallel::Dim::EP, parallel::Dim::DP, parallel::Dim::CP}), "dpcp");
    if (ep > 1) expert_pg_ = group_of(dims_->group_ranks({parallel::Dim::DP, parallel::Dim::CP}), "edp");
    spdlog::info("[reference] data parallel over {} ranks{}{}{} ({} group, timeout {} s): {}", dp * ep,
                 tp > 1 ? fmt::format(" x tensor parallel over {} ranks{}", tp,
                                      sizes.sequence_parallel ? " with sequence parallelism" : "")
                        : "",
                 cp > 1 ? fmt::format(" x context parallel over {} ranks", cp) : "",
                 ep > 1 ? fmt::format(", the experts over {} of them (each expert on {} ranks)", ep, dp) : "",
                 world_pg_->backend(), env_.timeout_s,
                 sizes.sharding == parallel::DpSharding::OptimGradsParams
                     ? "FSDP (parameters, gradients and optimizer state sharded)"
                 : sizes.sharding == parallel::DpSharding::OptimGrads ? "ZeRO-2 (gradients and optimizer state sharded)"
                 : dp_.distributed_optimizer                          ? "ZeRO-1 (optimizer state sharded)"
                                                                      : "optimizer state replicated");
  } else {
    world_pg_ = std::make_shared<parallel::SingleProcessGroup>();
  }
  if (!pg_) pg_ = std::make_shared<parallel::SingleProcessGroup>();
  if (!tp_pg_) tp_pg_ = std::make_shared<parallel::SingleProcessGroup>();
  if (!cp_pg_) cp_pg_ = std::make_shared<parallel::SingleProcessGroup>();
  if (!ep_pg_) ep_pg_ = std::make_shared<parallel::SingleProcessGroup>();
  // The experts' replicas: a group of one under ep with dp x cp = 1; without ep, the dense one's.
  if (!expert_pg_) expert_pg_ = ep > 1 ? std::make_shared<parallel::SingleProcessGroup>() : pg_;
  dims_->set_group(parallel::Dim::CP, cp_pg_);
  dims_->set_group(parallel::Dim::DP, pg_);
  dims_->set_group(parallel::Dim::TP, tp_pg_);
  dims_->set_group(parallel::Dim::EP, ep_pg_);
  reader_ = std::make_unique<parallel::RankBatchReader>(t.global_batch_size, t.micro_batch_size, data_rank(),
                                                        data_size());
  spdlog::info("[reference] output folder {}", t.output_dir.string());
}


void ReferenceTrainer::init() {
  auto& t = args_->train;
  auto& spec = args_->model;
  tokenizer_ = data::make_tokenizer(t.data.tokenizer);
  train::check_eod_mask_loss(t.data, *tokenizer_);
  if (tokenizer_->vocab_size() > spec.vocab_size) {
    throw ConfigError(fmt::format("tokenizer '{}' has {} tokens but the model's vocab_size is {}", t.data.tokenizer,
                                  tokenizer_->vocab_size(), spec.vocab_size));
  }
  // Rank 0 first: a text input is tokenized once into the output folder, then read by all.
  if (env_.rank == 0) data_ = train::build_data(t, spec);
  world_pg_->barrier();
  if (env_.rank != 0) data_ = train::build_data(t, spec);
  if (data_.valid) valid_start_ = data_.valid->state();
  if (data_.test) test_start_ = data_.test->state();

  const int64_t tp = dims_->size(parallel::Dim::TP);
  if (tp > 1) {
    const bool sp = t.model_parallel.sequence_parallel;
    tp_map_ = std::make_unique<train::TpShardMap>(spec, static_cast<int>(tp), tp_pg_->rank(), sp);
    if (sp && spec.seq_length % tp != 0) {
      throw ConfigError(fmt::format("sequence_parallel: seq_length {} is not divisible by tensor_model_parallel_size {}",
                                    spec.seq_length, tp));
    }
    if (t.optim.optimizer == "muon") {
      throw ConfigError("optimizer: muon with tensor_model_parallel_size > 1 is not implemented yet (Muon "
                        "orthogonalises whole matrices, which tp splits over ranks); use adamw or tp 1");
    }
  }
  const int64_t cp = dims_->size(parallel::Dim::CP);
  if (cp > 1) {
    const char* why = t.data.reset_attention_mask || t.data.reset_position_ids
                          ? "reset_attention_mask / reset_position_ids (packed documents)"
                          : nullptr;
    if (why) {
      throw ConfigError(fmt::format("context_parallel_size {} with {} is not implemented yet on the reference backend",
                                    cp, why));
    }
  }
  if (const int64_t ep = dims_->size(parallel::Dim::EP); ep > 1)
    ep_map_ = std::make_unique<train::EpShardMap>(spec, static_cast<int>(ep), ep_pg_->rank());
  const train::ModelSpec& local_spec = shard_map() ? shard_map()->local_spec() : spec;
  const size_t heap_before = reference_heap_in_use();
  // With context parallelism a forward holds seq_length / cp tokens of each sequence.
  model_ = std::make_unique<GptModel<float>>(local_spec, t.micro_batch_size, spec.seq_length / cp);
  model_->set_context_parallel(cp_pg_.get());
  const size_t heap_after = reference_heap_in_use();
  model_heap_bytes_ = heap_after > heap_before ? heap_after - heap_before : 0;
  model_->set_tensor_parallel(tp_map_.get(), tp_pg_.get(), t.model_parallel.sequence_parallel);
  model_->set_expert_parallel(ep_pg_.get());
  // The ranks holding other tokens, over which the router's gradient is averaged.
  model_->set_balance_group(pg_.get());
  moe_stats_ = std::make_unique<train::MoeStepStats>(spec);
  model_->set_document_masking({t.data.reset_attention_mask, t.data.reset_position_ids, tokenizer_->eod_id()});
  if (const train::ParamLayout* gl = global_layout()) {
    // Drawn in the global layout and cut: the weights of a single process, whatever the layout.
    std::vector<float> global(static_cast<size_t>(gl->total));
    train::init_params(spec, *gl, t.seed, global.data());
    train::load_initial_weights(args_->params, t.ckpt, spec, *gl, global.data());
    shard_map()->to_local(global.data(), model_->params.data());
  } else {
    model_->init_weights(t.seed);
    train::load_initial_weights(args_->params, t.ckpt, spec, model_->layout(), model_->params.data());
  }
  const auto total = static_cast<int64_t>(model_->params.size());
  int64_t owned = total;
  const parallel::DpSharding sharding = t.model_parallel.sharding;
  if (parallel::shards_gradients(sharding)) {
    const char* key = parallel::dp_sharding_name(sharding);
    if (t.optim.optimizer == "muon") {
      throw ConfigError(fmt::format("optimizer: muon with data_parallel_sharding_strategy {} is not implemented yet "
                                    "(Muon needs whole gradient matrices); use optim (ZeRO-1)",
                                    key));
    }
    fsdp_ = std::make_unique<ReferenceFsdp>(*model_, *pg_, sharding == parallel::DpSharding::OptimGradsParams);
    model_->set_sharding_hooks(fsdp_.get());
    owned = fsdp_->owned_count();
  }
  zero1_ = dp_.distributed_optimizer && !fsdp_;
  if (zero1_) {
    shards_ = parallel::shard_layout(total, dp_size());
    owned = shards_.shard;
    grad_shard_.assign(static_cast<size_t>(owned), 0.f);
  }
  m_.assign(static_cast<size_t>(owned), 0.f);
  v_.assign(static_cast<size_t>(owned), 0.f);
  if (t.optim.exp_avg_bf16 || t.optim.exp_avg_sq_bf16) {
    spdlog::info("[reference] optimizer: AdamW moments {} (bf16 values stochastically rounded, held in f32 buffers)",
                 t.optim.moment_dtypes());
  }
  if (t.optim.optimizer == "muon") {
    muon_ = std::make_unique<MuonOptimizer>(local_spec, model_->layout(), dp_rank(), dp_size(), zero1_);
    spdlog::info("[reference] optimizer: Muon for {} weight matrices (momentum {}, {}, {} Newton-Schulz steps), "
                 "AdamW for the rest{}",
                 muon_->tensors().size(), t.optim.muon_momentum, t.optim.muon_nesterov ? "Nesterov" : "plain",
                 t.optim.muon_ns_steps, zero1_ && dp_size() > 1 ? "; whole matrices per rank" : "");
  }
  batch_.resize(t.micro_batch_size * (spec.seq_length + 1));
  inputs_.resize(t.micro_batch_size * spec.seq_length);
  targets_.resize(inputs_.size());
  if (cp > 1) full_inputs_.resize(2 * inputs_.size());
  sample_rng_.seed(t.seed + 17);
  spdlog::info("[reference] model: {}, vocab {} ({:.2f}M parameters{})", spec.summary(), spec.vocab_size,
               spec.num_parameters() / 1e6,
               tp_map_   ? fmt::format(", {:.2f}M on each of {} tp ranks", total / 1e6, tp_map_->tp())
               : ep_map_ ? fmt::format(", {:.2f}M on each of {} ep ranks: experts {}..{} here", total / 1e6,
                                       ep_map_->ep(), ep_map_->first_expert(),
                                       ep_map_->first_expert() + ep_map_->local_experts() - 1)
                         : "");

  fsys::path load_dir = train::resume_dir(t.ckpt);
  if (!load_dir.empty()) load(load_dir);
  // Every rank starts from rank 0's weights (equal seeds give equal weights; this makes sure). Under
  // expert parallelism the ranks holding the same experts.
  expert_pg_->broadcast(model_->params.data(), model_->params.size(), parallel::DType::F32, 0);
  if (fsdp_) fsdp_->adopt_params();
  progress_ = std::make_unique<train::ProgressReporter>(t.output_dir, t.tensorboard_dir, t.train_iters,
                                                        t.log_interval, step_, parallel::writes_logs(env_.rank));
  progress_->set_average(t.log_avg_skip_iterations, t.log_avg_reset_interval);
}

void ReferenceTrainer::load_micro_batch(int64_t micro) {
  reader_->read(*data_.train, micro, batch_.data());
  split_batch();
}

void ReferenceTrainer::split_batch() {
  const int64_t B = args_->train.micro_batch_size, T = args_->model.seq_length;
  const int cp = cp_pg_->world_size();
  int32_t* in = cp > 1 ? full_inputs_.data() : inputs_.data();
  int32_t* tg = cp > 1 ? full_inputs_.data() + B * T : targets_.data();
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(&batch_[b * (T + 1)], T, &in[b * T]);
    std::copy_n(&batch_[b * (T + 1) + 1], T, &tg[b * T]);
  }
  if (args_->train.data.eod_mask_loss) {  // the whole sequences' count, the same on every cp rank
    model_->set_loss_targets(train::mask_eod_targets(in, tg, B * T, tokenizer_->eod_id(), turbo::cpu::kIgnoreIndex),
                             B * T);
  }
  if (cp > 1) {  // this rank's two chunks of every sequence
    cp_split(inputs_.data(), in, B, T, 1, cp, cp_pg_->rank());
    cp_split(targets_.data(), tg, B, T, 1, cp, cp_pg_->rank());
  }
}

void ReferenceTrainer::all_reduce_grads() {
  if (ep_map_) return all_reduce_expert_parallel_grads();
  if (dp_size() == 1) return;
  const int64_t total = static_cast<int64_t>(model_->grads.size()), be = dp_.bucket_elems(sizeof(float));
  for (int64_t off = 0; off < total; off += be) {
    pg_->all_reduce(model_->grads.data() + off, static_cast<size_t>(std::min(be, total - off)), parallel::DType::F32,
                    parallel::ReduceOp::Avg);
  }
}

void ReferenceTrainer::all_reduce_expert_parallel_grads() {
  // In buckets; every rank of a group walks the same layout, so the calls pair up.
  const int64_t be = dp_.bucket_elems(sizeof(float));
  const auto ep = static_cast<float>(ep_map_->ep());
  float* g = model_->grads.data();
  for (const bool expert : {false, true}) {
    parallel::ProcessGroup& group = expert ? *expert_pg_ : *pg_;
    for (const auto& [lo, count] : ep_map_->runs(expert)) {
      for (int64_t off = lo; off < lo + count; off += be) {
        const int64_t n = std::min(be, lo + count - off);
        if (group.world_size() > 1)
          group.all_reduce(g + off, static_cast<size_t>(n), parallel::DType::F32, parallel::ReduceOp::Avg);
        if (expert) std::for_each(g + off, g + off + n, [ep](float& x) { x /= ep; });
      }
    }
  }
}

void ReferenceTrainer::mean_dense_grads_over_ep() {
  const int64_t be = dp_.bucket_elems(sizeof(float));
  float* g = model_->grads.data();
  for (const auto& [lo, count] : ep_map_->runs(false)) {
    for (int64_t off = lo; off < lo + count; off += be) {
      ep_pg_->all_reduce(g + off, static_cast<size_t>(std::min(be, lo + count - off)), parallel::DType::F32,
                         parallel::ReduceOp::Avg);
    }
  }
}

void ReferenceTrainer::scale_expert_shard() {
  const int64_t b = shards_.begin(dp_rank()), e = shards_.valid_end(dp_rank());
  const auto ep = static_cast<float>(ep_map_->ep());
  for (const auto& [off, count] : ep_map_->runs(true)) {
    for (int64_t x = std::max(b, off); x < std::min(e, off + count); ++x) grad_shard_[static_cast<size_t>(x - b)] /= ep;
  }
}

// The shards are contiguous ([r*S, (r+1)*S) of the padded buffer), so one bucket is the k-th
// piece of every rank's shard, gathered into staging_ in rank order (reduce_scatter's layout).
void ReferenceTrainer::reduce_scatter_grads() {
  const int W = dp_size();
  const int64_t S = shards_.shard, total = shards_.total, be = std::min(dp_.bucket_elems(sizeof(float)), S);
  staging_.resize(static_cast<size_t>(W * be));
  const float* g = model_->grads.data();
  for (int64_t k = 0; k < S; k += be) {
    const int64_t len = std::min(be, S - k);
    for (int q = 0; q < W; ++q) {
      float* dst = staging_.data() + q * len;
      const int64_t lo = q * S + k, hi = std::min(lo + len, total);
      const int64_t n = std::max<int64_t>(0, hi - lo);
      if (n > 0) std::copy_n(g + lo, n, dst);
      std::fill(dst + n, dst + len, 0.f);  // padding past the last parameter
    }
    shard_pg().reduce_scatter(staging_.data(), grad_shard_.data() + k, static_cast<size_t>(len), parallel::DType::F32,
                        parallel::ReduceOp::Avg);
  }
}

void ReferenceTrainer::all_gather_params() {
  const int W = dp_size(), r = dp_rank();
  const int64_t S = shards_.shard, total = shards_.total, be = std::min(dp_.bucket_elems(sizeof(float)), S);
  staging_.resize(static_cast<size_t>(W * be));
  float* p = model_->params.data();
  for (int64_t k = 0; k < S; k += be) {
    const int64_t len = std::min(be, S - k);
    auto span_of = [&](int q) {
      const int64_t lo = q * S + k;
      return std::pair{lo, std::max<int64_t>(0, std::min(lo + len, total) - lo)};
    };
    auto [mlo, mn] = span_of(r);
    float* mine = staging_.data() + r * len;
    if (mn > 0) std::copy_n(p + mlo, mn, mine);
    std::fill(mine + mn, mine + len, 0.f);
    shard_pg().all_gather(mine, staging_.data(), static_cast<size_t>(len), parallel::DType::F32);
    for (int q = 0; q < W; ++q) {
      auto [lo, n] = span_of(q);
      if (n > 0) std::copy_n(staging_.data() + q * len, n, p + lo);
    }
  }
}

double ReferenceTrainer::train_step(int64_t step, double* grad_norm, bool* finite) {
  auto& t = args_->train;
  // The tokens of a micro-batch on this rank: context parallelism holds 1/cp of each sequence.
  const int64_t B = t.micro_batch_size, T = args_->model.seq_length / cp_pg_->world_size();
  if (fsdp_) {
    fsdp_->begin_step();  // the model's gradients are zero: each unit's is cleared once reduced
  } else {
    model_->zero_grad();
  }
  moe_stats_->reset();
  model_->begin_moe_step();
  double loss_sum = 0;
  const int64_t accum = reader_->micro_batches();
  for (int64_t micro = 0; micro < accum; ++micro) {
    load_micro_batch(micro);
    double dloss = 1.0 / (static_cast<double>(B * T) * static_cast<double>(accum));
    loss_sum += model_->forward(inputs_.data(), targets_.data(), B, T, dloss);
    for (int64_t l = 0; l < args_->model.num_layers; ++l) {
      if (const auto* m = model_->moe_layer(l))
        moe_stats_->add(l, m->stats().counts.data(), m->stats().dropped, m->stats().aux, m->stats().z,
                        m->stats().more_aux);
    }
    model_->backward();
  }
  if (!fsdp_) model_->reduce_tp_partial_grads();
  moe_stats_->all_reduce(pg_.get());
  reader_->finish_step(*data_.train);
  // Equal slices on every rank: the mean of the ranks' means is the global batch's mean.
  double loss = parallel::global_mean(*pg_, loss_sum / static_cast<double>(accum));
  const bool zero1 = zero1_;
  // Squares summed over the gradient group's shards, then over the tp ranks' slices (one rank's
  // groups are single-process groups where a dimension is 1).
  double norm;
  if (fsdp_) {
    norm = fsdp_grad_norm();
  } else if (zero1 && !muon_) {
    if (ep_map_) mean_dense_grads_over_ep();
    reduce_scatter_grads();
    if (ep_map_) scale_expert_shard();
    const int64_t b = shards_.begin(dp_rank()), e = shards_.valid_end(dp_rank());
    const double local = parallel::global_sum(shard_pg(), tp_sum_squares(grad_shard_.data(), b, std::max(b, e)));
    norm = std::sqrt(parallel::global_sum(*ep_pg_, parallel::global_sum(*tp_pg_, local)));
  } else {
    // Muon's owners orthogonalise whole matrices, so they need whole averaged gradients.
    all_reduce_grads();
    const double local = tp_sum_squares(model_->grads.data(), 0, static_cast<int64_t>(model_->grads.size()));
    norm = std::sqrt(parallel::global_sum(*ep_pg_, parallel::global_sum(*tp_pg_, local)));
  }
  *grad_norm = norm;
  *finite = std::isfinite(loss) && std::isfinite(norm);
  if (!*finite) return loss;
  double scale = t.optim.clip_grad > 0 ? k::clip_scale(norm, t.optim.clip_grad) : 1.0;
  k::AdamWParams hp;
  hp.lr = train::lr_at(t.optim, step);
  hp.beta1 = t.optim.beta1;
  hp.beta2 = t.optim.beta2;
  hp.eps = t.optim.eps;
  hp.step = step + 1 - opt_base_;  // AdamW's own steps (no_load_optim restarts them)
  hp.grad_scale = scale;
  // bf16 moments: the values the cuda backend stores (the same stochastic rounding, keyed by the
  // element's offset in the flat layout), held in the f32 buffers.
  hp.m_bf16 = t.optim.exp_avg_bf16;
  hp.v_bf16 = t.optim.exp_avg_sq_bf16;
  const auto& tensors = model_->layout().tensors;
  if (fsdp_) {
    fsdp_update(hp);
    fsdp_move_expert_bias();
    fsdp_->end_step();
    return loss;
  }
  if (!zero1) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& pt = tensors[i];
      if (muon_ && muon_->is_muon(i)) continue;
      hp.weight_decay = pt.decay ? t.optim.weight_decay : 0.0;
      hp.sr_key = pt.offset;
      k::adamw_update(model_->params.data() + pt.offset, model_->grads.data() + pt.offset, m_.data() + pt.offset,
                      v_.data() + pt.offset, pt.numel, hp);
    }
    if (muon_) muon_->update(model_->params.data(), model_->grads.data(), t.optim, train::muon_lr_at(t.optim, step), scale);
    model_->update_expert_bias(moe_stats_->load());
    return loss;
  }
  // ZeRO-1: this rank updates the parts of each tensor that fall in its shard, then every rank
  // gets every shard's new weights.
  const int64_t b = shards_.begin(dp_rank()), e = shards_.valid_end(dp_rank());
  // With Muon the whole averaged gradient is here; this rank's shard of it starts at b.
  const float* gshard = muon_ ? model_->grads.data() + b : grad_shard_.data();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& pt = tensors[i];
    if (muon_ && muon_->is_muon(i)) continue;
    const int64_t lo = std::max<int64_t>(b, pt.offset), hi = std::min<int64_t>(e, pt.offset + pt.numel);
    if (lo >= hi) continue;
    hp.weight_decay = pt.decay ? t.optim.weight_decay : 0.0;
    hp.sr_key = lo;
    k::adamw_update(model_->params.data() + lo, gshard + (lo - b), m_.data() + (lo - b),
                    v_.data() + (lo - b), hi - lo, hp);
  }
  all_gather_params();
  if (muon_) {  // after the gather, which carries the old values of Muon's tensors
    muon_->update(model_->params.data(), model_->grads.data(), t.optim, train::muon_lr_at(t.optim, step), scale);
    // The owners are of the ranks holding the same experts (shard_pg(): pg_ without ep), each ep
    // slice sharing its own; the dense tensors' updates are alike on every ep rank.
    muon_->share(shard_pg(), model_->params.data());
  }
  model_->update_expert_bias(moe_stats_->load());  // the same load on every rank: the same bias
  return loss;
}

void ReferenceTrainer::record_memory(train::StepStats& s) {
  const double rss = double(reference_peak_resident_bytes());
  const double buffers = double(model_heap_bytes_) + double(m_.capacity() + v_.capacity()) * sizeof(float) +
                         double(muon_ ? muon_->state_bytes() : 0);
  s.extras.push_back({"mem_gib", reference_gib(rss)});        // this process's peak resident set
  s.extras.push_back({"arena_gib", reference_gib(buffers)});  // the model's buffers and the optimizer state
  if (env_.world_size == 1) return;
  // Only rank 0 writes metrics: the other ranks' peaks reach its record through one all-gather
  // of a float each (in MiB: exact enough, and far inside a float's range).
  std::vector<float> all(static_cast<size_t>(env_.world_size));
  const float mine = static_cast<float>(rss / double(1 << 20));
  world_pg_->all_gather(&mine, all.data(), 1, parallel::DType::F32);
  const auto [lo, hi] = std::minmax_element(all.begin(), all.end());
  s.details.push_back({"mem_gib_min", double(*lo) / 1024});
  s.details.push_back({"mem_gib_max", double(*hi) / 1024});
}

double ReferenceTrainer::evaluate() { return evaluate_on(data_.valid.get(), valid_start_); }

double ReferenceTrainer::evaluate_on(data::BatchIterator* it, const nlohmann::json& start) {
  auto& t = args_->train;
  if (!it || t.eval_iters == 0) return NAN;
  const int64_t B = t.micro_batch_size, T = args_->model.seq_length / cp_pg_->world_size();
  // Every evaluation reads the same first batches of its data (validation or test), so values compare;
  // with several ranks, rank r evaluates batches r, r + W, ... and the sums are added.
  nlohmann::json saved = it->state();
  it->load_state(start);
  double sum = 0;
  // The model's forward has collectives when its parameters are sharded, its experts spread over
  // ranks or its MoE loads summed over them (global_aux_loss): every rank runs the same number of
  // them, a rank past the last batch re-reading one and not counting it.
  const bool collectives = fsdp_ || ep_map_ || (args_->model.moe.global_aux_loss && pg_->world_size() > 1);
  const int64_t rounds = collectives ? (t.eval_iters + data_size() - 1) / data_size() : 0;
  for (int64_t i = data_rank(), k = 0; i < t.eval_iters || k < rounds; i += data_size(), ++k) {
    const int64_t at = i < t.eval_iters ? i : i % t.eval_iters;
    it->read_at(static_cast<uint64_t>(at * B), static_cast<int>(B), batch_.data());
    split_batch();
    const double l = model_->forward(inputs_.data(), targets_.data(), B, T);
    if (i < t.eval_iters) sum += l;
  }
  it->load_state(saved);
  // The gradient group counts every batch once per cp rank (each returns the sequences' loss).
  return parallel::global_sum(*pg_, sum) / static_cast<double>(t.eval_iters * cp_pg_->world_size());
}

nlohmann::json ReferenceTrainer::state_json(int64_t step) const {
  return train::make_trainer_state(
      step,
      {"reference", args_->train.data.tokenizer, &args_->params, args_->experiment_file, opt_base_,
       !args_->train.ckpt.no_save_optim},
      data_,
      sample_rng_, !args_->train.ckpt.no_save_rng);
}

double ReferenceTrainer::tp_sum_squares(const float* g, int64_t lo, int64_t hi) const {
  if (hi <= lo) return 0.0;
  if (ep_map_ && ep_map_->rank() != 0) {  // the experts are this rank's alone; the rest, rank 0's
    double s = 0;
    for (const auto& [off, count] : ep_map_->runs(true)) {
      const int64_t a = std::max(lo, off), b = std::min(hi, off + count);
      if (a < b) s += k::sum_squares(g + (a - lo), b - a);
    }
    return s;
  }
  if (!tp_map_ || tp_map_->rank() == 0) return k::sum_squares(g, hi - lo);
  double s = 0;
  const auto& ts = model_->layout().tensors;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (tp_map_->replicated(i)) continue;
    const int64_t a = std::max(lo, ts[i].offset), b = std::min(hi, ts[i].offset + ts[i].numel);
    if (a < b) s += k::sum_squares(g + (a - lo), b - a);
  }
  // Replicated key/value rows: counted by their first replica alone.
  if (!tp_map_->counts_kv()) {
    for (const train::TpKvExchange& x : tp_map_->kv_exchanges())
      for (const train::TpPiece& p : x.pieces) {
        const int64_t a = std::max(lo, p.local), b = std::min(hi, p.local + p.count);
        if (a < b) s -= k::sum_squares(g + (a - lo), b - a);
      }
  }
  return s;
}

std::vector<float> ReferenceTrainer::tp_global(const float* local) const {
  std::vector<float> g(static_cast<size_t>(global_layout()->total), 0.f);
  shard_map()->to_global(local, g.data(), /*owned_only=*/true);
  shard_group().all_reduce(g.data(), g.size(), parallel::DType::F32, parallel::ReduceOp::Sum);
  return g;
}

std::vector<float> ReferenceTrainer::dp_full(const std::vector<float>& shard) const {
  const int64_t S = shards_.shard;
  std::vector<float> all(static_cast<size_t>(S * dp_size()));
  shard_pg().all_gather(shard.data(), all.data(), static_cast<size_t>(S), parallel::DType::F32);
  all.resize(static_cast<size_t>(shards_.total));
  return all;
}

double ReferenceTrainer::fsdp_grad_norm() {
  std::vector<float>& g = fsdp_->grad_shard();
  const auto& ts = model_->layout().tensors;
  // Tensor parallel: each rank's part of a shared tensor's gradient (the norms under sequence
  // parallelism, the q/k norms) summed over the tp group; every tp rank owns the same slices.
  if (tp_map_) {
    int64_t at = 0;
    for (const auto& seg : fsdp_->owned()) {
      for (size_t i = 0; i < ts.size(); ++i) {
        if (!tp_map_->partial_grad(i)) continue;
        const int64_t a = std::max(seg.begin, ts[i].offset), b = std::min(seg.end, ts[i].offset + ts[i].numel);
        if (a < b) {
          tp_pg_->all_reduce(g.data() + at + (a - seg.begin), static_cast<size_t>(b - a), parallel::DType::F32,
                             parallel::ReduceOp::Sum);
        }
      }
      at += seg.size();
    }
    // Replicated key/value rows: the replicas' parts of the slices this rank owns summed through
    // the tensor's global k|v range (the ranks of one tp group own the same local slices).
    std::vector<float> x;
    for (const train::TpKvExchange& e : tp_map_->kv_exchanges()) {
      x.assign(static_cast<size_t>(e.elems), 0.0f);
      auto each = [&](auto&& copy) {
        int64_t pos = 0;
        for (const auto& seg : fsdp_->owned()) {
          for (const train::TpPiece& p : e.pieces) {
            const int64_t a = std::max(seg.begin, p.local), b = std::min(seg.end, p.local + p.count);
            if (a < b) copy(g.data() + pos + (a - seg.begin), x.data() + (p.global - e.global_begin) + (a - p.local), b - a);
          }
          pos += seg.size();
        }
      };
      each([](float* shard, float* xs, int64_t n) { std::copy_n(shard, n, xs); });
      tp_pg_->all_reduce(x.data(), x.size(), parallel::DType::F32, parallel::ReduceOp::Sum);
      each([](float* shard, float* xs, int64_t n) { std::copy_n(xs, n, shard); });
    }
  }
  double local = 0;
  int64_t at = 0;
  for (const auto& seg : fsdp_->owned()) {
    local += tp_sum_squares(g.data() + at, seg.begin, seg.end);
    at += seg.size();
  }
  return std::sqrt(parallel::global_sum(*tp_pg_, parallel::global_sum(*pg_, local)));
}

void ReferenceTrainer::fsdp_update(const k::AdamWParams& hp_in) {
  k::AdamWParams hp = hp_in;
  const auto& ts = model_->layout().tensors;
  float* p = fsdp_->param_shard().data();
  const float* g = fsdp_->grad_shard().data();
  int64_t at = 0;
  for (const auto& seg : fsdp_->owned()) {
    for (const auto& pt : ts) {
      const int64_t a = std::max(seg.begin, pt.offset), b = std::min(seg.end, pt.offset + pt.numel);
      if (a >= b) continue;
      const int64_t i = at + (a - seg.begin);
      hp.weight_decay = pt.decay ? args_->train.optim.weight_decay : 0.0;
      hp.sr_key = a;
      k::adamw_update(p + i, g + i, m_.data() + i, v_.data() + i, b - a, hp);
    }
    at += seg.size();
  }
}

// The expert biases under sharded data parallelism: their owners' master slices are what the next
// gathers hand out, so each rank moves the elements it owns, by the global load (every rank has
// it: moe_stats_ is summed over the ranks). The update is elementwise given the load, so the
// owners' pieces make the one-process bias bit for bit.
void ReferenceTrainer::fsdp_move_expert_bias() {
  const train::ModelSpec& spec = args_->model;
  if (!spec.moe.expert_bias) return;
  const std::vector<std::vector<int64_t>> load = moe_stats_->load();
  const int64_t E = spec.moe.num_experts;
  float* p = fsdp_->param_shard().data();
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    const train::ParamTensor* bt = model_->layout().find(fmt::format("layers.{}.moe.router.expert_bias", l));
    if (!bt) continue;
    std::vector<float> delta(static_cast<size_t>(E), 0.0f);
    k::router_bias_update(delta.data(), load.at(static_cast<size_t>(l)).data(), E, spec.moe.bias_update_rate);
    int64_t at = 0;
    for (const auto& seg : fsdp_->owned()) {
      const int64_t a = std::max(seg.begin, bt->offset), b = std::min(seg.end, bt->offset + bt->numel);
      for (int64_t x = a; x < b; ++x) p[at + (x - seg.begin)] += delta[static_cast<size_t>(x - bt->offset)];
      at += seg.size();
    }
  }
}

void ReferenceTrainer::save(int64_t step) {
  auto& t = args_->train;
  auto t0 = std::chrono::steady_clock::now();
  const bool zero1 = zero1_;
  if (fsdp_) fsdp_->gather_all();  // the whole weights for rank 0 to write
  struct Regather {  // FSDP: give the weights back however save() ends (a no-op for ZeRO-2)
    ReferenceFsdp* f;
    ~Regather() {
      if (f) f->release_all();
    }
  } regather{fsdp_.get()};
  io::CheckpointData data;
  std::vector<parallel::FlatShard> shards;
  parallel::FlatSharding sharding;  // empty: rank 0 writes the moments whole
  parallel::ProcessGroup* group = pg_.get();
  std::vector<float> params, m, v, muon_flat;
  if (global_layout()) {
    // Tensor or expert parallel: the weights and moments put together in the global layout (every
    // rank takes part), written by rank 0 as one process would, so any layout can load them.
    params = tp_global(model_->params.data());
    auto whole = [&](const std::vector<float>& s) { return zero1 ? dp_full(s) : fsdp_ ? fsdp_->full(s) : s; };
    m = tp_global(whole(m_).data());
    v = tp_global(whole(v_).data());
    // Muon (beside ep: each expert's matrices whole on one rank): its momentum in the global layout too.
    if (muon_) muon_flat = tp_global(muon_->flat_momentum(shard_pg()).data());
    if (env_.rank == 0) {
      data = train::pack_checkpoint(args_->model, *global_layout(), params.data(), m.data(), v.data(),
                                    state_json(step));
      if (muon_) {
        data.optimizer.emplace(MuonOptimizer::kStateName,
                               io::TensorBlob::borrow(io::DType::F32, {static_cast<int64_t>(muon_flat.size())},
                                                      muon_flat.data(), muon_flat.size() * sizeof(float)));
      }
    }
    group = world_pg_.get();
  } else {
    // Rank 0 writes the weights (the same on every rank) and the state; with ZeRO-1 every rank
    // writes its shard of the moments, with ZeRO-2/FSDP its slices (one segment per unit), else
    // rank 0 writes them whole.
    if (zero1) sharding = parallel::flat_sharding(shards_);
    if (fsdp_) {
      sharding.total = model_->layout().total;
      for (int r = 0; r < dp_size(); ++r) sharding.ranks.push_back(fsdp_->owned(r));
    }
    const bool sharded = zero1 || fsdp_;
    if (env_.rank == 0) {
      data = train::pack_checkpoint(args_->model, model_->layout(), model_->params.data(), sharded ? nullptr : m_.data(),
                                    sharded ? nullptr : v_.data(), state_json(step));
    }
    if (sharded) shards = {{"exp_avg", m_.data()}, {"exp_avg_sq", v_.data()}};
    // Muon's momentum as one flat state like the moments (every rank calls: ZeRO-1 sums the owners').
    if (muon_) muon_flat = muon_->flat_momentum(shard_pg());
    if (muon_ && zero1) {
      shards.push_back({MuonOptimizer::kStateName, muon_flat.data() + std::min(shards_.begin(dp_rank()), shards_.total)});
    }
    if (muon_ && !zero1 && env_.rank == 0) {
      data.optimizer.emplace(MuonOptimizer::kStateName,
                             io::TensorBlob::borrow(io::DType::F32, {static_cast<int64_t>(muon_flat.size())},
                                                    muon_flat.data(), muon_flat.size() * sizeof(float)));
    }
  }
  if (t.ckpt.no_save_optim) {  // every rank alike: the same collectives, no shards
    for (const char* name : train::kOptimizerStateNames) data.optimizer.erase(name);
    sharding.ranks.clear();
    shards.clear();
  }
  io::SaveOptions so;
  so.keep_last = static_cast<int>(t.ckpt.keep_last_k);
  const auto dir = parallel::save_data_parallel(*group, t.ckpt.save, step, data,
                                                sharding.ranks.empty() ? nullptr : &sharding, shards, so);
  last_saved_ = step;
  spdlog::info("[checkpoint] saved step {} to {} ({:.2f}s{})", step, dir.string(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               tp_map_   ? fmt::format(", global layout from {} tp ranks", tp_map_->tp())
               : ep_map_ ? fmt::format(", global layout from {} ep ranks", ep_map_->ep())
                         : "");
}

void ReferenceTrainer::load(const fsys::path& dir) {
  // Each rank verifies the standard files and the optimizer shards it reads, not all of them.
  io::CheckpointData data = io::load_checkpoint(dir, /*verify_other_files=*/false);
  const bool no_load_optim = args_->train.ckpt.no_load_optim;
  train::check_optimizer_state(data.state, dir, no_load_optim);
  const auto total = static_cast<int64_t>(model_->params.size());
  // The elements of the local buffer whose moments this rank keeps, in its order.
  std::vector<parallel::FlatSegment> mine{{0, total}};
  if (zero1_) mine = {{shards_.begin(dp_rank()), std::max(shards_.begin(dp_rank()), shards_.valid_end(dp_rank()))}};
  if (fsdp_) mine = fsdp_->owned();
  if (const train::ParamLayout* gl = global_layout()) {
    // Checkpoints hold the global layout: this rank's slice of the weights, and of the moments the
    // elements [b, e) of its local buffer, read as the global segments they came from.
    std::vector<float> global(static_cast<size_t>(gl->total));
    train::unpack_checkpoint(data, dir, args_->model, *gl, global.data(), nullptr, nullptr);
    shard_map()->to_local(global.data(), model_->params.data());
    std::vector<parallel::FlatSegment> windows;
    for (const auto& [b, e] : mine) {
      for (const train::TpPiece& p : shard_map()->pieces()) {
        const int64_t lo = std::max(b, p.local), hi = std::min(e, p.local + p.count);
        if (lo < hi) windows.push_back({p.global + (lo - p.local), p.global + (hi - p.local)});
      }
    }
    if (!no_load_optim)
      parallel::read_flat_states(data, dir, {"exp_avg", "exp_avg_sq"}, gl->total, windows, {m_.data(), v_.data()});
  } else {
    train::unpack_checkpoint(data, dir, args_->model, model_->layout(), model_->params.data(), nullptr, nullptr);
    if (!no_load_optim)
      parallel::read_flat_states(data, dir, {"exp_avg", "exp_avg_sq"}, total, mine, {m_.data(), v_.data()});
  }
  // bf16 moments hold bf16 values: a checkpoint's f32 moments (from an fp32 run) rounded to nearest,
  // as the cuda backend stores them.
  for (auto [bf16, x] : {std::pair{args_->train.optim.exp_avg_bf16, &m_}, {args_->train.optim.exp_avg_sq_bf16, &v_}})
    if (bf16)
      for (float& f : *x) f = turbo::bf16_bits_to_float(turbo::float_to_bf16_bits(f));
  if (muon_ && !no_load_optim) muon_->load(data, dir, shard_map());
  step_ = train::restore_trainer_state(data.state, dir, data_, sample_rng_, !args_->train.ckpt.no_load_rng);
  // no_load_optim: the moments stay zero (as initialised) and AdamW counts its steps from here.
  opt_base_ = no_load_optim ? step_ : train::optimizer_step_base(data.state);
  if (no_load_optim) spdlog::info("[checkpoint] no_load_optim: the optimizer state starts afresh at step {}", step_);
  last_saved_ = step_;
  int saved_world = parallel::saved_world_size(data);
  spdlog::info("[checkpoint] resumed from {} at step {}{}", dir.string(), step_,
               saved_world != env_.world_size || global_layout()
                   ? fmt::format(" (saved by {} ranks, resharded for {})", saved_world, env_.world_size)
                   : "");
}

void ReferenceTrainer::train() {
  auto& t = args_->train;
  spdlog::info("[reference] training {} steps from step {}: global batch {} x {} tokens (micro {} x {} accumulation)",
               t.train_iters, step_, t.global_batch_size, args_->model.seq_length, t.micro_batch_size,
               t.grad_accum_steps);
  train::StepLoopHooks hooks;
  hooks.step = [this](int64_t step, double* norm, bool* finite) { return train_step(step, norm, finite); };
  hooks.decorate = [this](train::StepStats& s) {
    record_memory(s);
    moe_stats_->report(s);
  };
  hooks.evaluate = [this] { return evaluate(); };
  hooks.test = [this] { return evaluate_on(data_.test.get(), test_start_); };
  hooks.save = [this](int64_t step) { save(step); };
  // Ranks may see a signal at different steps; they stop (and checkpoint) together.
  hooks.agree_stop = [this](bool stop) { return parallel::global_sum(*world_pg_, stop ? 1.0 : 0.0) > 0; };
  if (train::run_step_loop(t, args_->model.seq_length, &step_, last_saved_, progress_.get(), hooks)) return;
  // The sampler runs the whole model on rank 0: tp ranks put their slices together first.
  std::vector<float> whole;
  const bool sampling = !t.sample_prompt.empty() && t.sample_tokens > 0;
  if (fsdp_ && sampling) fsdp_->gather_all();
  if (global_layout() && sampling) whole = tp_global(model_->params.data());
  if (sampling && env_.rank == 0) {
    std::vector<int32_t> ids = tokenizer_->encode(t.sample_prompt);
    if (ids.empty()) ids.push_back(0);
    size_t n = ids.size();
    SampleOptions so;
    so.max_new_tokens = t.sample_tokens;
    so.temperature = t.sample_temperature;
    so.top_k = t.sample_top_k;
    GptModel<float> sampler(args_->model, 1, args_->model.seq_length);
    sampler.params = global_layout() ? whole : model_->params;
    sample_tokens(sampler, ids, so, sample_rng_);
    std::string text = printable(t.sample_prompt + tokenizer_->decode(std::span<const int32_t>(ids).subspan(n)));
    spdlog::info("[sample] temperature {}, top-k {}:\n{}\n", so.temperature, so.top_k, text);
  }
}

void ReferenceTrainer::cleanup(bool on_error) {
  if (progress_) progress_->flush();
  if (on_error && pg_) pg_->abort();  // the other ranks see this one leave at once
  if (on_error && store_) store_->leave_without_waiting();
  if (on_error) spdlog::error("[reference] run stopped by an error; metrics are in {}", args_->train.output_dir.string());
}

}  // namespace primus::backends::reference
