#include "primus_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace primus::hardening {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

std::filesystem::path primus_binary() { return std::filesystem::path(PRIMUS_BINARY_DIR) / "bin" / "primus"; }

std::string ExitStatus::describe() const {
  if (timed_out) return "timed out (killed)";
  if (exited) return "exit " + std::to_string(code);
  if (signal) return std::string("killed by signal ") + std::to_string(signal) + " (" + strsignal(signal) + ")";
  return "still running";
}

PrimusProcess::PrimusProcess(const std::vector<std::string>& args,
                             const std::vector<std::pair<std::string, std::string>>& env) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) vars[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  vars["OMP_NUM_THREADS"] = "1";
  vars["OPENBLAS_NUM_THREADS"] = "1";
  for (auto& [k, v] : env) vars[k] = v;
  std::vector<std::string> env_strings, argv_strings{primus_binary().string()};
  for (auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  for (auto& s : argv_strings) argv.push_back(s.data());
  envp.push_back(nullptr);
  argv.push_back(nullptr);

  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid_ == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    // The test binary may block or ignore signals; the child starts with the defaults.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int s : {SIGTERM, SIGUSR1, SIGINT}) ::signal(s, SIG_DFL);
    ::execve(argv[0], argv.data(), envp.data());
    std::fprintf(stderr, "execve %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(fds[1]);
  out_fd_ = fds[0];
  ::fcntl(out_fd_, F_SETFL, O_NONBLOCK);
}

PrimusProcess::~PrimusProcess() {
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
  }
  if (out_fd_ >= 0) ::close(out_fd_);
}

bool PrimusProcess::read_some(int timeout_ms) {
  if (out_fd_ < 0) return false;
  pollfd p{out_fd_, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return true;
  char buf[65536];
  ssize_t n = ::read(out_fd_, buf, sizeof buf);
  if (n > 0) {
    output_.append(buf, static_cast<size_t>(n));
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
  ::close(out_fd_);  // EOF: the child closed its output (it exited)
  out_fd_ = -1;
  return false;
}

void PrimusProcess::drain() {
  while (out_fd_ >= 0) {
    size_t before = output_.size();
    if (!read_some(0) || output_.size() == before) return;
  }
}

bool PrimusProcess::wait_for_output(const std::string& text, double timeout_s) {
  auto t0 = Clock::now();
  size_t scanned = 0;
  while (true) {
    // Only whole lines count, so a line is never matched while half written.
    size_t end = output_.rfind('\n');
    if (end != std::string::npos && end + 1 > scanned) {
      size_t from = scanned >= text.size() ? scanned - text.size() : 0;
      auto at = output_.find(text, from);
      if (at != std::string::npos && at < end) return true;
      scanned = end + 1;
    }
    if (since(t0) > timeout_s) return false;
    if (!read_some(50)) return output_.find(text) != std::string::npos;
  }
}

void PrimusProcess::send(int sig) const {
  if (::kill(pid_, sig) != 0) throw std::runtime_error(std::string("kill: ") + std::strerror(errno));
}

bool PrimusProcess::signal_pending(int sig) const {
  std::ifstream in("/proc/" + std::to_string(pid_) + "/status");
  uint64_t bit = uint64_t{1} << (sig - 1);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("SigPnd:", 0) == 0 || line.rfind("ShdPnd:", 0) == 0) {
      if (std::stoull(line.substr(7), nullptr, 16) & bit) return true;
    }
  }
  return false;
}

ExitStatus PrimusProcess::wait(double timeout_s) {
  if (reaped_) return status_;
  auto t0 = Clock::now();
  while (true) {
    read_some(20);
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      status_.exited = WIFEXITED(st);
      status_.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      status_.signal = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
      break;
    }
    if (since(t0) > timeout_s) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &st, 0);
      reaped_ = true;
      status_.timed_out = true;
      break;
    }
  }
  // The child is gone, so its end of the pipe is closed: read up to end of file.
  for (int i = 0; i < 10000 && out_fd_ >= 0; ++i) read_some(100);
  return status_;
}

RunResult run_primus(const std::vector<std::string>& args,
                     const std::vector<std::pair<std::string, std::string>>& env, double timeout_s) {
  PrimusProcess p(args, env);
  RunResult r;
  r.status = p.wait(timeout_s);
  r.output = p.output();
  return r;
}

}  // namespace primus::hardening
