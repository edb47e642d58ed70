// The data-parallel gradient reducer for GPU models: one rank per GPU, each with a whole replica,
// each reading its own slice of every global batch; gradients averaged over the ranks by NCCL
// (NcclProcessGroup) in buckets that are launched while the backward pass is still running. It
// knows a replica only by its flat device buffers, its stream and its "gradients ready" points
// (ReplicaBuffers), so any model that reports those can be trained data-parallel.
//
// Buckets. The model's gradients are one flat fp32 buffer in train/param_layout.h order:
// embeddings, layers 0..L-1, final norm (and an untied head). The backward finishes them from
// the top down: the head and final norm first, then layer L-1 ... layer 0, the embeddings last.
// A "ready point" is an offset from which every gradient above is final for this step; the
// model reports each (e.g. backends/cuda/model/decoder.h: after the final norm, after each layer,
// 0 after the embedding) and the trainer forwards the reports to grads_ready(). plan_buckets() cuts the buffer at ready points into buckets of about
// `bucket_elems`; on the step's last micro-batch each bucket is launched on the group's stream
// (event-ordered after the model's work so far) as soon as its ready point is reported, so the
// reduction of layer l overlaps the backward of layers below it. The model's stream waits for
// the group's before the gradients are read again (clip, update, next zero_grad).
//
// Plain data parallelism: each bucket is all-reduced (average) in place; every rank then runs
// the model's own clip and AdamW on identical gradients.
//
// ZeRO-1 (use_distributed_optimizer): each bucket [b, e) is split into world_size equal chunks
// (bucket bounds are multiples of world_size * 64 elements; the flat buffers are padded to
// padded_total()); rank r reduce-scatters (average) the bucket into its chunk and alone keeps
// the fp32 master weights and AdamW moments of its chunks (a shard of 1/world_size of the
// model). The global grad norm is the square root of the ranks' summed squared shard norms;
// AdamW updates the shard and writes its bf16 weights into the model's flat bf16 buffer, and
// each bucket's bf16 chunks are all-gathered so every rank has every weight again. The model
// is then built without its own master weights and moments (CudaModelOptions). In checkpoints
// a rank's shard is the list of its chunks, clipped to the real elements (shard_segments(),
// parallel::FlatSharding): each rank writes and reads its own (parallel/dist_checkpoint.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "parallel/cuda/nccl_process_group.h"
#include "parallel/data_parallel.h"
#include "train/param_layout.h"
#include "turbo/core/arena.h"
#include "turbo/ops/optimizer.h"

namespace primus::parallel {

using turbo::TensorView;

// The GPU this process trains on. Under a multi-rank launch (WORLD_SIZE > 1): GPU LOCAL_RANK,
// or 0 when the process sees a single GPU (per-rank CUDA_VISIBLE_DEVICES); the config's
// `device` must then be 0 (ConfigError otherwise). A single process: `configured`.
int rank_device(int configured);

struct GradBucket {
  int64_t begin = 0, end = 0;  // flat element range [begin, end)
  int64_t ready_at = 0;        // launched once the ready point <= begin has been reported
};

// Cuts [0, total) at ready points (each rounded up to a multiple of `granule`) into buckets of
// at least `bucket_elems` elements (the last, at offset 0, may be smaller), top down. `total`
// must be a multiple of `granule`. Throws RuntimeError for inconsistent arguments.
std::vector<GradBucket> plan_buckets(const std::vector<int64_t>& ready_points, int64_t total, int64_t granule,
                                     int64_t bucket_elems);

// The flat element count the model's gradient and bf16 weight buffers need under ZeRO-1 with
// `world` ranks (a multiple of world * 64); plain DP needs layout.total.
int64_t zero1_padded_total(const train::ParamLayout& layout, int world);
inline int64_t zero1_granule(int world) { return int64_t{64} * world; }

// One model replica as the reducer sees it. The buffers are the replica's own, on this rank's
// GPU; the reducer reads and writes them in place.
struct ReplicaBuffers {
  const train::ParamLayout* layout = nullptr;  // tensors (offset, numel, weight decay); layout->total real elements
  TensorView grads;      // f32 [flat]: averaged over the ranks in place (ZeRO-1: this rank's chunks)
  TensorView weights;    // bf16 [flat]: ZeRO-1 writes its shard's and all-gathers the others
  TensorView grad_norm;  // f32 [2] {norm, clip factor}: ZeRO-1 writes the global ones there
  cudaStream_t stream = nullptr;      // the replica's stream: reductions are ordered after its work
  std::vector<int64_t> ready_points;  // the offsets it reports, in order, ending with 0
};

struct DataParallelOptions {
  bool zero1 = false;
  int64_t bucket_elems = 10'000'000;  // ddp_bucket_size
  bool overlap = true;                // false: every bucket after the backward (for comparison)
  // Reduce in bf16: each bucket is cast to bf16 on the group's stream, reduced (half the bytes
  // on the wire; NCCL rounds each sum to bf16) and cast back into the fp32 gradients.
  bool bf16_reduce = false;
};

class DataParallel {
 public:
  // For ZeRO-1 the model must have been built with padded flat buffers (zero1_padded_total) and
  // no optimizer state, and set_state() must give the shard its weights before the first step.
  DataParallel(const ReplicaBuffers& model, NcclProcessGroup& pg, const DataParallelOptions& opt);
  ~DataParallel();

  // Before each micro-batch's backward: `last` arms the bucket launches (earlier micro-batches
  // only accumulate).
  void begin_backward(bool last) { armed_ = last; }
  // The replica's report that every gradient from `offset` up is final for this micro-batch: on
  // the armed (last) micro-batch, launches the buckets above it (with overlap).
  void grads_ready(int64_t offset) {
    if (armed_ && opt_.overlap) on_ready(offset);
  }
  // After the last micro-batch's backward: launches what is left, and orders the model's stream
  // after the reductions.
  void end_backward();

  // The means over the ranks of a few host values (the loss, a stop flag); synchronising.
  std::vector<double> average(const std::vector<double>& local);

  // ZeRO-1 only: the global grad norm and clip factor into the model's grad_norm_buffer() (so
  // model.read_grad_norm() reads it), then AdamW on the shard and the all-gather of the bf16
  // weights (the model's stream waits for it).
  void grad_norm(float max_norm);
  void update(const turbo::AdamWHyper& hp);

  // ZeRO-1 only. The flat elements rank `rank`'s shard holds: its chunk of every bucket, in the
  // shard buffer's order, clipped to layout().total (the padding is not state), empty ones left
  // out (parallel::bucket_chunk_segments). A checkpoint stores each rank's shard as these segments.
  std::vector<parallel::FlatSegment> shard_segments(int rank) const;
  int64_t owned_elems() const;  // elements of this rank's segments: what read_shard/write_shard move

  // ZeRO-1 only, local (no collective): this rank's fp32 master weights and AdamW moments to /
  // from host arrays holding the elements of shard_segments(rank) concatenated (owned_elems()
  // floats each). nullptr: that array is skipped (read_shard) or zero (write_shard); write_shard
  // zeroes the padding.
  void read_shard(float* master, float* m, float* v);
  void write_shard(const float* master, const float* m, const float* v);
  // ZeRO-1 only, local: the shard from full host arrays (layout().total floats each; nullptr:
  // zeros), e.g. the initial weights.
  void set_state(const float* master, const float* m, const float* v);

  // ZeRO-1 only, collective (every rank calls it; the bug fixed in ae5ecea was a rank skipping
  // gathers the others waited in): the full fp32 master weights (layout().total floats) into
  // `master` on the ranks that pass one, nullptr on the others. One all-gather per bucket of the
  // master weights alone: the moments stay sharded.
  void gather_master(float* master);

  // Collective: every rank's `bytes` host bytes at `send` into `recv` (bytes x world, rank order),
  // staged through the device for NCCL (parallel::HostAllGather, for the checkpoint's shard digests).
  void all_gather_host(const void* send, void* recv, size_t bytes);

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  int64_t shard_elems() const { return shard_; }
  size_t optimizer_bytes() const;  // device bytes of this rank's master weights and moments
  size_t device_bytes() const;     // everything this object allocated on the device

 private:
  void on_ready(int64_t offset);
  void launch(const GradBucket& b);
  int64_t chunk(const GradBucket& b) const { return (b.end - b.begin) / world_; }
  // This rank's segments with where each starts in its shard buffers.
  struct OwnedPiece {
    int64_t shard;
    parallel::FlatSegment seg;
  };
  std::vector<OwnedPiece> owned_pieces() const;

  ReplicaBuffers model_;
  NcclProcessGroup& pg_;
  DataParallelOptions opt_;
  int rank_ = 0, world_ = 1;
  std::vector<GradBucket> buckets_;
  size_t next_ = 0;  // buckets_[0, next_) launched this step
  bool armed_ = false;
  // ZeRO-1
  int64_t shard_ = 0;                    // elements of this rank's shard (sum of its chunks)
  std::vector<int64_t> shard_offset_;    // per bucket: where its chunk starts in the shard
  std::unique_ptr<turbo::Arena> state_;  // shard master / m / v, norm, descriptor table
  std::unique_ptr<turbo::Arena> scratch_;
  TensorView master_, m_, v_, norm_;
  std::unique_ptr<turbo::MultiTensorAdamW> adamw_;
  void* stage_ = nullptr;  // bf16 staging of one bucket (bf16_reduce)
  float* scalar_ = nullptr;  // average()'s device floats (kMaxAverage)
  static constexpr size_t kMaxAverage = 16;
};

}  // namespace primus::parallel
