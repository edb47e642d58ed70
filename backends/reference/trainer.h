// The reference backend's trainer: assembles model, optimizer, data, checkpointing and
// progress from train/ and runs the step loop on the CPU. With WORLD_SIZE > 1 (`primus launch`,
// torchrun, Slurm) it is data parallel over a parallel::ProcessGroup: each rank reads its slice of
// every global batch, gradients are averaged across ranks in buckets, and with
// use_distributed_optimizer (ZeRO-1) each rank keeps AdamW moments only for its shard of the
// flat parameter buffer, updates that shard, and the weights are all-gathered. With
// tensor_model_parallel_size > 1 each data-parallel replica is a tp group of ranks holding slices
// of the model (train/tensor_parallel.h; sequence_parallel optional); data parallelism and ZeRO-1
// then run over the dp group on each rank's slice, and checkpoints are written in the global
// layout, so they load under any layout.
#pragma once
#include <memory>
#include <random>

#include "backends/reference/args.h"
#include "backends/reference/fsdp.h"
#include "backends/reference/model.h"
#include "backends/reference/muon.h"
#include "turbo/kernels/cpu/optimizer.h"
#include "core/trainer/trainer.h"
#include "data/dataset/data_config.h"
#include "data/tokenizer/tokenizer.h"
#include "parallel/data_parallel.h"
#include "parallel/launch_env.h"
#include "parallel/parallel_dims.h"
#include "parallel/process_group.h"
#include "parallel/tcp_store.h"
#include "train/expert_parallel.h"
#include "train/moe_stats.h"
#include "train/progress.h"
#include "train/tensor_parallel.h"

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
  void load_micro_batch(int64_t micro);
  // Data parallel pieces: gradients averaged in buckets; ZeRO-1 reduce-scatter / all-gather.
  void all_reduce_grads();
  void reduce_scatter_grads();
  void all_gather_params();
  double evaluate();
  // The mean loss of eval_iters batches of `it` from `start` (NaN when there is no data).
  double evaluate_on(data::BatchIterator* it, const nlohmann::json& start);
  // The step record's memory figures: this process's peak resident set and the model's and
  // optimizer's buffers; with several ranks also the smallest and largest peak over the ranks.
  void record_memory(train::StepStats& s);
  void save(int64_t step);
  void load(const std::filesystem::path& dir);
  nlohmann::json state_json(int64_t step) const;
  // The group ZeRO and FSDP shard over: the gradient group (dp x cp), or under expert parallelism
  // the ranks holding the same experts (dp x cp; the dense layers' state is then sharded over them
  // too, and kept alike on each ep rank).
  parallel::ProcessGroup& shard_pg() const { return ep_map_ ? *expert_pg_ : *pg_; }
  int dp_rank() const { return shard_pg().rank(); }
  int dp_size() const { return shard_pg().world_size(); }
  // Which samples this rank reads: its data-parallel coordinate, expert parallelism's ranks each
  // their own (Megatron's data-parallel rank); cp ranks read the same ones.
  int data_rank() const {
    return static_cast<int>(dims_->coord(parallel::Dim::EP) +
                            dims_->size(parallel::Dim::EP) * dims_->coord(parallel::Dim::DP));
  }
  int data_size() const { return static_cast<int>(dims_->size(parallel::Dim::EP) * dims_->size(parallel::Dim::DP)); }
  // The micro-batch in batch_ into inputs_ / targets_: this rank's tokens of each sequence.
  void split_batch();
  // Sum of squares of the local gradient elements [lo, hi) at g (g[0] is element lo), with the
  // tensors every tp rank holds counted on tp rank 0 only: summed over the tp group it is the
  // global model's.
  double tp_sum_squares(const float* g, int64_t lo, int64_t hi) const;
  // Tensor or expert parallel: the global flat buffer from every rank's local one (collective over
  // the tp or ep group).
  std::vector<float> tp_global(const float* local) const;
  // Tensor or expert parallelism: this rank's part of the model (null for neither), put together in
  // the global layout (checkpoints, sampling) over shard_group(), the tp or ep group.
  const train::ModelShardMap* shard_map() const {
    return tp_map_ ? static_cast<const train::ModelShardMap*>(tp_map_.get()) : ep_map_.get();
  }
  parallel::ProcessGroup& shard_group() const { return tp_map_ ? *tp_pg_ : *ep_pg_; }
  const train::ParamLayout* global_layout() const { return shard_map() ? &shard_map()->global_layout() : nullptr; }
  // Expert parallelism: the routed experts' gradients averaged over their replicas (expert_pg_)
  // and divided by ep (each is the sum of every ep rank's tokens' part), the rest over pg_.
  void all_reduce_expert_parallel_grads();
  // Expert parallelism beside ZeRO-1: the dense tensors' gradients averaged over the ep group
  // before the reduce-scatter over shard_pg(), the experts' divided by ep (in the shard) after it.
  void mean_dense_grads_over_ep();
  void scale_expert_shard();
  // The whole local optimizer state from ZeRO-1's shards (collective over the dp group).
  std::vector<float> dp_full(const std::vector<float>& shard) const;
  // Sharded data parallelism's optimizer step over the owned slices (after the gradients are
  // reduce-scattered): the tp parts summed, the norm, AdamW. Returns the gradient norm.
  double fsdp_grad_norm();
  void fsdp_update(const turbo::cpu::AdamWParams& hp);
  void fsdp_move_expert_bias();  // after fsdp_update, before the gathers

  std::shared_ptr<ReferenceArgs> args_;
  std::unique_ptr<GptModel<float>> model_;
  std::unique_ptr<train::MoeStepStats> moe_stats_;  // MoE models: the step's routing statistics
  std::unique_ptr<data::Tokenizer> tokenizer_;
  data::DataIterators data_;
  std::unique_ptr<train::ProgressReporter> progress_;
  parallel::DistEnv env_;
  std::unique_ptr<parallel::TcpStore> store_;
  // The gradient group: dp x cp (x ep: the dense layers' replicas under expert parallelism).
  std::shared_ptr<parallel::ProcessGroup> pg_;
  std::shared_ptr<parallel::ProcessGroup> cp_pg_;     // the context-parallel group
  std::shared_ptr<parallel::ProcessGroup> world_pg_;  // every rank of the job
  std::shared_ptr<parallel::ProcessGroup> tp_pg_;     // the tensor-parallel group
  std::unique_ptr<parallel::ParallelDims> dims_;      // the job's layout
  std::unique_ptr<train::TpShardMap> tp_map_;         // tensor_model_parallel_size > 1
  // expert_model_parallel_size > 1: the map, the ep group (the experts' all-to-all) and the
  // experts' gradient group (the ranks holding the same experts: dp x cp).
  std::unique_ptr<train::EpShardMap> ep_map_;
  std::shared_ptr<parallel::ProcessGroup> ep_pg_, expert_pg_;
  std::unique_ptr<ReferenceFsdp> fsdp_;               // optim_grads, optim_grads_params
  bool zero1_ = false;                                // optim (ZeRO-1): one contiguous shard a rank
  parallel::DataParallelArgs dp_;
  std::unique_ptr<parallel::RankBatchReader> reader_;
  parallel::ShardLayout shards_;      // ZeRO-1: this rank owns [begin(rank), valid_end(rank))
  std::vector<float> grad_shard_;  // ZeRO-1: the averaged gradient of this rank's shard
  std::vector<float> staging_;     // ZeRO-1: one bucket from every rank
  std::vector<float> m_, v_;       // AdamW moments: whole buffer, or this rank's shard (ZeRO-1)
  std::unique_ptr<MuonOptimizer> muon_;  // optimizer: muon (the layers' matrices; AdamW the rest)
  std::vector<int32_t> batch_, inputs_, targets_;
  std::vector<int32_t> full_inputs_;  // context parallel: whole sequences' inputs then targets
  std::mt19937_64 sample_rng_;
  // What the model's constructor took from the heap (its weights, gradients and activation
  // buffers), measured around it: the model keeps no count of its own.
  size_t model_heap_bytes_ = 0;
  int64_t step_ = 0;  // optimizer steps done
  int64_t opt_base_ = 0;  // the step the optimizer state began at (no_load_optim; TrainerStateInfo)
  int64_t last_saved_ = -1;
  nlohmann::json valid_start_;  // the validation iterator at its start: every eval begins there
  nlohmann::json test_start_;
};

}  // namespace primus::backends::reference
