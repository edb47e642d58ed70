// FP8 tensorwise quantisation (quantize_fp8, turbo/ops/quantization.h) in GB/s of the bytes it
// actually moves: current scaling needs max|x| of the whole tensor before the first byte can be
// written, so the input is read twice (the amax launch, then the quantise launch) and each
// requested output written once. "% of ceiling" is then the share of the device's copy
// bandwidth the two kernels reach; the note gives the minimal traffic (input read once), for
// which the best possible share is (in + outs) / (2 in + outs), e.g. 67% for bf16 -> out + out_t.
// Default cases: bf16 [16384, 8192] (the target: >= 85% of copy for out + out_t) and the
// activation / weight-gradient shapes of GPT-2 124M and Llama-3.2-1B at 16384 tokens; a small
// one on the host.
#include <fmt/format.h>

#include <string>

#include "turbo/bench/harness.h"
#include "turbo/ops/quantization.h"

namespace primus::turbo::bench {
namespace {

Case quantize_case(const std::string& label, int64_t R, int64_t C) {
  return {"quantize_fp8/" + label, [=](CaseEnv& e) {
            const double in = static_cast<double>(dtype_size(e.dtype)) * static_cast<double>(R * C);
            const double fp8 = static_cast<double>(R * C);  // one byte per element per output
            QuantizeFp8Args base;
            base.inp = e.rand(e.dtype, {R, C});
            base.scale_inv = e.empty(DType::F32, {1});
            base.ctx = e.ctx;
            const TensorView out = e.empty(DType::F8E4M3, {R, C}), out_t = e.empty(DType::F8E4M3, {C, R});
            std::vector<Timed> calls;
            auto add = [&](const char* mode, bool with_out, bool with_t) {
              QuantizeFp8Args a = base;
              if (with_out) a.out = out;
              if (with_t) a.out_t = out_t;
              const double outs = fp8 * ((with_out ? 1 : 0) + (with_t ? 1 : 0));
              calls.push_back({fmt::format("quantize_fp8_{}/{}", mode, label), Metric::Bytes, 2 * in + outs,
                               [a] { quantize_fp8(a); },
                               fmt::format("e4m3; bytes = 2 x input + outputs (minimal traffic {:.4g} MB)",
                                           (in + outs) / 1e6)});
            };
            add("both", true, true);
            add("out", true, false);
            add("out_t", false, true);
            // Per-group scaling, both outputs: rows read the input twice (amax launch, then
            // quantize), the block granularities once (one launch).
            for (const Fp8Granularity g : {Fp8Granularity::Row, Fp8Granularity::Block1x128, Fp8Granularity::Block128x128}) {
              const bool block = g != Fp8Granularity::Row;
              if (block && (R % kFp8BlockSize != 0 || C % kFp8BlockSize != 0)) continue;
              QuantizeFp8Args a = base;
              a.granularity = g;
              a.out = out;
              a.out_t = out_t;
              a.scale_inv = e.empty(DType::F32, {fp8_scale_numel(g, R, C)});
              a.scale_inv_t = e.empty(DType::F32, {fp8_scale_numel(g, C, R)});
              const double reads = block ? 1 : 2;
              calls.push_back({fmt::format("quantize_fp8_{}_both/{}", fp8_granularity_name(g), label), Metric::Bytes,
                               reads * in + 2 * fp8, [a] { quantize_fp8(a); },
                               fmt::format("e4m3 {} scales; bytes = {} x input + outputs", fp8_granularity_name(g), reads)});
            }
            // Delayed scaling (the scale known: one pass), both outputs; and the SwiGLU output of
            // gate_up [R, 2C] (its backward's dgate_up [R, 2C] from dact [R, C]) quantized so, by
            // the activation kernel then the quantizer ("swiglu_then_...") or with the activation
            // folded into the quantizer ("swiglu_fold_..."). Bytes: the folded op's minimal traffic
            // for both, so the GB/s compare as times do.
            {
              const TensorView scale = e.rand(DType::F32, {1}), amax = e.empty(DType::F32, {1});
              QuantizeFp8Args a = base;
              a.out = out;
              a.out_t = out_t;
              a.scale = scale;
              a.amax = amax;
              calls.push_back({fmt::format("quantize_fp8_delayed_both/{}", label), Metric::Bytes, in + 2 * fp8,
                               [a] { quantize_fp8(a); }, "e4m3 delayed (given scale); bytes = input + outputs"});
              const TensorView gate_up = e.rand(e.dtype, {R, 2 * C}), y = e.empty(e.dtype, {R, C});
              QuantizeFp8Args u = a;
              u.inp = y;
              QuantizeFp8Args f = a;
              f.prologue = QuantizePrologue::SwiGLU;
              f.inp = gate_up;
              const double fwd_bytes = 2 * in + 2 * fp8;
              const ExecContext ctx = e.ctx;
              calls.push_back({fmt::format("swiglu_then_quantize_fp8_delayed/{}", label), Metric::Bytes, fwd_bytes,
                               [u, gate_up, ctx] {
                                 run_quantize_prologue(QuantizePrologue::SwiGLU, u.inp, gate_up, {}, ctx);
                                 quantize_fp8(u);
                               },
                               "silu(gate) * up of gate_up [R, 2C], then quantized; bytes = gate_up + outputs"});
              if (quantize_fp8_prologue_fits(f))
                calls.push_back({fmt::format("swiglu_fold_quantize_fp8_delayed/{}", label), Metric::Bytes, fwd_bytes,
                                 [f] { quantize_fp8(f); }, "the same, the activation folded into the quantizer"});
              const TensorView dact = e.rand(e.dtype, {R, C}), dgu = e.empty(e.dtype, {R, 2 * C});
              const TensorView out2 = e.empty(DType::F8E4M3, {R, 2 * C}), out2_t = e.empty(DType::F8E4M3, {2 * C, R});
              QuantizeFp8Args ub = a;
              ub.inp = dgu;
              ub.out = out2;
              ub.out_t = out2_t;
              QuantizeFp8Args fb = ub;
              fb.prologue = QuantizePrologue::SwiGLUBackward;
              fb.inp = dact;
              fb.gate_up = gate_up;
              const double bwd_bytes = 3 * in + 4 * fp8;
              calls.push_back({fmt::format("swiglu_bwd_then_quantize_fp8_delayed/{}", label), Metric::Bytes, bwd_bytes,
                               [ub, gate_up, dact, ctx] {
                                 run_quantize_prologue(QuantizePrologue::SwiGLUBackward, ub.inp, dact, gate_up, ctx);
                                 quantize_fp8(ub);
                               },
                               "dgate_up [R, 2C] from dact and gate_up, then quantized; bytes = gate_up + dact + outputs"});
              if (quantize_fp8_prologue_fits(fb))
                calls.push_back({fmt::format("swiglu_bwd_fold_quantize_fp8_delayed/{}", label), Metric::Bytes, bwd_bytes,
                                 [fb] { quantize_fp8(fb); }, "the same, the activation folded into the quantizer"});
            }
            return calls;
          }};
}

}  // namespace

OpFamily quantize_family() {
  OpFamily f;
  f.name = "quantize";
  f.bench = "ops";
  f.dispatch_ops = {"quantize"};
  f.backends = {BackendType::TURBO, BackendType::CPU};
  f.shape_syntax = "RxC (rows x columns): FP8 e4m3 tensorwise, out [R,C] and/or out_t [C,R]; row / 1x128 / 128x128 scales, both";
  f.defaults = [](const Scale& s) {
    if (!s.gpu) return std::vector<Case>{quantize_case("small", s.tokens, 768)};
    return std::vector<Case>{quantize_case("16384x8192", 16384, 8192), quantize_case("gpt2/act", s.tokens, 768),
                             quantize_case("gpt2/fc", s.tokens, 3072), quantize_case("llama/act", s.tokens, 2048),
                             quantize_case("llama/fc", s.tokens, 8192)};
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("quantize", shape, 2, syntax);
    return quantize_case(shape, d[0], d[1]);
  };
  return f;
}

}  // namespace primus::turbo::bench
