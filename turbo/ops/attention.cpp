#include "turbo/ops/attention.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "turbo/kernels/cpu/attention.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/attention_flash.h"
#endif
#ifdef PRIMUS_TURBO_WITH_CUDNN
#include "turbo/kernels/cudnn/cudnn_api.h"
#include "turbo/kernels/cudnn/sdpa_cudnn.h"
#endif

namespace primus::turbo {
namespace {

struct AttentionDims {
  int64_t B, T, H, KVH, D;
};

int64_t num_docs(const AttentionOptions& o) { return o.cu_seqlens.defined() ? o.cu_seqlens.numel() - 1 : 0; }

AttentionDims validate_common(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& out, const TensorView& lse, const AttentionOptions& opt) {
  check_defined(q, op, "q");
  if (q.ndim != 4) throw RuntimeError(fmt::format("{}: q must be [B,T,H,D], got {}", op, q.describe()));
  const AttentionDims d{q.size(0), q.size(1), q.size(2), k.defined() && k.ndim == 4 ? k.size(2) : 0, q.size(3)};
  check_shape(k, {d.B, d.T, d.KVH, d.D}, op, "k");
  check_shape(v, {d.B, d.T, d.KVH, d.D}, op, "v");
  check_shape(out, {d.B, d.T, d.H, d.D}, op, "out");
  check_shape(lse, {d.B, d.H, d.T}, op, "lse");
  if (d.KVH <= 0 || d.H % d.KVH != 0)
    throw RuntimeError(fmt::format("{}: H={} is not a multiple of KVH={}", op, d.H, d.KVH));
  // q, k, v may be column slices of one packed projection (token rows strided); out, lse dense.
  for (auto [name, t] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}}) {
    detail::token_rows(*t, op, name);
    check_same_device(q, *t, op);
  }
  for (auto [name, t] : {std::pair{"out", &out}, {"lse", &lse}}) {
    check_contiguous(*t, op, name);
    check_same_device(q, *t, op);
  }
  for (auto [name, t] : {std::pair{"k", &k}, {"v", &v}, {"out", &out}}) check_dtype(*t, q.dtype, op, name);
  check_dtype(lse, DType::F32, op, "lse");
  if (opt.window < 0)
    throw RuntimeError(fmt::format("{}: window must be >= 0 (0: no sliding window), got {}", op, opt.window));
  if (opt.window > 0 && !opt.causal)
    throw RuntimeError(fmt::format("{}: a sliding window (window={}) needs causal attention", op, opt.window));
  if (opt.cu_seqlens.defined()) {
    check_dtype(opt.cu_seqlens, DType::I32, op, "cu_seqlens");
    check_same_device(q, opt.cu_seqlens, op);
    if (opt.cu_seqlens.ndim != 1 || opt.cu_seqlens.numel() < 2)
      throw RuntimeError(fmt::format("{}: cu_seqlens must be i32 [num_docs+1] with num_docs >= 1, got {}", op,
                                     opt.cu_seqlens.describe()));
  }
  return d;
}

AttentionDims dims_of(const TensorView& q, const TensorView& k) {
  return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
}

void validate(const AttentionForwardArgs& a) { validate_common("attention_forward", a.q, a.k, a.v, a.out, a.lse, a.opt); }

void validate(const AttentionBackwardArgs& a) {
  const char* op = "attention_backward";
  const AttentionDims d = validate_common(op, a.q, a.k, a.v, a.out, a.lse, a.opt);
  check_shape(a.dout, {d.B, d.T, d.H, d.D}, op, "dout");
  check_shape(a.dq, {d.B, d.T, d.H, d.D}, op, "dq");
  check_shape(a.dk, {d.B, d.T, d.KVH, d.D}, op, "dk");
  check_shape(a.dv, {d.B, d.T, d.KVH, d.D}, op, "dv");
  check_contiguous(a.dout, op, "dout");
  for (auto [name, t] : {std::pair{"dq", &a.dq}, {"dk", &a.dk}, {"dv", &a.dv}}) detail::token_rows(*t, op, name);
  for (auto [name, t] : {std::pair{"dout", &a.dout}, {"dq", &a.dq}, {"dk", &a.dk}, {"dv", &a.dv}}) {
    check_same_device(a.q, *t, op);
    check_dtype(*t, a.q.dtype, op, name);
  }
}

bool any_strided(std::initializer_list<const TensorView*> ts) {
  for (const TensorView* t : ts)
    if (t->defined() && !t->is_contiguous()) return true;
  return false;
}

// ---- CPU (reference) -----------------------------------------------------------------------

cpu::AttentionParams cpu_params(const AttentionDims& d, const AttentionOptions& o) {
  cpu::AttentionParams p;
  p.B = d.B, p.T = d.T, p.H = d.H, p.KVH = d.KVH, p.D = d.D;
  p.causal = o.causal;
  p.window = o.window;
  p.softmax_scale = o.scale(d.D);
  if (o.cu_seqlens.defined()) {
    p.cu_seqlens = o.cu_seqlens.ptr<const int32_t>();
    p.num_docs = num_docs(o);
  }
  return p;
}

std::string cpu_check_fwd(const AttentionForwardArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"q", &a.q}, {"cu_seqlens", &a.opt.cu_seqlens}}); !w.empty()) return w;
  return detail::all_dtype(DType::F32, {{"q", &a.q}});
}
void cpu_fwd(const AttentionForwardArgs& args) {
  detail::DenseRows dense(args.ctx, "attention_forward");
  AttentionForwardArgs a = args;
  a.q = dense.in(args.q), a.k = dense.in(args.k), a.v = dense.in(args.v);
  cpu::attention_forward<float>(a.out.ptr<float>(), a.lse.ptr<float>(), a.q.ptr<const float>(), a.k.ptr<const float>(),
                                a.v.ptr<const float>(), cpu_params(dims_of(a.q, a.k), a.opt));
}
std::string cpu_check_bwd(const AttentionBackwardArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"q", &a.q}, {"cu_seqlens", &a.opt.cu_seqlens}}); !w.empty()) return w;
  return detail::all_dtype(DType::F32, {{"q", &a.q}});
}
void cpu_bwd(const AttentionBackwardArgs& args) {
  detail::DenseRows dense(args.ctx, "attention_backward");
  AttentionBackwardArgs a = args;
  a.q = dense.in(args.q), a.k = dense.in(args.k), a.v = dense.in(args.v);
  a.dq = dense.out(args.dq), a.dk = dense.out(args.dk), a.dv = dense.out(args.dv);
  // The reference accumulates; this op overwrites.
  for (const TensorView* t : {&a.dq, &a.dk, &a.dv}) std::memset(t->data, 0, t->nbytes());
  cpu::attention_backward<float>(a.dq.ptr<float>(), a.dk.ptr<float>(), a.dv.ptr<float>(), a.dout.ptr<const float>(),
                                 a.q.ptr<const float>(), a.k.ptr<const float>(), a.v.ptr<const float>(),
                                 a.out.ptr<const float>(), a.lse.ptr<const float>(), cpu_params(dims_of(a.q, a.k), a.opt));
  dense.finish(args.dq, a.dq), dense.finish(args.dk, a.dk), dense.finish(args.dv, a.dv);
}

// ---- TURBO (in-house CUDA kernels) -----------------------------------------------------------
#ifdef PRIMUS_TURBO_WITH_CUDA
// The TURBO kernels read and write 16-byte vectors (TMA, cp.async, vector stores): "" when every
// dense tensor starts 16-byte aligned (strided ones are copied into the arena first), else which not.
std::string misaligned(std::initializer_list<std::pair<const char*, const TensorView*>> ts) {
  for (const auto& [name, t] : ts)
    if (t->defined() && t->is_contiguous() && (reinterpret_cast<uintptr_t>(t->data) & 15u) != 0)
      return fmt::format("{} does not start 16-byte aligned ({}; the TURBO kernels move 16-byte vectors)", name, t->describe());
  return "";
}

// A strided q / k / v (or gradient) for the TURBO kernels: read (written) in place when they take
// row strides (the warp-specialised Hopper kernels: `in_place`) and its token rows (validate()
// checked the layout: detail::token_rows) are a multiple of 8 elements apart from a 16-byte aligned
// start, setting *row; else a dense copy (output: a dense stand-in).
TensorView rows_or_dense(detail::DenseRows& dense, const TensorView& t, bool in_place, bool output, int64_t* row) {
  if (!t.defined() || t.is_contiguous()) return t;
  const int64_t r = detail::token_rows(t, output ? "attention_backward" : "attention", "a strided view");
  if (in_place && r % 8 == 0 && (reinterpret_cast<uintptr_t>(t.data) & 15u) == 0) {
    *row = r;
    return t;
  }
  return output ? dense.out(t) : dense.in(t);
}

cuda::FlashAttnParams flash_params(const AttentionDims& d, DType dt, const AttentionOptions& o) {
  cuda::FlashAttnParams p;
  p.B = d.B, p.T = d.T, p.H = d.H, p.KVH = d.KVH, p.D = d.D;
  p.causal = o.causal;
  p.window = o.window;
  p.scale = o.scale(d.D);
  p.dtype = dt;
  if (o.cu_seqlens.defined()) {
    p.cu_seqlens = o.cu_seqlens.ptr<const int32_t>();
    p.num_docs = num_docs(o);
  }
  return p;
}

std::string turbo_check_fwd(const AttentionForwardArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"q", &a.q}}); !w.empty()) return w;
  if (any_strided({&a.q, &a.k, &a.v}) && !a.ctx.scratch)
    return "strided q/k/v need ExecContext::scratch (device arena) for dense copies";
  if (auto w = misaligned({{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"out", &a.out}}); !w.empty()) return w;
  return cuda::flash_attention_unsupported_reason(a.q.dtype, a.q.size(3));
}
void turbo_fwd(const AttentionForwardArgs& args) {
  // The kernels read dense [B,T,H,D], or row-strided views where they take row strides; other
  // strided q/k/v are copied first (the CUDNN backend reads them in place).
  detail::DenseRows dense(args.ctx, "attention_forward");
  AttentionForwardArgs a = args;
  cuda::FlashAttnParams p = flash_params(dims_of(args.q, args.k), args.q.dtype, args.opt);
  const bool in_place = cuda::flash_attention_takes_row_strides(false);
  a.q = rows_or_dense(dense, args.q, in_place, false, &p.q_row);
  a.k = rows_or_dense(dense, args.k, in_place, false, &p.k_row);
  a.v = rows_or_dense(dense, args.v, in_place, false, &p.v_row);
  cuda::flash_attention_forward(p, a.out.data, a.lse.ptr<float>(), a.q.data, a.k.data, a.v.data,
                                static_cast<cudaStream_t>(a.ctx.stream));
}
std::string turbo_check_bwd(const AttentionBackwardArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"q", &a.q}}); !w.empty()) return w;
  if (a.opt.deterministic) return "a deterministic backward (the TURBO kernels accumulate dQ with atomics)";
  if (!a.ctx.scratch) return "needs ExecContext::scratch (device arena) for the f32 dq accumulator";
  if (auto w = misaligned({{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"out", &a.out}, {"dout", &a.dout}, {"dq", &a.dq}, {"dk", &a.dk},
                           {"dv", &a.dv}});
      !w.empty())
    return w;
  return cuda::flash_attention_unsupported_reason(a.q.dtype, a.q.size(3));
}
void turbo_bwd(const AttentionBackwardArgs& args) {
  // Dense stand-ins for strided views the kernels cannot take in place (allocated first: the
  // accumulator's scope nests inside theirs); out and dout are dense (validate()).
  detail::DenseRows dense(args.ctx, "attention_backward");
  AttentionBackwardArgs a = args;
  cuda::FlashAttnParams p = flash_params(dims_of(args.q, args.k), args.q.dtype, args.opt);
  const bool in_place = cuda::flash_attention_takes_row_strides(true);
  a.q = rows_or_dense(dense, args.q, in_place, false, &p.q_row);
  a.k = rows_or_dense(dense, args.k, in_place, false, &p.k_row);
  a.v = rows_or_dense(dense, args.v, in_place, false, &p.v_row);
  a.dq = rows_or_dense(dense, args.dq, in_place, true, &p.dq_row);
  a.dk = rows_or_dense(dense, args.dk, in_place, true, &p.dk_row);
  a.dv = rows_or_dense(dense, args.dv, in_place, true, &p.dv_row);
  {
    Arena& arena = detail::scratch_of(a.ctx, "attention_backward");
    ArenaScope scope(arena);
    void* scratch = arena.allocate(cuda::flash_attention_backward_scratch_bytes(p), 256, "attention_backward dq accumulator");
    cuda::flash_attention_backward(p, a.dq.data, a.dk.data, a.dv.data, a.dout.data, a.q.data, a.k.data, a.v.data,
                                   a.out.data, a.lse.ptr<const float>(), scratch, static_cast<cudaStream_t>(a.ctx.stream));
  }
  dense.finish(args.dq, a.dq), dense.finish(args.dk, a.dk), dense.finish(args.dv, a.dv);
}
#endif

// ---- CUDNN -----------------------------------------------------------------------------------
#ifdef PRIMUS_TURBO_WITH_CUDNN
cudnn::SdpaShape sdpa_shape(const AttentionDims& d, DType dt, bool causal) {
  cudnn::SdpaShape s;
  s.B = d.B, s.T = d.T, s.H = d.H, s.KVH = d.KVH, s.D = d.D;
  s.causal = causal;
  s.dtype = dt;
  return s;
}

std::string cudnn_common_check(const TensorView& q, const AttentionOptions& o) {
  if (auto w = detail::all_on(Device::CUDA, {{"q", &q}}); !w.empty()) return w;
  if (o.cu_seqlens.defined()) return "packed documents (cu_seqlens) are not served by the cuDNN backend";
  // cuDNN's band mask (diagonal alignment with a left bound) is not expressed by our graph builder.
  if (o.window > 0) return "a sliding window is not served by the cuDNN backend";
  // Loaded at first use: a machine without libcudnn makes this backend incapable (the
  // dispatcher then falls back to TURBO with its one-time warning).
  return cudnn::library().unavailable_reason();
}

// The token row strides of strided views (0 for dense ones: the plan key stays as before).
int64_t row_of(const TensorView& t) { return t.is_contiguous() ? 0 : t.strides[1]; }
cudnn::SdpaShape sdpa_shape(const AttentionForwardArgs& a) {
  cudnn::SdpaShape s = sdpa_shape(dims_of(a.q, a.k), a.q.dtype, a.opt.causal);
  s.deterministic = a.opt.deterministic;  // no engine search: the same engine in every process
  s.q_row = row_of(a.q), s.k_row = row_of(a.k), s.v_row = row_of(a.v);
  return s;
}
cudnn::SdpaShape sdpa_shape(const AttentionBackwardArgs& a) {
  cudnn::SdpaShape s = sdpa_shape(dims_of(a.q, a.k), a.q.dtype, a.opt.causal);
  s.deterministic = a.opt.deterministic;
  s.q_row = row_of(a.q), s.k_row = row_of(a.k), s.v_row = row_of(a.v);
  s.dq_row = row_of(a.dq), s.dk_row = row_of(a.dk), s.dv_row = row_of(a.dv);
  return s;
}

std::string cudnn_check_fwd(const AttentionForwardArgs& a) {
  if (auto w = cudnn_common_check(a.q, a.opt); !w.empty()) return w;
  const auto s = sdpa_shape(a);
  if (auto w = cudnn::sdpa_forward_unsupported(s); !w.empty()) return w;
  if (cudnn::sdpa_forward_workspace(s) > 0 && !a.ctx.scratch) return "needs ExecContext::scratch for the cuDNN workspace";
  return "";
}
void cudnn_fwd(const AttentionForwardArgs& a) {
  const auto s = sdpa_shape(a);
  const size_t ws_bytes = cudnn::sdpa_forward_workspace(s);
  void* ws = nullptr;
  std::optional<ArenaScope> scope;
  if (ws_bytes > 0) {
    Arena& arena = detail::scratch_of(a.ctx, "attention_forward");
    scope.emplace(arena);
    ws = arena.allocate(ws_bytes, 256, "cuDNN SDPA forward workspace");
  }
  cudnn::sdpa_forward(s, a.out.data, a.lse.ptr<float>(), a.q.data, a.k.data, a.v.data, a.opt.scale(s.D), ws,
                      static_cast<cudaStream_t>(a.ctx.stream));
}
std::string cudnn_check_bwd(const AttentionBackwardArgs& a) {
  if (auto w = cudnn_common_check(a.q, a.opt); !w.empty()) return w;
  if (!a.ctx.scratch) return "needs ExecContext::scratch for the cuDNN workspace";
  return cudnn::sdpa_backward_unsupported(sdpa_shape(a));
}
void cudnn_bwd(const AttentionBackwardArgs& a) {
  const auto s = sdpa_shape(a);
  Arena& arena = detail::scratch_of(a.ctx, "attention_backward");
  ArenaScope scope(arena);
  void* ws = arena.allocate(cudnn::sdpa_backward_workspace(s), 256, "cuDNN SDPA backward workspace");
  cudnn::sdpa_backward(s, a.dq.data, a.dk.data, a.dv.data, a.dout.data, a.q.data, a.k.data, a.v.data, a.out.data,
                       a.lse.ptr<const float>(), a.opt.scale(s.D), ws, static_cast<cudaStream_t>(a.ctx.stream));
}
#endif

#if defined(PRIMUS_TURBO_WITH_CUDNN)
constexpr BackendType kAttentionDefault = BackendType::CUDNN;
#elif defined(PRIMUS_TURBO_WITH_CUDA)
constexpr BackendType kAttentionDefault = BackendType::TURBO;
#else
constexpr BackendType kAttentionDefault = BackendType::CPU;
#endif

// Registration order is the fallback order: cuDNN, Turbo's kernels, the reference.
template <class Args>
OpDispatcher<Args>* make_dispatcher(typename FunctionBackend<Args>::CheckFn cudnn_check,
                                    typename FunctionBackend<Args>::RunFn cudnn_run,
                                    typename FunctionBackend<Args>::CheckFn turbo_check,
                                    typename FunctionBackend<Args>::RunFn turbo_run,
                                    typename FunctionBackend<Args>::CheckFn cpu_check,
                                    typename FunctionBackend<Args>::RunFn cpu_run) {
  // Both directions overwrite their outputs, so timing candidates (autotune) is harmless.
  auto* d = new OpDispatcher<Args>("attention", kAttentionDefault, DispatcherOptions{true, 256});
  if (cudnn_check && cudnn_run)
    d->register_backend(make_backend<Args>(BackendType::CUDNN, cudnn_check, cudnn_run));
  if (turbo_check && turbo_run)
    d->register_backend(make_backend<Args>(BackendType::TURBO, turbo_check, turbo_run));
  d->register_backend(make_backend<Args>(BackendType::CPU, cpu_check, cpu_run));
  detail::install_cuda_hooks(*d);
  return d;
}

#ifdef PRIMUS_TURBO_WITH_CUDNN
#define PRIMUS_CUDNN_FN(f) (f)
#else
#define PRIMUS_CUDNN_FN(f) nullptr
#endif

std::string options_key(const AttentionOptions& o) {
  return fmt::format("causal={} scale={} docs={}{}{}", o.causal ? 1 : 0,
                     o.softmax_scale ? fmt::format("{}", *o.softmax_scale) : "default", num_docs(o),
                     o.window > 0 ? fmt::format(" window={}", o.window) : "", o.deterministic ? " deterministic" : "");
}

}  // namespace

float AttentionOptions::scale(int64_t D) const {
  return softmax_scale ? *softmax_scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
}

std::string AttentionForwardArgs::key() const {
  return fmt::format("attention_forward q={} k={} {}", q.describe(), k.describe(), options_key(opt));
}
std::string AttentionBackwardArgs::key() const {
  return fmt::format("attention_backward q={} k={} {}", q.describe(), k.describe(), options_key(opt));
}

BackendType attention_forward(const AttentionForwardArgs& args) {
  validate(args);
  static auto* d = make_dispatcher<AttentionForwardArgs>(PRIMUS_CUDNN_FN(cudnn_check_fwd), PRIMUS_CUDNN_FN(cudnn_fwd),
                                                         PRIMUS_TURBO_FN(turbo_check_fwd), PRIMUS_TURBO_FN(turbo_fwd),
                                                         cpu_check_fwd, cpu_fwd);
  return d->dispatch(args);
}

BackendType attention_backward(const AttentionBackwardArgs& args) {
  validate(args);
  static auto* d = make_dispatcher<AttentionBackwardArgs>(PRIMUS_CUDNN_FN(cudnn_check_bwd), PRIMUS_CUDNN_FN(cudnn_bwd),
                                                          PRIMUS_TURBO_FN(turbo_check_bwd), PRIMUS_TURBO_FN(turbo_bwd),
                                                          cpu_check_bwd, cpu_bwd);
  return d->dispatch(args);
}

}  // namespace primus::turbo
