// The memory-bound ops, in GB/s of their minimal traffic (each input read once, each output
// written once): norms, activations, RoPE, embeddings, cross-entropy, AdamW and grad norm.
// Default cases: GPT-2 124M and Llama-3.2-1B at 16384 tokens on a GPU; small ones on the host.
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "turbo/bench/harness.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/embedding.h"
#include "turbo/ops/head_norm.h"
#include "turbo/ops/loss.h"
#include "turbo/ops/normalization.h"
#include "turbo/ops/optimizer.h"
#include "turbo/ops/rope.h"

namespace primus::turbo::bench {
namespace {

double bytes_of(DType t, int64_t n) { return static_cast<double>(dtype_size(t)) * static_cast<double>(n); }

// ---- norm: forward, forward fused with the residual add, backward -----------------------------
Case norm_case(const std::string& label, NormType type, int64_t N, int64_t C) {
  const bool ln = type == NormType::LayerNorm;
  const std::string nm = ln ? "layernorm" : "rmsnorm";
  return {nm + "/" + label, [=](CaseEnv& e) {
            TensorView x = e.rand(e.dtype, {N, C}), r = e.rand(e.dtype, {N, C});
            TensorView w = e.rand(e.dtype, {C}), bias = e.rand(e.dtype, {C});
            TensorView mean = e.empty(DType::F32, {N}), rstd = e.empty(DType::F32, {N});
            const double act = bytes_of(e.dtype, N * C), stats = bytes_of(DType::F32, N) * (ln ? 2 : 1);
            NormForwardArgs f;
            f.type = type;
            f.out = e.empty(e.dtype, {N, C});
            f.mean = mean;
            f.rstd = rstd;
            f.inp = x;
            f.weight = w;
            if (ln) f.bias = bias;
            f.ctx = e.ctx;
            NormForwardArgs fr = f;
            fr.residual = r;
            fr.residual_out = e.empty(e.dtype, {N, C});
            NormBackwardArgs bw;
            bw.type = type;
            bw.dinp = e.empty(e.dtype, {N, C});
            bw.dweight = e.zeros(DType::F32, {C});
            if (ln) bw.dbias = e.zeros(DType::F32, {C});
            bw.dout = e.rand(e.dtype, {N, C});
            bw.inp = x;
            bw.weight = w;
            bw.mean = mean;
            bw.rstd = rstd;
            bw.accumulate_dinp = false;  // torch's backward writes a fresh gradient: compare like with like
            bw.ctx = e.ctx;
            norm_forward(f);  // the statistics the backward reads
            // The training step's form: dinp += into the residual gradient (one more read), with
            // the column sums of dinp (the residual writers' bias gradients) from the same pass.
            NormBackwardArgs bwa = bw;
            bwa.accumulate_dinp = true;
            bwa.dinp_colsum = e.zeros(DType::F32, {C});
            std::vector<Timed> calls{
                {nm + "_fwd/" + label, Metric::Bytes, 2 * act + stats, [f] { norm_forward(f); }, ""},
                {"add_" + nm + "_fwd/" + label, Metric::Bytes, 4 * act + stats, [fr] { norm_forward(fr); }, ""},
                {nm + "_bwd/" + label, Metric::Bytes, 3 * act + stats, [bw] { norm_backward(bw); }, ""},
                {nm + "_bwd_acc_colsum/" + label, Metric::Bytes, 4 * act + stats, [bwa] { norm_backward(bwa); },
                 "dinp += and dinp_colsum"}};
            // A/B on a device: the other kernels and the staged kernel's stage counts, selected per
            // call through their environment switches (restored afterwards), timed in the same run.
            if (e.on_device()) {
              auto variant = [&](const std::string& name, double bytes, const NormBackwardArgs& a, const char* var,
                                 const char* value) {
                calls.push_back({name, Metric::Bytes, bytes,
                                 [a, var, value] {
                                   const char* old = std::getenv(var);
                                   const std::string saved = old ? old : "";
                                   ::setenv(var, value, 1);
                                   norm_backward(a);
                                   if (old) ::setenv(var, saved.c_str(), 1);
                                   else ::unsetenv(var);
                                 },
                                 fmt::format("{}={}", var, value)});
              };
              const char* kKernel = "PRIMUS_TURBO_NORM_BWD_KERNEL";
              const char* kStages = "PRIMUS_TURBO_NORM_BWD_STAGES";
              // The staged kernel (the default) takes rows of up to 1536 bytes (768 bf16 / 384 f32);
              // longer ones run the row-group kernel by default already.
              const bool staged = bytes_of(e.dtype, C) <= 1536;
              if (staged) variant(nm + "_bwd/" + label + "/rowgroup", 3 * act + stats, bw, kKernel, "rowgroup");
              variant(nm + "_bwd/" + label + "/legacy", 3 * act + stats, bw, kKernel, "legacy");
              if (staged) {
                variant(nm + "_bwd_acc_colsum/" + label + "/rowgroup", 4 * act + stats, bwa, kKernel, "rowgroup");
                variant(nm + "_bwd_acc_colsum/" + label + "/stages2", 4 * act + stats, bwa, kStages, "2");
                variant(nm + "_bwd_acc_colsum/" + label + "/stages4", 4 * act + stats, bwa, kStages, "4");
              }
            }
            return calls;
          }};
}

// ---- activation: GELU over [N, C], SwiGLU [N, 2C] -> [N, C] ------------------------------------
Case gelu_case(const std::string& label, int64_t N, int64_t C) {
  return {"gelu/" + label, [=](CaseEnv& e) {
            TensorView x = e.rand(e.dtype, {N, C}, 3.0f), y = e.empty(e.dtype, {N, C});
            TensorView dy = e.rand(e.dtype, {N, C}), dx = e.empty(e.dtype, {N, C});
            const double a = bytes_of(e.dtype, N * C);
            const ActivationForwardArgs f{Activation::Gelu, y, x, e.ctx};
            const ActivationBackwardArgs b{Activation::Gelu, dx, x, dy, false, e.ctx};
            return std::vector<Timed>{{"gelu_fwd/" + label, Metric::Bytes, 2 * a, [f] { activation_forward(f); }, ""},
                                      {"gelu_bwd/" + label, Metric::Bytes, 3 * a, [b] { activation_backward(b); }, ""}};
          }};
}
Case swiglu_case(const std::string& label, int64_t N, int64_t F) {
  return {"swiglu/" + label, [=](CaseEnv& e) {
            TensorView gu = e.rand(e.dtype, {N, 2 * F}, 3.0f), o = e.empty(e.dtype, {N, F});
            TensorView dgo = e.rand(e.dtype, {N, F}), dgu = e.empty(e.dtype, {N, 2 * F});
            const double a = bytes_of(e.dtype, N * F);
            const ActivationForwardArgs f{Activation::SwiGLU, o, gu, e.ctx};
            const ActivationBackwardArgs b{Activation::SwiGLU, dgu, gu, dgo, false, e.ctx};
            // With the maxima the rowwise / tensorwise FP8 quantizer takes from them (fp8 recipes'
            // handoff): the same bytes moved, so the rate says what taking them costs.
            ActivationForwardArgs fm = f;
            fm.maxima = e.empty(DType::F32, {N + F + 1});
            ActivationBackwardArgs bm = b;
            bm.maxima = e.empty(DType::F32, {N + 2 * F + 1});
            return std::vector<Timed>{
                {"swiglu_fwd/" + label, Metric::Bytes, 3 * a, [f] { activation_forward(f); }, ""},
                {"swiglu_bwd/" + label, Metric::Bytes, 5 * a, [b] { activation_backward(b); }, ""},
                {"swiglu_fwd_maxima/" + label, Metric::Bytes, 3 * a, [fm] { activation_forward(fm); }, ""},
                {"swiglu_bwd_maxima/" + label, Metric::Bytes, 5 * a, [bm] { activation_backward(bm); }, ""}};
          }};
}

// ---- rope: queries [B, T, H, D], forward and backward ----------------------------------------
Case rope_case(const std::string& label, int64_t B, int64_t T, int64_t H, int64_t D) {
  return {"rope/" + label, [=](CaseEnv& e) {
            RopeArgs a;
            a.inp = e.rand(e.dtype, {B, T, H, D});
            a.out = e.empty(e.dtype, {B, T, H, D});
            a.base = 500000.0;
            a.ctx = e.ctx;
            if (e.on_device()) {  // the device kernels read a cos/sin table; the CPU uses `base`
              a.table = e.empty(DType::F32, {T, D / 2, 2});
              rope_build_table(a.table, a.base, e.ctx);
            }
            RopeArgs bw = a;
            bw.backward = true;
            const double bytes = 2.0 * bytes_of(e.dtype, B * T * H * D);
            return std::vector<Timed>{{"rope_fwd/" + label, Metric::Bytes, bytes, [a] { rope(a); }, ""},
                                      {"rope_bwd/" + label, Metric::Bytes, bytes, [bw] { rope(bw); }, ""}};
          }};
}

// ---- head_norm: Qwen3's per-head q|k RMSNorm, in place on the packed q|k|v rows ----------------
// Traffic: forward reads q|k, writes it and the saved copy; backward reads d(q|k) and the saved
// copy, writes d(q|k) (rstd and the weights are small).
Case head_norm_case(const std::string& label, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D) {
  return {"head_norm/" + label, [=](CaseEnv& e) {
            const int64_t W = (H + 2 * KV) * D, Hx = H + KV;
            TensorView packed = e.rand(e.dtype, {B, T, W});
            TensorView x(packed.data, e.dtype, packed.device, {B, T, Hx, D});
            x.strides = {T * W, W, D, 1};
            HeadNormArgs f;
            f.x = x;
            f.saved = e.empty(e.dtype, {B, T, Hx, D});
            f.rstd = e.empty(DType::F32, {B * T * Hx});
            f.weight = e.rand(e.dtype, {D});
            f.weight_k = e.rand(e.dtype, {D});
            f.q_heads = H;
            f.ctx = e.ctx;
            HeadNormArgs bw = f;
            bw.backward = true;
            bw.dweight = e.zeros(DType::F32, {D});
            bw.dweight_k = e.zeros(DType::F32, {D});
            const double qk = bytes_of(e.dtype, B * T * Hx * D);
            return std::vector<Timed>{{"head_norm_fwd/" + label, Metric::Bytes, 3 * qk, [f] { head_norm(f); }, ""},
                                      {"head_norm_bwd/" + label, Metric::Bytes, 3 * qk, [bw] { head_norm(bw); }, ""}};
          }};
}

// ---- embedding: token + position tables, forward and (deterministic) backward ------------------
// `ids`: tokens drawn from the first `ids` rows only (0: all V). Few ids give long runs of one
// token in the backward, as real text's frequent tokens do (mock data's uniform tokens do not).
Case embedding_case(const std::string& label, int64_t B, int64_t T, int64_t C, int64_t V, int64_t ids = 0) {
  return {"embedding/" + label, [=](CaseEnv& e) {
            EmbeddingArgs f;
            f.wte = e.rand(e.dtype, {V, C});
            f.wpe = e.rand(e.dtype, {T, C});
            f.tokens = e.ints({B, T}, static_cast<int32_t>(ids > 0 ? std::min(ids, V) : V));
            f.out = e.empty(e.dtype, {B, T, C});
            f.ctx = e.ctx;
            EmbeddingArgs bw;
            bw.dout = e.rand(e.dtype, {B, T, C});
            bw.dwte = e.zeros(DType::F32, {V, C});
            bw.dwpe = e.zeros(DType::F32, {T, C});
            bw.tokens = f.tokens;
            bw.ctx = e.ctx;
            const double act = bytes_of(e.dtype, B * T * C);
            // Backward: dout read once per table; the touched f32 rows of dwte and dwpe read and written.
            const double bwd = 2 * act + 2.0 * 2 * bytes_of(DType::F32, B * T * C);
            return std::vector<Timed>{{"embedding_fwd/" + label, Metric::Bytes, 3 * act, [f] { embedding_forward(f); }, ""},
                                      {"embedding_bwd/" + label, Metric::Bytes, bwd, [bw] { embedding_backward(bw); }, ""}};
          }};
}

// ---- loss: fused softmax cross-entropy forward + backward, in place ---------------------------
Case loss_case(const std::string& label, int64_t N, int64_t Vp, int64_t V) {
  return {"cross_entropy/" + label, [=](CaseEnv& e) {
            CrossEntropyArgs a;
            a.logits = e.rand(e.dtype, {N, Vp}, 4.0f);
            a.dlogits = a.logits;  // in place: each call sees the previous gradients as logits, same traffic
            a.losses = e.empty(DType::F32, {N});
            a.targets = e.ints({N}, static_cast<int32_t>(V));
            a.vocab = V;
            a.dloss = 1.0f / static_cast<float>(N);
            a.ctx = e.ctx;
            const double bytes = 2.0 * bytes_of(e.dtype, N * Vp);
            std::vector<Timed> t{{"cross_entropy_fwdbwd/" + label, Metric::Bytes, bytes, [a] { cross_entropy(a); }, ""}};
            if (e.on_device()) {  // A/B: the legacy two-read kernel (the default is the on-chip one where it applies)
              CrossEntropyArgs l = a;
              l.legacy_kernel = true;
              t.push_back({"cross_entropy_fwdbwd/" + label + "/legacy", Metric::Bytes, bytes, [l] { cross_entropy(l); },
                           "two reads of each row"});
              if (cross_entropy_turbo_cluster(e.dtype, Vp) > 1) {  // rows over a cluster: streamed by default
                CrossEntropyArgs o = a;
                o.one_row_per_cluster = true;
                t.push_back({"cross_entropy_fwdbwd/" + label + "/one_row_per_cluster", Metric::Bytes, bytes,
                             [o] { cross_entropy(o); }, "one cluster per row, not streamed"});
              }
            }
            return t;
          }};
}

// ---- optimizer: AdamW over every parameter in one launch, and the global grad norm ------------
// GPT-2 124M's parameter tensors (tied head), as bench/ops/torch_ops.py lists them.
std::vector<int64_t> gpt2_param_sizes() {
  const int64_t C = 768, V = 50304, T = 1024, L = 12;
  std::vector<int64_t> s = {V * C, T * C};
  for (int64_t l = 0; l < L; ++l)
    for (int64_t n : {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C}) s.push_back(n);
  s.push_back(C);
  s.push_back(C);
  return s;
}

Case optimizer_case(const std::string& label, std::vector<int64_t> sizes) {
  return {"adamw/" + label, [=](CaseEnv& e) {
            std::vector<AdamWTensor> ts;
            int64_t total = 0;
            // The bf16 model copy exists only on the device (the CPU backend keeps f32 weights only).
            const bool copy = e.on_device() && e.dtype == DType::BF16;
            for (int64_t n : sizes) {
              AdamWTensor t;
              t.master = e.rand(DType::F32, {n});
              if (copy) t.model = e.empty(DType::BF16, {n});
              t.grad = e.rand(DType::F32, {n}, 0.01f);
              t.m = e.rand(DType::F32, {n}, 0.001f);
              t.v = e.rand(DType::F32, {n}, 1e-6f, 1e-6f);  // second moments are positive
              t.decay = n > 4 * 768;                         // matrices decay, vectors do not
              ts.push_back(t);
              total += n;
            }
            Arena* arena = e.on_device() ? &e.dev.arena() : nullptr;
            std::shared_ptr<MultiTensorAdamW> with_copy;
            if (copy) with_copy = std::make_shared<MultiTensorAdamW>(ts, arena);
            for (auto& t : ts) t.model = {};
            auto no_copy = std::make_shared<MultiTensorAdamW>(ts, arena);
            AdamWHyper hp;
            hp.lr = 1e-4f;
            hp.weight_decay = 0.1f;
            hp.step = 10;
            TensorView norm = e.empty(DType::F32, {2});
            const auto p = static_cast<double>(total);
            const ExecContext ctx = e.ctx;
            std::vector<Timed> out{{"adamw/" + label, Metric::Bytes, 28.0 * p,
                                    [no_copy, hp, ctx] { no_copy->step(hp, {}, {}, ctx); },
                                    fmt::format("{} params, f32 grads, no bf16 copy", total)}};
            if (with_copy)
              out.push_back({"adamw+bf16copy/" + label, Metric::Bytes, 30.0 * p,
                             [with_copy, hp, norm, ctx] { with_copy->step(hp, norm.slice0(1, 2), {}, ctx); },
                             "with bf16 model copy and clip scale"});
            out.push_back({"grad_norm/" + label, Metric::Bytes, 4.0 * p,
                           [no_copy, norm, ctx] { no_copy->grad_norm(norm, 1.0f, ctx); }, ""});
            if (with_copy) with_copy->grad_norm(norm, 1.0f, ctx);  // a defined clip scale for the copy variant
            return out;
          }};
}

// One --shapes entry that runs two cases on the same shape (LayerNorm and RMSNorm, GELU and SwiGLU).
Case both(const std::string& name, Case first, Case second) {
  return {name, [first, second](CaseEnv& e) {
            auto calls = first.build(e), more = second.build(e);
            calls.insert(calls.end(), more.begin(), more.end());
            return calls;
          }};
}

OpFamily family(const char* name, std::vector<std::string> dispatch, const char* syntax) {
  OpFamily f;
  f.name = name;
  f.bench = "ops";
  f.dispatch_ops = std::move(dispatch);
  f.backends = {BackendType::TURBO, BackendType::CPU};
  f.shape_syntax = syntax;
  return f;
}

}  // namespace

OpFamily norm_family() {
  OpFamily f = family("norm", {"norm"}, "NxC (rows x features): LayerNorm and RMSNorm");
  f.defaults = [](const Scale& s) {
    std::vector<Case> c{norm_case("gpt2", NormType::LayerNorm, s.tokens, 768)};
    if (s.gpu) c.push_back(norm_case("llama", NormType::RMSNorm, s.tokens, 2048));
    return c;
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("norm", shape, 2, syntax);
    return both(shape, norm_case(shape, NormType::LayerNorm, d[0], d[1]), norm_case(shape, NormType::RMSNorm, d[0], d[1]));
  };
  return f;
}

OpFamily activation_family() {
  OpFamily f = family("activation", {"activation"}, "NxC (rows x features): GELU over [N,C], SwiGLU [N,2C] -> [N,C]");
  f.defaults = [](const Scale& s) {
    std::vector<Case> c{gelu_case("gpt2", s.tokens, 3072)};
    if (s.gpu) c.push_back(swiglu_case("llama", s.tokens, 8192));
    else c.push_back(swiglu_case("small", s.tokens, 1024));
    return c;
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("activation", shape, 2, syntax);
    return both(shape, gelu_case(shape, d[0], d[1]), swiglu_case(shape, d[0], d[1]));
  };
  return f;
}

OpFamily rope_family() {
  OpFamily f = family("rope", {"rope"}, "BxTxHxD (batch x sequence x heads x head dim)");
  f.defaults = [](const Scale& s) {
    // Llama-3.2-1B queries: 32 heads of 64.
    return std::vector<Case>{s.gpu ? rope_case("llama", s.tokens / 2048, 2048, 32, 64) : rope_case("small", 1, s.tokens, 8, 64)};
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("rope", shape, 4, syntax);
    return rope_case(shape, d[0], d[1], d[2], d[3]);
  };
  return f;
}

OpFamily head_norm_family() {
  OpFamily f = family("head_norm", {"head_norm"}, "BxTxHxKVxD (batch x sequence x query heads x kv heads x head dim)");
  f.defaults = [](const Scale& s) {
    // Qwen3-0.6B / 1.7B: 16 query and 8 kv heads of 128; Qwen3-30B-A3B: 32 and 4.
    if (!s.gpu) return std::vector<Case>{head_norm_case("small", 1, s.tokens, 4, 2, 64)};
    return std::vector<Case>{head_norm_case("qwen3-0.6B", s.tokens / 2048, 2048, 16, 8, 128),
                             head_norm_case("qwen3-30B-A3B", s.tokens / 2048, 2048, 32, 4, 128)};
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("head_norm", shape, 5, syntax);
    return head_norm_case(shape, d[0], d[1], d[2], d[3], d[4]);
  };
  return f;
}

OpFamily embedding_family() {
  OpFamily f = family("embedding", {"embedding"}, "BxTxCxV (batch x sequence x features x vocabulary)");
  f.defaults = [](const Scale& s) {
    if (!s.gpu) return std::vector<Case>{embedding_case("small", 1, s.tokens, 256, 4096)};
    // Uniform tokens, and 64 ids (runs of ~256 rows per id in a 16k-token batch, like text's most
    // frequent tokens).
    return std::vector<Case>{embedding_case("gpt2", s.tokens / 1024, 1024, 768, 50304),
                             embedding_case("gpt2-64ids", s.tokens / 1024, 1024, 768, 50304, 64)};
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("embedding", shape, 4, syntax);
    return embedding_case(shape, d[0], d[1], d[2], d[3]);
  };
  return f;
}

OpFamily loss_family() {
  OpFamily f = family("loss", {"cross_entropy"}, "NxV (rows x vocabulary)");
  f.defaults = [](const Scale& s) {
    if (!s.gpu) return std::vector<Case>{loss_case("small", s.tokens, 4096, 4096)};
    return std::vector<Case>{loss_case("gpt2", s.tokens, 50304, 50257), loss_case("llama", s.tokens, 128256, 128256)};
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("loss", shape, 2, syntax);
    return loss_case(shape, d[0], d[1], d[1]);
  };
  return f;
}

OpFamily optimizer_family() {
  OpFamily f = family("optimizer", {"optimizer"}, "P (parameters, one tensor)");
  f.defaults = [](const Scale& s) {
    if (!s.gpu) return std::vector<Case>{optimizer_case("4M", {int64_t{1} << 22})};
    return std::vector<Case>{optimizer_case("gpt2-124M", gpt2_param_sizes())};
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("optimizer", shape, 1, syntax);
    return optimizer_case(shape, {d[0]});
  };
  return f;
}

}  // namespace primus::turbo::bench
