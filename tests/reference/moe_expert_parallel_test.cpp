// The reference MoE layer under expert parallelism, ranks as threads: each of ep ranks holds
// E / ep experts and routes its own tokens; its output, its input gradient and its router's
// gradient equal those of a layer with every expert run on the same tokens alone, and each
// expert's weight gradient on its rank equals the sum of those layers' gradients for that expert
// (every rank's tokens routed to it). Covered: the Mixtral-style and the DeepSeek-style tiny
// models (sigmoid, group-limited routing, shared expert, expert bias), token dropping under a
// capacity factor, and forced routings where a rank's experts receive no token or a rank sends
// none to another.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "backends/reference/moe_layer.h"
#include "parallel/threaded_process_group.h"
#include "tests/common/tiny_models.h"
#include "train/expert_parallel.h"
#include "train/param_layout.h"

namespace {

using primus::backends::reference::MoeLayer;
using primus::train::ModelSpec;

// One MoE layer's weights in its own flat buffer, by the names of layer 1 of the layout.
struct LayerParams {
  primus::train::ParamLayout layout;
  std::vector<float> w, g;
  std::string p = "layers.1.moe.";
  const float* at(const std::string& n) const {
    const auto* t = layout.find(p + n);
    return t ? w.data() + t->offset : nullptr;
  }
  float* grad(const std::string& n) {
    const auto* t = layout.find(p + n);
    return t ? g.data() + t->offset : nullptr;
  }
  MoeLayer<float>::Weights weights() const {
    return {at("router.weight"), at("router.expert_bias"), at("experts.fc.weight"), at("experts.proj.weight"),
            at("shared.fc.weight"), at("shared.proj.weight")};
  }
  MoeLayer<float>::Grads grads() {
    return {grad("router.weight"), grad("experts.fc.weight"), grad("experts.proj.weight"), grad("shared.fc.weight"),
            grad("shared.proj.weight")};
  }
};

std::vector<float> randn(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

void expect_near(const float* got, const float* want, int64_t n, const std::string& what) {
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(double(got[i]) - double(want[i])));
  EXPECT_LT(worst, 2e-5) << what;
}

// forced: per rank, the experts of each of its N tokens' K slots (empty: the router chooses).
void check(const ModelSpec& spec, int ep, int64_t N, const std::vector<std::vector<int32_t>>& forced = {}) {
  const int64_t C = spec.hidden_size, E = spec.moe.num_experts;
  std::mt19937 rng(7);
  LayerParams global;
  global.layout = primus::train::make_param_layout(spec);
  global.w = randn(static_cast<size_t>(global.layout.total), rng, 0.2f);
  if (const auto* b = global.layout.find(global.p + "router.expert_bias")) {
    for (int64_t e = 0; e < b->numel; ++e) global.w[b->offset + e] = 0.05f * float(e % 3);  // some ties broken
  }
  std::vector<std::vector<float>> inp(ep), dout(ep);
  for (int r = 0; r < ep; ++r) {
    inp[r] = randn(static_cast<size_t>(N * C), rng, 1.f);
    dout[r] = randn(static_cast<size_t>(N * C), rng, 1.f);
  }
  // The oracle: every rank's tokens through a layer with all experts, alone.
  std::vector<std::vector<float>> want_out(ep), want_dinp(ep);
  std::vector<std::vector<float>> want_g(ep);
  for (int r = 0; r < ep; ++r) {
    MoeLayer<float> layer(spec, N);
    if (!forced.empty()) layer.force_routing(&forced[r]);
    LayerParams lp = global;
    lp.g.assign(lp.w.size(), 0.f);
    want_out[r].resize(N * C);
    want_dinp[r].assign(N * C, 0.f);
    layer.forward(want_out[r].data(), inp[r].data(), lp.weights(), N);
    layer.backward(want_dinp[r].data(), dout[r].data(), inp[r].data(), lp.weights(), lp.grads(), 1.0);
    want_g[r] = lp.g;
  }
  auto hub = primus::parallel::ThreadedGroup::create(ep, std::chrono::seconds(30));
  std::vector<std::vector<float>> got_out(ep), got_dinp(ep), got_g(ep);
  std::vector<primus::train::EpShardMap> maps;
  for (int r = 0; r < ep; ++r) maps.emplace_back(spec, ep, r);
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(ep);
  for (int r = 0; r < ep; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto pg = hub->rank(r);
        const auto& map = maps[r];
        LayerParams lp;
        lp.layout = map.local_layout();
        lp.w.assign(static_cast<size_t>(lp.layout.total), 0.f);
        lp.g.assign(lp.w.size(), 0.f);
        map.to_local(global.w.data(), lp.w.data());
        MoeLayer<float> layer(map.local_spec(), N);
        layer.set_expert_parallel(pg.get());
        if (!forced.empty()) layer.force_routing(&forced[r]);
        got_out[r].resize(N * C);
        got_dinp[r].assign(N * C, 0.f);
        layer.forward(got_out[r].data(), inp[r].data(), lp.weights(), N);
        layer.backward(got_dinp[r].data(), dout[r].data(), inp[r].data(), lp.weights(), lp.grads(), 1.0);
        got_g[r].assign(global.w.size(), 0.f);
        map.to_global(lp.g.data(), got_g[r].data(), /*owned_only=*/false);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < ep; ++r) ASSERT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
  const std::string what = spec.model_type + " ep" + std::to_string(ep) + (forced.empty() ? "" : " forced");
  for (int r = 0; r < ep; ++r) {
    expect_near(got_out[r].data(), want_out[r].data(), N * C, what + " output, rank " + std::to_string(r));
    expect_near(got_dinp[r].data(), want_dinp[r].data(), N * C, what + " input gradient, rank " + std::to_string(r));
  }
  const int64_t El = E / ep;
  for (const auto& t : global.layout.tensors) {
    if (t.name.rfind(global.p, 0) != 0 || !t.trainable) continue;
    const bool expert = primus::train::is_routed_expert_tensor(t.name);
    const int64_t per = expert ? t.numel / E : t.numel;
    for (int r = 0; r < ep; ++r) {
      // Routed experts: rank r's are [r El, (r+1) El), their gradient every rank's tokens'. The
      // rest: each rank's own tokens'.
      const int64_t lo = expert ? t.offset + r * El * per : t.offset, n = expert ? El * per : t.numel;
      std::vector<float> want(static_cast<size_t>(n), 0.f);
      for (int q = 0; q < ep; ++q) {
        if (!expert && q != r) continue;
        for (int64_t i = 0; i < n; ++i) want[i] += want_g[q][lo + i];
      }
      expect_near(got_g[r].data() + lo, want.data(), n, what + " " + t.name + " gradient, rank " + std::to_string(r));
    }
  }
}

TEST(MoeExpertParallel, TwoAndThreeRanksGiveTheLayerOfOneRank) {
  const ModelSpec m = primus::testing::tiny_moe(false);  // 6 experts, top-2
  check(m, 2, 24);
  check(m, 3, 24);
  check(m, 6, 16);  // one expert a rank
}

TEST(MoeExpertParallel, DeepSeekStyleRoutingAndSharedExpert) {
  const ModelSpec m = primus::testing::tiny_moe(true);  // 8 experts in 4 groups, sigmoid top-4, bias, shared
  check(m, 2, 20);
  check(m, 4, 20);
}

TEST(MoeExpertParallel, TokenDroppingUnderACapacityFactor) {
  ModelSpec m = primus::testing::tiny_moe(false);
  m.moe.capacity_factor = 0.75;  // some experts overflow
  check(m, 2, 32);
  m.moe.drop_by_position = true;
  check(m, 3, 32);
}

TEST(MoeExpertParallel, ExpertsThatReceiveNoTokenAndRanksThatSendNone) {
  const ModelSpec m = primus::testing::tiny_moe(false);  // 6 experts over 2 ranks: 0-2 and 3-5
  const int64_t N = 10;
  std::vector<std::vector<int32_t>> forced(2);
  for (int64_t t = 0; t < N; ++t) {
    // Rank 0 routes only to rank 0's experts 0 and 1 (expert 2 and rank 1's get nothing from it);
    // rank 1 routes to experts 1 and 4 (expert 1 gets both ranks' tokens, 3 and 5 none at all).
    forced[0].insert(forced[0].end(), {0, 1});
    forced[1].insert(forced[1].end(), {1, 4});
  }
  check(m, 2, N, forced);
}

}  // namespace

// moe_router_load_balancing_type global_aux_loss in one process: the load is the mean of the
// counts of the optimizer step's micro-batches so far, begin_step() starts them again, and the
// router's gradient is that of the logged loss. Micro-batch 2's aux loss is
// E / (K N^2) x sum_e (c1_e + c2_e) / 2 x sum_n p2_ne (p the full softmax of its logits), its
// router gradient (no output gradient, no z loss) the finite differences of coefficient x that
// loss with micro-batch 1 held.
TEST(MoeGlobalAuxLoss, TheLoadIsTheMeanOfTheStepsMicroBatches) {
  ModelSpec spec = primus::testing::tiny_moe(false);  // 6 experts, softmax top-2
  spec.moe.set_balance(primus::train::MoeSpec::Balance::Global, 0.5);
  spec.moe.z_loss_coeff = 0.0;
  const int64_t N = 24, C = spec.hidden_size, E = spec.moe.num_experts, K = spec.moe.topk;
  std::mt19937 rng(11);
  LayerParams lp;
  lp.layout = primus::train::make_param_layout(spec);
  lp.w = randn(static_cast<size_t>(lp.layout.total), rng, 0.3f);
  const std::vector<float> x1 = randn(static_cast<size_t>(N * C), rng, 1.f), x2 = randn(static_cast<size_t>(N * C), rng, 1.f);
  const std::vector<float> zero_dout(static_cast<size_t>(N * C), 0.f);
  std::vector<float> out(N * C), dinp(N * C);
  auto counts = [&](const std::vector<int32_t>& idx) {
    std::vector<double> c(E, 0.0);
    for (int32_t e : idx) c[e] += 1;
    return c;
  };
  MoeLayer<float> layer(spec, N);
  // Micro-batch 1 after begin_step: its own counts, as the micro-batch loss gives.
  layer.begin_step();
  layer.forward(out.data(), x1.data(), lp.weights(), N);
  const std::vector<double> c1 = counts(layer.topk_idx());
  ModelSpec local_spec = spec;
  local_spec.moe.set_balance(primus::train::MoeSpec::Balance::Batch, 0.5);
  MoeLayer<float> local(local_spec, N);
  local.forward(out.data(), x1.data(), lp.weights(), N);
  EXPECT_NEAR(layer.stats().aux, local.stats().aux, 1e-6 * local.stats().aux);
  // Micro-batch 2: the mean of both micro-batches' counts.
  lp.g.assign(lp.w.size(), 0.f);
  layer.forward(out.data(), x2.data(), lp.weights(), N);
  const std::vector<int32_t> idx2 = layer.topk_idx();
  const std::vector<double> c2 = counts(idx2);
  const std::vector<float> logits2 = layer.logits();
  double want = 0;
  for (int64_t e = 0; e < E; ++e) {
    double psum = 0;
    for (int64_t n = 0; n < N; ++n) {
      double mx = -1e30, s = 0;
      for (int64_t j = 0; j < E; ++j) mx = std::max(mx, double(logits2[n * E + j]));
      for (int64_t j = 0; j < E; ++j) s += std::exp(double(logits2[n * E + j]) - mx);
      psum += std::exp(double(logits2[n * E + e]) - mx) / s;
    }
    want += (c1[e] + c2[e]) / 2 * psum;
  }
  want *= double(E) / (double(K) * N * N);
  const double aux2 = layer.stats().aux;
  EXPECT_NEAR(aux2, want, 1e-5 * want);
  EXPECT_GT(std::abs(aux2 - local.stats().aux), 1e-3 * want) << "micro-batch 2 logged micro-batch 1's loss";
  std::fill(dinp.begin(), dinp.end(), 0.f);
  layer.backward(dinp.data(), zero_dout.data(), x2.data(), lp.weights(), lp.grads(), 1.0);
  // Finite differences of 0.5 x aux over some router weights, micro-batch 1 run first each time
  // with the unperturbed weights and micro-batch 2 routed as before.
  const auto* router = lp.layout.find(lp.p + "router.weight");
  ASSERT_NE(router, nullptr);
  auto aux_with = [&](int64_t i, float d) {
    MoeLayer<float> probe(spec, N);
    probe.begin_step();
    probe.forward(out.data(), x1.data(), lp.weights(), N);
    LayerParams moved = lp;
    moved.w[router->offset + i] += d;
    probe.force_routing(&idx2);
    probe.forward(out.data(), x2.data(), moved.weights(), N);
    return probe.stats().aux;
  };
  const float h = 1e-2f;
  for (int64_t i = 0; i < router->numel; i += router->numel / 7) {
    const double fd = spec.moe.global_aux_loss_coeff * (aux_with(i, h) - aux_with(i, -h)) / (2.0 * h);
    EXPECT_NEAR(lp.g[router->offset + i], fd, 2e-3 * std::abs(fd) + 2e-5) << "router weight " << i;
  }
  // begin_step: the next step's first micro-batch has its own counts again.
  layer.begin_step();
  layer.forward(out.data(), x1.data(), lp.weights(), N);
  EXPECT_NEAR(layer.stats().aux, local.stats().aux, 1e-6 * local.stats().aux);
}
