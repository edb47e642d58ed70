// grouped_gemm_fp8's dispatcher: TURBO (the FP8 form of Turbo's Hopper grouped GEMM) and CPU (the
// reference: dequantize the operands, then the f32 grouped GEMM). Contract in
// turbo/ops/grouped_gemm_fp8.h.
#include "turbo/ops/grouped_gemm_fp8.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "turbo/core/dtype.h"
#include "turbo/kernels/cpu/grouped_gemm.h"
#include "turbo/kernels/cpu/quantize.h"
#include "turbo/ops/cast.h"
#include "turbo/ops/fp8_delayed.h"
#include "turbo/ops/gemm_fp8.h"
#include "turbo/ops/op_support.h"
#include "turbo/ops/quantization.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "turbo/kernels/cuda/grouped_gemm_sm90.h"
#endif

namespace primus::turbo {
namespace gg_fp8 {
namespace {

enum class Kind { Forward, Dgrad, Wgrad };
const char* op_name(Kind k) {
  return k == Kind::Forward ? "grouped_gemm_fp8_forward" : k == Kind::Dgrad ? "grouped_gemm_fp8_dgrad" : "grouped_gemm_fp8_wgrad";
}

// One call as the backends see it: a (the token operand, with its scales sa) and b (the weight or
// its transposed copy, or x^T for the weight gradient, with sb) give y.
struct Call {
  Kind kind = Kind::Forward;
  TensorView y, a, sa, b, sb, offsets;
  int64_t G = 0, M = 0, N = 0, K = 0, align = 1;
  bool accumulate = false;
  bool block = false;  // blockwise scales (GroupedFp8Scaling::Block)
  ExecContext ctx;
  std::string key() const {
    return fmt::format("{} G={} M={} N={} K={} align={} acc={} {}x{} {} {}", op_name(kind), G, M, N, K, align, accumulate ? 1 : 0,
                       dtype_name(a.dtype), dtype_name(b.dtype), block ? "block" : "row", device_name(a.device));
  }
  Precision precision() const { return Precision::FP8; }
};

// Dimension d of a matrix argument (throws naming it when it is not a defined 2-D tensor).
int64_t matrix_dim(const TensorView& t, int d, const char* op, const char* arg) {
  check_defined(t, op, arg);
  if (t.ndim != 2) throw RuntimeError(fmt::format("{}: {} must be a matrix, got {}", op, arg, t.describe()));
  return t.shape[d];
}
// G, N, K of a [G, N, K] weight-shaped argument.
void weight_dims(const TensorView& t, const char* op, const char* arg, Call& c) {
  check_defined(t, op, arg);
  check_contiguous(t, op, arg);
  if (t.ndim != 3) throw RuntimeError(fmt::format("{}: {} must be [G, N, K], got {}", op, arg, t.describe()));
  c.G = t.shape[0], c.N = t.shape[1], c.K = t.shape[2];
  if (c.G < 1) throw RuntimeError(fmt::format("{}: {} has no groups: {}", op, arg, t.describe()));
}

void check_2d(const TensorView& t, int64_t rows, int64_t cols, const char* op, const char* arg) {
  check_defined(t, op, arg);
  check_contiguous(t, op, arg);
  if (t.ndim != 2 || t.shape[0] != rows || t.shape[1] != cols)
    throw RuntimeError(fmt::format("{}: {} must be [{}, {}], got {}", op, arg, rows, cols, t.describe()));
}
void check_vec(const TensorView& t, int64_t n, const char* op, const char* arg) {
  check_defined(t, op, arg);
  check_contiguous(t, op, arg);
  check_dtype(t, DType::F32, op, arg);
  if (t.numel() != n) throw RuntimeError(fmt::format("{}: {} must hold {} f32 scales, got {}", op, arg, n, t.describe()));
}
void check_fp8(const TensorView& t, bool e5m2_ok, const char* op, const char* arg) {
  if (t.dtype == DType::F8E4M3 || (e5m2_ok && t.dtype == DType::F8E5M2)) return;
  throw RuntimeError(fmt::format("{}: {} must be {}, got {}", op, arg, e5m2_ok ? "f8e4m3 or f8e5m2" : "f8e4m3",
                                 dtype_name(t.dtype)));
}
void check_offsets(const Call& c) {
  const char* op = op_name(c.kind);
  check_defined(c.offsets, op, "offsets");
  check_dtype(c.offsets, DType::I32, op, "offsets");
  check_contiguous(c.offsets, op, "offsets");
  if (c.offsets.ndim != 1 || c.offsets.shape[0] != c.G + 1)
    throw RuntimeError(fmt::format("{}: offsets must be [G+1] = [{}], got {}", op, c.G + 1, c.offsets.describe()));
  for (const TensorView* v : {&c.y, &c.a, &c.sa, &c.b, &c.sb})
    if (v->device != c.offsets.device)
      throw RuntimeError(fmt::format("{}: every tensor must be on one device: {} on {}, offsets on {}", op,
                                     v->describe(), device_name(v->device), device_name(c.offsets.device)));
  const DType out = c.kind == Kind::Wgrad || c.y.device == Device::CPU ? DType::F32 : DType::BF16;
  check_dtype(c.y, out, op, c.kind == Kind::Forward ? "out" : c.kind == Kind::Dgrad ? "dinp" : "dweight");
}

// The blockwise layouts need whole 128-blocks along N and K (and M for the weight gradient, whose
// token copies are cut into 128-token blocks).
void check_block_dims(const Call& c) {
  if (!c.block) return;
  const bool m = c.kind == Kind::Wgrad;
  if (c.N % kFp8BlockSize != 0 || c.K % kFp8BlockSize != 0 || (m && c.M % kFp8BlockSize != 0))
    throw RuntimeError(fmt::format("{}: blockwise scales need N={}, K={}{} to be multiples of {}", op_name(c.kind), c.N, c.K,
                                   m ? fmt::format(" and M={}", c.M) : std::string(), kFp8BlockSize));
}
// The number of scales of an operand: rowwise `row`, blockwise those of granularity g over [R, C].
int64_t scales(const Call& c, int64_t row, Fp8Granularity g, int64_t R, int64_t C) {
  return c.block ? fp8_scale_numel(g, R, C) : row;
}

// The FP8-operand calls take their scales as Row vectors or Block layouts; a per-tensor scale is
// given broadcast into Row vectors (the bf16-operand products do that).
bool block_scaling(GroupedFp8Scaling s, Kind k) {
  if (s == GroupedFp8Scaling::Tensor)
    throw RuntimeError(fmt::format("{}: scaling Tensor is for the bf16-operand products (grouped_gemm_*_fp8); give a "
                                   "per-tensor scale here as Row scale vectors holding it",
                                   op_name(k)));
  return s == GroupedFp8Scaling::Block;
}

// Host offsets checked against the contract; the error names the op and the first bad entry.
std::vector<int32_t> checked_offsets(const Call& c) {
  const int32_t* h = c.offsets.ptr<const int32_t>();
  std::vector<int32_t> o(h, h + c.G + 1);
  cpu::check_row_groups(o.data(), c.G, c.M, op_name(c.kind), "M");
  return o;
}

// ---- CPU -------------------------------------------------------------------------------------------
float decode(const TensorView& t, int64_t i) {
  const uint8_t b = t.ptr<const uint8_t>()[i];
  return t.dtype == DType::F8E4M3 ? f8e4m3_bits_to_float(b) : f8e5m2_bits_to_float(b);
}
std::string cpu_check(const Call& c) {
  return detail::all_on(Device::CPU, {{"y", &c.y}, {"a", &c.a}, {"sa", &c.sa}, {"b", &c.b}, {"sb", &c.sb}, {"offsets", &c.offsets}});
}
void cpu_run(const Call& c) {
  const std::vector<int32_t> o = checked_offsets(c);
  const int64_t G = c.G, M = c.M, N = c.N, K = c.K;
  const float* sa = c.sa.ptr<const float>();
  const float* sb = c.sb.ptr<const float>();
  using FG = Fp8Granularity;
  // The scale of element (r, col) of a token matrix [M, C]: its row's, or its 1x128 tile's.
  const auto tok = [&](int64_t C, int64_t r, int64_t col) {
    return c.block ? sa[fp8_scale_index(FG::Block1x128, M, C, r, col)] : sa[r];
  };
  switch (c.kind) {
    case Kind::Forward: {
      std::vector<float> x(static_cast<size_t>(M * K), 0.0f), w(static_cast<size_t>(G * N * K));
      for (int64_t r = 0; r < o[G]; ++r)
        for (int64_t k = 0; k < K; ++k) x[r * K + k] = decode(c.a, r * K + k) * tok(K, r, k);
      for (int64_t i = 0; i < G * N; ++i)
        for (int64_t k = 0; k < K; ++k)
          w[i * K + k] = decode(c.b, i * K + k) * (c.block ? sb[fp8_scale_index(FG::Block128x128, G * N, K, i, k)] : sb[i]);
      cpu::grouped_gemm_forward(c.y.ptr<float>(), x.data(), w.data(), o.data(), G, N, K);
      return;
    }
    case Kind::Dgrad: {  // W_g [N,K] from w_t [K][G*N]
      std::vector<float> d(static_cast<size_t>(M * N), 0.0f), w(static_cast<size_t>(G * N * K));
      for (int64_t r = 0; r < o[G]; ++r)
        for (int64_t n = 0; n < N; ++n) d[r * N + n] = decode(c.a, r * N + n) * tok(N, r, n);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < K; ++k)
            w[(g * N + n) * K + k] = decode(c.b, k * G * N + g * N + n) *
                                     (c.block ? sb[fp8_scale_index(FG::Block128x128, K, G * N, k, g * N + n)] : sb[g * K + k]);
      cpu::grouped_gemm_dgrad(c.y.ptr<float>(), d.data(), w.data(), o.data(), G, N, K);
      return;
    }
    case Kind::Wgrad: {  // dout_g and x_g from [N][M] and [K][M]: scales per group (rowwise) or per 128 tokens
      std::vector<float> d(static_cast<size_t>(M * N), 0.0f), x(static_cast<size_t>(M * K), 0.0f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = o[g]; r < o[g + 1]; ++r) {
          for (int64_t n = 0; n < N; ++n)
            d[r * N + n] = decode(c.a, n * M + r) * (c.block ? sa[fp8_scale_index(FG::Block1x128, N, M, n, r)] : sa[g * N + n]);
          for (int64_t k = 0; k < K; ++k)
            x[r * K + k] = decode(c.b, k * M + r) * (c.block ? sb[fp8_scale_index(FG::Block1x128, K, M, k, r)] : sb[g * K + k]);
        }
      cpu::grouped_gemm_wgrad(c.y.ptr<float>(), d.data(), x.data(), o.data(), G, N, K, c.accumulate);
      return;
    }
  }
}

#ifdef PRIMUS_TURBO_WITH_CUDA
// ---- TURBO -----------------------------------------------------------------------------------------
cuda::GroupedGemmFp8Sm90Problem sm90_problem(const Call& c) {
  cuda::GroupedGemmFp8Sm90Problem p;
  p.kind = c.kind == Kind::Forward ? cuda::GroupedGemmKind::Forward
           : c.kind == Kind::Dgrad ? cuda::GroupedGemmKind::Dgrad
                                   : cuda::GroupedGemmKind::Wgrad;
  p.groups = c.G, p.rows = c.M, p.n = c.N, p.k = c.K;
  p.offsets = c.offsets.ptr<const int32_t>();
  p.a = c.a.data;
  p.scale_a = c.sa.ptr<const float>();
  p.b = c.b.data;
  p.scale_b = c.sb.ptr<const float>();
  p.d = c.y.data;
  p.a_e5m2 = c.a.dtype == DType::F8E5M2;
  p.accumulate = c.accumulate;
  p.blockwise = c.block;
  return p;
}
std::string turbo_check(const Call& c) {
  if (auto w = detail::all_on(Device::CUDA, {{"y", &c.y}, {"a", &c.a}, {"sa", &c.sa}, {"b", &c.b}, {"sb", &c.sb}, {"offsets", &c.offsets}});
      !w.empty())
    return w;
  if (c.kind == Kind::Wgrad && c.align % 16 != 0)
    return fmt::format("align {}: the weight gradient's token boxes start on 16-byte boundaries (offsets multiples of 16)",
                       c.align);
  if (c.kind == Kind::Wgrad && c.block && c.align % kFp8BlockSize != 0)
    return fmt::format("align {}: blockwise, every k-tile of the weight gradient is one 128-token scale block of one "
                       "group (offsets multiples of 128)",
                       c.align);
  return cuda::grouped_gemm_fp8_sm90_unsupported_reason(sm90_problem(c));
}
void turbo_run(const Call& c) { cuda::grouped_gemm_fp8_sm90(sm90_problem(c), static_cast<cudaStream_t>(c.ctx.stream)); }
#endif

BackendType dispatch(const Call& c) {
  static auto* d = detail::make_turbo_cpu_dispatcher<Call>("grouped_gemm_fp8", PRIMUS_TURBO_FN(turbo_check),
                                                           PRIMUS_TURBO_FN(turbo_run), cpu_check, cpu_run);
  return d->dispatch(c);
}

}  // namespace
}  // namespace gg_fp8

using gg_fp8::Call;
using gg_fp8::Kind;

BackendType grouped_gemm_fp8_forward(const GroupedGemmFp8ForwardArgs& a) {
  Call c;
  c.kind = Kind::Forward;
  const char* op = gg_fp8::op_name(c.kind);
  gg_fp8::weight_dims(a.weight, op, "weight", c);
  c.M = gg_fp8::matrix_dim(a.inp, 0, op, "inp");
  gg_fp8::check_2d(a.inp, c.M, c.K, op, "inp");
  gg_fp8::check_2d(a.out, c.M, c.N, op, "out");
  gg_fp8::check_fp8(a.inp, false, op, "inp");
  gg_fp8::check_fp8(a.weight, false, op, "weight");
  c.block = gg_fp8::block_scaling(a.scaling, c.kind);
  gg_fp8::check_block_dims(c);
  gg_fp8::check_vec(a.inp_scale, gg_fp8::scales(c, c.M, Fp8Granularity::Block1x128, c.M, c.K), op, "inp_scale");
  gg_fp8::check_vec(a.weight_scale, gg_fp8::scales(c, c.G * c.N, Fp8Granularity::Block128x128, c.G * c.N, c.K), op,
                    "weight_scale");
  c.y = a.out, c.a = a.inp, c.sa = a.inp_scale, c.b = a.weight, c.sb = a.weight_scale, c.offsets = a.offsets;
  c.ctx = a.ctx;
  gg_fp8::check_offsets(c);
  return gg_fp8::dispatch(c);
}

BackendType grouped_gemm_fp8_dgrad(const GroupedGemmFp8DgradArgs& a) {
  Call c;
  c.kind = Kind::Dgrad;
  const char* op = gg_fp8::op_name(c.kind);
  check_defined(a.offsets, op, "offsets");
  c.G = a.offsets.ndim == 1 ? a.offsets.shape[0] - 1 : 0;
  if (c.G < 1) throw RuntimeError(fmt::format("{}: offsets must be [G+1] with G >= 1, got {}", op, a.offsets.describe()));
  c.M = gg_fp8::matrix_dim(a.dout, 0, op, "dout");
  c.N = gg_fp8::matrix_dim(a.dout, 1, op, "dout");
  c.K = gg_fp8::matrix_dim(a.dinp, 1, op, "dinp");
  gg_fp8::check_2d(a.dout, c.M, c.N, op, "dout");
  gg_fp8::check_2d(a.dinp, c.M, c.K, op, "dinp");
  gg_fp8::check_2d(a.weight_t, c.K, c.G * c.N, op, "weight_t");
  gg_fp8::check_fp8(a.dout, true, op, "dout");
  gg_fp8::check_fp8(a.weight_t, false, op, "weight_t");
  c.block = gg_fp8::block_scaling(a.scaling, c.kind);
  gg_fp8::check_block_dims(c);
  gg_fp8::check_vec(a.dout_scale, gg_fp8::scales(c, c.M, Fp8Granularity::Block1x128, c.M, c.N), op, "dout_scale");
  gg_fp8::check_vec(a.weight_t_scale, gg_fp8::scales(c, c.G * c.K, Fp8Granularity::Block128x128, c.K, c.G * c.N), op,
                    "weight_t_scale");
  c.y = a.dinp, c.a = a.dout, c.sa = a.dout_scale, c.b = a.weight_t, c.sb = a.weight_t_scale, c.offsets = a.offsets;
  c.ctx = a.ctx;
  gg_fp8::check_offsets(c);
  return gg_fp8::dispatch(c);
}

BackendType grouped_gemm_fp8_wgrad(const GroupedGemmFp8WgradArgs& a) {
  Call c;
  c.kind = Kind::Wgrad;
  const char* op = gg_fp8::op_name(c.kind);
  gg_fp8::weight_dims(a.dweight, op, "dweight", c);
  c.M = gg_fp8::matrix_dim(a.dout_t, 1, op, "dout_t");
  gg_fp8::check_2d(a.dout_t, c.N, c.M, op, "dout_t");
  gg_fp8::check_2d(a.inp_t, c.K, c.M, op, "inp_t");
  gg_fp8::check_fp8(a.dout_t, true, op, "dout_t");
  gg_fp8::check_fp8(a.inp_t, false, op, "inp_t");
  c.block = gg_fp8::block_scaling(a.scaling, c.kind);
  gg_fp8::check_block_dims(c);
  gg_fp8::check_vec(a.dout_t_scale, gg_fp8::scales(c, c.G * c.N, Fp8Granularity::Block1x128, c.N, c.M), op, "dout_t_scale");
  gg_fp8::check_vec(a.inp_t_scale, gg_fp8::scales(c, c.G * c.K, Fp8Granularity::Block1x128, c.K, c.M), op, "inp_t_scale");
  c.y = a.dweight, c.a = a.dout_t, c.sa = a.dout_t_scale, c.b = a.inp_t, c.sb = a.inp_t_scale, c.offsets = a.offsets;
  c.accumulate = a.accumulate;
  if (a.align < 1) throw RuntimeError(fmt::format("{}: align must be >= 1, got {}", op, a.align));
  c.align = a.align;
  c.ctx = a.ctx;
  gg_fp8::check_offsets(c);
  return gg_fp8::dispatch(c);
}

// ---- bf16 operands, quantized here ----------------------------------------------------------------

namespace gg_fp8 {
namespace {
size_t rnd(int64_t bytes) {
  return (static_cast<size_t>(bytes) + Arena::kDefaultAlign) / Arena::kDefaultAlign * Arena::kDefaultAlign;
}
// A quantized copy and its scales in the arena.
struct Q {
  TensorView q, s;
};
// Row-scaled [R, C] copy of t (C its last dimension; scales [R]).
Q rows_q(Arena& arena, const TensorView& t, DType dt, const ExecContext& ctx, const char* what) {
  const int64_t C = t.shape[t.ndim - 1], R = t.numel() / C;
  Q o{arena.tensor(dt, {R, C}, what), arena.tensor(DType::F32, {R}, what)};
  QuantizeFp8Args a;
  a.inp = t.reshape({R, C});
  a.out = o.q;
  a.scale_inv = o.s;
  a.granularity = Fp8Granularity::Row;
  a.ctx = ctx;
  quantize_fp8(a);
  return o;
}
// Transposed [C, R] copy of t [R, C] with one scale per column and group of rows ([G, C]): the
// groups of `offsets`, or `group_rows` rows each.
Q groups_t_q(Arena& arena, const TensorView& t, int64_t R, int64_t C, int64_t G, const TensorView& offsets,
             int64_t group_rows, DType dt, const ExecContext& ctx, const char* what) {
  Q o{arena.tensor(dt, {C, R}, what), arena.tensor(DType::F32, {G, C}, what)};
  QuantizeFp8Args a;
  a.inp = t.reshape({R, C});
  a.out_t = o.q;
  a.scale_inv_t = o.s;
  a.granularity = Fp8Granularity::Row;
  a.offsets = offsets;
  a.group_rows = group_rows;
  a.ctx = ctx;
  quantize_fp8(a);
  return o;
}
// A blockwise copy of t viewed as [R, C] at granularity g: out (scales fp8_scale_shape(g, R, C)),
// or with `transposed` out_t (the [C, R] copy, scales fp8_scale_shape(g, C, R)).
Q block_q(Arena& arena, const TensorView& t, int64_t R, int64_t C, Fp8Granularity g, bool transposed, DType dt,
          const ExecContext& ctx, const char* what) {
  Q o{transposed ? arena.tensor(dt, {C, R}, what) : arena.tensor(dt, {R, C}, what),
      arena.tensor(DType::F32, {fp8_scale_numel(g, transposed ? C : R, transposed ? R : C)}, what)};
  QuantizeFp8Args a;
  a.inp = t.reshape({R, C});
  (transposed ? a.out_t : a.out) = o.q;
  (transposed ? a.scale_inv_t : a.scale_inv) = o.s;
  a.granularity = g;
  a.ctx = ctx;
  quantize_fp8(a);
  return o;
}
// A token matrix t [M, C] quantized along C for a product: one scale per row, or per 1x128 tile.
Q tokens_q(Arena& arena, const TensorView& t, int64_t M, int64_t C, bool block, DType dt, const ExecContext& ctx,
           const char* what) {
  return block ? block_q(arena, t, M, C, Fp8Granularity::Block1x128, false, dt, ctx, what) : rows_q(arena, t, dt, ctx, what);
}
// Delayed scaling's views for one tensor (QuantizeFp8Args::scale and amax), empty without it.
using Delayed = Fp8DelayedScaling::Tensor;
Delayed delayed_of(const Fp8DelayedScaling* d, const TensorView& weight, Fp8DelayedScaling::Role role, const char* op) {
  return d ? d->quantizer_views(weight.data, role, op) : Delayed{};
}
void check_delayed(const Fp8DelayedScaling* d, GroupedFp8Scaling s, const char* op) {
  if (d && s != GroupedFp8Scaling::Tensor)
    throw RuntimeError(fmt::format("{}: delayed scaling keeps one scale per tensor: it needs scaling Tensor", op));
}

// A per-tensor copy of t viewed as [R, C] (out, or with `transposed` out_t [C, R]) whose one scale
// fills `n` entries: the scale vector of the Row product that runs it. used: i32 [1], the rows whose
// amax sets the scale (QuantizeFp8Args::rows_in_use), or undefined for all; dl: delayed scaling's
// scale and amax, or none.
Q tensor_q(Arena& arena, const TensorView& t, int64_t R, int64_t C, bool transposed, int64_t n, const TensorView& used,
           DType dt, const ExecContext& ctx, const char* what, const Delayed& dl = {}) {
  Q o{transposed ? arena.tensor(dt, {C, R}, what) : arena.tensor(dt, {R, C}, what), arena.tensor(DType::F32, {n}, what)};
  const TensorView one = arena.tensor(DType::F32, {1}, what);
  QuantizeFp8Args a;
  a.inp = t.reshape({R, C});
  (transposed ? a.out_t : a.out) = o.q;
  a.scale_inv = one;
  a.granularity = Fp8Granularity::Tensor;
  a.rows_in_use = used;
  a.scale = dl.scale;
  a.amax = dl.amax;
  a.ctx = ctx;
  quantize_fp8(a);
  broadcast(o.s, one, ctx);
  return o;
}
// offsets[G] of a row plan as an i32 [1] view (the rows in use).
TensorView rows_in_use(const TensorView& offsets, int64_t G) {
  return TensorView(static_cast<int32_t*>(offsets.data) + G, DType::I32, offsets.device, {1});
}

// The step's copies of weight [G, N, K] in `cache` (see grouped_gemm_forward_fp8): filled here when
// the slot is not valid; null when the cache is off or has no slot for it.
// With `transposed` (the input gradient's copy) null as well when the cache keeps no transposes.
const Fp8WeightCache::Slot* cached_copies(Fp8WeightCache* cache, Arena& arena, const TensorView& weight, DType dt,
                                          GroupedFp8Scaling sc, const ExecContext& ctx, const char* op,
                                          bool transposed = false, const Delayed& dl = {}) {
  if (!cache || !cache->enabled) return nullptr;
  if (transposed && !cache->keep_transpose) return nullptr;  // quantized again by the caller
  Fp8WeightCache::Slot* s = cache->find(weight.data);
  if (!s) return nullptr;
  if (s->valid) {
    ++cache->hits;
    return s;
  }
  const bool both = cache->keep_transpose;
  const int64_t G = weight.shape[0], N = weight.shape[1], K = weight.shape[2];
  const int64_t ns = grouped_fp8_weight_scales(sc, G, N, K), nst = grouped_fp8_weight_t_scales(sc, G, N, K);
  if (s->q.nbytes() < static_cast<size_t>(G * N * K) || s->scale.numel() < ns ||
      (both && (s->q_t.nbytes() < static_cast<size_t>(G * N * K) || s->scale_t.numel() < nst)))
    throw RuntimeError(fmt::format("{}: the FP8 weight cache's slot is too small for a [{}, {}, {}] expert weight", op, G,
                                   N, K));
  QuantizeFp8Args a;
  a.inp = weight.reshape({G * N, K});
  a.out = TensorView(s->q.data, dt, s->q.device, {G * N, K});
  a.scale_inv = TensorView(s->scale.data, DType::F32, s->scale.device, {ns});
  const TensorView qt = both ? TensorView(s->q_t.data, dt, s->q_t.device, {K, G * N}) : TensorView();
  const TensorView st = both ? TensorView(s->scale_t.data, DType::F32, s->scale_t.device, {nst}) : TensorView();
  a.ctx = ctx;
  if (sc == GroupedFp8Scaling::Block) {  // one pass: the 128 x 128 blocks serve both layouts
    a.out_t = qt, a.scale_inv_t = st, a.granularity = Fp8Granularity::Block128x128;
    quantize_fp8(a);
  } else if (sc == GroupedFp8Scaling::Tensor) {  // one pass, one scale for both layouts
    const TensorView one = arena.tensor(DType::F32, {1}, "fp8 expert weight scale");
    const TensorView row_scales = a.scale_inv;
    a.out_t = qt, a.scale_inv = one, a.granularity = Fp8Granularity::Tensor, a.scale = dl.scale, a.amax = dl.amax;
    quantize_fp8(a);
    broadcast(row_scales, one, ctx);
    if (both) broadcast(st, one, ctx);
  } else if (!both) {  // per (expert, output feature)
    a.granularity = Fp8Granularity::Row;
    quantize_fp8(a);
  } else {  // per (expert, output feature), then per (expert, input feature)
    a.granularity = Fp8Granularity::Row;
    quantize_fp8(a);
    QuantizeFp8Args t;
    t.inp = a.inp, t.out_t = qt, t.scale_inv_t = st, t.granularity = Fp8Granularity::Row, t.group_rows = N, t.ctx = ctx;
    quantize_fp8(t);
  }
  s->valid = true;
  ++cache->fills;
  return s;
}
// Slot s's copy of a [G, N, K] weight: q(W) [G*N, K] or, `transposed`, q(W)^T [K, G*N], with its scales.
Q slot_q(const Fp8WeightCache::Slot& s, bool transposed, DType dt, GroupedFp8Scaling sc, int64_t G, int64_t N, int64_t K) {
  const TensorView& q = transposed ? s.q_t : s.q;
  const TensorView& scale = transposed ? s.scale_t : s.scale;
  const int64_t n = transposed ? grouped_fp8_weight_t_scales(sc, G, N, K) : grouped_fp8_weight_scales(sc, G, N, K);
  const int64_t rows = transposed ? K : G * N, cols = transposed ? G * N : K;
  return {TensorView(q.data, dt, q.device, {rows, cols}), TensorView(scale.data, DType::F32, scale.device, {n})};
}
}  // namespace
}  // namespace gg_fp8

// Tensor scaling keeps Row's vectors (its one scale in every entry).
int64_t grouped_fp8_weight_scales(GroupedFp8Scaling s, int64_t G, int64_t N, int64_t K) {
  return s == GroupedFp8Scaling::Block ? fp8_scale_numel(Fp8Granularity::Block128x128, G * N, K) : G * N;
}
int64_t grouped_fp8_weight_t_scales(GroupedFp8Scaling s, int64_t G, int64_t N, int64_t K) {
  return s == GroupedFp8Scaling::Block ? fp8_scale_numel(Fp8Granularity::Block128x128, K, G * N) : G * K;
}

void grouped_gemm_forward_fp8(const GroupedGemmForwardArgs& a, DType fwd, GroupedFp8Scaling scaling,
                              Fp8WeightCache* weights, const Fp8DelayedScaling* delayed) {
  const char* op = "grouped_gemm_forward_fp8";
  gg_fp8::check_delayed(delayed, scaling, op);
  using R = Fp8DelayedScaling;
  if (a.swiglu_out.defined())
    throw RuntimeError(fmt::format("{}: the SwiGLU epilogue (swiglu_out) is the bf16 grouped GEMM's; run the activation "
                                   "after this product",
                                   op));
  Arena& arena = detail::scratch_of(a.ctx, op);
  ArenaScope scope(arena);
  const int64_t G = a.weight.shape[0], N = a.weight.shape[1], K = a.weight.shape[2], M = a.inp.shape[0];
  const bool block = scaling == GroupedFp8Scaling::Block, tensor = scaling == GroupedFp8Scaling::Tensor;
  const gg_fp8::Delayed dx = gg_fp8::delayed_of(delayed, a.weight, R::kInput, op),
                        dw = gg_fp8::delayed_of(delayed, a.weight, R::kWeight, op);
  const gg_fp8::Q x = tensor ? gg_fp8::tensor_q(arena, a.inp, M, K, false, M, gg_fp8::rows_in_use(a.offsets, G), fwd,
                                                a.ctx, "fp8 expert input", dx)
                             : gg_fp8::tokens_q(arena, a.inp, M, K, block, fwd, a.ctx, "fp8 expert input");
  gg_fp8::Q w;
  if (const Fp8WeightCache::Slot* s = gg_fp8::cached_copies(weights, arena, a.weight, fwd, scaling, a.ctx, op, false, dw)) {
    w = gg_fp8::slot_q(*s, false, fwd, scaling, G, N, K);
  } else if (tensor) {
    w = gg_fp8::tensor_q(arena, a.weight, G * N, K, false, G * N, {}, fwd, a.ctx, "fp8 expert weight", dw);
  } else {
    w = block ? gg_fp8::block_q(arena, a.weight, G * N, K, Fp8Granularity::Block128x128, false, fwd, a.ctx,
                                "fp8 expert weight")
              : gg_fp8::rows_q(arena, a.weight, fwd, a.ctx, "fp8 expert weight");
  }
  const GroupedFp8Scaling kernel = block ? GroupedFp8Scaling::Block : GroupedFp8Scaling::Row;
  grouped_gemm_fp8_forward({a.out, x.q, x.s, w.q.reshape({G, N, K}), w.s.reshape({w.s.numel()}), a.offsets, a.ctx, kernel});
}

void grouped_gemm_dgrad_fp8(const GroupedGemmDgradArgs& a, DType fwd, DType grad, GroupedFp8Scaling scaling,
                            Fp8WeightCache* weights, const Fp8DelayedScaling* delayed) {
  const char* op = "grouped_gemm_dgrad_fp8";
  gg_fp8::check_delayed(delayed, scaling, op);
  using R = Fp8DelayedScaling;
  if (a.swiglu_inp.defined())
    throw RuntimeError(fmt::format("{}: the SwiGLU epilogue (swiglu_inp) is the bf16 grouped GEMM's; run the activation's "
                                   "backward after this product",
                                   op));
  Arena& arena = detail::scratch_of(a.ctx, op);
  ArenaScope scope(arena);
  const int64_t G = a.weight.shape[0], N = a.weight.shape[1], K = a.weight.shape[2], M = a.dout.shape[0];
  const bool block = scaling == GroupedFp8Scaling::Block, tensor = scaling == GroupedFp8Scaling::Tensor;
  const gg_fp8::Delayed ddy = gg_fp8::delayed_of(delayed, a.weight, R::kGrad, op),
                        dw = gg_fp8::delayed_of(delayed, a.weight, R::kWeight, op);
  const gg_fp8::Q dy = tensor ? gg_fp8::tensor_q(arena, a.dout, M, N, false, M, gg_fp8::rows_in_use(a.offsets, G), grad,
                                                 a.ctx, "fp8 expert output gradient", ddy)
                              : gg_fp8::tokens_q(arena, a.dout, M, N, block, grad, a.ctx, "fp8 expert output gradient");
  gg_fp8::Q wt;
  if (const Fp8WeightCache::Slot* s = gg_fp8::cached_copies(weights, arena, a.weight, fwd, scaling, a.ctx, op, true, dw)) {
    wt = gg_fp8::slot_q(*s, true, fwd, scaling, G, N, K);
  } else if (tensor) {
    wt = gg_fp8::tensor_q(arena, a.weight, G * N, K, true, G * K, {}, fwd, a.ctx, "fp8 expert weight^T", dw);
  } else if (block) {  // W's 128 x 128 blocks are the same in its transposed copy
    wt = gg_fp8::block_q(arena, a.weight, G * N, K, Fp8Granularity::Block128x128, true, fwd, a.ctx, "fp8 expert weight^T");
  } else {  // W viewed as [G*N, K], groups of N rows: W^T [K][G*N] with a scale per (expert, input feature)
    wt = gg_fp8::groups_t_q(arena, a.weight, G * N, K, G, {}, N, fwd, a.ctx, "fp8 expert weight^T");
  }
  const GroupedFp8Scaling kernel = block ? GroupedFp8Scaling::Block : GroupedFp8Scaling::Row;
  grouped_gemm_fp8_dgrad({a.dinp, dy.q, dy.s, wt.q, wt.s.reshape({wt.s.numel()}), a.offsets, a.ctx, kernel});
}

void grouped_gemm_wgrad_fp8(const GroupedGemmWgradArgs& a, DType fwd, DType grad, GroupedFp8Scaling scaling,
                            const Fp8DelayedScaling* delayed) {
  const char* op = "grouped_gemm_wgrad_fp8";
  gg_fp8::check_delayed(delayed, scaling, op);
  if (delayed && !a.weight.defined())
    throw RuntimeError(fmt::format("{}: delayed scaling finds the histories by the weight: args.weight is not set", op));
  Arena& arena = detail::scratch_of(a.ctx, op);
  ArenaScope scope(arena);
  const int64_t G = a.dweight.shape[0], N = a.dweight.shape[1], K = a.dweight.shape[2], M = a.dout.shape[0];
  if (scaling == GroupedFp8Scaling::Block) {  // 128-token blocks of the copies (offsets multiples of 128)
    const gg_fp8::Q dyt = gg_fp8::block_q(arena, a.dout, M, N, Fp8Granularity::Block1x128, true, grad, a.ctx,
                                          "fp8 expert output gradient^T");
    const gg_fp8::Q xt = gg_fp8::block_q(arena, a.inp, M, K, Fp8Granularity::Block1x128, true, fwd, a.ctx, "fp8 expert input^T");
    grouped_gemm_fp8_wgrad({a.dweight, dyt.q, dyt.s, xt.q, xt.s, a.offsets, a.align, a.accumulate, a.ctx, scaling});
    return;
  }
  if (scaling == GroupedFp8Scaling::Tensor) {  // the tensors' scales, over the plan's rows
    const TensorView used = gg_fp8::rows_in_use(a.offsets, G);
    const gg_fp8::Q dyt =
        gg_fp8::tensor_q(arena, a.dout, M, N, true, G * N, used, grad, a.ctx, "fp8 expert output gradient^T",
                         gg_fp8::delayed_of(delayed, a.weight, Fp8DelayedScaling::kGrad, op));
    const gg_fp8::Q xt = gg_fp8::tensor_q(arena, a.inp, M, K, true, G * K, used, fwd, a.ctx, "fp8 expert input^T",
                                          gg_fp8::delayed_of(delayed, a.weight, Fp8DelayedScaling::kInput, op));
    grouped_gemm_fp8_wgrad({a.dweight, dyt.q, dyt.s, xt.q, xt.s, a.offsets, a.align, a.accumulate, a.ctx});
    return;
  }
  const gg_fp8::Q dyt = gg_fp8::groups_t_q(arena, a.dout, M, N, G, a.offsets, 0, grad, a.ctx, "fp8 expert output gradient^T");
  const gg_fp8::Q xt = gg_fp8::groups_t_q(arena, a.inp, M, K, G, a.offsets, 0, fwd, a.ctx, "fp8 expert input^T");
  grouped_gemm_fp8_wgrad({a.dweight, dyt.q, dyt.s, xt.q, xt.s, a.offsets, a.align, a.accumulate, a.ctx});
}

size_t grouped_gemm_fp8_scratch_bytes(int64_t M, int64_t G, int64_t N, int64_t K) {
  using gg_fp8::rnd;
  const int64_t C = std::max(N, K);
  // Two copies at most are alive: a token matrix [M, N or K] (or its transpose) and the weight
  // (or a second token matrix), each with f32 scales (rowwise: per row or per group and feature;
  // blockwise: per 1x128 tile or 128 x 128 block); plus the quantizer's row / group maxima.
  const int64_t wblocks = std::max(G * N / 128 * fp8_pad4(K / 128), K / 128 * fp8_pad4(G * N / 128));
  const size_t tokens = rnd(M * C) + rnd(4 * std::max({M, G * C, M / 128 * C + C / 128 * M}));
  const size_t second = std::max(rnd(G * N * K) + rnd(4 * std::max(G * C, wblocks)), tokens);
  const size_t quantizer = rnd(4 * (G * C + M + C)) + (size_t{64} << 10);
  return tokens + second + quantizer + 8 * Arena::kDefaultAlign;
}

}  // namespace primus::turbo
