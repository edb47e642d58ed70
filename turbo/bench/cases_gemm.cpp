// gemm: the linear layers of GPT-2 124M and Llama-3.2-1B, each as the three products of a
// training step (forward, input gradient, weight gradient), in TFLOP/s. On a GPU both device
// backends run (TURBO, Turbo's sm90 kernel, on every case it supports; CUBLASLT) and the run ends
// with TURBO's time against cuBLASLt's per case.
#include <fmt/format.h>

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

}  // namespace

OpFamily gemm_family() {
  OpFamily f;
  f.name = "gemm";
  f.bench = "ops";
  f.dispatch_ops = {"gemm"};
  f.backends = {BackendType::TURBO, BackendType::CUBLASLT, BackendType::CPU};
  f.compare = {{BackendType::TURBO, BackendType::CUBLASLT}};
  f.shape_syntax = "MxNxK (tokens x output features x input features)";
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
    return cases;
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("gemm", shape, 3, syntax);
    return linear_case(shape, d[0], d[1], d[2]);
  };
  return f;
}

}  // namespace primus::turbo::bench
