#include "parallel/child_process.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/util/error.h"
#include "parallel/socket.h"

extern char** environ;

namespace primus::parallel {
namespace {

std::vector<char*> c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  for (auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// Between fork and exec only async-signal-safe calls: everything is prepared before fork.
[[noreturn]] void exec_child(const ChildSpec& spec, char* const* argv, char* const* envp, int out_w, int err_w,
                             int status_w, pid_t parent) {
  auto fail = [status_w](int err) {
    [[maybe_unused]] ssize_t n = ::write(status_w, &err, sizeof err);
    ::_exit(127);
  };
  ::setpgid(0, 0);
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) fail(errno);
  if (::getppid() != parent) ::_exit(1);  // the launcher died before prctl took effect
  int devnull = ::open("/dev/null", O_RDONLY);
  if (devnull < 0 || ::dup2(devnull, 0) < 0) fail(errno);
  if (::dup2(out_w, 1) < 0 || ::dup2(err_w, 2) < 0) fail(errno);
  // Signals are blocked since before fork: a signal caught now would run the launcher's handler
  // in this process. Back to defaults (an ignored signal would even survive exec), then unblock.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(spec.path.c_str(), argv, envp);
  fail(errno);
  ::_exit(127);
}

}  // namespace

Child spawn_child(const ChildSpec& spec) {
  auto argv = c_strings(spec.argv);
  auto envp = c_strings(spec.env);
  int out[2] = {-1, -1}, err[2] = {-1, -1}, status[2];
  Fd log;
  if (!spec.log_file.empty()) {
    log.reset(::open(spec.log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!log) throw IoError(fmt::format("cannot open log file {}: {}", spec.log_file, std::strerror(errno)));
  } else if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    throw RuntimeError(fmt::format("cannot create pipes: {}", std::strerror(errno)));
  }
  Fd out_r(out[0]), out_w(out[1]), err_r(err[0]), err_w(err[1]);
  if (::pipe2(status, O_CLOEXEC) != 0) throw RuntimeError(fmt::format("cannot create a pipe: {}", std::strerror(errno)));
  Fd status_r(status[0]), status_w(status[1]);
  pid_t parent = ::getpid();
  sigset_t all, old;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &old);
  pid_t pid = ::fork();
  if (pid == 0) {
    int o = log ? log.get() : out_w.get(), e = log ? log.get() : err_w.get();
    exec_child(spec, argv.data(), envp.data(), o, e, status_w.get(), parent);
  }
  int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) throw RuntimeError(fmt::format("fork failed: {}", std::strerror(fork_errno)));
  ::setpgid(pid, pid);  // also here, so the group exists before the launcher signals it
  status_w.reset();
  out_w.reset();
  err_w.reset();
  int child_errno = 0;
  ssize_t n;
  do {
    n = ::read(status_r.get(), &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  if (n > 0) {  // exec failed: the close-on-exec pipe carried errno instead of closing
    ::waitpid(pid, nullptr, 0);
    throw RuntimeError(fmt::format("cannot run {}: {}", spec.path, std::strerror(child_errno)));
  }
  Child c;
  c.pid = pid;
  if (!log) {
    c.out_fd = out_r.release();
    c.err_fd = err_r.release();
    ::fcntl(c.out_fd, F_SETFL, O_NONBLOCK);
    ::fcntl(c.err_fd, F_SETFL, O_NONBLOCK);
  }
  return c;
}

std::vector<std::string> environment_with(const std::vector<std::string>& overrides,
                                          const std::vector<std::string>& removed) {
  auto name_of = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
  std::vector<std::string> drop = removed;
  for (auto& o : overrides) drop.push_back(name_of(o));
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    bool skip = false;
    for (auto& d : drop) skip = skip || name_of(kv) == d;
    if (!skip) env.push_back(std::move(kv));
  }
  env.insert(env.end(), overrides.begin(), overrides.end());
  return env;
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    default: return fmt::format("SIG{}", sig);
  }
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return fmt::format("signal {} ({}){}", sig, signal_name(sig), WCOREDUMP(status) ? ", core dumped" : "");
  }
  return fmt::format("wait status {:#x}", status);
}

}  // namespace primus::parallel
