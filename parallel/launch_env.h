// Where this process stands in a multi-process job, read from the environment the way clusters
// launch jobs: torchrun's variables (also what `primus launch` sets), else Slurm's (srun with one
// task per GPU), else a single process. Every malformed or inconsistent value is an error that
// names the variable, because a rank that guesses wrong hangs at rendezvous instead of failing.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace primus::parallel {

struct DistEnv {
  int rank = 0;              // global rank, 0 <= rank < world_size
  int world_size = 1;        // processes in the whole job
  int local_rank = 0;        // rank on this node; picks the GPU
  int local_world_size = 1;  // processes on this node
  int node_rank = 0;         // index of this node
  std::string master_addr = "127.0.0.1";  // host of rank 0's TCP store
  int master_port = 29500;                // the store's port, 1..65535
  double timeout_s = 300;    // rendezvous / collective timeout (PRIMUS_DIST_TIMEOUT), seconds
  std::string source = "single";  // "torchrun" | "slurm" | "single"

  bool distributed() const { return world_size > 1; }
};

// Returns the variable's value, or nullopt when it is not set. An empty value counts as set.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Reads the process environment (getenv).
DistEnv read_dist_env();
// Same rules over any lookup (tests pass a map). Throws ConfigError naming the variable.
//   torchrun: RANK and WORLD_SIZE (both or neither); LOCAL_RANK, LOCAL_WORLD_SIZE (default: one
//             node, so WORLD_SIZE and RANK), GROUP_RANK or NODE_RANK (default rank / local size),
//             MASTER_ADDR (required when the job spans nodes), MASTER_PORT.
//   Slurm:    SLURM_PROCID and SLURM_NTASKS; SLURM_LOCALID; tasks on this node from
//             SLURM_NTASKS_PER_NODE, else SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE
//             ("4(x2),3") at SLURM_NODEID; MASTER_ADDR, else the first host of
//             SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST; MASTER_PORT, else
//             20000 + SLURM_JOB_ID % 10000 (two jobs sharing a node do not collide), else 29500.
//   single:   rank 0 of 1 on 127.0.0.1:29500 (MASTER_ADDR / MASTER_PORT still apply).
// PRIMUS_STORE_PORT, when set, is the store's port in every mode. Under torchrun with its agent
// store (TORCHELASTIC_USE_AGENT_STORE=True) MASTER_PORT is taken by torch's store, so ours uses
// MASTER_PORT + 1. PRIMUS_DIST_TIMEOUT (seconds) sets timeout_s.
DistEnv read_dist_env(const EnvLookup& env);

// Slurm's compressed host lists: "gpu[01-04,07],cpu3" -> gpu01 gpu02 gpu03 gpu04 gpu07 cpu3.
// Several bracket groups in one name multiply ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2); a range
// keeps the width of its lower bound ("[08-10]" -> 08 09 10, "[8-10]" -> 8 9 10).
// `what` names the variable in errors (ConfigError). At most `max_hosts` names are produced.
std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what = "host list",
                                         size_t max_hosts = 1 << 20);
// The first name of a host list, without expanding the rest.
std::string first_host(const std::string& list, const std::string& what = "host list");

// Slurm's per-node task counts: "4(x2),3" -> {4, 4, 3}. Throws ConfigError naming `what`.
std::vector<int> parse_tasks_per_node(const std::string& value, const std::string& what);

// One line for logs: "rank 3/8 (local 1/4, node 1) via torchrun, store 10.0.0.1:29500".
std::string describe(const DistEnv& env);

}  // namespace primus::parallel
