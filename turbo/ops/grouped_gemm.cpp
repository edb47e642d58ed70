// grouped_gemm's dispatcher: TURBO (Turbo's Hopper kernel, the default on the device), CUBLASLT
// (a loop of cuBLASLt products over host-read offsets) and CPU (the reference). Contract in
// turbo/ops/grouped_gemm.h.
#include "turbo/ops/grouped_gemm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "turbo/dispatch/backend_manager.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/grouped_gemm.h"
#include "turbo/kernels/cpu/quantize.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cublaslt/cublaslt_api.h"
#include "turbo/kernels/cublaslt/gemm_cublaslt.h"
#include "turbo/kernels/cuda/grouped_gemm_sm90.h"
#endif

namespace primus::turbo {
namespace {

enum class GgKind { Forward, Dgrad, Wgrad };
const char* gg_op_name(GgKind k) {
  return k == GgKind::Forward ? "grouped_gemm_forward" : k == GgKind::Dgrad ? "grouped_gemm_dgrad" : "grouped_gemm_wgrad";
}

// One call of any of the three, as the backends see it: x [M, N or K] (the token operand that is
// read), w (the weight [G,N,K], or inp [M,K] for wgrad), y (what is written).
struct GgCall {
  GgKind kind = GgKind::Forward;
  TensorView x, w, y, offsets;
  // SwiGLU fused in (grouped_gemm.h): the forward's act [M, N/2] (written), or the input gradient's
  // gate|up [M, 2K] (read; y is then d(gate|up) [M, 2K]).
  TensorView glu;
  int64_t G = 0, M = 0, N = 0, K = 0, align = 1;
  bool accumulate = false;
  ExecContext ctx;

  std::string key() const {
    const std::string out = kind == GgKind::Wgrad ? fmt::format("->{}", dtype_name(y.dtype)) : std::string();
    return fmt::format("{} G={} M={} N={} K={} align={} acc={} {}{} {}{}", gg_op_name(kind), G, M, N, K, align,
                       accumulate ? 1 : 0, dtype_name(x.dtype), out, device_name(x.device), glu.defined() ? " swiglu" : "");
  }
  Precision precision() const { return precision_of(x.dtype); }
};

void gg_check_2d(const TensorView& t, int64_t rows, int64_t cols, const char* op, const char* arg) {
  check_defined(t, op, arg);
  check_contiguous(t, op, arg);
  if (t.ndim != 2 || (rows >= 0 && t.shape[0] != rows) || t.shape[1] != cols)
    throw RuntimeError(fmt::format("{}: {} must be [{}, {}], got {}", op, arg, rows >= 0 ? std::to_string(rows) : "M",
                                   cols, t.describe()));
}

// Shapes from the weight [G,N,K] (or, for wgrad, from dweight) and the checks every backend shares.
GgCall gg_make_call(GgKind kind, const TensorView& weight3, const TensorView& offsets, int64_t align, const ExecContext& ctx) {
  const char* op = gg_op_name(kind);
  const char* wname = kind == GgKind::Wgrad ? "dweight" : "weight";
  check_defined(weight3, op, wname);
  check_contiguous(weight3, op, wname);
  if (weight3.ndim != 3)
    throw RuntimeError(fmt::format("{}: {} must be [G, N, K], got {}", op, wname, weight3.describe()));
  GgCall c;
  c.kind = kind;
  c.G = weight3.shape[0], c.N = weight3.shape[1], c.K = weight3.shape[2];
  if (c.G < 1) throw RuntimeError(fmt::format("{}: {} has no groups: {}", op, wname, weight3.describe()));
  check_defined(offsets, op, "offsets");
  check_dtype(offsets, DType::I32, op, "offsets");
  check_contiguous(offsets, op, "offsets");
  if (offsets.ndim != 1 || offsets.shape[0] != c.G + 1)
    throw RuntimeError(fmt::format("{}: offsets must be [G+1] = [{}] for {} {}, got {}", op, c.G + 1, wname,
                                   weight3.describe(), offsets.describe()));
  if (align < 1) throw RuntimeError(fmt::format("{}: align must be >= 1, got {}", op, align));
  c.offsets = offsets;
  c.align = align;
  c.ctx = ctx;
  return c;
}

void gg_finish_checks(const GgCall& c, std::initializer_list<std::pair<const char*, const TensorView*>> views,
                   const TensorView& token_dtype_ref) {
  const char* op = gg_op_name(c.kind);
  for (const auto& [name, v] : views) {
    if (v->device != c.offsets.device)
      throw RuntimeError(fmt::format("{}: {} is on {}, offsets on {}", op, name, device_name(v->device),
                                     device_name(c.offsets.device)));
    // Every bf16 / f32 operand but dweight (f32, or bf16 beside bf16 tokens) shares the token operand's dtype.
    if (v != &c.y || c.kind != GgKind::Wgrad) check_dtype(*v, token_dtype_ref.dtype, op, name);
  }
  if (c.kind == GgKind::Wgrad && !(c.y.dtype == DType::BF16 && token_dtype_ref.dtype == DType::BF16))
    check_dtype(c.y, DType::F32, op, "dweight");
  if (c.kind == GgKind::Wgrad && c.y.dtype == DType::BF16 && c.accumulate)
    throw RuntimeError(fmt::format("{}: a bf16 dweight is written, never accumulated (each addition would round); "
                                   "accumulate into an f32 dweight",
                                   op));
}

// Host offsets: checked against the contract (a broken plan must not reach memory past the
// buffers); the error names the op and the first bad entry.
std::vector<int32_t> gg_checked_offsets(const GgCall& c, const int32_t* host) {
  std::vector<int32_t> o(host, host + c.G + 1);
  cpu::check_row_groups(o.data(), c.G, c.M, gg_op_name(c.kind), "M");
  return o;
}

// ---- CPU -------------------------------------------------------------------------------------------
std::string gg_cpu_check(const GgCall& c) {
  if (auto w = detail::all_on(Device::CPU, {{"x", &c.x}, {"w", &c.w}, {"y", &c.y}, {"offsets", &c.offsets}}); !w.empty())
    return w;
  if (c.glu.defined() && c.glu.device != Device::CPU) return "the SwiGLU tensor is not on the host";
  return detail::all_dtype(DType::F32, {{"x", &c.x}, {"w", &c.w}, {"y", &c.y}});
}
void gg_cpu_run(const GgCall& c) {
  const std::vector<int32_t> o = gg_checked_offsets(c, c.offsets.ptr<const int32_t>());
  const int64_t used = o[static_cast<size_t>(c.G)];  // rows of the groups
  switch (c.kind) {
    case GgKind::Forward:
      cpu::grouped_gemm_forward(c.y.ptr<float>(), c.x.ptr<const float>(), c.w.ptr<const float>(), o.data(), c.G, c.N, c.K);
      if (c.glu.defined()) cpu::swiglu_forward(c.glu.ptr<float>(), c.y.ptr<const float>(), used, c.N / 2);
      break;
    case GgKind::Dgrad:
      if (c.glu.defined()) {  // act's gradient first, then through SwiGLU into d(gate|up)
        std::vector<float> dact(static_cast<size_t>(c.M * c.K));
        cpu::grouped_gemm_dgrad(dact.data(), c.x.ptr<const float>(), c.w.ptr<const float>(), o.data(), c.G, c.N, c.K);
        std::fill(c.y.ptr<float>(), c.y.ptr<float>() + used * 2 * c.K, 0.0f);  // swiglu_backward adds
        cpu::swiglu_backward(c.y.ptr<float>(), c.glu.ptr<const float>(), dact.data(), used, c.K);
        break;
      }
      cpu::grouped_gemm_dgrad(c.y.ptr<float>(), c.x.ptr<const float>(), c.w.ptr<const float>(), o.data(), c.G, c.N, c.K);
      break;
    case GgKind::Wgrad:
      cpu::grouped_gemm_wgrad(c.y.ptr<float>(), c.x.ptr<const float>(), c.w.ptr<const float>(), o.data(), c.G, c.N, c.K,
                              c.accumulate);
      break;
  }
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string gg_device_dtypes(const GgCall& c) {
  if (auto w = detail::all_on(Device::CUDA, {{"x", &c.x}, {"w", &c.w}, {"y", &c.y}, {"offsets", &c.offsets}}); !w.empty())
    return w;
  if (c.x.dtype != DType::BF16) return fmt::format("the token tensors are {}; this backend multiplies bf16", dtype_name(c.x.dtype));
  return "";
}

// ---- TURBO -----------------------------------------------------------------------------------------
cuda::GroupedGemmSm90Problem gg_sm90_problem(const GgCall& c) {
  cuda::GroupedGemmSm90Problem p;
  p.kind = c.kind == GgKind::Forward ? cuda::GroupedGemmKind::Forward
           : c.kind == GgKind::Dgrad ? cuda::GroupedGemmKind::Dgrad
                                     : cuda::GroupedGemmKind::Wgrad;
  p.groups = c.G, p.rows = c.M, p.n = c.N, p.k = c.K;
  p.offsets = c.offsets.ptr<const int32_t>();
  p.a = c.x.data;
  p.b = c.w.data;
  p.d = c.y.data;
  p.accumulate = c.accumulate;
  p.d_bf16 = c.kind == GgKind::Wgrad && c.y.dtype == DType::BF16;
  if (c.glu.defined()) {
    p.glu = cuda::GroupedGemmGlu::SwiGLU;
    p.aux = c.glu.data;
  }
  return p;
}
std::string gg_turbo_check(const GgCall& c) {
  if (auto w = gg_device_dtypes(c); !w.empty()) return w;
  return cuda::grouped_gemm_sm90_unsupported_reason(gg_sm90_problem(c));
}
void gg_turbo_run(const GgCall& c) { cuda::grouped_gemm_sm90(gg_sm90_problem(c), static_cast<cudaStream_t>(c.ctx.stream)); }

// ---- CUBLASLT --------------------------------------------------------------------------------------
std::string gg_cublaslt_check(const GgCall& c) {
  if (auto w = gg_device_dtypes(c); !w.empty()) return w;
  if (c.glu.defined()) return "the SwiGLU epilogue is TURBO's (this backend has no scratch for act's gradient)";
  if (detail::cuda_capturing(c.ctx.stream))
    return "the stream is being captured into a CUDA graph, and this backend reads the group offsets on the host";
  return cublaslt::library().unavailable_reason();
}
void gg_cublaslt_run(const GgCall& c) {
  auto stream = static_cast<cudaStream_t>(c.ctx.stream);
  std::vector<int32_t> host(static_cast<size_t>(c.G + 1));
  CUDA_CHECK(cudaMemcpyAsync(host.data(), c.offsets.data, host.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<int32_t> o = gg_checked_offsets(c, host.data());
  const int64_t bf = 2;  // bytes per bf16 element
  for (int64_t g = 0; g < c.G; ++g) {
    const int64_t r0 = o[g], rows = o[g + 1] - o[g];
    cublaslt::GemmProblem p;
    const char* xb = static_cast<const char*>(c.x.data);
    const char* wb = static_cast<const char*>(c.w.data);
    char* yb = static_cast<char*>(c.y.data);
    switch (c.kind) {
      case GgKind::Forward:  // out_g [rows,N] = inp_g [rows,K] @ W_g^T
        if (rows == 0) continue;
        p.m = rows, p.n = c.N, p.k = c.K;
        p.a = {xb + r0 * c.K * bf, DType::BF16, c.K, false};
        p.b = {wb + g * c.N * c.K * bf, DType::BF16, c.K, true};
        p.d = {yb + r0 * c.N * bf, DType::BF16, c.N, false};
        break;
      case GgKind::Dgrad:  // dinp_g [rows,K] = dout_g [rows,N] @ W_g
        if (rows == 0) continue;
        p.m = rows, p.n = c.K, p.k = c.N;
        p.a = {xb + r0 * c.N * bf, DType::BF16, c.N, false};
        p.b = {wb + g * c.N * c.K * bf, DType::BF16, c.K, false};
        p.d = {yb + r0 * c.K * bf, DType::BF16, c.K, false};
        break;
      case GgKind::Wgrad: {  // dW_g [N,K] (+)= dout_g^T @ inp_g
        const size_t esize = dtype_size(c.y.dtype);
        char* dw = yb + g * c.N * c.K * static_cast<int64_t>(esize);
        if (rows == 0) {
          if (!c.accumulate) CUDA_CHECK(cudaMemsetAsync(dw, 0, static_cast<size_t>(c.N * c.K) * esize, stream));
          continue;
        }
        p.m = c.N, p.n = c.K, p.k = rows;
        p.a = {xb + r0 * c.N * bf, DType::BF16, c.N, true};
        p.b = {wb + r0 * c.K * bf, DType::BF16, c.K, false};
        p.d = {dw, c.y.dtype, c.K, false};
        p.beta = c.accumulate ? 1.0f : 0.0f;
        break;
      }
    }
    cublaslt::gemm(p, stream);
  }
}
#endif

OpDispatcher<GgCall>& gg_dispatcher() {
  static OpDispatcher<GgCall>* d = [] {
    // Not autotuned: the weight gradient may accumulate in place, and CUBLASLT synchronises.
    auto* disp = new OpDispatcher<GgCall>("grouped_gemm", detail::kDeviceDefault, DispatcherOptions{false, 16});
#ifdef PRIMUS_TURBO_WITH_CUDA
    disp->register_backend(make_backend<GgCall>(BackendType::TURBO, gg_turbo_check, gg_turbo_run));
    disp->register_backend(make_backend<GgCall>(BackendType::CUBLASLT, gg_cublaslt_check, gg_cublaslt_run));
#endif
    disp->register_backend(make_backend<GgCall>(BackendType::CPU, gg_cpu_check, gg_cpu_run));
    detail::install_cuda_hooks(*disp);
    return disp;
  }();
  return *d;
}

}  // namespace

bool grouped_gemm_swiglu_available(Device device, int64_t F) {
  if (F < 1) return false;
  if (device == Device::CPU) return true;
#ifdef PRIMUS_TURBO_WITH_CUDA
  if (F % 128 != 0 || !cuda::grouped_gemm_sm90_device_ok()) return false;
  const auto choice = GlobalBackendManager::instance().user_choice("grouped_gemm", Precision::BF16);
  return !choice || choice->choice.is_autotune() || choice->choice.backend == BackendType::TURBO;
#else
  return false;
#endif
}

BackendType grouped_gemm_forward(const GroupedGemmForwardArgs& a) {
  GgCall c = gg_make_call(GgKind::Forward, a.weight, a.offsets, a.align, a.ctx);
  const char* op = gg_op_name(c.kind);
  check_defined(a.inp, op, "inp");
  c.M = a.inp.ndim == 2 ? a.inp.shape[0] : -1;
  gg_check_2d(a.inp, -1, c.K, op, "inp");
  gg_check_2d(a.out, c.M, c.N, op, "out");
  c.x = a.inp, c.w = a.weight, c.y = a.out;
  gg_finish_checks(c, {{"inp", &c.x}, {"weight", &c.w}, {"out", &c.y}}, c.x);
  if (a.swiglu_out.defined()) {
    if (c.N % 2 != 0)
      throw RuntimeError(fmt::format("{}: swiglu_out needs the weight's N (gate|up) even, got {}", op, a.weight.describe()));
    gg_check_2d(a.swiglu_out, c.M, c.N / 2, op, "swiglu_out");
    c.glu = a.swiglu_out;
    gg_finish_checks(c, {{"swiglu_out", &c.glu}}, c.x);
  }
  return gg_dispatcher().dispatch(c);
}

BackendType grouped_gemm_dgrad(const GroupedGemmDgradArgs& a) {
  GgCall c = gg_make_call(GgKind::Dgrad, a.weight, a.offsets, a.align, a.ctx);
  const char* op = gg_op_name(c.kind);
  check_defined(a.dout, op, "dout");
  c.M = a.dout.ndim == 2 ? a.dout.shape[0] : -1;
  gg_check_2d(a.dout, -1, c.N, op, "dout");
  c.x = a.dout, c.w = a.weight, c.y = a.dinp;
  if (a.swiglu_inp.defined()) {  // dinp is then d(gate|up)
    gg_check_2d(a.swiglu_inp, c.M, 2 * c.K, op, "swiglu_inp");
    c.glu = a.swiglu_inp;
  }
  gg_check_2d(a.dinp, c.M, c.glu.defined() ? 2 * c.K : c.K, op, "dinp");
  gg_finish_checks(c, {{"dout", &c.x}, {"weight", &c.w}, {"dinp", &c.y}}, c.x);
  if (c.glu.defined()) gg_finish_checks(c, {{"swiglu_inp", &c.glu}}, c.x);
  return gg_dispatcher().dispatch(c);
}

BackendType grouped_gemm_wgrad(const GroupedGemmWgradArgs& a) {
  GgCall c = gg_make_call(GgKind::Wgrad, a.dweight, a.offsets, a.align, a.ctx);
  const char* op = gg_op_name(c.kind);
  check_defined(a.dout, op, "dout");
  c.M = a.dout.ndim == 2 ? a.dout.shape[0] : -1;
  gg_check_2d(a.dout, -1, c.N, op, "dout");
  gg_check_2d(a.inp, c.M, c.K, op, "inp");
  c.x = a.dout, c.w = a.inp, c.y = a.dweight;
  c.accumulate = a.accumulate;
  gg_finish_checks(c, {{"dout", &c.x}, {"inp", &c.w}, {"dweight", &c.y}}, c.x);
  return gg_dispatcher().dispatch(c);
}

}  // namespace primus::turbo
