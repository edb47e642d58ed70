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
// manifest.json's "sharding" says how it was saved: {"world_size": W, "scheme": "none"} or
// {"world_size": W, "scheme": "zero1", "total": N, "padded": P, "shard": S, "tensors": [...],
//  "shards": [{"rank": r, "file": ..., "begin": b, "end": e}, ...]} (elements [b, e) of the flat
// buffer). A checkpoint loads at any world size, sharded or not: read_flat_states assembles any
// range from whichever shards cover it, verifying each shard file it reads.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "io/checkpoint.h"
#include "train/data_parallel.h"

namespace primus::train {

// One flat fp32 state tensor: this rank's shard of it (layout.valid_count(rank) elements).
struct FlatShard {
  std::string name;
  const float* data = nullptr;
};

// The shard file of `rank` in a checkpoint saved by `world` ranks.
std::string shard_file_name(int rank, int world);

// Collective (host buffers: a SocketProcessGroup or SingleProcessGroup, see data_parallel.h):
// every rank calls it with the same iteration. `data` is what rank 0 saves (model
// and trainer state, plus the full optimizer state when `shards` is empty); other ranks' `data`
// is not read. With `layout` non-null (ZeRO-1) every rank writes `shards`. Returns the
// checkpoint's folder once it is installed on every rank.
std::filesystem::path save_data_parallel(dist::ProcessGroup& pg, const std::filesystem::path& save_dir,
                                         int64_t iteration, const io::CheckpointData& data,
                                         const ShardLayout* layout, const std::vector<FlatShard>& shards,
                                         io::SaveOptions opts);

// Fills dsts[i] with elements [begin, end) of flat state names[i] (of `total` elements) from a
// checkpoint loaded with io::load_checkpoint(dir, false), whichever world size saved it.
// FormatError naming the folder, the file and the rank whose shard is missing or corrupt, or
// when the checkpoint's flat buffer has another size.
void read_flat_states(const io::CheckpointData& data, const std::filesystem::path& dir,
                      const std::vector<std::string>& names, int64_t total, int64_t begin, int64_t end,
                      const std::vector<float*>& dsts);

// The world size a checkpoint was saved at (1 for checkpoints from before data parallelism).
int saved_world_size(const io::CheckpointData& data);

}  // namespace primus::train
