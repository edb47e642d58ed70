#include "backends/reference/context_parallel.h"

#include <algorithm>
#include <cstring>

#include "core/util/error.h"

namespace primus::backends::reference {

namespace k = primus::turbo::cpu;
using parallel::DType;
using parallel::ProcessGroup;

namespace {

// Each step of a walk has its own tag, so a message that arrives before the receiver has
// posted its previous receive can never be taken for that one.
constexpr uint32_t kForwardTag = 0x52460000;   // "RF" + step
constexpr uint32_t kBackwardTag = 0x52420000;  // "RB" + step

// Sends `send` to the next rank and receives the previous rank's into `recv` (count floats each).
// A send may wait for the matching receive, so even ranks send first and odd ranks receive
// first: every even -> odd transfer pairs at once, then every odd -> even one; with an odd cp
// the last rank (even) sends to rank 0 (even), which receives as soon as its own send is done.
void ring_shift(ProcessGroup& g, const float* send, float* recv, size_t count, uint32_t tag) {
  const int r = g.rank(), n = g.world_size();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  if (r % 2 == 0) {
    g.send(send, count, DType::F32, next, tag);
    g.recv(recv, count, DType::F32, prev, tag);
  } else {
    g.recv(recv, count, DType::F32, prev, tag);
    g.send(send, count, DType::F32, next, tag);
  }
}

// The shapes and the position table both walks check and use.
struct Ring {
  int cp, rank;
  int64_t Tl;
  size_t kv;  // floats in one of k, v: B * Tl * KVH * D
  std::vector<int32_t> table;  // [cp, Tl]
  const int32_t* positions_of(int r) const { return table.data() + static_cast<size_t>(r) * Tl; }
};

Ring ring_of(const ProcessGroup& g, const k::AttentionParams& p, const int32_t* positions,
             const char* what) {
  Ring ring;
  ring.cp = g.world_size();
  ring.rank = g.rank();
  ring.Tl = p.T;
  PRIMUS_CHECK(p.B > 0 && p.T > 0 && p.H > 0 && p.KVH > 0 && p.D > 0,
               "{}: shape B={} T={} H={} KVH={} D={} must be positive", what, p.B, p.T, p.H, p.KVH,
               p.D);
  PRIMUS_CHECK(!p.cu_seqlens,
               "{}: packed documents (cu_seqlens) are not supported with context parallelism "
               "(cp={})",
               what, ring.cp);
  PRIMUS_CHECK(!p.q_positions && !p.k_positions && (p.Tk == 0 || p.Tk == p.T),
               "{}: p_local must leave Tk ({}), q_positions and k_positions unset: the ring sets "
               "them from the position table",
               what, p.Tk);
  ring.kv = static_cast<size_t>(p.B * p.T * p.KVH * p.D);
  if (positions) {
    ring.table.assign(positions, positions + static_cast<size_t>(ring.cp) * ring.Tl);
  } else {
    PRIMUS_CHECK(ring.Tl % 2 == 0,
                 "{}: the load-balanced layout needs an even number of local tokens, got T={} on "
                 "rank {} of cp={}",
                 what, ring.Tl, ring.rank, ring.cp);
    ring.table = cp_all_positions(ring.Tl * ring.cp, ring.cp);
  }
  return ring;
}

// True when no query at qpos sees any key at kpos: the block may be skipped, exactly.
bool block_is_masked(const k::AttentionParams& p, const int32_t* qpos, const int32_t* kpos,
                     int64_t Tl) {
  if (!p.causal) return false;
  const auto [qmin, qmax] = std::minmax_element(qpos, qpos + Tl);
  const auto [kmin, kmax] = std::minmax_element(kpos, kpos + Tl);
  if (*kmin > *qmax) return true;                                      // every key is later
  return p.window > 0 && int64_t{*kmax} <= int64_t{*qmin} - p.window;  // every key is too old
}

// The parameters of one block: this rank's queries against the keys of rank `owner`.
k::AttentionParams block_params(const k::AttentionParams& p, const Ring& ring, int owner) {
  k::AttentionParams b = p;
  b.Tk = ring.Tl;
  b.q_positions = ring.positions_of(ring.rank);
  b.k_positions = ring.positions_of(owner);
  return b;
}

}  // namespace

std::vector<int32_t> cp_chunk_positions(int64_t T, int cp, int rank) {
  PRIMUS_CHECK(cp >= 1 && rank >= 0 && rank < cp, "context parallel: rank {} of cp={} is not valid",
               rank, cp);
  PRIMUS_CHECK(T > 0 && T % (2 * cp) == 0,
               "context parallel: the sequence length T={} must be a positive multiple of 2*cp={} "
               "(each rank holds two chunks of T/(2cp) tokens)",
               T, 2 * cp);
  const int64_t chunk = T / (2 * cp);
  std::vector<int32_t> pos;
  pos.reserve(static_cast<size_t>(2 * chunk));
  for (const int64_t c : {int64_t{rank}, int64_t{2 * cp - 1 - rank}})
    for (int64_t t = 0; t < chunk; ++t) pos.push_back(static_cast<int32_t>(c * chunk + t));
  return pos;
}

std::vector<int32_t> cp_all_positions(int64_t T, int cp) {
  std::vector<int32_t> table;
  for (int r = 0; r < cp; ++r) {
    const std::vector<int32_t> row = cp_chunk_positions(T, cp, r);
    table.insert(table.end(), row.begin(), row.end());
  }
  return table;
}

void ring_attention_forward(ProcessGroup& cp_group, float* out, float* lse, const float* q,
                            const float* k, const float* v, const k::AttentionParams& p_local,
                            const int32_t* positions) {
  const Ring ring = ring_of(cp_group, p_local, positions, "ring_attention_forward");
  const k::AttentionParams& p = p_local;
  // Its own block first: it holds every query's own position, so no row stays at -inf.
  k::attention_forward(out, lse, q, k, v, block_params(p, ring, ring.rank));
  if (ring.cp == 1) return;

  // [k | v] of the block in hand and of the one arriving.
  std::vector<float> held(2 * ring.kv), arriving(2 * ring.kv);
  std::copy_n(k, ring.kv, held.data());
  std::copy_n(v, ring.kv, held.data() + ring.kv);
  std::vector<float> out_b(static_cast<size_t>(p.B * ring.Tl * p.H * p.D));
  std::vector<float> lse_b(static_cast<size_t>(p.B * p.H * ring.Tl));
  for (int step = 1; step < ring.cp; ++step) {
    ring_shift(cp_group, held.data(), arriving.data(), held.size(), kForwardTag + step);
    held.swap(arriving);
    const int owner = (ring.rank - step + ring.cp) % ring.cp;
    const k::AttentionParams b = block_params(p, ring, owner);
    if (block_is_masked(p, b.q_positions, b.k_positions, ring.Tl)) continue;
    k::attention_forward(out_b.data(), lse_b.data(), q, held.data(), held.data() + ring.kv, b);
    k::attention_merge(out, lse, out_b.data(), lse_b.data(), p.B, ring.Tl, p.H, p.D);
  }
}

void ring_attention_backward(ProcessGroup& cp_group, float* dq, float* dk, float* dv,
                             const float* dout, const float* q, const float* k, const float* v,
                             const float* out, const float* lse, const k::AttentionParams& p_local,
                             const int32_t* positions) {
  const Ring ring = ring_of(cp_group, p_local, positions, "ring_attention_backward");
  const k::AttentionParams& p = p_local;
  const size_t n = ring.kv;
  if (ring.cp == 1) {
    k::attention_backward(dq, dk, dv, dout, q, k, v, out, lse, block_params(p, ring, ring.rank));
    return;
  }
  // [k | v | dk | dv] of the block in hand: its keys and values and the gradient that the ranks
  // it has visited so far gathered for them.
  std::vector<float> held(4 * n, 0.f), arriving(4 * n);
  std::copy_n(k, n, held.data());
  std::copy_n(v, n, held.data() + n);
  for (int step = 0; step < ring.cp; ++step) {
    if (step > 0) {
      ring_shift(cp_group, held.data(), arriving.data(), held.size(), kBackwardTag + step);
      held.swap(arriving);
    }
    const int owner = (ring.rank - step + ring.cp) % ring.cp;
    const k::AttentionParams b = block_params(p, ring, owner);
    if (block_is_masked(p, b.q_positions, b.k_positions, ring.Tl)) continue;
    float* kv = held.data();
    k::attention_backward(dq, kv + 2 * n, kv + 3 * n, dout, q, kv, kv + n, out, lse, b);
  }
  // The block in hand is the next rank's, now visited by every rank: hand its gradient over,
  // and take this rank's own from the previous rank.
  std::vector<float> own(2 * n);
  ring_shift(cp_group, held.data() + 2 * n, own.data(), 2 * n, kBackwardTag + ring.cp);
  for (size_t i = 0; i < n; ++i) {
    dk[i] += own[i];
    dv[i] += own[n + i];
  }
}

}  // namespace primus::backends::reference
