// The FP8 grouped GEMM's host path (the reference the device kernel is tested against) against a
// double-precision sum written out here from the FP8 bytes and scales, with an empty group and
// spare rows past offsets[G] (NaN bytes that no result may read); and the argument errors.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "turbo/core/arena.h"
#include "turbo/core/dtype.h"
#include "turbo/kernels/cpu/quantize.h"
#include "turbo/ops/fp8_delayed.h"
#include "turbo/ops/grouped_gemm.h"
#include "turbo/ops/grouped_gemm_fp8.h"

namespace primus::turbo {
namespace {

double dec(uint8_t b, DType t) { return t == DType::F8E4M3 ? f8e4m3_bits_to_float(b) : f8e5m2_bits_to_float(b); }

class GroupedGemmFp8Host : public ::testing::Test {
 protected:
  std::mt19937 rng{std::random_device{}()};
  std::vector<uint8_t> bytes(int64_t n, DType t) {
    std::normal_distribution<float> d(0.0f, 4.0f);
    std::vector<uint8_t> v(static_cast<size_t>(n));
    for (auto& b : v) b = t == DType::F8E4M3 ? float_to_f8e4m3_bits(d(rng)) : float_to_f8e5m2_bits(d(rng));
    return v;
  }
  std::vector<float> scales(int64_t n) {
    std::uniform_real_distribution<float> d(0.01f, 0.1f);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& s : v) s = d(rng);
    return v;
  }
  // Random FP8 operands of the three products: x [M,K], w [G,N,K], wt [K][G*N] (E4M3), dy [M,N],
  // dyt [N][M] (E5M2), xt [K][M]; the token rows from `used` on hold NaN bytes (0x7f).
  std::array<std::vector<uint8_t>, 6> operands(int64_t G, int64_t N, int64_t K, int64_t M, int64_t used) {
    const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
    std::array<std::vector<uint8_t>, 6> a = {bytes(M * K, e4), bytes(G * N * K, e4), bytes(K * G * N, e4),
                                             bytes(M * N, e5), bytes(N * M, e5), bytes(K * M, e4)};
    auto& [x, w, wt, dy, dyt, xt] = a;
    for (int64_t r = used; r < M; ++r) {
      for (int64_t k = 0; k < K; ++k) x[r * K + k] = 0x7f, xt[k * M + r] = 0x7f;
      for (int64_t n = 0; n < N; ++n) dy[r * N + n] = 0x7f, dyt[n * M + r] = 0x7f;
    }
    return a;
  }
  // The three products in double from the FP8 operands of `operands` (x, w, wt E4M3; dy, dyt E5M2),
  // every element times its scale as the caller's lookups give it: sx(r, k), sw(g, n, k), sdy(r, n),
  // swt(g, n, k) (W_g[n, k]'s in the transposed copy), sdyt(g, r, n), sxt(g, r, k). Rows past
  // offsets[G] keep -7.
  struct Ref {
    std::vector<double> y, dx, dw;
  };
  template <class SX, class SW, class SDY, class SWT, class SDYT, class SXT>
  static Ref reference(int64_t G, int64_t N, int64_t K, int64_t M, const std::vector<int32_t>& o,
                       const std::array<std::vector<uint8_t>, 6>& ops, SX sx, SW sw, SDY sdy, SWT swt, SDYT sdyt, SXT sxt) {
    const auto& [x, w, wt, dy, dyt, xt] = ops;
    const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
    Ref f{std::vector<double>(M * N, -7.0), std::vector<double>(M * K, -7.0), std::vector<double>(G * N * K, 0.0)};
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t r = o[g]; r < o[g + 1]; ++r) {
        for (int64_t n = 0; n < N; ++n) {
          double s = 0.0;
          for (int64_t k = 0; k < K; ++k) s += dec(x[r * K + k], e4) * sx(r, k) * dec(w[(g * N + n) * K + k], e4) * sw(g, n, k);
          f.y[r * N + n] = s;
        }
        for (int64_t k = 0; k < K; ++k) {
          double s = 0.0;
          for (int64_t n = 0; n < N; ++n) s += dec(dy[r * N + n], e5) * sdy(r, n) * dec(wt[k * G * N + g * N + n], e4) * swt(g, n, k);
          f.dx[r * K + k] = s;
        }
      }
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          double s = 0.0;
          for (int64_t r = o[g]; r < o[g + 1]; ++r)
            s += dec(dyt[n * M + r], e5) * sdyt(g, r, n) * dec(xt[k * M + r], e4) * sxt(g, r, k);
          f.dw[(g * N + n) * K + k] = s;
        }
    }
    return f;
  }
  static void expect_close(const std::vector<float>& got, const std::vector<double>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::fabs(want[i]))) << what << " element " << i;
  }
};

TEST_F(GroupedGemmFp8Host, EachProductIsTheScaledSumOfItsGroupsFp8Operands) {
  const int64_t G = 3, N = 16, K = 32, M = 24;
  std::vector<int32_t> o = {0, 5, 5, 16};  // group 1 empty, rows 16.. spare
  const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
  auto ops = operands(G, N, K, M, o[G]);
  auto& [x, w, wt, dy, dyt, xt] = ops;
  std::vector<float> sx = scales(M), sw = scales(G * N), swt = scales(G * K), sdy = scales(M), sdyt = scales(G * N),
                     sxt = scales(G * K);
  auto v = [](auto& vec, DType t, std::initializer_list<int64_t> s) { return TensorView(vec.data(), t, Device::CPU, s); };
  const TensorView off = v(o, DType::I32, {G + 1});
  std::vector<float> y(M * N, -7.0f), dx(M * K, -7.0f), dw(G * N * K, -7.0f);
  EXPECT_EQ(grouped_gemm_fp8_forward({v(y, DType::F32, {M, N}), v(x, e4, {M, K}), v(sx, DType::F32, {M}),
                                      v(w, e4, {G, N, K}), v(sw, DType::F32, {G, N}), off, {}}),
            BackendType::CPU);
  EXPECT_EQ(grouped_gemm_fp8_dgrad({v(dx, DType::F32, {M, K}), v(dy, e5, {M, N}), v(sdy, DType::F32, {M}),
                                    v(wt, e4, {K, G * N}), v(swt, DType::F32, {G, K}), off, {}}),
            BackendType::CPU);
  EXPECT_EQ(grouped_gemm_fp8_wgrad({v(dw, DType::F32, {G, N, K}), v(dyt, e5, {N, M}), v(sdyt, DType::F32, {G, N}),
                                    v(xt, e4, {K, M}), v(sxt, DType::F32, {G, K}), off, 1, false, {}}),
            BackendType::CPU);
  Ref ref = reference(
      G, N, K, M, o, ops, [&](int64_t r, int64_t) { return sx[r]; }, [&](int64_t g, int64_t n, int64_t) { return sw[g * N + n]; },
      [&](int64_t r, int64_t) { return sdy[r]; }, [&](int64_t g, int64_t, int64_t k) { return swt[g * K + k]; },
      [&](int64_t g, int64_t, int64_t n) { return sdyt[g * N + n]; }, [&](int64_t g, int64_t, int64_t k) { return sxt[g * K + k]; });
  std::vector<double>&ry = ref.y, &rdx = ref.dx, &rdw = ref.dw;
  // Rows past offsets[G] are not written (they keep -7).
  expect_close(y, ry, "forward");
  expect_close(dx, rdx, "dgrad");
  expect_close(dw, rdw, "wgrad (the empty group's block is zeros)");
  // Accumulate adds once.
  EXPECT_EQ(grouped_gemm_fp8_wgrad({v(dw, DType::F32, {G, N, K}), v(dyt, e5, {N, M}), v(sdyt, DType::F32, {G, N}),
                                    v(xt, e4, {K, M}), v(sxt, DType::F32, {G, K}), off, 1, true, {}}),
            BackendType::CPU);
  for (auto& d : rdw) d *= 2.0;
  expect_close(dw, rdw, "wgrad accumulate");
}

// The bf16-operand wrappers (what the FP8 expert slots call) on host f32 tensors: each product
// within the FP8 SNR gates of the exact one on the unquantized operands (so every operand went into
// the layout and scale grouping its product needs), the empty group's weight gradient zero, rows
// past offsets[G] (NaN) untouched, and all three within grouped_gemm_fp8_scratch_bytes (an arena
// of exactly that size, whose high-water mark is checked). `outliers`: a few entries of x and dy
// 100x larger.
void check_wrappers(std::mt19937& rng, int64_t G, int64_t N, int64_t K, int64_t M, const std::vector<int32_t>& o,
                    int64_t align, GroupedFp8Scaling sc, DType fwd, DType grad, bool outliers) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  auto fill = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng);
    return v;
  };
  std::vector<float> x = fill(M * K), w = fill(G * N * K), dy = fill(M * N);
  if (outliers)
    for (int64_t i = 0; i < 8; ++i) x[(i * 37) % (o[G] * K)] *= 100.0f, dy[(i * 53) % (o[G] * N)] *= 100.0f;
  for (int64_t i = o[G] * K; i < M * K; ++i) x[i] = NAN;  // rows no group owns
  for (int64_t i = o[G] * N; i < M * N; ++i) dy[i] = NAN;
  std::vector<float> y(M * N, -7.0f), dx(M * K, -7.0f), dw(G * N * K, -7.0f);
  std::vector<int32_t> off = o;
  auto v = [](auto& vec, DType t, std::initializer_list<int64_t> s) { return TensorView(vec.data(), t, Device::CPU, s); };
  const size_t bound = grouped_gemm_fp8_scratch_bytes(M, G, N, K);
  std::unique_ptr<Arena> arena = make_host_arena(bound);
  ExecContext ctx;
  ctx.scratch = arena.get();
  const TensorView offs = v(off, DType::I32, {G + 1});
  grouped_gemm_forward_fp8({v(y, DType::F32, {M, N}), v(x, DType::F32, {M, K}), v(w, DType::F32, {G, N, K}), offs, align, ctx},
                           fwd, sc);
  grouped_gemm_dgrad_fp8({v(dx, DType::F32, {M, K}), v(dy, DType::F32, {M, N}), v(w, DType::F32, {G, N, K}), offs, align, ctx},
                         fwd, grad, sc);
  grouped_gemm_wgrad_fp8({v(dw, DType::F32, {G, N, K}), v(dy, DType::F32, {M, N}), v(x, DType::F32, {M, K}), offs, align,
                          false, ctx},
                         fwd, grad, sc);
  EXPECT_LE(arena->high_water(), bound);
  // Exact products in double; relative L2 per product.
  double ny = 0, ey = 0, ndx = 0, edx = 0, ndw = 0, edw = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = o[g]; r < o[g + 1]; ++r) {
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += double(x[r * K + k]) * w[(g * N + n) * K + k];
        ny += s * s, ey += (y[r * N + n] - s) * (y[r * N + n] - s);
      }
      for (int64_t k = 0; k < K; ++k) {
        double s = 0;
        for (int64_t n = 0; n < N; ++n) s += double(dy[r * N + n]) * w[(g * N + n) * K + k];
        ndx += s * s, edx += (dx[r * K + k] - s) * (dx[r * K + k] - s);
      }
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        double s = 0;
        for (int64_t r = o[g]; r < o[g + 1]; ++r) s += double(dy[r * N + n]) * x[r * K + k];
        const double got = dw[(g * N + n) * K + k];
        if (o[g] == o[g + 1]) {
          ASSERT_EQ(got, 0.0) << "the empty group's weight gradient";
        }
        ndw += s * s, edw += (got - s) * (got - s);
      }
  }
  // The FP8 accuracy gates (issue #38): SNR = 10 log10(|ref|^2 / |err|^2) >= 25 dB with E4M3
  // operands, >= 20 dB with an E5M2 one.
  const auto snr = [](double sig, double err) { return 10.0 * std::log10(sig / err); };
  const double gate = grad == DType::F8E5M2 ? 20.0 : 25.0;
  EXPECT_GE(snr(ny, ey), 25.0) << "forward";
  EXPECT_GE(snr(ndx, edx), gate) << "input gradient";
  EXPECT_GE(snr(ndw, edw), gate) << "weight gradient";
  EXPECT_GT(std::sqrt(ey / ny), 1e-4) << "the forward was quantized";
  for (int64_t i = o[G] * N; i < M * N; ++i) ASSERT_EQ(y[i], -7.0f) << "forward wrote past offsets[G]";
  for (int64_t i = o[G] * K; i < M * K; ++i) ASSERT_EQ(dx[i], -7.0f) << "dgrad wrote past offsets[G]";
}

TEST_F(GroupedGemmFp8Host, WrappersQuantizeEachOperandForItsProductWithinTheirScratchBound) {
  check_wrappers(rng, 4, 48, 80, 112, {0, 32, 32, 64, 96}, 16, GroupedFp8Scaling::Row, DType::F8E4M3, DType::F8E5M2, false);
}

// Blockwise scales: every element takes the scale of its own 1x128 tile (token operands) or
// 128 x 128 block (the weight, in both layouts), indexed here by hand from the layouts of
// turbo/core/fp8_granularity.h. Groups of whole 128-token blocks, an empty one, NaN rows past
// offsets[G].
TEST_F(GroupedGemmFp8Host, BlockwiseProductsTakeEachTilesAndBlocksScale) {
  const int64_t G = 3, N = 256, K = 256, M = 384;
  std::vector<int32_t> o = {0, 128, 128, 256};
  const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
  auto ops = operands(G, N, K, M, o[G]);
  auto& [x, w, wt, dy, dyt, xt] = ops;
  const int64_t kb = K / 128, nb = N / 128, mb = M / 128, gnb = G * N / 128;
  const int64_t pk = (kb + 3) / 4 * 4, pgn = (gnb + 3) / 4 * 4;
  std::vector<float> sx = scales(kb * M), sw = scales(gnb * pk), swt = scales(kb * pgn), sdy = scales(nb * M),
                     sdyt = scales(mb * N), sxt = scales(mb * K);
  auto v = [](auto& vec, DType t, std::initializer_list<int64_t> s) { return TensorView(vec.data(), t, Device::CPU, s); };
  const TensorView off = v(o, DType::I32, {G + 1});
  const auto blk = GroupedFp8Scaling::Block;
  std::vector<float> y(M * N, -7.0f), dx(M * K, -7.0f), dw(G * N * K, -7.0f);
  EXPECT_EQ(grouped_gemm_fp8_forward({v(y, DType::F32, {M, N}), v(x, e4, {M, K}), v(sx, DType::F32, {kb, M}),
                                      v(w, e4, {G, N, K}), v(sw, DType::F32, {gnb, pk}), off, {}, blk}),
            BackendType::CPU);
  EXPECT_EQ(grouped_gemm_fp8_dgrad({v(dx, DType::F32, {M, K}), v(dy, e5, {M, N}), v(sdy, DType::F32, {nb, M}),
                                    v(wt, e4, {K, G * N}), v(swt, DType::F32, {kb, pgn}), off, {}, blk}),
            BackendType::CPU);
  EXPECT_EQ(grouped_gemm_fp8_wgrad({v(dw, DType::F32, {G, N, K}), v(dyt, e5, {N, M}), v(sdyt, DType::F32, {mb, N}),
                                    v(xt, e4, {K, M}), v(sxt, DType::F32, {mb, K}), off, 128, false, {}, blk}),
            BackendType::CPU);
  // Blockwise: the scale of the element's own tile or block, indexed by hand.
  const Ref ref = reference(
      G, N, K, M, o, ops, [&](int64_t r, int64_t k) { return sx[(k / 128) * M + r]; },
      [&](int64_t g, int64_t n, int64_t k) { return sw[((g * N + n) / 128) * pk + k / 128]; },
      [&](int64_t r, int64_t n) { return sdy[(n / 128) * M + r]; },
      [&](int64_t g, int64_t n, int64_t k) { return swt[(k / 128) * pgn + (g * N + n) / 128]; },
      [&](int64_t, int64_t r, int64_t n) { return sdyt[(r / 128) * N + n]; },
      [&](int64_t, int64_t r, int64_t k) { return sxt[(r / 128) * K + k]; });
  const std::vector<double>&ry = ref.y, &rdx = ref.dx, &rdw = ref.dw;
  expect_close(y, ry, "blockwise forward");
  expect_close(dx, rdx, "blockwise dgrad");
  expect_close(dw, rdw, "blockwise wgrad");
}

// The wrappers with blockwise scales (e4m3 throughout, 128-row groups), outliers included.
TEST_F(GroupedGemmFp8Host, BlockwiseWrappersMeetTheSnrGatesWithinTheirScratchBound) {
  check_wrappers(rng, 3, 128, 256, 512, {0, 128, 128, 384}, 128, GroupedFp8Scaling::Block, DType::F8E4M3, DType::F8E4M3,
                 true);
}

TEST_F(GroupedGemmFp8Host, ArgumentErrorsNameTheArgument) {
  const int64_t G = 2, N = 16, K = 16, M = 8;
  std::vector<uint8_t> x(M * K), w(G * N * K);
  std::vector<float> sx(M, 1.0f), sw(G * N, 1.0f), y(M * N), bad_sw(G * N - 1, 1.0f);
  std::vector<int32_t> o = {0, 4, 8};
  auto v = [](auto& vec, DType t, std::initializer_list<int64_t> s) { return TensorView(vec.data(), t, Device::CPU, s); };
  const DType e4 = DType::F8E4M3;
  auto fwd = [&](TensorView inp, TensorView wt, TensorView ws, std::vector<int32_t> offs) {
    grouped_gemm_fp8_forward({v(y, DType::F32, {M, N}), inp, v(sx, DType::F32, {M}), wt, ws,
                              TensorView(offs.data(), DType::I32, Device::CPU, {G + 1}), {}});
  };
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one naming " << needle;
    } catch (const RuntimeError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fwd(v(x, e4, {M, K}), v(w, e4, {G, N, K}), v(sw, DType::F32, {G, N}), o);  // well formed
  expect_error([&] { fwd(v(x, DType::F8E5M2, {M, K}), v(w, e4, {G, N, K}), v(sw, DType::F32, {G, N}), o); }, "inp");
  expect_error([&] { fwd(v(x, e4, {M, K}), v(w, DType::F8E5M2, {G, N, K}), v(sw, DType::F32, {G, N}), o); }, "weight");
  expect_error([&] { fwd(v(x, e4, {M, K}), v(w, e4, {G, N, K}), v(bad_sw, DType::F32, {G * N - 1}), o); }, "weight_scale");
  expect_error([&] { fwd(v(x, e4, {M, K}), v(w, e4, {G, N, K}), v(sw, DType::F32, {G, N}), {1, 4, 8}); }, "offsets[0]");
  expect_error([&] { fwd(v(x, e4, {M, K}), v(w, e4, {G, N, K}), v(sw, DType::F32, {G, N}), {0, 6, 4}); }, "offsets[2]");
  expect_error([&] { fwd(v(x, e4, {M, K}), v(w, e4, {G, N, K}), v(sw, DType::F32, {G, N}), {0, 4, 9}); }, "at most M");
  // Blockwise: 128-multiples and the layouts' scale counts.
  const auto blk = [&](int64_t n, int64_t k, int64_t nsx, int64_t nsw) {
    std::vector<uint8_t> bx(M * k), bw(G * n * k);
    std::vector<float> bsx(nsx, 1.0f), bsw(nsw, 1.0f), by(M * n);
    grouped_gemm_fp8_forward({v(by, DType::F32, {M, n}), v(bx, e4, {M, k}), v(bsx, DType::F32, {nsx}), v(bw, e4, {G, n, k}),
                              v(bsw, DType::F32, {nsw}), v(o, DType::I32, {G + 1}), {}, GroupedFp8Scaling::Block});
  };
  blk(128, 256, 2 * M, G * 4);  // well formed: [K/128, M] and [G*N/128, pad4(K/128)]
  expect_error([&] { blk(128, 160, 2 * M, G * 4); }, "multiples of 128");
  expect_error([&] { blk(128, 256, M, G * 4); }, "inp_scale");
  expect_error([&] { blk(128, 256, 2 * M, G * 2); }, "weight_scale");
  // A per-tensor scale reaches the FP8-operand calls as Row vectors.
  expect_error(
      [&] {
        grouped_gemm_fp8_forward({v(y, DType::F32, {M, N}), v(x, e4, {M, K}), v(sx, DType::F32, {M}), v(w, e4, {G, N, K}),
                                  v(sw, DType::F32, {G, N}), v(o, DType::I32, {G + 1}), {}, GroupedFp8Scaling::Tensor});
      },
      "scaling Tensor is for the bf16-operand products");
}

// The wrappers with tensorwise scales (Primus-Turbo's tensorwise grouped GEMM): hybrid and e4m3,
// outliers included, NaN rows past offsets[G] (which must not set the token operands' scales).
TEST_F(GroupedGemmFp8Host, TensorwiseWrappersMeetTheSnrGatesWithinTheirScratchBound) {
  check_wrappers(rng, 4, 48, 80, 112, {0, 32, 32, 64, 96}, 16, GroupedFp8Scaling::Tensor, DType::F8E4M3, DType::F8E5M2,
                 false);
  check_wrappers(rng, 3, 64, 32, 96, {0, 16, 48, 64}, 16, GroupedFp8Scaling::Tensor, DType::F8E4M3, DType::F8E4M3, true);
}

// The three bf16-operand products of random host operands [M,K] x [G,N,K] with dy [M,N] over the
// groups `o`, rows past o[G] huge (x) or NaN (dy): what the tensorwise and delayed tests run, and
// the f32 grouped GEMMs of operands dequantized by hand that their results must equal.
class TensorScaled {
 public:
  static constexpr int64_t G = 3, N = 32, K = 48, M = 80;
  const std::vector<int32_t> o = {0, 16, 16, 64};
  std::vector<float> x, w, dy;
  struct Out {
    std::vector<float> y, dx, dw;
  };
  explicit TensorScaled(std::mt19937& rng) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    auto fill = [&](int64_t n, float s) {
      std::vector<float> v(static_cast<size_t>(n));
      for (auto& e : v) e = d(rng) * s;
      return v;
    };
    x = fill(M * K, 2.0f), w = fill(G * N * K, 0.1f), dy = fill(M * N, 1e-3f);
    w[5] = 3.0f;  // one expert's outlier sets the scale of all
    for (int64_t i = o[G] * K; i < M * K; ++i) x[i] = 1e30f;
    for (int64_t i = o[G] * N; i < M * N; ++i) dy[i] = NAN;
    ctx_.scratch = arena_.get();
  }
  static TensorView view(std::vector<float>& v, std::initializer_list<int64_t> s) {
    return TensorView(v.data(), DType::F32, Device::CPU, s);
  }
  TensorView offsets() { return TensorView(off_.data(), DType::I32, Device::CPU, {G + 1}); }
  // The wrappers (E4M3 x and w, E5M2 dy) at `s`, with delayed scaling's histories or none.
  Out run(GroupedFp8Scaling s, const Fp8DelayedScaling* delayed = nullptr) {
    Out r{std::vector<float>(M * N, 0.0f), std::vector<float>(M * K, 0.0f), std::vector<float>(G * N * K, 0.0f)};
    const TensorView W = view(w, {G, N, K});
    grouped_gemm_forward_fp8({view(r.y, {M, N}), view(x, {M, K}), W, offsets(), 16, ctx_}, kE4, s, nullptr, delayed);
    grouped_gemm_dgrad_fp8({view(r.dx, {M, K}), view(dy, {M, N}), W, offsets(), 16, ctx_}, kE4, kE5, s, nullptr, delayed);
    GroupedGemmWgradArgs wa{view(r.dw, {G, N, K}), view(dy, {M, N}), view(x, {M, K}), offsets(), 16, false, ctx_};
    wa.weight = W;
    grouped_gemm_wgrad_fp8(wa, kE4, kE5, s, delayed);
    return r;
  }
  // t [R, C] quantized with scale `scale` (current scaling over the first `rows` rows when scale
  // is 0), then dequantized; rows past `rows` zero.
  static std::vector<float> dequantized(const std::vector<float>& t, int64_t R, int64_t C, int64_t rows, float scale,
                                        DType f) {
    std::vector<uint8_t> q(static_cast<size_t>(R * C));
    float inv = 0;
    if (scale == 0) {
      const cpu::Fp8Scaling s = cpu::quantize_fp8_tensorwise(t.data(), DType::F32, R, C, C, q.data(), nullptr, f, rows);
      EXPECT_TRUE(s.finite());
      inv = s.scale_inv;
    } else {
      (void)cpu::quantize_fp8_with_scale(t.data(), DType::F32, rows, C, C, scale, q.data(), nullptr, f);
      inv = 1.0f / scale;
    }
    std::vector<float> r(t.size(), 0.0f);
    for (int64_t i = 0; i < rows * C; ++i) r[i] = static_cast<float>(dec(q[i], f)) * inv;
    return r;
  }
  // `got` equals, bit for bit on the rows in use, the f32 grouped GEMMs of x, w and dy quantized
  // with scales sx, sw, sdy (0: each tensor's own amax over its rows in use).
  void expect_products_of(const Out& got, float sx, float sw, float sdy) {
    std::vector<float> qx = dequantized(x, M, K, o[G], sx, kE4), qw = dequantized(w, G * N, K, G * N, sw, kE4),
                       qdy = dequantized(dy, M, N, o[G], sdy, kE5);
    std::vector<float> ry(M * N, 0.0f), rdx(M * K, 0.0f), rdw(G * N * K, 0.0f);
    grouped_gemm_forward({view(ry, {M, N}), view(qx, {M, K}), view(qw, {G, N, K}), offsets(), 16, ctx_});
    grouped_gemm_dgrad({view(rdx, {M, K}), view(qdy, {M, N}), view(qw, {G, N, K}), offsets(), 16, ctx_});
    grouped_gemm_wgrad({view(rdw, {G, N, K}), view(qdy, {M, N}), view(qx, {M, K}), offsets(), 16, false, ctx_});
    for (int64_t i = 0; i < o[G] * N; ++i) ASSERT_EQ(got.y[i], ry[i]) << "forward " << i;
    for (int64_t i = 0; i < o[G] * K; ++i) ASSERT_EQ(got.dx[i], rdx[i]) << "dgrad " << i;
    for (int64_t i = 0; i < G * N * K; ++i) ASSERT_EQ(got.dw[i], rdw[i]) << "wgrad " << i;
  }
  const ExecContext& ctx() const { return ctx_; }

 private:
  static constexpr DType kE4 = DType::F8E4M3, kE5 = DType::F8E5M2;
  std::vector<int32_t> off_ = o;
  std::unique_ptr<Arena> arena_ = make_host_arena(grouped_gemm_fp8_scratch_bytes(M, G, N, K));
  ExecContext ctx_;
};

// Tensorwise: each product is the f32 grouped GEMM of its operands, each dequantized from one
// tensor scale (cpu::quantize_fp8_tensorwise over the plan's rows for x and dy, over all experts
// for W), bit for bit.
TEST_F(GroupedGemmFp8Host, TensorwiseProductsTakeOneScalePerOperand) {
  TensorScaled t(rng);
  t.expect_products_of(t.run(GroupedFp8Scaling::Tensor), 0, 0, 0);
}

// Delayed scaling (the tensorwise products with scales from the expert weight's histories): before
// a step is recorded the products are tensorwise current scaling's, bit for bit, and each role's
// amax (x and dy over the plan's rows) lands in its history entry; with the histories' scales each
// product is the f32 grouped GEMM of its operands quantized with those scales, bit for bit; an
// unregistered weight, a missing args.weight and a scaling other than Tensor are named.
TEST_F(GroupedGemmFp8Host, DelayedProductsTakeTheHistoriesScales) {
  TensorScaled t(rng);
  const int64_t G = TensorScaled::G, N = TensorScaled::N, K = TensorScaled::K, M = TensorScaled::M;
  const auto sc = GroupedFp8Scaling::Tensor;
  Fp8DelayedScaling dl(Fp8DelayedOptions{2});
  dl.add_layer(t.w.data(), "layer 0 experts fc");
  std::vector<float> hist(6 * 2, 0.0f), scale(3, 1.0f), fmax = {448.0f, 448.0f, 57344.0f};
  dl.bind(TensorScaled::view(hist, {6}), TensorScaled::view(scale, {3}), TensorScaled::view(fmax, {3}));
  // Step 1: no history yet (use_history false): current scaling, amaxes recorded.
  const TensorScaled::Out first = t.run(sc, &dl), current = t.run(sc);
  EXPECT_EQ(first.y, current.y);
  EXPECT_EQ(first.dx, current.dx);
  EXPECT_EQ(first.dw, current.dw);
  const auto absmax = [](const std::vector<float>& v, int64_t n) {
    float m = 0;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(v[i]));
    return m;
  };
  EXPECT_EQ(hist[0 * 2], absmax(t.x, t.o[G] * K)) << "x over the plan's rows";
  EXPECT_EQ(hist[1 * 2], absmax(t.w, G * N * K)) << "all experts' weights";
  EXPECT_EQ(hist[2 * 2], absmax(t.dy, t.o[G] * N)) << "dy over the plan's rows";
  // Step 2: the histories' scales.
  fp8_delayed_update(dl, t.ctx());
  dl.use_history = true;
  EXPECT_NE(scale[0], 1.0f) << "the update gave the input a scale";
  t.expect_products_of(t.run(sc, &dl), scale[0], scale[1], scale[2]);
  // Misuse is named.
  std::vector<float> other = t.w, y(M * N), dw(G * N * K);
  const TensorView X = TensorScaled::view(t.x, {M, K}), Y = TensorScaled::view(y, {M, N});
  const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
  EXPECT_THROW(grouped_gemm_forward_fp8({Y, X, TensorScaled::view(other, {G, N, K}), t.offsets(), 16, t.ctx()}, e4, sc,
                                        nullptr, &dl),
               RuntimeError);
  EXPECT_THROW(grouped_gemm_forward_fp8({Y, X, TensorScaled::view(t.w, {G, N, K}), t.offsets(), 16, t.ctx()}, e4,
                                        GroupedFp8Scaling::Row, nullptr, &dl),
               RuntimeError);
  EXPECT_THROW(grouped_gemm_wgrad_fp8({TensorScaled::view(dw, {G, N, K}), TensorScaled::view(t.dy, {M, N}), X, t.offsets(),
                                       16, false, t.ctx()},
                                      e4, e5, sc, &dl),
               RuntimeError);
}

}  // namespace
}  // namespace primus::turbo
