// Decode attention (one query per sequence against its KV cache) against the full attention
// kernel: the decode of token L-1 must equal row L-1 of causal attention over the first L tokens,
// for several cache slots of different lengths in one call, with GQA, a strided q and a window.
#include "turbo/kernels/cpu/decode_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/util/error.h"
#include "turbo/kernels/cpu/attention.h"

namespace primus::turbo::cpu {
namespace {

struct Seq {  // one sequence's q, k, v [T, heads, D]
  std::vector<double> q, k, v;
};

Seq random_seq(std::mt19937_64& rng, int64_t T, int64_t H, int64_t KVH, int64_t D) {
  std::normal_distribution<double> n(0.0, 1.0);
  Seq s;
  for (auto [vec, heads] : {std::pair{&s.q, H}, {&s.k, KVH}, {&s.v, KVH}}) {
    vec->resize(static_cast<size_t>(T * heads * D));
    for (double& x : *vec) x = n(rng);
  }
  return s;
}

// Row `row` of causal attention over tokens [begin, row] of s (the flash kernel on that slice).
std::vector<double> full_attention_row(const Seq& s, int64_t begin, int64_t row, int64_t H, int64_t KVH, int64_t D) {
  const int64_t T = row - begin + 1;
  AttentionParams p;
  p.B = 1, p.T = T, p.H = H, p.KVH = KVH, p.D = D, p.causal = true;
  std::vector<double> out(static_cast<size_t>(T * H * D)), lse(static_cast<size_t>(H * T));
  attention_forward(out.data(), lse.data(), s.q.data() + begin * H * D, s.k.data() + begin * KVH * D,
                    s.v.data() + begin * KVH * D, p);
  return std::vector<double>(out.end() - H * D, out.end());
}

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-12) << what << " element " << i;
}

void run_case(int64_t window) {
  std::mt19937_64 rng(std::random_device{}());
  const int64_t H = 4, KVH = 2, D = 8, cap = 12, slots = 3, extra = 5;  // q rows padded by `extra` (strided q)
  const std::vector<int32_t> slot = {2, 0}, len = {12, 5};
  std::vector<Seq> seqs;
  for (int64_t s = 0; s < slots; ++s) seqs.push_back(random_seq(rng, cap, H, KVH, D));
  // The caches hold every slot's keys/values; the queries are each sequence's token len-1.
  std::vector<double> kc(static_cast<size_t>(slots * cap * KVH * D)), vc(kc.size());
  for (int64_t s = 0; s < slots; ++s) {
    std::copy(seqs[s].k.begin(), seqs[s].k.end(), kc.begin() + s * cap * KVH * D);
    std::copy(seqs[s].v.begin(), seqs[s].v.end(), vc.begin() + s * cap * KVH * D);
  }
  const int64_t n = static_cast<int64_t>(slot.size()), qrow = H * D + extra;
  std::vector<double> q(static_cast<size_t>(n * qrow), NAN), out(static_cast<size_t>(n * H * D));
  for (int64_t i = 0; i < n; ++i) {
    const Seq& s = seqs[slot[i]];
    std::copy(s.q.begin() + (len[i] - 1) * H * D, s.q.begin() + len[i] * H * D, q.begin() + i * qrow);
  }
  DecodeAttentionParams p;
  p.n = n, p.H = H, p.KVH = KVH, p.D = D, p.slots = slots, p.cap = cap, p.window = window, p.q_row = qrow;
  decode_attention_forward(out.data(), q.data(), kc.data(), vc.data(), slot.data(), len.data(), p);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t last = len[i] - 1, begin = window > 0 ? std::max<int64_t>(0, len[i] - window) : 0;
    const auto want = full_attention_row(seqs[slot[i]], begin, last, H, KVH, D);
    expect_near_all(std::vector<double>(out.begin() + i * H * D, out.begin() + (i + 1) * H * D), want,
                    "query " + std::to_string(i) + " window " + std::to_string(window));
  }
}

TEST(DecodeAttention, EqualsLastRowOfCausalAttention) { run_case(0); }
TEST(DecodeAttention, SlidingWindowEqualsAttentionOverTheLastKeys) {
  run_case(4);
  run_case(1);   // only the token itself: out = its own v
  run_case(50);  // a window longer than every sequence changes nothing
}

TEST(DecodeAttention, CacheWriteAndBadSlots) {
  const int64_t KVH = 2, D = 4, W = KVH * D;
  DecodeAttentionParams p;
  p.n = 2, p.H = 2, p.KVH = KVH, p.D = D, p.slots = 2, p.cap = 3;
  std::vector<float> kc(static_cast<size_t>(2 * 3 * W), 0.0f), vc(kc.size(), 0.0f);
  std::vector<float> k(static_cast<size_t>(2 * (W + 3))), v(k.size());  // rows W + 3 apart
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i), v[i] = -static_cast<float>(i);
  const std::vector<int32_t> slot = {1, 0}, len = {3, 1};
  kv_cache_write(kc.data(), vc.data(), k.data(), v.data(), W + 3, slot.data(), len.data(), p);
  for (int64_t c = 0; c < W; ++c) {
    EXPECT_EQ(kc[(1 * 3 + 2) * W + c], k[c]);           // row 0 -> slot 1, position 2
    EXPECT_EQ(vc[(0 * 3 + 0) * W + c], v[W + 3 + c]);   // row 1 -> slot 0, position 0
  }
  const std::vector<int32_t> bad_slot = {2, 0}, bad_len = {0, 1};
  std::vector<float> q(static_cast<size_t>(2 * 2 * D)), out(q.size());
  EXPECT_THROW(decode_attention_forward(out.data(), q.data(), kc.data(), vc.data(), bad_slot.data(), len.data(), p),
               RuntimeError);
  EXPECT_THROW(decode_attention_forward(out.data(), q.data(), kc.data(), vc.data(), slot.data(), bad_len.data(), p),
               RuntimeError);
  EXPECT_THROW(kv_cache_write(kc.data(), vc.data(), k.data(), v.data(), W, slot.data(), bad_len.data(), p),
               RuntimeError);
}

}  // namespace
}  // namespace primus::turbo::cpu
