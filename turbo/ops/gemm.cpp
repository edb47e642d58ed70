// gemm's dispatcher: CUBLASLT for device tensors (default), TURBO (Turbo's own sm90 kernel,
// turbo/kernels/cuda/gemm_sm90.h) where it applies, CPU for host f32 tensors.
#include "turbo/ops/gemm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <optional>
#include <vector>

#include "turbo/ops/gemm_cpu.h"
#include "turbo/ops/gemm_problem.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cublaslt/cublaslt_api.h"
#include "turbo/kernels/cublaslt/gemm_cublaslt.h"
#include "turbo/kernels/cuda/elementwise.h"
#include "turbo/kernels/cuda/gemm_sm90.h"
#endif

namespace primus::turbo {
namespace {

// The epilogues that write or read an aux matrix (GELU's pre-activation).
bool has_aux(GemmEpilogue e) {
  return e == GemmEpilogue::GeluAux || e == GemmEpilogue::GeluAuxBias || e == GemmEpilogue::DGelu;
}


#ifdef PRIMUS_TURBO_WITH_CUDA
cublaslt::Epilogue to_lt(GemmEpilogue e) { return static_cast<cublaslt::Epilogue>(static_cast<uint8_t>(e)); }
static_assert(static_cast<int>(cublaslt::Epilogue::BGradB) == static_cast<int>(GemmEpilogue::BGradB),
              "GemmEpilogue and cublaslt::Epilogue list the same epilogues in the same order");

cublaslt::Matrix to_lt(const detail::MatrixLayout& l) {
  return {l.ptr, l.dtype, l.ld, l.transposed, l.batch > 1 ? l.batch_stride : 0};
}

cublaslt::GemmProblem lt_problem(const GemmArgs& g, const detail::GemmShape& s) {
  cublaslt::GemmProblem p;
  p.m = s.m; p.n = s.n; p.k = s.k; p.batch = s.batch;
  p.a = to_lt(s.a); p.b = to_lt(s.b); p.d = to_lt(s.d);
  p.alpha = g.alpha; p.beta = g.beta;
  p.epilogue = to_lt(g.epilogue);
  p.bias = g.bias.data;
  p.bias_dtype = g.bias.defined() ? g.bias.dtype : g.d.dtype;
  p.aux = g.aux.data;
  p.aux_ld = g.aux.defined() ? g.aux.stride(0) : 0;
  p.allow_tf32 = g.allow_tf32;
  p.a_scale = g.a_scale.ptr<const float>();
  p.b_scale = g.b_scale.ptr<const float>();
  p.a_scaling = g.a_scaling;
  p.b_scaling = g.b_scaling;
  p.fp8_fast_accum = g.fp8_fast_accum;
  return p;
}

cuda::GemmSm90Problem sm90_problem(const GemmArgs& g, const detail::GemmShape& s) {
  cuda::GemmSm90Problem p;
  p.m = s.m; p.n = s.n; p.k = s.k;
  p.in_dtype = s.a.dtype;
  p.a = {s.a.ptr, s.a.ld, s.a.transposed};
  p.b = {s.b.ptr, s.b.ld, s.b.transposed};
  p.d = s.d.ptr;
  p.ldd = s.d.ld;
  p.d_dtype = s.d.dtype;
  p.alpha = g.alpha; p.beta = g.beta;
  const bool with_bias = g.epilogue == GemmEpilogue::Bias || g.epilogue == GemmEpilogue::GeluAuxBias;
  p.bias = with_bias ? g.bias.data : nullptr;
  if (has_aux(g.epilogue)) {
    p.epilogue = g.epilogue == GemmEpilogue::DGelu ? cuda::GemmSm90Epilogue::DGelu : cuda::GemmSm90Epilogue::GeluAux;
    p.aux = g.aux.data;
    p.ld_aux = g.aux.defined() && g.aux.ndim == 2 ? g.aux.stride(0) : 0;
  }
  return p;
}

// Why the TURBO kernel cannot run a call ("" when it can): what the dispatcher and a forced
// PRIMUS_TURBO_GEMM_BACKEND=TURBO report.
std::string turbo_unsupported_reason(const GemmArgs& g, const detail::GemmShape& s) {
  if (dtype_is_fp8(s.a.dtype)) return "FP8 operands (the TURBO GEMM runs bf16/f16)";
  if (g.epilogue != GemmEpilogue::None && g.epilogue != GemmEpilogue::Bias && !has_aux(g.epilogue))
      return fmt::format("epilogue {} (the TURBO GEMM has none, bias, gelu_aux, gelu_aux_bias and dgelu)",
                         gemm_epilogue_name(g.epilogue));
  if (s.batch > 1) return fmt::format("batch {} (the TURBO GEMM runs one matrix per call)", s.batch);
  if (s.a.dtype != s.b.dtype)
    return fmt::format("A is {} and B is {} (the TURBO GEMM wants one input type)", dtype_name(s.a.dtype), dtype_name(s.b.dtype));
  if ((g.epilogue == GemmEpilogue::Bias || g.epilogue == GemmEpilogue::GeluAuxBias) && g.bias.dtype != g.d.dtype)
    return fmt::format("bias is {} but D is {} (the TURBO GEMM reads the bias in D's type)", dtype_name(g.bias.dtype),
                       dtype_name(g.d.dtype));
  // (gemm_shape has checked aux: a row-major [M, N] matrix of D's type.)
  if (has_aux(g.epilogue) && g.beta != 0.0f)
    return fmt::format("epilogue {} with beta != 0", gemm_epilogue_name(g.epilogue));
  return cuda::gemm_sm90_unsupported_reason(sm90_problem(g, s));
}

// Autotune runs each candidate several times. With beta != 0 every run would accumulate into D
// once more, so D is saved before the timing and put back after it (autotune never runs while a
// graph is captured, so the allocation here is allowed).
double time_gemm_ms(const GemmArgs& g, const std::function<void()>& run) {
  detail::GemmShape s;
  if (g.beta == 0.0f || !detail::gemm_shape(g, &s).empty() || s.m == 0 || s.n == 0)
    return detail::cuda_time_ms(g.ctx.stream, run);
  const int64_t elems = (s.batch - 1) * s.d.batch_stride + (s.m - 1) * s.d.ld + s.n;
  const size_t bytes = static_cast<size_t>(elems) * dtype_size(s.d.dtype);
  auto stream = static_cast<cudaStream_t>(g.ctx.stream);
  void* saved = nullptr;
  CUDA_CHECK(cudaMalloc(&saved, bytes));
  auto restore = [&] {
    const cudaError_t e1 = cudaMemcpyAsync(s.d.ptr, saved, bytes, cudaMemcpyDeviceToDevice, stream);
    const cudaError_t e2 = cudaStreamSynchronize(stream);
    cudaFree(saved);
    CUDA_CHECK(e1);
    CUDA_CHECK(e2);
  };
  double ms = 0.0;
  try {
    CUDA_CHECK(cudaMemcpyAsync(saved, s.d.ptr, bytes, cudaMemcpyDeviceToDevice, stream));
    ms = detail::cuda_time_ms(g.ctx.stream, run);
  } catch (...) {
    try { restore(); } catch (...) {}
    throw;
  }
  restore();
  return ms;
}
#endif

std::string views_on(Device dev, const GemmArgs& g) {
  return detail::all_on(dev, {{"A", &g.a}, {"B", &g.b}, {"D", &g.d}, {"bias", &g.bias}, {"aux", &g.aux},
                              {"a_scale", &g.a_scale}, {"b_scale", &g.b_scale}});
}

// The default backend of GEMMs with a fused bias / GELU epilogue on 16-bit tensors:
// PRIMUS_TURBO_GEMM_EPILOGUE_BACKEND=TURBO|CUBLASLT (read once; unset: CUBLASLT). TURBO's
// epilogues are correct but GPT-2 trains 2-3% slower with them than with cuBLASLt's (H200, H100;
// alone, the GELU-aux forward reaches 0.97-1.02x of cuBLASLt's, the other epilogue products
// 0.85-0.96x), so cuBLASLt stays the default until they are faster. A call TURBO cannot run goes to the op's default.
std::optional<BackendType> epilogue_rule(const GemmArgs& g) {
  static const std::optional<BackendType> pick = []() -> std::optional<BackendType> {
    const char* e = std::getenv("PRIMUS_TURBO_GEMM_EPILOGUE_BACKEND");
    std::string v = e ? e : "";
    for (char& c : v) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (v == "TURBO") return BackendType::TURBO;
    if (v.empty() || v == "CUBLASLT") return BackendType::CUBLASLT;
    throw ConfigError(fmt::format("PRIMUS_TURBO_GEMM_EPILOGUE_BACKEND='{}': expected TURBO or CUBLASLT", e));
  }();
  if (g.epilogue != GemmEpilogue::Bias && !has_aux(g.epilogue)) return std::nullopt;
  const bool half = [](DType t) { return t == DType::BF16 || t == DType::F16; }(g.d.dtype);
  if (!half || g.a.dtype != g.d.dtype || g.b.dtype != g.d.dtype) return std::nullopt;
  return pick;
}

OpDispatcher<GemmArgs>& dispatcher() {
  static OpDispatcher<GemmArgs>* d = [] {
    auto* disp = new OpDispatcher<GemmArgs>("gemm", turbo_has_cuda() ? BackendType::CUBLASLT : BackendType::CPU);
    disp->set_default_rule(epilogue_rule);
#ifdef PRIMUS_TURBO_WITH_CUDA
    disp->register_backend(make_backend<GemmArgs>(
        BackendType::CUBLASLT,
        [](const GemmArgs& g) -> std::string {
          if (auto w = views_on(Device::CUDA, g); !w.empty()) return w;
          detail::GemmShape s;
          if (auto w = detail::gemm_shape(g, &s); !w.empty()) return w;
          if (auto w = cublaslt::unsupported_reason(lt_problem(g, s)); !w.empty()) return w;
          // Loaded at first use: a machine without libcublasLt makes this backend incapable.
          return cublaslt::library().unavailable_reason();
        },
        [](const GemmArgs& g) {
          // Autotune also means timing cuBLASLt's own top candidates per shape (once each), unless
          // PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH says how many (it wins over every other setting).
          static const bool tune = [] {
            const char* search = std::getenv("PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH");  // empty counts as unset
            if (GlobalBackendManager::instance().auto_tune_enabled() && !(search && *search))
              cublaslt::set_algo_search(8);
            return true;
          }();
          (void)tune;
          detail::GemmShape s;
          detail::gemm_shape(g, &s);
          cublaslt::gemm(lt_problem(g, s), static_cast<cudaStream_t>(g.ctx.stream));
        }));
    disp->register_backend(make_backend<GemmArgs>(
        BackendType::TURBO,
        [](const GemmArgs& g) -> std::string {
          if (auto w = views_on(Device::CUDA, g); !w.empty()) return w;
          detail::GemmShape s;
          if (auto w = detail::gemm_shape(g, &s); !w.empty()) return w;
          return turbo_unsupported_reason(g, s);
        },
        [](const GemmArgs& g) {
          detail::GemmShape s;
          detail::gemm_shape(g, &s);
          cuda::gemm_sm90(sm90_problem(g, s), static_cast<cudaStream_t>(g.ctx.stream));
        }));
    detail::install_cuda_hooks(*disp);
    disp->set_timer(time_gemm_ms);
#endif
    disp->register_backend(make_backend<GemmArgs>(
        BackendType::CPU,
        [](const GemmArgs& g) -> std::string {
          if (auto w = views_on(Device::CPU, g); !w.empty()) return w;
          if (dtype_is_fp8(g.a.dtype)) {  // FP8 operands are dequantized; the rest is f32
            if (auto w = detail::all_dtype(DType::F32, {{"D", &g.d}, {"bias", &g.bias}, {"aux", &g.aux}}); !w.empty())
              return w + " (the CPU backend computes in f32)";
          } else if (auto w = detail::all_dtype(DType::F32, {{"A", &g.a}, {"B", &g.b}, {"D", &g.d}, {"bias", &g.bias}, {"aux", &g.aux}}); !w.empty()) {
            return w + " (the CPU backend computes in f32)";
          }
          detail::GemmShape s;
          return detail::gemm_shape(g, &s);
        },
        [](const GemmArgs& g) {
          detail::GemmShape s;
          detail::gemm_shape(g, &s);
          if (dtype_is_fp8(s.a.dtype))
            detail::gemm_cpu_fp8(g, s);
          else
            detail::gemm_cpu(g, s);
        }));
    return disp;
  }();
  return *d;
}

}  // namespace

const char* gemm_epilogue_name(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::None: return "none";
    case GemmEpilogue::Bias: return "bias";
    case GemmEpilogue::Gelu: return "gelu";
    case GemmEpilogue::GeluBias: return "gelu_bias";
    case GemmEpilogue::GeluAux: return "gelu_aux";
    case GemmEpilogue::GeluAuxBias: return "gelu_aux_bias";
    case GemmEpilogue::DGelu: return "dgelu";
    case GemmEpilogue::DGeluBGrad: return "dgelu_bgrad";
    case GemmEpilogue::BGradA: return "bgrad_a";
    case GemmEpilogue::BGradB: return "bgrad_b";
  }
  return "?";
}

std::string GemmArgs::key() const {
  auto lay = [](const TensorView& t) {
    if (!t.defined()) return std::string("-");
    std::string s = t.describe();
    return s;
  };
  // Whether A and B start 16-byte aligned: TURBO (TMA) needs it, so a backend autotune picked for
  // aligned operands must not be reused from the cache for unaligned ones of the same shapes.
  const int al16 = (reinterpret_cast<uintptr_t>(a.data) % 16 == 0 ? 1 : 0) + (reinterpret_cast<uintptr_t>(b.data) % 16 == 0 ? 2 : 0);
  return fmt::format("gemm A={} B={} D={} epi={} beta0={} tf32={} al16={} fastacc={} scal={}/{}", lay(a), lay(b),
                     lay(d), gemm_epilogue_name(epilogue), beta == 0.0f ? 1 : 0, allow_tf32 ? 1 : 0, al16,
                     fp8_fast_accum ? 1 : 0, fp8_granularity_name(a_scaling), fp8_granularity_name(b_scaling));
}

BackendType gemm(const GemmArgs& args) {
  detail::GemmShape s;
  if (auto w = detail::gemm_shape(args, &s); !w.empty())
    throw RuntimeError(fmt::format("gemm: {}", w));
  return dispatcher().dispatch(args);
}

BackendType linear_forward(const TensorView& out, const TensorView& inp, const TensorView& weight,
                           const TensorView& bias, const TensorView& aux, const ExecContext& ctx) {
  GemmArgs g;
  g.a = inp;
  g.b = weight.transposed();
  g.d = out;
  g.bias = bias;
  g.aux = aux;
  if (aux.defined())
    g.epilogue = bias.defined() ? GemmEpilogue::GeluAuxBias : GemmEpilogue::GeluAux;
  else
    g.epilogue = bias.defined() ? GemmEpilogue::Bias : GemmEpilogue::None;
  g.ctx = ctx;
  return gemm(g);
}

void linear_backward(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                     const TensorView& dout, const TensorView& inp, const TensorView& weight,
                     bool accumulate_dinp, const ExecContext& ctx, bool accumulate_dweight) {
  if (dinp.defined()) {
    GemmArgs g;
    g.a = dout;
    g.b = weight;
    g.d = dinp;
    g.beta = accumulate_dinp ? 1.0f : 0.0f;
    g.ctx = ctx;
    gemm(g);
  }
  if (!dweight.defined()) {
    if (dbias.defined()) throw RuntimeError("linear_backward: dbias without dweight is not supported");
    return;
  }
  GemmArgs g;
  g.a = dout.transposed();
  g.b = inp;
  g.d = dweight;
  g.beta = accumulate_dweight ? 1.0f : 0.0f;  // parameter gradients accumulate over micro-batches
  g.ctx = ctx;
  if (!dbias.defined()) {
    gemm(g);
    return;
  }
  // The bias-gradient epilogue overwrites its vector; it goes to scratch and is then added.
  if (dbias.dtype != dweight.dtype)
    throw RuntimeError(fmt::format("linear_backward: dbias ({}) must have the dtype of dweight ({})",
                                   dtype_name(dbias.dtype), dtype_name(dweight.dtype)));
  const int64_t oc = dweight.size(0);
  std::vector<float> host_tmp;
  TensorView tmp;
  Arena* arena = dbias.device == Device::CUDA ? &detail::scratch_of(ctx, "linear_backward") : nullptr;
  std::optional<ArenaScope> scope;
  if (arena) {
    scope.emplace(*arena);
    tmp = arena->tensor(dbias.dtype, {oc}, "linear_backward dbias");
  } else {
    host_tmp.resize(static_cast<size_t>(oc));
    tmp = TensorView(host_tmp.data(), DType::F32, Device::CPU, {oc});
  }
  g.epilogue = GemmEpilogue::BGradA;
  g.bias = tmp;
  gemm(g);
  if (dbias.device == Device::CPU) {
    for (int64_t i = 0; i < oc; ++i) dbias.ptr<float>()[i] += host_tmp[i];
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  if (dbias.dtype != DType::F32) throw RuntimeError("linear_backward: a device dbias must be f32");
  cuda::add_inplace_f32(dbias.ptr<float>(), tmp.ptr<float>(), oc, static_cast<cudaStream_t>(ctx.stream));
#endif
}

void bias_grad(const TensorView& dbias, const TensorView& dout, const ExecContext& ctx) {
  if (!dbias.defined() || !dout.defined()) throw RuntimeError("bias_grad: dbias and dout must be defined");
  if (dbias.dtype != DType::F32 || dbias.ndim != 1 || !dbias.is_contiguous())
    throw RuntimeError(fmt::format("bias_grad: dbias must be a contiguous f32 vector, got {}", dbias.describe()));
  if (dout.ndim != 2 || dout.stride(1) != 1 || dout.stride(0) < dout.size(1))
    throw RuntimeError(fmt::format("bias_grad: dout must be a row-major [N, C] matrix, got {}", dout.describe()));
  if (dout.size(1) != dbias.size(0))
    throw RuntimeError(fmt::format("bias_grad: dout has {} columns but dbias {} elements", dout.size(1), dbias.size(0)));
  if (dout.device != dbias.device) throw RuntimeError("bias_grad: dbias and dout must be on the same device");
  const int64_t N = dout.size(0), C = dout.size(1), ld = dout.stride(0);
  if (dout.device == Device::CPU) {
    if (dout.dtype != DType::F32) throw RuntimeError(fmt::format("bias_grad: a host dout must be f32, got {}", dout.describe()));
    std::vector<double> acc(static_cast<size_t>(C), 0.0);
    const float* x = dout.ptr<float>();
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < C; ++c) acc[static_cast<size_t>(c)] += x[r * ld + c];
    float* d = dbias.ptr<float>();
    for (int64_t c = 0; c < C; ++c) d[c] += static_cast<float>(acc[static_cast<size_t>(c)]);
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  if (dout.dtype != DType::F32 && dout.dtype != DType::BF16)
    throw RuntimeError(fmt::format("bias_grad: dout must be f32 or bf16, got {}", dout.describe()));
  Arena& arena = detail::scratch_of(ctx, "bias_grad");
  ArenaScope scope(arena);
  const int64_t parts = cuda::column_sum_partials(N, C);
  TensorView tmp = arena.tensor(DType::F32, {std::max<int64_t>(parts, 1)}, "bias_grad partials");
  cuda::column_sum_accumulate(dbias.ptr<float>(), dout.data, dout.dtype, N, C, ld, tmp.ptr<float>(),
                              static_cast<cudaStream_t>(ctx.stream));
#else
  (void)ctx;
  throw RuntimeError("bias_grad: this build has no CUDA");
#endif
}

size_t linear_backward_weight_ones_scratch_bytes(int64_t OC, int64_t Cp) {
  return static_cast<size_t>(OC * Cp) * sizeof(float) + Arena::kDefaultAlign;
}

void linear_backward_weight_ones(const TensorView& dweight, const TensorView& dbias, const TensorView& dout,
                                 const TensorView& inp_ones, const ExecContext& ctx, bool accumulate_dweight) {
  const char* op = "linear_backward_weight_ones";
  check_defined(dweight, op, "dweight");
  check_defined(dout, op, "dout");
  check_defined(inp_ones, op, "inp_ones");
  check_dtype(dweight, DType::F32, op, "dweight");
  check_contiguous(dweight, op, "dweight");
  if (dweight.ndim != 2 || dout.ndim != 2 || inp_ones.ndim != 2)
    throw RuntimeError(fmt::format("{}: dweight, dout and inp_ones must be matrices, got {}, {}, {}", op,
                                   dweight.describe(), dout.describe(), inp_ones.describe()));
  const int64_t OC = dweight.size(0), C = dweight.size(1), N = dout.size(0), Cp = inp_ones.size(1);
  if (dout.size(1) != OC || inp_ones.size(0) != N || Cp <= C)
    throw RuntimeError(fmt::format("{}: dweight {} needs dout [N, {}] and inp_ones [N, more than {} columns], got {} and {}",
                                   op, dweight.describe(), OC, C, dout.describe(), inp_ones.describe()));
  if (dbias.defined()) {
    check_shape(dbias, {OC}, op, "dbias");
    check_dtype(dbias, DType::F32, op, "dbias");
  }
  for (auto [name, t] : {std::pair{"dbias", &dbias}, {"dout", &dout}, {"inp_ones", &inp_ones}})
    if (t->defined() && t->device != dweight.device)
      throw RuntimeError(fmt::format("{}: {} is on {}, dweight on {}", op, name, device_name(t->device), device_name(dweight.device)));
  GemmArgs g;
  g.a = dout.transposed();
  g.b = inp_ones;
  g.beta = 0.0f;
  g.ctx = ctx;
  if (dweight.device == Device::CPU) {
    std::vector<float> s(static_cast<size_t>(OC * Cp));
    g.d = TensorView(s.data(), DType::F32, Device::CPU, {OC, Cp});
    gemm(g);
    float* dw = dweight.ptr<float>();
    for (int64_t r = 0; r < OC; ++r) {
      for (int64_t c = 0; c < C; ++c) dw[r * C + c] = (accumulate_dweight ? dw[r * C + c] : 0.0f) + s[size_t(r * Cp + c)];
      if (dbias.defined()) dbias.ptr<float>()[r] += s[size_t(r * Cp + C)];
    }
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  Arena& arena = detail::scratch_of(ctx, op);
  ArenaScope scope(arena);
  g.d = arena.tensor(DType::F32, {OC, Cp}, "linear_backward_weight_ones [dweight | dbias]");
  gemm(g);
  cuda::split_ones_gradient(dweight.ptr<float>(), dbias.ptr<float>(), g.d.ptr<float>(), OC, C, Cp, accumulate_dweight,
                            static_cast<cudaStream_t>(ctx.stream));
#else
  throw RuntimeError(fmt::format("{}: this build has no CUDA", op));
#endif
}

void linear_backward_input_dgelu(const TensorView& dpre, const TensorView& dbias,
                                 const TensorView& dout, const TensorView& weight,
                                 const TensorView& pre_aux, const ExecContext& ctx) {
  GemmArgs g;
  g.a = dout;
  g.b = weight;
  g.d = dpre;
  g.aux = pre_aux;
  g.bias = dbias;
  g.epilogue = dbias.defined() ? GemmEpilogue::DGeluBGrad : GemmEpilogue::DGelu;
  g.ctx = ctx;
  gemm(g);
}

}  // namespace primus::turbo
