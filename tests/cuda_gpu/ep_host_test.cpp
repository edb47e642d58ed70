// Expert parallelism in the CUDA model, checked without a GPU: two and four ranks as threads running
// the model in host mode (fp32 on Turbo's CPU kernels, the same decoder code as on the device),
// each holding its experts and training on its part of every batch, against one rank holding every
// expert on the whole batch (ep_parity.h), for the Mixtral-style and DeepSeek-style tiny MoEs. fp32
// gate of DESIGN.md: every step's mean loss and the one gradient norm within 1e-5 relative, the final
// weights within 1e-4 (the order of summation differs: the dense gradients' mean over the ranks,
// each expert's rows from several ranks).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <tuple>

#include "core/util/error.h"
#include "ep_parity.h"

namespace primus::backends::cuda::testing {
namespace {

class EpHostTest : public ::testing::TestWithParam<std::tuple<bool, int>> {};

TEST_P(EpHostTest, RanksTrainAsOne) {
  const auto [deepseek, ep] = GetParam();
  const train::ModelSpec spec = ep_spec(deepseek);
  constexpr int kSteps = 6;
  const EpRun one = run_ep(spec, 1, turbo::Device::CPU, kSteps);
  const EpRun many = run_ep(spec, ep, turbo::Device::CPU, kSteps);
  const auto [worst_loss, worst_norm] = expect_fp32_steps(one.loss, one.gnorm, many.rank_loss, many.rank_gnorm, false);
  const double dw = rel_l2(many.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dw, 1e-4);
  EXPECT_LT(one.loss.back(), one.loss.front() - 0.1) << "the run must learn";
  std::printf("[host %s ep%d] %d steps: loss %.4f -> %.4f, worst relative loss %.1e, grad norm %.1e, weights %.1e\n",
              deepseek ? "deepseek_moe" : "mixtral_moe", ep, kSteps, one.loss.front(), one.loss.back(), worst_loss,
              worst_norm, dw);
}

INSTANTIATE_TEST_SUITE_P(Models, EpHostTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(2, 4)), [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "deepseek" : "mixtral") + "_ep" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The recipes beside the plain one, under ep2 against one rank with the same recipe: the optimizer
// in the backward (each group's gradients averaged over the ep ranks and the experts' divided by ep
// just before its update), FP8 experts (rowwise; blockwise on the 128-wide model), whose grouped
// GEMMs quantize the held groups, and the experts recomputed in the backward (selective: the
// permuted input moved to the experts' ranks again by the layer's saved plan, and SwiGLU; full: the
// expert GEMMs too, their output moved back for the combine's backward), and Muon (each expert's
// matrices whole on its rank, orthogonalised there from the gradient averaged as AdamW's is). Without FP8 the fp32 gate holds. With it the two sides quantize
// some tensors at other granularities (a column-scaled copy's maxima are over this rank's rows: its
// tokens in the linear layers, its experts' groups in the grouped GEMMs), so they differ by FP8's
// rounding, which training then carries: two FP8 runs of one model, they must stay closer to each
// other than FP8 is to the same recipe without it (three quarters of that distance; measured: a
// half for rowwise's losses, a sixth for blockwise's). A gradient off by a factor, e.g. an expert's
// not divided by ep, moves the norm by far more than FP8's rounding.
class EpHostRecipeTest : public ::testing::TestWithParam<EpRecipeCase> {};

struct StepDistance {
  double loss = 0, norm = 0, weights = 0;
};

inline StepDistance step_distance(const EpRun& a, const EpRun& b) {
  StepDistance d;
  for (size_t s = 0; s < b.loss.size(); ++s) {
    d.loss = std::max(d.loss, std::fabs(a.loss[s] - b.loss[s]) / b.loss[s]);
    d.norm = std::max(d.norm, std::fabs(a.gnorm[s] - b.gnorm[s]) / b.gnorm[s]);
  }
  d.weights = rel_l2(a.params.data(), b.params.data(), static_cast<int64_t>(b.params.size()));
  return d;
}

TEST_P(EpHostRecipeTest, RanksTrainAsOne) {
  const EpRecipeCase& c = GetParam();
  const std::unique_ptr<EpCase> ec = ep_case(c);
  const train::ModelSpec& spec = ec->spec;
  const turbo::Fp8Recipe* fp8 = ec->fp8.get();
  const EpRecipe& recipe = ec->recipe;
  constexpr int kSteps = 6;
  const EpRun one = run_ep(spec, 1, turbo::Device::CPU, kSteps, Attn::Default, recipe);
  const EpRun many = run_ep(spec, c.ep, turbo::Device::CPU, kSteps, Attn::Default, recipe);
  for (int s = 0; s < kSteps; ++s)
    for (int r = 1; r < c.ep; ++r) EXPECT_EQ(many.rank_gnorm[r][s], many.rank_gnorm[0][s]) << "step " << s << ": one norm";
  const StepDistance d = step_distance(many, one);
  StepDistance gate{1e-5, 1e-5, 1e-4};
  if (fp8) {
    EpRecipe plain = recipe;
    plain.fp8 = nullptr;
    const StepDistance own = step_distance(one, run_ep(spec, 1, turbo::Device::CPU, kSteps, Attn::Default, plain));
    gate = {0.75 * own.loss, 0.75 * own.norm, 0.75 * own.weights};
    std::printf("[host %s] FP8 against fp32 on one rank: loss %.1e, grad norm %.1e, weights %.1e\n", c.name, own.loss,
                own.norm, own.weights);
  }
  EXPECT_LT(d.loss, gate.loss) << "the steps' mean losses, worst relative distance";
  EXPECT_LT(d.norm, gate.norm) << "the steps' gradient norms, worst relative distance";
  EXPECT_LT(d.weights, gate.weights) << "the final weights, relative L2";
  EXPECT_LT(one.loss.back(), one.loss.front() - 0.1) << "the run must learn";
  std::printf("[host %s ep2] %d steps: loss %.4f -> %.4f, worst relative loss %.1e, grad norm %.1e, weights %.1e\n",
              c.name, kSteps, one.loss.front(), one.loss.back(), d.loss, d.norm, d.weights);
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, EpHostRecipeTest,
    ::testing::Values(EpRecipeCase{"mixtral_in_backward", false, false, 2, true, false, nullptr, nullptr},
                      EpRecipeCase{"deepseek_in_backward", true, false, 2, true, false, nullptr, nullptr},
                      EpRecipeCase{"mixtral_fp8_rowwise", false, false, 2, false, false, "hybrid", "rowwise"},
                      EpRecipeCase{"deepseek_fp8_blockwise", true, true, 2, false, false, "e4m3", "blockwise"},
                      EpRecipeCase{"mixtral_fp8_blockwise_in_backward", false, true, 2, true, false, "e4m3",
                                   "blockwise"},
                      EpRecipeCase{"mixtral_selective", false, false, 2, false, false, nullptr, nullptr,
                                   Recompute::Selective},
                      EpRecipeCase{"mixtral_full_in_backward", false, false, 2, true, false, nullptr, nullptr,
                                   Recompute::Full},
                      EpRecipeCase{"mixtral_fp8_rowwise_full", false, false, 2, false, false, "hybrid", "rowwise",
                                   Recompute::Full},
                      EpRecipeCase{"mixtral_muon", false, false, 2, false, false, nullptr, nullptr, Recompute::None,
                                   true},
                      EpRecipeCase{"deepseek_muon", true, false, 2, false, false, nullptr, nullptr, Recompute::None,
                                   true}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace primus::backends::cuda::testing

namespace primus::backends::cuda::testing {
namespace {

// EpComm itself on host groups (two ranks as threads): each rank's local groups (4 experts, 2 a
// rank, padded to 4 rows) go to the experts' ranks, expert-major with every group padded by zero
// rows, and come back to the kept rows they left (the local padding rows zeroed); an expert that receives nothing and a rank
// that sends another nothing. A routing beyond the held buffers stops both ranks with an error
// naming moe_ep_buffer_factor before anything moves.
TEST(EpCommHost, RowsReachTheirExpertsAndComeBack) {
  constexpr int64_t E = 4, C = 3, align = 4;
  // kept[rank][expert]: rank 0 sends nothing to rank 1's expert 3, expert 2 gets nothing at all.
  const int32_t kept[2][E] = {{3, 1, 0, 0}, {2, 0, 0, 5}};
  auto value = [](int r, int64_t e, int64_t i, int64_t c) { return float(1000 * (r + 1) + 100 * e + 10 * i + c); };
  // Held rows: rank 0's experts 0 (3 + 2 rows, padded to 8) and 1 (1, padded to 4), 12; rank 1's
  // 2 (none) and 3 (5, padded to 8), 8. Buffers of 12 rows hold it, of 11 not.
  for (const int64_t cap : {int64_t{64}, int64_t{12}, int64_t{11}}) {
    std::vector<std::string> errors(2);
    run_threaded_ranks(2, {}, "ep", [&](int r, parallel::ProcessGroup* pg) {
      try {
        ModelStream stream;
        stream.host = true;
        EpComm ep(*pg, stream, E, align, 1, 64, cap);
        std::vector<int32_t> k(kept[r], kept[r] + E), off(E + 1, 0);
        for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + (k[e] + align - 1) / align * align;
        std::vector<float> local(static_cast<size_t>(off[E] * C), -1.f), back(local.size(), -7.f);
        for (int64_t e = 0; e < E; ++e)
          for (int64_t i = 0; i < k[e]; ++i)
            for (int64_t c = 0; c < C; ++c) local[(off[e] + i) * C + c] = value(r, e, i, c);
        std::vector<int32_t> held_off(3, -1);
        std::vector<float> held(static_cast<size_t>(64 * C), -5.f), send(static_cast<size_t>(64 * C)),
            recv(static_cast<size_t>(64 * C));
        auto view = [&](std::vector<float>& v, int64_t rows) {
          return TensorView(v.data(), turbo::DType::F32, turbo::Device::CPU, {rows, C});
        };
        const int64_t rows = ep.plan(0, TensorView(k.data(), turbo::DType::I32, turbo::Device::CPU, {E}),
                                     TensorView(held_off.data(), turbo::DType::I32, turbo::Device::CPU, {3}));
        ep.dispatch(0, view(local, off[E]), view(held, 64), view(send, 64), view(recv, 64));
        // Held expert-major: this rank's experts 2r, 2r + 1, each from rank 0 then rank 1, padded.
        int64_t at = 0;
        for (int64_t le = 0; le < 2; ++le) {
          const int64_t e = 2 * r + le;
          EXPECT_EQ(held_off[le], at) << "rank " << r << " expert " << e;
          int64_t row = at;
          for (int q = 0; q < 2; ++q)
            for (int64_t i = 0; i < kept[q][e]; ++i, ++row)
              for (int64_t c = 0; c < C; ++c) EXPECT_EQ(held[row * C + c], value(q, e, i, c)) << "rank " << r;
          const int64_t n = kept[0][e] + kept[1][e], padded = (n + align - 1) / align * align;
          for (; row < at + padded; ++row)
            for (int64_t c = 0; c < C; ++c) EXPECT_EQ(held[row * C + c], 0.f) << "padding, rank " << r;
          at += padded;
        }
        EXPECT_EQ(held_off[2], at);
        EXPECT_EQ(rows, at);
        ep.combine(0, view(held, 64), view(back, off[E]), view(send, 64), view(recv, 64));
        for (int64_t e = 0; e < E; ++e)
          for (int64_t i = 0; i < off[e + 1] - off[e]; ++i)  // the kept rows back, the groups' padding zeroed
            for (int64_t c = 0; c < C; ++c)
              EXPECT_EQ(back[(off[e] + i) * C + c], i < k[e] ? value(r, e, i, c) : 0.f) << "rank " << r;
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
    for (int r = 0; r < 2; ++r) {
      if (cap >= 12) {
        EXPECT_TRUE(errors[r].empty()) << "cap " << cap << ", rank " << r << ": " << errors[r];
      } else {  // both ranks see the same counts and stop alike
        EXPECT_NE(errors[r].find("routes 12 rows to one rank's experts, more than its held buffers' 11 rows; raise "
                                 "moe_ep_buffer_factor"),
                  std::string::npos)
            << "rank " << r << ": " << errors[r];
      }
    }
  }
}

}  // namespace
}  // namespace primus::backends::cuda::testing
