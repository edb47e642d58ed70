// Shared by the process-group tests: ranks as threads of this process (each with its own store
// client and process group: Gloo or the socket ring), and the inputs whose serial reduction the
// results must equal.
#pragma once
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "parallel/gloo_process_group.h"
#include "parallel/socket_process_group.h"
#include "io/dtype.h"
#include "tests/parallel/store_test_util.h"

namespace primus::parallel {

// Small integers: every partial sum is exact in f32 and (below 256) in bf16, so any summation
// order gives the serial result bit for bit.
inline float input_value(int rank, size_t i) { return static_cast<float>(static_cast<int>((rank * 31 + i * 7) % 13) - 6); }

// bf16 in and out: io/dtype.h's conversions (exact for the small integers above).
using io::bf16_to_fp32;
using io::fp32_to_bf16;

struct RankOutcome {
  bool ok = false;
  std::string error;
  double seconds = 0;  // from the start of fn to its return or throw
};

enum class PgEngine { Socket, Gloo };

// One rank's group of `world` over the store at 127.0.0.1:store.port().
inline std::unique_ptr<ProcessGroup> make_test_group(PgEngine engine, TcpStore& store, int rank, int world, Ms timeout,
                                                     const std::string& name) {
  if (engine == PgEngine::Gloo) {
    return std::make_unique<GlooProcessGroup>(store, "127.0.0.1", rank, world, timeout, name, "127.0.0.1");
  }
  return std::make_unique<SocketProcessGroup>(store, rank, world, timeout, name, "127.0.0.1");
}

// Runs fn(group) on `world` threads, each rank with its own group over a store hosted by the
// caller. A group name unique per call keeps runs on one store apart.
inline std::vector<RankOutcome> run_ranks(TcpStore& host, int world, Ms timeout,
                                          const std::function<void(ProcessGroup&)>& fn,
                                          PgEngine engine = PgEngine::Socket) {
  static std::atomic<int> generation{0};
  std::string name = "pg" + std::to_string(generation++);
  std::vector<RankOutcome> out(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        TcpStore store("127.0.0.1", host.port(), false, Ms(10000));
        auto pg = make_test_group(engine, store, r, world, timeout, name);
        auto t0 = Clock::now();
        try {
          fn(*pg);
          out[r].ok = true;
        } catch (const std::exception& e) {
          out[r].error = e.what();
        }
        out[r].seconds = seconds_since(t0);
      } catch (const std::exception& e) {
        out[r].error = std::string("setup: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace primus::parallel
