// What `primus launch` tells each rank, read back the way a rank reads it: for random node
// counts, sizes and positions, every rank lands where the launcher put it.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "parallel/launch_env.h"
#include "parallel/launcher.h"

namespace primus::parallel {
namespace {

DistEnv read_back(const std::vector<std::string>& vars) {
  std::map<std::string, std::string> m;
  for (auto& kv : vars) m[kv.substr(0, kv.find('='))] = kv.substr(kv.find('=') + 1);
  return read_dist_env([&](const std::string& name) -> std::optional<std::string> {
    auto it = m.find(name);
    if (it == m.end()) return std::nullopt;
    return it->second;
  });
}

TEST(RankEnvironment, RoundTripsThroughReadDistEnv) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 100; ++trial) {
    LaunchOptions o;
    o.nnodes = 1 + rng() % 8;
    o.nproc_per_node = 1 + rng() % 8;
    o.node_rank = rng() % o.nnodes;
    o.master_addr = "node" + std::to_string(rng() % 100);
    o.master_port = 1024 + rng() % 60000;
    o.timeout_s = trial % 2 ? 0 : 1 + rng() % 600;
    int local = rng() % o.nproc_per_node;
    DistEnv d = read_back(rank_environment(o, local));
    SCOPED_TRACE(describe(d));
    EXPECT_EQ(d.source, "torchrun");
    EXPECT_EQ(d.rank, o.node_rank * o.nproc_per_node + local);
    EXPECT_EQ(d.world_size, o.nnodes * o.nproc_per_node);
    EXPECT_EQ(d.local_rank, local);
    EXPECT_EQ(d.local_world_size, o.nproc_per_node);
    EXPECT_EQ(d.node_rank, o.node_rank);
    EXPECT_EQ(d.master_addr, o.master_addr);
    EXPECT_EQ(d.master_port, o.master_port);
    EXPECT_DOUBLE_EQ(d.timeout_s, o.timeout_s > 0 ? o.timeout_s : DistEnv{}.timeout_s);
  }
}

}  // namespace
}  // namespace primus::parallel
