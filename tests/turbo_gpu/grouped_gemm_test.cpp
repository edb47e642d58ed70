// Grouped GEMM on the device (TURBO, CUBLASLT) against the CPU reference in double, on fresh
// random bf16 inputs: every shape class of the MoE presets at reduced rows, empty groups (first,
// middle, last), skewed groups, all rows in one group, group sizes that are no multiple of the
// tiles (alignment 1, 8, 16), the weight gradient's overwrite and accumulate forms; rows past
// offsets[G] hold NaN in the inputs and must stay untouched in the outputs. Errors are checked per
// group, so a small group cannot hide behind a large one. Then the TURBO launch inside a CUDA
// graph (offsets read at replay) and CUBLASLT's refusal while capturing; and, without a GPU, the
// op's host path and argument errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "gpu_fixture.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/dispatch/dispatcher.h"
#include "turbo/kernels/cpu/grouped_gemm.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/grouped_gemm.h"

namespace primus::turbo::testing {
namespace {

struct GgCase {
  std::string name;
  int64_t N, K;                 // the weight's [N, K] per group
  std::vector<int32_t> counts;  // rows per group (already multiples of align)
  int64_t align;
};

void PrintTo(const GgCase& c, std::ostream* os) { *os << c.name; }

std::vector<int32_t> offsets_of(const std::vector<int32_t>& counts) {
  std::vector<int32_t> o(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g) o[g + 1] = o[g] + counts[g];
  return o;
}

// Rows [r0, r1) of a row-major [*, cols] host matrix.
template <class T>
std::vector<T> rows_of(const std::vector<T>& v, int64_t r0, int64_t r1, int64_t cols) {
  return std::vector<T>(v.begin() + r0 * cols, v.begin() + r1 * cols);
}

class GroupedGemmGpuTest : public GpuTest {
 protected:
  void TearDown() override {
    GlobalBackendManager::instance().clear_backend("grouped_gemm");
    GpuTest::TearDown();
  }

  // Host values of a bf16 [M, cols] token matrix: random in the group rows, NaN in the spare rows.
  std::vector<float> tokens(const TensorView& t, int64_t used, int64_t cols) {
    std::vector<float> v = randn(t.numel(), 1.0f, DType::BF16);
    for (size_t i = static_cast<size_t>(used * cols); i < v.size(); ++i) v[i] = std::numeric_limits<float>::quiet_NaN();
    put(t, v);
    return v;
  }
  // Rows from `used` on still hold the poison bytes.
  void expect_untouched(const TensorView& t, int64_t used, const char* what) {
    const std::vector<uint8_t> b = bytes(t);
    const size_t from = static_cast<size_t>(used * t.cols()) * dtype_size(t.dtype);
    for (size_t i = from; i < b.size(); ++i)
      ASSERT_EQ(b[i], 0xFF) << what << ": byte " << i << " past offsets[G] (row " << used << ") was written";
  }

  void run_case(const GgCase& c, BackendType be) {
    SCOPED_TRACE(c.name + " on " + std::string(backend_name(be)));
    GlobalBackendManager::instance().set_backend("grouped_gemm", be);
    const int64_t G = static_cast<int64_t>(c.counts.size()), N = c.N, K = c.K;
    const std::vector<int32_t> o = offsets_of(c.counts);
    const int64_t used = o.back(), M = used + 40;  // 40 spare rows no group owns
    TensorView x = make(DType::BF16, {M, K}), dy = make(DType::BF16, {M, N}), w = make(DType::BF16, {G, N, K});
    TensorView off = make(DType::I32, {G + 1});
    put_i32(off, o);
    const std::vector<float> xv = tokens(x, used, K), dyv = tokens(dy, used, N);
    const std::vector<float> wv = random_tensor(w, 1.0f / std::sqrt(static_cast<float>(K)));
    TensorView y = make(DType::BF16, {M, N}), dx = make(DType::BF16, {M, K}), dw = make(DType::F32, {G, N, K});
    poison(y), poison(dx), poison(dw);
    EXPECT_EQ(grouped_gemm_forward({y, x, w, off, c.align, ctx}), be);
    EXPECT_EQ(grouped_gemm_dgrad({dx, dy, w, off, c.align, ctx}), be);
    EXPECT_EQ(grouped_gemm_wgrad({dw, dy, x, off, c.align, false, ctx}), be);

    const std::vector<double> xd(xv.begin(), xv.end()), dyd(dyv.begin(), dyv.end()), wd(wv.begin(), wv.end());
    std::vector<double> ry(static_cast<size_t>(M * N)), rdx(static_cast<size_t>(M * K)), rdw(static_cast<size_t>(G * N * K));
    cpu::grouped_gemm_forward<double>(ry.data(), xd.data(), wd.data(), o.data(), G, N, K);
    cpu::grouped_gemm_dgrad<double>(rdx.data(), dyd.data(), wd.data(), o.data(), G, N, K);
    cpu::grouped_gemm_wgrad<double>(rdw.data(), dyd.data(), xd.data(), o.data(), G, N, K, false);
    const std::vector<float> gy = get(y), gdx = get(dx), gdw = get(dw);
    for (int64_t g = 0; g < G; ++g) {
      SCOPED_TRACE("group " + std::to_string(g) + " of " + std::to_string(c.counts[g]) + " rows");
      if (c.counts[g] > 0) {
        EXPECT_LT(rel_err(rows_of(gy, o[g], o[g + 1], N), rows_of(ry, o[g], o[g + 1], N)), gate(DType::BF16)) << "forward";
        EXPECT_LT(rel_err(rows_of(gdx, o[g], o[g + 1], K), rows_of(rdx, o[g], o[g + 1], K)), gate(DType::BF16)) << "dgrad";
        // f32 out of exact bf16 products: only the summation order differs.
        EXPECT_LT(rel_err(rows_of(gdw, g * N, (g + 1) * N, K), rows_of(rdw, g * N, (g + 1) * N, K)), 1e-3) << "wgrad";
      } else {
        for (int64_t i = g * N * K; i < (g + 1) * N * K; ++i) ASSERT_EQ(gdw[i], 0.0f) << "wgrad of an empty group, element " << i;
      }
    }
    expect_untouched(y, used, "forward out");
    expect_untouched(dx, used, "dgrad dinp");

    // Accumulate: dweight += the product, exactly once; an empty group's block keeps its values.
    const std::vector<float> d0 = random_tensor(dw);
    EXPECT_EQ(grouped_gemm_wgrad({dw, dy, x, off, c.align, true, ctx}), be);
    const std::vector<float> acc = get(dw);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> want(static_cast<size_t>(N * K));
      for (int64_t i = 0; i < N * K; ++i) want[i] = d0[g * N * K + i] + rdw[g * N * K + i];
      EXPECT_LT(rel_err(rows_of(acc, g * N, (g + 1) * N, K), want), 1e-3) << "wgrad accumulate, group " << g;
    }

    // A bf16 dweight: the same sums rounded once; an empty group's block zeros; never accumulated.
    TensorView dwb = make(DType::BF16, {G, N, K});
    poison(dwb);
    EXPECT_EQ(grouped_gemm_wgrad({dwb, dy, x, off, c.align, false, ctx}), be);
    const std::vector<float> gb = get(dwb);
    for (int64_t g = 0; g < G; ++g) {
      if (c.counts[g] > 0) {
        EXPECT_LT(rel_err(rows_of(gb, g * N, (g + 1) * N, K), rows_of(rdw, g * N, (g + 1) * N, K)), gate(DType::BF16))
            << "bf16 wgrad, group " << g;
      } else {
        for (int64_t i = g * N * K; i < (g + 1) * N * K; ++i) ASSERT_EQ(gb[i], 0.0f) << "bf16 wgrad of an empty group, element " << i;
      }
    }
    EXPECT_THROW(grouped_gemm_wgrad({dwb, dy, x, off, c.align, true, ctx}), std::exception) << "bf16 accumulate";
  }
};

// Every preset's expert layers (C = 2048: olmoe Fe 1024, mixtral Fe 5632, deepseek Fe 1408; fc
// [2 Fe, C], proj [C, Fe]) at reduced rows, then the irregular groupings.
std::vector<GgCase> cases() {
  return {
      {"olmoe_fc", 2048, 2048, {128, 0, 64, 256, 64, 192}, 64},
      {"olmoe_proj", 2048, 1024, {192, 64, 0, 320}, 64},
      {"mixtral_fc", 11264, 2048, {128, 64, 0}, 64},
      {"mixtral_proj", 2048, 5632, {64, 192}, 64},
      {"deepseek_fc", 2816, 2048, {0, 64, 128, 320, 64}, 64},
      {"deepseek_proj", 2048, 1408, {256, 64, 0, 128}, 64},
      // Tiles crossing group ends (forward, dgrad) and k-tiles cut at them (wgrad); N, K no
      // multiple of the tile or of 64.
      {"align1", 136, 200, {33, 0, 1, 95, 130, 7}, 1},
      {"align8", 264, 520, {8, 136, 0, 72, 264}, 8},
      {"align16", 520, 264, {16, 48, 0, 80, 208}, 16},
      {"empty_ends", 256, 128, {0, 48, 0, 0, 16, 0}, 16},
      {"skewed", 512, 256, {1008, 16, 0, 32, 16}, 16},
      {"one_group", 256, 384, {0, 0, 640, 0}, 64},
      // N and K multiples of 64 but not of 128: the weight gradient's paired slab loads reach one
      // 64-column chunk past the matrix in the last tile row and column (read as zeros).
      {"half_tile_edges", 192, 320, {64, 0, 208, 16}, 16},
      {"single_rows", 384, 256, {1, 1, 0, 1}, 1},
  };
}

// The TURBO kernel's switches (docs/environment.md) a lane may set; every test unsets them after.
const char* const kTurboSwitches[] = {"PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE", "PRIMUS_TURBO_GROUPED_GEMM_WGRAD_PAIRS",
                                      "PRIMUS_TURBO_GROUPED_GEMM_DGRAD_PAIRS"};

// A backend, and for TURBO the switches it runs with (none: the defaults, ping-pong).
struct Lane {
  BackendType be;
  std::vector<std::pair<std::string, std::string>> env;
  std::string name;
};
void PrintTo(const Lane& l, std::ostream* os) { *os << l.name; }

class GroupedGemmCaseTest : public GroupedGemmGpuTest, public ::testing::WithParamInterface<std::tuple<GgCase, Lane>> {
 protected:
  void TearDown() override {
    for (const char* v : kTurboSwitches) unsetenv(v);
    GroupedGemmGpuTest::TearDown();
  }
};

TEST_P(GroupedGemmCaseTest, MatchesReferencePerGroup) {
  const auto& [c, lane] = GetParam();
  for (const auto& [k, v] : lane.env) setenv(k.c_str(), v.c_str(), 1);
  run_case(c, lane.be);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedGemmCaseTest,
                         ::testing::Combine(::testing::ValuesIn(cases()),
                                            ::testing::Values(
                                                Lane{BackendType::TURBO, {}, "TURBO"},
                                                Lane{BackendType::TURBO, {{"PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE", "coop"}}, "TURBO_coop"},
                                                // Ping-pong with one TMA load per slab.
                                                Lane{BackendType::TURBO,
                                                     {{"PRIMUS_TURBO_GROUPED_GEMM_WGRAD_PAIRS", "0"},
                                                      {"PRIMUS_TURBO_GROUPED_GEMM_DGRAD_PAIRS", "0"}},
                                                     "TURBO_slabs"},
                                                Lane{BackendType::CUBLASLT, {}, "CUBLASLT"})),
                         [](const ::testing::TestParamInfo<std::tuple<GgCase, Lane>>& i) {
                           return std::get<0>(i.param).name + "_" + std::get<1>(i.param).name;
                         });

// Fresh group sizes every run (multiples of 16, some empty), both device backends and both TURBO
// schedules.
TEST_F(GroupedGemmGpuTest, RandomGroupSizes) {
  std::vector<int32_t> counts = randint(7, 0, 14);
  for (auto& n : counts) n = n < 3 ? 0 : 16 * n;
  for (BackendType be : {BackendType::TURBO, BackendType::CUBLASLT}) run_case({"random", 392, 328, counts, 16}, be);
  setenv("PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE", "coop", 1);
  run_case({"random_coop", 392, 328, counts, 16}, BackendType::TURBO);
  unsetenv("PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE");
}

// SwiGLU in the epilogues (grouped_gemm.h): the up projection writing act beside gate|up, and the
// down projection's input gradient written as d(gate|up), against the plain products followed by
// the activation kernels on fresh random data: the same bytes in every group row, nothing written
// past offsets[G]. F = 1408 is deepseek's expert width (11 column tiles); align 16 and 1 put group
// ends inside tiles.
TEST_F(GroupedGemmGpuTest, SwiGLUEpiloguesAreThePlainProductsThenTheActivationBitForBit) {
  struct S {
    std::string name;
    int64_t F, C;
    std::vector<int32_t> counts;
    int64_t align;
  };
  std::vector<int32_t> rnd = randint(9, 0, 20);
  for (auto& n : rnd) n = n < 4 ? 0 : 16 * n;
  const std::vector<S> cases = {{"olmoe", 1024, 2048, {128, 0, 64, 256, 64, 192}, 64},
                                {"deepseek", 1408, 1024, {0, 64, 320, 64}, 64},
                                {"skewed", 128, 256, {1008, 16, 0, 32, 16}, 16},
                                {"align1", 256, 200, {33, 0, 1, 95, 130, 7}, 1},
                                {"random", 384, 328, rnd, 16}};
  GlobalBackendManager::instance().set_backend("grouped_gemm", BackendType::TURBO);
  // The epilogues run the ping-pong tiles under either schedule switch (the plain products then
  // follow the switch: the same bits, as their k-loops add in the same order).
  for (const char* sched : {"pingpong", "coop"}) {
  setenv("PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE", sched, 1);
  for (const S& s : cases) {
    SCOPED_TRACE(s.name + " " + sched);
    const int64_t G = static_cast<int64_t>(s.counts.size()), F = s.F, C = s.C;
    const std::vector<int32_t> o = offsets_of(s.counts);
    const int64_t used = o.back(), M = used + 40;
    TensorView off = make(DType::I32, {G + 1});
    put_i32(off, o);
    TensorView x = make(DType::BF16, {M, C}), dy = make(DType::BF16, {M, C});
    TensorView wfc = make(DType::BF16, {G, 2 * F, C}), wproj = make(DType::BF16, {G, C, F});
    tokens(x, used, C), tokens(dy, used, C);
    random_tensor(wfc, 1.0f / std::sqrt(static_cast<float>(C)));
    random_tensor(wproj, 1.0f / std::sqrt(static_cast<float>(F)));
    // The plain path.
    TensorView h0 = make(DType::BF16, {M, 2 * F}), act0 = make(DType::BF16, {M, F});
    TensorView dact0 = make(DType::BF16, {M, F}), dh0 = make(DType::BF16, {M, 2 * F});
    EXPECT_EQ(grouped_gemm_forward({h0, x, wfc, off, s.align, ctx}), BackendType::TURBO);
    activation_forward({Activation::SwiGLU, act0, h0, ctx});
    EXPECT_EQ(grouped_gemm_dgrad({dact0, dy, wproj, off, s.align, ctx}), BackendType::TURBO);
    activation_backward({Activation::SwiGLU, dh0, h0, dact0, false, ctx});
    // The epilogues.
    TensorView h = make(DType::BF16, {M, 2 * F}), act = make(DType::BF16, {M, F}), dh = make(DType::BF16, {M, 2 * F});
    poison(h), poison(act), poison(dh);
    EXPECT_EQ(grouped_gemm_forward({h, x, wfc, off, s.align, ctx, act}), BackendType::TURBO);
    EXPECT_EQ(grouped_gemm_dgrad({dh, dy, wproj, off, s.align, ctx, h0}), BackendType::TURBO);
    for (const auto& [what, got, want] : {std::tuple<const char*, TensorView, TensorView>{"gate|up", h, h0},
                                          {"act", act, act0},
                                          {"d(gate|up)", dh, dh0}}) {
      const std::vector<uint8_t> a = bytes(got), b = bytes(want);
      const size_t n = static_cast<size_t>(used * got.cols()) * 2;
      size_t diff = 0;
      for (size_t i = 0; i < n; ++i) diff += a[i] != b[i];
      EXPECT_EQ(diff, 0u) << what << ": bytes that differ from the plain path in the group rows";
      expect_untouched(got, used, what);
    }
    // Not vacuous: the rows hold values of the right size.
    const std::vector<float> av = get(act), dv = get(dh);
    double sa = 0.0, sd = 0.0;
    for (int64_t i = 0; i < used * F; ++i) sa += std::fabs(av[static_cast<size_t>(i)]);
    for (int64_t i = 0; i < used * 2 * F; ++i) sd += std::fabs(dv[static_cast<size_t>(i)]);
    if (used > 0) {
      EXPECT_GT(sa / static_cast<double>(used * F), 0.05) << "act";
      EXPECT_GT(sd / static_cast<double>(used * 2 * F), 0.01) << "d(gate|up)";
    }
  }
  }
  unsetenv("PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE");
  // A width the kernel does not tile: TURBO declines with the reason, and no other device backend
  // takes the fused call.
  const int64_t G = 2, M = 128, C = 64;
  TensorView off = make(DType::I32, {G + 1});
  put_i32(off, {0, 64, 128});
  TensorView x = make(DType::BF16, {M, C}), w = make(DType::BF16, {G, 2 * 192, C});
  TensorView h = make(DType::BF16, {M, 2 * 192}), act = make(DType::BF16, {M, 192});
  GlobalBackendManager::instance().clear_backend("grouped_gemm");
  try {
    grouped_gemm_forward({h, x, w, off, 64, ctx, act});
    ADD_FAILURE() << "F = 192 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 128"), std::string::npos) << e.what();
  }
  // What a caller asks before choosing the fused call.
  EXPECT_TRUE(grouped_gemm_swiglu_available(Device::CUDA, 1408));
  EXPECT_FALSE(grouped_gemm_swiglu_available(Device::CUDA, 192));
  GlobalBackendManager::instance().set_backend("grouped_gemm", BackendType::CUBLASLT);
  EXPECT_FALSE(grouped_gemm_swiglu_available(Device::CUDA, 1408)) << "CUBLASLT has no SwiGLU epilogue";
}

// The TURBO forward captured once and replayed after the offsets changed in device memory: the
// graph reads the groups at replay (no host read at capture). CUBLASLT, which reads them on the
// host, refuses while the stream is being captured.
TEST_F(GroupedGemmGpuTest, TurboRunsInACudaGraphAndCublasLtRefusesCapture) {
  const int64_t G = 4, N = 256, K = 128, M = 512;
  TensorView x = make(DType::BF16, {M, K}), w = make(DType::BF16, {G, N, K}), y = make(DType::BF16, {M, N});
  TensorView off = make(DType::I32, {G + 1});
  const std::vector<float> xv = random_tensor(x), wv = random_tensor(w, 0.1f);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ExecContext c = ctx;
  c.stream = stream;
  auto& mgr = GlobalBackendManager::instance();
  mgr.set_backend("grouped_gemm", BackendType::TURBO);
  put_i32(off, {0, 128, 128, 320, 448});
  EXPECT_EQ(grouped_gemm_forward({y, x, w, off, 64, c}), BackendType::TURBO);  // eager first: one-time setup
  CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EXPECT_EQ(grouped_gemm_forward({y, x, w, off, 64, c}), BackendType::TURBO);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const std::vector<int32_t> o = {0, 64, 256, 256, 512};
  put_i32(off, o);
  poison(y);
  CUDA_CHECK(cudaDeviceSynchronize());  // the legacy stream's memset before the non-blocking stream's replay
  CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<double> xd(xv.begin(), xv.end()), wd(wv.begin(), wv.end());
  std::vector<double> ref(static_cast<size_t>(M * N));
  cpu::grouped_gemm_forward<double>(ref.data(), xd.data(), wd.data(), o.data(), G, N, K);
  EXPECT_LT(rel_err(get(y), ref), gate(DType::BF16)) << "the replay used the offsets of capture time?";
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));

  mgr.set_backend("grouped_gemm", BackendType::CUBLASLT);
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EXPECT_THROW(grouped_gemm_forward({y, x, w, off, 64, c}), BackendRefusedError);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---- no GPU needed: the host path and the argument checks --------------------------------------

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(GroupedGemmHostTest, HostTensorsRunTheReferenceAndBadArgumentsAreNamed) {
  const int64_t G = 3, N = 8, K = 16, M = 20;
  std::vector<float> x(M * K), w(G * N * K), y(M * N, -1.0f), dw(G * N * K);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::cos(0.11f * static_cast<float>(i));
  std::vector<int32_t> o = {0, 5, 5, 17};
  TensorView xv(x.data(), DType::F32, Device::CPU, {M, K}), wv(w.data(), DType::F32, Device::CPU, {G, N, K});
  TensorView yv(y.data(), DType::F32, Device::CPU, {M, N}), dwv(dw.data(), DType::F32, Device::CPU, {G, N, K});
  TensorView ov(o.data(), DType::I32, Device::CPU, {G + 1});
  EXPECT_EQ(grouped_gemm_forward({yv, xv, wv, ov, 1, {}}), BackendType::CPU);
  std::vector<float> want(M * N, -1.0f);
  cpu::grouped_gemm_forward<float>(want.data(), x.data(), w.data(), o.data(), G, N, K);
  EXPECT_EQ(y, want);  // the same kernel, and rows 17.. untouched

  EXPECT_NE(error_of([&] { grouped_gemm_forward({yv, xv, wv, ov.slice0(0, G), 1, {}}); }).find("offsets must be [G+1]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { grouped_gemm_forward({yv, xv.reshape({M * 2, K / 2}), wv, ov, 1, {}}); }).find("inp must be"),
            std::string::npos);
  EXPECT_NE(error_of([&] { grouped_gemm_forward({yv, xv, wv, ov, 0, {}}); }).find("align must be >= 1"), std::string::npos);
  std::vector<uint16_t> half(G * N * K);
  TensorView dw16(half.data(), DType::BF16, Device::CPU, {G, N, K});
  EXPECT_NE(error_of([&] { grouped_gemm_wgrad({dw16, yv, xv, ov, 1, false, {}}); }).find("dweight"), std::string::npos);
  // A bf16 dweight beside bf16 tokens is written, never accumulated (refused before any backend).
  std::vector<uint16_t> x16(M * K), y16(M * N);
  TensorView xb(x16.data(), DType::BF16, Device::CPU, {M, K}), yb(y16.data(), DType::BF16, Device::CPU, {M, N});
  EXPECT_NE(error_of([&] { grouped_gemm_wgrad({dw16, yb, xb, ov, 1, true, {}}); }).find("never accumulated"),
            std::string::npos);
  o = {0, 9, 5, 17};  // decreasing: the host path names the entry
  EXPECT_NE(error_of([&] { grouped_gemm_forward({yv, xv, wv, ov, 1, {}}); }).find("offsets[2] = 5"), std::string::npos);
  o = {0, 5, 5, 21};  // past M
  EXPECT_NE(error_of([&] { grouped_gemm_forward({yv, xv, wv, ov, 1, {}}); }).find("at most M = 20"), std::string::npos);
  o = {0, 5, 5, 17};
  EXPECT_EQ(grouped_gemm_wgrad({dwv, yv, xv, ov, 1, false, {}}), BackendType::CPU);

  // The SwiGLU forms on the host: the product, then the activation (forward) or the activation's
  // backward (input gradient, overwriting d(gate|up)), over the group rows only.
  std::vector<float> act(M * N / 2, -1.0f), hv(M * N, -1.0f);
  TensorView actv(act.data(), DType::F32, Device::CPU, {M, N / 2}), hvv(hv.data(), DType::F32, Device::CPU, {M, N});
  EXPECT_EQ(grouped_gemm_forward({hvv, xv, wv, ov, 1, {}, actv}), BackendType::CPU);
  EXPECT_EQ(hv, want);
  std::vector<float> want_act(M * N / 2, -1.0f);
  cpu::swiglu_forward<float>(want_act.data(), want.data(), 17, N / 2);
  EXPECT_EQ(act, want_act);
  // dinp [M, 2K'] of weight [G, N', K'] = the forward's [G, N, K] read as the down projection
  // [G, K, N / 2]... here: dout [M, K] @ W2[g] with W2 [G, K, N / 2], K' = N / 2.
  std::vector<float> w2(G * K * (N / 2)), dout(M * K), dh(M * N, 7.0f);
  for (size_t i = 0; i < w2.size(); ++i) w2[i] = std::sin(0.05f * static_cast<float>(i) + 1.0f);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = std::cos(0.21f * static_cast<float>(i));
  TensorView w2v(w2.data(), DType::F32, Device::CPU, {G, K, N / 2}), doutv(dout.data(), DType::F32, Device::CPU, {M, K});
  TensorView dhv(dh.data(), DType::F32, Device::CPU, {M, N});
  EXPECT_EQ(grouped_gemm_dgrad({dhv, doutv, w2v, ov, 1, {}, hvv}), BackendType::CPU);
  std::vector<float> dact(M * (N / 2)), want_dh(M * N, 7.0f);
  cpu::grouped_gemm_dgrad<float>(dact.data(), dout.data(), w2.data(), o.data(), G, K, N / 2);
  std::fill(want_dh.begin(), want_dh.begin() + 17 * N, 0.0f);
  cpu::swiglu_backward<float>(want_dh.data(), hv.data(), dact.data(), 17, N / 2);
  EXPECT_EQ(dh, want_dh);  // rows 17.. untouched
  EXPECT_TRUE(grouped_gemm_swiglu_available(Device::CPU, 4));
  EXPECT_FALSE(grouped_gemm_swiglu_available(Device::CPU, 0));
  EXPECT_NE(error_of([&] { grouped_gemm_forward({hvv, xv, wv, ov, 1, {}, hvv}); }).find("swiglu_out must be"),
            std::string::npos);
  EXPECT_NE(error_of([&] { grouped_gemm_dgrad({dhv, doutv, w2v, ov, 1, {}, actv}); }).find("swiglu_inp must be"),
            std::string::npos);
}

}  // namespace
}  // namespace primus::turbo::testing
