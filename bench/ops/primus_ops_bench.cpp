// primus_ops_bench: times Turbo's ops on the GPU at the training shapes of GPT-2 124M and
// Llama-3.2-1B (M = 16384 tokens), through the public ops API (so dispatch overhead counts).
//   GEMMs in TFLOP/s (forward, input-gradient and weight-gradient products);
//   memory-bound ops in GB/s of their minimal traffic (each input read once, each output
//   written once), next to a measured device-to-device copy (bytes read + written).
// Each case: warm-up, then the median of per-call event timings of calls enqueued back to back
// (one synchronisation at the end). Inputs are random.
// Output: a table on stdout and one JSON object per case in --out (see bench/ops/README.md);
// bench/ops/torch_ops.py measures the PyTorch equivalents under the same case names and
// bench/ops/merge_ops.py joins both into bench/results/ops.jsonl.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/ops/fill.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cublaslt/gemm_cublaslt.h"
#include "turbo/kernels/cuda/rope.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/embedding.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/loss.h"
#include "turbo/ops/normalization.h"
#include "turbo/ops/optimizer.h"
#include "turbo/ops/rope.h"

using namespace primus::turbo;
namespace pb = primus::bench;

namespace {

constexpr int64_t kTokens = 16384;

struct Bench {
  Arena* arena = nullptr;
  ExecContext ctx;
  FILE* out = nullptr;
  double copy_gbs = 0.0;
  uint64_t seed = 1234;
  int reps = 50;

  TensorView rand(DType dt, std::initializer_list<int64_t> shape, float scale = 1.0f) {
    TensorView t = arena->tensor(dt, shape);
    pb::fill_uniform(t.data, dt, t.numel(), seed++, scale);
    return t;
  }

  // Median per-call GPU time: the calls are enqueued back to back (each between its own pair
  // of events) and synchronised once at the end, so host-side launch cost overlaps the GPU
  // work of the previous call, as in a training step, instead of adding idle gaps.
  double time_ms(const std::function<void()>& f) {
    for (int i = 0; i < 5; ++i) f();
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<cudaEvent_t> ev(static_cast<size_t>(2 * reps));
    for (auto& e : ev) CUDA_CHECK(cudaEventCreate(&e));
    for (int r = 0; r < reps; ++r) {
      CUDA_CHECK(cudaEventRecord(ev[2 * r]));
      f();
      CUDA_CHECK(cudaEventRecord(ev[2 * r + 1]));
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ms(static_cast<size_t>(reps));
    for (int r = 0; r < reps; ++r) CUDA_CHECK(cudaEventElapsedTime(&ms[r], ev[2 * r], ev[2 * r + 1]));
    for (auto& e : ev) cudaEventDestroy(e);
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    return ms[ms.size() / 2];
  }

  // metric "TFLOP/s" (work = flops) or "GB/s" (work = bytes).
  void record(const std::string& name, const char* metric, double work, double ms, const std::string& note = "") {
    const double value = std::strcmp(metric, "TFLOP/s") == 0 ? work / ms / 1e9 : work / ms / 1e6;
    std::string extra;
    if (std::strcmp(metric, "GB/s") == 0 && copy_gbs > 0)
      extra = fmt::format("  ({:.0f}% of copy)", 100.0 * value / copy_gbs);
    std::printf("%-44s %9.4f ms %9.1f %s%s %s\n", name.c_str(), ms, value, metric, extra.c_str(), note.c_str());
    std::fflush(stdout);
    if (out) {
      std::fprintf(out, "{\"case\": \"%s\", \"metric\": \"%s\", \"ms\": %.6f, \"value\": %.3f, \"work\": %.6e%s}\n",
                   name.c_str(), metric, ms, value, work,
                   note.empty() ? "" : fmt::format(", \"note\": \"{}\"", note).c_str());
      std::fflush(out);
    }
  }
};

void bench_copy(Bench& b) {
  ArenaScope s(*b.arena);
  const int64_t n = int64_t{1} << 28;  // bf16: 512 MiB each way
  TensorView x = b.rand(DType::BF16, {n}), y = b.arena->tensor(DType::BF16, {n});
  const double ms = b.time_ms([&] { CUDA_CHECK(cudaMemcpyAsync(y.data, x.data, x.nbytes(), cudaMemcpyDeviceToDevice)); });
  b.copy_gbs = 2.0 * static_cast<double>(x.nbytes()) / ms / 1e6;
  b.record("copy/512MiB", "GB/s", 2.0 * static_cast<double>(x.nbytes()), ms);
}

struct Linear {
  const char* model;
  const char* name;
  int64_t C, OC;
};

void bench_gemm(Bench& b, const Linear& l, const char* variant) {
  ArenaScope s(*b.arena);
  const int64_t M = kTokens;
  TensorView x = b.rand(DType::BF16, {M, l.C}), w = b.rand(DType::BF16, {l.OC, l.C}, 0.05f);
  TensorView y = b.arena->tensor(DType::BF16, {M, l.OC}), dy = b.rand(DType::BF16, {M, l.OC});
  TensorView dx = b.arena->tensor(DType::BF16, {M, l.C}), dw = b.arena->tensor(DType::BF16, {l.OC, l.C});
  const double flops = 2.0 * M * l.C * l.OC;
  auto run = [&](const TensorView& a, const TensorView& bb, const TensorView& d) {
    GemmArgs g;
    g.a = a;
    g.b = bb;
    g.d = d;
    g.ctx = b.ctx;
    return [g] { gemm(g); };
  };
  const std::string base = fmt::format("gemm/{}/{}", l.model, l.name);
  b.record(base + "/fwd" + variant, "TFLOP/s", flops, b.time_ms(run(x, w.transposed(), y)),
           fmt::format("[{}x{}] @ [{}x{}]^T", M, l.C, l.OC, l.C));
  b.record(base + "/dgrad" + variant, "TFLOP/s", flops, b.time_ms(run(dy, w, dx)));
  b.record(base + "/wgrad" + variant, "TFLOP/s", flops, b.time_ms(run(dy.transposed(), x, dw)));
}

void bench_norms(Bench& b, const char* model, NormType type, int64_t C) {
  ArenaScope s(*b.arena);
  const int64_t N = kTokens;
  const bool ln = type == NormType::LayerNorm;
  const char* nm = ln ? "layernorm" : "rmsnorm";
  TensorView x = b.rand(DType::BF16, {N, C}), r = b.rand(DType::BF16, {N, C});
  TensorView w = b.rand(DType::BF16, {C}), bias = b.rand(DType::BF16, {C});
  TensorView out = b.arena->tensor(DType::BF16, {N, C}), res = b.arena->tensor(DType::BF16, {N, C});
  TensorView mean = b.arena->tensor(DType::F32, {N}), rstd = b.arena->tensor(DType::F32, {N});
  const double act = static_cast<double>(N * C * 2), stats = static_cast<double>(N * 4 * (ln ? 2 : 1));
  NormForwardArgs f;
  f.type = type;
  f.out = out; f.mean = mean; f.rstd = rstd; f.inp = x; f.weight = w;
  if (ln) f.bias = bias;
  f.ctx = b.ctx;
  b.record(fmt::format("{}_fwd/{}", nm, model), "GB/s", 2 * act + stats, b.time_ms([&] { norm_forward(f); }));
  NormForwardArgs fr = f;
  fr.residual = r;
  fr.residual_out = res;
  b.record(fmt::format("add_{}_fwd/{}", nm, model), "GB/s", 4 * act + stats, b.time_ms([&] { norm_forward(fr); }));
  TensorView dout = b.rand(DType::BF16, {N, C}), dinp = b.arena->tensor(DType::BF16, {N, C});
  TensorView dw = b.arena->tensor(DType::F32, {C}), db = b.arena->tensor(DType::F32, {C});
  CUDA_CHECK(cudaMemset(dw.data, 0, dw.nbytes()));
  CUDA_CHECK(cudaMemset(db.data, 0, db.nbytes()));
  norm_forward(f);
  NormBackwardArgs bw;
  bw.type = type;
  bw.dinp = dinp; bw.dweight = dw;
  if (ln) bw.dbias = db;
  bw.dout = dout; bw.inp = x; bw.weight = w; bw.mean = mean; bw.rstd = rstd;
  bw.accumulate_dinp = false;  // torch's backward writes a fresh gradient: compare like with like
  bw.ctx = b.ctx;
  b.record(fmt::format("{}_bwd/{}", nm, model), "GB/s", 3 * act + stats, b.time_ms([&] { norm_backward(bw); }));
}

void bench_activations(Bench& b) {
  ArenaScope s(*b.arena);
  const int64_t n = kTokens * 3072;  // GPT-2 MLP hidden
  TensorView x = b.rand(DType::BF16, {n}, 3.0f), y = b.arena->tensor(DType::BF16, {n}), dy = b.rand(DType::BF16, {n});
  TensorView dx = b.arena->tensor(DType::BF16, {n});
  const double e = static_cast<double>(n) * 2;
  b.record("gelu_fwd/gpt2", "GB/s", 2 * e, b.time_ms([&] { activation_forward({Activation::Gelu, y, x, b.ctx}); }));
  b.record("gelu_bwd/gpt2", "GB/s", 3 * e,
           b.time_ms([&] { activation_backward({Activation::Gelu, dx, x, dy, false, b.ctx}); }));
  ArenaScope s2(*b.arena);
  const int64_t F = 8192;  // Llama-3.2-1B intermediate size
  TensorView gu = b.rand(DType::BF16, {kTokens, 2 * F}, 3.0f), o = b.arena->tensor(DType::BF16, {kTokens, F});
  TensorView dgo = b.rand(DType::BF16, {kTokens, F}), dgu = b.arena->tensor(DType::BF16, {kTokens, 2 * F});
  const double f = static_cast<double>(kTokens * F) * 2;
  b.record("swiglu_fwd/llama", "GB/s", 3 * f, b.time_ms([&] { activation_forward({Activation::SwiGLU, o, gu, b.ctx}); }));
  b.record("swiglu_bwd/llama", "GB/s", 5 * f,
           b.time_ms([&] { activation_backward({Activation::SwiGLU, dgu, gu, dgo, false, b.ctx}); }));
}

void bench_rope(Bench& b) {
  ArenaScope s(*b.arena);
  const int64_t B = 8, T = 2048, H = 32, D = 64;  // Llama-3.2-1B queries, 16384 tokens
  TensorView table = b.arena->tensor(DType::F32, {T, D / 2, 2});
  rope_build_table(table, 500000.0, b.ctx);
  TensorView q = b.rand(DType::BF16, {B, T, H, D}), o = b.arena->tensor(DType::BF16, {B, T, H, D});
  RopeArgs a;
  a.out = o; a.inp = q; a.table = table; a.base = 500000.0; a.ctx = b.ctx;
  const double bytes = 2.0 * static_cast<double>(q.nbytes());
  b.record("rope_fwd/llama", "GB/s", bytes, b.time_ms([&] { rope(a); }));
  RopeArgs bw = a;
  bw.backward = true;
  b.record("rope_bwd/llama", "GB/s", bytes, b.time_ms([&] { rope(bw); }));
}

void bench_embedding(Bench& b) {
  ArenaScope s(*b.arena);
  const int64_t B = 16, T = 1024, C = 768, V = 50304;
  TensorView wte = b.rand(DType::BF16, {V, C}), wpe = b.rand(DType::BF16, {T, C});
  TensorView tok = b.arena->tensor(DType::I32, {B, T}), out = b.arena->tensor(DType::BF16, {B, T, C});
  pb::fill_ints(tok.ptr<int32_t>(), tok.numel(), b.seed++, static_cast<int32_t>(V));
  EmbeddingArgs f;
  f.out = out; f.tokens = tok; f.wte = wte; f.wpe = wpe; f.ctx = b.ctx;
  const double act = static_cast<double>(out.nbytes());
  b.record("embedding_fwd/gpt2", "GB/s", 3 * act, b.time_ms([&] { embedding_forward(f); }));
  TensorView dout = b.rand(DType::BF16, {B, T, C});
  TensorView dwte = b.arena->tensor(DType::F32, {V, C}), dwpe = b.arena->tensor(DType::F32, {T, C});
  CUDA_CHECK(cudaMemset(dwte.data, 0, dwte.nbytes()));
  CUDA_CHECK(cudaMemset(dwpe.data, 0, dwpe.nbytes()));
  EmbeddingArgs bw;
  bw.dout = dout; bw.dwte = dwte; bw.dwpe = dwpe; bw.tokens = tok; bw.ctx = b.ctx;
  // dout read once per table, touched dwte/dwpe rows read and written in f32.
  b.record("embedding_bwd/gpt2", "GB/s", 2 * act + 2.0 * 2 * (B * T * C * 4), b.time_ms([&] { embedding_backward(bw); }));
}

void bench_cross_entropy(Bench& b, const char* model, int64_t Vp, int64_t V) {
  ArenaScope s(*b.arena);
  const int64_t N = kTokens;
  TensorView logits = b.rand(DType::BF16, {N, Vp}, 4.0f), tgt = b.arena->tensor(DType::I32, {N});
  TensorView losses = b.arena->tensor(DType::F32, {N});
  pb::fill_ints(tgt.ptr<int32_t>(), N, b.seed++, static_cast<int32_t>(V));
  CrossEntropyArgs a;
  a.logits = logits; a.dlogits = logits; a.losses = losses; a.targets = tgt; a.vocab = V;
  a.dloss = 1.0f / static_cast<float>(N);
  a.ctx = b.ctx;
  // In place, so each timed call sees the previous call's gradients as logits: same traffic.
  b.record(fmt::format("cross_entropy_fwdbwd/{}", model), "GB/s", 2.0 * static_cast<double>(logits.nbytes()),
           b.time_ms([&] { cross_entropy(a); }));
}

// GPT-2 124M's parameter tensors (tied head), as torch_ops.py lists them.
std::vector<int64_t> gpt2_param_sizes() {
  const int64_t C = 768, V = 50304, T = 1024, L = 12;
  std::vector<int64_t> s = {V * C, T * C};
  for (int64_t l = 0; l < L; ++l)
    for (int64_t n : {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C}) s.push_back(n);
  s.push_back(C);
  s.push_back(C);
  return s;
}

void bench_optimizer(Bench& b) {
  ArenaScope s(*b.arena);
  std::vector<AdamWTensor> ts;
  int64_t total = 0;
  for (int64_t n : gpt2_param_sizes()) {
    AdamWTensor t;
    t.master = b.rand(DType::F32, {n});
    t.model = b.arena->tensor(DType::BF16, {n});
    t.grad = b.rand(DType::F32, {n}, 0.01f);
    t.m = b.rand(DType::F32, {n}, 0.001f);
    t.v = b.arena->tensor(DType::F32, {n});  // second moments are positive
    pb::fill_uniform(t.v.data, DType::F32, n, b.seed++, 1e-6f, 1e-6f);
    t.decay = n > 4 * 768;  // matrices decay, vectors do not
    ts.push_back(t);
    total += n;
  }
  MultiTensorAdamW with_copy(ts, b.arena);
  for (auto& t : ts) t.model = {};
  MultiTensorAdamW no_copy(ts, b.arena);
  AdamWHyper hp;
  hp.lr = 1e-4f;
  hp.weight_decay = 0.1f;
  hp.step = 10;
  TensorView norm = b.arena->tensor(DType::F32, {2});
  const auto p = static_cast<double>(total);
  b.record("adamw/gpt2-124M", "GB/s", 28.0 * p, b.time_ms([&] { no_copy.step(hp, {}, {}, b.ctx); }),
           fmt::format("{} params, f32 grads, no bf16 copy", total));
  b.record("adamw+bf16copy/gpt2-124M", "GB/s", 30.0 * p,
           b.time_ms([&] { with_copy.step(hp, norm.slice0(1, 2), {}, b.ctx); }), "with bf16 model copy and clip scale");
  b.record("grad_norm/gpt2-124M", "GB/s", 4.0 * p, b.time_ms([&] { no_copy.grad_norm(norm, 1.0f, b.ctx); }));
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) out_path = argv[++i];
    else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
    else {
      std::fprintf(stderr, "usage: primus_ops_bench [--out results.jsonl] [--only gemm|mem]\n");
      return 2;
    }
  }
  try {
    if (cuda_device_count_or_zero() == 0) {
      std::fprintf(stderr, "primus_ops_bench: no CUDA device\n");
      return 3;
    }
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, %.0f MB L2\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6);
    auto arena = make_device_arena(size_t{24} << 30);
    auto scratch = make_device_arena(size_t{1} << 30);
    Bench b;
    b.arena = arena.get();
    b.ctx.scratch = scratch.get();
    if (!out_path.empty()) b.out = std::fopen(out_path.c_str(), "w");
    bench_copy(b);
    if (only.empty() || only == "gemm") {
      const Linear shapes[] = {
          {"gpt2", "qkv", 768, 2304},          {"gpt2", "attn_proj", 768, 768}, {"gpt2", "fc", 768, 3072},
          {"gpt2", "fc_proj", 3072, 768},      {"gpt2", "lm_head", 768, 50304}, {"llama", "q_o", 2048, 2048},
          {"llama", "kv", 2048, 1024},         {"llama", "gate_up", 2048, 16384}, {"llama", "down", 8192, 2048},
          {"llama", "lm_head", 2048, 128256}};
      for (const Linear& l : shapes) bench_gemm(b, l, "");
      // cuBLASLt's top 8 candidates timed once per shape (PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH=8).
      cublaslt::set_algo_search(8);
      for (const Linear& l : shapes) bench_gemm(b, l, "+search");
      cublaslt::set_algo_search(1);
    }
    if (only.empty() || only == "mem") {
      bench_norms(b, "gpt2", NormType::LayerNorm, 768);
      bench_norms(b, "llama", NormType::RMSNorm, 2048);
      bench_activations(b);
      bench_rope(b);
      bench_embedding(b);
      bench_cross_entropy(b, "gpt2", 50304, 50257);
      bench_cross_entropy(b, "llama", 128256, 128256);
      bench_optimizer(b);
    }
    if (b.out) std::fclose(b.out);
    CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "primus_ops_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
