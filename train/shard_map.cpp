#include "train/shard_map.h"

#include <algorithm>

namespace primus::train {

void ModelShardMap::to_local(const float* global, float* local) const {
  for (const TpPiece& p : pieces_) std::copy_n(global + p.global, p.count, local + p.local);
}

void ModelShardMap::to_global(const float* local, float* global, bool owned_only) const {
  for (const TpPiece& p : owned_only ? owned_pieces() : pieces_) std::copy_n(local + p.local, p.count, global + p.global);
}

}  // namespace primus::train
