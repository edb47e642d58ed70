// Drives the real `primus` binary (PRIMUS_BINARY_DIR/bin/primus) as a child process for the
// end-to-end hardening tests: start it, read its output as it comes, send it signals, wait
// for its exit. The child runs with OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1, so every
// run of the same config computes the same bits.
#pragma once
#include <sys/types.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace primus::hardening {

std::filesystem::path primus_binary();

// How a child ended.
struct ExitStatus {
  bool exited = false;  // returned or called exit/_exit: `code` holds the status
  int code = -1;
  int signal = 0;       // killed by this signal
  bool timed_out = false;
  std::string describe() const;
};

class PrimusProcess {
 public:
  // Starts `primus args...`; `env` adds or replaces NAME=VALUE entries of this environment.
  explicit PrimusProcess(const std::vector<std::string>& args,
                         const std::vector<std::pair<std::string, std::string>>& env = {});
  ~PrimusProcess();  // a child still running is killed (SIGKILL) and reaped
  PrimusProcess(const PrimusProcess&) = delete;
  PrimusProcess& operator=(const PrimusProcess&) = delete;

  pid_t pid() const { return pid_; }
  // Reads output until a line containing `text` has appeared (true), or the child closes its
  // output or `timeout_s` passes (false).
  bool wait_for_output(const std::string& text, double timeout_s = 120);
  // Reads whatever output is ready without blocking.
  void drain();
  void send(int sig) const;
  // True while `sig` is pending (sent, not yet delivered to a handler) in the child.
  bool signal_pending(int sig) const;
  // Waits until the child has exited (reading its output); kills it after `timeout_s`.
  ExitStatus wait(double timeout_s = 300);
  bool running() const { return !reaped_; }
  const std::string& output() const { return output_; }

 private:
  bool read_some(int timeout_ms);
  pid_t pid_ = -1;
  int out_fd_ = -1;
  bool reaped_ = false;
  ExitStatus status_;
  std::string output_;
};

// Runs primus to completion.
struct RunResult {
  ExitStatus status;
  std::string output;
};
RunResult run_primus(const std::vector<std::string>& args,
                     const std::vector<std::pair<std::string, std::string>>& env = {},
                     double timeout_s = 300);

}  // namespace primus::hardening
