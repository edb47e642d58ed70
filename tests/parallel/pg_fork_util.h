// Shared by the process-group tests with real processes: ranks fork()ed from the test, the test
// process hosting the store, each rank's group made by make_test_group (Gloo or the socket ring).
#pragma once
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "tests/core/test_util.h"
#include "tests/parallel/pg_test_util.h"

namespace primus::parallel {

// What a forked rank does; it returns its exit code and writes its error text to `report`.
using RankBody = std::function<int(ProcessGroup& pg, std::string& report)>;

struct Forked {
  std::vector<pid_t> pids;
  std::vector<std::filesystem::path> reports;
};

class ForkedRanksTest : public StoreTest {
 protected:
  // A rank whose group setup throws exits 3 with the error as its report.
  Forked fork_group_ranks(PgEngine engine, int world, Ms timeout, const RankBody& body) {
    Forked f;
    static int generation = 0;
    std::string name = "procpg" + std::to_string(generation++);
    for (int r = 0; r < world; ++r) {
      f.reports.push_back(dir_.path() / ("rank" + std::to_string(r) + "_" + name));
      pid_t pid = ::fork();
      if (pid == 0) {
        int rc = 0;
        std::string report;
        try {
          TcpStore store("127.0.0.1", server_->port(), false, Ms(10000));
          auto pg = make_test_group(engine, store, r, world, timeout, name);
          rc = body(*pg, report);
        } catch (const std::exception& e) {
          report = e.what();
          rc = 3;
        }
        std::ofstream(f.reports.back()) << report;
        std::fflush(nullptr);
        ::_exit(rc);
      }
      f.pids.push_back(pid);
    }
    return f;
  }
  // Waits for rank r; returns its wait status.
  int wait_rank(const Forked& f, int r) {
    int st = 0;
    ::waitpid(f.pids[r], &st, 0);
    return st;
  }
  std::string report(const Forked& f, int r) {
    std::ifstream in(f.reports[r]);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  primus::testing::TempDir dir_;
};

}  // namespace primus::parallel
