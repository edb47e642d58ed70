// Checkpoints of a data-parallel job, on top of io/checkpoint (same folder layout, same atomic
// install, same manifest with checksums):
//
//  - plain data parallelism: every rank holds the same weights and optimizer state, so rank 0
//    writes the checkpoint exactly as a single process does; the others wait for it.
//  - ZeRO-1: every rank writes its shard of the flat optimizer state (exp_avg, exp_avg_sq, ...)
//    as optimizer.rank0000R-of-0000W.safetensors, staged in the save folder; rank 0 then writes
//    the weights (once) and the trainer state, and adopts the shard files into the checkpoint
//    before its manifest is written, so a crash at any moment leaves the previous checkpoint as
//    it was. optimizer.safetensors is then empty.
//
// A rank's shard is a list of segments of the flat buffer (FlatSharding): one contiguous range
// for the reference trainer (ShardLayout), one chunk per gradient bucket for the cuda trainer.
// Each tensor of a shard file holds the rank's segments concatenated in list order.
//
// manifest.json's "sharding" says how it was saved: {"world_size": W, "scheme": "none"} or
// {"world_size": W, "scheme": "zero1", "total": N, "tensors": [...],
//  "shards": [{"rank": r, "file": ..., "elements": n, "segments": [[b, e], ...]}, ...]}
// (elements [b, e) of the flat buffer; a shard of exactly one segment also carries "begin" and
// "end", the only form checkpoints written before segments have). Each shard file's metadata
// repeats its rank, world size, total and segments. On load the segments are checked (inside
// [0, N), no overlap, together exactly [0, N), each file's tensors as long as its segments, the
// file's metadata agreeing with the manifest), and errors name the checkpoint and the file.
// A checkpoint loads at any world size, sharded or not: read_flat_states assembles any windows
// from whichever shards cover them, verifying each shard file it reads.
#pragma once
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "parallel/process_group.h"
#include "io/checkpoint.h"
#include "parallel/data_parallel.h"

namespace primus::parallel {

// One flat fp32 state tensor: this rank's shard of it (its segments' elements, concatenated).
struct FlatShard {
  std::string name;
  const float* data = nullptr;
};

// Which elements of a flat state of `total` elements each rank's shard holds: ranks[r] lists
// rank r's segments in the order its shard (and its file) stores them. Every rank passes the
// same FlatSharding, describing all ranks.
struct FlatSharding {
  int64_t total = 0;
  std::vector<std::vector<FlatSegment>> ranks;
  int world() const { return static_cast<int>(ranks.size()); }
  int64_t count(int rank) const;  // elements of rank's shard: the sum of its segment sizes
};

// The sharding of a ShardLayout: one segment per rank (none for a rank that owns nothing).
FlatSharding flat_sharding(const ShardLayout& layout);

// "" when the segments are inside [0, total), non-empty, do not overlap and together cover
// [0, total) exactly; otherwise what is wrong, naming the rank (and `file_of(rank)` when given).
std::string check_flat_sharding(const FlatSharding& s, const std::function<std::string(int)>& file_of = {});

// The shard file of `rank` in a checkpoint saved by `world` ranks.
std::string shard_file_name(int rank, int world);

// Moves a few host bytes between the ranks: every rank's `bytes` bytes at `send`, into `recv`
// (bytes x world) in rank order, called by every rank. Default (empty): pg.all_gather on the
// host buffers, right for the socket and single-process groups; a group on device memory
// (NCCL) passes one that stages through the device (NcclProcessGroup::all_gather_host).
using HostAllGather = std::function<void(const void* send, void* recv, size_t bytes)>;

// Collective: every rank calls it with the same iteration and the same sharding. `data` is what
// rank 0 saves (model and trainer state, plus the full optimizer state when `sharding` is null);
// other ranks' `data` is not read. With `sharding` non-null (ZeRO-1) every rank writes `shards`,
// each holding sharding->count(rank) floats. A rank whose shard file cannot be written makes
// every rank throw (after the exchange every rank joins), naming that rank. Returns the
// checkpoint's folder once it is installed on every rank.
std::filesystem::path save_data_parallel(parallel::ProcessGroup& pg, const std::filesystem::path& save_dir,
                                         int64_t iteration, const io::CheckpointData& data,
                                         const FlatSharding* sharding, const std::vector<FlatShard>& shards,
                                         io::SaveOptions opts, const HostAllGather& gather = {});
// The same with a contiguous ShardLayout (null: no ZeRO-1).
std::filesystem::path save_data_parallel(parallel::ProcessGroup& pg, const std::filesystem::path& save_dir,
                                         int64_t iteration, const io::CheckpointData& data,
                                         const ShardLayout* layout, const std::vector<FlatShard>& shards,
                                         io::SaveOptions opts);

// Fills dsts[i] with the elements of `windows` (concatenated, in order) of flat state names[i]
// (of `total` elements) from a checkpoint loaded with io::load_checkpoint(dir, false), whichever
// world size and sharding saved it. Each shard file needed is read and verified once.
// FormatError naming the folder and the file (and the rank whose shard is missing, corrupt or
// inconsistent), or when the checkpoint's flat buffer has another size.
void read_flat_states(const io::CheckpointData& data, const std::filesystem::path& dir,
                      const std::vector<std::string>& names, int64_t total, const std::vector<FlatSegment>& windows,
                      const std::vector<float*>& dsts);
// One window [begin, end).
void read_flat_states(const io::CheckpointData& data, const std::filesystem::path& dir,
                      const std::vector<std::string>& names, int64_t total, int64_t begin, int64_t end,
                      const std::vector<float*>& dsts);

// The world size a checkpoint was saved at (1 for checkpoints from before data parallelism).
int saved_world_size(const io::CheckpointData& data);

}  // namespace primus::parallel
