// The CUDA backend's trainer: assembles the device model, data, checkpointing and progress from
// train/ and runs the step loop (gradient accumulation, global-norm clipping, AdamW, eval,
// checkpoints, NaN stop/skip, preemption signals) as the reference trainer does, with the
// model on the GPU. Per step it also reports model TFLOP/s, MFU and device memory.
#pragma once
#include <chrono>
#include <memory>
#include <random>
#include <vector>

#include "backends/cuda/args.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/model.h"
#include "backends/cuda/profile.h"
#include "backends/cuda/step_graph.h"
#include "core/trainer/trainer.h"
#include "data/dataset/data_config.h"
#include "data/tokenizer/tokenizer.h"
#include "io/checkpoint.h"
#include "parallel/cuda/grad_reducer.h"
#include "parallel/cuda/nccl_process_group.h"
#include "parallel/data_parallel.h"
#include "parallel/parallel_dims.h"
#include "parallel/store_vote.h"
#include "parallel/tcp_store.h"
#include "train/progress.h"
#include "train/tensor_parallel.h"

namespace primus::backends::cuda {

class CudaTrainer : public Trainer {
 public:
  CudaTrainer(std::shared_ptr<CudaArgs> args, CudaOps ops);
  void setup() override;
  void init() override;
  void train() override;
  void cleanup(bool on_error) override;

 private:
  double train_step(int64_t step, double* grad_norm, bool* finite) {
    launch_step(step);
    return finish_step(step, grad_norm, finite);
  }
  // The step in two halves (train/step_loop.h's launch and finish hooks): launch_step stages the
  // step's batches and AdamW scalars, enqueues its device work and the copy of its status;
  // finish_step waits for that status alone. With launch_ahead_ the step loop launches step s + 1
  // before it finishes step s, so the device runs back to back while the host reads, logs and
  // stages (patch cuda.step.launch_ahead, key launch_ahead; PRIMUS_CUDA_LAUNCH_AHEAD=0|1 overrides;
  // not with data parallelism or the profiler).
  void launch_step(int64_t step);
  double finish_step(int64_t step, double* grad_norm, bool* finite);
  bool launch_ahead_ = false;
  int status_ticket_[2] = {0, 0};  // by step parity: enqueue_step_status's ticket
  void step_body(int64_t step);  // the step's device work (captured under cuda_graph)
  void configure_gemm_algorithms();  // cuBLASLt algorithm search and its cache (gemm_algo_search)
  turbo::AdamWHyper adamw_hyper(int64_t step) const;
  turbo::MuonHyper muon_hyper(int64_t step) const;
  std::vector<float> split_muon_momentum(std::vector<float>& m) const;  // see save()
  // fp8_recipe delayed: the amax histories and scales as optimizer tensors fp8_amax_history
  // [tensors, len] and fp8_scale [tensors], the switches in the state's "fp8_delayed"; `keep`
  // holds the bytes until the checkpoint is written. A checkpoint without them starts the
  // histories empty (logged).
  void save_fp8_delayed(io::CheckpointData& data, CudaModel::Fp8DelayedState& keep) const;
  void load_fp8_delayed(const io::CheckpointData& data, const std::filesystem::path& dir);
  std::vector<train::MuonTensor> muon_tensors_;  // optimizer: muon, in the model's layout (empty: AdamW everywhere)
  double evaluate();
  // The mean loss of eval_iters batches of `it` from `start` (NaN when there is no data).
  double evaluate_on(data::BatchIterator* it, const nlohmann::json& start);
  void reduce_moe_stats();
  // The groups whose members together are every rank holding other tokens (data parallel, plain,
  // ZeRO-1 or sharded, and context parallel; tensor-parallel ranks route the same tokens): sums
  // over them in turn are the global batch's. Only groups of more than one rank.
  std::vector<parallel::ProcessGroup*> token_groups() const;
  void next_batch(data::BatchIterator& it);  // the iterator's next micro-batch into inputs_ and targets_
  void read_micro(int64_t micro);  // this rank's micro-batch `micro` of the step's global batch (reader_)
  void split_batch();              // batch_ -> inputs_, targets_
  // The next step's micro-batches, read while this step runs on the device (the iterator has
  // already moved past this step's batch when the step is launched): ahead_ holds them for the
  // iterator position ahead_position_ (ahead_ready_ false: nothing read ahead). read_micro takes
  // them when the iterator is still there, so the host's reading leaves the device's idle time
  // between steps. read_at does not move the iterator: checkpoints see the same position.
  void read_ahead();
  std::vector<int32_t> ahead_;
  uint64_t ahead_position_ = 0;
  bool ahead_ready_ = false;
  bool read_ahead_on_ = true;  // PRIMUS_CUDA_READ_AHEAD=0 turns it off (A/B runs)
  size_t arena_bytes() const;      // device bytes the model and the data-parallel reducer hold
  void save(int64_t step);
  void sample_at_end();  // the [sample] log line (sample_prompt), from the inference engine
  void load(const std::filesystem::path& dir);
  nlohmann::json state_json(int64_t step) const;

  std::shared_ptr<CudaArgs> args_;
  CudaOps ops_;
  // The job's layout (parallel/parallel_dims.h) and data parallelism (parallel/cuda/grad_reducer.h):
  // the group and reducer are null in a job of one. Declared so that dp_ goes first and the
  // group after the model. pg_: plain or ZeRO-1 data parallelism over this rank's dp group (the
  // whole job, or beside tp or cp the ranks that share this rank's tp and cp coordinates): NCCL with
  // the reducer dp_ on GPUs; in host mode the CPU group, whose gradients reduce_host_grads()
  // averages after the backward. world_pg_: host mode's CPU group of every rank, which its
  // subgroups are made from.
  parallel::DistEnv dist_;
  std::unique_ptr<parallel::TcpStore> store_;
  std::shared_ptr<parallel::ProcessGroup> world_pg_;
  std::shared_ptr<parallel::ProcessGroup> pg_;
  // The group of this rank's coordinate along d (tp, cp or dp): the whole job when it spans it.
  std::shared_ptr<parallel::ProcessGroup> make_group(parallel::Dim d);
  std::shared_ptr<parallel::ProcessGroup> make_group(const std::vector<int>& ranks, const std::string& name);
  void reduce_host_grads();  // host mode: the gradients averaged over pg_ (plain data parallelism)
  std::unique_ptr<parallel::ParallelDims> dims_;  // holds pg_ as its dp group
  std::unique_ptr<CudaModel> model_;
  std::unique_ptr<train::MoeStepStats> moe_stats_;  // MoE models: the step's routing statistics
  std::unique_ptr<parallel::DataParallel> dp_;
  bool zero1() const { return dp_ && args_->use_distributed_optimizer; }
  bool rank0() const { return dist_.rank == 0; }
  // Tensor parallelism (tensor_model_parallel_size > 1; beside cp and dp in Megatron's rank order):
  // the group (NCCL on GPUs, Gloo in host mode) and this rank's shard map. The model is the map's
  // local spec; weights are initialised, checkpointed and sampled in the global layout, which
  // tp_global() puts together (every rank of the tp group calls it).
  std::shared_ptr<parallel::ProcessGroup> tp_pg_;
  // Sharded data parallelism (optim_grads, optim_grads_params, and ZeRO-1 where zero1_in_model:
  // the model's own, model/fsdp.h) over the gradient group, dp x cp (with cp the ranks of this
  // rank's dp group and their cp groups): NCCL on GPUs, the CPU group in host mode. Null otherwise.
  std::shared_ptr<parallel::ProcessGroup> sharded_pg_;
  // Context parallelism (beside tp and dp; NCCL on GPUs, the CPU group in host mode); null without.
  std::shared_ptr<parallel::ProcessGroup> cp_pg_;
  // The optimizer in the backward beside plain data parallelism and context parallelism: the dp x
  // cp ranks, over which the model averages each layer's gradients (CudaModelOptions::
  // grad_mean_group); null otherwise (dp alone: pg_; cp alone: the model takes cp_pg_).
  std::shared_ptr<parallel::ProcessGroup> mean_pg_;
  // A micro-batch as the model takes it: B x T, or with context parallelism this rank's 2B chunk
  // rows of T / 2cp tokens.
  int64_t rows() const;
  int64_t row_tokens() const;
  // The mean over the data- and context-parallel ranks of a host value (the loss); x itself alone.
  double dp_mean(double x);
  // The mean of x over group g (every member calls; x itself without g).
  static double group_mean(parallel::ProcessGroup* g, double x);
  // Whether any rank of the job says stop (every rank calls; a job that is one tp group votes
  // through the store, stop_vote_, see the definition).
  bool any_rank(bool stop);
  std::unique_ptr<parallel::StoreVote> stop_vote_;
  // Whether this rank writes (or helps write) checkpoints. With tp: the tp group of cp and dp
  // coordinates 0 (sharded, after every rank has given its chunks). Else sharded: every rank (the
  // weights and moments are put together from all the chunks). Else with cp: the cp group of dp
  // coordinate 0. Else every rank of the one group. The others wait in a barrier: sharded beside tp
  // over the sharded group; else over their cp group (beside tp), then their dp group. A rank
  // leaves its cp barrier once its cp peer of coordinate 0 arrives, which in the writers' dp column
  // is after the save, and its dp barrier once that column's rank arrives.
  bool writer() const {
    // Expert parallelism: the ep group of dp and cp coordinates 0.
    if (ep_pg_) return dims_->coord(parallel::Dim::DP) == 0 && dims_->coord(parallel::Dim::CP) == 0;
    if (sharded_pg_ && !tp_pg_) return true;
    return (!tp_pg_ || dims_->coord(parallel::Dim::CP) == 0) && (!(tp_pg_ || cp_pg_) || dims_->coord(parallel::Dim::DP) == 0);
  }
  std::shared_ptr<train::TpShardMap> tp_map_;
  // Expert parallelism (expert_model_parallel_size > 1): the ep group (the experts' all-to-all),
  // this rank's shard map, and the experts' replicas (the dp ranks holding the same experts; null
  // with dp 1). pg_ is then the dense layers' replicas, ep x dp. The model is the map's local spec;
  // weights are initialised, checkpointed and sampled in the global layout, as under tp.
  std::shared_ptr<parallel::ProcessGroup> ep_pg_, expert_pg_;
  // Beside context parallelism: the gradients' groups with the cp ranks (ep x dp x cp, dp x cp).
  std::shared_ptr<parallel::ProcessGroup> ep_dense_pg_, ep_expert_pg_;
  std::shared_ptr<train::EpShardMap> ep_map_;
  // Tensor or expert parallelism: this rank holds a part of the model (the map's), put together
  // over model_group() (tp or ep) in the global layout; null without either.
  const train::ModelShardMap* shard_map() const {
    return tp_map_ ? static_cast<const train::ModelShardMap*>(tp_map_.get()) : ep_map_.get();
  }
  parallel::ProcessGroup& model_group() const { return tp_map_ ? *tp_pg_ : *ep_pg_; }
  // The global flat buffer from every rank's local one (collective over model_group()).
  std::vector<float> tp_global(const float* local) const;
  const train::ParamLayout& global_layout() const {
    return shard_map() ? shard_map()->global_layout() : model_->layout();
  }
  std::unique_ptr<parallel::RankBatchReader> reader_;
  std::unique_ptr<data::Tokenizer> tokenizer_;
  data::DataIterators data_;
  std::unique_ptr<train::ProgressReporter> progress_;
  std::vector<int32_t> batch_, inputs_, targets_;
  std::mt19937_64 sample_rng_;
  int64_t step_ = 0;  // optimizer steps done
  int64_t opt_base_ = 0;  // the step the optimizer state began at (no_load_optim; TrainerStateInfo)
  int64_t last_saved_ = -1;
  nlohmann::json valid_start_;  // the validation iterator at its start: every eval begins there
  nlohmann::json test_start_;
  size_t peak_used_bytes_ = 0;
  // Host time per training step (steady clock, ms, summed over the steps after the first two):
  // the step loop's own work (from one finish_step to the next launch_step), staging (batches to
  // the device, AdamW scalars), launching the step (graph replay or eager enqueue) and reading the
  // next step's batches ahead, waiting for its status. Without launch-ahead the device idles for
  // about the first two; with it, only when the host's share exceeds the step's device time.
  // Reported at the end of training.
  struct HostTimes {
    double between = 0, staging = 0, launch = 0, wait = 0;
    int64_t launches = 0, finishes = 0;  // all; the first two of each (warm-up, capture) are not timed
    static int64_t timed(int64_t n) { return n > 2 ? n - 2 : 0; }
    std::chrono::steady_clock::time_point last_end{};
  } host_times_;
  // The step runner (eager or CUDA graph) and the optional per-phase profiler; both after the
  // model (the graph holds its buffers' addresses).
  std::unique_ptr<StepProfiler> profiler_;
  std::unique_ptr<StepGraph> step_graph_;
};

}  // namespace primus::backends::cuda
