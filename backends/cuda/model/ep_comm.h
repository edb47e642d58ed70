// The CUDA model's expert-parallel group (train/expert_parallel.h): each rank holds num_experts /
// ep of every MoE layer's experts, and the rows its router sends to another rank's experts go there
// and come back, as in the reference backend's MoeLayer.
//
// Per MoE layer and micro-batch, plan() reads the local row plan (the kept slots per expert) on the
// host, which synchronises the model's stream: the rows each rank sends
// each other rank are known there before any moves, as Megatron's all-to-all dispatcher knows its
// token counts. The counts then go round the group (one all-to-all), and this rank's held groups
// (its experts' rows from every rank, expert-major, each group padded to the grouped GEMM's
// alignment with zero rows) get their offsets, and the four row maps of the layer's moves are
// built on the host and uploaded (one gather kernel each: no copy per expert). dispatch() packs the
// local groups' kept rows rank by rank into a wire buffer, exchanges them (all-to-all with variable
// counts: NCCL grouped send / recv on the device, any host group in host mode) and unpacks them
// into the held groups; combine() is the way back. The backward uses the same two moves on the gradients (the output
// rows' gradient dispatched, the input rows' gradient combined).
//
// Because the host reads the counts, a step with expert parallelism cannot be captured as a CUDA
// graph; the model refuses cuda_graph beside it.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "backends/cuda/model/memory_plan.h"
#include "parallel/process_group.h"
#include "turbo/core/arena.h"

namespace primus::parallel {
class NcclProcessGroup;
}

namespace primus::backends::cuda {

class EpComm {
 public:
  // ConfigError when a device model gets a group that is neither NCCL nor the threaded one, or the
  // experts do not split over the group.
  // held_rows: the held buffers' rows (MemoryPlan: ActivationBuffers::moe_held_rows); a routing
  // that would send this rank more is a RuntimeError (plan) naming moe_ep_buffer_factor.
  // local_rows: the local permuted rows' bound (ActivationBuffers::moe_rows).
  EpComm(parallel::ProcessGroup& group, const ModelStream& stream, int64_t num_experts, int64_t align,
         int64_t moe_layers, int64_t local_rows, int64_t held_rows);

  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t local_experts() const { return El_; }

  // Plans MoE layer i (its index among the MoE layers) from this micro-batch's local plan: kept
  // (i32 [E], model memory; the local groups' offsets follow from it and the alignment). Writes the
  // held groups' offsets (i32 [El + 1]) into held_offsets and returns the held rows.
  int64_t plan(int64_t i, const TensorView& kept, const TensorView& held_offsets);
  // local [M, W] rows in layer i's local groups -> held [Mh, W] in its held groups (padding rows
  // zeroed); send_wire / recv_wire [rows, >= W] staging (rows: held_rows_max).
  void dispatch(int64_t i, const TensorView& local, const TensorView& held, const TensorView& send_wire,
                const TensorView& recv_wire) const;
  // held [Mh, W] -> the kept rows of local [M, W] (its padding rows are left as they are).
  void combine(int64_t i, const TensorView& held, const TensorView& local, const TensorView& send_wire,
               const TensorView& recv_wire) const;

  // The gradients' reductions (CudaModel::grad_norm), in the model's stream order: t (f32) summed
  // over the ep group; t averaged over `group` (null or one rank: unchanged); t *= s (f32, or on
  // the device bf16: moe_expert_grad_dtype's), on `stream` (null: the model's; host mode: a loop).
  void sum(const TensorView& t) const;
  void mean(parallel::ProcessGroup* group, const TensorView& t) const;
  void scale(const TensorView& t, float s, cudaStream_t stream = nullptr) const;

 private:
  struct Plan {
    std::vector<size_t> send_rows, recv_rows;  // per rank
    int64_t local_rows = 0, held_rows = 0, sent = 0, received = 0;
  };
  // The row maps of MoE layer i (model memory): dst row r takes src row map[r] (-1: zeros).
  // pack: wire <- local kept rows; unpack: held <- wire (padding -1); back: wire <- held rows;
  // home: local <- wire (padding -1).
  TensorView map(int64_t i, int which) const;
  // dst rows [0, rows) from src by map (host: a loop; device: ep::gather_rows).
  void gather(const TensorView& dst, const TensorView& src, const TensorView& map, int64_t rows) const;
  void exchange(const TensorView& send, const std::vector<size_t>& send_rows, const TensorView& recv,
                const std::vector<size_t>& recv_rows, int64_t W) const;
  // src -> dst through the wire: to the experts' ranks (pack, exchange, unpack) or back (back,
  // exchange, home).
  void route(int64_t i, const TensorView& src, const TensorView& dst, const TensorView& send_wire,
             const TensorView& recv_wire, bool to_experts) const;

  parallel::ProcessGroup& group_;
  parallel::NcclProcessGroup* nccl_ = nullptr;
  ModelStream stream_;
  int rank_ = 0, size_ = 1;
  int64_t E_, El_, align_, local_cap_, held_cap_;
  std::vector<Plan> plans_;
  std::unique_ptr<turbo::Arena> map_arena_;
  TensorView maps_;  // i32 [layers, 2 x (local_cap_ + held_cap_)]
};

}  // namespace primus::backends::cuda
