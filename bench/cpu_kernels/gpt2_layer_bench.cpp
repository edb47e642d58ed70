// One GPT-2 transformer layer (pre-LN, GELU MLP) on the CPU reference kernels, forward and
// backward, plus its parts and the cross-entropy head, at the size of a tiny model:
// C=384, H=6 (D=64), T=256, B=8 by default. Threads: OMP_NUM_THREADS (and OPENBLAS_NUM_THREADS
// for the GEMMs). Run:  OMP_NUM_THREADS=2 build/bin/bench_cpu_kernels
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/attention.h"
#include "turbo/kernels/cpu/loss.h"
#include "turbo/kernels/cpu/matmul.h"
#include "turbo/kernels/cpu/normalization.h"
#include "turbo/kernels/cpu/residual.h"

namespace cpu = primus::turbo::cpu;

namespace {

std::vector<float> random_vec(size_t n, float scale, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(gen);
  return v;
}

// Weights, activations and gradients of one layer, laid out as llm.c's train_gpt2.c does.
struct Gpt2Layer {
  int64_t B, T, C, H, N;
  cpu::AttentionParams attn;
  std::vector<float> ln1w, ln1b, wq, wk, wv, bq, bk, bv, wproj, bproj, ln2w, ln2b, wfc, bfc,
      wfcproj, bfcproj;
  std::vector<float> x, ln1, ln1_mean, ln1_rstd, q, k, v, att, lse, proj, res1, ln2, ln2_mean,
      ln2_rstd, fc, gelu, fcproj, out;
  std::vector<float> dout, d_res1, d_ln2, d_fc, d_gelu, d_att, d_q, d_k, d_v, d_ln1, d_x, dweights;

  Gpt2Layer(int64_t B_, int64_t T_, int64_t C_, int64_t H_)
      : B(B_), T(T_), C(C_), H(H_), N(B_ * T_) {
    attn.B = B, attn.T = T, attn.H = H, attn.KVH = H, attn.D = C / H;
    const float ws = 0.02f;
    uint32_t seed = 1;
    auto w = [&](int64_t n) { return random_vec(n, ws, seed++); };
    ln1w = w(C), ln1b = w(C), wq = w(C * C), wk = w(C * C), wv = w(C * C), bq = w(C), bk = w(C),
    bv = w(C), wproj = w(C * C), bproj = w(C), ln2w = w(C), ln2b = w(C), wfc = w(4 * C * C),
    bfc = w(4 * C), wfcproj = w(4 * C * C), bfcproj = w(C);
    for (float& a : ln1w) a += 1.f;
    for (float& a : ln2w) a += 1.f;
    x = random_vec(N * C, 1.f, 100), dout = random_vec(N * C, 1.f, 101);
    for (auto* a : {&ln1, &q, &k, &v, &att, &proj, &res1, &ln2, &fcproj, &out}) a->resize(N * C);
    for (auto* a : {&fc, &gelu}) a->resize(N * 4 * C);
    for (auto* a : {&ln1_mean, &ln1_rstd, &ln2_mean, &ln2_rstd}) a->resize(N);
    lse.resize(B * H * T);
    for (auto* a : {&d_res1, &d_ln2, &d_att, &d_q, &d_k, &d_v, &d_ln1, &d_x}) a->resize(N * C);
    for (auto* a : {&d_fc, &d_gelu}) a->resize(N * 4 * C);
    dweights.resize(12 * C * C + 16 * C);
  }

  void forward() {
    cpu::layernorm_forward(ln1.data(), ln1_mean.data(), ln1_rstd.data(), x.data(), ln1w.data(),
                           ln1b.data(), N, C, 1e-5);
    cpu::matmul_forward(q.data(), ln1.data(), wq.data(), bq.data(), N, C, C);
    cpu::matmul_forward(k.data(), ln1.data(), wk.data(), bk.data(), N, C, C);
    cpu::matmul_forward(v.data(), ln1.data(), wv.data(), bv.data(), N, C, C);
    cpu::attention_forward(att.data(), lse.data(), q.data(), k.data(), v.data(), attn);
    cpu::matmul_forward(proj.data(), att.data(), wproj.data(), bproj.data(), N, C, C);
    cpu::residual_forward(res1.data(), x.data(), proj.data(), N * C);
    cpu::layernorm_forward(ln2.data(), ln2_mean.data(), ln2_rstd.data(), res1.data(), ln2w.data(),
                           ln2b.data(), N, C, 1e-5);
    cpu::matmul_forward(fc.data(), ln2.data(), wfc.data(), bfc.data(), N, C, 4 * C);
    cpu::gelu_forward(gelu.data(), fc.data(), N * 4 * C);
    cpu::matmul_forward(fcproj.data(), gelu.data(), wfcproj.data(), bfcproj.data(), N, 4 * C, C);
    cpu::residual_forward(out.data(), res1.data(), fcproj.data(), N * C);
  }

  void backward() {
    // Gradients accumulate (+=): zero the activation gradients first, as a trainer does.
    for (auto* a : {&d_res1, &d_ln2, &d_att, &d_q, &d_k, &d_v, &d_ln1, &d_x, &d_fc, &d_gelu})
      std::fill(a->begin(), a->end(), 0.f);
    float* dw = dweights.data();
    auto take = [&](int64_t n) {
      float* p = dw;
      dw += n;
      return p;
    };
    float *dwq = take(C * C), *dwk = take(C * C), *dwv = take(C * C), *dwproj = take(C * C),
          *dwfc = take(4 * C * C), *dwfcproj = take(4 * C * C), *dbq = take(C), *dbk = take(C),
          *dbv = take(C), *dbproj = take(C), *dbfc = take(4 * C), *dbfcproj = take(C),
          *dln1w = take(C), *dln1b = take(C), *dln2w = take(C), *dln2b = take(C);
    // out = res1 + fcproj: dout flows to res1 and to the MLP branch unchanged.
    cpu::residual_backward(d_res1.data(), static_cast<float*>(nullptr), dout.data(), N * C);
    cpu::matmul_backward(d_gelu.data(), dwfcproj, dbfcproj, dout.data(), gelu.data(),
                         wfcproj.data(), N, 4 * C, C);
    cpu::gelu_backward(d_fc.data(), fc.data(), d_gelu.data(), N * 4 * C);
    cpu::matmul_backward(d_ln2.data(), dwfc, dbfc, d_fc.data(), ln2.data(), wfc.data(), N, C,
                         4 * C);
    cpu::layernorm_backward(d_res1.data(), dln2w, dln2b, d_ln2.data(), res1.data(), ln2w.data(),
                            ln2_mean.data(), ln2_rstd.data(), N, C);
    // res1 = x + proj
    cpu::residual_backward(d_x.data(), static_cast<float*>(nullptr), d_res1.data(), N * C);
    cpu::matmul_backward(d_att.data(), dwproj, dbproj, d_res1.data(), att.data(), wproj.data(), N,
                         C, C);
    cpu::attention_backward(d_q.data(), d_k.data(), d_v.data(), d_att.data(), q.data(), k.data(),
                            v.data(), att.data(), lse.data(), attn);
    cpu::matmul_backward(d_ln1.data(), dwq, dbq, d_q.data(), ln1.data(), wq.data(), N, C, C);
    cpu::matmul_backward(d_ln1.data(), dwk, dbk, d_k.data(), ln1.data(), wk.data(), N, C, C);
    cpu::matmul_backward(d_ln1.data(), dwv, dbv, d_v.data(), ln1.data(), wv.data(), N, C, C);
    cpu::layernorm_backward(d_x.data(), dln1w, dln1b, d_ln1.data(), x.data(), ln1w.data(),
                            ln1_mean.data(), ln1_rstd.data(), N, C);
  }

  // Multiply-adds of the GEMMs and attention, for a FLOP rate.
  double flops_fwd() const {
    const double gemm = 2.0 * N * C * C * (3 + 1 + 4 + 4);
    const double attn_flops = 2.0 * 2.0 * B * H * (T * (T + 1) / 2.0) * (C / H);
    return gemm + attn_flops;
  }
};

Gpt2Layer& layer() {
  static Gpt2Layer l(8, 256, 384, 6);
  return l;
}

void BM_Gpt2LayerForward(benchmark::State& state) {
  Gpt2Layer& l = layer();
  for (auto _ : state) l.forward();
  state.counters["GFLOP/s"] =
      benchmark::Counter(l.flops_fwd() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Gpt2LayerForwardBackward(benchmark::State& state) {
  Gpt2Layer& l = layer();
  for (auto _ : state) {
    l.forward();
    l.backward();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(3 * l.flops_fwd() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_AttentionForward(benchmark::State& state) {
  Gpt2Layer& l = layer();
  l.forward();
  for (auto _ : state)
    cpu::attention_forward(l.att.data(), l.lse.data(), l.q.data(), l.k.data(), l.v.data(), l.attn);
}

void BM_AttentionBackward(benchmark::State& state) {
  Gpt2Layer& l = layer();
  l.forward();
  for (auto _ : state)
    cpu::attention_backward(l.d_q.data(), l.d_k.data(), l.d_v.data(), l.dout.data(), l.q.data(),
                            l.k.data(), l.v.data(), l.att.data(), l.lse.data(), l.attn);
}

void BM_MatmulFcForward(benchmark::State& state) {
  Gpt2Layer& l = layer();
  for (auto _ : state)
    cpu::matmul_forward(l.fc.data(), l.ln2.data(), l.wfc.data(), l.bfc.data(), l.N, l.C, 4 * l.C);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * l.N * l.C * 4 * l.C * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

void BM_LayerNormForwardBackward(benchmark::State& state) {
  Gpt2Layer& l = layer();
  for (auto _ : state) {
    cpu::layernorm_forward(l.ln1.data(), l.ln1_mean.data(), l.ln1_rstd.data(), l.x.data(),
                           l.ln1w.data(), l.ln1b.data(), l.N, l.C, 1e-5);
    cpu::layernorm_backward(l.d_x.data(), l.dweights.data(), l.dweights.data() + l.C, l.dout.data(),
                            l.x.data(), l.ln1w.data(), l.ln1_mean.data(), l.ln1_rstd.data(), l.N,
                            l.C);
  }
}

void BM_GeluForwardBackward(benchmark::State& state) {
  Gpt2Layer& l = layer();
  for (auto _ : state) {
    cpu::gelu_forward(l.gelu.data(), l.fc.data(), l.N * 4 * l.C);
    cpu::gelu_backward(l.d_fc.data(), l.fc.data(), l.d_gelu.data(), l.N * 4 * l.C);
  }
}

// The LM head's loss at GPT-2's vocabulary over one micro-batch's rows (range(0) rows).
void BM_CrossEntropyFused(benchmark::State& state) {
  const int64_t N = state.range(0), V = 50257;
  const std::vector<float> logits = random_vec(N * V, 5.f, 7);
  std::vector<float> dlogits(N * V);
  std::vector<int32_t> targets(N);
  for (int64_t n = 0; n < N; ++n) targets[n] = static_cast<int32_t>((n * 7919) % V);
  for (auto _ : state)
    cpu::cross_entropy_forward_backward(dlogits.data(), static_cast<float*>(nullptr), logits.data(),
                                        targets.data(), N, V, 1.0 / N);
}

}  // namespace

BENCHMARK(BM_Gpt2LayerForward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Gpt2LayerForwardBackward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AttentionForward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AttentionBackward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MatmulFcForward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_LayerNormForwardBackward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_GeluForwardBackward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CrossEntropyFused)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
