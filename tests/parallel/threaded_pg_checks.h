// The checks of the threaded process group (parallel/threaded_process_group.h), shared by the
// host test (tests/parallel/threaded_process_group_test.cpp) and the device one
// (tests/nccl/threaded_device_group_test.cpp): the same collectives on fresh random data, each
// result compared bit for bit with the value computed here in rank order (f32 sum of the inputs
// widened from their dtype, divided for Avg, rounded once; the largest for Max), whatever the
// buffers' memory.
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "io/dtype.h"
#include "parallel/threaded_process_group.h"

namespace primus::parallel::threaded_test {

using Ms = std::chrono::milliseconds;
using Bytes = std::vector<uint8_t>;

// Where the ranks' buffers live.
class TestMemory {
 public:
  virtual ~TestMemory() = default;
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void put(void* dst, const Bytes& src) = 0;     // host -> buffer
  virtual Bytes get(const void* src, size_t bytes) = 0;  // buffer -> host
  virtual ThreadedGroup::OpsFactory ops() = 0;           // empty: host memory
  virtual void enter_rank_thread() {}                    // e.g. cudaSetDevice
};

class HostTestMemory final : public TestMemory {
 public:
  void* alloc(size_t bytes) override { return ::operator new(bytes ? bytes : 1); }
  void release(void* p) override { ::operator delete(p); }
  void put(void* dst, const Bytes& src) override {
    if (!src.empty()) std::memcpy(dst, src.data(), src.size());
  }
  Bytes get(const void* src, size_t bytes) override {
    const auto* b = static_cast<const uint8_t*>(src);
    return Bytes(b, b + bytes);
  }
  ThreadedGroup::OpsFactory ops() override { return {}; }
};

// One buffer of a rank, freed with it.
class Buffer {
 public:
  Buffer(TestMemory& mem, size_t bytes) : mem_(mem), bytes_(bytes), p_(mem.alloc(bytes)) {}
  ~Buffer() { mem_.release(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* data() const { return p_; }
  char* at(size_t byte) const { return static_cast<char*>(p_) + byte; }
  void put(const Bytes& b) { mem_.put(p_, b); }
  Bytes get() const { return mem_.get(p_, bytes_); }

 private:
  TestMemory& mem_;
  size_t bytes_;
  void* p_;
};

// x as the dtype stores it.
inline float representable(float x, DType d) { return d == DType::BF16 ? io::bf16_to_fp32(io::fp32_to_bf16(x)) : x; }

inline Bytes encode(const std::vector<float>& v, DType d) {
  Bytes b(v.size() * dtype_size(d));
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == DType::F32) {
      std::memcpy(&b[i * 4], &v[i], 4);
    } else {
      const uint16_t h = io::fp32_to_bf16(v[i]);
      std::memcpy(&b[i * 2], &h, 2);
    }
  }
  return b;
}

inline std::vector<float> decode(const Bytes& b, DType d) {
  std::vector<float> v(b.size() / dtype_size(d));
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == DType::F32) {
      std::memcpy(&v[i], &b[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      v[i] = io::bf16_to_fp32(h);
    }
  }
  return v;
}

// The reduction of values[0..n) in rank order, as every engine must compute it.
inline float reference_reduce(const std::vector<float>& values, DType d, ReduceOp op) {
  float acc = values[0];
  for (size_t j = 1; j < values.size(); ++j) acc = op == ReduceOp::Max ? std::fmax(acc, values[j]) : acc + values[j];
  if (op == ReduceOp::Avg) acc /= static_cast<float>(values.size());
  return representable(acc, d);
}

// Fresh data: the seed is printed by SCOPED_TRACE in the checks, so a failure can be replayed.
inline uint32_t fresh_seed() { return std::random_device{}(); }

// rank_values[r][i]: uniform in [-1, 1), representable in d.
inline std::vector<std::vector<float>> random_inputs(std::mt19937& rng, int world, size_t n, DType d) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<std::vector<float>> v(static_cast<size_t>(world), std::vector<float>(n));
  for (auto& rank : v) {
    for (auto& x : rank) x = representable(u(rng), d);
  }
  return v;
}

inline void expect_equal(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &got[i], 4);
    std::memcpy(&b, &want[i], 4);
    if (a != b && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": first difference at " << first << ": got " << got[first] << ", want " << want[first];
}

struct RankOutcome {
  bool ok = false;
  std::string error;
  double seconds = 0;  // from the first call of fn to its return or throw
};

// Runs fn(group) on `world` threads over a fresh hub; returns each rank's outcome. `hub_out`,
// when given, receives the hub (to abort it from outside).
inline std::vector<RankOutcome> run_ranks(TestMemory& mem, int world, Ms timeout,
                                          const std::function<void(ProcessGroup&)>& fn,
                                          std::shared_ptr<ThreadedGroup>* hub_out = nullptr) {
  auto hub = ThreadedGroup::create(world, timeout, mem.ops());
  if (hub_out) *hub_out = hub;
  std::vector<RankOutcome> out(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto& o = out[static_cast<size_t>(r)];
      const auto t0 = std::chrono::steady_clock::now();
      try {
        mem.enter_rank_thread();
        auto pg = hub->rank(r);
        fn(*pg);
        o.ok = true;
      } catch (const std::exception& e) {
        o.error = e.what();
      }
      o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

inline void expect_all_ok(const std::vector<RankOutcome>& out, const std::string& what) {
  for (size_t r = 0; r < out.size(); ++r) EXPECT_TRUE(out[r].ok) << what << " rank " << r << ": " << out[r].error;
}

inline std::string case_name(const char* op, int world, DType d, size_t count, const char* extra = "") {
  return std::string(op) + " world " + std::to_string(world) + " " + dtype_name(d) + " count " + std::to_string(count) +
         extra;
}

const std::vector<int> kWorlds = {2, 3, 4};
const std::vector<DType> kDtypes = {DType::F32, DType::BF16};

// all_reduce, Sum, Avg and Max, f32 and bf16, counts smaller and larger than the world. Max meets
// a NaN on rank 0, which gives way to the other ranks' numbers.
inline void check_all_reduce(TestMemory& mem) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int world : kWorlds) {
    for (DType d : kDtypes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        for (size_t count : {size_t{1}, size_t{3}, size_t{1000}, size_t{4099}}) {
          const std::string what =
              case_name("all_reduce", world, d, count, (std::string(" ") + reduce_op_name(op)).c_str());
          auto in = random_inputs(rng, world, count, d);
          if (op == ReduceOp::Max) in[0][count / 2] = std::numeric_limits<float>::quiet_NaN();
          std::vector<std::vector<float>> got(static_cast<size_t>(world));
          auto out = run_ranks(mem, world, Ms(10000), [&](ProcessGroup& pg) {
            const size_t r = static_cast<size_t>(pg.rank());
            Buffer buf(mem, count * dtype_size(d));
            buf.put(encode(in[r], d));
            pg.all_reduce(buf.data(), count, d, op);
            got[r] = decode(buf.get(), d);
          });
          expect_all_ok(out, what);
          std::vector<float> want(count), column(static_cast<size_t>(world));
          for (size_t i = 0; i < count; ++i) {
            for (int r = 0; r < world; ++r) column[static_cast<size_t>(r)] = in[static_cast<size_t>(r)][i];
            want[i] = reference_reduce(column, d, op);
          }
          for (int r = 0; r < world; ++r)
            expect_equal(got[static_cast<size_t>(r)], want, what + " rank " + std::to_string(r));
        }
      }
    }
  }
}

// reduce_scatter, out of place and in place (recv = send + rank * count).
inline void check_reduce_scatter(TestMemory& mem) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int world : kWorlds) {
    for (DType d : kDtypes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        for (bool in_place : {false, true}) {
          const size_t count = 257;
          const std::string what = case_name("reduce_scatter", world, d, count,
                                             (std::string(in_place ? " in place " : " ") + reduce_op_name(op)).c_str());
          auto in = random_inputs(rng, world, count * static_cast<size_t>(world), d);
          std::vector<std::vector<float>> got(static_cast<size_t>(world));
          auto out = run_ranks(mem, world, Ms(10000), [&](ProcessGroup& pg) {
            const size_t r = static_cast<size_t>(pg.rank()), es = dtype_size(d);
            Buffer send(mem, in[r].size() * es), recv(mem, count * es);
            send.put(encode(in[r], d));
            void* to = in_place ? send.at(r * count * es) : recv.data();
            pg.reduce_scatter(send.data(), to, count, d, op);
            Bytes all = send.get();
            got[r] = in_place ? decode(Bytes(all.begin() + static_cast<std::ptrdiff_t>(r * count * es),
                                             all.begin() + static_cast<std::ptrdiff_t>((r + 1) * count * es)),
                                       d)
                              : decode(recv.get(), d);
          });
          expect_all_ok(out, what);
          std::vector<float> column(static_cast<size_t>(world));
          for (int r = 0; r < world; ++r) {
            std::vector<float> want(count);
            for (size_t i = 0; i < count; ++i) {
              for (int q = 0; q < world; ++q)
                column[static_cast<size_t>(q)] = in[static_cast<size_t>(q)][static_cast<size_t>(r) * count + i];
              want[i] = reference_reduce(column, d, op);
            }
            expect_equal(got[static_cast<size_t>(r)], want, what + " rank " + std::to_string(r));
          }
        }
      }
    }
  }
}

// all_gather, out of place and in place (send = recv + rank * count).
inline void check_all_gather(TestMemory& mem) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int world : kWorlds) {
    for (DType d : kDtypes) {
      for (bool in_place : {false, true}) {
        const size_t count = 301;
        const std::string what = case_name("all_gather", world, d, count, in_place ? " in place" : "");
        auto in = random_inputs(rng, world, count, d);
        std::vector<std::vector<float>> got(static_cast<size_t>(world));
        auto out = run_ranks(mem, world, Ms(10000), [&](ProcessGroup& pg) {
          const size_t r = static_cast<size_t>(pg.rank()), es = dtype_size(d);
          Buffer send(mem, count * es), recv(mem, count * es * static_cast<size_t>(world));
          // Garbage where the gather writes, so a chunk it skips shows.
          recv.put(Bytes(count * es * static_cast<size_t>(world), 0xff));
          const void* from = send.data();
          if (in_place) {
            Bytes all = recv.get();
            Bytes mine = encode(in[r], d);
            std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(r * count * es));
            recv.put(all);
            from = recv.at(r * count * es);
          } else {
            send.put(encode(in[r], d));
          }
          pg.all_gather(from, recv.data(), count, d);
          got[r] = decode(recv.get(), d);
        });
        expect_all_ok(out, what);
        std::vector<float> want;
        for (const auto& rank : in) want.insert(want.end(), rank.begin(), rank.end());
        for (int r = 0; r < world; ++r)
          expect_equal(got[static_cast<size_t>(r)], want, what + " rank " + std::to_string(r));
      }
    }
  }
}

// broadcast from every root.
inline void check_broadcast(TestMemory& mem) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int world : kWorlds) {
    for (DType d : kDtypes) {
      for (int root = 0; root < world; ++root) {
        const size_t count = 513;
        const std::string what = case_name("broadcast", world, d, count, (" root " + std::to_string(root)).c_str());
        auto in = random_inputs(rng, world, count, d);
        std::vector<std::vector<float>> got(static_cast<size_t>(world));
        auto out = run_ranks(mem, world, Ms(10000), [&](ProcessGroup& pg) {
          const size_t r = static_cast<size_t>(pg.rank());
          Buffer buf(mem, count * dtype_size(d));
          buf.put(encode(in[r], d));
          pg.broadcast(buf.data(), count, d, root);
          got[r] = decode(buf.get(), d);
        });
        expect_all_ok(out, what);
        for (int r = 0; r < world; ++r) {
          expect_equal(got[static_cast<size_t>(r)], in[static_cast<size_t>(root)], what + " rank " + std::to_string(r));
        }
      }
    }
  }
}

// all_to_all_v with the counts counts(q, p) from rank q to rank p; equal counts go through
// all_to_all.
inline void all_to_all_case(TestMemory& mem, std::mt19937& rng, int world, DType d,
                            const std::function<size_t(int, int)>& counts, bool equal) {
  const std::string what = case_name(equal ? "all_to_all" : "all_to_all_v", world, d, counts(0, 1));
  const size_t n = static_cast<size_t>(world);
  std::vector<std::vector<float>> in(n);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int q = 0; q < world; ++q) {
    size_t total = 0;
    for (int p = 0; p < world; ++p) total += counts(q, p);
    for (size_t i = 0; i < total; ++i) in[static_cast<size_t>(q)].push_back(representable(u(rng), d));
  }
  std::vector<std::vector<float>> got(n);
  auto out = run_ranks(mem, world, Ms(10000), [&](ProcessGroup& pg) {
    const int r = pg.rank();
    std::vector<size_t> sc(n), rc(n);
    size_t rtotal = 0;
    for (int p = 0; p < world; ++p) {
      sc[static_cast<size_t>(p)] = counts(r, p);
      rc[static_cast<size_t>(p)] = counts(p, r);
      rtotal += rc[static_cast<size_t>(p)];
    }
    const size_t es = dtype_size(d);
    Buffer send(mem, in[static_cast<size_t>(r)].size() * es), recv(mem, rtotal * es);
    send.put(encode(in[static_cast<size_t>(r)], d));
    if (equal) {
      pg.all_to_all(send.data(), recv.data(), counts(0, 0), d);
    } else {
      pg.all_to_all_v(send.data(), sc, recv.data(), rc, d);
    }
    got[static_cast<size_t>(r)] = decode(recv.get(), d);
  });
  expect_all_ok(out, what);
  for (int r = 0; r < world; ++r) {
    std::vector<float> want;
    for (int q = 0; q < world; ++q) {
      size_t off = 0;
      for (int p = 0; p < r; ++p) off += counts(q, p);
      const auto& src = in[static_cast<size_t>(q)];
      want.insert(want.end(), src.begin() + static_cast<std::ptrdiff_t>(off),
                  src.begin() + static_cast<std::ptrdiff_t>(off + counts(q, r)));
    }
    expect_equal(got[static_cast<size_t>(r)], want, what + " rank " + std::to_string(r));
  }
}

inline void check_all_to_all(TestMemory& mem) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int world : kWorlds) {
    for (DType d : kDtypes) {
      all_to_all_case(
          mem, rng, world, d, [](int, int) { return size_t{37}; }, true);
      // Uneven, with zeros: some pairs exchange nothing, rank 0 sends nothing to itself.
      all_to_all_case(
          mem, rng, world, d, [](int q, int p) { return static_cast<size_t>((q * 3 + p * 5) % 4) * 11; }, false);
    }
  }
}

// Point to point: a ring (rank 0 sends first, the others receive first, as the contract asks),
// then two tags from every rank to rank 0, received in the reverse order of the senders.
inline void check_send_recv(TestMemory& mem) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int world : kWorlds) {
    for (DType d : kDtypes) {
      const size_t count = 129;
      const std::string what = case_name("send/recv", world, d, count);
      auto in = random_inputs(rng, world, 2 * count, d);
      std::vector<std::vector<float>> ring(static_cast<size_t>(world)), ring_back(static_cast<size_t>(world));
      std::vector<std::vector<std::vector<float>>> at_zero(static_cast<size_t>(world));
      auto out = run_ranks(mem, world, Ms(10000), [&](ProcessGroup& pg) {
        const int r = pg.rank(), next = (r + 1) % world, prev = (r + world - 1) % world;
        const size_t es = dtype_size(d);
        Buffer mine(mem, 2 * count * es), got(mem, count * es);
        mine.put(encode(in[static_cast<size_t>(r)], d));
        if (r == 0) {
          pg.send(mine.data(), count, d, next, 5);
          pg.recv(got.data(), count, d, prev, 5);
        } else {
          pg.recv(got.data(), count, d, prev, 5);
          pg.send(mine.data(), count, d, next, 5);
        }
        ring[static_cast<size_t>(r)] = decode(got.get(), d);
        // One ring step the other way round, every rank at once (send_recv orders the blocking
        // sends itself): the second half of each rank's data to the previous rank.
        pg.send_recv(mine.at(count * es), prev, got.data(), next, count, d, 7);
        ring_back[static_cast<size_t>(r)] = decode(got.get(), d);
        // Tags 1 and 2 carry the two halves of each rank's data to rank 0.
        if (r == 0) {
          for (int q = world - 1; q >= 1; --q) {
            for (uint32_t tag : {1u, 2u}) {
              pg.recv(got.data(), count, d, q, tag);
              at_zero[static_cast<size_t>(q)].push_back(decode(got.get(), d));
            }
          }
        } else {
          pg.send(mine.data(), count, d, 0, 1);
          pg.send(mine.at(count * es), count, d, 0, 2);
        }
      });
      expect_all_ok(out, what);
      for (int r = 0; r < world; ++r) {
        const auto& src = in[static_cast<size_t>((r + world - 1) % world)];
        expect_equal(ring[static_cast<size_t>(r)], std::vector<float>(src.begin(), src.begin() + count),
                     what + " ring");
        const auto& back = in[static_cast<size_t>((r + 1) % world)];
        expect_equal(ring_back[static_cast<size_t>(r)], std::vector<float>(back.begin() + count, back.end()),
                     what + " send_recv ring");
      }
      for (int q = 1; q < world; ++q) {
        const auto& src = in[static_cast<size_t>(q)];
        ASSERT_EQ(at_zero[static_cast<size_t>(q)].size(), 2u);
        expect_equal(at_zero[static_cast<size_t>(q)][0], std::vector<float>(src.begin(), src.begin() + count),
                     what + " tag 1");
        expect_equal(at_zero[static_cast<size_t>(q)][1], std::vector<float>(src.begin() + count, src.end()),
                     what + " tag 2");
      }
    }
  }
}

// The tp and dp groups of a 2 x 2 mesh (tp fastest: tp groups {0,1} {2,3}, dp groups {0,2} {1,3}),
// collectives on both interleaved for `rounds` rounds, while the other pair works concurrently;
// each sum covers its own ranks only. Ranks list the dp group in reverse on purpose: the
// sub-group's rank i is ranks[i].
inline void check_mesh_subgroups(TestMemory& mem, int rounds) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const size_t count = 64;
  std::vector<std::vector<std::vector<float>>> in(static_cast<size_t>(rounds));
  for (auto& round : in) round = random_inputs(rng, 4, count, DType::F32);
  std::vector<std::vector<std::vector<float>>> tp_got(4), dp_got(4);
  std::vector<int> tp_rank(4), dp_rank(4);
  auto out = run_ranks(mem, 4, Ms(10000), [&](ProcessGroup& pg) {
    const int r = pg.rank(), tp_base = r / 2 * 2, col = r % 2;
    auto tp = pg.new_subgroup({tp_base, tp_base + 1}, "tp" + std::to_string(tp_base / 2));
    auto dp = pg.new_subgroup({col + 2, col}, "dp" + std::to_string(col));
    tp_rank[static_cast<size_t>(r)] = tp->rank();
    dp_rank[static_cast<size_t>(r)] = dp->rank();
    Buffer buf(mem, count * 4);
    for (int k = 0; k < rounds; ++k) {
      buf.put(encode(in[static_cast<size_t>(k)][static_cast<size_t>(r)], DType::F32));
      tp->all_reduce(buf.data(), count, DType::F32, ReduceOp::Sum);
      tp_got[static_cast<size_t>(r)].push_back(decode(buf.get(), DType::F32));
      buf.put(encode(in[static_cast<size_t>(k)][static_cast<size_t>(r)], DType::F32));
      dp->all_reduce(buf.data(), count, DType::F32, ReduceOp::Avg);
      dp_got[static_cast<size_t>(r)].push_back(decode(buf.get(), DType::F32));
    }
    tp->barrier();
    dp->barrier();
  });
  expect_all_ok(out, "mesh sub-groups");
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(tp_rank[static_cast<size_t>(r)], r % 2);
    EXPECT_EQ(dp_rank[static_cast<size_t>(r)], r < 2 ? 1 : 0);
  }
  for (int r = 0; r < 4 && !::testing::Test::HasFailure(); ++r) {
    const int tp_peer = r ^ 1, dp_peer = r ^ 2;
    for (int k = 0; k < rounds; ++k) {
      const auto& v = in[static_cast<size_t>(k)];
      std::vector<float> tp_want(count), dp_want(count);
      for (size_t i = 0; i < count; ++i) {
        // Sub-group rank order: tp {even, odd}; dp {upper row, lower row}.
        const int t0 = std::min(r, tp_peer), t1 = std::max(r, tp_peer);
        tp_want[i] =
            reference_reduce({v[static_cast<size_t>(t0)][i], v[static_cast<size_t>(t1)][i]}, DType::F32, ReduceOp::Sum);
        const int d0 = std::max(r, dp_peer), d1 = std::min(r, dp_peer);
        dp_want[i] =
            reference_reduce({v[static_cast<size_t>(d0)][i], v[static_cast<size_t>(d1)][i]}, DType::F32, ReduceOp::Avg);
      }
      expect_equal(tp_got[static_cast<size_t>(r)][static_cast<size_t>(k)], tp_want, "tp round " + std::to_string(k));
      expect_equal(dp_got[static_cast<size_t>(r)][static_cast<size_t>(k)], dp_want, "dp round " + std::to_string(k));
    }
  }
}

// Many small all_reduces back to back: a rank that overtook another, or read a buffer being
// rewritten, shows as a wrong sum. Each rank adds rank + 1 to its value and the sum must grow
// by the same amount every call.
inline void check_many_small_all_reduces(TestMemory& mem, int world, int calls) {
  std::vector<std::vector<float>> got(static_cast<size_t>(world));
  auto out = run_ranks(mem, world, Ms(10000), [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Buffer buf(mem, 4 * sizeof(float));
    auto& mine = got[static_cast<size_t>(r)];
    for (int k = 0; k < calls; ++k) {
      std::vector<float> v(4);
      for (size_t i = 0; i < 4; ++i) v[i] = static_cast<float>(k * (r + 1)) + static_cast<float>(i);
      buf.put(encode(v, DType::F32));
      pg.all_reduce(buf.data(), 4, DType::F32, ReduceOp::Sum);
      auto res = decode(buf.get(), DType::F32);
      mine.insert(mine.end(), res.begin(), res.end());
    }
  });
  expect_all_ok(out, "many all_reduces world " + std::to_string(world));
  const float ranks_sum = static_cast<float>(world * (world + 1) / 2);
  for (int r = 0; r < world; ++r) {
    std::vector<float> want;
    for (int k = 0; k < calls; ++k) {
      for (size_t i = 0; i < 4; ++i)
        want.push_back(static_cast<float>(k) * ranks_sum + static_cast<float>(world) * static_cast<float>(i));
    }
    expect_equal(got[static_cast<size_t>(r)], want,
                 "many all_reduces world " + std::to_string(world) + " rank " + std::to_string(r));
  }
}

}  // namespace primus::parallel::threaded_test
