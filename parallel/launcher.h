// The local launcher behind `primus launch`: starts this node's ranks with torchrun-style
// variables, relays their output, forwards signals, and stops the whole node's job when one rank
// fails. One launcher runs per node; ranks of all nodes meet at MASTER_ADDR:MASTER_PORT.
//
// Policy, in order:
//   - every rank exits 0                -> exit 0
//   - a rank exits non-zero or dies by a signal (the first one seen is "the failing rank"):
//     SIGTERM to every other rank's process group, SIGKILL to what is left after grace_s,
//     a line naming the rank and its exit code or signal, and the launcher exits with the
//     rank's exit code (128 + signal when it died by one)
//   - SIGINT / SIGTERM / SIGUSR1 / SIGHUP to the launcher are forwarded to every running rank;
//     the launcher then waits for the ranks and applies the rules above (a trainer that
//     checkpoints on SIGTERM and exits 0 makes the launcher exit 0).
#pragma once
#include <string>
#include <vector>

namespace primus::parallel {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;  // empty: 127.0.0.1, allowed only when nnodes == 1
  int master_port = -1;     // -1 or 0: a free port when nnodes == 1 (else 29500 for -1)
  double timeout_s = 0;     // > 0: passed to ranks as PRIMUS_DIST_TIMEOUT (rendezvous, collectives)
  double grace_s = 10;      // SIGTERM -> SIGKILL grace after a failure, seconds
  std::string log_dir;      // non-empty: rank K writes LOG_DIR/rank_K.log instead of prefixed lines
  std::string exec;         // program to run; empty: this binary (/proc/self/exe)
  std::vector<std::string> args;  // its arguments, e.g. {"train", "pretrain", "--config", "x.yaml"}
};

// Checks the options (UsageError naming the flag), runs the ranks to completion and returns the
// launcher's exit code. Status lines go to stderr, prefixed "primus launch: ". Installs its own
// signal handlers for the duration and restores the previous ones. Call from the main thread
// of a single-threaded process (ranks die with the forking thread, see child_process.h).
int run_launcher(LaunchOptions opts);

// The environment variables rank `local_rank` of this node gets ("NAME=value").
std::vector<std::string> rank_environment(const LaunchOptions& opts, int local_rank);

}  // namespace primus::parallel
