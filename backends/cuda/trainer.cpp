#include "backends/cuda/hooks.h"
#include "backends/cuda/trainer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "train/data_setup.h"
#include "train/document_masks.h"
#include "turbo/kernels/cpu/loss.h"
#include "train/hf_import.h"
#include "train/param_init.h"
#include "parallel/dist_checkpoint.h"
#include "parallel/socket_process_group.h"
#include "parallel/store_vote.h"
#include "train/param_layout.h"
#include "train/trainer_state.h"
#include "backends/cuda/device.h"
#include "backends/cuda/inference/engine.h"
#include "backends/cuda/model_options.h"
#include "backends/cuda/nvtx.h"
#include "backends/cuda/turbo_keys.h"
#include "core/util/error.h"
#include "io/checkpoint.h"
#include "train/checkpointing.h"
#include "train/lr_schedule.h"
#include "train/signals.h"
#include "train/step_loop.h"
#include "turbo/kernels/cublaslt/gemm_cublaslt.h"

namespace primus::backends::cuda {

namespace fsys = std::filesystem;

CudaTrainer::CudaTrainer(std::shared_ptr<CudaArgs> args, CudaOps ops) : args_(std::move(args)), ops_(std::move(ops)) {}

void CudaTrainer::setup() {
  auto& t = args_->train;
  dist_ = parallel::read_dist_env();
  t.check_batch();
  t.check_data();
  check_graph_config(*args_);
  dims_ = std::make_unique<parallel::ParallelDims>(parallel::ParallelDims::from_launch(t.parallel_sizes(), dist_, kCudaMesh));
  const int64_t tp = dims_->size(parallel::Dim::TP), dp = dims_->size(parallel::Dim::DP);
  const int64_t cp = dims_->size(parallel::Dim::CP), ep = dims_->size(parallel::Dim::EP);
  const parallel::DpSharding sharding = t.model_parallel.sharding;
  // The sharded strategies shard over the gradient group, dp x cp (Megatron's data-parallel group
  // with context parallelism folded in: the cp ranks' gradients are other tokens' parts of the same
  // weights, averaged with the replicas' by the same reduce-scatter). ZeRO-1 too, where the model
  // runs it (zero1_in_model); plain data parallelism's ZeRO-1 on GPUs is the bucketed reducer's.
  const bool sharded = dp * cp > 1 && (parallel::shards_gradients(sharding) || zero1_in_model(*args_));
  if (t.data_parallel_size != dp * ep) {
    throw ConfigError(fmt::format("data_parallel_size {} but the job has {} rank(s) ({}) for tp {}; launch one rank per "
                                  "GPU with primus launch / torchrun / srun",
                                  t.data_parallel_size, dist_.world_size, parallel::describe(dist_), tp));
  }
  // This rank's contiguous slice of every global batch (parallel/data_parallel.h): the same
  // samples, in rank order, that one process reads, and resumable at any world size. The ranks of
  // a tp or cp group read the same samples; the ep ranks read their own, as Megatron's data-parallel
  // ranks (ep + EP x dp).
  reader_ = std::make_unique<parallel::RankBatchReader>(
      t.global_batch_size, t.micro_batch_size,
      static_cast<int>(dims_->coord(parallel::Dim::EP) + ep * dims_->coord(parallel::Dim::DP)), static_cast<int>(dp * ep));
  if (!args_->host_mode) select_device(args_->device);  // this thread's device (prepare() ran on it too)
  if (dist_.world_size > 1) {
    parallel::configure_rank_logging(dist_.rank, dist_.world_size);  // rank 0 alone logs
    store_ = parallel::TcpStore::from_env(dist_);
  }
  // Every rank makes its tp group, then its cp group, then its dp group: the same order everywhere,
  // so that the members of each group meet.
  std::string layout;
  if (tp > 1) {
    tp_pg_ = make_group(parallel::Dim::TP);
    dims_->set_group(parallel::Dim::TP, tp_pg_);
    layout += fmt::format("tensor parallel over {} ranks{} ({} group)", tp,
                          t.model_parallel.sequence_parallel ? " with sequence parallelism" : "", tp_pg_->backend());
  }
  if (cp > 1) {
    cp_pg_ = make_group(parallel::Dim::CP);
    dims_->set_group(parallel::Dim::CP, cp_pg_);
    layout += fmt::format("{}context parallel over {} ranks: each holds chunks r and {} - r of {} per sequence ({} group)",
                          layout.empty() ? "" : " x ", cp, 2 * cp - 1, 2 * cp, cp_pg_->backend());
  }
  auto grad_ranks = [&] {  // this rank's dp group, each member with its cp group
    std::vector<int> ranks;
    for (int r : dims_->group_ranks(parallel::Dim::DP)) {
      for (int c : parallel::ParallelDims(t.parallel_sizes(), dist_.world_size, r).group_ranks(parallel::Dim::CP))
        ranks.push_back(c);
    }
    std::sort(ranks.begin(), ranks.end());
    return ranks;
  };
  if (ep > 1) {
    // Expert parallelism: the ep group (the experts' all-to-all), the dense layers' replicas (ep x
    // dp: pg_, the loss and routing statistics' group too) and each expert's replicas (dp).
    ep_pg_ = make_group(parallel::Dim::EP);
    dims_->set_group(parallel::Dim::EP, ep_pg_);
    if (dp > 1) {
      const std::vector<int> ranks = dims_->group_ranks({parallel::Dim::EP, parallel::Dim::DP});
      pg_ = make_group(ranks, fmt::format("dpep{}-{}", ranks.front(), ranks.back()));
      expert_pg_ = make_group(parallel::Dim::DP);
      dims_->set_group(parallel::Dim::DP, expert_pg_);
    } else {
      pg_ = ep_pg_;
    }
    // Beside context parallelism the gradients' means span the cp ranks too (their tokens' parts of
    // the same weights): the dense ones over ep x dp x cp, the experts' over dp x cp.
    if (cp > 1) {
      const std::vector<int> dense = dims_->group_ranks({parallel::Dim::EP, parallel::Dim::DP, parallel::Dim::CP});
      ep_dense_pg_ = make_group(dense, fmt::format("epdpcp{}-{}", dense.front(), dense.back()));
      const std::vector<int> experts = dims_->group_ranks({parallel::Dim::DP, parallel::Dim::CP});
      ep_expert_pg_ = make_group(experts, fmt::format("edpcp{}-{}", experts.front(), experts.back()));
    }
    // Sharded data parallelism (ZeRO-1 too) shards over the ranks holding the same experts (dp x cp):
    // the dense gradients' part of each unit is averaged over the ep group before its reduce-scatter.
    if (parallel::shards_optimizer(sharding) && dp * cp > 1) {
      sharded_pg_ = cp > 1 ? ep_expert_pg_ : expert_pg_;
      spdlog::info("[cuda] data_parallel_sharding_strategy {} over the {} ranks holding the same experts",
                   parallel::dp_sharding_name(sharding), dp * cp);
    }
    layout += fmt::format("{}expert parallel over {} ranks: experts {}..{} here ({} group)", layout.empty() ? "" : " x ",
                          ep, dims_->coord(parallel::Dim::EP) * (args_->model.moe.num_experts / ep),
                          (dims_->coord(parallel::Dim::EP) + 1) * (args_->model.moe.num_experts / ep) - 1,
                          ep_pg_->backend());
    spdlog::info("[cuda] data parallel: {} ranks ({}), the experts over {} of them (each expert on {} ranks)", dp * ep,
                 parallel::describe(dist_), ep, dp);
  } else if (sharded) {
    const std::vector<int> ranks = grad_ranks();
    sharded_pg_ = cp > 1 ? make_group(ranks, fmt::format("dpcp{}-{}", ranks.front(), ranks.back()))
                         : make_group(parallel::Dim::DP);
    if (cp == 1) dims_->set_group(parallel::Dim::DP, sharded_pg_);
    spdlog::info("[cuda] data parallel: {} ranks ({}), data_parallel_sharding_strategy {} ({} group){}", dp,
                 parallel::describe(dist_), parallel::dp_sharding_name(sharding), sharded_pg_->backend(),
                 cp > 1 ? fmt::format(", sharded over dp x cp = {} ranks", ranks.size()) : std::string());
  } else if (dp > 1) {
    pg_ = make_group(parallel::Dim::DP);
    dims_->set_group(parallel::Dim::DP, pg_);
    spdlog::info("[cuda] data parallel: {} ranks{} ({}), {} ({} group)", dp,
                 dp < dist_.world_size ? fmt::format(" of {}", dist_.world_size) : std::string(),
                 parallel::describe(dist_),
                 args_->use_distributed_optimizer ? "ZeRO-1 (sharded optimizer)"
                 : args_->optimizer_in_bwd
                     ? "replicated optimizer in the backward (each layer's gradients averaged over the ranks as the "
                       "layer below runs its backward)"
                     : "replicated optimizer",
                 pg_->backend());
    if (args_->optimizer_in_bwd && cp > 1) {
      const std::vector<int> ranks = grad_ranks();
      mean_pg_ = make_group(ranks, fmt::format("dpcp{}-{}", ranks.front(), ranks.back()));
    }
  } else if (args_->use_distributed_optimizer) {
    spdlog::info("[cuda] use_distributed_optimizer: a job of one rank has nothing to shard");
  }
  if (!layout.empty()) spdlog::info("[cuda] {}{}", layout, dp > 1 ? fmt::format(" x data parallel over {} ranks", dp) : "");
  fsys::create_directories(t.output_dir);
  if (t.exit_on_signal) train::install_exit_signal_handlers();
  spdlog::info("[cuda] output folder {}", t.output_dir.string());
}

std::shared_ptr<parallel::ProcessGroup> CudaTrainer::make_group(parallel::Dim d) {
  return make_group(dims_->group_ranks(d), dims_->group_name(d));
}

std::shared_ptr<parallel::ProcessGroup> CudaTrainer::make_group(const std::vector<int>& ranks, const std::string& name) {
  const bool whole = static_cast<int>(ranks.size()) == dist_.world_size;
  if (args_->host_mode) {
    if (!world_pg_) world_pg_ = parallel::make_process_group(dist_, *store_);
    if (whole) return world_pg_;
    return world_pg_->new_subgroup(ranks, name);
  }
  parallel::NcclGroupOptions go;
  go.device = args_->device;
  go.timeout = std::chrono::milliseconds(static_cast<int64_t>(dist_.timeout_s * 1000));
  go.name = name;
  if (whole) return std::make_shared<parallel::NcclProcessGroup>(*store_, dist_, go);
  return parallel::NcclProcessGroup::subgroup(*store_, dist_, ranks, go);
}

// Plain data parallelism in host mode: the step's gradients (this rank's sum over its
// micro-batches, each scaled by 1 / its tokens) summed over the replicas and divided by their
// number, as the GPU reducer's buckets average them; then every replica clips and updates alike.
void CudaTrainer::reduce_host_grads() {
  const turbo::TensorView& g = model_->grads();
  if (g.device != turbo::Device::CPU) throw RuntimeError("reduce_host_grads: the model's gradients are not in host memory");
  auto* p = static_cast<float*>(g.data);
  const size_t n = static_cast<size_t>(model_->layout().total);
  pg_->all_reduce(p, n, parallel::DType::F32, parallel::ReduceOp::Sum);
  const float inv = 1.0f / static_cast<float>(pg_->world_size());
  for (size_t i = 0; i < n; ++i) p[i] *= inv;
}

// cuBLASLt's algorithm per GEMM shape (gemm_algo_search, patch cuda.gemm.algo_search): k > 1
// times the top k candidates once per shape (inside the first step, which the throughput
// figures leave out) and keeps the winners in a per-machine cache file, so that a resumed run,
// a new process, takes the same algorithms as the run it continues (a GPU resume is still not
// bit-identical for other reasons: docs/cuda.md "Reproducibility"). Only GEMMs with beta = 0 are timed (reruns overwrite their output; none of the
// model's read it); the accumulating weight-gradient GEMMs keep the heuristic's choice.
// PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH in the environment overrides the key.
void CudaTrainer::configure_gemm_algorithms() {
  const char* env = std::getenv("PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH");
  if (!(env && *env)) turbo::cublaslt::set_algo_search(std::max(1, args_->gemm_algo_search));
  const int k = turbo::cublaslt::algo_search();
  const std::string file = turbo::cublaslt::algo_cache_file();
  const char* from_env = env && *env ? " (PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH)" : "";
  if (k <= 1) {
    spdlog::info("[cuda] GEMM algorithms: cuBLASLt's heuristic{}", from_env);
  } else {
    spdlog::info("[cuda] GEMM algorithms: top {} cuBLASLt candidates timed per shape{}; {}", k, from_env,
                 file.empty() ? "no cache file (PRIMUS_TURBO_CUBLASLT_ALGO_CACHE=0 or no HOME): choices are timed "
                                "again in every process"
                              : "winners cached in " + file);
  }
}

void CudaTrainer::init() {
  auto& t = args_->train;
  auto& spec = args_->model;
  tokenizer_ = data::make_tokenizer(t.data.tokenizer);
  train::check_eod_mask_loss(t.data, *tokenizer_);
  if (tokenizer_->vocab_size() > spec.vocab_size) {
    throw ConfigError(fmt::format("tokenizer '{}' has {} tokens but the model's vocab_size is {}", t.data.tokenizer,
                                  tokenizer_->vocab_size(), spec.vocab_size));
  }
  data_ = train::build_data(t, spec);
  if (data_.valid) valid_start_ = data_.valid->state();
  if (data_.test) test_start_ = data_.test->state();

  if (!args_->host_mode) {
    apply_turbo_selection(args_->turbo);
    configure_gemm_algorithms();
  }
  // The options `primus projection` sizes the model with (model_options.h): the two cannot disagree.
  CudaModelOptions mo = model_options_for(*args_, dims_->size(parallel::Dim::DP));
  mo.document_masking.eod_id = tokenizer_->eod_id();
  if (mo.fp8_linear && spec.hidden_size < 2048) {
    spdlog::warn("[cuda] fp8: {}: with hidden_size {} each quantization pass costs about what the FP8 GEMM saves "
                 "(GPT-2 124M, hidden 768: 11% slower than bf16 on an H100; Llama-3.2-1B, hidden 2048: 18% faster, "
                 "78,722 vs 66,652 tok/s: docs/cuda.md \"FP8\"); fp8: none is likely faster here",
                 args_->fp8, spec.hidden_size);
  }
  // Each rank records the amaxes of its own part of the tensors (its samples, its tokens, its
  // slices): step_body takes their max over every group, so the histories and scales stay one
  // process's.
  if (mo.fp8_delayed) {
    for (parallel::ProcessGroup* g : {static_cast<parallel::ProcessGroup*>(pg_.get()), sharded_pg_.get(),
                                      cp_pg_.get(), tp_pg_.get()})
      if (g && g->world_size() > 1) mo.fp8_amax_groups.push_back(g);
  }
  const bool fallback = uses_fallback_attention(*args_);
  const bool zero = pg_ && args_->use_distributed_optimizer;
  if (tp_pg_) {
    const bool sp = t.model_parallel.sequence_parallel;
    tp_map_ = std::make_shared<train::TpShardMap>(spec, tp_pg_->world_size(), tp_pg_->rank(), sp);
    mo.tp_group = tp_pg_.get();
    mo.tp_map = tp_map_;
  }
  if (cp_pg_) mo.cp_group = cp_pg_.get();
  if (spec.moe.global_aux_loss) mo.balance_groups = token_groups();
  if (ep_pg_) {
    ep_map_ = std::make_shared<train::EpShardMap>(spec, ep_pg_->world_size(), ep_pg_->rank());
    mo.ep_group = ep_pg_.get();
    mo.ep_map = ep_map_;
    mo.ep_dense_group = ep_dense_pg_ ? ep_dense_pg_.get() : pg_.get();
    mo.ep_expert_group = ep_expert_pg_ ? ep_expert_pg_.get() : expert_pg_.get();
    if (mo.optimizer_in_backward) mo.grad_mean_group = mo.ep_dense_group;  // the loss slots and the dense layers
  }
  if (mo.optimizer_in_backward && pg_ && !ep_pg_) mo.grad_mean_group = mean_pg_ ? mean_pg_.get() : pg_.get();
  if (sharded_pg_) {
    mo.dp_group = sharded_pg_.get();
    mo.dp_sharding = t.model_parallel.sharding;
  }
  model_ = std::make_unique<CudaModel>(shard_map() ? shard_map()->local_spec() : spec, mo, ops_);
  if (sharded_pg_) {
    const double P = static_cast<double>(model_->layout().total), world = sharded_pg_->world_size();
    const bool optim = t.model_parallel.sharding == parallel::DpSharding::Optim;
    const double per = optim ? 12.0 : 16.0;  // master and moments, + the averaged gradient
    spdlog::info("[cuda] {}: this rank keeps 1/{} of the fp32 master weights, AdamW moments{} ({:.3f} GiB of {:.3f} "
                 "GiB){}",
                 parallel::dp_sharding_name(t.model_parallel.sharding), sharded_pg_->world_size(),
                 optim ? "" : " and averaged gradient", per * P / world / double(size_t{1} << 30),
                 per * P / double(size_t{1} << 30),
                 optim ? "; the gradients accumulate whole and are reduce-scattered once a step, on the last "
                         "micro-batch"
                 : t.model_parallel.sharding == parallel::DpSharding::OptimGradsParams
                     ? "; the layers' bf16 weights are gathered one layer ahead"
                     : "");
  }
  // In the model's own layout (under tp its pieces of the matrices): where Muon's momentum lies in m.
  if (!mo.muon.empty()) muon_tensors_ = train::muon_tensors(model_->spec(), model_->layout());
  if (!muon_tensors_.empty()) {
    spdlog::info("[cuda] optimizer: Muon for {} weight matrices (momentum {}, {}, {} Newton-Schulz steps {}), AdamW "
                 "for the rest",
                 muon_tensors_.size(), t.optim.muon_momentum, t.optim.muon_nesterov ? "Nesterov" : "plain",
                 t.optim.muon_ns_steps,
                 args_->host_mode ? std::string("in fp32 on the CPU (host mode)")
                                  : fmt::format("in bf16 GEMMs; {:.1f} MiB working set",
                                                double(model_->muon_device_bytes()) / double(1 << 20)));
  }
  moe_stats_ = std::make_unique<train::MoeStepStats>(spec);
  // The same seed on every rank, in the global layout: every rank the same weights, and a tp rank its cut of them.
  std::vector<float> params(static_cast<size_t>(global_layout().total));
  train::init_params(spec, global_layout(), t.seed, params.data());
  train::load_initial_weights(args_->params, t.ckpt, spec, global_layout(), params.data());
  if (shard_map()) {
    std::vector<float> local(static_cast<size_t>(model_->layout().total));
    shard_map()->to_local(params.data(), local.data());
    params.swap(local);
  }
  model_->set_params(params.data());
  // In the backward, or beside expert parallelism: the model averages the gradients itself.
  if (pg_ && !args_->host_mode && !mo.optimizer_in_backward && !ep_map_) {
    parallel::DataParallelOptions dpo;
    dpo.zero1 = zero;
    dpo.bucket_elems = args_->ddp_bucket_size;
    dpo.overlap = args_->overlap_grad_reduce;
    dpo.bf16_reduce = args_->grad_reduce_in_bf16;
    parallel::ReplicaBuffers replica;
    replica.layout = &model_->layout();
    replica.grads = model_->grads();
    replica.weights = model_->weights();
    replica.grad_norm = model_->grad_norm_buffer();
    replica.stream = model_->stream();
    replica.ready_points = grad_ready_points(model_->layout());
    dp_ = std::make_unique<parallel::DataParallel>(replica, static_cast<parallel::NcclProcessGroup&>(*pg_), dpo);
    // The reducer subscribes to the model's "gradients ready" reports (its buckets launch while
    // the backward continues below them).
    model_->on_grads_ready([this](int64_t offset) {
      if (dp_) dp_->grads_ready(offset);
    });
    if (zero) dp_->set_state(params.data(), nullptr, nullptr);
    const double full_opt = 12.0 * static_cast<double>(model_->layout().total);
    spdlog::info("[cuda] gradient reduction: {} buckets of <= {} elements, {}; optimizer state per GPU {:.3f} GiB{}",
                 dp_->buckets().size(), args_->ddp_bucket_size,
                 fmt::format("{}, {}", args_->grad_reduce_in_bf16 ? "bf16" : "fp32",
                             args_->overlap_grad_reduce ? "overlapped with the backward" : "after the backward"),
                 zero ? gib(dp_->optimizer_bytes()) : full_opt / double(size_t{1} << 30),
                 zero ? fmt::format(" (ZeRO-1 shard of {} elements; unsharded {:.3f} GiB)", dp_->shard_elems(),
                                    full_opt / double(size_t{1} << 30))
                      : "");
  }
  if (args_->profile_steps > 0) {
    profiler_ = std::make_unique<StepProfiler>(model_->stream(), args_->profile_steps);
    model_->set_profiler(profiler_.get());
  }
  step_graph_ = std::make_unique<StepGraph>(model_->stream(), args_->cuda_graph, profiler_.get());
  log_step_setup(*model_, *args_);
  launch_ahead_ = args_->launch_ahead;  // patch cuda.step.launch_ahead (key launch_ahead); the variable overrides
  for (auto [name, flag] : {std::pair{"PRIMUS_CUDA_READ_AHEAD", &read_ahead_on_},
                            std::pair{"PRIMUS_CUDA_LAUNCH_AHEAD", &launch_ahead_}}) {
    if (const char* e = std::getenv(name); e && *e) {
      const std::string v = e;
      if (v == "0" || v == "1") *flag = v == "1";
      else throw ConfigError(fmt::format("{}='{}': expected 0 or 1", name, v));
    }
  }
  batch_.resize(t.micro_batch_size * (spec.seq_length + 1));
  inputs_.resize(t.micro_batch_size * spec.seq_length);
  targets_.resize(inputs_.size());
  sample_rng_.seed(t.seed + 17);
  spdlog::info("[cuda] model: {}, vocab {} ({:.2f}M parameters); device memory reserved {:.2f} GiB (weights, grads, "
               "optimizer, activations for micro-batch {} x {}, scratch)",
               spec.summary(), spec.vocab_size, spec.num_parameters() / 1e6, gib(model_->reserved_bytes()),
               t.micro_batch_size, spec.seq_length);
  spdlog::info("[cuda] attention: {}", fallback ? "fallback (GEMMs + softmax kernel)" : "Turbo attention op");
  if (t.optim.exp_avg_bf16 || t.optim.exp_avg_sq_bf16) {
    spdlog::info("[cuda] optimizer: AdamW moments {} (bf16 stored stochastically rounded)", t.optim.moment_dtypes());
  }

  const fsys::path load_dir = train::resume_dir(t.ckpt);
  if (!load_dir.empty()) load(load_dir);
  if (rank0()) {
    progress_ = std::make_unique<train::ProgressReporter>(t.output_dir, t.tensorboard_dir, t.train_iters,
                                                          t.log_interval, step_);
    progress_->set_average(t.log_avg_skip_iterations, t.log_avg_reset_interval);
  }
}

size_t CudaTrainer::arena_bytes() const {
  return model_->reserved_bytes() + (dp_ ? dp_->device_bytes() : 0);
}

void CudaTrainer::next_batch(data::BatchIterator& it) {
  it.next_batch(static_cast<int>(args_->train.micro_batch_size), batch_.data());
  split_batch();
}

void CudaTrainer::read_micro(int64_t micro) {
  if (ahead_ready_ && ahead_position_ == data_.train->position()) {
    std::copy_n(ahead_.data() + micro * static_cast<int64_t>(batch_.size()), batch_.size(), batch_.data());
  } else {
    reader_->read(*data_.train, micro, batch_.data());
  }
  split_batch();
}

void CudaTrainer::read_ahead() {
  const int64_t n = reader_->micro_batches();
  ahead_.resize(static_cast<size_t>(n) * batch_.size());
  ahead_ready_ = false;
  try {
    for (int64_t m = 0; m < n; ++m) reader_->read(*data_.train, m, ahead_.data() + m * static_cast<int64_t>(batch_.size()));
  } catch (const std::exception&) {
    return;  // nothing read ahead: the next step reads (and reports) for itself
  }
  ahead_position_ = data_.train->position();
  ahead_ready_ = true;
}

int64_t CudaTrainer::rows() const { return (cp_pg_ ? 2 : 1) * args_->train.micro_batch_size; }
int64_t CudaTrainer::row_tokens() const {
  return args_->model.seq_length / (cp_pg_ ? 2 * cp_pg_->world_size() : 1);
}

void CudaTrainer::split_batch() {
  const int64_t B = args_->train.micro_batch_size, T = args_->model.seq_length;
  // eod_mask_loss: no loss where the input is the end-of-document token; the model counts the
  // targets that keep one on the device (CudaModelOptions::masked_loss).
  auto mask = [&] {
    if (args_->train.data.eod_mask_loss)
      train::mask_eod_targets(inputs_.data(), targets_.data(), B * T, tokenizer_->eod_id(),
                              turbo::cpu::kIgnoreIndex);
  };
  if (!cp_pg_) {
    for (int64_t b = 0; b < B; ++b) {
      std::copy_n(&batch_[b * (T + 1)], T, &inputs_[b * T]);
      std::copy_n(&batch_[b * (T + 1) + 1], T, &targets_[b * T]);
    }
    mask();
    return;
  }
  // Context parallelism: chunk r of every sequence, then chunk 2cp - 1 - r of every sequence
  // (the model's chunk slots, cp_attention.h).
  const int64_t cp = cp_pg_->world_size(), r = cp_pg_->rank(), Tc = T / (2 * cp);
  int64_t row = 0;
  for (const int64_t c : {r, 2 * cp - 1 - r}) {
    for (int64_t b = 0; b < B; ++b, ++row) {
      std::copy_n(&batch_[b * (T + 1) + c * Tc], Tc, &inputs_[row * Tc]);
      std::copy_n(&batch_[b * (T + 1) + c * Tc + 1], Tc, &targets_[row * Tc]);
    }
  }
  mask();  // each input beside its own target: the chunked rows mask as the whole ones
}

turbo::AdamWHyper CudaTrainer::adamw_hyper(int64_t step) const {
  auto& t = args_->train;
  turbo::AdamWHyper hp;
  hp.lr = static_cast<float>(train::lr_at(t.optim, step));
  hp.beta1 = static_cast<float>(t.optim.beta1);
  hp.beta2 = static_cast<float>(t.optim.beta2);
  hp.eps = static_cast<float>(t.optim.eps);
  hp.weight_decay = static_cast<float>(t.optim.weight_decay);  // applied to tensors with decay (ParamLayout)
  hp.step = step + 1 - opt_base_;  // AdamW's own steps (no_load_optim restarts them)
  return hp;
}

turbo::MuonHyper CudaTrainer::muon_hyper(int64_t step) const {
  const train::OptimizerArgs& o = args_->train.optim;
  turbo::MuonHyper hp;
  hp.lr = static_cast<float>(train::muon_lr_at(o, step));
  // On the device the step's lr comes from the staged AdamW scalars; muon_lr_at is lr_at scaled
  // by muon_lr / lr at every step, so one factor carries it.
  hp.lr_scale = o.muon_lr >= 0 && o.lr > 0 ? static_cast<float>(o.muon_lr / o.lr) : 1.0f;
  hp.momentum = static_cast<float>(o.muon_momentum);
  hp.nesterov = o.muon_nesterov;
  hp.ns_steps = o.muon_ns_steps;
  hp.scale_mode = turbo::cpu::muon_scale_from_name(o.muon_scale_mode);
  hp.extra_scale = static_cast<float>(o.muon_extra_scale_factor);
  hp.weight_decay = static_cast<float>(o.weight_decay);
  return hp;
}

// Everything the GPU does in one step, with no host decision and no host copy: StepGraph runs
// it eagerly or captures it. A non-finite loss or grad norm is caught by check_step on the
// device, which makes AdamW skip; the host learns of it from the status read after the step.
void CudaTrainer::step_body(int64_t step) {
  auto& t = args_->train;
  const int64_t B = rows(), T = row_tokens();  // this rank's micro-batch
  const float dloss = static_cast<float>(1.0 / (static_cast<double>(B * T) * static_cast<double>(t.grad_accum_steps)));
  model_->zero_grad();
  if (model_->optimizer_in_backward()) {  // AdamW and the step check run inside the backward, layer by layer
    model_->forward_staged(B, T, dloss, 0);
    model_->backward();
    model_->reduce_fp8_amaxes();  // fp8_recipe delayed: the step's amaxes, the max over the ranks
    return;
  }
  for (int64_t micro = 0; micro < t.grad_accum_steps; ++micro) {
    model_->forward_staged(B, T, dloss, micro);
    if (dp_) dp_->begin_backward(micro + 1 == t.grad_accum_steps);
    model_->begin_backward(micro + 1 == t.grad_accum_steps);
    model_->backward();
  }
  if (dp_) dp_->end_backward();  // the gradients are now averaged over the ranks (ZeRO-1: this rank's shard)
  if (pg_ && !dp_ && !ep_map_) reduce_host_grads();
  model_->reduce_fp8_amaxes();    // fp8_recipe delayed: the step's amaxes, the max over the ranks
  if (zero1()) {
    dp_->grad_norm(static_cast<float>(t.optim.clip_grad));
  } else {
    model_->grad_norm(static_cast<float>(t.optim.clip_grad));
  }
  model_->check_step(t.grad_accum_steps);
  if (zero1()) {
    dp_->update(adamw_hyper(step));
  } else {
    model_->update();  // the scalars set_hyper staged (a captured update reads them from the device)
  }
}

void CudaTrainer::launch_step(int64_t step) {
  auto& t = args_->train;
  const int64_t B = rows(), T = row_tokens();  // this rank's micro-batch
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const bool timed = ++host_times_.launches > 2;  // past the warm-up and capture steps
  if (timed && host_times_.last_end != clock::time_point{}) {
    host_times_.between += std::chrono::duration<double, std::milli>(t0 - host_times_.last_end).count();
  }
  // Host work first: every micro-batch staged in its device slot and the step's AdamW scalars
  // set, so the step itself is device work only.
  for (int64_t micro = 0; micro < t.grad_accum_steps; ++micro) {
    read_micro(micro);
    model_->stage_batch(inputs_.data(), targets_.data(), B, T, micro);
  }
  reader_->finish_step(*data_.train);
  model_->set_hyper(adamw_hyper(step));
  if (!muon_tensors_.empty()) model_->set_muon_hyper(muon_hyper(step));
  const auto t1 = clock::now();
  // A capture begins on an idle stream: the step before it (launched ahead or not) runs first.
  if (step_graph_->will_capture()) model_->sync();
  step_graph_->run([&] { step_body(step); });
  status_ticket_[step & 1] = model_->enqueue_step_status();
  if (read_ahead_on_) read_ahead();  // while the device runs the step (this step's batch is staged)
  if (timed) {
    auto ms = [](clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
    host_times_.staging += ms(t1 - t0);
    host_times_.launch += ms(clock::now() - t1);
  }
}

double CudaTrainer::finish_step(int64_t step, double* grad_norm, bool* finite) {
  auto& t = args_->train;
  using clock = std::chrono::steady_clock;
  const auto t2 = clock::now();
  const CudaModel::StepStatus st = model_->wait_step_status(status_ticket_[step & 1], t.grad_accum_steps);
  if (++host_times_.finishes > 2) {  // past the warm-up and capture steps
    host_times_.wait += std::chrono::duration<double, std::milli>(clock::now() - t2).count();
  }
  if (profiler_) profiler_->collect();
  double loss = st.loss_sum / static_cast<double>(t.grad_accum_steps);
  loss = dp_mean(loss);  // the global batch's loss
  *grad_norm = st.grad_norm;
  *finite = st.finite && std::isfinite(loss);
  if (st.partial) {
    throw RuntimeError(fmt::format("step {}: a non-finite gradient after a finite loss (loss {:.6g}) with "
                                   "optimizer_in_bwd: the layers above it were already updated, so the step can be "
                                   "neither skipped nor undone; stopping (the checkpoints saved so far are intact; "
                                   "resume from the last one, e.g. with a lower learning rate)",
                                   step + 1, loss));
  }
  moe_stats_->reset();
  model_->moe_report(st, t.grad_accum_steps, *moe_stats_);
  reduce_moe_stats();
  // Before the next step launches (launch-ahead is off for these models): it routes with the new bias.
  if (*finite) model_->update_expert_bias(moe_stats_->load());
  host_times_.last_end = clock::now();
  return loss;
}

// The step's MoE routing statistics summed over the ranks that split the batch (data parallel,
// plain, ZeRO-1 or sharded, or context parallel; tensor-parallel ranks route the same tokens):
// the reported loads are the global batch's, and every rank moves its expert biases by the same
// load, so the replicas keep routing alike.
std::vector<parallel::ProcessGroup*> CudaTrainer::token_groups() const {
  // The sharded group spans dp x cp; the plain dp group and the cp group are summed in turn. Under
  // expert parallelism pg_ is ep x dp and the sharded group (dp x cp) would count dp twice.
  const bool shard_sum = sharded_pg_ && !ep_pg_;
  std::vector<parallel::ProcessGroup*> out;
  for (parallel::ProcessGroup* g : {pg_.get(), shard_sum ? sharded_pg_.get() : nullptr, shard_sum ? nullptr : cp_pg_.get()})
    if (g && g->world_size() > 1) out.push_back(g);
  return out;
}

void CudaTrainer::reduce_moe_stats() {
  if (!moe_stats_->enabled()) return;
  for (parallel::ProcessGroup* g : token_groups()) {
    if (auto* nccl = dynamic_cast<parallel::NcclProcessGroup*>(g)) {  // device buffers: staged
      moe_stats_->all_reduce(g->world_size(), [nccl](const void* s, void* r, size_t b) { nccl->all_gather_host(s, r, b); });
    } else {
      moe_stats_->all_reduce(g);
    }
  }
}

double CudaTrainer::evaluate() { return evaluate_on(data_.valid.get(), valid_start_); }

double CudaTrainer::evaluate_on(data::BatchIterator* it, const nlohmann::json& start) {
  auto& t = args_->train;
  if (!it || t.eval_iters == 0) return NAN;
  NvtxRange r("eval");
  const int64_t B = rows(), T = row_tokens();  // this rank's micro-batch
  // Every evaluation reads the same first batches of its data (validation or test), so values compare.
  nlohmann::json saved = it->state();
  it->load_state(start);
  double sum = 0;
  for (int64_t i = 0; i < t.eval_iters; ++i) {
    next_batch(*it);  // every rank the same batches: a 1-rank run's values
    model_->forward(inputs_.data(), targets_.data(), B, T, 0.0f, 0);
    sum += model_->read_loss_sum(1);
  }
  it->load_state(saved);
  // Context parallelism: each rank has its own tokens' mean (the ranks hold equal shares).
  return group_mean(cp_pg_.get(), sum / static_cast<double>(t.eval_iters));
}

nlohmann::json CudaTrainer::state_json(int64_t step) const {
  return train::make_trainer_state(
      step,
      {"cuda", args_->train.data.tokenizer, &args_->params, args_->experiment_file, opt_base_,
       !args_->train.ckpt.no_save_optim},
      data_,
      sample_rng_, !args_->train.ckpt.no_save_rng);
}

void CudaTrainer::save(int64_t step) {
  auto& t = args_->train;
  NvtxRange r("checkpoint");
  auto t0 = std::chrono::steady_clock::now();
  const size_t n = static_cast<size_t>(model_->layout().total);
  io::SaveOptions so;
  so.keep_last = static_cast<int>(t.ckpt.keep_last_k);
  fsys::path dir;
  // The checkpoint is written over one group: the tp group (each rank its moments' slices), else
  // the cp or the data-parallel group. Ranks of the other dimensions hold copies of the same state
  // (cp: the same weights, dp beside tp or cp: a replica), so only the group whose other
  // coordinates are 0 writes, and the rest wait for it below.
  // Under expert parallelism the writers are one ep group: the other dp (expert_pg_) and cp ranks wait.
  const bool waiters = (tp_pg_ && (cp_pg_ || pg_ || sharded_pg_)) || (cp_pg_ && pg_) || (ep_pg_ && expert_pg_);
  if (!writer()) {
    // This rank's state is a writer's (the same weights, moments and trainer state); sharded, its
    // chunks are read with the writers' reads (collective over the sharded group, in their order).
    if (sharded_pg_) {
      std::vector<float> p(n), m(n), v(n);
      model_->get_params(p.data());
      model_->get_moments(m.data(), v.data());
    }
  } else if (shard_map()) {
    // Tensor or expert parallel: the weights put together in the global layout (every rank takes
    // part) and written by rank 0 as one process would; the moments as per-rank shard files of the
    // global flat states, each rank its own slices (the tensors every rank holds from rank 0), so
    // no rank holds them whole. Any layout loads both (load()).
    std::vector<float> local(n), m(n), v(n);
    model_->get_params(local.data());
    model_->get_moments(m.data(), v.data());
    const std::vector<float> params = tp_global(local.data());
    parallel::FlatSharding sharding;
    sharding.total = global_layout().total;
    for (int k = 0; k < model_group().world_size(); ++k) {
      std::vector<parallel::FlatSegment> segs;
      for (const train::TpPiece& p : shard_map()->owned_pieces_of(k)) segs.push_back({p.global, p.global + p.count});
      sharding.ranks.push_back(std::move(segs));
    }
    const std::vector<float> mu = split_muon_momentum(m);  // Muon's momentum: a flat state of its own
    std::vector<float> own_m, own_v, own_mu;  // this rank's owned pieces, in segment order
    for (const train::TpPiece& p : shard_map()->owned_pieces()) {
      own_m.insert(own_m.end(), m.begin() + p.local, m.begin() + p.local + p.count);
      own_v.insert(own_v.end(), v.begin() + p.local, v.begin() + p.local + p.count);
      if (!mu.empty()) own_mu.insert(own_mu.end(), mu.begin() + p.local, mu.begin() + p.local + p.count);
    }
    io::CheckpointData data;
    CudaModel::Fp8DelayedState fp8;  // fp8_recipe delayed (the same on every rank): outlives the save
    if (rank0()) {
      data = train::pack_checkpoint(args_->model, global_layout(), params.data(), nullptr, nullptr, state_json(step));
      if (model_->fp8_delayed_on()) save_fp8_delayed(data, fp8);
    }
    parallel::HostAllGather gather;  // NCCL takes device buffers: the shard digests through the device
    if (auto* nccl = dynamic_cast<parallel::NcclProcessGroup*>(&model_group())) {
      gather = [nccl](const void* send, void* recv, size_t bytes) { nccl->all_gather_host(send, recv, bytes); };
    }
    std::vector<parallel::FlatShard> states = {{"exp_avg", own_m.data()}, {"exp_avg_sq", own_v.data()}};
    if (!own_mu.empty()) states.push_back({"muon_momentum", own_mu.data()});
    // no_save_optim: no shard files (every rank alike), rank 0 writes the rest.
    dir = t.ckpt.no_save_optim
              ? parallel::save_data_parallel(model_group(), t.ckpt.save, step, data,
                                             static_cast<const parallel::FlatSharding*>(nullptr), {}, so)
              : parallel::save_data_parallel(model_group(), t.ckpt.save, step, data, &sharding, states, so, gather);
  } else if (zero1()) {
    // parallel/dist_checkpoint.h, scheme "zero1": every rank writes its own shard of the moments
    // (its chunk of every bucket: DataParallel::shard_segments), copied from its GPU; rank 0
    // writes the fp32 master weights, gathered from the shards (every rank joins each gather),
    // and the trainer state. The moments are never gathered.
    std::vector<float> params(rank0() ? n : 0);
    dp_->gather_master(rank0() ? params.data() : nullptr);
    if (rank0()) model_->put_expert_bias(params.data());  // the shards' bias slots never move
    const size_t own = static_cast<size_t>(dp_->owned_elems());
    std::vector<float> m(own), v(own);
    dp_->read_shard(nullptr, m.data(), v.data());
    parallel::FlatSharding sharding;
    sharding.total = static_cast<int64_t>(n);
    for (int k = 0; k < dist_.world_size; ++k) sharding.ranks.push_back(dp_->shard_segments(k));
    io::CheckpointData data;
    CudaModel::Fp8DelayedState fp8;  // fp8_recipe delayed (the same on every rank): outlives the save
    if (rank0()) {
      data = train::pack_checkpoint(args_->model, model_->layout(), params.data(), nullptr, nullptr, state_json(step));
      if (model_->fp8_delayed_on()) save_fp8_delayed(data, fp8);
    }
    // The shard digests travel through the device (an NCCL group takes device buffers).
    parallel::HostAllGather gather = [this](const void* send, void* recv, size_t bytes) {
      dp_->all_gather_host(send, recv, bytes);
    };
    dir = t.ckpt.no_save_optim
              ? parallel::save_data_parallel(*pg_, t.ckpt.save, step, data,
                                             static_cast<const parallel::FlatSharding*>(nullptr), {}, so)
              : parallel::save_data_parallel(*pg_, t.ckpt.save, step, data, &sharding,
                                             {{"exp_avg", m.data()}, {"exp_avg_sq", v.data()}}, so, gather);
  } else {
    // Every rank holds the same state: rank 0 writes it as one process does. Sharded (optim_grads,
    // optim_grads_params): the weights and moments put together from the ranks' chunks first (every
    // rank takes part), so the checkpoint is the one-process one and any layout loads it.
    const bool all = sharded_pg_ != nullptr;
    std::vector<float> params(rank0() || all ? n : 0), m(rank0() || all ? n : 0), v(rank0() || all ? n : 0), muon_flat;
    io::CheckpointData data;
    CudaModel::Fp8DelayedState fp8;  // fp8_recipe delayed (the same on every rank): outlives the save
    if (all || rank0()) {
      model_->get_params(params.data());
      model_->get_moments(m.data(), v.data());
    }
    if (rank0()) {
      muon_flat = split_muon_momentum(m);
      data = train::pack_checkpoint(args_->model, model_->layout(), params.data(), m.data(), v.data(),
                                    state_json(step));
      if (!muon_flat.empty()) {
        data.optimizer.emplace("muon_momentum", io::TensorBlob::borrow(io::DType::F32, {static_cast<int64_t>(n)},
                                                                      muon_flat.data(), n * sizeof(float)));
      }
      if (model_->fp8_delayed_on()) save_fp8_delayed(data, fp8);
      if (t.ckpt.no_save_optim)
        for (const char* name : train::kOptimizerStateNames) data.optimizer.erase(name);
    }
    // With a group, every rank waits until the checkpoint is installed (the last one always loads).
    parallel::ProcessGroup* group = sharded_pg_ ? sharded_pg_.get() : cp_pg_ ? cp_pg_.get() : pg_.get();
    dir = group ? parallel::save_data_parallel(*group, t.ckpt.save, step, data,
                                               static_cast<const parallel::FlatSharding*>(nullptr), {}, so)
                : io::save_checkpoint(t.ckpt.save, step, data, so);
  }
  if (waiters) {  // every rank goes on once the checkpoint is installed (cp first: see writer())
    if (tp_pg_ && sharded_pg_) {
      sharded_pg_->barrier();  // dp x cp: the writer of this rank's tp coordinate is a member
    } else {
      if ((tp_pg_ || ep_pg_) && cp_pg_) cp_pg_->barrier();
      if (pg_) pg_->barrier();
    }
  }
  last_saved_ = step;
  if (!dir.empty())
    spdlog::info("[checkpoint] saved step {} to {} ({:.2f}s)", step, dir.string(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// Checkpoints keep Muon's momentum as its own flat state "muon_momentum" (zero outside Muon's
// tensors) and exp_avg zero inside them, as the reference backend writes them, so either backend
// resumes the other's. Moves Muon's rows out of m; returns the flat state (empty without Muon).
std::vector<float> CudaTrainer::split_muon_momentum(std::vector<float>& m) const {
  if (muon_tensors_.empty()) return {};
  std::vector<float> flat(m.size(), 0.f);
  for (const train::MuonTensor& mt : muon_tensors_) {
    const train::ParamTensor& pt = model_->layout().tensors[mt.index];
    std::copy_n(m.data() + pt.offset, pt.numel, flat.data() + pt.offset);
    std::fill_n(m.data() + pt.offset, pt.numel, 0.f);
  }
  return flat;
}

void CudaTrainer::save_fp8_delayed(io::CheckpointData& data, CudaModel::Fp8DelayedState& keep) const {
  keep = model_->get_fp8_delayed();
  data.optimizer.emplace("fp8_amax_history",
                         io::TensorBlob::borrow(io::DType::F32, {keep.tensors, keep.history_len}, keep.history.data(),
                                                keep.history.size() * sizeof(float)));
  data.optimizer.emplace("fp8_scale", io::TensorBlob::borrow(io::DType::F32, {keep.tensors}, keep.scale.data(),
                                                             keep.scale.size() * sizeof(float)));
  data.state["fp8_delayed"] = {{"use_history", keep.use_history}, {"pending", keep.pending},
                               {"history_len", keep.history_len}, {"amax_compute_algo", args_->fp8_amax_compute_algo},
                               {"margin", args_->fp8_margin}};
}

void CudaTrainer::load_fp8_delayed(const io::CheckpointData& data, const fsys::path& dir) {
  const auto h = data.optimizer.find("fp8_amax_history");
  const auto s = data.optimizer.find("fp8_scale");
  if (h == data.optimizer.end() || s == data.optimizer.end() || !data.state.contains("fp8_delayed")) {
    spdlog::info("[checkpoint] {} has no FP8 amax histories (saved without fp8_recipe delayed): they start empty, "
                 "the first step runs current scaling",
                 dir.string());
    return;
  }
  const nlohmann::json& j = data.state.at("fp8_delayed");
  CudaModel::Fp8DelayedState st;
  if (h->second.shape().size() != 2 || s->second.shape().size() != 1 || h->second.dtype() != io::DType::F32 ||
      s->second.dtype() != io::DType::F32)
    throw RuntimeError(fmt::format("{}: fp8_amax_history / fp8_scale: expected f32 [tensors, length] and [tensors]",
                                   (dir / "optimizer.safetensors").string()));
  st.tensors = h->second.shape()[0];
  st.history_len = h->second.shape()[1];
  st.history = h->second.to_vector<float>();
  st.scale = s->second.to_vector<float>();
  st.use_history = j.value("use_history", false);
  st.pending = j.value("pending", false);
  if (st.history_len != args_->fp8_amax_history_len)
    spdlog::info("[checkpoint] FP8 amax histories saved with length {}, resumed with {}: the newest {} entries kept",
                 st.history_len, args_->fp8_amax_history_len, std::min(st.history_len, args_->fp8_amax_history_len));
  try {
    model_->set_fp8_delayed(st);
  } catch (const RuntimeError& e) {
    throw RuntimeError(fmt::format("{}: {}", dir.string(), e.what()));
  }
}

void CudaTrainer::load(const fsys::path& dir) {
  // Saved by any world size and either backend: the moments come whole from optimizer.safetensors
  // or from the ZeRO-1 shard files that cover them (parallel/dist_checkpoint.h), each verified.
  io::CheckpointData data = io::load_checkpoint(dir, /*verify_other_files=*/false);
  const size_t n = static_cast<size_t>(model_->layout().total);
  std::vector<float> params(n);
  const std::vector<std::string> names = {"exp_avg", "exp_avg_sq"};
  // no_load_optim: the moments (and Muon's momentum) start at zero instead of the checkpoint's.
  const bool no_load_optim = args_->train.ckpt.no_load_optim;
  train::check_optimizer_state(data.state, dir, no_load_optim);
  if (shard_map()) {
    // Checkpoints hold the global layout: the weights whole, cut here; the moments read as this
    // rank's pieces alone (in local order they are its whole buffer), from whichever files hold them.
    const auto G = static_cast<size_t>(global_layout().total);
    std::vector<float> global(G), m(n), v(n);
    train::unpack_checkpoint(data, dir, args_->model, global_layout(), global.data(), nullptr, nullptr);
    shard_map()->to_local(global.data(), params.data());
    std::vector<parallel::FlatSegment> windows;
    for (const train::TpPiece& p : shard_map()->pieces()) windows.push_back({p.global, p.global + p.count});
    if (!no_load_optim)
      parallel::read_flat_states(data, dir, names, static_cast<int64_t>(G), windows, {m.data(), v.data()});
    if (!muon_tensors_.empty()) {  // Muon's momentum into m's rows of its tensors
      std::vector<float> mu(n);
      if (!no_load_optim)
        parallel::read_flat_states(data, dir, {"muon_momentum"}, static_cast<int64_t>(G), windows, {mu.data()});
      for (const train::MuonTensor& mt : muon_tensors_) {
        const train::ParamTensor& pt = model_->layout().tensors[mt.index];
        std::copy_n(mu.data() + pt.offset, pt.numel, m.data() + pt.offset);
      }
    }
    model_->set_params(params.data());
    model_->set_moments(m.data(), v.data());
    if (model_->fp8_delayed_on()) load_fp8_delayed(data, dir);
  } else if (zero1()) {
    train::unpack_checkpoint(data, dir, args_->model, model_->layout(), params.data(), nullptr, nullptr);
    model_->set_params(params.data());
    // This rank reads only the elements its shard holds (its chunk of every bucket), from
    // whichever shard files of the saved run cover them.
    const std::vector<parallel::FlatSegment> segs = dp_->shard_segments(dist_.rank);
    const size_t own = static_cast<size_t>(dp_->owned_elems());
    std::vector<float> master(own), m(own), v(own);
    size_t off = 0;
    for (const auto& s : segs) {
      std::copy_n(params.data() + s.begin, s.size(), master.data() + off);
      off += static_cast<size_t>(s.size());
    }
    if (!no_load_optim)
      parallel::read_flat_states(data, dir, names, static_cast<int64_t>(n), segs, {m.data(), v.data()});
    dp_->write_shard(master.data(), m.data(), v.data());
    if (model_->fp8_delayed_on()) load_fp8_delayed(data, dir);
  } else {
    train::unpack_checkpoint(data, dir, args_->model, model_->layout(), params.data(), nullptr, nullptr);
    model_->set_params(params.data());
    std::vector<float> m(n), v(n);
    if (!no_load_optim)
      parallel::read_flat_states(data, dir, names, static_cast<int64_t>(n), 0, static_cast<int64_t>(n),
                                 {m.data(), v.data()});
    if (!muon_tensors_.empty()) {
      // Muon's momentum lives in m's rows of its tensors (AdamW leaves them to it).
      std::vector<float> mu(n);
      if (!no_load_optim)
        parallel::read_flat_states(data, dir, {"muon_momentum"}, static_cast<int64_t>(n), 0, static_cast<int64_t>(n),
                                   {mu.data()});
      for (const train::MuonTensor& mt : muon_tensors_) {
        const train::ParamTensor& pt = model_->layout().tensors[mt.index];
        std::copy_n(mu.data() + pt.offset, pt.numel, m.data() + pt.offset);
      }
    }
    model_->set_moments(m.data(), v.data());
    if (model_->fp8_delayed_on()) load_fp8_delayed(data, dir);
  }
  step_ = train::restore_trainer_state(data.state, dir, data_, sample_rng_, !args_->train.ckpt.no_load_rng);
  opt_base_ = no_load_optim ? step_ : train::optimizer_step_base(data.state);  // AdamW counts its steps from here
  if (no_load_optim) spdlog::info("[checkpoint] no_load_optim: the optimizer state starts afresh at step {}", step_);
  last_saved_ = step_;
  const int saved_world = parallel::saved_world_size(data);
  spdlog::info("[checkpoint] resumed from {} at step {}{}", dir.string(), step_,
               saved_world != dist_.world_size
                   ? fmt::format(" (saved by {} rank(s), resharded for {})", saved_world, dist_.world_size)
                   : "");
}

void CudaTrainer::train() {
  auto& t = args_->train;
  const double tokens_per_step = static_cast<double>(t.global_batch_size * args_->model.seq_length);
  const double flops_per_token = args_->model.flops_per_token();
  spdlog::info("[cuda] training {} steps from step {}: global batch {} x {} tokens (micro {} x {} accumulation); "
               "{:.3g} model FLOPs per token, peak {:.3g} FLOP/s",
               t.train_iters, step_, t.global_batch_size, args_->model.seq_length, t.micro_batch_size,
               t.grad_accum_steps, flops_per_token, args_->peak_flops);
  // Megatron-LM's profile window (profile_window.h): host mode has no CUDA profiler, so it only logs.
  ProfileWindow window(args_->profile_window, dist_.rank,
                       args_->host_mode ? std::function<void(bool)>([](bool) {}) : std::function<void(bool)>());
  train::StepLoopHooks hooks;
  hooks.step = [this, &window](int64_t step, double* norm, bool* finite) {
    window.before_step(step);
    double loss;
    {
      NvtxRange r("step");
      loss = train_step(step, norm, finite);
    }
    window.after_step(step);
    return loss;
  };
  // Launch-ahead needs nothing on the host that reads per-step device state: no profiler (its
  // events are per step), no data-parallel loss average (a host collective) in between. In host
  // mode a launch runs the step at once; the order of host work and the statuses (one copy per
  // ticket) are the same, so the host trainer test covers this path without a GPU.
  // The expert-bias update runs on the host between steps: the next step must not be queued before it.
  const bool ahead = launch_ahead_ && !profiler_ && !pg_ && !sharded_pg_ && !cp_pg_ && !args_->model.moe.expert_bias;
  if (ahead) {
    hooks.launch = [this, &window](int64_t step) {
      window.before_step(step);
      NvtxRange r("launch");
      launch_step(step);
    };
    hooks.finish = [this, &window](int64_t step, double* norm, bool* finite) {
      double loss;
      {
        NvtxRange r("finish");
        loss = finish_step(step, norm, finite);
      }
      window.after_step(step);
      return loss;
    };
  }
  spdlog::info("[cuda] launch-ahead: {}", ahead ? "on (step s + 1 is queued before step s's result is read)"
                                                : launch_ahead_ ? "off (profiler, data parallelism or the MoE expert-bias update)"
                                                                : "off (launch_ahead: false or PRIMUS_CUDA_LAUNCH_AHEAD=0)");
  hooks.decorate = [&](train::StepStats& st) {
    const size_t used = args_->host_mode ? 0 : device_memory().used;
    peak_used_bytes_ = std::max(peak_used_bytes_, used);
    // Per GPU, as Megatron reports it: the job's model FLOP/s over its ranks (dp x tp).
    const double flops =
        st.seconds > 0 ? flops_per_token * tokens_per_step / st.seconds / static_cast<double>(dist_.world_size) : 0.0;
    st.extras.push_back({"tflops", flops / 1e12});
    if (args_->peak_flops > 0) st.extras.push_back({"mfu", flops / args_->peak_flops});
    st.extras.push_back({"mem_gib", gib(used)});             // device-wide, CUDA context included
    st.extras.push_back({"arena_gib", gib(arena_bytes())});  // the model's own tensors (+ the ZeRO-1 shard)
    moe_stats_->report(st);  // the global batch's (reduce_moe_stats)
  };
  hooks.evaluate = [this] { return evaluate(); };
  hooks.test = [this] { return evaluate_on(data_.test.get(), test_start_); };
  hooks.save = [this](int64_t step) { save(step); };
  // A signal to any rank stops every rank at this step.
  hooks.agree_stop = [this](bool stop) { return any_rank(stop); };
  if (train::run_step_loop(t, args_->model.seq_length, &step_, last_saved_, progress_.get(), hooks)) {
    window.finish();
    if (rank0()) report_profile(profiler_.get(), t.output_dir);
    return;
  }
  window.finish();
  if (rank0()) report_profile(profiler_.get(), t.output_dir);
  spdlog::info("[cuda] peak device memory in use {:.2f} GiB (of which {:.2f} GiB reserved by the model's arenas)",
               gib(peak_used_bytes_), gib(arena_bytes()));
  const HostTimes& h = host_times_;
  if (const int64_t steps = HostTimes::timed(h.finishes), launches = HostTimes::timed(h.launches);
      steps > 0 && launches > 0) {
    const double n = static_cast<double>(steps), nl = static_cast<double>(launches);
    spdlog::info("[cuda] host time per step over {} steps: between steps {:.3f} ms, staging {:.3f} ms, launch {:.3f} ms, "
                 "waiting for the device {:.3f} ms (launch includes reading the next step's batches ahead; {})",
                 steps, h.between / nl, h.staging / nl, h.launch / nl, h.wait / n,
                 ahead ? "with launch-ahead the device has the next step queued meanwhile"
                       : "the device idles for about the first two");
  }
  if (!t.sample_prompt.empty() && t.sample_tokens > 0) sample_at_end();
}

// The reference trainer's end-of-training sample, from the inference engine (KV cache) on the
// trained weights (the fp32 master copy, gathered from the shards under ZeRO-1: every rank joins).
void CudaTrainer::sample_at_end() {
  const auto& t = args_->train;
  std::vector<float> params(rank0() ? static_cast<size_t>(model_->layout().total) : 0);
  if (shard_map()) {
    std::vector<float> local(static_cast<size_t>(model_->layout().total));
    model_->get_params(local.data());
    params = tp_global(local.data());
  } else if (zero1()) {
    dp_->gather_master(rank0() ? params.data() : nullptr);
    if (rank0()) model_->put_expert_bias(params.data());
  } else if (sharded_pg_) {  // collective: every rank takes part
    params.resize(static_cast<size_t>(model_->layout().total));
    model_->get_params(params.data());
  } else if (rank0()) {
    model_->get_params(params.data());
  }
  if (!rank0()) return;
  std::vector<int32_t> ids = tokenizer_->encode(t.sample_prompt);
  if (ids.empty()) ids.push_back(tokenizer_->eod_id() >= 0 ? tokenizer_->eod_id() : 0);
  train::SampleOptions so;
  so.max_new_tokens = t.sample_tokens;
  so.temperature = t.sample_temperature;
  so.top_k = t.sample_top_k;
  try {
    InferenceEngine engine(args_->model, params.data(), 1, args_->host_mode ? turbo::Device::CPU : turbo::Device::CUDA);
    const auto out = generate(engine, {ids}, so, sample_rng_);
    std::string text = t.sample_prompt + tokenizer_->decode(out[0]);
    for (char& ch : text)
      if (ch == '\0') ch = '\n';  // the byte tokenizer's end of document, shown as a line break
    spdlog::info("[sample] temperature {}, top-k {}:\n{}\n", so.temperature, so.top_k, text);
  } catch (const Error& e) {  // e.g. MoE token dropping (the engine routes dropless), or no memory beside the model
    spdlog::warn("[sample] skipped: {}; primus generate --backend reference --checkpoint {} --prompt '{}'", e.what(),
                 t.ckpt.save.string(), t.sample_prompt);
  }
}

double CudaTrainer::group_mean(parallel::ProcessGroup* g, double x) {
  if (!g || g->world_size() == 1) return x;
  float v = static_cast<float>(x);
  if (auto* nccl = dynamic_cast<parallel::NcclProcessGroup*>(g)) {
    nccl->all_reduce_host(&v, 1);
  } else {
    g->all_reduce(&v, 1, parallel::DType::F32, parallel::ReduceOp::Sum);
  }
  return static_cast<double>(v) / g->world_size();
}

// The dp and cp groups of a rank together span the ranks that hold other samples or other tokens
// of the same model part (tp ranks hold the same values): a mean over one, then the other, is the
// mean over them all.
double CudaTrainer::dp_mean(double x) {
  // The sharded group is dp x cp; beside expert parallelism it leaves the ep ranks out (pg_ has them).
  if (sharded_pg_ && !ep_pg_) return group_mean(sharded_pg_.get(), x);
  x = dp_ ? dp_->average({x})[0] : group_mean(pg_.get(), x);
  return group_mean(cp_pg_.get(), x);
}

// Beside dp or cp the tp group joins too, so that every rank of the job stops at the same step. A
// job that is one tp group votes through the TCP store instead (parallel/store_vote.h): there
// launch-ahead queues step s + 1's tp collectives before step s is finished, and a collective here
// would wait behind them. Without the vote a signal that reaches the ranks on either side of a step
// boundary would send one into the checkpoint's collectives and the other into the next step's.
bool CudaTrainer::any_rank(bool stop) {
  if (tp_pg_ && !(pg_ || sharded_pg_ || cp_pg_)) {
    if (!stop_vote_) {
      stop_vote_ = std::make_unique<parallel::StoreVote>(*store_, "primus/stop_vote", dist_.world_size,
                                                         store_->timeout());
    }
    return stop_vote_->any(stop, fmt::format("the tensor-parallel ranks' stop agreement after step {}", step_));
  }
  const double x = dp_mean(stop ? 1.0 : 0.0);
  return (pg_ || sharded_pg_ || cp_pg_ ? group_mean(tp_pg_.get(), x) : x) > 0;
}

std::vector<float> CudaTrainer::tp_global(const float* local) const {
  std::vector<float> g(static_cast<size_t>(global_layout().total), 0.f);
  shard_map()->to_global(local, g.data(), /*owned_only=*/true);
  if (auto* nccl = dynamic_cast<parallel::NcclProcessGroup*>(&model_group())) {
    nccl->all_reduce_host(g.data(), g.size());
  } else {
    model_group().all_reduce(g.data(), g.size(), parallel::DType::F32, parallel::ReduceOp::Sum);
  }
  return g;
}

void CudaTrainer::cleanup(bool on_error) {
  if (progress_) progress_->flush();
  if (on_error && pg_) pg_->abort();  // frees this rank's GPU work; the peers' watchdogs name this rank
  if (on_error && world_pg_ && world_pg_ != pg_ && world_pg_ != tp_pg_ && world_pg_ != cp_pg_ && world_pg_ != sharded_pg_)
    world_pg_->abort();
  if (on_error && tp_pg_) tp_pg_->abort();
  if (on_error && sharded_pg_) sharded_pg_->abort();
  if (on_error && cp_pg_) cp_pg_->abort();
  if (on_error && ep_pg_ && ep_pg_ != pg_) ep_pg_->abort();
  if (on_error && expert_pg_) expert_pg_->abort();
  if (on_error && ep_dense_pg_) ep_dense_pg_->abort();
  if (on_error && ep_expert_pg_) ep_expert_pg_->abort();
  if (on_error && store_) store_->leave_without_waiting();  // rank 0: do not wait for a stalled peer to hang up
  if (on_error) spdlog::error("[cuda] run stopped by an error; metrics are in {}", args_->train.output_dir.string());
}

}  // namespace primus::backends::cuda
