// `primus launch` end to end, with real processes: the ranks are parallel_test_worker (see its
// header for the steps), started through the real primus binary's --exec. Covers the
// environment every rank sees, rendezvous through the TCP store, failure propagation (exit code,
// signal, a rank that ignores SIGTERM), signal forwarding, log files and usage errors.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "tests/core/test_util.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

const std::string kPrimus = std::string(PRIMUS_BINARY_DIR) + "/bin/primus";
const std::string kWorker = std::string(PRIMUS_BINARY_DIR) + "/bin/parallel_test_worker";

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One `primus` process with stdout and stderr captured in a file.
class Proc {
 public:
  Proc(const std::vector<std::string>& args, const fs::path& out) : out_(out) {
    t0_ = Clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> argv{const_cast<char*>(kPrimus.c_str())};
      for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(kPrimus.c_str(), argv.data());
      ::_exit(126);
    }
  }
  ~Proc() {
    if (pid_ > 0 && !done_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  std::string output() const { return slurp(out_); }
  // Waits for exit; returns the exit code (128 + signal when killed) or -1 after `limit_s`.
  int wait(double limit_s = 15) {
    auto limit = t0_ + std::chrono::duration<double>(limit_s);
    while (Clock::now() < limit) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        done_ = true;
        seconds_ = std::chrono::duration<double>(Clock::now() - t0_).count();
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return -1;
  }
  double seconds() const { return seconds_; }

 private:
  fs::path out_;
  pid_t pid_ = -1;
  bool done_ = false;
  Clock::time_point t0_;
  double seconds_ = 0;
};

class LaunchTest : public ::testing::Test {
 protected:
  // Runs primus with `args` to completion.
  int run(const std::vector<std::string>& args, double limit_s = 15) {
    Proc p(args, dir_.path() / "out.txt");
    code_ = p.wait(limit_s);
    out_ = p.output();
    seconds_ = p.seconds();
    return code_;
  }
  std::vector<std::string> launch(std::vector<std::string> opts, const std::vector<std::string>& steps) {
    opts.insert(opts.begin(), "launch");
    opts.insert(opts.end(), {"--exec", kWorker, "--"});
    opts.insert(opts.end(), steps.begin(), steps.end());
    return opts;
  }
  void expect_out(const std::string& fragment) {
    EXPECT_NE(out_.find(fragment), std::string::npos) << "missing '" << fragment << "' in:\n" << out_;
  }
  // Waits until `n` workers have written DIR/ready_<rank>; returns their pids by rank.
  std::vector<pid_t> await_ready(const fs::path& dir, int first, int n) {
    std::vector<pid_t> pids;
    for (int r = first; r < first + n; ++r) {
      fs::path f = dir / ("ready_" + std::to_string(r));
      for (int i = 0; i < 1000 && !fs::exists(f); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      EXPECT_TRUE(fs::exists(f)) << f;
      pids.push_back(std::atoi(slurp(f).c_str()));
    }
    return pids;
  }
  primus::testing::TempDir dir_;
  int code_ = -1;
  std::string out_;
  double seconds_ = 0;
};

TEST_F(LaunchTest, EveryRankSeesItsEnvironmentAndAllSucceed) {
  ASSERT_EQ(run(launch({"--nproc-per-node", "3"},
                       {"env", "echo:hello from stdout", "echoerr:hello from stderr", "partial:no newline"})),
            0)
      << out_;
  std::set<std::string> ports;
  for (int r = 0; r < 3; ++r) {
    std::string k = std::to_string(r);
    std::regex line("\\[rank " + k + "\\] env rank=" + k + " world=3 local=" + k +
                    " local_world=3 node=0 addr=127\\.0\\.0\\.1 port=(\\d+) source=torchrun\n");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out_, m, line)) << "rank " << r << " env line missing:\n" << out_;
    ports.insert(m[1]);
    expect_out("[rank " + k + "] hello from stdout\n");
    expect_out("[rank " + k + "] hello from stderr\n");
    expect_out("[rank " + k + "] no newline\n");
  }
  EXPECT_EQ(ports.size(), 1u) << "every rank must meet at the same store";
  EXPECT_NE(*ports.begin(), "0");
  expect_out("all 3 ranks exited 0");
}

TEST_F(LaunchTest, SecondNodeGetsGlobalRanks) {
  ASSERT_EQ(run(launch({"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3",
                        "--master-port", "4567", "--timeout", "7"},
                       {"env"})),
            0)
      << out_;
  expect_out("[rank 2] env rank=2 world=4 local=0 local_world=2 node=1 addr=10.1.2.3 port=4567 source=torchrun\n");
  expect_out("[rank 3] env rank=3 world=4 local=1 local_world=2 node=1 addr=10.1.2.3 port=4567 source=torchrun\n");
  EXPECT_EQ(out_.find("[rank 0]"), std::string::npos) << out_;
}

TEST_F(LaunchTest, RanksRendezvousThroughTheStore) {
  ASSERT_EQ(run(launch({"--nproc-per-node", "4", "--timeout", "10"}, {"store"})), 0) << out_;
  std::regex line("\\[rank (\\d)\\] store id=([0-9a-f]{16}) bytes=128\n");
  std::set<std::string> ranks, ids;
  for (std::sregex_iterator it(out_.begin(), out_.end(), line), end; it != end; ++it) {
    ranks.insert((*it)[1]);
    ids.insert((*it)[2]);
  }
  EXPECT_EQ(ranks.size(), 4u) << out_;
  EXPECT_EQ(ids.size(), 1u) << "every rank must read rank 0's id:\n" << out_;
}

TEST_F(LaunchTest, FailingRankStopsTheOthersAndIsNamed) {
  EXPECT_EQ(run(launch({"--nproc-per-node", "3", "--grace", "8"}, {"r1:exit:3", "sleep:30"})), 3) << out_;
  EXPECT_LT(seconds_, 5.0) << "the others must be stopped by SIGTERM, well before the grace period ends";
  expect_out("rank 1 (pid ");
  expect_out("failed: exit code 3; stopping the other 2 ranks");
  expect_out("FAILED: rank 1 (local rank 1, pid");
  expect_out("rank 0: signal 15 (SIGTERM), stopped by the launcher");
  expect_out("rank 2: signal 15 (SIGTERM), stopped by the launcher");
}

TEST_F(LaunchTest, RankKilledBySignalIsNamed) {
  EXPECT_EQ(run(launch({"--nproc-per-node", "3"}, {"r2:kill:9", "sleep:30"})), 128 + 9) << out_;
  expect_out("FAILED: rank 2 (local rank 2, pid");
  expect_out("signal 9 (SIGKILL)");
}

bool process_gone(pid_t pid);

// Rank 1 killed by a signal and rank 0 exiting with an error found dead in the same pass of the
// launcher (it is stopped while both die): the killed rank is the one named, not the lower one
// (rank 0 exiting because its peer's connection closed is the usual aftermath; CI once saw the
// data-parallel kill test name rank 0 that way).
TEST_F(LaunchTest, KilledRankIsNamedOverOneThatExitedInTheSamePass) {
  std::string d = dir_.path().string();
  Proc p(launch({"--nproc-per-node", "2"}, {"ready:" + d, "await:" + d + "/go", "r1:kill:9", "r0:exit:3", "sleep:30"}),
         dir_.path() / "out.txt");
  auto pids = await_ready(dir_.path(), 0, 2);
  ASSERT_EQ(pids.size(), 2u);
  ASSERT_EQ(::kill(p.pid(), SIGSTOP), 0);
  { std::ofstream(dir_.path() / "go") << "go"; }
  bool both = false;
  for (int i = 0; i < 1000 && !(both = process_gone(pids[0]) && process_gone(pids[1])); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ::kill(p.pid(), SIGCONT);
  EXPECT_TRUE(both) << "the ranks did not both end while the launcher was stopped";
  code_ = p.wait(10);
  out_ = p.output();
  EXPECT_EQ(code_, 128 + 9) << out_;
  expect_out("rank 1 (pid " + std::to_string(pids[1]) + ") failed: signal 9 (SIGKILL)");
  expect_out("FAILED: rank 1 (local rank 1");
  expect_out("rank 0: exit code 3");
}

TEST_F(LaunchTest, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  std::string d = dir_.path().string();
  EXPECT_EQ(run(launch({"--nproc-per-node", "2", "--grace", "1"},
                       {"r0:ignore-term", "r0:ready:" + d, "r1:await:" + d + "/ready_0", "r1:exit:3", "sleep:30"})),
            3)
      << out_;
  EXPECT_GE(seconds_, 1.0);
  EXPECT_LT(seconds_, 5.0);
  expect_out("grace period of 1 s over; SIGKILL to rank 0");
  expect_out("FAILED: rank 1");
  expect_out("rank 0: signal 9 (SIGKILL), killed after the grace period");
}

TEST_F(LaunchTest, SignalsAreForwardedToEveryRank) {
  std::string d = dir_.path().string();
  Proc p(launch({"--nproc-per-node", "2"}, {"trap", "ready:" + d, "sleep:30"}), dir_.path() / "out.txt");
  await_ready(dir_.path(), 0, 2);
  ::kill(p.pid(), SIGUSR1);
  // SIGTERM only after both ranks handled SIGUSR1: a pending SIGTERM would cut its handler short.
  auto both_caught = [&] {
    std::string o = p.output();
    return o.find("[rank 0] caught SIGUSR1") != std::string::npos &&
           o.find("[rank 1] caught SIGUSR1") != std::string::npos;
  };
  for (int i = 0; i < 400 && !both_caught(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ::kill(p.pid(), SIGTERM);
  code_ = p.wait(10);
  out_ = p.output();
  EXPECT_EQ(code_, 0) << "ranks that exit 0 on SIGTERM make the launcher exit 0:\n" << out_;
  expect_out("forwarded SIGUSR1 to 2 running ranks");
  expect_out("forwarded SIGTERM to 2 running ranks");
  for (std::string k : {"0", "1"}) {
    expect_out("[rank " + k + "] caught SIGUSR1\n");
    expect_out("[rank " + k + "] caught SIGTERM\n");
  }
}

bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return true;
  std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");  // a zombie is gone too
  size_t close = stat.rfind(')');
  return close == std::string::npos || (close + 2 < stat.size() && stat[close + 2] == 'Z');
}

TEST_F(LaunchTest, KilledLauncherTakesItsRanksAlong) {
  std::string d = dir_.path().string();
  Proc p(launch({"--nproc-per-node", "2"}, {"ready:" + d, "sleep:30"}), dir_.path() / "out.txt");
  auto pids = await_ready(dir_.path(), 0, 2);
  ::kill(p.pid(), SIGKILL);
  EXPECT_EQ(p.wait(5), 128 + 9);
  for (pid_t pid : pids) {
    bool gone = false;
    for (int i = 0; i < 400 && !(gone = process_gone(pid)); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_TRUE(gone) << "rank pid " << pid << " outlived its launcher";
    if (!gone) ::kill(pid, SIGKILL);
  }
}

TEST_F(LaunchTest, LogDirHoldsEachRanksOutput) {
  fs::path logs = dir_.path() / "logs";
  std::string d = dir_.path().string();
  EXPECT_EQ(run(launch({"--nproc-per-node", "2", "--log-dir", logs.string()},
                       {"echo:line one", "echoerr:line two", "r0:ready:" + d, "r1:await:" + d + "/ready_0", "r1:exit:4",
                        "sleep:30"})),
            4)
      << out_;
  EXPECT_EQ(slurp(logs / "rank_1.log"), "line one\nline two\n");
  EXPECT_NE(slurp(logs / "rank_0.log").find("line one\n"), std::string::npos);
  EXPECT_EQ(out_.find("[rank 0] line one"), std::string::npos) << "with --log-dir, output goes to the files";
  expect_out("last lines of " + (logs / "rank_1.log").string());
  expect_out("[rank 1] line two\n");
  expect_out("FAILED: rank 1 (local rank 1, pid");
}

TEST_F(LaunchTest, RunsPrimusItselfByDefault) {
  ASSERT_EQ(run({"launch", "--nproc-per-node", "2", "--", "--version"}), 0) << out_;
  expect_out("[rank 0] primus ");
  expect_out("[rank 1] primus ");
}

TEST_F(LaunchTest, UsageErrorsExit2AndNameTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string fragment;
  };
  std::vector<Case> cases = {
      {{"launch", "--nproc-per-node", "2"}, "nothing to launch"},
      {{"launch", "--nproc-per-node", "0", "--exec", kWorker}, "--nproc-per-node"},
      {{"launch", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--exec", kWorker}, "--node-rank 2"},
      {{"launch", "--nnodes", "2", "--exec", kWorker}, "--master-addr is required"},
      {{"launch", "--master-port", "70000", "--exec", kWorker}, "--master-port 70000"},
      {{"launch", "--exec", "/nonexistent/worker"}, "/nonexistent/worker"},
      {{"launch", "--grace", "-1", "--exec", kWorker}, "--grace"},
  };
  for (auto& c : cases) {
    EXPECT_EQ(run(c.args), 2) << out_;
    expect_out(c.fragment);
  }
}

}  // namespace
