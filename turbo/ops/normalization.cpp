#include "turbo/ops/normalization.h"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "turbo/kernels/cpu/normalization.h"
#include "turbo/kernels/cpu/residual.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/normalization.h"
#endif

namespace primus::turbo {
namespace {

const char* type_name(NormType t) { return t == NormType::LayerNorm ? "layernorm" : "rmsnorm"; }

void validate(const NormForwardArgs& a) {
  const char* op = "norm_forward";
  check_defined(a.inp, op, "inp");
  check_contiguous(a.inp, op, "inp");
  const int64_t N = a.inp.rows(), C = a.inp.cols();
  for (auto [name, t] : {std::pair{"out", &a.out}, {"residual_out", &a.residual_out}, {"residual", &a.residual}}) {
    if (!t->defined()) continue;
    if (t == &a.out) {  // out may have padded rows ([N, C] with a row stride >= C)
      if (t->ndim != 2 || t->stride(1) != 1 || t->stride(0) < t->size(1))
        throw RuntimeError(fmt::format("{}: out must be [N, C] with contiguous rows, got {}", op, t->describe()));
    } else {
      check_contiguous(*t, op, name);
    }
    if (t->rows() != N || t->cols() != C || t->dtype != a.inp.dtype)
      throw RuntimeError(fmt::format("{}: {} {} does not match inp {}", op, name, t->describe(), a.inp.describe()));
  }
  check_defined(a.out, op, "out");
  check_shape(a.weight, {C}, op, "weight");
  if (a.bias.defined()) {
    if (a.type == NormType::RMSNorm) throw RuntimeError("norm_forward: RMSNorm takes no bias");
    check_shape(a.bias, {C}, op, "bias");
  }
  if (a.residual.defined() != a.residual_out.defined())
    throw RuntimeError("norm_forward: residual and residual_out go together (fused add)");
  check_shape(a.rstd, {N}, op, "rstd");
  if (a.type == NormType::LayerNorm) check_shape(a.mean, {N}, op, "mean");
}

void validate(const NormBackwardArgs& a) {
  const char* op = "norm_backward";
  check_defined(a.inp, op, "inp");
  const int64_t N = a.inp.rows(), C = a.inp.cols();
  for (auto [name, t] : {std::pair{"dinp", &a.dinp}, {"dout", &a.dout}}) {
    check_defined(*t, op, name);
    check_contiguous(*t, op, name);
    if (t->rows() != N || t->cols() != C || t->dtype != a.inp.dtype)
      throw RuntimeError(fmt::format("{}: {} {} does not match inp {}", op, name, t->describe(), a.inp.describe()));
  }
  check_shape(a.weight, {C}, op, "weight");
  check_shape(a.dweight, {C}, op, "dweight");
  check_dtype(a.dweight, DType::F32, op, "dweight");
  if (a.dbias.defined()) {
    check_shape(a.dbias, {C}, op, "dbias");
    check_dtype(a.dbias, DType::F32, op, "dbias");
  }
  if (a.dinp_colsum.defined()) {
    check_shape(a.dinp_colsum, {C}, op, "dinp_colsum");
    check_dtype(a.dinp_colsum, DType::F32, op, "dinp_colsum");
    check_same_device(a.dinp_colsum, a.inp, op);
  }
  check_shape(a.rstd, {N}, op, "rstd");
  if (a.type == NormType::LayerNorm) check_shape(a.mean, {N}, op, "mean");
}

std::string cpu_check_fwd(const NormForwardArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"inp", &a.inp}, {"out", &a.out}, {"weight", &a.weight}, {"residual", &a.residual}}); !w.empty()) return w;
  return detail::all_dtype(DType::F32, {{"inp", &a.inp}, {"weight", &a.weight}, {"bias", &a.bias}, {"mean", &a.mean}, {"rstd", &a.rstd}});
}

void cpu_fwd(const NormForwardArgs& a) {
  const int64_t N = a.inp.rows(), C = a.inp.cols();
  const float* x = a.inp.ptr<float>();
  if (a.residual.defined()) {
    cpu::residual_forward(a.residual_out.ptr<float>(), x, a.residual.ptr<const float>(), N * C);
    x = a.residual_out.ptr<float>();
  }
  // Padded output rows: normalise into a dense buffer, then copy the rows (the padding is left).
  const int64_t ld = a.out.stride(0);
  std::vector<float> dense(ld == C ? 0 : static_cast<size_t>(N * C));
  float* out = ld == C ? a.out.ptr<float>() : dense.data();
  if (a.type == NormType::LayerNorm)
    cpu::layernorm_forward(out, a.mean.ptr<float>(), a.rstd.ptr<float>(), x,
                           a.weight.ptr<const float>(), a.bias.ptr<const float>(), N, C, a.eps);
  else
    cpu::rmsnorm_forward(out, a.rstd.ptr<float>(), x, a.weight.ptr<const float>(), N, C, a.eps);
  if (ld != C)
    for (int64_t r = 0; r < N; ++r) std::memcpy(a.out.ptr<float>() + r * ld, out + r * C, size_t(C) * sizeof(float));
}

std::string cpu_check_bwd(const NormBackwardArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"inp", &a.inp}, {"dinp", &a.dinp}, {"dout", &a.dout}, {"weight", &a.weight}, {"dinp_colsum", &a.dinp_colsum}}); !w.empty()) return w;
  return detail::all_dtype(DType::F32, {{"inp", &a.inp}, {"weight", &a.weight}, {"mean", &a.mean}, {"rstd", &a.rstd}});
}

void cpu_bwd(const NormBackwardArgs& a) {
  const int64_t N = a.inp.rows(), C = a.inp.cols();
  if (!a.accumulate_dinp) std::memset(a.dinp.data, 0, a.dinp.nbytes());
  if (a.type == NormType::LayerNorm)
    cpu::layernorm_backward(a.dinp.ptr<float>(), a.dweight.ptr<float>(), a.dbias.ptr<float>(),
                            a.dout.ptr<const float>(), a.inp.ptr<const float>(), a.weight.ptr<const float>(),
                            a.mean.ptr<const float>(), a.rstd.ptr<const float>(), N, C);
  else
    cpu::rmsnorm_backward(a.dinp.ptr<float>(), a.dweight.ptr<float>(), a.dout.ptr<const float>(),
                          a.inp.ptr<const float>(), a.weight.ptr<const float>(), a.rstd.ptr<const float>(), N, C);
  if (a.dinp_colsum.defined()) {
    // Column sums of the final dinp rows, each column in row order (deterministic).
    const float* dx = a.dinp.ptr<const float>();
    float* cs = a.dinp_colsum.ptr<float>();
    std::vector<double> sum(static_cast<size_t>(C), 0.0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) sum[c] += dx[n * C + c];
    for (int64_t c = 0; c < C; ++c) cs[c] += static_cast<float>(sum[c]);
  }
}

#ifdef PRIMUS_TURBO_WITH_CUDA
cuda::NormKind kind(NormType t) { return t == NormType::LayerNorm ? cuda::NormKind::LayerNorm : cuda::NormKind::RMSNorm; }

std::string turbo_check_fwd(const NormForwardArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"inp", &a.inp}, {"out", &a.out}, {"weight", &a.weight}, {"bias", &a.bias}, {"residual", &a.residual}, {"residual_out", &a.residual_out}, {"mean", &a.mean}, {"rstd", &a.rstd}}); !w.empty()) return w;
  if (auto w = detail::all_dtype(a.inp.dtype, {{"weight", &a.weight}, {"bias", &a.bias}}); !w.empty()) return w;
  if (auto w = detail::all_dtype(DType::F32, {{"mean", &a.mean}, {"rstd", &a.rstd}}); !w.empty()) return w;
  if (a.out.stride(0) % (16 / static_cast<int64_t>(dtype_size(a.out.dtype))) != 0)
    return "out's row stride must be a multiple of the 16-byte vector";
  return cuda::norm_unsupported_reason(a.inp.dtype, a.inp.cols());
}

void turbo_fwd(const NormForwardArgs& a) {
  cuda::norm_forward(kind(a.type), a.inp.dtype, a.out.data, a.mean.ptr<float>(), a.rstd.ptr<float>(),
                     a.residual_out.data, a.inp.data, a.residual.data, a.weight.data, a.bias.data,
                     a.inp.rows(), a.inp.cols(), a.eps, static_cast<cudaStream_t>(a.ctx.stream), a.out.stride(0));
}

std::string turbo_check_bwd(const NormBackwardArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"inp", &a.inp}, {"dinp", &a.dinp}, {"dout", &a.dout}, {"weight", &a.weight}, {"dweight", &a.dweight}, {"dbias", &a.dbias}, {"mean", &a.mean}, {"rstd", &a.rstd}, {"dinp_colsum", &a.dinp_colsum}}); !w.empty()) return w;
  if (auto w = detail::all_dtype(a.inp.dtype, {{"weight", &a.weight}}); !w.empty()) return w;
  if (!a.ctx.scratch) return "needs ExecContext::scratch (device arena) for the parameter-gradient partials";
  return cuda::norm_unsupported_reason(a.inp.dtype, a.inp.cols());
}

void turbo_bwd(const NormBackwardArgs& a) {
  const int64_t N = a.inp.rows(), C = a.inp.cols();
  Arena& arena = detail::scratch_of(a.ctx, "norm_backward");
  ArenaScope scope(arena);
  void* scratch = arena.allocate(cuda::norm_backward_scratch_bytes(N, C), 256, "norm_backward partials");
  cuda::norm_backward(kind(a.type), a.inp.dtype, a.dinp.data, a.dweight.ptr<float>(), a.dbias.ptr<float>(),
                      a.dout.data, a.inp.data, a.weight.data, a.mean.ptr<const float>(),
                      a.rstd.ptr<const float>(), N, C, a.accumulate_dinp, scratch,
                      static_cast<cudaStream_t>(a.ctx.stream), a.dinp_colsum.ptr<float>());
}
#endif

}  // namespace

std::string NormForwardArgs::key() const {
  return fmt::format("{}_forward inp={} residual={} bias={} ld_out={}", type_name(type), inp.describe(),
                     residual.defined() ? 1 : 0, bias.defined() ? 1 : 0, out.defined() ? out.stride(0) : 0);
}
std::string NormBackwardArgs::key() const {
  return fmt::format("{}_backward inp={} dbias={} acc={} colsum={}", type_name(type), inp.describe(),
                     dbias.defined() ? 1 : 0, accumulate_dinp ? 1 : 0, dinp_colsum.defined() ? 1 : 0);
}

BackendType norm_forward(const NormForwardArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<NormForwardArgs>(
      "norm", PRIMUS_TURBO_FN(turbo_check_fwd), PRIMUS_TURBO_FN(turbo_fwd), cpu_check_fwd, cpu_fwd);
  return d->dispatch(args);
}

BackendType norm_backward(const NormBackwardArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<NormBackwardArgs>(
      "norm", PRIMUS_TURBO_FN(turbo_check_bwd), PRIMUS_TURBO_FN(turbo_bwd), cpu_check_bwd, cpu_bwd);
  return d->dispatch(args);
}

}  // namespace primus::turbo
