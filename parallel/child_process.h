// Starting one rank of a local launch: fork + execve with a prepared environment, its own
// process group (so a signal reaches the rank and everything it started, and a Ctrl-C in the
// terminal reaches only the launcher, which forwards it once), stdin from /dev/null, stdout and
// stderr to pipes or to a log file, and death with the launcher (PR_SET_PDEATHSIG) so a killed
// launcher leaves no orphans holding GPUs.
#pragma once
#include <sys/types.h>

#include <string>
#include <vector>

namespace primus::parallel {

struct ChildSpec {
  std::string path;               // executable to run
  std::vector<std::string> argv;  // argv[0] included
  std::vector<std::string> env;   // "NAME=value", the complete environment
  std::string log_file;           // non-empty: stdout and stderr go there (truncated first)
};

struct Child {
  pid_t pid = -1;   // also the process group id
  int out_fd = -1;  // read ends of the stdout / stderr pipes (non-blocking), -1 with a log file
  int err_fd = -1;
};

// Starts the child. Throws RuntimeError naming the path when it cannot be executed (the error
// comes back from the child before this returns) or the log file cannot be opened.
Child spawn_child(const ChildSpec& spec);

// The environment of this process with `overrides` ("NAME=value") replacing or adding entries
// and `removed` names taken out.
std::vector<std::string> environment_with(const std::vector<std::string>& overrides,
                                          const std::vector<std::string>& removed = {});

// "exit code 3", "signal 9 (SIGKILL)": a wait status in words.
std::string describe_wait_status(int status);

// SIGTERM -> "SIGTERM"; unknown numbers -> "SIG<n>".
std::string signal_name(int sig);

}  // namespace primus::parallel
