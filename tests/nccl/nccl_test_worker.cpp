// One rank of the NCCL process-group tests (nccl_gpu_test.cpp starts several). Reads the
// torchrun variables, joins a NcclProcessGroup on GPU LOCAL_RANK and runs one scenario:
//   collectives  every collective on f32 and bf16 (all_reduce sum, avg and max), results checked
//                against the serial reduction (small integers: exact in any order); prints "OK rank R"
//   hang         rank 1 stops itself (SIGSTOP) before the all-reduce; the others must fail
//   leave        rank 1 leaves (exit 0) without joining the all-reduce; the others must fail
//   stall        rank 1 stays alive (heartbeats go on) but never joins; the others must fail
// Errors print "ERROR rank R: <what>" and exit 3.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <thread>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "parallel/cuda/nccl_process_group.h"
#include "core/util/error.h"
#include "parallel/launch_env.h"
#include "parallel/tcp_store.h"
#include "io/dtype.h"
#include "turbo/core/cuda_check.h"

using namespace primus;

namespace {

float value(int rank, size_t i) { return static_cast<float>(static_cast<int>((rank * 31 + i * 7) % 13) - 6); }
using primus::io::bf16_to_fp32;
using primus::io::fp32_to_bf16;

// Host buffer of `n` values of `dtype` from floats, and back.
std::vector<char> pack(const std::vector<float>& v, parallel::DType t) {
  std::vector<char> out(v.size() * (t == parallel::DType::F32 ? 4 : 2));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == parallel::DType::F32) {
      std::memcpy(&out[i * 4], &v[i], 4);
    } else {
      uint16_t h = fp32_to_bf16(v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}
std::vector<float> unpack(const std::vector<char>& b, parallel::DType t) {
  const size_t es = t == parallel::DType::F32 ? 4 : 2;
  std::vector<float> out(b.size() / es);
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == parallel::DType::F32) {
      std::memcpy(&out[i], &b[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      out[i] = bf16_to_fp32(h);
    }
  }
  return out;
}

struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t b) : bytes(b) { CUDA_CHECK(cudaMalloc(&p, b)); }
  ~Dev() { cudaFree(p); }
  void put(const std::vector<char>& h) { CUDA_CHECK(cudaMemcpy(p, h.data(), h.size(), cudaMemcpyHostToDevice)); }
  std::vector<char> get() {
    std::vector<char> h(bytes);
    CUDA_CHECK(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
    return h;
  }
};

void expect_eq(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i]) {
      throw RuntimeError(fmt::format("{}: element {} is {}, expected {}", what, i, got[i], want[i]));
    }
  }
}

void collectives(parallel::NcclProcessGroup& pg) {
  const int R = pg.rank(), W = pg.world_size();
  const size_t n = 1000 * W + 8;  // not a multiple of anything NCCL likes
  for (parallel::DType t : {parallel::DType::F32, parallel::DType::BF16}) {
    const std::string tn = t == parallel::DType::F32 ? "f32" : "bf16";
    const size_t es = t == parallel::DType::F32 ? 4 : 2;
    std::vector<float> mine(n), sum(n, 0.0f);
    for (size_t i = 0; i < n; ++i) {
      mine[i] = value(R, i);
      for (int r = 0; r < W; ++r) sum[i] += value(r, i);
    }
    Dev buf(n * es);
    // all_reduce sum and avg
    buf.put(pack(mine, t));
    pg.all_reduce(buf.p, n, t, parallel::ReduceOp::Sum);
    pg.synchronize();
    expect_eq(unpack(buf.get(), t), sum, "all_reduce sum " + tn);
    if (W == 2 || W == 4 || W == 1) {  // averages of small integers over 1, 2, 4 ranks are exact
      std::vector<float> avg(n);
      for (size_t i = 0; i < n; ++i) avg[i] = sum[i] / static_cast<float>(W);
      buf.put(pack(mine, t));
      pg.all_reduce(buf.p, n, t, parallel::ReduceOp::Avg);
      pg.synchronize();
      expect_eq(unpack(buf.get(), t), avg, "all_reduce avg " + tn);
    }
    // all_reduce max, with a NaN on rank 0 that gives way to the other ranks' numbers (fmaxf)
    auto nan_at = [&](int r, size_t i) { return r == 0 && W > 1 && i == 1; };
    std::vector<float> with_nan = mine, max(n, -1e30f);
    if (nan_at(R, 1)) with_nan[1] = std::nanf("");
    for (size_t i = 0; i < n; ++i)
      for (int r = 0; r < W; ++r)
        if (!nan_at(r, i)) max[i] = std::max(max[i], value(r, i));
    buf.put(pack(with_nan, t));
    pg.all_reduce(buf.p, n, t, parallel::ReduceOp::Max);
    pg.synchronize();
    expect_eq(unpack(buf.get(), t), max, "all_reduce max " + tn);
    // reduce_scatter, in place (recv = send + rank * chunk)
    const size_t chunk = n / W, total = chunk * W;
    std::vector<float> full(mine.begin(), mine.begin() + total);
    Dev rs(total * es);
    rs.put(pack(full, t));
    void* recv = static_cast<char*>(rs.p) + R * chunk * es;
    pg.reduce_scatter(rs.p, recv, chunk, t, parallel::ReduceOp::Sum);
    pg.synchronize();
    auto got = unpack(rs.get(), t);
    std::vector<float> mine_chunk(got.begin() + R * chunk, got.begin() + (R + 1) * chunk);
    std::vector<float> want_chunk(sum.begin() + R * chunk, sum.begin() + (R + 1) * chunk);
    expect_eq(mine_chunk, want_chunk, "reduce_scatter " + tn);
    // all_gather, in place: every rank's chunk ends up everywhere
    pg.all_gather(recv, rs.p, chunk, t);
    pg.synchronize();
    expect_eq(unpack(rs.get(), t), std::vector<float>(sum.begin(), sum.begin() + total), "all_gather " + tn);
    // broadcast from the last rank
    buf.put(pack(mine, t));
    pg.broadcast(buf.p, n, t, W - 1);
    pg.synchronize();
    std::vector<float> last(n);
    for (size_t i = 0; i < n; ++i) last[i] = value(W - 1, i);
    expect_eq(unpack(buf.get(), t), last, "broadcast " + tn);
  }
  pg.barrier();
  bool threw = false;
  try {
    pg.broadcast(nullptr, 1, parallel::DType::F32, W);
  } catch (const parallel::CollectiveError& e) {
    threw = std::string(e.what()).find(fmt::format("root {} is not a rank", W)) != std::string::npos;
  }
  if (!threw) throw RuntimeError("broadcast from a root outside the group did not fail naming the root");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "collectives";
  int rank = -1;
  try {
    parallel::DistEnv env = parallel::read_dist_env();
    rank = env.rank;
    auto store = parallel::TcpStore::from_env(env);
    parallel::NcclGroupOptions opt;
    opt.device = env.local_rank;
    opt.timeout = std::chrono::milliseconds(static_cast<int64_t>(env.timeout_s * 1000));
    opt.heartbeat = std::chrono::milliseconds(200);
    parallel::NcclProcessGroup pg(*store, env, opt);
    if (mode == "collectives") {
      collectives(pg);
      std::printf("OK rank %d NCCL %s from %s NVLS=%s\n", rank, pg.library().version().c_str(),
                  pg.library().path.c_str(), std::getenv("NCCL_NVLS_ENABLE"));
      std::fflush(stdout);
      return 0;
    }
    Dev buf(4096);
    CUDA_CHECK(cudaMemset(buf.p, 0, 4096));
    pg.all_reduce(buf.p, 1024, parallel::DType::F32, parallel::ReduceOp::Sum);  // one that completes
    pg.synchronize();
    if (rank == 1) {
      std::printf("rank 1 %s now\n", mode == "hang" ? "stops" : mode == "stall" ? "stalls" : "leaves");
      std::fflush(stdout);
      if (mode == "hang") std::raise(SIGSTOP);
      if (mode == "stall") std::this_thread::sleep_for(std::chrono::seconds(120));  // killed by the test first
      std::_Exit(0);
    }
    pg.all_reduce(buf.p, 1024, parallel::DType::F32, parallel::ReduceOp::Sum);
    pg.synchronize();
    std::printf("UNEXPECTED rank %d: the all-reduce completed without rank 1\n", rank);
    std::fflush(stdout);
    std::_Exit(4);
  } catch (const std::exception& e) {
    std::printf("ERROR rank %d: %s\n", rank, e.what());
    std::fflush(stdout);
    std::_Exit(3);
  }
}
