// The FP8 grouped GEMM on the device (TURBO) against the op's CPU reference on the same FP8 bytes
// and scales: fresh random E4M3 / E5M2 operands and scales, the MoE presets' expert shapes at
// reduced rows, empty groups, groups that are no multiple of the 128-row tiles or the 128-token
// k-tiles (the weight gradient's cut), both schedules; blockwise scales on the same shapes. Rows and token columns past offsets[G] hold
// NaN bytes: no written value may read them, and no row past offsets[G] is written. Errors are
// per group. Then one capture into a CUDA graph replayed with other offsets; and, without a GPU,
// the host path against a double-precision sum and the argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <ostream>
#include <string>
#include <vector>

#include "gpu_fixture.h"
#include "turbo/core/dtype.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/ops/grouped_gemm_fp8.h"

namespace primus::turbo::testing {
namespace {

struct F8Case {
  std::string name;
  int64_t N, K;
  std::vector<int32_t> counts;
  bool aligned = true;  // every count a multiple of 16 (blockwise: 128): the device weight gradient runs too
  bool block = false;   // blockwise scales (1x128 token tiles, 128 x 128 weight blocks)
};
void PrintTo(const F8Case& c, std::ostream* os) { *os << c.name; }

std::vector<int32_t> f8_offsets(const std::vector<int32_t>& counts) {
  std::vector<int32_t> o(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g) o[g + 1] = o[g] + counts[g];
  return o;
}
template <class T>
std::vector<T> slice_rows(const std::vector<T>& v, int64_t r0, int64_t r1, int64_t cols) {
  return std::vector<T>(v.begin() + r0 * cols, v.begin() + r1 * cols);
}

constexpr uint8_t kNanByte = 0x7f;  // NaN in e4m3 and e5m2

class GroupedGemmFp8GpuTest : public GpuTest {
 protected:
  void TearDown() override {
    unsetenv("PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE");
    GpuTest::TearDown();
  }
  // Random FP8 bytes of `dt` (values of a normal(0, 8) rounded to the format).
  std::vector<uint8_t> fp8_bytes(int64_t n, DType dt) {
    std::normal_distribution<float> d(0.0f, 8.0f);
    std::vector<uint8_t> b(static_cast<size_t>(n));
    for (auto& x : b) x = dt == DType::F8E4M3 ? float_to_f8e4m3_bits(d(rng_)) : float_to_f8e5m2_bits(d(rng_));
    return b;
  }
  std::vector<float> scales(int64_t n) {
    std::uniform_real_distribution<float> d(0.5e-3f, 2e-3f);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng_);
    return v;
  }
  // A device tensor holding `b`, and a host view of the same bytes.
  struct Pair {
    TensorView dev, host;
  };
  Pair upload(std::vector<uint8_t>& b, DType dt, std::initializer_list<int64_t> shape) {
    Pair p{make(dt, shape), TensorView(b.data(), dt, Device::CPU, shape)};
    CUDA_CHECK(cudaMemcpy(p.dev.data, b.data(), b.size(), cudaMemcpyHostToDevice));
    return p;
  }
  Pair upload_f32(std::vector<float>& v, std::initializer_list<int64_t> shape) {
    Pair p{make(DType::F32, shape), TensorView(v.data(), DType::F32, Device::CPU, shape)};
    put(p.dev, v);
    return p;
  }

  void run_case(const F8Case& c, DType grad_dt) {
    SCOPED_TRACE(c.name + (grad_dt == DType::F8E5M2 ? " e5m2 gradients" : " e4m3 gradients") +
                 (c.block ? " blockwise" : " rowwise"));
    const int64_t G = static_cast<int64_t>(c.counts.size()), N = c.N, K = c.K;
    std::vector<int32_t> o = f8_offsets(c.counts);
    const int64_t mr = c.block ? 128 : 16, align = mr;
    const int64_t used = o.back(), M = (used + 40 + mr - 1) / mr * mr;  // spare rows no group owns
    const GroupedFp8Scaling sc = c.block ? GroupedFp8Scaling::Block : GroupedFp8Scaling::Row;
    const auto p4 = [](int64_t x) { return (x + 3) / 4 * 4; };
    // Operands: x [M,K], w [G,N,K], w_t [K][G*N], dy [M,N], dy_t [N][M], x_t [K][M].
    std::vector<uint8_t> x = fp8_bytes(M * K, DType::F8E4M3), w = fp8_bytes(G * N * K, DType::F8E4M3),
                         wt = fp8_bytes(K * G * N, DType::F8E4M3), dy = fp8_bytes(M * N, grad_dt),
                         dyt = fp8_bytes(N * M, grad_dt), xt = fp8_bytes(K * M, DType::F8E4M3);
    for (int64_t r = used; r < M; ++r) {
      for (int64_t k = 0; k < K; ++k) x[r * K + k] = kNanByte, xt[k * M + r] = kNanByte;
      for (int64_t n = 0; n < N; ++n) dy[r * N + n] = kNanByte, dyt[n * M + r] = kNanByte;
    }
    // Scale counts (turbo/ops/grouped_gemm_fp8.h): rowwise per row / per (group, feature); blockwise
    // per 1x128 tile of the token operands and per 128 x 128 block of the weight.
    const bool b = c.block;
    const int64_t nsx = b ? K / 128 * M : M, nsw = b ? G * N / 128 * p4(K / 128) : G * N,
                  nswt = b ? K / 128 * p4(G * N / 128) : G * K, nsdy = b ? N / 128 * M : M, nsdyt = b ? M / 128 * N : G * N,
                  nsxt = b ? M / 128 * K : G * K;
    std::vector<float> sx = scales(nsx), sw = scales(nsw), swt = scales(nswt), sdy = scales(nsdy), sdyt = scales(nsdyt),
                       sxt = scales(nsxt);
    Pair X = upload(x, DType::F8E4M3, {M, K}), W = upload(w, DType::F8E4M3, {G, N, K}),
         WT = upload(wt, DType::F8E4M3, {K, G * N}), DY = upload(dy, grad_dt, {M, N}), DYT = upload(dyt, grad_dt, {N, M}),
         XT = upload(xt, DType::F8E4M3, {K, M});
    Pair SX = upload_f32(sx, {nsx}), SW = upload_f32(sw, {nsw}), SWT = upload_f32(swt, {nswt}), SDY = upload_f32(sdy, {nsdy}),
         SDYT = upload_f32(sdyt, {nsdyt}), SXT = upload_f32(sxt, {nsxt});
    TensorView off = make(DType::I32, {G + 1});
    put_i32(off, o);
    const TensorView hoff(o.data(), DType::I32, Device::CPU, {G + 1});

    TensorView y = make(DType::BF16, {M, N}), dx = make(DType::BF16, {M, K}), dw = make(DType::F32, {G, N, K});
    poison(y), poison(dx), poison(dw);
    // Each product synchronised on its own, so that a device fault names its kernel.
    EXPECT_EQ(grouped_gemm_fp8_forward({y, X.dev, SX.dev, W.dev, SW.dev, off, ctx, sc}), BackendType::TURBO);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "forward";
    EXPECT_EQ(grouped_gemm_fp8_dgrad({dx, DY.dev, SDY.dev, WT.dev, SWT.dev, off, ctx, sc}), BackendType::TURBO);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "dgrad";
    // The device weight gradient needs offsets on 16-row boundaries (align 16; blockwise 128).
    if (c.aligned) {
      EXPECT_EQ(grouped_gemm_fp8_wgrad({dw, DYT.dev, SDYT.dev, XT.dev, SXT.dev, off, align, false, ctx, sc}),
                BackendType::TURBO);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "wgrad";
    }

    std::vector<float> ry(static_cast<size_t>(M * N)), rdx(static_cast<size_t>(M * K)), rdw(static_cast<size_t>(G * N * K));
    ExecContext host;
    const TensorView hy(ry.data(), DType::F32, Device::CPU, {M, N}), hdx(rdx.data(), DType::F32, Device::CPU, {M, K}),
        hdw(rdw.data(), DType::F32, Device::CPU, {G, N, K});
    EXPECT_EQ(grouped_gemm_fp8_forward({hy, X.host, SX.host, W.host, SW.host, hoff, host, sc}), BackendType::CPU);
    EXPECT_EQ(grouped_gemm_fp8_dgrad({hdx, DY.host, SDY.host, WT.host, SWT.host, hoff, host, sc}), BackendType::CPU);
    EXPECT_EQ(grouped_gemm_fp8_wgrad({hdw, DYT.host, SDYT.host, XT.host, SXT.host, hoff, 1, false, host, sc}),
              BackendType::CPU);

    const std::vector<float> gy = get(y), gdx = get(dx), gdw = get(dw);
    double worst_w = 0.0;
    for (int64_t g = 0; g < G; ++g) {
      SCOPED_TRACE("group " + std::to_string(g) + " of " + std::to_string(c.counts[g]) + " rows");
      if (c.counts[g] > 0) {
        EXPECT_LT(rel_err(slice_rows(gy, o[g], o[g + 1], N), slice_rows(ry, o[g], o[g + 1], N)), 1e-2) << "forward";
        EXPECT_LT(rel_err(slice_rows(gdx, o[g], o[g + 1], K), slice_rows(rdx, o[g], o[g + 1], K)), 1e-2) << "dgrad";
      }
      // f32 out: exact FP8 products, only the accumulation differs (the tensor cores' FP8 adder).
      if (!c.aligned) continue;
      const double e = rel_err(slice_rows(gdw, g * N, (g + 1) * N, K), slice_rows(rdw, g * N, (g + 1) * N, K));
      worst_w = std::max(worst_w, c.counts[g] > 0 ? e : 0.0);
      if (c.counts[g] > 0) EXPECT_LT(e, 2e-3) << "wgrad";
      else
        for (int64_t i = g * N * K; i < (g + 1) * N * K; ++i) ASSERT_EQ(gdw[i], 0.0f) << "wgrad of an empty group";
    }
    RecordProperty("wgrad_worst_rel_err", std::to_string(worst_w));
    const std::vector<uint8_t> by = bytes(y), bdx = bytes(dx);
    for (size_t i = static_cast<size_t>(used * N) * 2; i < by.size(); ++i) ASSERT_EQ(by[i], 0xFF) << "forward wrote past offsets[G]";
    for (size_t i = static_cast<size_t>(used * K) * 2; i < bdx.size(); ++i) ASSERT_EQ(bdx[i], 0xFF) << "dgrad wrote past offsets[G]";

    if (!c.aligned) return;
    // Accumulate: dweight += the product, once.
    const std::vector<float> d0 = random_tensor(dw);
    EXPECT_EQ(grouped_gemm_fp8_wgrad({dw, DYT.dev, SDYT.dev, XT.dev, SXT.dev, off, align, true, ctx, sc}), BackendType::TURBO);
    const std::vector<float> acc = get(dw);
    std::vector<double> want(acc.size());
    for (size_t i = 0; i < acc.size(); ++i) want[i] = static_cast<double>(d0[i]) + rdw[i];
    EXPECT_LT(rel_err(acc, want), 2e-3) << "wgrad accumulate";
  }
};

// The presets' expert shapes (hidden 2048: olmoe fc [2048, 2048] / proj [2048, 1024], mixtral
// fc [11264, 2048] / proj [2048, 5632], deepseek fc [2816, 2048] / proj [2048, 1408]) at reduced
// rows, then irregular groupings.
std::vector<F8Case> f8_cases() {
  return {
      {"olmoe_fc", 2048, 2048, {128, 0, 64, 256, 64, 192}},
      {"olmoe_proj", 2048, 1024, {192, 64, 0, 320}},
      {"mixtral_fc", 11264, 2048, {128, 64, 0}},
      {"mixtral_proj", 2048, 5632, {64, 192}},
      {"deepseek_fc", 2816, 2048, {0, 64, 128, 320, 64}},
      {"deepseek_proj", 2048, 1408, {256, 64, 0, 128}},
      {"unaligned", 144, 208, {33, 0, 1, 95, 130, 7}, false},
      {"align16_cut", 144, 208, {48, 0, 16, 96, 144, 16}},
      {"align16", 528, 272, {16, 48, 0, 80, 208}},
      {"empty_ends", 256, 128, {0, 48, 0, 0, 16, 0}},
      {"skewed", 512, 256, {1008, 16, 0, 32, 16}},
  };
}

struct F8Lane {
  std::string schedule, name;
};
void PrintTo(const F8Lane& l, std::ostream* os) { *os << l.name; }

class GroupedGemmFp8CaseTest : public GroupedGemmFp8GpuTest,
                               public ::testing::WithParamInterface<std::tuple<F8Case, F8Lane>> {};

TEST_P(GroupedGemmFp8CaseTest, MatchesReferencePerGroup) {
  const auto& [c, lane] = GetParam();
  if (!lane.schedule.empty()) setenv("PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE", lane.schedule.c_str(), 1);
  run_case(c, DType::F8E5M2);
  run_case(c, DType::F8E4M3);
}

// Blockwise: the same expert shapes (multiples of 128), groups of whole 128-token blocks for the
// weight gradient, then groups that are not (forward and input gradient only).
std::vector<F8Case> f8_block_cases() {
  const auto blk = [](std::string name, int64_t N, int64_t K, std::vector<int32_t> counts, bool aligned = true) {
    return F8Case{std::move(name), N, K, std::move(counts), aligned, true};
  };
  return {
      blk("block_olmoe_fc", 2048, 2048, {128, 0, 256, 128}),
      blk("block_olmoe_proj", 2048, 1024, {256, 128, 0, 384}),
      blk("block_mixtral_fc", 11264, 2048, {128, 0, 128}),
      blk("block_mixtral_proj", 2048, 5632, {0, 256}),
      blk("block_deepseek_fc", 2816, 2048, {0, 128, 384, 128}),
      blk("block_deepseek_proj", 2048, 1408, {256, 0, 128}),
      blk("block_unaligned", 384, 256, {33, 0, 1, 95, 130, 7}, false),
      blk("block_empty_ends", 256, 128, {0, 128, 0, 0, 256, 0}),
  };
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedGemmFp8CaseTest,
                         ::testing::Combine(::testing::ValuesIn(f8_cases()),
                                            ::testing::Values(F8Lane{"", "pingpong"}, F8Lane{"coop", "coop"})),
                         [](const ::testing::TestParamInfo<std::tuple<F8Case, F8Lane>>& i) {
                           return std::get<0>(i.param).name + "_" + std::get<1>(i.param).name;
                         });

// Blockwise runs one schedule (the cooperative 128 x 128 tile), whatever the variable says.
class GroupedGemmFp8BlockTest : public GroupedGemmFp8GpuTest, public ::testing::WithParamInterface<F8Case> {};

TEST_P(GroupedGemmFp8BlockTest, MatchesReferencePerGroup) {
  run_case(GetParam(), DType::F8E5M2);
  run_case(GetParam(), DType::F8E4M3);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedGemmFp8BlockTest, ::testing::ValuesIn(f8_block_cases()),
                         [](const ::testing::TestParamInfo<F8Case>& i) { return i.param.name; });

TEST_F(GroupedGemmFp8GpuTest, RandomGroupSizes) {
  std::vector<int32_t> counts = randint(7, 0, 20);
  for (auto& n : counts) n = n < 3 ? 0 : 16 * n;
  run_case({"random", 400, 336, counts}, DType::F8E5M2);
  std::vector<int32_t> odd = randint(7, 0, 300);
  run_case({"random_unaligned", 400, 336, odd, false}, DType::F8E4M3);
  std::vector<int32_t> blocks = randint(6, 0, 5);
  for (auto& n : blocks) n = n < 1 ? 0 : 128 * n;
  run_case({"random_blockwise", 384, 512, blocks, true, true}, DType::F8E5M2);
}

// The bf16-operand products with tensorwise scales (what patch cuda.moe.fp8 runs for fp8_recipe
// tensorwise) against the host path on the same values: the quantizer is bit-exact on both sides,
// so the products differ by the accumulation order and the bf16 outputs' rounding only. Rows past
// offsets[G] hold NaN and must not set the token operands' scales. Then the forward captured into a
// CUDA graph and replayed with a plan of more rows (offsets[G] read at replay).
TEST_F(GroupedGemmFp8GpuTest, TensorwiseWrappersMatchTheHostPath) {
  const int64_t G = 5, N = 256, K = 384, M = 1024;
  std::vector<int32_t> o = {0, 128, 128, 400, 560, 720};  // multiples of 16; an empty expert
  const int64_t used = o[G];
  std::vector<float> x = randn(M * K, 1.0f, DType::BF16), w = randn(G * N * K, 0.05f, DType::BF16),
                     dy = randn(M * N, 1e-2f, DType::BF16);
  for (int64_t i = used * K; i < M * K; ++i) x[i] = NAN;
  for (int64_t i = used * N; i < M * N; ++i) dy[i] = NAN;
  TensorView X = make(DType::BF16, {M, K}), W = make(DType::BF16, {G, N, K}), DY = make(DType::BF16, {M, N});
  put(X, x), put(W, w), put(DY, dy);
  TensorView off = make(DType::I32, {G + 1});
  put_i32(off, o);
  TensorView y = make(DType::BF16, {M, N}), dx = make(DType::BF16, {M, K}), dw = make(DType::F32, {G, N, K});
  const auto sc = GroupedFp8Scaling::Tensor;
  const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
  grouped_gemm_forward_fp8({y, X, W, off, 16, ctx}, e4, sc);
  grouped_gemm_dgrad_fp8({dx, DY, W, off, 16, ctx}, e4, e5, sc);
  grouped_gemm_wgrad_fp8({dw, DY, X, off, 16, false, ctx}, e4, e5, sc);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  auto host = make_host_arena(grouped_gemm_fp8_scratch_bytes(M, G, N, K));
  ExecContext hc;
  hc.scratch = host.get();
  const auto hv = [](std::vector<float>& v, std::initializer_list<int64_t> s) {
    return TensorView(v.data(), DType::F32, Device::CPU, s);
  };
  const TensorView hoff(o.data(), DType::I32, Device::CPU, {G + 1});
  std::vector<float> ry(M * N), rdx(M * K), rdw(G * N * K);
  grouped_gemm_forward_fp8({hv(ry, {M, N}), hv(x, {M, K}), hv(w, {G, N, K}), hoff, 16, hc}, e4, sc);
  grouped_gemm_dgrad_fp8({hv(rdx, {M, K}), hv(dy, {M, N}), hv(w, {G, N, K}), hoff, 16, hc}, e4, e5, sc);
  grouped_gemm_wgrad_fp8({hv(rdw, {G, N, K}), hv(dy, {M, N}), hv(x, {M, K}), hoff, 16, false, hc}, e4, e5, sc);
  const auto head = [](const std::vector<float>& v, int64_t n) { return std::vector<float>(v.begin(), v.begin() + n); };
  const double ey = rel_err(head(get(y), used * N), head(ry, used * N));
  const double edx = rel_err(head(get(dx), used * K), head(rdx, used * K));
  const double edw = rel_err(get(dw), rdw);
  EXPECT_LT(ey, 5e-3) << "forward";
  EXPECT_LT(edx, 5e-3) << "input gradient";
  EXPECT_LT(edw, 2e-3) << "weight gradient";  // exact FP8 products; the tensor cores' FP8 adder
  for (float v : head(ry, used * N)) ASSERT_TRUE(std::isfinite(v)) << "the host forward read a stale row";

  // The forward in a graph: offsets[G] (the rows whose amax sets x's scale) read at replay.
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ExecContext c = ctx;
  c.stream = stream;
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  grouped_gemm_forward_fp8({y, X, W, off, 16, c}, e4, sc);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  o = {0, 160, 320, 480, 640, 1008};
  for (int64_t i = used * K; i < o[G] * K; ++i) x[i] = round_to(DType::BF16, 4.0f * std::sin(0.01f * i));
  put(X, x);
  put_i32(off, o);
  CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  grouped_gemm_forward_fp8({hv(ry, {M, N}), hv(x, {M, K}), hv(w, {G, N, K}), hoff, 16, hc}, e4, sc);
  EXPECT_LT(rel_err(head(get(y), o[G] * N), head(ry, o[G] * N)), 5e-3) << "graph replay with another plan";
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Captured once, replayed after the offsets changed in device memory.
TEST_F(GroupedGemmFp8GpuTest, RunsInACudaGraphWithOffsetsReadAtReplay) {
  const int64_t G = 4, N = 256, K = 128, M = 512;
  std::vector<uint8_t> x = fp8_bytes(M * K, DType::F8E4M3), w = fp8_bytes(G * N * K, DType::F8E4M3);
  std::vector<float> sx = scales(M), sw = scales(G * N);
  Pair X = upload(x, DType::F8E4M3, {M, K}), W = upload(w, DType::F8E4M3, {G, N, K});
  Pair SX = upload_f32(sx, {M}), SW = upload_f32(sw, {G, N});
  TensorView off = make(DType::I32, {G + 1}), y = make(DType::BF16, {M, N});
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ExecContext c = ctx;
  c.stream = stream;
  std::vector<int32_t> o = {0, 128, 128, 320, 448};
  put_i32(off, o);
  grouped_gemm_fp8_forward({y, X.dev, SX.dev, W.dev, SW.dev, off, c});
  CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  grouped_gemm_fp8_forward({y, X.dev, SX.dev, W.dev, SW.dev, off, c});
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  o = {0, 16, 272, 272, 512};
  put_i32(off, o);
  CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ry(static_cast<size_t>(M * N));
  const TensorView hy(ry.data(), DType::F32, Device::CPU, {M, N}), hoff(o.data(), DType::I32, Device::CPU, {G + 1});
  grouped_gemm_fp8_forward({hy, X.host, SX.host, W.host, SW.host, hoff, ExecContext{}});
  EXPECT_LT(rel_err(get(y), ry), 1e-2);
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace primus::turbo::testing
