#include "parallel/launcher.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include "core/util/error.h"
#include "parallel/child_process.h"
#include "parallel/line_relay.h"
#include "parallel/socket.h"

namespace primus::parallel {
namespace {

constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGUSR1, SIGHUP};
// After the last rank exits, output still in the pipes is read for at most this long (a rank's
// leftover child process may hold a pipe open forever).
constexpr auto kDrain = std::chrono::seconds(2);

int g_signal_pipe = -1;

void on_signal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe, &b, 1);
  errno = saved;
}

// Signals become bytes on a pipe that the supervision loop polls with the ranks' output, so the
// handlers do nothing but write(). Restores the previous dispositions on destruction.
class SignalPipe {
 public:
  SignalPipe() {
    int p[2];
    if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) throw RuntimeError("primus launch: cannot create a pipe");
    read_.reset(p[0]);
    write_.reset(p[1]);
    g_signal_pipe = write_.get();
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (int sig : kForwarded) install(sig, sa);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    install(SIGCHLD, sa);
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    install(SIGPIPE, ign);  // a closed stdout must not kill the launcher while ranks run
  }
  ~SignalPipe() {
    for (auto& [sig, old] : saved_) ::sigaction(sig, &old, nullptr);
    g_signal_pipe = -1;
  }
  int fd() const { return read_.get(); }

 private:
  void install(int sig, const struct sigaction& sa) {
    struct sigaction old {};
    ::sigaction(sig, &sa, &old);
    saved_.emplace_back(sig, old);
  }
  Fd read_, write_;
  std::vector<std::pair<int, struct sigaction>> saved_;
};

void say(const std::string& line) {
  std::fflush(stdout);
  std::string s = "primus launch: " + line + "\n";
  [[maybe_unused]] ssize_t n = ::write(2, s.data(), s.size());
}

struct Stream {
  Fd fd;
  std::unique_ptr<LineRelay> relay;
};

struct Rank {
  int rank = 0, local = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  bool sent_term = false, sent_kill = false;
  Stream out, err;
  std::string log_file;
};

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw RuntimeError("primus launch: cannot find this binary (/proc/self/exe); pass --exec");
  return p.string();
}

int free_port() {
  int port = 0;
  listen_tcp(0, &port);  // closed again at once; no connection, so no TIME_WAIT holds it
  return port;
}

void validate(LaunchOptions& o) {
  if (o.nproc_per_node < 1) throw UsageError("--nproc-per-node must be at least 1");
  if (o.nnodes < 1) throw UsageError("--nnodes must be at least 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    throw UsageError(fmt::format("--node-rank {} must be in [0, {}) (--nnodes {})", o.node_rank, o.nnodes, o.nnodes));
  }
  if (o.master_addr.empty()) {
    if (o.nnodes > 1) throw UsageError("--master-addr is required with --nnodes > 1 (the host of node 0)");
    o.master_addr = "127.0.0.1";
  }
  if (o.master_port < -1 || o.master_port > 65535) {
    throw UsageError(fmt::format("--master-port {} is not a TCP port (1..65535)", o.master_port));
  }
  if (o.master_port <= 0) {
    if (o.nnodes > 1 && o.master_port == 0) throw UsageError("--master-port 0 (a free port) needs --nnodes 1");
    o.master_port = o.nnodes > 1 ? 29500 : free_port();
  }
  if (!(o.grace_s >= 0)) throw UsageError("--grace must be a non-negative number of seconds");
  if (!(o.timeout_s >= 0)) throw UsageError("--timeout must be a non-negative number of seconds");
  if (o.args.empty() && o.exec.empty()) {
    throw UsageError("nothing to launch: give the primus command after '--', e.g. -- train pretrain --config x.yaml");
  }
  if (o.exec.empty()) o.exec = self_exe();
  if (::access(o.exec.c_str(), X_OK) != 0) {
    throw UsageError(fmt::format("--exec {}: not an executable file ({})", o.exec, std::strerror(errno)));
  }
  if (!o.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.log_dir, ec);
    if (ec) throw IoError(fmt::format("cannot create --log-dir {}: {}", o.log_dir, ec.message()));
  }
}

void print_log_tail(const Rank& r, size_t lines) {
  std::ifstream in(r.log_file);
  std::deque<std::string> tail;
  for (std::string line; std::getline(in, line);) {
    tail.push_back(line);
    if (tail.size() > lines) tail.pop_front();
  }
  if (tail.empty()) return;
  say(fmt::format("last lines of {}:", r.log_file));
  std::string block;
  for (auto& l : tail) block += fmt::format("[rank {}] {}\n", r.rank, l);
  [[maybe_unused]] ssize_t n = ::write(2, block.data(), block.size());
}

// Runs the ranks and enforces the policy of launcher.h.
class Supervisor {
 public:
  explicit Supervisor(const LaunchOptions& o) : o_(o) {}

  int run() {
    SignalPipe signals;
    start_all();
    using Clock = std::chrono::steady_clock;
    Clock::time_point kill_at = Clock::time_point::max(), drain_until = Clock::time_point::max();
    while (true) {
      reap();
      if (failed_ >= 0 && kill_at == Clock::time_point::max()) {
        kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.grace_s * 1000));
      }
      if (Clock::now() >= kill_at) kill_remaining();
      bool any_running = running_count() > 0;
      if (!any_running && drain_until == Clock::time_point::max()) drain_until = Clock::now() + kDrain;
      std::vector<pollfd> fds{{signals.fd(), POLLIN, 0}};
      std::vector<Stream*> streams;
      for (auto& r : ranks_) {
        for (Stream* s : {&r.out, &r.err}) {
          if (s->fd) {
            fds.push_back({s->fd.get(), POLLIN, 0});
            streams.push_back(s);
          }
        }
      }
      if (!any_running && (streams.empty() || Clock::now() >= drain_until)) break;
      Clock::time_point wake = std::min({kill_at, drain_until, Clock::now() + std::chrono::seconds(1)});
      int n = ::poll(fds.data(), fds.size(), poll_timeout_ms(wake));
      if (n < 0 && errno != EINTR) throw RuntimeError(fmt::format("primus launch: poll: {}", std::strerror(errno)));
      if (n <= 0) continue;
      if (fds[0].revents) handle_signals(signals.fd());
      for (size_t i = 0; i < streams.size(); ++i) {
        if (fds[i + 1].revents) pump(*streams[i]);
      }
    }
    for (auto& r : ranks_) {
      for (Stream* s : {&r.out, &r.err}) {
        if (s->relay) s->relay->finish();
      }
    }
    return finish();
  }

 private:
  void start_all() {
    int world = o_.nnodes * o_.nproc_per_node;
    int first = o_.node_rank * o_.nproc_per_node;
    say(fmt::format("starting {} rank{} ({}-{} of {}) on node {} of {}, store {}:{}: {}{}", o_.nproc_per_node,
                    o_.nproc_per_node == 1 ? "" : "s", first, first + o_.nproc_per_node - 1, world, o_.node_rank,
                    o_.nnodes, o_.master_addr, o_.master_port, o_.exec,
                    o_.log_dir.empty() ? "" : ", logs in " + o_.log_dir));
    ranks_.resize(o_.nproc_per_node);
    for (int local = 0; local < o_.nproc_per_node; ++local) {
      Rank& r = ranks_[local];
      r.local = local;
      r.rank = first + local;
      ChildSpec spec;
      spec.path = o_.exec;
      spec.argv.push_back(o_.exec);
      spec.argv.insert(spec.argv.end(), o_.args.begin(), o_.args.end());
      // An outer launcher's GROUP_RANK would win over our NODE_RANK (launch_env.h), and its
      // agent-store flag would move our store's port: neither describes these ranks.
      spec.env = environment_with(rank_environment(o_, local), {"GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE"});
      if (!o_.log_dir.empty()) {
        r.log_file = (std::filesystem::path(o_.log_dir) / fmt::format("rank_{}.log", r.rank)).string();
        spec.log_file = r.log_file;
      }
      Child c;
      try {
        c = spawn_child(spec);
      } catch (...) {
        // Not a rank's failure but the launcher's (a log file it cannot open, fork failing):
        // take down the ranks already started, then report.
        for (auto& started : ranks_) {
          if (!started.running) continue;
          ::kill(-started.pid, SIGKILL);
          ::waitpid(started.pid, nullptr, 0);
        }
        throw;
      }
      r.pid = c.pid;
      r.running = true;
      if (c.out_fd >= 0) {
        std::string prefix = fmt::format("[rank {}] ", r.rank);
        r.out = {Fd(c.out_fd), std::make_unique<LineRelay>(prefix, 1)};
        r.err = {Fd(c.err_fd), std::make_unique<LineRelay>(prefix, 2)};
      }
    }
  }

  int running_count() const {
    int n = 0;
    for (auto& r : ranks_) n += r.running;
    return n;
  }

  void reap() {
    Rank* first = nullptr;  // the failure to name among the ranks found dead in this pass
    for (auto& r : ranks_) {
      if (!r.running) continue;
      int st = 0;
      pid_t p = ::waitpid(r.pid, &st, WNOHANG);
      if (p != r.pid) continue;
      r.running = false;
      r.status = st;
      bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      // Found dead together, a rank killed by a signal is the likelier cause: the others
      // typically exit with an error because its connections closed (a killed rank 1 must not
      // be reported as rank 0's "rank 1 closed its connection" failure just because 0 < 1).
      if (!ok && (!first || (WIFSIGNALED(st) && !WIFSIGNALED(first->status)))) first = &r;
    }
    if (first && failed_ == -1) on_first_failure(*first);
  }

  void on_first_failure(Rank& r) {
    failed_ = r.local;
    int others = running_count();
    say(fmt::format("rank {} (pid {}) failed: {}{}", r.rank, r.pid, describe_wait_status(r.status),
                    others ? fmt::format("; stopping the other {} rank{} (SIGTERM, SIGKILL after {:g} s)", others,
                                         others == 1 ? "" : "s", o_.grace_s)
                           : ""));
    for (auto& o : ranks_) {
      if (o.running) {
        ::kill(-o.pid, SIGTERM);
        o.sent_term = true;
      }
    }
  }

  void kill_remaining() {
    std::string who;
    for (auto& r : ranks_) {
      if (r.running && !r.sent_kill) {
        ::kill(-r.pid, SIGKILL);
        r.sent_kill = true;
        who += (who.empty() ? "" : ", ") + std::to_string(r.rank);
      }
    }
    if (!who.empty()) say(fmt::format("grace period of {:g} s over; SIGKILL to rank {}", o_.grace_s, who));
  }

  void handle_signals(int fd) {
    unsigned char buf[64];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof buf)) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        int sig = buf[i];
        if (sig == SIGCHLD) continue;  // reap() runs on every loop iteration
        int count = 0;
        for (auto& r : ranks_) {
          if (r.running) count += ::kill(-r.pid, sig) == 0;
        }
        forwarded_ = sig;
        say(fmt::format("forwarded {} to {} running rank{}", signal_name(sig), count, count == 1 ? "" : "s"));
      }
    }
  }

  void pump(Stream& s) {
    char buf[65536];
    while (true) {
      ssize_t n = ::read(s.fd.get(), buf, sizeof buf);
      if (n > 0) {
        s.relay->feed(std::string_view(buf, static_cast<size_t>(n)));
        continue;
      }
      if (n == 0 || (errno != EAGAIN && errno != EINTR)) s.fd.reset();  // EOF
      return;
    }
  }

  int finish() {
    if (failed_ < 0) {
      say(fmt::format("all {} rank{} exited 0", ranks_.size(), ranks_.size() == 1 ? "" : "s"));
      return 0;
    }
    const Rank& f = ranks_[failed_];
    std::string others;
    for (auto& r : ranks_) {
      if (&r == &f) continue;
      std::string fate = describe_wait_status(r.status);
      bool by_signal = WIFSIGNALED(r.status);
      if (by_signal && WTERMSIG(r.status) == SIGKILL && r.sent_kill) {
        fate += ", killed after the grace period";
      } else if (by_signal && WTERMSIG(r.status) == SIGTERM && r.sent_term) {
        fate += ", stopped by the launcher";
      }  // an exit code is the rank's own doing, whether or not it saw our SIGTERM
      others += fmt::format("; rank {}: {}", r.rank, fate);
    }
    if (!f.log_file.empty()) print_log_tail(f, 20);
    say(fmt::format("FAILED: rank {} (local rank {}, pid {}) {}{}{}", f.rank, f.local, f.pid,
                    describe_wait_status(f.status),
                    forwarded_ ? fmt::format(" after the launcher forwarded {}", signal_name(forwarded_)) : "", others));
    if (WIFEXITED(f.status)) return WEXITSTATUS(f.status);
    return 128 + WTERMSIG(f.status);
  }

  const LaunchOptions& o_;
  std::vector<Rank> ranks_;
  int failed_ = -1;  // local index of the first failing rank
  int forwarded_ = 0;
};

}  // namespace

std::vector<std::string> rank_environment(const LaunchOptions& o, int local_rank) {
  int world = o.nnodes * o.nproc_per_node;
  std::vector<std::string> env = {
      fmt::format("RANK={}", o.node_rank * o.nproc_per_node + local_rank),
      fmt::format("WORLD_SIZE={}", world),
      fmt::format("LOCAL_RANK={}", local_rank),
      fmt::format("LOCAL_WORLD_SIZE={}", o.nproc_per_node),
      fmt::format("NODE_RANK={}", o.node_rank),
      fmt::format("MASTER_ADDR={}", o.master_addr),
      fmt::format("MASTER_PORT={}", o.master_port),
  };
  if (o.timeout_s > 0) env.push_back(fmt::format("PRIMUS_DIST_TIMEOUT={:g}", o.timeout_s));
  // N ranks on one machine each starting an OpenMP team of every core would oversubscribe it N
  // times over; share the cores unless the user chose.
  if (o.nproc_per_node > 1 && !std::getenv("OMP_NUM_THREADS")) {
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env.push_back(fmt::format("OMP_NUM_THREADS={}", std::max(1u, cores / static_cast<unsigned>(o.nproc_per_node))));
  }
  return env;
}

int run_launcher(LaunchOptions opts) {
  validate(opts);
  return Supervisor(opts).run();
}

}  // namespace primus::parallel
