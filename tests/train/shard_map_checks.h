// The checks every ModelShardMap (train/shard_map.h) must pass, shared by the tensor- and
// expert-parallel tests: each rank's pieces tile its local buffer in order, and the ranks' owned
// pieces together tile the global buffer exactly once, so a global buffer of distinct values cut
// by every rank and put back (owned pieces only, summed) is unchanged. `map_of(r)` builds rank r's map.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "train/shard_map.h"

namespace primus::testing {

inline void expect_pieces_tile(int ranks, const std::function<std::unique_ptr<train::ModelShardMap>(int)>& map_of,
                               const std::string& what) {
  std::unique_ptr<train::ModelShardMap> first = map_of(0);
  const train::ParamLayout& G = first->global_layout();
  std::vector<int> covered(static_cast<size_t>(G.total), 0);
  std::vector<float> global(static_cast<size_t>(G.total));
  std::iota(global.begin(), global.end(), 1.f);  // every element distinct
  std::vector<float> rebuilt(global.size(), 0.f);
  for (int r = 0; r < ranks; ++r) {
    const std::unique_ptr<train::ModelShardMap> map = r == 0 ? std::move(first) : map_of(r);
    const int64_t local_total = map->local_layout().total;
    int64_t at = 0;
    for (const train::TpPiece& p : map->pieces()) {
      EXPECT_EQ(p.local, at) << what << " rank " << r;
      at += p.count;
    }
    EXPECT_EQ(at, local_total) << what << " rank " << r;
    std::vector<float> local(static_cast<size_t>(local_total), 0.f);
    map->to_local(global.data(), local.data());
    std::vector<float> mine(global.size(), 0.f);
    map->to_global(local.data(), mine.data(), /*owned_only=*/true);
    for (size_t i = 0; i < mine.size(); ++i) {
      if (mine[i] != 0.f) {
        ++covered[i];
        rebuilt[i] += mine[i];
      }
    }
    EXPECT_EQ(map->owned_pieces_of(r).size(), map->owned_pieces().size()) << what << " rank " << r;
  }
  for (size_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1) << what << " element " << i;
  EXPECT_EQ(rebuilt, global) << what;
}

}  // namespace primus::testing
