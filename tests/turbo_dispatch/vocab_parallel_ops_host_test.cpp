// The vocabulary-parallel ops on host tensors (what the CUDA model's tensor parallelism runs in
// host mode, and what its device kernels mirror): the embedding and the cross-entropy of a
// vocabulary split over `tp` ranks give, summed or merged, the whole vocabulary's results.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/util/error.h"
#include "turbo/ops/embedding.h"
#include "turbo/ops/loss.h"
#include "tests/turbo_dispatch/host_views.h"

namespace primus::turbo {
namespace {

using testing::host;

// 3 ranks of 17 rows over a vocabulary of 50 (51 padded): the last rank ends in a padding column.
constexpr int64_t kVpRows = 9, kVpVocab = 50, kVpRanks = 3, kVpRowsPerRank = 17;

TEST(VocabParallelHost, CrossEntropyOfTheSlicesIsTheWholeOne) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::uniform_int_distribution<int32_t> id(0, kVpVocab - 1);
  std::vector<float> whole(static_cast<size_t>(kVpRows * kVpVocab));
  for (auto& x : whole) x = nd(rng);
  std::vector<int32_t> targets(kVpRows);
  for (auto& t : targets) t = id(rng);
  targets[3] = -100;  // ignored row
  targets[5] = kVpVocab - 1;  // on the last rank
  const float dloss = 0.125f;

  std::vector<float> ref_logits = whole, ref_losses(kVpRows);
  CrossEntropyArgs ce;
  ce.logits = host(ref_logits, {kVpRows, kVpVocab});
  ce.dlogits = ce.logits;
  ce.losses = host(ref_losses, {kVpRows});
  ce.targets = host(targets, {kVpRows});
  ce.dloss = dloss;
  cross_entropy(ce);

  std::vector<std::vector<float>> slice(kVpRanks, std::vector<float>(static_cast<size_t>(kVpRows * kVpRowsPerRank), 0.0f));
  std::vector<float> all(static_cast<size_t>(kVpRanks * kVpRows * 3));
  auto args = [&](int r, std::vector<float>& losses) {
    VocabParallelCrossEntropyArgs v;
    v.logits = host(slice[r], {kVpRows, kVpRowsPerRank});
    v.targets = host(targets, {kVpRows});
    v.stats = TensorView(all.data() + r * kVpRows * 3, DType::F32, Device::CPU, {kVpRows, 3});
    v.all_stats = host(all, {kVpRanks, kVpRows, 3});
    v.losses = host(losses, {kVpRows});
    v.vocab_begin = r * kVpRowsPerRank;
    v.vocab = std::clamp<int64_t>(kVpVocab - v.vocab_begin, 0, kVpRowsPerRank);
    v.global_vocab = kVpVocab;
    v.dloss = dloss;
    return v;
  };
  std::vector<std::vector<float>> losses(kVpRanks, std::vector<float>(kVpRows));
  for (int r = 0; r < kVpRanks; ++r) {
    for (int64_t n = 0; n < kVpRows; ++n)
      for (int64_t j = 0; j < kVpRowsPerRank && r * kVpRowsPerRank + j < kVpVocab; ++j) slice[r][n * kVpRowsPerRank + j] = whole[n * kVpVocab + r * kVpRowsPerRank + j];
    slice[r][kVpRowsPerRank - 1] = r == kVpRanks - 1 ? 1e4f : slice[r][kVpRowsPerRank - 1];  // padding: must not count
    vocab_parallel_ce_stats(args(r, losses[r]));  // writes its rows of `all` (the all-gather)
  }
  for (int r = 0; r < kVpRanks; ++r) vocab_parallel_ce_finish(args(r, losses[r]));
  for (int r = 0; r < kVpRanks; ++r) {
    for (int64_t n = 0; n < kVpRows; ++n) {
      EXPECT_NEAR(losses[r][n], ref_losses[n], 1e-5 * std::max(1.0f, std::fabs(ref_losses[n]))) << r << "," << n;
      for (int64_t j = 0; j < kVpRowsPerRank; ++j) {
        const int64_t g = r * kVpRowsPerRank + j;
        const float want = g < kVpVocab ? ref_logits[n * kVpVocab + g] : 0.0f;
        EXPECT_NEAR(slice[r][n * kVpRowsPerRank + j], want, 1e-6) << "rank " << r << " row " << n << " column " << g;
      }
    }
  }
  EXPECT_EQ(losses[0][3], 0.0f);

  targets[2] = kVpVocab;  // outside the vocabulary
  std::vector<float> l(kVpRows);
  EXPECT_THROW(vocab_parallel_ce_finish(args(0, l)), RuntimeError);
}

TEST(VocabParallelHost, EmbeddingSlicesSumToTheWholeOne) {
  constexpr int64_t B = 2, T = 5, C = 8, V = 12, tp = 3, Vl = V / tp;
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int32_t> id(0, V - 1);
  std::vector<float> wte(V * C), wpe(T * C), dout(B * T * C);
  for (auto* v : {&wte, &wpe, &dout})
    for (auto& x : *v) x = nd(rng);
  std::vector<int32_t> tokens(B * T);
  for (auto& t : tokens) t = id(rng);
  tokens[0] = tokens[7] = 4;  // a repeated token

  std::vector<float> out(B * T * C), dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  EmbeddingArgs e;
  e.out = host(out, {B, T, C});
  e.tokens = host(tokens, {B, T});
  e.wte = host(wte, {V, C});
  e.wpe = host(wpe, {T, C});
  embedding_forward(e);
  e.dwte = host(dwte, {V, C});
  e.dwpe = host(dwpe, {T, C});
  e.dout = host(dout, {B, T, C});
  embedding_backward(e);

  std::vector<float> sum(B * T * C, 0.0f);
  for (int64_t r = 0; r < tp; ++r) {
    std::vector<float> part(wte.begin() + r * Vl * C, wte.begin() + (r + 1) * Vl * C);
    std::vector<float> o(B * T * C), dpart(Vl * C, 0.0f), dp(T * C, 0.0f);
    EmbeddingArgs p;
    p.out = host(o, {B, T, C});
    p.tokens = host(tokens, {B, T});
    p.wte = host(part, {Vl, C});
    if (r == 0) p.wpe = host(wpe, {T, C});  // positions from one rank
    p.vocab_begin = r * Vl;
    embedding_forward(p);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += o[i];
    p.wpe = host(wpe, {T, C});
    p.dwte = host(dpart, {Vl, C});
    p.dwpe = host(dp, {T, C});
    p.dout = host(dout, {B, T, C});
    embedding_backward(p);
    for (int64_t i = 0; i < Vl * C; ++i) EXPECT_EQ(dpart[i], dwte[r * Vl * C + i]) << "rank " << r << " element " << i;
    EXPECT_EQ(dp, dwpe);
  }
  for (size_t i = 0; i < sum.size(); ++i) EXPECT_FLOAT_EQ(sum[i], out[i]) << i;
}

}  // namespace
}  // namespace primus::turbo
