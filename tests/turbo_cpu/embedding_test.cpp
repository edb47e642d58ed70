#include "turbo/kernels/cpu/embedding.h"

#include <omp.h>

#include "core/util/error.h"
#include "tests/turbo_cpu/op_check.h"

namespace primus::turbo::cpu::testing {
namespace {

struct EmbCfg {
  int64_t B, T, C, V, max_pos;
  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;  // empty: pos = t
  bool learned_positions = true;
};

template <typename Real>
struct EmbeddingOp {
  EmbCfg c;
  explicit EmbeddingOp(const EmbCfg& cfg) : c(cfg) {}
  const int32_t* pos() const { return c.positions.empty() ? nullptr : c.positions.data(); }
  std::vector<InputSpec> inputs() const {
    std::vector<InputSpec> in{{"wte", static_cast<size_t>(c.V * c.C)}};
    if (c.learned_positions) in.push_back({"wpe", static_cast<size_t>(c.max_pos * c.C)});
    return in;
  }
  size_t out_size() const { return c.B * c.T * c.C; }
  void forward(const Inputs<Real>& x, std::vector<Real>& out) {
    embedding_forward(out.data(), c.tokens.data(), pos(), x[0].data(),
                      c.learned_positions ? x[1].data() : nullptr, c.B, c.T, c.C, c.V, c.max_pos);
  }
  void backward(const Inputs<Real>&, const std::vector<Real>& dout, Inputs<Real>& dx) {
    embedding_backward(dx[0].data(), c.learned_positions ? dx[1].data() : nullptr, dout.data(),
                       c.tokens.data(), pos(), c.B, c.T, c.C, c.V, c.max_pos);
  }
};

class EmbeddingTest : public OpTest {
 protected:
  // Few distinct ids so that tokens repeat: the scatter-add must sum duplicates.
  EmbCfg cfg(int64_t B, int64_t T, int64_t C, int64_t V) {
    return EmbCfg{B, T, C, V, T, rng.ints(B * T, 0, static_cast<int32_t>(V - 1)), {}, true};
  }
};

TEST_F(EmbeddingTest, GradientsWithLearnedPositions) {
  check_gradients<EmbeddingOp>(cfg(2, 6, 70, 5), rng);
}

TEST_F(EmbeddingTest, GradientsWithoutPositionsAndWithExplicitPositions) {
  EmbCfg c = cfg(2, 4, 9, 6);
  c.learned_positions = false;
  check_gradients<EmbeddingOp>(c, rng);
  c = cfg(2, 4, 9, 6);
  c.max_pos = 3;
  c.positions = {0, 1, 0, 1, 2, 0, 1, 2};  // packed documents restarting at 0
  check_gradients<EmbeddingOp>(c, rng);
}

TEST_F(EmbeddingTest, FloatMatchesDouble) {
  check_float_vs_double<EmbeddingOp>(cfg(4, 64, 384, 50), rng);
}

TEST_F(EmbeddingTest, ForwardGathersRows) {
  const EmbCfg c = cfg(2, 3, 5, 7);
  const auto wte = rng.vec(c.V * c.C), wpe = rng.vec(c.max_pos * c.C);
  std::vector<double> out(c.B * c.T * c.C);
  embedding_forward(out.data(), c.tokens.data(), nullptr, wte.data(), wpe.data(), c.B, c.T, c.C,
                    c.V, c.max_pos);
  for (int64_t i = 0; i < c.B * c.T; ++i)
    for (int64_t k = 0; k < c.C; ++k)
      EXPECT_EQ(out[i * c.C + k], wte[c.tokens[i] * c.C + k] + wpe[(i % c.T) * c.C + k]);
}

TEST_F(EmbeddingTest, RejectsOutOfRangeIds) {
  std::vector<int32_t> tokens{0, 7};
  std::vector<float> wte(7 * 2), out(2 * 2);
  EXPECT_THROW(embedding_forward(out.data(), tokens.data(), nullptr, wte.data(),
                                 static_cast<const float*>(nullptr), 1, 2, 2, 7, 2),
               RuntimeError);
}

// The scatter-add is bitwise reproducible: across runs and across thread counts.
TEST_F(EmbeddingTest, BackwardIsDeterministic) {
  const EmbCfg c = cfg(8, 128, 200, 30);
  const auto dout = rng.vec<float>(c.B * c.T * c.C);
  auto run = [&](int threads) {
    std::vector<float> dwte(c.V * c.C, 0.f), dwpe(c.max_pos * c.C, 0.f);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    embedding_backward(dwte.data(), dwpe.data(), dout.data(), c.tokens.data(), nullptr, c.B, c.T,
                       c.C, c.V, c.max_pos);
    omp_set_num_threads(saved);
    dwte.insert(dwte.end(), dwpe.begin(), dwpe.end());
    return dwte;
  };
  const auto first = run(2);
  EXPECT_EQ(first, run(2));
  EXPECT_EQ(first, run(1));
  EXPECT_EQ(first, run(3));
}

}  // namespace
}  // namespace primus::turbo::cpu::testing
