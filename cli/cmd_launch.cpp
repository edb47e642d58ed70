// primus launch: start this node's ranks of a multi-process job (torchrun-style variables),
// relay their output, forward signals, and stop everything when one rank fails. See
// docs/launch.md and parallel/launcher.h for the policy.
#ifdef PRIMUS_PARALLEL
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "cli/command.h"
#include "parallel/launcher.h"

namespace primus::cli {
namespace {

void setup_launch(CLI::App& sub) {
  auto o = std::make_shared<parallel::LaunchOptions>();
  sub.add_option("--nproc-per-node,--nproc_per_node", o->nproc_per_node, "Ranks to start on this node (one per GPU)")
      ->capture_default_str();
  sub.add_option("--nnodes", o->nnodes, "Nodes in the job; run one launcher per node")->capture_default_str();
  sub.add_option("--node-rank,--node_rank", o->node_rank, "Index of this node, 0 .. nnodes-1")->capture_default_str();
  sub.add_option("--master-addr,--master_addr", o->master_addr,
                 "Host of node 0, where rank 0 hosts the rendezvous store (default 127.0.0.1; required with --nnodes > 1)");
  sub.add_option("--master-port,--master_port", o->master_port,
                 "Port of the rendezvous store (default: a free port on one node, 29500 across nodes)");
  sub.add_option("--timeout", o->timeout_s,
                 "Seconds a rank waits at rendezvous and collectives before failing (sets PRIMUS_DIST_TIMEOUT)");
  sub.add_option("--grace", o->grace_s, "Seconds between SIGTERM and SIGKILL for the other ranks after one fails")
      ->capture_default_str();
  sub.add_option("--log-dir", o->log_dir, "Write rank K's output to LOG_DIR/rank_K.log instead of prefixed lines");
  sub.add_option("--exec", o->exec, "Run this program instead of primus (for tests and wrapper scripts)");
  sub.add_option("command", o->args, "The primus subcommand and its arguments, after '--'");
  sub.footer("Example: primus launch --nproc-per-node 8 -- train pretrain --config exp.yaml");
  sub.callback([o] {
    int rc = parallel::run_launcher(*o);
    if (rc != 0) {
      // The failing rank's exit code is the launcher's; main() only knows the codes of errors.
      std::fflush(nullptr);
      std::exit(rc);
    }
  });
}

CommandRegistrar reg_launch({"launch", "Start this node's ranks of a multi-process job (torchrun-style)",
                             setup_launch});

}  // namespace
}  // namespace primus::cli
#endif  // PRIMUS_PARALLEL
