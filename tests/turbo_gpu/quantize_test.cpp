// FP8 tensorwise quantisation (quantize_fp8) on the device (TURBO) against the CPU reference
// backend: bytes of out / out_t and scale_inv must be bit-identical, for fresh random inputs of
// many shapes (tile-aligned, ragged, single row, strided rows, misaligned pitches), f32 and bf16
// inputs, both FP8 formats, and each choice of outputs; outputs are poisoned (0xFF) before every
// run and a second run must give the same bits. Also: the hardware conversion against the host
// encoder at scale 1, subnormal amax, non-finite input, and capture into a CUDA graph; row groups
// for out_t (offsets read on the device, group_rows) against the reference, in a graph too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gpu_fixture.h"
#include "turbo/bench/benchmark.h"
#include "turbo/kernels/cpu/quantize.h"
#include "turbo/ops/fp8_delayed.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/quantization.h"

namespace primus::turbo::testing {
namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// An input [R, C] with rows ld apart, held on the host (raw storage of dtype `dt`) and on the device.
struct Input {
  DType dt;
  int64_t R, C, ld;
  std::vector<uint8_t> host;  // R * ld elements
  TensorView dev;
  TensorView host_view() {
    TensorView v(host.data(), dt, Device::CPU, {R, ld});
    v.shape[1] = C;
    return v;
  }
};

struct Outputs {
  std::vector<uint8_t> out, out_t;
  float scale_inv = 0;
};

class QuantizeGpuTest : public GpuTest {
 protected:
  // Values of widely spread magnitudes (so some land in the FP8 subnormals), rounded to dt; the
  // gaps between rows hold NaN, which must not be read.
  Input make_input(DType dt, int64_t R, int64_t C, int64_t ld, const std::vector<float>* values = nullptr) {
    Input in{dt, R, C, ld, {}, {}};
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::uniform_real_distribution<float> e(-6.0f, 3.0f);
    std::vector<float> all(static_cast<size_t>(R * ld), std::numeric_limits<float>::quiet_NaN());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) all[r * ld + c] = values ? (*values)[r * C + c] : n(rng_) * std::exp2(e(rng_));
    in.host.resize(all.size() * dtype_size(dt));
    for (size_t i = 0; i < all.size(); ++i) store_from_float(in.host.data(), dt, i, all[i]);
    TensorView full = make(dt, {R, ld});
    CUDA_CHECK(cudaMemcpy(full.data, in.host.data(), in.host.size(), cudaMemcpyHostToDevice));
    in.dev = full;
    in.dev.shape[1] = C;
    return in;
  }

  // The CPU backend on the host copy at a per-group granularity: both outputs and their scales.
  struct GroupedRef {
    std::vector<uint8_t> out, out_t;
    std::vector<float> scale_inv, scale_inv_t;
  };
  GroupedRef reference_grouped(Input& in, Fp8Granularity g, DType fp8) {
    const int64_t ns = fp8_scale_numel(g, in.R, in.C), nst = fp8_scale_numel(g, in.C, in.R);
    GroupedRef r{std::vector<uint8_t>(static_cast<size_t>(in.R * in.C)), std::vector<uint8_t>(static_cast<size_t>(in.R * in.C)),
                 std::vector<float>(static_cast<size_t>(ns)), std::vector<float>(static_cast<size_t>(nst))};
    QuantizeFp8Args a;
    a.inp = in.host_view();
    a.granularity = g;
    a.out = TensorView(r.out.data(), fp8, Device::CPU, {in.R, in.C});
    a.out_t = TensorView(r.out_t.data(), fp8, Device::CPU, {in.C, in.R});
    a.scale_inv = TensorView(r.scale_inv.data(), DType::F32, Device::CPU, {ns});
    a.scale_inv_t = TensorView(r.scale_inv_t.data(), DType::F32, Device::CPU, {nst});
    EXPECT_EQ(quantize_fp8(a), BackendType::CPU);
    return r;
  }

  // The CPU backend on the host copy: both outputs.
  Outputs reference(Input& in, DType fp8) {
    Outputs o;
    o.out.resize(static_cast<size_t>(in.R * in.C));
    o.out_t.resize(o.out.size());
    QuantizeFp8Args a;
    a.inp = in.host_view();
    a.out = TensorView(o.out.data(), fp8, Device::CPU, {in.R, in.C});
    a.out_t = TensorView(o.out_t.data(), fp8, Device::CPU, {in.C, in.R});
    a.scale_inv = TensorView(&o.scale_inv, DType::F32, Device::CPU, {1});
    EXPECT_EQ(quantize_fp8(a), BackendType::CPU);
    return o;
  }

  // The device op with the requested outputs, each poisoned first; returns what it wrote.
  Outputs device(const Input& in, DType fp8, bool want_out, bool want_t, void* stream = nullptr) {
    QuantizeFp8Args a;
    a.inp = in.dev;
    if (want_out) a.out = out_;
    if (want_t) a.out_t = out_t_;
    a.out.dtype = a.out_t.dtype = fp8;
    a.scale_inv = scale_inv_;
    a.ctx = ctx;
    a.ctx.stream = stream;
    for (const TensorView* t : {&a.out, &a.out_t, &a.scale_inv})
      if (t->defined()) poison(*t);
    CUDA_CHECK(cudaDeviceSynchronize());  // the memsets are not ordered with a non-blocking stream
    EXPECT_EQ(quantize_fp8(a), BackendType::TURBO);
    Outputs o;
    if (want_out) o.out = bytes(a.out);
    if (want_t) o.out_t = bytes(a.out_t);
    const auto s = bytes(scale_inv_);
    std::memcpy(&o.scale_inv, s.data(), 4);
    return o;
  }

  // Output buffers for [R, C] (fresh per input; dtype set per call).
  void alloc_outputs(int64_t R, int64_t C) {
    out_ = make(DType::F8E4M3, {R, C});
    out_t_ = make(DType::F8E4M3, {C, R});
    scale_inv_ = make(DType::F32, {1});
  }

  // Device against reference for every output choice, twice each.
  void check_all_modes(Input& in, DType fp8) {
    const Outputs ref = reference(in, fp8);
    alloc_outputs(in.R, in.C);
    struct Mode {
      bool out, out_t;
      const char* name;
    };
    for (const Mode m : {Mode{true, true, "out+out_t"}, Mode{true, false, "out only"}, Mode{false, true, "out_t only"}}) {
      SCOPED_TRACE(m.name);
      const Outputs first = device(in, fp8, m.out, m.out_t);
      if (m.out) {
        EXPECT_TRUE(first.out == ref.out) << first_diff(first.out, ref.out);
      }
      if (m.out_t) {
        EXPECT_TRUE(first.out_t == ref.out_t) << first_diff(first.out_t, ref.out_t);
      }
      EXPECT_EQ(bits(first.scale_inv), bits(ref.scale_inv)) << first.scale_inv << " vs " << ref.scale_inv;
      const Outputs again = device(in, fp8, m.out, m.out_t);
      EXPECT_TRUE(again.out == first.out && again.out_t == first.out_t) << "a repeated run differs";
      EXPECT_EQ(bits(again.scale_inv), bits(first.scale_inv));
    }
  }

  static std::string first_diff(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
    if (got.size() != want.size()) return fmt::format("sizes {} vs {}", got.size(), want.size());
    size_t n = 0, first = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[i] && n++ == 0) first = i;
    if (n == 0) return "";
    return fmt::format("{} of {} bytes differ; first at {}: got 0x{:02x} want 0x{:02x}", n, got.size(), first,
                       got[first], want[first]);
  }

  TensorView out_, out_t_, scale_inv_;
};

struct Shape {
  int64_t R, C, ld;  // ld == 0: contiguous
};
struct ShapeCase {
  Shape s;
  DType in;
};

class QuantizeShapes : public QuantizeGpuTest, public ::testing::WithParamInterface<ShapeCase> {};

TEST_P(QuantizeShapes, BitIdenticalToCpuReference) {
  const auto [s, in_dt] = GetParam();
  Input in = make_input(in_dt, s.R, s.C, s.ld ? s.ld : s.C);
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    SCOPED_TRACE(std::string(dtype_name(fp8)));
    check_all_modes(in, fp8);
  }
}

std::vector<ShapeCase> shape_cases() {
  const std::vector<Shape> shapes = {
      {128, 128, 0},    // one full tile
      {4096, 3072, 0},  // many tiles, more than one wave
      {144, 272, 0},    // tile path with partial edge tiles (multiples of 16)
      {1000, 48, 0},    // R not a multiple of 16: out_t takes the generic kernel, out the tile one
      {37, 100, 0},     // ragged: generic kernel
      {1, 4096, 0},     // one row
      {4096, 1, 0},     // one column
      {16, 16, 0},      // smaller than a tile
      {304, 256, 264},  // strided rows, 16-byte aligned pitch (both dtypes): tile path
      {300, 256, 264},  // the same with R % 16 != 0: out_t takes the generic kernel
      {64, 48, 50},     // strided rows, pitch not 16-byte aligned: generic loads
      {3, 5, 7},        // tiny strided
  };
  std::vector<ShapeCase> c;
  for (const Shape& s : shapes)
    for (DType in : {DType::F32, DType::BF16}) c.push_back({s, in});
  return c;
}

INSTANTIATE_TEST_SUITE_P(Quantize, QuantizeShapes, ::testing::ValuesIn(shape_cases()), [](const auto& info) {
  const Shape& s = info.param.s;
  return fmt::format("{}x{}{}_{}", s.R, s.C, s.ld ? fmt::format("_ld{}", s.ld) : std::string(),
                     dtype_name(info.param.in));
});

// amax = 448 (e4m3) / 57344 (e5m2) makes the scale exactly 1, so every byte is the hardware's
// conversion of the input itself: each FP8 value, each midpoint between neighbours and one f32
// ulp either side of it, and f32 subnormals, against the host encoder. (Saturation cannot occur
// at scale 1 without a larger amax; the host tests cover it.)
TEST_F(QuantizeGpuTest, HardwareConversionMatchesHostEncoderAtScaleOne) {
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    SCOPED_TRACE(std::string(dtype_name(fp8)));
    const float mx = cpu::fp8_max(fp8);
    std::vector<float> v = {mx, -mx, 0.0f, -0.0f, 1e-40f, -1e-40f, FLT_MIN};
    for (int b = 0; b < 0x7f; ++b) {
      const uint8_t b0 = static_cast<uint8_t>(b), b1 = static_cast<uint8_t>(b + 1);
      const float lo = load_as_float(&b0, fp8, 0), hi = load_as_float(&b1, fp8, 0);
      if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
      const float mid = (lo + hi) / 2;
      for (float x : {lo, mid, std::nextafter(mid, lo), std::nextafter(mid, hi)}) {
        v.push_back(x);
        v.push_back(-x);
      }
    }
    while (v.size() % 16 != 0) v.push_back(0.0f);
    const int64_t C = static_cast<int64_t>(v.size()) / 16;
    Input in = make_input(DType::F32, 16, C, C, &v);
    const Outputs ref = reference(in, fp8);
    ASSERT_EQ(ref.scale_inv, 1.0f);
    alloc_outputs(16, C);
    const Outputs got = device(in, fp8, true, true);
    EXPECT_TRUE(got.out == ref.out) << first_diff(got.out, ref.out);
    EXPECT_TRUE(got.out_t == ref.out_t) << first_diff(got.out_t, ref.out_t);
    EXPECT_EQ(bits(got.scale_inv), bits(ref.scale_inv));
  }
}

// max |x| an f32 subnormal: fp8_max / amax overflows and the scale is clamped to FLT_MAX; the
// device must not flush subnormals (the products are then ordinary numbers).
// rows_in_use (an MoE plan's offsets[G], read on the device): the scale and the used rows' bytes
// equal the reference's, bit for bit, with NaN and huge values in the rows past it; on the tile
// path (both outputs), on the generic one (ragged C), and in a CUDA graph replayed after the count
// changed in device memory.
TEST_F(QuantizeGpuTest, RowsInUseLimitTheAmaxBitForBit) {
  struct Case {
    int64_t R, C;
  };
  for (const Case k : {Case{512, 256}, Case{96, 40}}) {
    for (const DType in_dt : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(fmt::format("[{}, {}] {}", k.R, k.C, dtype_name(in_dt)));
      // Stale rows past 3/4 of the tensor: NaN and 1e30 (finite in f32, inf in bf16).
      std::vector<float> v = randn(k.R * k.C, 2.0f, in_dt);
      const int64_t first = k.R * 3 / 4;
      for (int64_t i = first * k.C; i < k.R * k.C; ++i) v[i] = i % 2 ? NAN : 1e30f;
      Input in = make_input(in_dt, k.R, k.C, k.C, &v);
      const TensorView used_dev = make(DType::I32, {1});
      cudaStream_t stream;
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      ExecContext c = ctx;
      c.stream = stream;
      const TensorView out = make(DType::F8E4M3, {k.R, k.C}), out_t = make(DType::F8E4M3, {k.C, k.R});
      const TensorView si = make(DType::F32, {1});
      QuantizeFp8Args a;
      a.inp = in.dev, a.out = out, a.out_t = out_t, a.scale_inv = si, a.granularity = Fp8Granularity::Tensor;
      a.rows_in_use = used_dev, a.ctx = c;
      const auto check = [&](int32_t used) {
        SCOPED_TRACE(fmt::format("{} rows in use", used));
        std::vector<uint8_t> ro(static_cast<size_t>(k.R * k.C));
        const cpu::Fp8Scaling s = cpu::quantize_fp8_tensorwise(in.host.data(), in_dt, k.R, k.C, k.C, ro.data(), nullptr,
                                                               DType::F8E4M3, used);
        const std::vector<uint8_t> go = bytes(out), gt = bytes(out_t), gs = bytes(si);
        float got_inv;
        std::memcpy(&got_inv, gs.data(), 4);
        EXPECT_TRUE(std::isfinite(got_inv));
        EXPECT_EQ(bits(got_inv), bits(s.scale_inv));
        for (int64_t r = 0; r < used; ++r)
          for (int64_t col = 0; col < k.C; ++col) {
            ASSERT_EQ(go[r * k.C + col], ro[r * k.C + col]) << r << "," << col;
            ASSERT_EQ(gt[col * k.R + r], ro[r * k.C + col]) << "out_t " << r << "," << col;
          }
      };
      put_i32(used_dev, {static_cast<int32_t>(first)});
      quantize_fp8(a);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      check(static_cast<int32_t>(first));
      cudaGraph_t graph;
      CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      quantize_fp8(a);
      CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec;
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const int32_t fewer = static_cast<int32_t>(k.R / 3);
      put_i32(used_dev, {fewer});
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      check(fewer);
      CUDA_CHECK(cudaGraphExecDestroy(exec));
      CUDA_CHECK(cudaGraphDestroy(graph));
      // Delayed scaling: the given scale quantizes, the recorded amax is the rows in use's (folded
      // into what amax held), the bytes of those rows the reference's.
      const TensorView scale = make(DType::F32, {1}), amax = make(DType::F32, {1});
      put(scale, {24.0f});
      put(amax, {0.25f});
      a.scale = scale, a.amax = amax;
      quantize_fp8(a);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<uint8_t> ro(static_cast<size_t>(fewer * k.C));
      (void)cpu::quantize_fp8_with_scale(in.host.data(), in_dt, fewer, k.C, k.C, 24.0f, ro.data(), nullptr, DType::F8E4M3);
      const uint32_t m = cpu::absmax_bits(in.host.data(), in_dt, fewer, k.C, k.C);
      float want_amax;
      std::memcpy(&want_amax, &m, 4);
      EXPECT_EQ(get(amax)[0], std::max(want_amax, 0.25f)) << "delayed: the rows in use's amax";
      const std::vector<uint8_t> go = bytes(out);
      for (int64_t i = 0; i < fewer * k.C; ++i) ASSERT_EQ(go[i], ro[i]) << "delayed byte " << i;
      CUDA_CHECK(cudaStreamDestroy(stream));
    }
  }
}

TEST_F(QuantizeGpuTest, SubnormalAmaxMatchesReference) {
  std::vector<float> v(32 * 32);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : v) x = u(rng_) * 1e-39f;
  Input in = make_input(DType::F32, 32, 32, 32, &v);
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    const Outputs ref = reference(in, fp8);
    EXPECT_EQ(ref.scale_inv, 1.0f / FLT_MAX);
    alloc_outputs(32, 32);
    const Outputs got = device(in, fp8, true, true);
    EXPECT_TRUE(got.out == ref.out) << first_diff(got.out, ref.out);
    EXPECT_TRUE(got.out_t == ref.out_t) << first_diff(got.out_t, ref.out_t);
    EXPECT_EQ(bits(got.scale_inv), bits(ref.scale_inv));
  }
}

// One NaN or inf anywhere: scale_inv NaN (0x7fc00000), every byte 0x7f, on both paths.
TEST_F(QuantizeGpuTest, NonFiniteInputPoisonsTheResult) {
  for (const Shape s : {Shape{256, 256, 0}, Shape{37, 100, 0}})
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()})
      for (DType in_dt : {DType::F32, DType::BF16}) {
        std::vector<float> v(static_cast<size_t>(s.R * s.C), 0.5f);
        v[v.size() / 3] = bad;
        Input in = make_input(in_dt, s.R, s.C, s.C, &v);
        alloc_outputs(s.R, s.C);
        const Outputs got = device(in, DType::F8E4M3, true, true);
        EXPECT_EQ(bits(got.scale_inv), 0x7fc00000u);
        EXPECT_EQ(got.out, std::vector<uint8_t>(v.size(), cpu::kFp8PoisonByte));
        EXPECT_EQ(got.out_t, std::vector<uint8_t>(v.size(), cpu::kFp8PoisonByte));
      }
}

// Two launches, no allocation, no host synchronisation: the op captures into a CUDA graph, and the
// replay writes what the eager call wrote.
TEST_F(QuantizeGpuTest, CapturesIntoACudaGraph) {
  Input in = make_input(DType::BF16, 512, 768, 768);
  alloc_outputs(512, 768);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Outputs eager = device(in, DType::F8E4M3, true, true, stream);
  poison(out_);
  poison(out_t_);
  poison(scale_inv_);
  CUDA_CHECK(cudaDeviceSynchronize());
  QuantizeFp8Args a;
  a.inp = in.dev;
  a.out = out_;
  a.out_t = out_t_;
  a.scale_inv = scale_inv_;
  a.ctx = ctx;
  a.ctx.stream = stream;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EXPECT_EQ(quantize_fp8(a), BackendType::TURBO);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(bytes(out_), eager.out);
  EXPECT_EQ(bytes(out_t_), eager.out_t);
  const auto s = bytes(scale_inv_);
  EXPECT_EQ(std::memcmp(s.data(), &eager.scale_inv, 4), 0);
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Without ctx.scratch the device backend declines, and with device tensors nothing else can run.
TEST_F(QuantizeGpuTest, DeviceCallWithoutScratchIsAnError) {
  Input in = make_input(DType::F32, 16, 16, 16);
  alloc_outputs(16, 16);
  QuantizeFp8Args a;
  a.inp = in.dev;
  a.out = out_;
  a.scale_inv = scale_inv_;
  EXPECT_THROW(quantize_fp8(a), RuntimeError);
}

// `primus benchmark quantize`: per case and backend, three tensorwise measurements (out + out_t,
// out, out_t), the per-group ones (rows always; 1x128 and 128x128 where both dimensions are
// multiples of 128), delayed scaling, and the SwiGLU forward and backward quantized after the
// activation and folded into it: 9 for 64x96, 11 for 128x256; on the host (runs everywhere) and,
// where there is one, on the device.
TEST(QuantizeBench, MeasurementsPerCase) {
  for (bool cpu_only : {true, false}) {
    if (!cpu_only && cuda_device_count_or_zero() == 0) continue;
    bench::BenchConfig cfg;
    cfg.ops = {"quantize"};
    cfg.shapes = {"64x96", "128x256"};
    cfg.iters = 2;
    cfg.cpu_only = cpu_only;
    cfg.memory_gib = 1;
    EXPECT_EQ(bench::run_benchmarks(cfg, stdout), 20) << (cpu_only ? "host" : "device");
  }
}

// Per-group scaling (rows, 1x128 tiles, 128x128 blocks): the device kernel against the CPU
// reference, bytes and scales bit for bit, both outputs and each alone, f32 and bf16 inputs,
// both FP8 formats, strided rows; a NaN poisons only its group; a graph replay gives the same bits.
// Both block kernels (PRIMUS_TURBO_QUANT_GROUPS_KERNEL: 8 x 8 and 16 x 4 patches).
TEST_F(QuantizeGpuTest, GroupScalingMatchesTheReferenceBitForBit) {
  using G = Fp8Granularity;
  struct Shape { int64_t R, C, ld; };
  for (const char* kernel : {"patch8", "patch16"})
  for (const G g : {G::Row, G::Block1x128, G::Block128x128})
    for (const Shape sh : g == G::Row ? std::vector<Shape>{{272, 400, 400}, {128, 256, 264}, {16, 2048, 2048}}
                                      : std::vector<Shape>{{256, 384, 384}, {384, 640, 648}, {128, 128, 128}})
      for (const DType dt : {DType::BF16, DType::F32})
        for (const DType fp8 : {DType::F8E4M3, DType::F8E5M2})
          for (const bool nan : {false, true}) {
            SCOPED_TRACE(fmt::format("{} {} [{}, {}] ld {} {} -> {}{}", kernel, fp8_granularity_name(g), sh.R, sh.C,
                                     sh.ld, dtype_name(dt), dtype_name(fp8), nan ? " with a NaN" : ""));
            ::setenv("PRIMUS_TURBO_QUANT_GROUPS_KERNEL", kernel, 1);
            std::vector<float> vals(static_cast<size_t>(sh.R * sh.C));
            std::normal_distribution<float> n(0.0f, 1.0f);
            std::uniform_real_distribution<float> e(-6.0f, 3.0f);
            for (auto& v : vals) v = n(rng_) * std::exp2(e(rng_));
            if (nan) vals[static_cast<size_t>((sh.R / 2) * sh.C + sh.C / 3)] = std::numeric_limits<float>::quiet_NaN();
            Input in = make_input(dt, sh.R, sh.C, sh.ld, &vals);
            const int64_t ns = fp8_scale_numel(g, sh.R, sh.C), nst = fp8_scale_numel(g, sh.C, sh.R);
            const GroupedRef ref = reference_grouped(in, g, fp8);
            const std::vector<uint8_t>&ro = ref.out, &rt = ref.out_t;
            const std::vector<float>&rs = ref.scale_inv, &rst = ref.scale_inv_t;
            // Device: both outputs, then each alone.
            TensorView out = make(fp8, {sh.R, sh.C}), out_t = make(fp8, {sh.C, sh.R});
            TensorView sc = make(DType::F32, {ns}), sct = make(DType::F32, {nst});
            for (int mode = 0; mode < 3; ++mode) {
              QuantizeFp8Args a;
              a.inp = in.dev;
              a.granularity = g;
              if (mode != 2) a.out = out, a.scale_inv = sc;
              if (mode != 1) a.out_t = out_t, a.scale_inv_t = sct;
              a.ctx = ctx;
              for (const TensorView* t : {&out, &out_t, &sc, &sct}) poison(*t);
              CUDA_CHECK(cudaDeviceSynchronize());
              ASSERT_EQ(quantize_fp8(a), BackendType::TURBO);
              if (mode != 2) {
                EXPECT_TRUE(bytes(out) == ro) << "out: " << first_diff(bytes(out), ro);
                const auto s = get(sc);
                for (int64_t k = 0; k < ns; ++k)
                  ASSERT_EQ(bits(s[k]), bits(rs[k])) << "scale_inv[" << k << "] " << s[k] << " vs " << rs[k];
              }
              if (mode != 1) {
                EXPECT_TRUE(bytes(out_t) == rt) << "out_t: " << first_diff(bytes(out_t), rt);
                const auto s = get(sct);
                for (int64_t k = 0; k < nst; ++k)
                  ASSERT_EQ(bits(s[k]), bits(rst[k])) << "scale_inv_t[" << k << "] " << s[k] << " vs " << rst[k];
              }
            }
            if (nan && (g != G::Block128x128 || sh.R * sh.C > kFp8BlockSize * kFp8BlockSize)) {  // only the NaN's group is poisoned: some bytes of out are finite
              size_t poisoned = 0;
              for (uint8_t b : ro) poisoned += b == 0x7f;
              EXPECT_GT(poisoned, 0u);
              EXPECT_LT(poisoned, ro.size() / 2);
            }
          }
  ::unsetenv("PRIMUS_TURBO_QUANT_GROUPS_KERNEL");
}

// Row and tensor scaling with the producer's maxima (QuantizeFp8Args::maxima, as the SwiGLU kernels
// write them): one launch instead of the amax pass and the quantizing one, the same bytes and
// scales as the CPU reference without maxima, with both outputs and with one alone, a NaN included.
TEST_F(QuantizeGpuTest, RowScalingWithTheProducersMaximaMatchesTheReferenceBitForBit) {
  struct Shape { int64_t R, C, ld; };
  for (const Shape sh : {Shape{272, 400, 400}, Shape{128, 256, 264}, Shape{1024, 2048, 2048}})
    for (const DType dt : {DType::BF16, DType::F32})
      for (const DType fp8 : {DType::F8E4M3, DType::F8E5M2})
        for (const bool nan : {false, true}) {
          SCOPED_TRACE(fmt::format("[{}, {}] ld {} {} -> {}{}", sh.R, sh.C, sh.ld, dtype_name(dt), dtype_name(fp8),
                                   nan ? " with a NaN" : ""));
          std::vector<float> vals(static_cast<size_t>(sh.R * sh.C));
          std::normal_distribution<float> n(0.0f, 1.0f);
          std::uniform_real_distribution<float> e(-6.0f, 3.0f);
          for (auto& v : vals) v = n(rng_) * std::exp2(e(rng_));
          if (nan) vals[static_cast<size_t>((sh.R / 3) * sh.C + sh.C / 2)] = std::numeric_limits<float>::quiet_NaN();
          Input in = make_input(dt, sh.R, sh.C, sh.ld, &vals);
          // The maxima as a producer takes them: of the stored values.
          std::vector<uint32_t> mx(static_cast<size_t>(sh.R + sh.C), 0);
          for (int64_t r = 0; r < sh.R; ++r)
            for (int64_t c = 0; c < sh.C; ++c) {
              const uint32_t b = bits(load_as_float(in.host.data(), dt, static_cast<size_t>(r * sh.ld + c))) & 0x7fffffffu;
              mx[r] = std::max(mx[r], b);
              mx[sh.R + c] = std::max(mx[sh.R + c], b);
            }
          TensorView maxima = make(DType::F32, {sh.R + sh.C});
          CUDA_CHECK(cudaMemcpy(maxima.data, mx.data(), mx.size() * 4, cudaMemcpyHostToDevice));
          const int64_t ns = sh.R, nst = sh.C;
          const GroupedRef rowref = reference_grouped(in, Fp8Granularity::Row, fp8);
          const std::vector<uint8_t>&ro = rowref.out, &rt = rowref.out_t;
          const std::vector<float>&rs = rowref.scale_inv, &rst = rowref.scale_inv_t;
          TensorView out = make(fp8, {sh.R, sh.C}), out_t = make(fp8, {sh.C, sh.R});
          TensorView sc = make(DType::F32, {ns}), sct = make(DType::F32, {nst});
          for (const bool with_out : {true, false}) {
            QuantizeFp8Args a;
            a.inp = in.dev;
            a.granularity = Fp8Granularity::Row;
            if (with_out) a.out = out, a.scale_inv = sc;
            a.out_t = out_t, a.scale_inv_t = sct;
            a.maxima = maxima;
            a.ctx = ctx;
            for (const TensorView* t : {&out, &out_t, &sc, &sct}) poison(*t);
            ASSERT_EQ(quantize_fp8(a), BackendType::TURBO);
            if (with_out) {
              EXPECT_TRUE(bytes(out) == ro) << "out: " << first_diff(bytes(out), ro);
              const auto s = get(sc);
              for (int64_t k = 0; k < ns; ++k) ASSERT_EQ(bits(s[k]), bits(rs[k])) << "scale_inv[" << k << "]";
            }
            EXPECT_TRUE(bytes(out_t) == rt) << "out_t: " << first_diff(bytes(out_t), rt);
            const auto s = get(sct);
            for (int64_t k = 0; k < nst; ++k) ASSERT_EQ(bits(s[k]), bits(rst[k])) << "scale_inv_t[" << k << "]";
          }
          // Tensor granularity: the whole tensor's maximum, one f32.
          const Outputs ref = reference(in, fp8);
          uint32_t all = 0;
          for (int64_t r = 0; r < sh.R; ++r) all = std::max(all, mx[r]);
          TensorView tmax = make(DType::F32, {1}), ts = make(DType::F32, {1});
          CUDA_CHECK(cudaMemcpy(tmax.data, &all, 4, cudaMemcpyHostToDevice));
          for (int mode = 0; mode < 3; ++mode) {
            QuantizeFp8Args a;
            a.inp = in.dev;
            if (mode != 2) a.out = out;
            if (mode != 1) a.out_t = out_t;
            a.scale_inv = ts;
            a.maxima = tmax;
            a.ctx = ctx;
            for (const TensorView* t : {&out, &out_t, &ts}) poison(*t);
            ASSERT_EQ(quantize_fp8(a), BackendType::TURBO);
            if (mode != 2) EXPECT_TRUE(bytes(out) == ref.out) << "tensor out: " << first_diff(bytes(out), ref.out);
            if (mode != 1) EXPECT_TRUE(bytes(out_t) == ref.out_t) << "tensor out_t: " << first_diff(bytes(out_t), ref.out_t);
            EXPECT_EQ(bits(get(ts)[0]), bits(ref.scale_inv)) << "tensor scale_inv";
          }
        }
}

// Row scaling with out alone runs a one-launch kernel (a warp per row, the row held in registers
// up to 4096 bf16 / 2048 f32 elements, the rest of a longer row read twice): any row count, rows
// longer and shorter than the registers hold, a NaN row, against the CPU reference bit for bit.
TEST_F(QuantizeGpuTest, RowScalingOfOutAloneMatchesTheReferenceBitForBit) {
  struct Shape { int64_t R, C, ld; };
  for (const Shape sh : {Shape{37, 8208, 8208}, Shape{5, 16, 24}, Shape{301, 2064, 2064}, Shape{64, 4096, 4104}})
    for (const DType dt : {DType::BF16, DType::F32})
      for (const DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
        SCOPED_TRACE(fmt::format("[{}, {}] ld {} {} -> {}", sh.R, sh.C, sh.ld, dtype_name(dt), dtype_name(fp8)));
        std::vector<float> vals(static_cast<size_t>(sh.R * sh.C));
        std::normal_distribution<float> n(0.0f, 1.0f);
        std::uniform_real_distribution<float> e(-6.0f, 3.0f);
        for (auto& v : vals) v = n(rng_) * std::exp2(e(rng_));
        vals[static_cast<size_t>((sh.R / 2) * sh.C + sh.C - 1)] = std::numeric_limits<float>::quiet_NaN();
        Input in = make_input(dt, sh.R, sh.C, sh.ld, &vals);
        std::vector<uint8_t> ro(static_cast<size_t>(sh.R * sh.C));
        std::vector<float> rs(static_cast<size_t>(sh.R));
        QuantizeFp8Args ra;
        ra.inp = in.host_view();
        ra.granularity = Fp8Granularity::Row;
        ra.out = TensorView(ro.data(), fp8, Device::CPU, {sh.R, sh.C});
        ra.scale_inv = TensorView(rs.data(), DType::F32, Device::CPU, {sh.R});
        ASSERT_EQ(quantize_fp8(ra), BackendType::CPU);
        TensorView out = make(fp8, {sh.R, sh.C}), sc = make(DType::F32, {sh.R});
        poison(out), poison(sc);
        QuantizeFp8Args a;
        a.inp = in.dev;
        a.granularity = Fp8Granularity::Row;
        a.out = out, a.scale_inv = sc;
        a.ctx = ctx;
        ASSERT_EQ(quantize_fp8(a), BackendType::TURBO);
        EXPECT_TRUE(bytes(out) == ro) << "out: " << first_diff(bytes(out), ro);
        const auto s = get(sc);
        for (int64_t k = 0; k < sh.R; ++k) ASSERT_EQ(bits(s[k]), bits(rs[k])) << "scale_inv[" << k << "]";
        EXPECT_TRUE(std::isnan(s[sh.R / 2])) << "the NaN row's scale";
      }
}

// ---- row groups for out_t (offsets / group_rows) -----------------------------------------------

struct RowGroupOutputs {
  std::vector<uint8_t> out, out_t;
  std::vector<float> scale_inv, scale_inv_t;
};
constexpr uint8_t kOutTSentinel = 0xAB;  // out_t before a row-groups call: rows of no group keep it

class QuantizeRowGroupsGpu : public QuantizeGpuTest {
 protected:
  // Random cut points: G groups ending at R minus a tail of no group (when `tail`), one group
  // forced empty when G > 2; sizes otherwise anything (not multiples of 16).
  std::vector<int32_t> random_offsets(int64_t R, int G, bool tail) {
    const int64_t end = tail ? R - std::uniform_int_distribution<int64_t>(1, std::max<int64_t>(1, R / 8))(rng_) : R;
    std::uniform_int_distribution<int64_t> cut(0, end);
    std::vector<int32_t> o(static_cast<size_t>(G + 1));
    o[0] = 0;
    o[static_cast<size_t>(G)] = static_cast<int32_t>(end);
    for (int g = 1; g < G; ++g) o[static_cast<size_t>(g)] = static_cast<int32_t>(cut(rng_));
    std::sort(o.begin(), o.end());
    if (G > 2) o[2] = o[1];
    return o;
  }

  // The CPU backend on the host copy, out_t pre-filled with the sentinel.
  RowGroupOutputs reference(Input& in, DType fp8, const std::vector<int32_t>& offsets, int64_t group_rows) {
    const int64_t G = group_rows ? in.R / group_rows : static_cast<int64_t>(offsets.size()) - 1;
    RowGroupOutputs o;
    o.out.assign(static_cast<size_t>(in.R * in.C), 0);
    o.out_t.assign(o.out.size(), kOutTSentinel);
    o.scale_inv.assign(static_cast<size_t>(in.R), 0.0f);
    o.scale_inv_t.assign(static_cast<size_t>(G * in.C), 0.0f);
    std::vector<int32_t> off = offsets;
    QuantizeFp8Args a;
    a.inp = in.host_view();
    a.granularity = Fp8Granularity::Row;
    a.out = TensorView(o.out.data(), fp8, Device::CPU, {in.R, in.C});
    a.scale_inv = TensorView(o.scale_inv.data(), DType::F32, Device::CPU, {in.R});
    a.out_t = TensorView(o.out_t.data(), fp8, Device::CPU, {in.C, in.R});
    a.scale_inv_t = TensorView(o.scale_inv_t.data(), DType::F32, Device::CPU, {G, in.C});
    if (group_rows) a.group_rows = group_rows;
    else a.offsets = TensorView(off.data(), DType::I32, Device::CPU, {G + 1});
    EXPECT_EQ(quantize_fp8(a), BackendType::CPU);
    return o;
  }

  // The args of a device call writing into out_ / out_t_ / sc_ / sct_ (allocated by alloc_groups).
  QuantizeFp8Args device_args(const Input& in, DType fp8, const TensorView& offsets, int64_t group_rows,
                              bool with_out) {
    QuantizeFp8Args a;
    a.inp = in.dev;
    a.granularity = Fp8Granularity::Row;
    a.out_t = out_t_;
    a.out_t.dtype = fp8;
    a.scale_inv_t = sct_;
    if (with_out) {
      a.out = out_;
      a.out.dtype = fp8;
      a.scale_inv = sc_;
    }
    a.offsets = offsets;
    a.group_rows = group_rows;
    a.ctx = ctx;
    return a;
  }
  void alloc_groups(int64_t R, int64_t C, int64_t G) {
    out_ = make(DType::F8E4M3, {R, C});
    out_t_ = make(DType::F8E4M3, {C, R});
    sc_ = make(DType::F32, {R});
    sct_ = make(DType::F32, {G, C});
  }
  void prefill() {
    poison(out_);
    CUDA_CHECK(cudaMemset(out_t_.data, kOutTSentinel, out_t_.nbytes()));
    poison(sc_);
    poison(sct_);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  RowGroupOutputs fetch(bool with_out) {
    RowGroupOutputs o;
    o.out_t = bytes(out_t_);
    o.scale_inv_t = get(sct_);
    if (with_out) {
      o.out = bytes(out_);
      o.scale_inv = get(sc_);
    }
    return o;
  }
  void expect_equal(const RowGroupOutputs& got, const RowGroupOutputs& ref, bool with_out) {
    EXPECT_TRUE(got.out_t == ref.out_t) << "out_t: " << first_diff(got.out_t, ref.out_t);
    ASSERT_EQ(got.scale_inv_t.size(), ref.scale_inv_t.size());
    for (size_t k = 0; k < ref.scale_inv_t.size(); ++k)
      ASSERT_EQ(bits(got.scale_inv_t[k]), bits(ref.scale_inv_t[k]))
          << "scale_inv_t[" << k << "] " << got.scale_inv_t[k] << " vs " << ref.scale_inv_t[k];
    if (!with_out) return;
    EXPECT_TRUE(got.out == ref.out) << "out: " << first_diff(got.out, ref.out);
    for (size_t k = 0; k < ref.scale_inv.size(); ++k)
      ASSERT_EQ(bits(got.scale_inv[k]), bits(ref.scale_inv[k]))
          << "scale_inv[" << k << "] " << got.scale_inv[k] << " vs " << ref.scale_inv[k];
  }

  TensorView out_, out_t_, sc_, sct_;
};

// Fresh random inputs, random plans (empty groups, groups of any size, many groups smaller than
// a tile, a tail of rows in no group), both ways of giving the groups, with and without out,
// f32 and bf16, both FP8 formats, the 16-byte path and the element-wise one (ragged shapes,
// strided rows), a NaN in one case: bytes and scales bit for bit as the CPU reference, out_t's
// rows of no group untouched, and a second run identical.
TEST_F(QuantizeRowGroupsGpu, MatchTheReferenceBitForBit) {
  struct Case {
    int64_t R, C, ld;
    int G;              // random offsets with G groups (group_rows == 0)
    int64_t group_rows;  // > 0: equal groups
    bool tail, nan;
  };
  const std::vector<Case> cases = {
      {1024, 256, 256, 7, 0, true, false},     // 16-byte path, groups across tiles
      {1024, 384, 392, 64, 0, true, false},    // ~16 rows a group: many groups a tile; strided rows
      {512, 128, 128, 300, 0, false, false},   // more groups than rows of a tile can hold
      {2048, 512, 512, 0, 256, false, false},  // group_rows
      {96, 48, 48, 0, 16, false, true},        // group_rows, a NaN
      {1000, 200, 200, 9, 0, true, false},     // R % 16 != 0: element-wise path
      {37, 100, 103, 4, 0, true, true},        // ragged, strided, a NaN
      {90, 30, 30, 0, 9, false, false},        // group_rows, element-wise path
      {512, 256, 256, 1, 0, true, false},      // one group and a tail
  };
  for (const Case& k : cases)
    for (const DType dt : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(fmt::format("[{}, {}] ld {} {} {}{}", k.R, k.C, k.ld, dtype_name(dt),
                               k.group_rows ? fmt::format("group_rows {}", k.group_rows) : fmt::format("G {}", k.G),
                               k.nan ? " with a NaN" : ""));
      std::vector<float> vals(static_cast<size_t>(k.R * k.C));
      std::normal_distribution<float> n(0.0f, 1.0f);
      std::uniform_real_distribution<float> e(-6.0f, 3.0f);
      for (auto& v : vals) v = n(rng_) * std::exp2(e(rng_));
      if (k.nan) vals[static_cast<size_t>((k.R / 2) * k.C + k.C / 3)] = std::numeric_limits<float>::quiet_NaN();
      Input in = make_input(dt, k.R, k.C, k.ld, &vals);
      const std::vector<int32_t> plan = k.group_rows ? std::vector<int32_t>{} : random_offsets(k.R, k.G, k.tail);
      const int64_t G = k.group_rows ? k.R / k.group_rows : k.G;
      TensorView off;
      if (!k.group_rows) {
        off = make(DType::I32, {G + 1});
        put_i32(off, plan);
      }
      alloc_groups(k.R, k.C, G);
      for (const DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
        const RowGroupOutputs ref = reference(in, fp8, plan, k.group_rows);
        for (const bool with_out : {true, false}) {
          SCOPED_TRACE(fmt::format("{} {}", dtype_name(fp8), with_out ? "out + out_t" : "out_t alone"));
          const QuantizeFp8Args a = device_args(in, fp8, off, k.group_rows, with_out);
          prefill();
          ASSERT_EQ(quantize_fp8(a), BackendType::TURBO);
          const RowGroupOutputs first = fetch(with_out);
          expect_equal(first, ref, with_out);
          if (!with_out) {
            EXPECT_EQ(bytes(out_), std::vector<uint8_t>(out_.nbytes(), 0xFF)) << "out written";
          }
          prefill();
          ASSERT_EQ(quantize_fp8(a), BackendType::TURBO);
          expect_equal(fetch(with_out), first, with_out);
        }
      }
    }
}

// The call captures into a CUDA graph (no host synchronisation, no allocation) and the replay reads
// the offsets as they are at replay: a new plan written into the same tensor gives that plan's
// result without a new capture.
TEST_F(QuantizeRowGroupsGpu, CaptureIntoACudaGraphAndFollowTheOffsets) {
  const int64_t R = 768, C = 512;
  const int G = 8;
  Input in = make_input(DType::BF16, R, C, C);
  TensorView off = make(DType::I32, {G + 1});
  const std::vector<std::vector<int32_t>> plans = {random_offsets(R, G, true), random_offsets(R, G, false),
                                                   {0, 0, 1, 17, 17, 300, 301, 640, 700}};
  alloc_groups(R, C, G);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  QuantizeFp8Args a = device_args(in, DType::F8E4M3, off, 0, true);
  a.ctx.stream = stream;
  put_i32(off, plans[0]);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EXPECT_EQ(quantize_fp8(a), BackendType::TURBO);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (const auto& plan : plans) {
    SCOPED_TRACE(::testing::PrintToString(plan));
    put_i32(off, plan);
    prefill();
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_equal(fetch(true), reference(in, DType::F8E4M3, plan, 0), true);
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Offsets that break the contract (decreasing, negative, past R, huge) give unspecified bytes but
// never write outside out_t / scale_inv_t: the guard bytes after both stay as they were, and the
// device reports no error.
TEST_F(QuantizeRowGroupsGpu, BadDeviceOffsetsStayInsideTheTensors) {
  const int64_t R = 256, C = 128, kGuard = 4096;
  const int G = 5;
  Input in = make_input(DType::BF16, R, C, C);
  TensorView off = make(DType::I32, {G + 1});
  TensorView out_t = make(DType::F8E4M3, {C * R + kGuard}), sct = make(DType::F32, {G * C + kGuard});
  for (const std::vector<int32_t>& plan : {std::vector<int32_t>{0, 300, 100, 50, -20, 256},
                                           std::vector<int32_t>{5, -1000, 1 << 30, 7, 256, 1},
                                           std::vector<int32_t>{-7, 0, 0, 0, 0, 1 << 30}}) {
    SCOPED_TRACE(::testing::PrintToString(plan));
    put_i32(off, plan);
    CUDA_CHECK(cudaMemset(out_t.data, 0xAB, out_t.nbytes()));
    CUDA_CHECK(cudaMemset(sct.data, 0xAB, sct.nbytes()));
    QuantizeFp8Args a;
    a.inp = in.dev;
    a.granularity = Fp8Granularity::Row;
    a.out_t = TensorView(out_t.data, DType::F8E4M3, Device::CUDA, {C, R});
    a.scale_inv_t = TensorView(sct.data, DType::F32, Device::CUDA, {G, C});
    a.offsets = off;
    a.ctx = ctx;
    ASSERT_EQ(quantize_fp8(a), BackendType::TURBO);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto ot = bytes(out_t), st = bytes(sct);
    for (int64_t i = C * R; i < C * R + kGuard; ++i) ASSERT_EQ(ot[static_cast<size_t>(i)], 0xAB) << "out_t guard " << i;
    for (size_t i = static_cast<size_t>(G * C) * 4; i < st.size(); ++i) ASSERT_EQ(st[i], 0xAB) << "scale guard " << i;
  }
}

// Delayed scaling on the device against the CPU reference, bit for bit: the bytes of out and
// out_t, scale_inv = 1 / the given scale, and the amax folded into an entry that already holds
// a value (kept when larger), on the tile path (aligned shapes) and the element-wise one (a
// ragged pitch), f32 and bf16 inputs, both formats; planted inf / NaN elements are poisoned one
// by one. Current scaling with an amax entry records the same amax as the reference.
TEST_F(QuantizeGpuTest, DelayedScalingMatchesTheReferenceBitForBit) {
  struct Case {
    int64_t R, C, ld;
    DType in;
    bool bad;
  };
  for (const Case k : {Case{256, 384, 384, DType::BF16, false}, Case{256, 384, 384, DType::BF16, true},
                       Case{128, 256, 256, DType::F32, true}, Case{37, 100, 103, DType::BF16, true},
                       Case{64, 48, 48, DType::F32, false}}) {
    SCOPED_TRACE(fmt::format("[{}, {}] ld {} {}{}", k.R, k.C, k.ld, dtype_name(k.in), k.bad ? " with inf/NaN" : ""));
    Input in = make_input(k.in, k.R, k.C, k.ld);
    if (k.bad) {  // one inf, one -inf, one NaN in the data (not the row gaps)
      const float planted[3] = {INFINITY, -INFINITY, NAN};
      for (int i = 0; i < 3; ++i) {
        const int64_t r = (i * 7 + 3) % k.R, c = (i * 13 + 5) % k.C;
        store_from_float(in.host.data(), k.in, static_cast<size_t>(r * k.ld + c), planted[i]);
      }
      CUDA_CHECK(cudaMemcpy(in.dev.data, in.host.data(), in.host.size(), cudaMemcpyHostToDevice));
    }
    alloc_outputs(k.R, k.C);
    TensorView scale = make(DType::F32, {1}), amax = make(DType::F32, {1});
    for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
      for (const bool delayed : {true, false}) {
        SCOPED_TRACE(fmt::format("{} {}", dtype_name(fp8), delayed ? "delayed" : "current"));
        if (!delayed && k.bad) continue;  // current scaling poisons the whole tensor: covered above
        float s_host = delayed ? 37.5f : 0.0f, amax_ref = 0.125f, inv_ref = 0;
        std::vector<uint8_t> ro(static_cast<size_t>(k.R * k.C)), rt(ro.size());
        QuantizeFp8Args r;
        r.inp = in.host_view();
        r.out = TensorView(ro.data(), fp8, Device::CPU, {k.R, k.C});
        r.out_t = TensorView(rt.data(), fp8, Device::CPU, {k.C, k.R});
        r.scale_inv = TensorView(&inv_ref, DType::F32, Device::CPU, {1});
        if (delayed) r.scale = TensorView(&s_host, DType::F32, Device::CPU, {1});
        r.amax = TensorView(&amax_ref, DType::F32, Device::CPU, {1});
        ASSERT_EQ(quantize_fp8(r), BackendType::CPU);
        put(scale, {s_host});
        put(amax, {0.125f});
        QuantizeFp8Args a;
        a.inp = in.dev;
        a.out = out_;
        a.out_t = out_t_;
        a.out.dtype = a.out_t.dtype = fp8;
        a.scale_inv = scale_inv_;
        if (delayed) a.scale = scale;
        a.amax = amax;
        a.ctx = ctx;
        poison(a.out);
        poison(a.out_t);
        CUDA_CHECK(cudaDeviceSynchronize());
        ASSERT_EQ(quantize_fp8(a), BackendType::TURBO);
        EXPECT_TRUE(bytes(a.out) == ro) << "out: " << first_diff(bytes(a.out), ro);
        EXPECT_TRUE(bytes(a.out_t) == rt) << "out_t: " << first_diff(bytes(a.out_t), rt);
        EXPECT_EQ(bits(get(scale_inv_)[0]), bits(inv_ref));
        EXPECT_EQ(bits(get(amax)[0]), bits(amax_ref)) << get(amax)[0] << " vs " << amax_ref;
        if (k.bad) {
          size_t poisoned = 0;
          for (uint8_t b : ro) poisoned += b == 0x7f || b == 0xff;
          EXPECT_LT(poisoned, ro.size() / 2) << "only the non-finite elements are poisoned";
        }
      }
    }
  }
}

// The history bookkeeping on the device against the CPU reference, bit for bit: random amaxes
// over several magnitudes, rows with nothing recorded, inf and NaN newest entries, both ways of
// taking the amax, margins 0 and 3, history lengths 1, 5 and 1024.
TEST_F(QuantizeGpuTest, DelayedUpdateMatchesTheReferenceBitForBit) {
  std::uniform_real_distribution<float> e(-20.0f, 20.0f);
  for (const int64_t len : {int64_t{1}, int64_t{5}, int64_t{1024}})
    for (const bool use_max : {false, true})
      for (const int margin : {0, 3}) {
        SCOPED_TRACE(fmt::format("len {} {} margin {}", len, use_max ? "max" : "most_recent", margin));
        const int64_t T = 37;
        std::vector<float> h(static_cast<size_t>(T * len)), sc(static_cast<size_t>(T)), fm(static_cast<size_t>(T));
        for (auto& v : h) v = std::exp2(e(rng_));
        for (int64_t t = 0; t < T; ++t) {
          sc[t] = 1.0f + static_cast<float>(t);
          fm[t] = t % 3 == 2 ? 57344.0f : 448.0f;
        }
        for (int64_t i = 0; i < len; ++i) h[static_cast<size_t>(4 * len + i)] = 0.0f;  // nothing recorded
        h[static_cast<size_t>(5 * len)] = INFINITY;
        h[static_cast<size_t>(6 * len)] = NAN;
        h[static_cast<size_t>(7 * len)] = 1e-40f;  // the quotient overflows: FLT_MAX
        TensorView dh = make(DType::F32, {T, len}), ds = make(DType::F32, {T}), dm = make(DType::F32, {T});
        put(dh, h);
        put(ds, sc);
        put(dm, fm);
        Fp8DelayedUpdateArgs a{dh, ds, dm, use_max ? Fp8AmaxAlgo::Max : Fp8AmaxAlgo::MostRecent, margin, ctx};
        ASSERT_EQ(fp8_delayed_update(a), BackendType::TURBO);
        Fp8DelayedUpdateArgs r{TensorView(h.data(), DType::F32, Device::CPU, {T, len}),
                               TensorView(sc.data(), DType::F32, Device::CPU, {T}),
                               TensorView(fm.data(), DType::F32, Device::CPU, {T}), a.algo, margin, {}};
        ASSERT_EQ(fp8_delayed_update(r), BackendType::CPU);
        const auto gh = get(dh), gs = get(ds);
        for (int64_t t = 0; t < T; ++t) ASSERT_EQ(bits(gs[t]), bits(sc[t])) << "scale " << t;
        for (size_t i = 0; i < h.size(); ++i) ASSERT_EQ(bits(gh[i]), bits(h[i])) << "history entry " << i;
      }
}

}  // namespace
}  // namespace primus::turbo::testing

namespace primus::turbo::testing {
namespace {

// SwiGLU folded into the delayed quantizer (QuantizeFp8Args::prologue) against the activation
// kernel followed by the quantizer, on the device, bit for bit: the bytes of out and out_t,
// scale_inv, and the amax folded into an entry; forward (act from gate_up) and backward (dgate_up
// from dact and gate_up); tile-aligned and ragged shapes (R and F not multiples of 128), both
// FP8 formats, each choice of outputs; an inf and a NaN planted in gate_up are poisoned as the
// quantizer poisons them in the activation's output. Also which calls the folded kernel takes.
TEST_F(QuantizeGpuTest, SwigluPrologueEqualsTheActivationThenTheQuantizer) {
  struct Case {
    int64_t R, F;
    bool bad;
  };
  for (const Case k : {Case{256, 384, false}, Case{144, 208, false}, Case{16, 16, false}, Case{128, 256, true}}) {
    for (const bool backward : {false, true}) {
      SCOPED_TRACE(fmt::format("R {} F {} {}{}", k.R, k.F, backward ? "backward" : "forward", k.bad ? " with inf/NaN" : ""));
      ArenaScope tensors = scoped_tensors();
      const int64_t R = k.R, F = k.F, C = backward ? 2 * F : F;
      TensorView gate_up = make(DType::BF16, {R, 2 * F}), dact = make(DType::BF16, {R, F});
      std::vector<float> gu = randn(R * 2 * F, 2.0f, DType::BF16);
      if (k.bad) {
        gu[static_cast<size_t>(3 * 2 * F + 5)] = INFINITY;          // a gate
        gu[static_cast<size_t>(7 * 2 * F + F + 9)] = NAN;           // an up
      }
      put(gate_up, gu);
      random_tensor(dact, 0.5f);
      TensorView y = make(DType::BF16, {R, C});
      if (backward) {
        ActivationBackwardArgs b;
        b.act = Activation::SwiGLU;
        b.dinp = y;
        b.inp = gate_up;
        b.dout = dact;
        b.ctx = ctx;
        activation_backward(b);
      } else {
        activation_forward({Activation::SwiGLU, y, gate_up, ctx});
      }
      TensorView scale = make(DType::F32, {1}), amax = make(DType::F32, {1}), ref_amax = make(DType::F32, {1});
      TensorView ref_inv = make(DType::F32, {1}), inv = make(DType::F32, {1});
      TensorView ro = make(DType::F8E4M3, {R, C}), rt = make(DType::F8E4M3, {C, R});
      TensorView o = make(DType::F8E4M3, {R, C}), ot = make(DType::F8E4M3, {C, R});
      put(scale, {backward ? 3000.0f : 37.5f});
      for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
        for (const int mode : {0, 1, 2}) {  // both outputs, out only, out_t only
          SCOPED_TRACE(fmt::format("{} mode {}", dtype_name(fp8), mode));
          ro.dtype = rt.dtype = o.dtype = ot.dtype = fp8;
          QuantizeFp8Args r;
          r.inp = y;
          if (mode != 2) r.out = ro;
          if (mode != 1) r.out_t = rt;
          r.scale_inv = ref_inv;
          r.scale = scale;
          r.amax = ref_amax;
          r.ctx = ctx;
          QuantizeFp8Args a = r;
          a.prologue = backward ? QuantizePrologue::SwiGLUBackward : QuantizePrologue::SwiGLU;
          a.inp = backward ? dact : gate_up;
          if (backward) a.gate_up = gate_up;
          a.out = mode != 2 ? o : TensorView();
          a.out_t = mode != 1 ? ot : TensorView();
          a.scale_inv = inv;
          a.amax = amax;
          put(ref_amax, {0.125f});
          put(amax, {0.125f});
          for (const TensorView* t : {&ro, &rt, &o, &ot, &ref_inv, &inv}) poison(*t);
          ASSERT_TRUE(quantize_fp8_prologue_fits(a));
          ASSERT_EQ(quantize_fp8(r), BackendType::TURBO);
          ASSERT_EQ(quantize_fp8(a), BackendType::TURBO);
          if (mode != 2) EXPECT_TRUE(bytes(o) == bytes(ro)) << first_diff(bytes(o), bytes(ro));
          if (mode != 1) EXPECT_TRUE(bytes(ot) == bytes(rt)) << first_diff(bytes(ot), bytes(rt));
          EXPECT_EQ(bytes(inv), bytes(ref_inv));
          EXPECT_EQ(bytes(amax), bytes(ref_amax)) << get(amax)[0] << " vs " << get(ref_amax)[0];
          if (!k.bad) EXPECT_GT(get(amax)[0], 0.125f);  // the data's own maximum was recorded
        }
      }
    }
  }
}

TEST_F(QuantizeGpuTest, SwigluPrologueSaysWhichCallsTheFoldedKernelTakes) {
  TensorView gate_up = make(DType::BF16, {32, 48}), out = make(DType::F8E4M3, {32, 24});
  TensorView scale = make(DType::F32, {1}), inv = make(DType::F32, {1});
  QuantizeFp8Args a;
  a.prologue = QuantizePrologue::SwiGLU;
  a.inp = gate_up;  // F = 24: not a multiple of 16
  a.out = out;
  a.scale_inv = inv;
  a.scale = scale;
  a.ctx = ctx;
  EXPECT_FALSE(quantize_fp8_prologue_fits(a));
  try {
    quantize_fp8(a);
    ADD_FAILURE() << "F = 24 was accepted by the device";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("prologue swiglu"), std::string::npos) << e.what();
  }
  TensorView g2 = make(DType::BF16, {24, 64}), o2 = make(DType::F8E4M3, {24, 32}), ot2 = make(DType::F8E4M3, {32, 24});
  a.inp = g2;
  a.out = o2;
  EXPECT_TRUE(quantize_fp8_prologue_fits(a));  // R = 24 is fine without out_t
  a.out_t = ot2;
  EXPECT_FALSE(quantize_fp8_prologue_fits(a));  // ... not with it (16-row stores)
}

}  // namespace
}  // namespace primus::turbo::testing
