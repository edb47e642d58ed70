// FP8 linear layers over turbo::quantize_fp8 and turbo::gemm's FP8 operands.
#include "turbo/ops/gemm_fp8.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/util/error.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/fp8_delayed.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/op_support.h"
#include "turbo/ops/quantization.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "turbo/core/cuda_check.h"
#endif

namespace primus::turbo {
namespace {

constexpr size_t kQuantizerBytes = size_t{64} << 10;  // scale + the amax partials, generously

struct Quantized {
  TensorView q;      // as stored (row-major)
  TensorView scale;  // f32 dequantization factors (fp8_scale_shape of q's shape at g)
  Fp8Granularity g = Fp8Granularity::Tensor;
};

TensorView scale_tensor(Arena& arena, Fp8Granularity g, int64_t rows, int64_t cols, const char* what) {
  return arena.tensor(DType::F32, {fp8_scale_numel(g, rows, cols)}, what);
}

// Delayed scaling: the scale to quantize a tensor with (none until a step has been recorded) and
// the amax entry to record into (none for an evaluation forward); both undefined under current
// scaling.
struct Delayed {
  TensorView scale, amax;
};
Delayed delayed_of(const Fp8Recipe& r, const TensorView& weight, Fp8DelayedScaling::Role role, const char* op) {
  if (r.scaling != Fp8Scaling::Delayed) return {};
  if (!r.delayed)
    throw RuntimeError(fmt::format("{}: fp8_recipe delayed without its amax histories (Fp8Recipe::delayed is not set)", op));
  const Fp8DelayedScaling::Tensor t = r.delayed->quantizer_views(weight.data, role, op);
  return {t.scale, t.amax};
}

// The part of a producer's maxima [R + C + 1] (Fp8Maxima) a quantization at g reads: Row the row
// and column maxima where it writes the column-scaled copy (the row-scaled one alone is one pass
// anyway), Tensor the whole tensor's; nothing otherwise.
TensorView maxima_for(const TensorView& maxima, Fp8Granularity g, bool column_copy) {
  if (!maxima.defined()) return {};
  const int64_t n = maxima.numel();
  if (g == Fp8Granularity::Row && column_copy) return maxima.slice0(0, n - 1);
  if (g == Fp8Granularity::Tensor) return maxima.slice0(n - 1, n);
  return {};
}

using Producer = std::optional<Fp8Producers::Entry>;

// Runs producer p's activation into t, the memory it names (Fp8Producers).
void write_producer(const TensorView& t, const Fp8Producers::Entry& p, const ExecContext& ctx) {
  run_quantize_prologue(p.kind, t, p.inp, p.gate_up, ctx);
}

// Quantizes a.inp = t, or with producer p (t not written) p's activation: folded into the
// quantizer where it takes it, else written into t first.
void quantize_from(QuantizeFp8Args a, const Producer& p, const Fp8Recipe& r) {
  if (p) {
    const TensorView t = a.inp;
    a.prologue = p->kind;
    a.inp = p->inp;
    a.gate_up = p->gate_up;
    if (a.scale.defined() && quantize_fp8_prologue_fits(a)) {
      ++r.producers->folded;
      quantize_fp8(a);
      return;
    }
    write_producer(t, *p, a.ctx);
    ++r.producers->written;
    a.prologue = QuantizePrologue::None;
    a.inp = t;
    a.gate_up = TensorView();
  }
  quantize_fp8(a);
}

// q(t) at granularity g into fresh scratch: row-major [R,C] (transposed = false) or the
// quantisation of t^T, [C,R].
Quantized quantize(Arena& arena, const TensorView& t, DType dt, bool transposed, Fp8Granularity g,
                   const ExecContext& ctx, const char* what, const Delayed& d = {}, const TensorView& maxima = {},
                   const Producer& producer = {}, const Fp8Recipe* r = nullptr) {
  const int64_t R = t.size(0), C = t.size(1);
  Quantized out;
  out.g = g;
  out.scale = transposed ? scale_tensor(arena, g, C, R, what) : scale_tensor(arena, g, R, C, what);
  out.q = transposed ? arena.tensor(dt, {C, R}, what) : arena.tensor(dt, {R, C}, what);
  QuantizeFp8Args a;
  a.inp = t;
  a.granularity = g;
  (transposed ? a.out_t : a.out) = out.q;
  (transposed && g != Fp8Granularity::Tensor ? a.scale_inv_t : a.scale_inv) = out.scale;
  a.scale = d.scale;
  a.amax = d.amax;
  a.maxima = maxima_for(maxima, g, transposed);
  a.ctx = ctx;
  if (producer) quantize_from(a, producer, *r);
  else quantize_fp8(a);
  return out;
}

// q(t) [R, C] into (q, scale) and q(t)^T [C, R] into (q_t, scale_t) from one read of t; at Tensor
// granularity `scale` serves both layouts.
void quantize_both(const TensorView& t, Fp8Granularity g, const TensorView& q, const TensorView& scale,
                   const TensorView& q_t, const TensorView& scale_t, const Delayed& d, const ExecContext& ctx,
                   const TensorView& maxima = {}, const Producer& producer = {}, const Fp8Recipe* r = nullptr) {
  QuantizeFp8Args a;
  a.inp = t;
  a.granularity = g;
  a.out = q;
  a.out_t = q_t;
  a.scale_inv = scale;
  if (g != Fp8Granularity::Tensor) a.scale_inv_t = scale_t;
  a.scale = d.scale;
  a.amax = d.amax;
  a.maxima = maxima_for(maxima, g, q_t.defined());
  a.ctx = ctx;
  if (producer) quantize_from(a, producer, *r);
  else quantize_fp8(a);
}

// The producer's maxima of t for this call (Fp8Maxima), or undefined. Each linear call looks up
// its tensors, then drops the entry (drop_maxima), used or not.
TensorView maxima_of(const Fp8Recipe& r, const TensorView& t) {
  if (!r.maxima || !r.takes_maxima()) return {};
  const TensorView m = r.maxima->find(t);
  if (m.defined()) ++r.maxima->uses;
  return m;
}
void drop_maxima(const Fp8Recipe& r) {
  if (r.maxima) r.maxima->clear();
  if (r.producers) r.producers->clear();
}
// The producer of t for this call (Fp8Producers; delayed scaling), copied: drop_maxima clears it.
Producer producer_of(const Fp8Recipe& r, const TensorView& t) {
  if (!r.producers || r.scaling != Fp8Scaling::Delayed || !t.defined()) return std::nullopt;
  const Fp8Producers::Entry* e = r.producers->find(t);
  if (!e) return std::nullopt;
  return *e;
}

// The saved q(x)^T of layer `weight` as the weight-gradient GEMM's operand ([C, N] with its
// scales), or nothing when the layer has no slot. Throws when the slot is too small for N.
std::optional<Quantized> saved_input(const Fp8Recipe& r, const TensorView& weight, int64_t N, int64_t C, DType dt,
                                     const char* op) {
  if (!r.saved) return std::nullopt;
  const Fp8SavedInputs::Slot* s = r.saved->find(weight.data);
  if (!s) return std::nullopt;
  const Fp8Granularity g = r.act_granularity();
  const int64_t scales = fp8_scale_numel(g, C, N);
  if (s->q_t.nbytes() < static_cast<size_t>(C * N) || s->scale.numel() < scales || s->scale.dtype != DType::F32)
    throw RuntimeError(fmt::format("{}: the saved-input slot ({} bytes, {} scales) is too small for a [{}, {}] input "
                                   "({} bytes, {} scales)",
                                   op, s->q_t.nbytes(), s->scale.numel(), N, C, C * N, scales));
  Quantized q;
  q.q = TensorView(s->q_t.data, dt, s->q_t.device, {C, N});
  q.scale = TensorView(s->scale.data, DType::F32, s->scale.device, {scales});
  q.g = g;
  return q;
}

// The step's cached q(w) (transposed = false, [OC, C]) or q(w)^T ([C, OC]) of layer `weight`:
// filled at the first use when the slot is not valid yet and `fill` is set (the forward), read
// as it is when valid; nothing when the layer has no slot, the cache is switched off, or the slot
// is empty and may not be filled here.
std::optional<Quantized> cached_weight(const Fp8Recipe& r, const TensorView& weight, bool transposed, bool fill,
                                       const ExecContext& ctx, const char* op) {
  if (!r.weights || !r.weights->enabled) return std::nullopt;
  if (transposed && !r.weights->keep_transpose) return std::nullopt;  // quantized again by the caller
  Fp8WeightCache::Slot* s = r.weights->find(weight.data);
  if (!s) return std::nullopt;
  const Fp8Granularity g = r.weight_granularity();
  const int64_t OC = weight.size(0), C = weight.size(1);
  if (!s->valid) {
    if (!fill) return std::nullopt;
    const bool both = r.weights->keep_transpose;
    if (s->q.nbytes() < static_cast<size_t>(OC * C) || s->scale.numel() < fp8_scale_numel(g, OC, C) ||
        (both && (s->q_t.nbytes() < static_cast<size_t>(OC * C) || s->scale_t.numel() < fp8_scale_numel(g, C, OC))))
      throw RuntimeError(fmt::format("{}: the FP8 weight cache's slot is too small for a [{}, {}] weight", op, OC, C));
    quantize_both(weight, g, TensorView(s->q.data, r.fwd, s->q.device, {OC, C}),
                  TensorView(s->scale.data, DType::F32, s->scale.device, {fp8_scale_numel(g, OC, C)}),
                  both ? TensorView(s->q_t.data, r.fwd, s->q_t.device, {C, OC}) : TensorView(),
                  both ? TensorView(s->scale_t.data, DType::F32, s->scale_t.device, {fp8_scale_numel(g, C, OC)})
                       : TensorView(),
                  delayed_of(r, weight, Fp8DelayedScaling::kWeight, op), ctx);
    s->valid = true;
    ++r.weights->fills;
  } else {
    ++r.weights->hits;
  }
  Quantized q;
  q.g = g;
  const TensorView& scale = transposed && g != Fp8Granularity::Tensor ? s->scale_t : s->scale;
  q.q = transposed ? TensorView(s->q_t.data, r.fwd, s->q_t.device, {C, OC}) : TensorView(s->q.data, r.fwd, s->q.device, {OC, C});
  q.scale = TensorView(scale.data, DType::F32, scale.device,
                       {transposed ? fp8_scale_numel(g, C, OC) : fp8_scale_numel(g, OC, C)});
  return q;
}

void check_matrix(const TensorView& t, const char* op, const char* name) {
  if (!t.defined() || t.ndim != 2 || t.stride(1) != 1 || t.stride(0) < t.size(1))
    throw RuntimeError(fmt::format("{}: {} must be a row-major matrix, got {}", op, name,
                                   t.defined() ? t.describe() : "none"));
}

// gemm(A = qa, B = qb_stored^T) into d, with the two scales.
void fp8_gemm(const Quantized& a, const Quantized& b_stored, const TensorView& d, float beta, bool fast_accum,
              GemmEpilogue epi, const TensorView& bias, const ExecContext& ctx) {
  GemmArgs g;
  g.a = a.q;
  g.b = b_stored.q.transposed();
  g.d = d;
  g.a_scale = a.scale;
  g.b_scale = b_stored.scale;
  g.a_scaling = a.g;
  g.b_scaling = b_stored.g;
  g.beta = beta;
  g.fp8_fast_accum = fast_accum;
  g.epilogue = epi;
  g.bias = bias;
  g.ctx = ctx;
  gemm(g);
}

void zero(const TensorView& t, const ExecContext& ctx) {
  if (t.device == Device::CPU) {
    std::memset(t.data, 0, t.nbytes());
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), static_cast<cudaStream_t>(ctx.stream)));
#else
  (void)ctx;
#endif
}

// dinp = q(dout) @ q(weight) with beta; the scratch is given back before returning.
void input_grad(const TensorView& dinp, float beta, const TensorView& dout, const TensorView& weight,
                const ExecContext& ctx, const Fp8Recipe& r, const char* op, const Producer& dout_producer = {}) {
  Arena& arena = detail::scratch_of(ctx, op);
  ArenaScope scope(arena);
  const Quantized dy = quantize(arena, dout, r.grad, false, r.act_granularity(), ctx, "fp8 dout",
                                delayed_of(r, weight, Fp8DelayedScaling::kGrad, op), {}, dout_producer, &r);
  const std::optional<Quantized> cached = cached_weight(r, weight, true, false, ctx, op);
  const Quantized wt = cached ? *cached
                              : quantize(arena, weight, r.fwd, true, r.weight_granularity(), ctx, "fp8 weight^T",
                                         delayed_of(r, weight, Fp8DelayedScaling::kWeight, op));  // [C,OC]
  fp8_gemm(dy, wt, dinp, beta, false, GemmEpilogue::None, {}, ctx);
}

}  // namespace

void Fp8SavedInputs::add(const void* weight, Slot slot) {
  if (!weight || !slot.q_t.defined() || !slot.scale.defined())
    throw RuntimeError("Fp8SavedInputs::add: a weight and both buffers are needed");
  if (!slots_.emplace(weight, slot).second) throw RuntimeError("Fp8SavedInputs::add: the weight already has a slot");
}

const Fp8SavedInputs::Slot* Fp8SavedInputs::find(const void* weight) const {
  const auto it = slots_.find(weight);
  return it == slots_.end() ? nullptr : &it->second;
}

void Fp8WeightCache::add(const void* weight, const Slot& slot) {
  if (!weight || !slot.q.defined() || !slot.scale.defined() ||
      (keep_transpose && (!slot.q_t.defined() || !slot.scale_t.defined())))
    throw RuntimeError(keep_transpose ? "Fp8WeightCache::add: a weight and all four buffers are needed"
                                      : "Fp8WeightCache::add: a weight, q and scale are needed");
  const auto [it, fresh] = slots_.emplace(weight, slot);
  if (!fresh) throw RuntimeError("Fp8WeightCache::add: the weight already has a slot");
  it->second.valid = false;
}

Fp8WeightCache::Slot* Fp8WeightCache::find(const void* weight) {
  const auto it = slots_.find(weight);
  return it == slots_.end() ? nullptr : &it->second;
}

Fp8Maxima::Fp8Maxima(Fp8Granularity g) : g_(g) {
  if (g != Fp8Granularity::Row && g != Fp8Granularity::Tensor)
    throw RuntimeError(fmt::format("Fp8Maxima: serves row or tensor granularity, not {}", fp8_granularity_name(g)));
}

void Fp8Maxima::put(const TensorView& t, const TensorView& maxima) {
  if (!t.defined() || t.ndim != 2 || !maxima.defined() || maxima.dtype != DType::F32 ||
      maxima.numel() != t.size(0) + t.size(1) + 1)
    throw RuntimeError(fmt::format("Fp8Maxima::put: expected f32 [rows + cols + 1] maxima of a matrix, got {} for {}",
                                   maxima.defined() ? maxima.describe() : "none", t.defined() ? t.describe() : "none"));
  key_ = Fp8HandoffKey::of(t);
  maxima_ = maxima;
  ++puts;
}

TensorView Fp8Maxima::find(const TensorView& t) const {
  if (!maxima_.defined() || !t.defined() || t.ndim != 2 || Fp8HandoffKey::of(t) != key_) return {};
  return maxima_;
}

Fp8HandoffKey Fp8HandoffKey::of(const TensorView& t) {
  return {t.data, t.size(0), t.size(1), t.size(0) > 1 ? t.stride(0) : t.size(1)};
}

void Fp8Producers::put(const TensorView& t, const Entry& e) {
  const bool fwd = e.kind == QuantizePrologue::SwiGLU, bwd = e.kind == QuantizePrologue::SwiGLUBackward;
  const bool ok = t.defined() && t.ndim == 2 && e.inp.defined() && e.inp.ndim == 2 && e.inp.size(0) == t.size(0) &&
                  ((fwd && !e.gate_up.defined() && e.inp.size(1) == 2 * t.size(1)) ||
                   (bwd && e.gate_up.defined() && e.inp.size(1) * 2 == t.size(1) && e.gate_up.ndim == 2 &&
                    e.gate_up.size(0) == t.size(0) && e.gate_up.size(1) == t.size(1)));
  if (!ok)
    throw RuntimeError(fmt::format("Fp8Producers::put: expected act [R, F] from gate_up [R, 2F] (swiglu) or dgate_up "
                                   "[R, 2F] from dact [R, F] and gate_up [R, 2F] (swiglu backward); got {} from {}{}",
                                   t.defined() ? t.describe() : "none", e.inp.defined() ? e.inp.describe() : "none",
                                   e.gate_up.defined() ? " and " + e.gate_up.describe() : std::string()));
  key_ = Fp8HandoffKey::of(t);
  entry_ = e;
  ++puts;
}

const Fp8Producers::Entry* Fp8Producers::find(const TensorView& t) const {
  if (entry_.kind == QuantizePrologue::None || !t.defined() || t.ndim != 2 || Fp8HandoffKey::of(t) != key_)
    return nullptr;
  return &entry_;
}

void Fp8WeightCache::invalidate() {
  for (auto& [w, s] : slots_) s.valid = false;
}

int64_t fp8_saved_scale_numel(const Fp8Recipe& r, int64_t N, int64_t C) {
  return fp8_scale_numel(r.act_granularity(), C, N);
}

const char* fp8_scaling_name(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::Tensorwise: return "tensorwise";
    case Fp8Scaling::Rowwise: return "rowwise";
    case Fp8Scaling::Blockwise: return "blockwise";
    case Fp8Scaling::Delayed: return "delayed";
  }
  return "?";
}

Fp8Granularity Fp8Recipe::act_granularity() const {
  switch (scaling) {
    case Fp8Scaling::Tensorwise:
    case Fp8Scaling::Delayed: return Fp8Granularity::Tensor;
    case Fp8Scaling::Rowwise: return Fp8Granularity::Row;
    case Fp8Scaling::Blockwise: return Fp8Granularity::Block1x128;
  }
  return Fp8Granularity::Tensor;
}
Fp8Granularity Fp8Recipe::weight_granularity() const {
  return scaling == Fp8Scaling::Blockwise ? Fp8Granularity::Block128x128 : act_granularity();
}

std::string Fp8Recipe::name() const {
  if (fwd == DType::F8E4M3 && grad == DType::F8E5M2) return "hybrid";
  if (fwd == DType::F8E4M3 && grad == DType::F8E4M3) return "e4m3";
  return "custom";
}

Fp8Recipe parse_fp8_recipe(const std::string& text, const std::string& where) {
  Fp8Recipe r;
  if (text == "hybrid") return r;
  if (text == "e4m3") {
    r.grad = DType::F8E4M3;
    return r;
  }
  throw ConfigError(fmt::format("{}: unknown FP8 recipe '{}' (expected hybrid or e4m3)", where, text));
}

Fp8Recipe parse_fp8_recipe(const std::string& format, const std::string& scaling, const std::string& where,
                           const std::string& scaling_key) {
  Fp8Recipe r = parse_fp8_recipe(format, where);
  if (scaling == "tensorwise") return r;
  if (scaling == "rowwise") {
    r.scaling = Fp8Scaling::Rowwise;
    return r;
  }
  if (scaling == "blockwise") {
    if (r.grad != DType::F8E4M3)
      throw ConfigError(fmt::format("{}: {} blockwise needs the e4m3 format (DeepSeek-V3's recipe: E4M3 everywhere, "
                                    "the 1x128 and 128x128 scales give gradients their range; cuBLASLt's block "
                                    "scales take E4M3 operands), not {}",
                                    where, scaling_key, format));
    r.scaling = Fp8Scaling::Blockwise;
    r.fast_accum_fwd = false;
    return r;
  }
  if (scaling == "delayed") {
    r.scaling = Fp8Scaling::Delayed;
    return r;
  }
  throw ConfigError(fmt::format("{}: {}: unknown FP8 scaling '{}' (expected tensorwise, rowwise, blockwise or delayed)",
                                where, scaling_key, scaling));
}

int64_t linear_fp8_multiple(const Fp8Recipe& r) { return r.scaling == Fp8Scaling::Blockwise ? kFp8BlockSize : 16; }

size_t linear_fp8_scratch_bytes(int64_t n, int64_t in_features, int64_t out_features) {
  const auto b = [](int64_t bytes) { return (size_t(bytes) + Arena::kDefaultAlign) / Arena::kDefaultAlign * Arena::kDefaultAlign; };
  // A quantized copy of an [R, C] matrix with its scales at any granularity: one f32 per row or
  // column (Row), per 128 elements (1x128), per block with padding (128x128), or one.
  const auto copy = [&](int64_t R, int64_t C) {
    return b(R * C) + b(4 * (std::max({R, C, R * C / kFp8BlockSize}) + 4 * (R / kFp8BlockSize + 1)));
  };
  const int64_t N = n, C = in_features, OC = out_features;
  // Forward: x, w. Backward with both gradients: dy^T, then dy and w^T (dgrad), then x^T in
  // their place (wgrad). One gradient only: dy + w^T, or dy^T + x^T.
  const size_t fwd = copy(N, C) + copy(OC, C), both = copy(OC, N) + std::max(copy(N, OC) + copy(C, OC), copy(C, N));
  // The quantizer's own scratch while a copy is made: the tensorwise amax partials, or the row
  // and column maxima of rowwise scaling.
  const size_t quantizer = std::max<size_t>(kQuantizerBytes, b(4 * (N + std::max(C, OC) + std::max(C, OC))));
  return std::max(fwd, both) + 2 * (quantizer + 2 * Arena::kDefaultAlign);
}

void linear_forward_fp8(const TensorView& out, const TensorView& inp, const TensorView& weight,
                        const TensorView& bias, const TensorView& aux, const ExecContext& ctx,
                        const Fp8Recipe& r) {
  constexpr const char* op = "linear_forward_fp8";
  check_matrix(out, op, "out");
  check_matrix(inp, op, "inp");
  check_matrix(weight, op, "weight");
  Arena& arena = detail::scratch_of(ctx, op);
  ArenaScope scope(arena);
  const int64_t N = inp.size(0), C = inp.size(1);
  const Fp8Granularity ga = r.act_granularity();
  const TensorView maxima = maxima_of(r, inp);
  const Producer producer = producer_of(r, inp);
  drop_maxima(r);
  Quantized x;
  if (const std::optional<Quantized> saved = saved_input(r, weight, N, C, r.fwd, op)) {
    // Both layouts in one pass: q(x) for this GEMM, q(x)^T kept for the weight gradient.
    x.g = ga;
    x.q = arena.tensor(r.fwd, {N, C}, "fp8 inp");
    x.scale = ga == Fp8Granularity::Tensor ? saved->scale : scale_tensor(arena, ga, N, C, "fp8 inp scale");
    quantize_both(inp, ga, x.q, x.scale, saved->q, saved->scale, delayed_of(r, weight, Fp8DelayedScaling::kInput, op),
                  ctx, maxima, producer, &r);
  } else {
    x = quantize(arena, inp, r.fwd, false, ga, ctx, "fp8 inp", delayed_of(r, weight, Fp8DelayedScaling::kInput, op),
                 maxima, producer, &r);
  }
  const std::optional<Quantized> cached = cached_weight(r, weight, false, true, ctx, op);
  const Quantized w = cached ? *cached
                             : quantize(arena, weight, r.fwd, false, r.weight_granularity(), ctx, "fp8 weight",
                                        delayed_of(r, weight, Fp8DelayedScaling::kWeight, op));
  const GemmEpilogue epi = bias.defined() ? GemmEpilogue::Bias : GemmEpilogue::None;
  if (!aux.defined()) {
    fp8_gemm(x, w, out, 0.0f, r.fast_accum_fwd, epi, bias, ctx);
    return;
  }
  // GELU: the pre-activation goes to aux, the activation is its own pass (cuBLASLt's GELU
  // epilogues are not offered here with FP8 operands).
  check_matrix(aux, op, "aux");
  fp8_gemm(x, w, aux, 0.0f, r.fast_accum_fwd, epi, bias, ctx);
  activation_forward({Activation::Gelu, out, aux, ctx});
}

void linear_backward_fp8(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                         const TensorView& dout, const TensorView& inp, const TensorView& weight,
                         bool accumulate_dinp, const ExecContext& ctx, const Fp8Recipe& r,
                         bool accumulate_dweight) {
  constexpr const char* op = "linear_backward_fp8";
  const float beta_w = accumulate_dweight ? 1.0f : 0.0f;  // gradients accumulate over micro-batches
  check_matrix(dout, op, "dout");
  check_matrix(weight, op, "weight");
  const TensorView dout_maxima = maxima_of(r, dout), inp_maxima = inp.defined() ? maxima_of(r, inp) : TensorView();
  Producer dout_producer = producer_of(r, dout);
  const Producer inp_producer = producer_of(r, inp);
  drop_maxima(r);
  if (dout_producer && dbias.defined()) {  // the bias gradient reads dout itself
    write_producer(dout, *dout_producer, ctx);
    ++r.producers->written;
    dout_producer.reset();
  }
  if (dinp.defined() && dweight.defined()) {
    // Both GEMMs read dout: quantize it once into both layouts (one amax pass, one read) instead
    // of twice. The transposed copy comes first in the arena so that the dgrad's operands can be
    // given back before x^T is taken.
    check_matrix(dinp, op, "dinp");
    check_matrix(inp, op, "inp");
    Arena& arena = detail::scratch_of(ctx, op);
    ArenaScope scope(arena);
    const int64_t N = dout.size(0), OC = dout.size(1);
    const Fp8Granularity ga = r.act_granularity();
    const bool tensor = ga == Fp8Granularity::Tensor;
    Quantized dyt{arena.tensor(r.grad, {OC, N}, "fp8 dout^T"), scale_tensor(arena, ga, OC, N, "fp8 dout^T scale"), ga};
    {
      ArenaScope dgrad_scope(arena);
      const Quantized dy{arena.tensor(r.grad, {N, OC}, "fp8 dout"),
                         tensor ? dyt.scale : scale_tensor(arena, ga, N, OC, "fp8 dout scale"), ga};
      quantize_both(dout, ga, dy.q, dy.scale, dyt.q, dyt.scale, delayed_of(r, weight, Fp8DelayedScaling::kGrad, op),
                    ctx, dout_maxima, dout_producer, &r);
      const std::optional<Quantized> cached = cached_weight(r, weight, true, false, ctx, op);
      const Quantized wt = cached ? *cached
                                  : quantize(arena, weight, r.fwd, true, r.weight_granularity(), ctx, "fp8 weight^T",
                                             delayed_of(r, weight, Fp8DelayedScaling::kWeight, op));  // [C,OC]
      fp8_gemm(dy, wt, dinp, accumulate_dinp ? 1.0f : 0.0f, false, GemmEpilogue::None, {}, ctx);
    }
    const std::optional<Quantized> saved = saved_input(r, weight, N, weight.size(1), r.fwd, op);
    const Quantized xt = saved ? *saved
                               : quantize(arena, inp, r.fwd, true, r.act_granularity(), ctx, "fp8 inp^T",
                                          delayed_of(r, weight, Fp8DelayedScaling::kInput, op), inp_maxima,
                                          inp_producer, &r);  // [C,N]
    fp8_gemm(dyt, xt, dweight, beta_w, false, GemmEpilogue::None, {}, ctx);
    if (dbias.defined()) bias_grad(dbias, dout, ctx);
    return;
  }
  if (dinp.defined()) {
    check_matrix(dinp, op, "dinp");
    input_grad(dinp, accumulate_dinp ? 1.0f : 0.0f, dout, weight, ctx, r, op, dout_producer);
  }
  if (dweight.defined()) {
    check_matrix(inp, op, "inp");
    Arena& arena = detail::scratch_of(ctx, op);
    ArenaScope scope(arena);
    const Quantized dyt = quantize(arena, dout, r.grad, true, r.act_granularity(), ctx, "fp8 dout^T",
                                   delayed_of(r, weight, Fp8DelayedScaling::kGrad, op), dout_maxima, dout_producer,
                                   &r);  // [OC,N]
    const std::optional<Quantized> saved = saved_input(r, weight, dout.size(0), weight.size(1), r.fwd, op);
    const Quantized xt = saved ? *saved
                               : quantize(arena, inp, r.fwd, true, r.act_granularity(), ctx, "fp8 inp^T",
                                          delayed_of(r, weight, Fp8DelayedScaling::kInput, op), inp_maxima,
                                          inp_producer, &r);  // [C,N]
    fp8_gemm(dyt, xt, dweight, beta_w, false, GemmEpilogue::None, {}, ctx);
  } else if (dbias.defined()) {
    throw RuntimeError("linear_backward_fp8: dbias without dweight is not supported");
  }
  if (dbias.defined()) bias_grad(dbias, dout, ctx);
}

void linear_backward_input_dgelu_fp8(const TensorView& dpre, const TensorView& dbias, const TensorView& dout,
                                     const TensorView& weight, const TensorView& pre_aux, const ExecContext& ctx,
                                     const Fp8Recipe& r) {
  constexpr const char* op = "linear_backward_input_dgelu_fp8";
  drop_maxima(r);
  check_matrix(dpre, op, "dpre");
  check_matrix(dout, op, "dout");
  check_matrix(pre_aux, op, "pre_aux");
  input_grad(dpre, 0.0f, dout, weight, ctx, r, op);
  // dpre = dpre * gelu'(pre_aux): in place on the device (the kernel reads each element before
  // writing it); the host reference zeroes dinp first, so it reads a copy.
  Arena& arena = detail::scratch_of(ctx, op);
  ArenaScope scope(arena);
  ActivationBackwardArgs a;
  a.act = Activation::Gelu;
  a.dinp = dpre;
  a.inp = pre_aux;
  a.dout = dpre;
  if (dpre.device == Device::CPU) {
    a.dout = arena.tensor(dpre.dtype, {dpre.size(0), dpre.size(1)}, "dgelu dout copy");
    for (int64_t i = 0; i < dpre.size(0); ++i)
      std::memcpy(a.dout.ptr<char>() + i * dpre.size(1) * dtype_size(dpre.dtype),
                  dpre.ptr<char>() + i * dpre.stride(0) * dtype_size(dpre.dtype), dpre.size(1) * dtype_size(dpre.dtype));
  }
  a.ctx = ctx;
  activation_backward(a);
  if (dbias.defined()) {
    zero(dbias, ctx);
    bias_grad(dbias, dpre, ctx);
  }
}

}  // namespace primus::turbo
