// Ring attention between real processes (fork()ed ranks over a Gloo group, the parent hosts the
// store): each rank's out, lse and dq/dk/dv of its tokens equal single-process attention over the
// whole sequence cut the same way, for cp = 2, 3, 4, GQA, with and without a sliding window;
// a rank that dies inside the ring is named by the others.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backends/reference/context_parallel.h"
#include "tests/parallel/pg_fork_util.h"

namespace primus::parallel {
namespace {

using backends::reference::cp_all_positions;
using backends::reference::cp_split;
using backends::reference::ring_attention_backward;
using backends::reference::ring_attention_forward;
using turbo::cpu::AttentionParams;

constexpr int64_t kB = 2, kH = 4, kKVH = 2, kD = 8;
constexpr int64_t kChunk = 20;  // tokens per chunk: a rank's 40 span two 32-row query blocks

// max|a - ref| / max|ref| (+inf when ref is all zeros, so a vacuous comparison fails).
double rel_error(const std::vector<float>& a, const std::vector<double>& ref) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return std::isnan(diff) ? INFINITY : (scale > 0 ? diff / scale : INFINITY);
}

// The whole sequence: random float inputs and random starting gradients (the ring accumulates).
struct Problem {
  AttentionParams p;
  std::vector<float> q, k, v, dout, dq0, dk0, dv0;
};
// Single-process attention of a Problem in double. Computed in the forked ranks, not before the
// fork: an OpenMP thread pool started in the parent does not exist in a child, whose next
// parallel region would then wait for it forever.
struct Expected {
  std::vector<double> out, lse, dq, dk, dv;
};

Problem make_problem(uint64_t seed, int64_t T, int64_t window, bool causal) {
  Problem pr;
  pr.p.B = kB, pr.p.T = T, pr.p.H = kH, pr.p.KVH = kKVH, pr.p.D = kD;
  pr.p.causal = causal;
  pr.p.window = window;
  std::mt19937_64 gen(seed);
  auto draw = [&](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = static_cast<float>(std::uniform_real_distribution<double>(-2, 2)(gen));
    return x;
  };
  const int64_t nq = kB * T * kH * kD, nkv = kB * T * kKVH * kD;
  pr.q = draw(nq), pr.k = draw(nkv), pr.v = draw(nkv), pr.dout = draw(nq);
  pr.dq0 = draw(nq), pr.dk0 = draw(nkv), pr.dv0 = draw(nkv);
  return pr;
}

Expected expected(const Problem& pr) {
  auto wide = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  const std::vector<double> q = wide(pr.q), k = wide(pr.k), v = wide(pr.v), dout = wide(pr.dout);
  Expected ex;
  ex.out.resize(q.size()), ex.lse.resize(pr.p.B * pr.p.H * pr.p.T);
  turbo::cpu::attention_forward(ex.out.data(), ex.lse.data(), q.data(), k.data(), v.data(), pr.p);
  ex.dq = wide(pr.dq0), ex.dk = wide(pr.dk0), ex.dv = wide(pr.dv0);
  turbo::cpu::attention_backward(ex.dq.data(), ex.dk.data(), ex.dv.data(), dout.data(), q.data(),
                                 k.data(), v.data(), ex.out.data(), ex.lse.data(), pr.p);
  return ex;
}

// This rank's tokens of a [B', T, inner] tensor, in the positions table's order (row `rank`).
template <typename E>
std::vector<E> take(const std::vector<E>& full, int64_t B, int64_t T, int64_t inner,
                    const int32_t* pos, int64_t Tl) {
  std::vector<E> y;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tl; ++i)
      y.insert(y.end(), full.begin() + (b * T + pos[i]) * inner,
               full.begin() + (b * T + pos[i] + 1) * inner);
  return y;
}

class ContextParallelProcesses : public ForkedRanksTest {
 protected:
  // Every rank runs the ring forward and backward on its slice and checks it against the
  // whole-sequence result; `table` is the positions table ([cp, T/cp]) or empty for the
  // load-balanced layout.
  void expect_ring_matches(int cp, int64_t window, bool causal = true,
                           std::vector<int32_t> table = {}) {
    const uint64_t seed = std::random_device{}();
    SCOPED_TRACE(::testing::Message() << "cp=" << cp << " window=" << window << " causal=" << causal
                                      << " seed=" << seed << (table.empty() ? "" : " own table"));
    const int64_t T = 2 * cp * kChunk, Tl = T / cp;
    const Problem pr = make_problem(seed, T, window, causal);
    const std::vector<int32_t> layout = table.empty() ? cp_all_positions(T, cp) : table;
    auto f = fork_group_ranks(PgEngine::Gloo, cp, Ms(20000), [&](ProcessGroup& pg, std::string& report) {
      const int r = pg.rank();
      const int32_t* pos = layout.data() + r * Tl;
      AttentionParams pl = pr.p;
      pl.T = Tl;
      const int32_t* positions = table.empty() ? nullptr : table.data();
      const int64_t hd = kH * kD, kvd = kKVH * kD;
      const auto q = take(pr.q, kB, T, hd, pos, Tl), k = take(pr.k, kB, T, kvd, pos, Tl),
                 v = take(pr.v, kB, T, kvd, pos, Tl), dout = take(pr.dout, kB, T, hd, pos, Tl);
      std::vector<float> out(q.size()), lse(kB * kH * Tl);
      ring_attention_forward(pg, out.data(), lse.data(), q.data(), k.data(), v.data(), pl, positions);
      auto dq = take(pr.dq0, kB, T, hd, pos, Tl), dk = take(pr.dk0, kB, T, kvd, pos, Tl),
           dv = take(pr.dv0, kB, T, kvd, pos, Tl);
      ring_attention_backward(pg, dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                              v.data(), out.data(), lse.data(), pl, positions);
      const Expected ex = expected(pr);
      const double errs[] = {rel_error(out, take(ex.out, kB, T, hd, pos, Tl)),
                             rel_error(lse, take(ex.lse, kB * kH, T, 1, pos, Tl)),
                             rel_error(dq, take(ex.dq, kB, T, hd, pos, Tl)),
                             rel_error(dk, take(ex.dk, kB, T, kvd, pos, Tl)),
                             rel_error(dv, take(ex.dv, kB, T, kvd, pos, Tl))};
      report = fmt::format("rank {}: relative errors out {:.3g} lse {:.3g} dq {:.3g} dk {:.3g} dv {:.3g}",
                           r, errs[0], errs[1], errs[2], errs[3], errs[4]);
      for (double e : errs)
        if (!(e < 1e-5)) return 1;
      return 0;
    });
    for (int r = 0; r < cp; ++r) {
      const int st = wait_rank(f, r);
      EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "rank " << r << " status " << st << ": " << report(f, r);
    }
  }
};

// Windows: none, shorter than a chunk (whole blocks out of reach: skipped), longer than one.
TEST_F(ContextParallelProcesses, RingAttentionEqualsWholeSequenceCp2) {
  for (int64_t w : {0, 13, 45}) expect_ring_matches(2, w);
}
TEST_F(ContextParallelProcesses, RingAttentionEqualsWholeSequenceCp3) {
  for (int64_t w : {0, 13, 45}) expect_ring_matches(3, w);
  expect_ring_matches(3, 0, false);
}
TEST_F(ContextParallelProcesses, RingAttentionEqualsWholeSequenceCp4) {
  for (int64_t w : {0, 13}) expect_ring_matches(4, w);
}

// A layout other than the load-balanced one (rank r holds tokens r*Tl.. in reverse): the
// positions table is honoured, including blocks that lie wholly after a rank's queries.
TEST_F(ContextParallelProcesses, RingAttentionWithAnyPositionsTable) {
  const int cp = 3;
  const int64_t Tl = 2 * kChunk;
  std::vector<int32_t> table;
  for (int r = 0; r < cp; ++r)
    for (int64_t i = Tl - 1; i >= 0; --i) table.push_back(static_cast<int32_t>(r * Tl + i));
  expect_ring_matches(cp, 0, true, table);
  expect_ring_matches(cp, 17, true, table);
}

// Forwards to a real group; raises SIGKILL when its owner makes its first send, that is inside
// the ring, after the first receive.
class DyingGroup : public ProcessGroup {
 public:
  explicit DyingGroup(ProcessGroup& g) : g_(g) {}
  int rank() const override { return g_.rank(); }
  int world_size() const override { return g_.world_size(); }
  std::string backend() const override { return g_.backend(); }
  std::chrono::milliseconds timeout() const override { return g_.timeout(); }
  void all_reduce(void* b, size_t n, DType t, ReduceOp op) override { g_.all_reduce(b, n, t, op); }
  void reduce_scatter(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    g_.reduce_scatter(s, r, n, t, op);
  }
  void all_gather(const void* s, void* r, size_t n, DType t) override { g_.all_gather(s, r, n, t); }
  void broadcast(void* b, size_t n, DType t, int root) override { g_.broadcast(b, n, t, root); }
  void barrier() override { g_.barrier(); }
  void send(const void*, size_t, DType, int, uint32_t) override { ::raise(SIGKILL); }
  void recv(void* b, size_t n, DType t, int peer, uint32_t tag) override { g_.recv(b, n, t, peer, tag); }
  void synchronize() override { g_.synchronize(); }
  void abort() override { g_.abort(); }

 private:
  ProcessGroup& g_;
};

TEST_F(ContextParallelProcesses, RankDyingInsideTheRingIsNamed) {
  const int cp = 3;
  const int64_t T = 2 * cp * kChunk, Tl = T / cp;
  const Problem pr = make_problem(std::random_device{}(), T, 0, true);
  const auto t0 = Clock::now();
  auto f = fork_group_ranks(PgEngine::Gloo, cp, Ms(3000), [&](ProcessGroup& pg, std::string& report) {
    // Every rank past the group's setup first: under ASan rank 1 could die while rank 2 was still
    // connecting to it, which fails the setup instead of the ring.
    pg.barrier();
    DyingGroup dying(pg);
    ProcessGroup& g = pg.rank() == 1 ? static_cast<ProcessGroup&>(dying) : pg;
    AttentionParams pl = pr.p;
    pl.T = Tl;
    std::vector<float> q(kB * Tl * kH * kD), k(kB * Tl * kKVH * kD), v(k.size()), out(q.size()),
        lse(kB * kH * Tl);
    cp_split(q.data(), pr.q.data(), kB, T, kH * kD, cp, pg.rank());
    cp_split(k.data(), pr.k.data(), kB, T, kKVH * kD, cp, pg.rank());
    cp_split(v.data(), pr.v.data(), kB, T, kKVH * kD, cp, pg.rank());
    try {
      // Rank 0's first send can complete (rank 1 receives first), so the survivors may fail in
      // the second pass; a rank that gets through both is wrong.
      ring_attention_forward(g, out.data(), lse.data(), q.data(), k.data(), v.data(), pl);
      std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
      ring_attention_backward(g, dq.data(), dk.data(), dv.data(), q.data(), q.data(), k.data(),
                              v.data(), out.data(), lse.data(), pl);
    } catch (const CollectiveError& e) {
      report = e.what();
      return 4;
    }
    report = "no error";
    return 0;
  });
  const int st1 = wait_rank(f, 1);
  EXPECT_TRUE(WIFSIGNALED(st1) && WTERMSIG(st1) == SIGKILL) << "status " << st1;
  for (int r : {0, 2}) {
    const int st = wait_rank(f, r);
    const std::string e = report(f, r);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 4) << "rank " << r << " status " << st << ": " << e;
    // The operation names its peer whichever it is; the heartbeat check names the dead one.
    EXPECT_NE(e.find("missing: rank 1 ("), std::string::npos) << e;
  }
  EXPECT_LT(seconds_since(t0), 15.0);
}

}  // namespace
}  // namespace primus::parallel
