// The TURBO GEMM's stream-K plan without a GPU: the division of the work that the kernel walks
// (gemm_sm90_streamk.h) and the plan choice (gemm_sm90_choose_plan) on a modelled H100.
//
// The kernel's correctness rests on these rules, so each is checked over many problem sizes:
// every k-iteration of every tile is done exactly once; a block writes at most one partial (its
// first stream-K segment) and an owner's shared segment is its last; the blocks sharing a tile
// follow each other in k order (so the owner's sum has a fixed order); an owner waits only for
// blocks of higher index (no cycle of waits).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "turbo/kernels/cuda/gemm_sm90.h"
#include "turbo/kernels/cuda/gemm_sm90_streamk.h"

namespace primus::turbo::cuda {
namespace {

struct Walked {
  int tile, kb_begin, kb_end;
  bool data_parallel;
};

// What block b does, in the kernel's order (producer and consumers walk the same sequence).
std::vector<Walked> walk(const streamk::Split& s, int b) {
  std::vector<Walked> out;
  for (int t = b; t < s.tiles_dp; t += s.grid) out.push_back({t, 0, s.kblocks, true});
  for (int64_t u = s.begin(b); u < s.end(b);) {
    const streamk::Segment g = streamk::segment_at(s, b, u);
    out.push_back({g.tile, g.kb_begin, g.kb_end, false});
    u += g.kb_end - g.kb_begin;
  }
  return out;
}

void check_split(int tiles, int kblocks, int grid) {
  SCOPED_TRACE(fmt::format("tiles {} kblocks {} grid {}", tiles, kblocks, grid));
  const streamk::Split s = streamk::make_split(tiles, kblocks, grid);
  ASSERT_GE(s.grid, 1);
  ASSERT_LE(s.grid, grid);
  EXPECT_EQ(s.tiles_dp % s.grid, 0) << "every block gets the same number of whole tiles";
  EXPECT_EQ(s.units, static_cast<int64_t>(tiles - s.tiles_dp) * kblocks);
  if (tiles >= 2 * grid) {
    EXPECT_GE(tiles - s.tiles_dp, grid) << "the stream-K part keeps at least one wave of tiles";
    EXPECT_LT(tiles - s.tiles_dp, 2 * grid) << "and less than two";
  } else {
    EXPECT_EQ(s.tiles_dp, 0);
  }
  std::vector<std::vector<int>> done(tiles, std::vector<int>(kblocks, 0));
  // tile -> (block, segment) in the order the blocks hold it
  std::map<int, std::vector<std::pair<int, Walked>>> holders;
  int64_t min_units = INT64_MAX, max_units = 0;
  for (int b = 0; b < s.grid; ++b) {
    const auto segs = walk(s, b);
    int64_t units = 0;
    int partials = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      const Walked& g = segs[i];
      ASSERT_GE(g.tile, 0);
      ASSERT_LT(g.tile, tiles);
      ASSERT_LT(g.kb_begin, g.kb_end);
      ASSERT_LE(g.kb_end, kblocks);
      for (int k = g.kb_begin; k < g.kb_end; ++k) ++done[g.tile][k];
      if (g.data_parallel) continue;
      units += g.kb_end - g.kb_begin;
      holders[g.tile].push_back({b, g});
      if (g.kb_begin > 0) {
        ++partials;
        EXPECT_EQ(i, static_cast<size_t>(s.tiles_dp / s.grid)) << "a partial is the block's first stream-K segment";
      }
      if (g.kb_begin == 0 && g.kb_end < kblocks) {
        EXPECT_EQ(i + 1, segs.size()) << "an owner's shared segment is its last";
      }
    }
    EXPECT_LE(partials, 1) << "one workspace slot per block";
    min_units = std::min(min_units, units);
    max_units = std::max(max_units, units);
  }
  EXPECT_LE(max_units - min_units, 1) << "the stream-K ranges are equal to one k-iteration";
  for (int t = 0; t < tiles; ++t)
    for (int k = 0; k < kblocks; ++k) ASSERT_EQ(done[t][k], 1) << "tile " << t << " k-iteration " << k;
  for (const auto& [t, hs] : holders) {
    SCOPED_TRACE(fmt::format("stream-K tile {}", t));
    ASSERT_FALSE(hs.empty());
    const int owner = hs.front().first;
    EXPECT_EQ(hs.front().second.kb_begin, 0) << "the first holder owns the tile";
    EXPECT_EQ(owner, s.block_of(static_cast<int64_t>(t - s.tiles_dp) * kblocks));
    EXPECT_EQ(hs.back().first, streamk::last_block_of_tile(s, t)) << "the owner waits for exactly these blocks";
    for (size_t i = 0; i < hs.size(); ++i) {
      EXPECT_EQ(hs[i].first, owner + static_cast<int>(i)) << "holders are consecutive blocks, owner first";
      if (i > 0) {
        EXPECT_EQ(hs[i].second.kb_begin, hs[i - 1].second.kb_end) << "in k order";
      }
    }
  }
  for (int64_t u = 0; u < s.units; ++u) {
    const int b = s.block_of(u);
    ASSERT_TRUE(s.begin(b) <= u && u < s.end(b)) << "block_of(" << u << ") = " << b;
  }
}

TEST(GemmSm90StreamK, EveryUnitOnceOwnersFirstPartialsInKOrder) {
  // GPT-2 / Llama weight-gradient shapes on 132 SMs, edge cases (fewer units than blocks, one
  // k-iteration per tile, data-parallel waves ahead of the stream-K part), odd grids.
  const int cases[][3] = {{72, 256, 132},  {18, 256, 132}, {54, 256, 132}, {32, 256, 132}, {1024, 256, 132},
                          {9, 16, 132},    {4, 2, 132},    {1, 1, 132},    {1, 7, 3},      {300, 1, 132},
                          {264, 12, 132},  {265, 12, 132}, {1152, 12, 132}, {7, 100, 13},  {29, 3, 8},
                          {128, 256, 132}, {2, 1000, 132}, {133, 5, 132}};
  for (const auto& c : cases) check_split(c[0], c[1], c[2]);
}

// cluster_slots for a modelled H100 SXM: 132 SMs in GPCs of 16 and 18; a cluster of s blocks
// fits inside one GPC.
int h100_slots(int, int s) {
  const int gpcs[] = {16, 16, 16, 16, 16, 16, 18, 18};
  int n = 0;
  for (int g : gpcs) n += g / s;
  return n;
}

GemmSm90Plan choose(int64_t m, int64_t n, int64_t k, bool streamk, int force_bn = 0, int force_splits = 0) {
  GemmSm90PlanQuery q;
  q.m = m, q.n = n, q.k = k;
  q.sms = 132;
  q.streamk = streamk;
  q.force_bn = force_bn, q.force_splits = force_splits;
  return gemm_sm90_choose_plan(q, h100_slots);
}

struct Shape {
  const char* what;
  int64_t m, n, k;
};
// The training GEMMs of GPT-2 124M and Llama-3.2-1B at 16384 tokens (M x N x K of the product).
const Shape kTraining[] = {
    {"gpt2 qkv fwd", 16384, 2304, 768},         {"gpt2 attn_proj fwd", 16384, 768, 768},
    {"gpt2 fc fwd", 16384, 3072, 768},          {"gpt2 fc_proj fwd", 16384, 768, 3072},
    {"gpt2 lm_head fwd", 16384, 50304, 768},    {"gpt2 qkv wgrad", 2304, 768, 16384},
    {"gpt2 attn_proj wgrad", 768, 768, 16384},  {"gpt2 fc wgrad", 3072, 768, 16384},
    {"gpt2 fc_proj wgrad", 768, 3072, 16384},   {"llama q wgrad", 2048, 2048, 16384},
    {"llama kv wgrad", 512, 2048, 16384},       {"llama gate|up fwd", 16384, 16384, 2048},
    {"llama gate|up wgrad", 16384, 2048, 16384}, {"llama down wgrad", 2048, 8192, 16384},
};

const Shape& shape(const std::string& what) {
  for (const Shape& s : kTraining)
    if (what == s.what) return s;
  throw std::runtime_error("no shape " + what);
}

TEST(GemmSm90StreamK, OffByDefault) {
  for (const Shape& s : kTraining) EXPECT_FALSE(choose(s.m, s.n, s.k, false).streamk) << s.what;
}

// Allowed, the model takes stream-K where the cluster plans leave SMs idle (GPT-2's 54- and
// 72-tile weight gradients, whose cluster plans keep 108-120 of 132 SMs busy) and keeps the other
// plans where they already fill the GPU (the wide forward products, 128 tiles on 132 SMs) or
// where one owner would add too many partials (18 tiles: 7 blocks a tile).
TEST(GemmSm90StreamK, ChosenWhereClustersLeaveSmsIdle) {
  for (const char* what : {"gpt2 qkv wgrad", "gpt2 fc wgrad", "gpt2 fc_proj wgrad"}) {
    const Shape& s = shape(what);
    const GemmSm90Plan p = choose(s.m, s.n, s.k, true);
    EXPECT_TRUE(p.streamk) << what;
    EXPECT_EQ(p.bn, 256) << what;
    EXPECT_EQ(p.splits, 1) << what;
    EXPECT_EQ(p.grid, 132) << what;
    EXPECT_FALSE(p.pingpong) << what;
  }
  for (const char* what : {"gpt2 qkv fwd", "gpt2 fc fwd", "gpt2 lm_head fwd", "gpt2 attn_proj wgrad", "llama q wgrad",
                           "llama gate|up fwd"}) {
    const Shape& s = shape(what);
    EXPECT_FALSE(choose(s.m, s.n, s.k, true).streamk) << what;
  }
}

TEST(GemmSm90StreamK, ForcedPlanAndItsLimits) {
  GemmSm90Plan p = choose(384, 640, 1000, false, 0, kGemmSm90StreamK);
  EXPECT_TRUE(p.streamk);
  EXPECT_EQ(p.bn, 256);
  EXPECT_EQ(p.grid, 132);  // 3 x 3 tiles x 16 k-iterations = 144 units
  p = choose(136, 264, 104, false, 256, kGemmSm90StreamK);
  EXPECT_TRUE(p.streamk);
  EXPECT_EQ(p.grid, 8);  // 2 x 2 tiles x 2 k-iterations: one unit per block
  // Forcing a split count or the tile width 128 leaves stream-K out even when it is allowed.
  EXPECT_FALSE(choose(3072, 768, 16384, true, 0, 4).streamk);
  EXPECT_FALSE(choose(3072, 768, 16384, true, 128, 0).streamk);
  EXPECT_THROW(gemm_sm90_force_plan(128, kGemmSm90StreamK), std::exception);
  EXPECT_THROW(gemm_sm90_force_plan(256, -2), std::exception);
  // Under the ping-pong schedule the automatic choice keeps to it.
  GemmSm90PlanQuery q;
  q.m = 3072, q.n = 768, q.k = 16384, q.sms = 132, q.streamk = true, q.pingpong = true;
  EXPECT_FALSE(gemm_sm90_choose_plan(q, h100_slots).streamk);
}

// PRIMUS_TURBO_GEMM_PLAN's syntax: a typo must stop the run, not time another plan.
// The 160-wide tile (linear / bias epilogues, splits 1): taken where its 120 tiles fill one wave
// that the other widths split into clusters of several waves (GPT-2's fc / fc_proj weight
// gradients, 3072 x 768 and 768 x 3072), never where it is not allowed, not split (GPT-2's
// attn_proj weight gradient, 30 such tiles, keeps a cluster plan of another width), and not for
// the wide products whose 256-wide waves are already full.
TEST(GemmSm90StreamK, Width160ForOneWaveWeightGradients) {
  const auto plan = [](const Shape& s, bool bn160, int force_bn = 0) {
    GemmSm90PlanQuery q;
    q.m = s.m, q.n = s.n, q.k = s.k, q.sms = 132, q.bn160 = bn160, q.force_bn = force_bn;
    return gemm_sm90_choose_plan(q, h100_slots);
  };
  for (const char* what : {"gpt2 fc wgrad", "gpt2 fc_proj wgrad"}) {
    const GemmSm90Plan p = plan(shape(what), true);
    EXPECT_EQ(p.bn, 160) << what;
    EXPECT_EQ(p.splits, 1) << what;
    EXPECT_EQ(p.grid, 120) << what;
    EXPECT_NE(plan(shape(what), false).bn, 160) << what;
  }
  const GemmSm90Plan attn = plan(shape("gpt2 attn_proj wgrad"), true);
  EXPECT_NE(attn.bn, 160);
  EXPECT_GT(attn.splits, 1);
  EXPECT_NE(plan(shape("gpt2 attn_proj wgrad"), true, 160).splits, 1) << "forced 160: split (30 tiles)";
  for (const char* what : {"gpt2 qkv fwd", "gpt2 fc fwd", "gpt2 lm_head fwd", "llama q wgrad", "llama gate|up fwd",
                           "llama down wgrad"})
    EXPECT_NE(plan(shape(what), true).bn, 160) << what;
  // Forced where it is not allowed (a GELU epilogue): no plan, an error.
  try {
    (void)plan(shape("gpt2 fc wgrad"), false, 160);
    ADD_FAILURE() << "a forced 160-wide plan without its kernels was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("linear and bias epilogues only"), std::string::npos) << e.what();
  }
  EXPECT_EQ(plan(shape("gpt2 fc fwd"), true, 160).bn, 160);
  EXPECT_THROW(gemm_sm90_force_plan(160, kGemmSm90StreamK), std::exception);
}

TEST(GemmSm90StreamK, PlanVariableSyntax) {
  using P = std::pair<int, int>;
  EXPECT_EQ(gemm_sm90_parse_plan(nullptr), P(0, 0));
  EXPECT_EQ(gemm_sm90_parse_plan(""), P(0, 0));
  EXPECT_EQ(gemm_sm90_parse_plan("256x2"), P(256, 2));
  EXPECT_EQ(gemm_sm90_parse_plan("128x0"), P(128, 0));
  EXPECT_EQ(gemm_sm90_parse_plan("256xsk"), P(256, kGemmSm90StreamK));
  EXPECT_EQ(gemm_sm90_parse_plan("0xsk"), P(0, kGemmSm90StreamK));
  EXPECT_EQ(gemm_sm90_parse_plan("160x1"), P(160, 1));
  for (const char* bad : {"128xsk", "160xsk", "256xs", "256xskk", "256x9", "192x1", "256x2x", "sk", "256"}) {
    try {
      (void)gemm_sm90_parse_plan(bad);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("PRIMUS_TURBO_GEMM_PLAN='" + std::string(bad) + "'"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace primus::turbo::cuda
