// gemm: the linear layers of GPT-2 124M and Llama-3.2-1B, each as the three products of a
// training step (forward, input gradient, weight gradient), in TFLOP/s. On a GPU both device
// backends run (TURBO, Turbo's sm90 kernel, on every case it supports; CUBLASLT) and the run ends
// with TURBO's time against cuBLASLt's per case.
//
// gemm_fp8: turbo::gemm on FP8 E4M3 operands as the FP8 linear layers call it (turbo/ops/gemm_fp8.cpp,
// fp8_gemm): A = q(x) [M,K] row-major, B = q(w)^T with w [N,K] row-major, scales at one granularity
// (tensorwise, rowwise, or blockwise 1x128 x 128x128), output bf16; quantized before timing.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/util/error.h"
#include "turbo/bench/harness.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/quantization.h"

namespace primus::turbo::bench {
namespace {

// y[M,N] = x[M,K] @ w[N,K]^T; dx = dy @ w; dw = dy^T @ x.
Case linear_case(std::string name, int64_t M, int64_t N, int64_t K) {
  return {name, [name, M, N, K](CaseEnv& e) {
            TensorView x = e.rand(e.dtype, {M, K}), w = e.rand(e.dtype, {N, K}, 0.05f);
            TensorView y = e.empty(e.dtype, {M, N}), dy = e.rand(e.dtype, {M, N});
            TensorView dx = e.empty(e.dtype, {M, K}), dw = e.empty(e.dtype, {N, K});
            auto call = [&e](const TensorView& a, const TensorView& b, const TensorView& d) {
              GemmArgs g;
              g.a = a;
              g.b = b;
              g.d = d;
              g.ctx = e.ctx;
              return [g] { gemm(g); };
            };
            const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
            return std::vector<Timed>{
                {"gemm/" + name + "/fwd", Metric::Flops, flops, call(x, w.transposed(), y), fmt::format("[{}x{}] @ [{}x{}]^T", M, K, N, K)},
                {"gemm/" + name + "/dgrad", Metric::Flops, flops, call(dy, w, dx), ""},
                {"gemm/" + name + "/wgrad", Metric::Flops, flops, call(dy.transposed(), x, dw), ""}};
          }};
}

// The products of a GPT-2 linear layer as the cuda backend's training step issues them (GPU only;
// TURBO serves the bias and GELU epilogues, not the bias-gradient ones): the forward with its bias (and the
// GELU + pre-activation epilogue for the MLP up-projection), the input gradient through GELU's
// derivative (MLP down-projection), and the weight gradient accumulated into fp32 with and
// without the bias gradient. Against the plain products above they show what each fusion costs.
Case training_case(std::string name, int64_t M, int64_t N, int64_t K, bool gelu_out, bool dgelu_in) {
  return {name, [name, M, N, K, gelu_out, dgelu_in](CaseEnv& e) {
            TensorView x = e.rand(e.dtype, {M, K}), w = e.rand(e.dtype, {N, K}, 0.05f), b = e.rand(e.dtype, {N}, 0.1f);
            TensorView y = e.empty(e.dtype, {M, N}), aux = e.empty(e.dtype, {M, N}), dy = e.rand(e.dtype, {M, N});
            TensorView dx = e.empty(e.dtype, {M, K}), pre = e.rand(e.dtype, {M, K});
            TensorView dw = e.zeros(DType::F32, {N, K}), db = e.zeros(DType::F32, {N});
            const ExecContext c = e.ctx;
            const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
            std::vector<Timed> t;
            t.push_back({"gemm/" + name + (gelu_out ? "/fwd+bias+gelu_aux" : "/fwd+bias"), Metric::Flops, flops,
                         [=] { linear_forward(y, x, w, b, gelu_out ? aux : TensorView(), c); }, "training-step epilogues"});
            if (dgelu_in) {
              t.push_back({"gemm/" + name + "/dgrad+dgelu", Metric::Flops, flops,
                           [=] { linear_backward_input_dgelu(dx, {}, dy, w, pre, c); }, ""});
              // The bias gradient of the layer below (over dx's columns) in the same epilogue.
              TensorView dbx = e.empty(e.dtype, {K});
              t.push_back({"gemm/" + name + "/dgrad+dgelu+bias_grad", Metric::Flops, flops,
                           [=] { linear_backward_input_dgelu(dx, dbx, dy, w, pre, c); }, ""});
            }
            t.push_back({"gemm/" + name + "/wgrad_f32+=", Metric::Flops, flops,
                         [=] { linear_backward({}, dw, {}, dy, x, w, false, c); }, ""});
            t.push_back({"gemm/" + name + "/wgrad_f32+=+bias_grad", Metric::Flops, flops,
                         [=] { linear_backward({}, dw, db, dy, x, w, false, c); }, ""});
            // The bias gradient as its own column-sum reduction (what the cuda backend runs), in
            // bytes of dy read: its share of the copy ceiling.
            t.push_back({"gemm/" + name + "/bias_grad_colsum", Metric::Bytes,
                         static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(dtype_size(e.dtype)),
                         [=] { bias_grad(db, dy, c); }, ""});
            return t;
          }};
}

// The FP8 products of one MxNxK shape, one per scaling granularity: x [M,K] and w [N,K] drawn at
// random (bf16 on the device, f32 on the host), quantized to E4M3 by turbo::quantize_fp8 at the
// granularity (outside the timed call), then D [M,N] = (q(x) * sx) @ (q(w) * sw)^T as
// turbo/ops/gemm_fp8.cpp's fp8_gemm issues it: A = q(x) row-major, B = q(w).transposed(), the
// scales laid out by fp8_scale_shape. Fast accumulation as the forward GEMMs use it: on for
// tensorwise and rowwise, off for blockwise (which refuses it). Blockwise only when M, N and K are
// multiples of 128. The first call of each product (a warm-up call) reads back the first rows of D
// and refuses a non-finite result.
Case gemm_fp8_case(const std::string& shape, const std::string& label, int64_t M, int64_t N, int64_t K) {
  return {shape, [shape, label, M, N, K](CaseEnv& e) {
            const DType src = e.on_device() ? DType::BF16 : DType::F32;  // what quantize_fp8 takes
            const TensorView x = e.rand(src, {M, K}), w = e.rand(src, {N, K}, 0.05f);
            const TensorView d = e.empty(e.dtype, {M, N});
            const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
            BenchDevice* dev = &e.dev;
            struct G { const char* name; Fp8Granularity a, b; bool fast; };
            static const G kGs[] = {{"tensorwise", Fp8Granularity::Tensor, Fp8Granularity::Tensor, true},
                                    {"rowwise", Fp8Granularity::Row, Fp8Granularity::Row, true},
                                    {"blockwise", Fp8Granularity::Block1x128, Fp8Granularity::Block128x128, false}};
            // The quantizer on the host tensors' own backend (no fallback warning from the default, TURBO).
            struct HostQuantizer {
              bool on;
              explicit HostQuantizer(bool host) : on(host) {
                if (on) GlobalBackendManager::instance().set_backend("quantize", BackendType::CPU);
              }
              ~HostQuantizer() {
                if (on) GlobalBackendManager::instance().clear_backend("quantize");
              }
            } host_quantizer(!e.on_device());
            std::vector<Timed> calls;
            for (const G& gr : kGs) {
              const bool block = gr.a != Fp8Granularity::Tensor && gr.a != Fp8Granularity::Row;
              if (block && (M % kFp8BlockSize != 0 || N % kFp8BlockSize != 0 || K % kFp8BlockSize != 0)) continue;
              // Each granularity quantizes into its own copies (the timed calls read them later).
              const TensorView qb = e.empty(DType::F8E4M3, {N, K});  // w as stored, [N,K]
              GemmArgs g;
              g.a = e.empty(DType::F8E4M3, {M, K});
              g.b = qb.transposed();
              g.d = d;
              g.a_scale = e.empty(DType::F32, {fp8_scale_numel(gr.a, M, K)});
              g.b_scale = e.empty(DType::F32, {fp8_scale_numel(gr.b, N, K)});
              g.a_scaling = gr.a;
              g.b_scaling = gr.b;
              g.fp8_fast_accum = gr.fast;
              g.ctx = e.ctx;
              auto quantize = [&e](const TensorView& in, const TensorView& q, const TensorView& scale, Fp8Granularity gran) {
                QuantizeFp8Args qa;
                qa.inp = in;
                qa.out = q;
                qa.scale_inv = scale;
                qa.granularity = gran;
                qa.ctx = e.ctx;
                quantize_fp8(qa);
              };
              quantize(x, g.a, g.a_scale, gr.a);
              quantize(w, qb, g.b_scale, gr.b);
              auto checked = std::make_shared<bool>(false);
              const std::string name = fmt::format("gemm_fp8_{}/{}", gr.name, shape);
              calls.push_back({name, Metric::Flops, flops,
                               [g, checked, dev, name, M] {
                                 gemm(g);
                                 if (*checked) return;
                                 *checked = true;  // the first (warm-up) call: the result must be finite
                                 dev->synchronize();
                                 for (float v : dev->read(g.d.slice0(0, std::min<int64_t>(M, 8))))
                                   if (!std::isfinite(v)) throw RuntimeError(fmt::format("{}: non-finite output", name));
                               },
                               fmt::format("{}e4m3 {} x {} -> {}{}", label.empty() ? "" : label + ": ",
                                           fp8_granularity_name(gr.a), fp8_granularity_name(gr.b), dtype_name(e.dtype),
                                           gr.fast ? ", fast accum" : "")});
            }
            return calls;
          }};
}

}  // namespace

OpFamily gemm_family() {
  OpFamily f;
  f.name = "gemm";
  f.bench = "ops";
  f.dispatch_ops = {"gemm"};
  f.backends = {BackendType::TURBO, BackendType::CUBLASLT, BackendType::CPU};
  f.compare = {{BackendType::TURBO, BackendType::CUBLASLT}};
  f.shape_syntax =
      "MxNxK (tokens x output features x input features); MxNxK+bias, +gelu or +dgelu: the training step's "
      "epilogue products of such a layer (bias; bias + GELU out; GELU's derivative in)";
  f.defaults = [](const Scale& s) {
    struct L { const char* model; const char* name; int64_t K, N; };
    static const L kGpt2[] = {{"gpt2", "qkv", 768, 2304},   {"gpt2", "attn_proj", 768, 768}, {"gpt2", "fc", 768, 3072},
                              {"gpt2", "fc_proj", 3072, 768}, {"gpt2", "lm_head", 768, 50304}};
    static const L kLlama[] = {{"llama", "q_o", 2048, 2048},     {"llama", "kv", 2048, 1024},
                               {"llama", "gate_up", 2048, 16384}, {"llama", "down", 8192, 2048},
                               {"llama", "lm_head", 2048, 128256}};
    std::vector<Case> cases;
    for (const L& l : kGpt2)
      if (s.gpu || std::string(l.name) != "lm_head") cases.push_back(linear_case(fmt::format("{}/{}", l.model, l.name), s.tokens, l.N, l.K));
    if (s.gpu)
      for (const L& l : kLlama) cases.push_back(linear_case(fmt::format("{}/{}", l.model, l.name), s.tokens, l.N, l.K));
    if (s.gpu)  // GPT-2's layers with the epilogues the training step uses (fc: GELU out; fc_proj: dGELU in)
      for (const L& l : kGpt2)
        if (std::string(l.name) != "lm_head")
          cases.push_back(training_case(fmt::format("{}/{}", l.model, l.name), s.tokens, l.N, l.K,
                                        std::string(l.name) == "fc", std::string(l.name) == "fc_proj"));
    return cases;
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const size_t plus = shape.find('+');
    const std::string dims = shape.substr(0, plus), epi = plus == std::string::npos ? "" : shape.substr(plus + 1);
    if (!epi.empty() && epi != "bias" && epi != "gelu" && epi != "dgelu")
      throw UsageError(fmt::format("gemm shape '{}': unknown epilogue '+{}' (expected +bias, +gelu or +dgelu)", shape, epi));
    const auto d = parse_dims("gemm", dims, 3, syntax);
    if (!epi.empty()) return training_case(shape, d[0], d[1], d[2], epi == "gelu", epi == "dgelu");
    return linear_case(shape, d[0], d[1], d[2]);
  };
  return f;
}

OpFamily gemm_fp8_family() {
  OpFamily f;
  f.name = "gemm_fp8";
  f.bench = "gemm_fp8";
  f.dispatch_ops = {"gemm"};
  f.backends = {BackendType::CUBLASLT, BackendType::CPU};  // TURBO's GEMM runs bf16/f16 only
  f.shape_syntax =
      "MxNxK (tokens x output features x input features): E4M3 x E4M3 -> bf16, tensorwise, rowwise and "
      "blockwise (1x128 x 128x128; M, N, K multiples of 128) scales";
  f.defaults = [](const Scale& s) {
    struct L { const char* name; int64_t M, N, K; };
    const int64_t T = s.tokens;
    // Llama-3.2-1B (hidden 2048, 32 heads + 2 x 8 kv groups of 64, ffn 8192; gate|up fused) and
    // GPT-2 124M at 16384 tokens (8 x 2048, 16 x 1024), and 8192^3.
    const L gpu[] = {{"llama/qkv", T, 3072, 2048},     {"llama/attn_out", T, 2048, 2048}, {"llama/gate_up", T, 16384, 2048},
                     {"llama/down", T, 2048, 8192},     {"gpt2/qkv", T, 2304, 768},        {"gpt2/attn_proj", T, 768, 768},
                     {"gpt2/fc", T, 3072, 768},         {"gpt2/fc_proj", T, 768, 3072},    {"8192^3", 8192, 8192, 8192}};
    const L host[] = {{"gpt2/qkv", T, 2304, 768}, {"gpt2/attn_proj", T, 768, 768}, {"gpt2/fc", T, 3072, 768},
                      {"gpt2/fc_proj", T, 768, 3072}};
    std::vector<Case> cases;
    if (s.gpu)
      for (const L& l : gpu) cases.push_back(gemm_fp8_case(fmt::format("{}x{}x{}", l.M, l.N, l.K), l.name, l.M, l.N, l.K));
    else
      for (const L& l : host) cases.push_back(gemm_fp8_case(fmt::format("{}x{}x{}", l.M, l.N, l.K), l.name, l.M, l.N, l.K));
    return cases;
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("gemm_fp8", shape, 3, syntax);
    return gemm_fp8_case(shape, "", d[0], d[1], d[2]);
  };
  return f;
}

}  // namespace primus::turbo::bench
