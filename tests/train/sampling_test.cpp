// train::Sampler: greedy, temperature, top-k and top-p (nucleus) against hand-worked cases and
// against an independent implementation of transformers' warpers (TopPLogitsWarper removes the
// tokens whose ascending cumulative probability is <= 1 - top_p).
#include "train/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "core/util/error.h"

namespace primus::train {
namespace {

std::vector<float> log_probs(const std::vector<double>& p) {
  std::vector<float> l;
  for (double x : p) l.push_back(static_cast<float>(std::log(x)));
  return l;
}

TEST(Sampler, GreedyIsTheArgmaxLowestIdOnTies) {
  Sampler s;
  std::mt19937_64 rng(1);
  SampleOptions o;
  o.temperature = 0;
  const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(s(l.data(), 4, o, rng), 1);
  o.top_p = 0.01, o.top_k = 1;  // ignored when greedy
  EXPECT_EQ(s(l.data(), 4, o, rng), 1);
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (shuffled ids): p = 0.75 keeps {0.5, 0.3}; 0.45 keeps {0.5};
  // 0.85 keeps three; 1 keeps all.
  const std::vector<float> l = log_probs({0.15, 0.5, 0.05, 0.3});
  Sampler s;
  std::mt19937_64 rng(7);
  SampleOptions o;
  struct Case {
    double p;
    std::vector<int32_t> kept;
    std::vector<double> probs;
  };
  for (const Case& c : {Case{0.75, {1, 3}, {0.625, 0.375}}, Case{0.45, {1}, {1.0}},
                        Case{0.85, {1, 3, 0}, {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95}},
                        Case{1.0, {0, 1, 2, 3}, {0.15, 0.5, 0.05, 0.3}}}) {  // no cut: id order
    o.top_p = c.p;
    const int32_t t = s(l.data(), 4, o, rng);
    EXPECT_EQ(s.kept(), c.kept) << "p " << c.p;
    ASSERT_EQ(s.kept_probs().size(), c.probs.size());
    for (size_t i = 0; i < c.probs.size(); ++i) EXPECT_NEAR(s.kept_probs()[i], c.probs[i], 1e-6) << "p " << c.p;
    EXPECT_NE(std::find(c.kept.begin(), c.kept.end(), t), c.kept.end());
  }
}

TEST(Sampler, TopPDrawsWithTheRenormalisedProbabilities) {
  const std::vector<float> l = log_probs({0.15, 0.5, 0.05, 0.3});
  Sampler s;
  std::mt19937_64 rng(std::random_device{}());
  SampleOptions o;
  o.top_p = 0.75;
  std::vector<int> count(4, 0);
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++count[s(l.data(), 4, o, rng)];
  EXPECT_EQ(count[0] + count[2], 0);
  EXPECT_NEAR(count[1] / double(n), 0.625, 0.015);  // about 4.5 standard deviations
}

// transformers: temperature, top-k (keep logits >= the k-th largest), top-p on the softmax of
// what is left; the kept ids as a set.
std::set<int32_t> transformers_kept(const std::vector<float>& logits, double temp, int64_t k, double p) {
  const int64_t V = static_cast<int64_t>(logits.size());
  std::vector<double> x(logits.begin(), logits.end());
  for (double& v : x) v /= temp;
  std::vector<bool> keep(V, true);
  if (k > 0 && k < V) {
    std::vector<double> sorted = x;
    std::sort(sorted.rbegin(), sorted.rend());
    for (int64_t i = 0; i < V; ++i) keep[i] = x[i] >= sorted[k - 1];
  }
  double mx = -INFINITY, sum = 0;
  for (int64_t i = 0; i < V; ++i)
    if (keep[i]) mx = std::max(mx, x[i]);
  std::vector<double> pr(V, 0.0);
  for (int64_t i = 0; i < V; ++i)
    if (keep[i]) sum += pr[i] = std::exp(x[i] - mx);
  std::vector<int32_t> asc(V);
  std::iota(asc.begin(), asc.end(), 0);
  std::stable_sort(asc.begin(), asc.end(), [&](int32_t a, int32_t b) { return x[a] < x[b]; });
  double cum = 0;
  std::set<int32_t> out;
  for (int32_t i : asc) {
    if (!keep[i]) continue;
    cum += pr[i] / sum;
    if (cum > 1 - p) out.insert(i);
  }
  return out;
}

TEST(Sampler, TopKAndTopPAgreeWithTransformersOrder) {
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::uniform_real_distribution<double> u(0.05, 0.98);
  Sampler s;
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t V = 50;
    std::vector<float> l(V);
    for (float& x : l) x = n(rng);
    SampleOptions o;
    o.temperature = trial % 2 ? 0.7 : 1.5;
    o.top_k = trial % 3 == 0 ? 0 : 5 + trial % 20;
    o.top_p = u(rng);
    s(l.data(), V, o, rng);
    const std::set<int32_t> got(s.kept().begin(), s.kept().end());
    // Skip the rare draws where p lands within rounding of a cumulative sum (either side is right).
    const auto want = transformers_kept(l, o.temperature, o.top_k, o.top_p);
    const auto lo = transformers_kept(l, o.temperature, o.top_k, o.top_p - 1e-9);
    const auto hi = transformers_kept(l, o.temperature, o.top_k, o.top_p + 1e-9);
    if (lo != hi) continue;
    EXPECT_EQ(got, want) << "trial " << trial << " top_k " << o.top_k << " top_p " << o.top_p;
  }
}

TEST(Sampler, WithoutCutsItDrawsLikeThePlainSoftmaxSampler) {
  // Neither top-k nor top-p: tokens in id order, one uniform draw over the unnormalised weights
  // (what the reference sampled before top-p existed, so seeds keep their samples).
  std::mt19937_64 a(42), b(42);
  const std::vector<float> l = {0.1f, 1.2f, -0.3f, 0.8f, 0.0f};
  Sampler s;
  SampleOptions o;
  o.temperature = 0.9;
  for (int i = 0; i < 100; ++i) {
    double mx = static_cast<double>(1.2f), sum = 0;
    std::vector<double> w;
    for (float x : l) sum += w.emplace_back(std::exp((x - mx) / o.temperature));
    double r = std::uniform_real_distribution<double>(0.0, sum)(b);
    int32_t want = 0;
    for (; want < 4 && r >= w[want]; ++want) r -= w[want];
    ASSERT_EQ(s(l.data(), 5, o, a), want);
  }
}

TEST(Sampler, OptionsOutOfRangeAreRefused) {
  SampleOptions o;
  o.top_p = 0;
  EXPECT_THROW(check_sample_options(o), ConfigError);
  o.top_p = 1.5;
  EXPECT_THROW(check_sample_options(o), ConfigError);
  o.top_p = 1;
  o.temperature = -1;
  EXPECT_THROW(check_sample_options(o), ConfigError);
  o.temperature = 1;
  o.top_k = -2;
  EXPECT_THROW(check_sample_options(o), ConfigError);
  o.top_k = 0;
  EXPECT_NO_THROW(check_sample_options(o));
}

}  // namespace
}  // namespace primus::train
