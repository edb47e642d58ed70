// A stand-in rank for the launcher tests (`primus launch --exec parallel_test_worker -- STEP...`):
// it runs its steps in order, so one command line describes how every rank behaves.
// A step "rK:STEP" runs only on rank K. Steps:
//   env            print "env rank=.. world=.. local=.. local_world=.. node=.. addr=.. port=.. source=.."
//   echo:TEXT      print TEXT on stdout;  echoerr:TEXT on stderr;  partial:TEXT without '\n'
//   exit:N         exit with code N
//   kill:SIG       die by signal number SIG
//   sleep:S        sleep S seconds (a signal with its default action ends it)
//   ignore-term    ignore SIGTERM from now on (a hung rank)
//   trap           on SIGTERM/SIGINT print "caught SIGNAME" and exit 0; on SIGUSR1 print and go on
//   ready:DIR      write this process's pid to DIR/ready_<rank> (the test waits for these files)
//   await:PATH     wait (up to 10 s) until PATH exists: orders one rank's steps after another's
//   store          rendezvous through the TCP store: rank 0 publishes a 128-byte id (like NCCL's),
//                  every rank reads it, prints "store id=<checksum>", meets the others at a barrier
#include <signal.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "parallel/launch_env.h"
#include "parallel/tcp_store.h"

namespace {

volatile sig_atomic_t g_caught = 0;

void on_trap(int sig) {
  g_caught = sig;
  const char* name = sig == SIGTERM ? "caught SIGTERM\n" : sig == SIGINT ? "caught SIGINT\n" : "caught SIGUSR1\n";
  [[maybe_unused]] ssize_t n = ::write(1, name, std::char_traits<char>::length(name));
  if (sig != SIGUSR1) ::_exit(0);
}

void store_step(const primus::parallel::DistEnv& env) {
  auto store = primus::parallel::TcpStore::from_env(env);
  if (env.rank == 0) {
    std::string id(128, '\0');
    std::mt19937 rng(std::random_device{}());
    for (auto& c : id) c = static_cast<char>(rng());
    store->set("nccl_id", id);
  }
  std::string id = store->get("nccl_id");
  uint64_t sum = 1469598103934665603ull;  // FNV-1a over the bytes: equal ids print equal sums
  for (unsigned char c : id) sum = (sum ^ c) * 1099511628211ull;
  std::printf("store id=%016llx bytes=%zu\n", static_cast<unsigned long long>(sum), id.size());
  std::fflush(stdout);
  store->barrier("end", env.rank, env.world_size);  // rank 0's server lives until all have read
}

}  // namespace

int main(int argc, char** argv) {
  auto env = primus::parallel::read_dist_env();
  for (int i = 1; i < argc; ++i) {
    std::string step = argv[i];
    if (step.size() > 1 && step[0] == 'r' && step.find(':') != std::string::npos && std::isdigit(step[1])) {
      size_t colon = step.find(':');
      if (std::stoi(step.substr(1, colon - 1)) != env.rank) continue;
      step = step.substr(colon + 1);
    }
    size_t colon = step.find(':');
    std::string op = step.substr(0, colon), arg = colon == std::string::npos ? "" : step.substr(colon + 1);
    if (op == "env") {
      std::printf("env rank=%d world=%d local=%d local_world=%d node=%d addr=%s port=%d source=%s\n", env.rank,
                  env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.master_addr.c_str(),
                  env.master_port, env.source.c_str());
    } else if (op == "echo") {
      std::printf("%s\n", arg.c_str());
    } else if (op == "echoerr") {
      std::fprintf(stderr, "%s\n", arg.c_str());
    } else if (op == "partial") {
      std::printf("%s", arg.c_str());
    } else if (op == "exit") {
      std::fflush(nullptr);
      return std::atoi(arg.c_str());
    } else if (op == "kill") {
      std::fflush(nullptr);
      ::signal(std::atoi(arg.c_str()), SIG_DFL);
      ::raise(std::atoi(arg.c_str()));
    } else if (op == "sleep") {
      std::fflush(nullptr);
      std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(arg.c_str())));
    } else if (op == "ignore-term") {
      ::signal(SIGTERM, SIG_IGN);
    } else if (op == "trap") {
      for (int sig : {SIGTERM, SIGINT, SIGUSR1}) ::signal(sig, on_trap);
    } else if (op == "ready") {
      std::string path = arg + "/ready_" + std::to_string(env.rank);
      std::ofstream(path + ".tmp") << ::getpid() << "\n";
      std::rename((path + ".tmp").c_str(), path.c_str());  // the test never sees a half-written file
    } else if (op == "await") {
      for (int t = 0; t < 1000 && ::access(arg.c_str(), F_OK) != 0; ++t) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } else if (op == "store") {
      store_step(env);
    } else {
      std::fprintf(stderr, "parallel_test_worker: unknown step '%s'\n", argv[i]);
      return 99;
    }
    std::fflush(nullptr);
  }
  return 0;
}
