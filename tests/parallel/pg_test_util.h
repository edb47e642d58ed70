// Shared by the process-group tests: ranks as threads of this process (each with its own store
// client and process group: Gloo or the socket ring), and the inputs whose serial reduction the
// results must equal.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
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

// ReduceOp::Max on `engine`, 1 to 3 ranks: all_reduce (f32 and bf16) and reduce_scatter give every
// rank the largest of the ranks' values (small integers, exact in both dtypes), and a NaN on rank
// 0 gives way to the other ranks' numbers (the contract's rule, NCCL's fmaxf).
inline void check_max(TcpStore& host, PgEngine engine) {
  const size_t count = 1001;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int world = 1; world <= 3; ++world) {
    auto value = [&](int r, size_t i) { return i == 1 && r == 0 && world > 1 ? nan : input_value(r, i); };
    std::vector<std::vector<float>> f32(world), bf(world), rs(world);
    auto out = run_ranks(
        host, world, Ms(5000),
        [&](ProcessGroup& pg) {
          const int r = pg.rank();
          std::vector<float> buf(count);
          std::vector<uint16_t> b(count);
          for (size_t i = 0; i < count; ++i) {
            buf[i] = value(r, i);
            b[i] = fp32_to_bf16(buf[i]);
          }
          pg.all_reduce(buf.data(), count, DType::F32, ReduceOp::Max);
          pg.all_reduce(b.data(), count, DType::BF16, ReduceOp::Max);
          f32[r] = buf;
          for (uint16_t x : b) bf[r].push_back(bf16_to_fp32(x));
          std::vector<float> send(count * world), recv(count);
          for (size_t i = 0; i < send.size(); ++i) send[i] = value(r, i);
          pg.reduce_scatter(send.data(), recv.data(), count, DType::F32, ReduceOp::Max);
          rs[r] = recv;
        },
        engine);
    for (int r = 0; r < world; ++r)
      ASSERT_TRUE(out[r].ok) << "world " << world << " rank " << r << ": " << out[r].error;
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < count; ++i) {
        float want = -1e30f, want_rs = -1e30f;
        for (int q = 0; q < world; ++q) {
          if (!std::isnan(value(q, i))) want = std::max(want, value(q, i));
          if (!std::isnan(value(q, r * count + i))) want_rs = std::max(want_rs, value(q, r * count + i));
        }
        ASSERT_EQ(f32[r][i], want) << "f32 world " << world << " rank " << r << " i " << i;
        ASSERT_EQ(bf[r][i], want) << "bf16 world " << world << " rank " << r << " i " << i;
        ASSERT_EQ(rs[r][i], want_rs) << "reduce_scatter world " << world << " rank " << r << " i " << i;
      }
    }
  }
}

}  // namespace primus::parallel
