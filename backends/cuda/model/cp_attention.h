// Context parallelism in the CUDA model: causal attention over sequences split across the ranks
// of a group, load-balanced as Megatron splits them (the sequence cut into 2 x cp chunks, rank r
// holding chunks r and 2cp - 1 - r, so every rank has the same share of the causal triangle).
//
// Token layout. A rank's micro-batch is its two chunks of each of B sequences, slot-major: rows
// [0, B Tc) chunk r of sequence 0, 1, ..., rows [B Tc, 2 B Tc) chunk 2cp - 1 - r of each (Tc =
// T / 2cp), given to the model as a batch of 2B rows of Tc tokens (train/context_parallel.h cuts
// them). Everything but the attention works row by row and needs nothing else; positions (RoPE,
// learned positions) are the chunks' global ones (positions()).
//
// Attention: ring attention, as Megatron's p2p context parallelism. The post-RoPE k|v of each rank
// pass around the group (r -> r + 1) cp - 1 times, so every rank meets every key chunk once;
// each ring step is sent while the step's products run (NCCL: on the group's stream). A local
// query chunk c attends to each key chunk j <= c it meets: the diagonal causally, earlier ones
// whole, one attention call each, the partial outputs merged by their log-sum-exp in fp32. The
// backward walks the ring again, running the attention backward of the same pairs with the merged
// output and log-sum-exp (which makes each pair's softmax the global one): dq accumulates here in
// fp32, and each chunk pair's dk|dv into an fp32 gradient that travels with its k|v and, after
// the last step, arrives at the owner. The weights' gradients of each rank cover its own tokens:
// the model averages them over the group (all_reduce_mean) before the norm.
#pragma once
#include <cstdint>

#include "backends/cuda/hooks.h"
#include "backends/cuda/model/memory_plan.h"
#include "parallel/process_group.h"

namespace primus::parallel {
class NcclProcessGroup;
}

namespace primus::backends::cuda {

class CpAttention {
 public:
  // Throws ConfigError when a device model gets a group that is neither NCCL nor the threaded one.
  CpAttention(parallel::ProcessGroup& group, const ActivationBuffers& acts, const CudaOps& ops,
              const ModelStream& stream, int64_t heads, int64_t kv_heads, int64_t head_dim);

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The global chunk of slot s (0, 1) of this rank.
  int64_t chunk(int s) const { return s == 0 ? rank_ : 2 * size_ - 1 - rank_; }
  // i32 [B2, Tc] positions of a micro-batch of B2 = 2B rows of Tc tokens (uploaded when the shape
  // changes, stream-ordered).
  TensorView positions(int64_t B2, int64_t Tc);
  // att [B2*Tc, QD] and lse [B2, H, Tc] of the local queries, from the packed qkv [B2*Tc, QD + 2KVD]
  // (q|k after RoPE).
  void forward(const TensorView& att, const TensorView& lse, const TensorView& qkv, int64_t B2, int64_t Tc,
               float scale, const ExecContext& ctx);
  // dq [B2*Tc rows, QD], dk, dv [.., KVD] (row-strided column views, overwritten) from datt, the
  // saved qkv, att and lse.
  void backward(const TensorView& dq, const TensorView& dk, const TensorView& dv, const TensorView& datt,
                const TensorView& qkv, const TensorView& att, const TensorView& lse, int64_t B2, int64_t Tc, float scale,
                const ExecContext& ctx);
  // t (f32 or bf16) averaged over the group in place (the weights' gradients).
  void all_reduce_mean(const TensorView& t) const;
  // t (f32) summed over the group in place (an MoE layer's token counts).
  void all_reduce_sum(const TensorView& t) const;

 private:
  template <class F>
  void ordered(F&& call) const;
  // The global chunk of `owner`'s slot (0, 1).
  int64_t slot_chunk(int64_t owner, int slot) const;
  // One ring step: send to rank r + 1 while rank r - 1's arrives in recv (issued in the model's
  // stream order; await_group before reading recv).
  void exchange(const TensorView& send, const TensorView& recv) const;
  // This rank's k|v columns of qkv, dense, into dst [N, 2KVD].
  void own_kv(const TensorView& qkv, const TensorView& dst, const ExecContext& ctx) const;
  TensorView heads4(const TensorView& rows, int64_t B, int64_t Tc, int64_t col, int64_t n) const;

  parallel::ProcessGroup& group_;
  parallel::NcclProcessGroup* nccl_ = nullptr;
  const ActivationBuffers& a_;
  CudaOps ops_;
  ModelStream stream_;
  int rank_ = 0, size_ = 1;
  int64_t H_, KV_, D_;
  int64_t pos_B2_ = -1, pos_Tc_ = -1;
};

}  // namespace primus::backends::cuda
