// Reading the launch environment: torchrun and Slurm variables, which wins, Slurm's compressed
// host lists and task counts, and errors that name the offending variable.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "parallel/launch_env.h"
#include "tests/core/test_util.h"

namespace primus::parallel {
namespace {

using primus::testing::expect_error;
using Vars = std::map<std::string, std::string>;

DistEnv read(const Vars& vars) {
  return read_dist_env([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

TEST(LaunchEnv, NothingSetIsOneProcess) {
  DistEnv d = read({});
  EXPECT_EQ(d.source, "single");
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 1);
  EXPECT_EQ(d.local_rank, 0);
  EXPECT_EQ(d.local_world_size, 1);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  EXPECT_EQ(d.master_port, 29500);
  EXPECT_FALSE(d.distributed());
}

TEST(LaunchEnv, Torchrun) {
  DistEnv d = read({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                    {"GROUP_RANK", "1"}, {"MASTER_ADDR", "node-a"}, {"MASTER_PORT", "12345"},
                    {"PRIMUS_DIST_TIMEOUT", "2.5"}});
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_EQ(d.master_addr, "node-a");
  EXPECT_EQ(d.master_port, 12345);
  EXPECT_DOUBLE_EQ(d.timeout_s, 2.5);
  EXPECT_TRUE(d.distributed());
  EXPECT_EQ(describe(d), "rank 5/8 (local 1/4, node 1) via torchrun, store node-a:12345");
}

TEST(LaunchEnv, TorchrunMinimalMeansOneNode) {
  DistEnv d = read({{"RANK", "3"}, {"WORLD_SIZE", "4"}});
  EXPECT_EQ(d.local_rank, 3);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.node_rank, 0);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  // NODE_RANK (what primus launch sets) when GROUP_RANK is absent; derived when both are.
  EXPECT_EQ(read({{"RANK", "6"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                  {"NODE_RANK", "3"}})
                .node_rank,
            3);
  DistEnv derived = read({{"RANK", "6"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}});
  EXPECT_EQ(derived.node_rank, 1);
  EXPECT_EQ(derived.local_rank, 2);
}

TEST(LaunchEnv, Slurm) {
  DistEnv d = read({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"},
                    {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_JOB_NODELIST", "gpu[01-04,07],cpu3"},
                    {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(d.source, "slurm");
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_EQ(d.master_addr, "gpu01");
  EXPECT_EQ(d.master_port, 23456);  // 20000 + job id % 10000
}

TEST(LaunchEnv, SlurmUnevenNodesAndVariablePriority) {
  Vars v = {{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "2"},
            {"SLURM_TASKS_PER_NODE", "3,2(x2)"}, {"SLURM_NODELIST", "n[7-9]"}};
  DistEnv d = read(v);
  EXPECT_EQ(d.local_world_size, 2);
  EXPECT_EQ(d.master_addr, "n7");
  EXPECT_EQ(d.master_port, 29500);  // no job id
  v["SLURM_JOB_NODELIST"] = "j[3-4]";
  EXPECT_EQ(read(v).master_addr, "j3");
  v["SLURM_STEP_NODELIST"] = "s[05-06]";  // the step's nodes: where rank 0 of this srun runs
  EXPECT_EQ(read(v).master_addr, "s05");
  v["SLURM_NTASKS_PER_NODE"] = "3";
  EXPECT_EQ(read(v).local_world_size, 3);
  v["MASTER_ADDR"] = "explicit-host";
  v["MASTER_PORT"] = "4242";
  d = read(v);
  EXPECT_EQ(d.master_addr, "explicit-host");
  EXPECT_EQ(d.master_port, 4242);
}

TEST(LaunchEnv, TorchrunWinsOverSlurm) {
  // primus launch under srun: the ranks see both; the launcher's variables describe them.
  DistEnv d = read({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                    {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_NODELIST", "x[1-2]"}});
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
}

TEST(LaunchEnv, StorePortUnderTorchrunAgentStore) {
  Vars v = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29400"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  EXPECT_EQ(read(v).master_port, 29401);  // torch's agent holds 29400
  v["PRIMUS_STORE_PORT"] = "31000";
  EXPECT_EQ(read(v).master_port, 31000);
  EXPECT_EQ(read({{"PRIMUS_STORE_PORT", "31001"}}).master_port, 31001);
  expect_error<ConfigError>([] { read({{"PRIMUS_STORE_PORT", "0"}}); }, {"PRIMUS_STORE_PORT=0"});
}

TEST(LaunchEnv, ErrorsNameTheVariable) {
  expect_error<ConfigError>([] { read({{"RANK", "1"}}); }, {"RANK", "WORLD_SIZE"});
  expect_error<ConfigError>([] { read({{"WORLD_SIZE", "2"}}); }, {"WORLD_SIZE", "RANK"});
  expect_error<ConfigError>([] { read({{"RANK", "4"}, {"WORLD_SIZE", "4"}}); }, {"RANK=4", "WORLD_SIZE=4"});
  expect_error<ConfigError>([] { read({{"RANK", "x1"}, {"WORLD_SIZE", "4"}}); }, {"RANK='x1'", "not an integer"});
  expect_error<ConfigError>([] { read({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}); }, {"RANK"});
  expect_error<ConfigError>([] { read({{"RANK", "0"}, {"WORLD_SIZE", "0"}}); }, {"WORLD_SIZE=0", "out of range"});
  expect_error<ConfigError>([] { read({{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999"}}); }, {"WORLD_SIZE"});
  expect_error<ConfigError>([] { read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}}); },
                            {"LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"});
  expect_error<ConfigError>([] { read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}); },
                            {"LOCAL_WORLD_SIZE=3", "WORLD_SIZE=2"});
  expect_error<ConfigError>([] { read({{"RANK", "0"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}}); },
                            {"MASTER_ADDR", "spans nodes"});
  expect_error<ConfigError>([] { read({{"MASTER_PORT", "70000"}}); }, {"MASTER_PORT=70000"});
  expect_error<ConfigError>([] { read({{"MASTER_PORT", "80a"}}); }, {"MASTER_PORT='80a'"});
  expect_error<ConfigError>([] { read({{"MASTER_ADDR", ""}}); }, {"MASTER_ADDR", "empty"});
  expect_error<ConfigError>([] { read({{"PRIMUS_DIST_TIMEOUT", "-3"}}); }, {"PRIMUS_DIST_TIMEOUT='-3'"});
  expect_error<ConfigError>([] { read({{"PRIMUS_DIST_TIMEOUT", "10s"}}); }, {"PRIMUS_DIST_TIMEOUT"});
  expect_error<ConfigError>([] { read({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}}); },
                            {"SLURM_PROCID=3", "SLURM_NTASKS=2"});
  expect_error<ConfigError>(
      [] {
        read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NODEID", "2"}, {"SLURM_TASKS_PER_NODE", "2,2"}});
      },
      {"SLURM_NODEID=2", "SLURM_TASKS_PER_NODE", "2 nodes"});
  expect_error<ConfigError>(
      [] { read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_TASKS_PER_NODE", "2(x"}}); },
      {"SLURM_TASKS_PER_NODE", "2(x"});
  expect_error<ConfigError>(
      [] { read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "gpu[01-04"}}); },
      {"SLURM_JOB_NODELIST", "unbalanced"});
  expect_error<ConfigError>(
      [] { read({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "3"}, {"SLURM_NTASKS_PER_NODE", "2"}}); },
      {"SLURM_LOCALID=3", "SLURM_NTASKS_PER_NODE=2"});
}

TEST(Hostlist, Expansion) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_hostlist("node1"), V({"node1"}));
  EXPECT_EQ(expand_hostlist("gpu[01-04,07],cpu3"), V({"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"}));
  EXPECT_EQ(expand_hostlist("n[8-11]"), V({"n8", "n9", "n10", "n11"}));
  EXPECT_EQ(expand_hostlist("n[08-11]"), V({"n08", "n09", "n10", "n11"}));
  EXPECT_EQ(expand_hostlist("n[098-101]"), V({"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand_hostlist("x[007]"), V({"x007"}));
  EXPECT_EQ(expand_hostlist("r[1-2]n[1-2]"), V({"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(expand_hostlist("a[1-2]-ib,b"), V({"a1-ib", "a2-ib", "b"}));
  EXPECT_EQ(expand_hostlist("[3-4]"), V({"3", "4"}));
  EXPECT_EQ(first_host("gpu[01-04,07],cpu3"), "gpu01");
  EXPECT_EQ(first_host("r[2-3]n[09-10]-ib"), "r2n09-ib");
  EXPECT_EQ(first_host("cpu3,gpu[1-2]"), "cpu3");
}

TEST(Hostlist, ErrorsNameTheList) {
  for (const char* bad : {"gpu[01-04", "gpu01-04]", "gpu[4-1]", "gpu[a-b]", "gpu[]", "gpu[1-]", "a,,b", ",a", "g[[1]]"}) {
    SCOPED_TRACE(bad);
    expect_error<ConfigError>([&] { expand_hostlist(bad, "SLURM_NODELIST"); }, {"SLURM_NODELIST", bad});
  }
  expect_error<ConfigError>([] { first_host("", "SLURM_NODELIST"); }, {"SLURM_NODELIST", "empty"});
  expect_error<ConfigError>([] { expand_hostlist("n[1-1000]x[1-1000]", "L", 5000); }, {"more than 5000"});
}

// Random host lists, built alongside their expected expansion; first_host must agree with the
// expansion's first name without expanding.
TEST(Hostlist, RandomListsRoundTrip) {
  std::mt19937 rng(std::random_device{}());
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 200; ++trial) {
    std::string list;
    std::vector<std::string> want;
    int entries = uni(1, 4);
    for (int e = 0; e < entries; ++e) {
      std::string prefix = std::string(1, char('a' + uni(0, 25))) + (uni(0, 1) ? "node" : "g");
      std::string entry = prefix;
      std::vector<std::string> names;
      if (uni(0, 3) == 0) {
        names.push_back(prefix);
      } else {
        int width = uni(1, 4);
        entry += "[";
        int ranges = uni(1, 3), base = 0;
        for (int r = 0; r < ranges; ++r) {
          int lo = base + uni(0, 5), hi = lo + uni(0, 4);
          base = hi + 1;
          auto pad = [&](int v) {
            std::string s = std::to_string(v);
            return std::string(s.size() < size_t(width) ? width - s.size() : 0, '0') + s;
          };
          entry += (r ? "," : "") + pad(lo) + (hi != lo ? "-" + pad(hi) : "");
          for (int v = lo; v <= hi; ++v) {
            std::string s = std::to_string(v);
            std::string lo_s = pad(lo);  // the lower bound's width rules the range
            names.push_back(prefix + std::string(s.size() < lo_s.size() ? lo_s.size() - s.size() : 0, '0') + s);
          }
        }
        entry += "]";
      }
      list += (e ? "," : "") + entry;
      want.insert(want.end(), names.begin(), names.end());
    }
    SCOPED_TRACE(list);
    EXPECT_EQ(expand_hostlist(list), want);
    EXPECT_EQ(first_host(list), want.front());
  }
}

TEST(TasksPerNode, Forms) {
  EXPECT_EQ(parse_tasks_per_node("4(x2),3", "V"), std::vector<int>({4, 4, 3}));
  EXPECT_EQ(parse_tasks_per_node("8", "V"), std::vector<int>({8}));
  EXPECT_EQ(parse_tasks_per_node("1,2(x3),1", "V"), std::vector<int>({1, 2, 2, 2, 1}));
  for (const char* bad : {"", "0", "4(x)", "4(x2", "4x2", "a", "4(x0)", "4,"}) {
    SCOPED_TRACE(bad);
    expect_error<ConfigError>([&] { parse_tasks_per_node(bad, "SLURM_TASKS_PER_NODE"); }, {"SLURM_TASKS_PER_NODE"});
  }
}

}  // namespace
}  // namespace primus::parallel
