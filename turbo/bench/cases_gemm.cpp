// gemm: the linear layers of GPT-2 124M and Llama-3.2-1B, each as the three products of a
// training step (forward, input gradient, weight gradient), in TFLOP/s. On a GPU both device
// backends run (TURBO, Turbo's sm90 kernel, on every case it supports; CUBLASLT) and the run ends
// with TURBO's time against cuBLASLt's per case.
#include <fmt/format.h>

#include "core/util/error.h"
#include "turbo/bench/harness.h"
#include "turbo/ops/gemm.h"

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

}  // namespace primus::turbo::bench
