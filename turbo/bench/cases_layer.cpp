// layer: one GPT-2 transformer layer (pre-LN, GELU MLP) forward and backward on the CPU reference
// kernels (turbo/kernels/cpu, called directly, as the reference backend's model does), then its
// parts: attention, the MLP up-projection, LayerNorm, GELU, and the LM head's cross-entropy at
// GPT-2's vocabulary over one sequence's rows. Host only: in a GPU run it still runs on the host.
// Threads: OMP_NUM_THREADS (the GEMMs run on OpenMP's threads, turbo/kernels/cpu/matmul.h).
// TFLOP/s count the GEMMs (2*N*C*C*12: q, k, v, the projection and the MLP's two) and causal
// attention (4*B*H*T^2*D halved) for the forward, and the backward as twice the forward; GB/s
// count each f32 tensor read or written once.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "core/util/error.h"
#include "turbo/bench/harness.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/attention.h"
#include "turbo/kernels/cpu/loss.h"
#include "turbo/kernels/cpu/matmul.h"
#include "turbo/kernels/cpu/normalization.h"
#include "turbo/kernels/cpu/residual.h"

namespace primus::turbo::bench {
namespace {

namespace k = primus::turbo::cpu;

constexpr int64_t kVocab = 50257;  // GPT-2's, for the cross-entropy head

// Weights, activations and gradients of one layer in the host arena, laid out as llm.c's
// train_gpt2.c does (q, k and v as three [C, C] linears).
struct Gpt2Layer {
  int64_t B, T, C, H, N;
  k::AttentionParams attn;
  float *ln1w, *ln1b, *wq, *wk, *wv, *bq, *bk, *bv, *wproj, *bproj, *ln2w, *ln2b, *wfc, *bfc, *wfcproj, *bfcproj;
  float *x, *ln1, *ln1_mean, *ln1_rstd, *q, *kk, *v, *att, *lse, *proj, *res1, *ln2, *ln2_mean, *ln2_rstd, *fc, *gelu,
      *fcproj, *out;
  float *dout, *d_res1, *d_ln2, *d_fc, *d_gelu, *d_att, *d_q, *d_k, *d_v, *d_ln1, *d_x, *dweights;

  Gpt2Layer(CaseEnv& e, int64_t B_, int64_t T_, int64_t C_, int64_t H_) : B(B_), T(T_), C(C_), H(H_), N(B_ * T_) {
    attn.B = B, attn.T = T, attn.H = H, attn.KVH = H, attn.D = C / H;
    auto w = [&](int64_t n, float offset = 0.0f) { return e.rand(DType::F32, {n}, 0.02f, offset).ptr<float>(); };
    auto act = [&](int64_t n) { return e.empty(DType::F32, {n}).ptr<float>(); };
    ln1w = w(C, 1.0f), ln1b = w(C), wq = w(C * C), wk = w(C * C), wv = w(C * C), bq = w(C), bk = w(C), bv = w(C);
    wproj = w(C * C), bproj = w(C), ln2w = w(C, 1.0f), ln2b = w(C), wfc = w(4 * C * C), bfc = w(4 * C);
    wfcproj = w(4 * C * C), bfcproj = w(C);
    x = e.rand(DType::F32, {N * C}).ptr<float>(), dout = e.rand(DType::F32, {N * C}).ptr<float>();
    for (float** a : {&ln1, &q, &kk, &v, &att, &proj, &res1, &ln2, &fcproj, &out}) *a = act(N * C);
    for (float** a : {&fc, &gelu}) *a = act(N * 4 * C);
    for (float** a : {&ln1_mean, &ln1_rstd, &ln2_mean, &ln2_rstd}) *a = act(N);
    lse = act(B * H * T);
    for (float** a : {&d_res1, &d_ln2, &d_att, &d_q, &d_k, &d_v, &d_ln1, &d_x}) *a = act(N * C);
    for (float** a : {&d_fc, &d_gelu}) *a = act(N * 4 * C);
    dweights = act(12 * C * C + 16 * C);
  }

  void forward() {
    k::layernorm_forward(ln1, ln1_mean, ln1_rstd, x, ln1w, ln1b, N, C, 1e-5);
    k::matmul_forward(q, ln1, wq, bq, N, C, C);
    k::matmul_forward(kk, ln1, wk, bk, N, C, C);
    k::matmul_forward(v, ln1, wv, bv, N, C, C);
    k::attention_forward(att, lse, q, kk, v, attn);
    k::matmul_forward(proj, att, wproj, bproj, N, C, C);
    k::residual_forward(res1, x, proj, N * C);
    k::layernorm_forward(ln2, ln2_mean, ln2_rstd, res1, ln2w, ln2b, N, C, 1e-5);
    k::matmul_forward(fc, ln2, wfc, bfc, N, C, 4 * C);
    k::gelu_forward(gelu, fc, N * 4 * C);
    k::matmul_forward(fcproj, gelu, wfcproj, bfcproj, N, 4 * C, C);
    k::residual_forward(out, res1, fcproj, N * C);
  }

  void backward() {
    // Gradients accumulate (+=): zero the activation gradients first, as a trainer does.
    for (float* a : {d_res1, d_ln2, d_att, d_q, d_k, d_v, d_ln1, d_x}) std::fill(a, a + N * C, 0.f);
    for (float* a : {d_fc, d_gelu}) std::fill(a, a + N * 4 * C, 0.f);
    float* dw = dweights;
    auto take = [&](int64_t n) {
      float* p = dw;
      dw += n;
      return p;
    };
    float *dwq = take(C * C), *dwk = take(C * C), *dwv = take(C * C), *dwproj = take(C * C), *dwfc = take(4 * C * C),
          *dwfcproj = take(4 * C * C), *dbq = take(C), *dbk = take(C), *dbv = take(C), *dbproj = take(C),
          *dbfc = take(4 * C), *dbfcproj = take(C), *dln1w = take(C), *dln1b = take(C), *dln2w = take(C),
          *dln2b = take(C);
    // out = res1 + fcproj: dout flows to res1 and to the MLP branch unchanged.
    k::residual_backward(d_res1, static_cast<float*>(nullptr), dout, N * C);
    k::matmul_backward(d_gelu, dwfcproj, dbfcproj, dout, gelu, wfcproj, N, 4 * C, C);
    k::gelu_backward(d_fc, fc, d_gelu, N * 4 * C);
    k::matmul_backward(d_ln2, dwfc, dbfc, d_fc, ln2, wfc, N, C, 4 * C);
    k::layernorm_backward(d_res1, dln2w, dln2b, d_ln2, res1, ln2w, ln2_mean, ln2_rstd, N, C);
    // res1 = x + proj
    k::residual_backward(d_x, static_cast<float*>(nullptr), d_res1, N * C);
    k::matmul_backward(d_att, dwproj, dbproj, d_res1, att, wproj, N, C, C);
    k::attention_backward(d_q, d_k, d_v, d_att, q, kk, v, att, lse, attn);
    k::matmul_backward(d_ln1, dwq, dbq, d_q, ln1, wq, N, C, C);
    k::matmul_backward(d_ln1, dwk, dbk, d_k, ln1, wk, N, C, C);
    k::matmul_backward(d_ln1, dwv, dbv, d_v, ln1, wv, N, C, C);
    k::layernorm_backward(d_x, dln1w, dln1b, d_ln1, x, ln1w, ln1_mean, ln1_rstd, N, C);
  }

  double attention_flops() const {
    return 4.0 * static_cast<double>(B * H) * static_cast<double>(T) * static_cast<double>(T) *
           static_cast<double>(C / H) * 0.5;
  }
  double flops_fwd() const { return 2.0 * static_cast<double>(N) * static_cast<double>(C * C) * 12.0 + attention_flops(); }
};

Case layer_case(const std::string& label, int64_t B, int64_t T, int64_t C, int64_t H) {
  return {label, [=](CaseEnv& e) {
            if (e.on_device()) throw RuntimeError("layer: the CPU reference kernels run on the host only");
            auto l = std::make_shared<Gpt2Layer>(e, B, T, C, H);
            l->forward();  // the activations the parts below read
            const std::string base = "layer/" + label;
            const char* threads = std::getenv("OMP_NUM_THREADS");
            const double n = static_cast<double>(l->N), c = static_cast<double>(C), f32 = 4.0;
            // The head: T rows of GPT-2's vocabulary, gradient written over the logits' copy.
            const TensorView logits = e.rand(DType::F32, {T, kVocab}, 5.0f), dlogits = e.empty(DType::F32, {T, kVocab});
            const TensorView targets = e.ints({T}, static_cast<int32_t>(kVocab));
            return std::vector<Timed>{
                {base + "/fwd", Metric::Flops, l->flops_fwd(), [l] { l->forward(); },
                 fmt::format("B={} T={} C={} H={}; OMP_NUM_THREADS={}", B, T, C, H, threads ? threads : "(unset)")},
                {base + "/fwdbwd", Metric::Flops, 3.0 * l->flops_fwd(), [l] {
                   l->forward();
                   l->backward();
                 },
                 ""},
                {base + "/attention_fwd", Metric::Flops, l->attention_flops(),
                 [l] { k::attention_forward(l->att, l->lse, l->q, l->kk, l->v, l->attn); }, ""},
                {base + "/attention_bwd", Metric::Flops, 2.5 * l->attention_flops(),
                 [l] {
                   k::attention_backward(l->d_q, l->d_k, l->d_v, l->dout, l->q, l->kk, l->v, l->att, l->lse, l->attn);
                 },
                 ""},
                {base + "/fc_fwd", Metric::Flops, 2.0 * n * c * 4.0 * c,
                 [l] { k::matmul_forward(l->fc, l->ln2, l->wfc, l->bfc, l->N, l->C, 4 * l->C); }, ""},
                // x read, out written; dout and x read, dx read and written (it accumulates).
                {base + "/layernorm_fwdbwd", Metric::Bytes, 6.0 * n * c * f32,
                 [l] {
                   k::layernorm_forward(l->ln1, l->ln1_mean, l->ln1_rstd, l->x, l->ln1w, l->ln1b, l->N, l->C, 1e-5);
                   k::layernorm_backward(l->d_x, l->dweights, l->dweights + l->C, l->dout, l->x, l->ln1w, l->ln1_mean,
                                         l->ln1_rstd, l->N, l->C);
                 },
                 ""},
                // in read, out written; in and dout read, din read and written (it accumulates).
                {base + "/gelu_fwdbwd", Metric::Bytes, 6.0 * n * 4.0 * c * f32,
                 [l] {
                   k::gelu_forward(l->gelu, l->fc, l->N * 4 * l->C);
                   k::gelu_backward(l->d_fc, l->fc, l->d_gelu, l->N * 4 * l->C);
                 },
                 ""},
                {base + "/cross_entropy_fwdbwd", Metric::Bytes, 2.0 * static_cast<double>(T * kVocab) * f32,
                 [=] {
                   k::cross_entropy_forward_backward(dlogits.ptr<float>(), static_cast<float*>(nullptr), logits.ptr<float>(),
                                                     targets.ptr<int32_t>(), T, kVocab, 1.0 / static_cast<double>(T));
                 },
                 fmt::format("{} rows x V={}", T, kVocab)}};
          }};
}

}  // namespace

OpFamily layer_family() {
  OpFamily f;
  f.name = "layer";
  f.bench = "ops";
  f.dispatch_ops = {};  // the kernels are called directly
  f.backends = {BackendType::CPU};
  f.shape_syntax =
      "BxTxCxH (batch x sequence x features x heads): a GPT-2 layer on the CPU reference kernels, on the host";
  // A tiny model's layer (head dim 64), small enough for a 2-core machine.
  f.defaults = [](const Scale&) { return std::vector<Case>{layer_case("gpt2_c384_t256", 8, 256, 384, 6)}; };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("layer", shape, 4, syntax);
    if (d[2] % d[3] != 0)
      throw UsageError(fmt::format("layer: shape '{}': {} features do not split into {} heads", shape, d[2], d[3]));
    return layer_case(shape, d[0], d[1], d[2], d[3]);
  };
  return f;
}

}  // namespace primus::turbo::bench
