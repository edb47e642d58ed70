// Data parallelism as every backend's trainer sees it, independent of where buffers live: the
// config keys, which samples of each global batch a rank reads, the ZeRO-1 shard of a flat
// buffer each rank owns, the step's global loss and gradient norm, and which rank writes logs.
// The collectives themselves are parallel::ProcessGroup's (Gloo or NCCL).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config/schema.h"
#include "core/config/value.h"
#include "data/dataset/batch_iterator.h"
#include "parallel/process_group.h"

namespace primus::parallel {

// ---- config ----

struct DataParallelArgs {
  // ZeRO-1: use_distributed_optimizer, or data_parallel_sharding_strategy: optim.
  bool distributed_optimizer = false;
  // ddp_bucket_size_mb: gradient reduction granularity. 160 MiB = 40M fp32 elements, Megatron-LM's
  // default bucket; on 2 H200s it scaled 1.90x where 25 MiB gave 1.87-1.89x (docs/performance.md).
  double bucket_size_mb = 160;
  int64_t bucket_elements = 0;  // ddp_bucket_size (Megatron-LM's, in elements): wins when > 0
  // Reads the keys add_data_parallel_schema declares and data_parallel_sharding_strategy
  // (add_parallel_schema's); a schema without them keeps the defaults.
  static DataParallelArgs from_config(const config::Value& params);
  // Elements of `elem_bytes` in one bucket (at least 1): ddp_bucket_size, else ddp_bucket_size_mb's.
  int64_t bucket_elems(size_t elem_bytes) const;
};

// use_distributed_optimizer, ddp_bucket_size_mb.
void add_data_parallel_schema(config::Schema& s);

// ---- which samples a rank reads ----

// Samples [first, first + count) of a global batch.
struct BatchSlice {
  int64_t first = 0, count = 0;
};

// Rank r of `world` reads the r-th contiguous slice of every global batch, so the ranks' slices
// in rank order are the global batch a single process reads. ConfigError when global_batch is
// not a multiple of world.
BatchSlice rank_batch_slice(int64_t global_batch, int rank, int world);

// Reads this rank's slice of each global batch in micro-batches from an iterator built for one
// rank (dp_size 1): micro-batch m of rank r is samples [r*G/W + m*B, r*G/W + (m+1)*B) of the
// global batch at the iterator's position. The iterator's position counts global samples, so a
// checkpoint saved at one world size resumes at another.
class RankBatchReader {
 public:
  // ConfigError when global_batch is not world x micro_batch x (a whole number of micro-batches).
  RankBatchReader(int64_t global_batch, int64_t micro_batch, int rank, int world);
  int64_t micro_batches() const { return slice_.count / micro_; }  // gradient accumulation steps
  const BatchSlice& slice() const { return slice_; }
  // Writes micro-batch `micro` ([micro_batch][seq_length+1] int32) to out.
  void read(const data::BatchIterator& it, int64_t micro, int32_t* out) const;
  // Moves the iterator past the global batch; every rank calls it once per step.
  void finish_step(data::BatchIterator& it) const { it.skip(static_cast<uint64_t>(global_)); }

 private:
  int64_t global_, micro_;
  BatchSlice slice_;
};

// ---- ZeRO-1 ----

// The shards of a flat buffer of `total` elements: padded to a multiple of world x align, rank r
// owns [begin(r), end(r)) of the padded buffer, of which [begin(r), valid_end(r)) are real
// elements (the padding sits at the end of the last shards and is never read as data).
struct ShardLayout {
  int64_t total = 0, padded = 0, shard = 0;
  int world = 1;
  int64_t begin(int rank) const { return shard * rank; }
  int64_t end(int rank) const { return shard * (rank + 1); }
  int64_t valid_end(int rank) const;
  int64_t valid_count(int rank) const { return valid_end(rank) - begin(rank); }
};
// align: shard sizes become multiples of it (e.g. 64 so that device shards stay aligned).
ShardLayout shard_layout(int64_t total, int world, int64_t align = 1);

// Elements [begin, end) of a flat buffer.
struct FlatSegment {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const FlatSegment&) const = default;
};

// The real elements rank `rank` owns under a ShardLayout: [begin, valid_end), none when empty.
std::vector<FlatSegment> layout_segments(const ShardLayout& l, int rank);

// The real elements rank `rank` of `world` owns under per-bucket ZeRO-1 shards (the cuda
// trainer's, Megatron style): each bucket [b, e) of a flat buffer padded past `total` is cut into
// `world` equal chunks and the rank owns chunk `rank` of every bucket. One segment per bucket, in
// the order of `buckets` (the order of the rank's shard buffer), clipped to [0, total), empty
// ones left out. RuntimeError when a bucket's size is not a multiple of world.
std::vector<FlatSegment> bucket_chunk_segments(const std::vector<FlatSegment>& buckets, int64_t total, int rank,
                                               int world);

// ---- step statistics across ranks ----
// These pass host buffers to the group: use a Gloo (or socket) group / SingleProcessGroup (an NCCL
// group takes device pointers; a trainer on NCCL can keep a Gloo group from the same store
// for such small host-side exchanges).

// Sum over ranks of a double, bit-identical on every rank and summed in rank order in double
// (the values travel exactly, as two floats each).
double global_sum(parallel::ProcessGroup& pg, double local);
// Mean over ranks (each rank's value being the mean over equal-sized slices: the global mean).
inline double global_mean(parallel::ProcessGroup& pg, double local) { return global_sum(pg, local) / pg.world_size(); }
// sqrt of the sum over ranks of each rank's sum of squares (of its shard of the gradient).
double global_norm(parallel::ProcessGroup& pg, double local_sum_squares);

// ---- which rank writes ----

// Rank 0 writes logs, metrics, TensorBoard events and the checkpoint tracker.
inline bool writes_logs(int rank) { return rank == 0; }
// On ranks other than 0 only warnings and errors are printed (rank 0 reports for everyone).
void configure_rank_logging(int rank, int world);

}  // namespace primus::parallel
