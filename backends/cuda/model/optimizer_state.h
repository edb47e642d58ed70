// The CUDA model's optimizer state and the step's end: the fp32 master weights and AdamW moments
// (views of the memory plan's state arena), gradient clearing, the global gradient norm and clip
// factor, the on-device non-finite check and the AdamW update that refreshes the bf16 compute
// weights. Everything here is enqueued on the model's stream without a host decision, so it can
// be captured in the step's CUDA graph.
//
// Without optimizer state (ZeRO-1: the data-parallel shard keeps the master weights and moments)
// only the gradient clearing, the check and set_params remain; the other calls throw.
//
// The optimizer in the backward (InBackward): instead of one update after the backward, one
// AdamW per group of tensors whose gradients become final together (the decoder's "gradients
// ready" points: the final norm and head, each layer from the top, the embeddings), run from
// backward_ready() as soon as the decoder reports the group; the update computes the norm of the
// gradients it applied in the same pass, and step_check_group (turbo/kernels/cuda/step_check.h)
// turns a non-finite one into a stop (the loss alone is checked before the first group). The
// layers' gradients then share one window of the gradient buffer (grad_placement.h), cleared
// range by range before each layer's backward accumulates into it. There is no global gradient norm before the first update,
// so this mode has no clipping; grad_norm(), check_step() and update() throw.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/hooks.h"
#include "backends/cuda/model/memory_plan.h"
#include "train/muon_layout.h"
#include "train/param_layout.h"
#include "turbo/ops/muon.h"
#include "turbo/ops/optimizer.h"

namespace primus::backends::cuda {

// The gradient ranges zero_grad() clears: every tensor but those `written_first` says a GEMM
// writes with beta 0 at the start of each step, merged where adjacent. Large ones (an untied token
// embedding: 1 GB for Llama-3's vocabulary) go to cudaMemsetAsync, which runs at full rate (the
// ranges kernel measured 0.78 TB/s on it, 1.35 ms per Llama step on an H200); the many small ones
// (norms, biases) to one zero_ranges kernel.
struct GradClearing {
  std::vector<std::pair<int64_t, int64_t>> ranges;         // (offset, count): one kernel for all
  std::vector<std::pair<int64_t, int64_t>> memset_ranges;  // one cudaMemsetAsync each
  int64_t ranges_total = 0;                                // elements in `ranges`
  static constexpr int64_t kMemsetRange = int64_t{1} << 22;  // elements (16 MiB)
};
GradClearing plan_grad_clearing(const train::ParamLayout& layout,
                                const std::function<bool(const std::string& name)>& written_first);

// The optimizer in the backward: the groups' first layout offsets in the order the decoder reports
// them (grad_ready_points), and which tensors the first GEMM writes with beta 0 (not cleared).
struct InBackward {
  std::vector<int64_t> points;
  std::function<bool(const std::string& name)> written_first;
  bool clear_all = false;  // clear every gradient before its group accumulates (zero_grad_full)
};

class OptimizerState {
 public:
  // `state`, `place` and `arena`: the memory plan's (the AdamW descriptor tables come from the
  // arena). keep_state = false: ZeRO-1 (no master weights or moments here). in_backward: the
  // optimizer in the backward (needs keep_state; `place` then has the shared window).
  // muon: the tensors Muon updates (train/muon_layout.h; empty: AdamW for all). Their momentum
  // lives in the first-moment buffer m (AdamW skips them, so it is free there); v is unused there.
  // muon_piece (tensor parallelism): called for each Muon block (its layout tensor, the block,
  // its index among the tensor's blocks) to make its matrix a piece of the whole one
  // (turbo::MuonMatrix::gather and the whole's shape).
  // sr_keys: per layout tensor, the stochastic-rounding key of its element 0 (bf16 moments,
  // turbo/ops/optimizer.h); empty: its layout offset. A sharded model's layout is its shard's, so
  // it passes the pieces' offsets in the model's layout, and its elements round as one process's.
  using MuonPieceFn = std::function<void(size_t tensor, const train::MuonBlock& block, size_t index, turbo::MuonMatrix& mm)>;
  OptimizerState(const train::ParamLayout& layout, const StateBuffers& state, const GradPlacement& place,
                 turbo::Arena& arena, GradClearing clearing, bool keep_state, const ModelStream& stream,
                 const CudaOps& ops, const InBackward* in_backward = nullptr,
                 const std::vector<train::MuonTensor>& muon = {}, const MuonPieceFn& muon_piece = {},
                 std::vector<int64_t> sr_keys = {});

  bool keeps_state() const { return adamw_ != nullptr || !groups_.empty(); }
  // The masters are split: state.master the low halves, state.weights the high (model.h).
  bool split_master() const { return state_.master.defined() && state_.master.dtype == turbo::DType::U16; }
  // The optimizer in the backward: the decoder reports that the gradients from layout offset
  // `offset` up are final; runs the group starting there (AdamW with its norm, the check) and
  // clears the next layer's gradient ranges in the shared window. n_losses: the step's loss slots.
  void backward_ready(int64_t offset, int64_t n_losses, const ExecContext& ctx);
  // The optimizer in the backward: the gradients of the group starting at layout offset `offset`,
  // as views of their storage (adjacent ones of one dtype merged), for a caller that reduces them
  // over a group before backward_ready (context parallelism).
  const std::vector<TensorView>& group_grads(int64_t offset) const;
  // Tensor i's gradient, as stored (its place, its dtype).
  TensorView grad_of(size_t i) const;
  // The optimizer in the backward under tensor parallelism: each group's norm counts what this
  // rank counts (`counted`, `excluded` as norm_over's), and `sum_squares` sums its square over the
  // group (f32 [1], in the stream's order) before the group's check, so that every rank checks
  // and accumulates the same norm, and the step's norm is the whole model's.
  void group_norms_over(const std::vector<bool>& counted, const std::vector<std::pair<int64_t, int64_t>>& excluded,
                        std::function<void(const TensorView&)> sum_squares);
  // The range table zero_grad's kernel reads (device mode; once, at construction of the model).
  void upload_clearing_table() const;

  // Clears the gradients of this step: all of them with `full`, else only the ranges nobody
  // overwrites (the caller's GEMMs then write their tensors' gradients with beta 0).
  void zero_grad(bool full) const;
  void grad_norm(float max_norm, const ExecContext& ctx);
  // Tensor parallelism: the gradient norm of a rank's part of the model. norm_over(counted) picks
  // the tensors this rank counts (its own slices, and the replicated tensors on one rank only);
  // grad_norm_squares then leaves the sum of their squared gradients in the norm buffer's first
  // float, for the caller to sum over the group, and finish_grad_norm turns that sum into
  // {norm, clip factor} as grad_norm does.
  // excluded: layout ranges (offset, count) inside counted tensors left out (replicated key/value
  // rows this rank does not count).
  void norm_over(const std::vector<bool>& counted, const std::vector<std::pair<int64_t, int64_t>>& excluded = {});
  void grad_norm_squares(const ExecContext& ctx);
  void finish_grad_norm(float max_norm);
  // The step's non-finite check over loss slots [0, n) of `slots` and the grad norm: a non-finite
  // step sets the clip factor to NaN, which makes update() leave every weight and moment untouched.
  void check_step(int64_t n, int64_t slots) const;
  // Host-side hyperparameters of the next update; on the device the captured update reads lr and
  // the bias corrections from state.hyper (see CudaModel::set_hyper).
  void set_hyper(const turbo::AdamWHyper& hp) { hp_ = hp; }
  // Muon's hyperparameters (lr_scale: muon_lr / lr; the captured step reads lr from state.hyper).
  void set_muon_hyper(const turbo::MuonHyper& hp) { muon_hp_ = hp; }
  bool has_muon() const { return muon_ != nullptr; }
  size_t muon_device_bytes() const;
  void update(const ExecContext& ctx);

  // Host <-> model copies of the flat fp32 buffers (layout.total floats each); synchronising.
  // set_params also refreshes the bf16 compute copy (without state: through the gradient buffer,
  // then clears the gradients).
  void set_params(const float* host);
  void get_params(float* host) const;
  void set_moments(const float* m, const float* v);  // nullptr: zeros
  void get_moments(float* m, float* v) const;
  void get_grads(float* host) const;

 private:
  void need_state(const char* what) const;  // throws without it (ZeRO-1)
  void need_global(const char* what) const;  // throws with the optimizer in the backward
  void build_groups(const InBackward& ib, turbo::Arena& arena);
  turbo::AdamWTensor adamw_tensor(size_t i) const;
  // Elements [off, off + n) of tensor i (layout offsets).
  turbo::AdamWTensor adamw_slice(size_t i, int64_t off, int64_t n) const;

  struct Group {
    int64_t begin = 0;  // layout offset of its first tensor (the decoder's report)
    bool window = false;  // a transformer layer (its gradients in the shared window)
    std::unique_ptr<turbo::MultiTensorAdamW> adamw;
    std::vector<std::pair<int64_t, int64_t>> clear;  // (gradient-buffer offset, count) to clear before its backward
    // Cleared right after its update: a later group's gradients that take this one's place
    // (GradPlacement::reuse).
    std::vector<std::pair<int64_t, int64_t>> clear_after;
    std::vector<TensorView> grads;  // its gradients' storage (group_grads)
    std::unique_ptr<turbo::MultiTensorAdamW> uncounted;  // group_norms_over: what this rank does not count
  };
  size_t group_at(int64_t offset) const;

  // The stochastic-rounding key of tensor i's element 0 (sr_keys, or its offset).
  int64_t sr_key(size_t i) const { return sr_keys_.empty() ? layout_.tensors[i].offset : sr_keys_[i]; }

  const train::ParamLayout& layout_;
  std::vector<int64_t> sr_keys_;
  const StateBuffers& state_;
  const GradPlacement& place_;
  GradClearing clearing_;
  ModelStream stream_;
  CudaOps ops_;
  turbo::AdamWHyper hp_;
  std::unique_ptr<turbo::MultiTensorAdamW> adamw_;
  // With Muon: AdamW over the other tensors (adamw_ still spans all of them for the global norm),
  // its descriptor table in an arena of its own, and Muon over the matrices' blocks.
  std::unique_ptr<turbo::Arena> rest_table_;
  std::unique_ptr<turbo::MultiTensorAdamW> adamw_rest_;
  // norm_over's tensors (their descriptor table in an arena of its own).
  std::unique_ptr<turbo::Arena> norm_table_;
  std::unique_ptr<turbo::MultiTensorAdamW> norm_set_;
  // group_norms_over: the groups' uncounted sets' tables, one norm's output f32 [2], the sum.
  std::unique_ptr<turbo::Arena> uncounted_table_;
  TensorView uncounted_norm_;
  std::function<void(const TensorView&)> sum_squares_;
  std::unique_ptr<turbo::MultiMatrixMuon> muon_;
  turbo::MuonHyper muon_hp_;
  std::vector<Group> groups_;  // the optimizer in the backward, in report order
  // The optimizer in the backward: the gradients outside the window that zero_grad clears (of the
  // groups outside it, and the layers' tensors with places of their own).
  std::vector<std::pair<int64_t, int64_t>> step_clear_;
};

}  // namespace primus::backends::cuda
