#include "turbo/ops/activation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "turbo/kernels/cpu/activation.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/activation.h"
#endif

namespace primus::turbo {
namespace {

const char* act_name(Activation a) { return a == Activation::Gelu ? "gelu" : "swiglu"; }

// For swiglu: rows N and half-width F of gate_up [N,2F]; checks the partner tensor [N,F].
void swiglu_dims(const TensorView& gate_up, const TensorView& half, const char* op, int64_t* N, int64_t* F) {
  *N = gate_up.rows();
  if (gate_up.cols() % 2 != 0)
    throw RuntimeError(fmt::format("{}: gate_up {} has an odd last dimension", op, gate_up.describe()));
  *F = gate_up.cols() / 2;
  if (half.rows() != *N || half.cols() != *F)
    throw RuntimeError(fmt::format("{}: {} is not [{}, {}] for gate_up {}", op, half.describe(), *N, *F,
                                   gate_up.describe()));
}

// The optional maxima of a SwiGLU output [R, C]: f32 [R + C + 1], contiguous, on the output's device.
void check_maxima(const TensorView& maxima, Activation act, const TensorView& y, const char* op) {
  if (!maxima.defined()) return;
  if (act != Activation::SwiGLU)
    throw RuntimeError(fmt::format("{}: maxima are written by swiglu only, not gelu", op));
  check_contiguous(maxima, op, "maxima");
  check_dtype(maxima, DType::F32, op, "maxima");
  if (maxima.numel() != y.rows() + y.cols() + 1)
    throw RuntimeError(fmt::format("{}: maxima {} must hold {} rows + {} columns + 1 of {}", op, maxima.describe(),
                                   y.rows(), y.cols(), y.describe()));
  if (maxima.device != y.device)
    throw RuntimeError(fmt::format("{}: maxima {} is not on the output's device ({})", op, maxima.describe(),
                                   y.describe()));
}

// max |y| per row, then per column, then over all, of a host f32 [R, C] matrix as f32 bits
// (unsigned order of the magnitudes' bits: NaN > inf > finite), into maxima [R + C + 1].
void host_maxima(const float* y, int64_t R, int64_t C, float* maxima) {
  std::vector<uint32_t> m(static_cast<size_t>(R + C + 1), 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      uint32_t b;
      std::memcpy(&b, y + r * C + c, 4);
      b &= 0x7fffffffu;
      m[r] = std::max(m[r], b);
      m[R + c] = std::max(m[R + c], b);
      m[R + C] = std::max(m[R + C], b);
    }
  std::memcpy(maxima, m.data(), m.size() * 4);
}

void validate(const ActivationForwardArgs& a) {
  const char* op = "activation_forward";
  check_defined(a.inp, op, "inp");
  check_defined(a.out, op, "out");
  check_contiguous(a.inp, op, "inp");
  check_contiguous(a.out, op, "out");
  check_dtype(a.out, a.inp.dtype, op, "out");
  if (a.act == Activation::Gelu) {
    if (a.out.numel() != a.inp.numel())
      throw RuntimeError(fmt::format("{}: out {} and inp {} differ in size", op, a.out.describe(), a.inp.describe()));
  } else {
    int64_t N, F;
    swiglu_dims(a.inp, a.out, op, &N, &F);
  }
  check_maxima(a.maxima, a.act, a.out, op);
}

void validate(const ActivationBackwardArgs& a) {
  const char* op = "activation_backward";
  for (auto [n, t] : {std::pair{"dinp", &a.dinp}, {"inp", &a.inp}, {"dout", &a.dout}}) {
    check_defined(*t, op, n);
    check_contiguous(*t, op, n);
    check_dtype(*t, a.inp.dtype, op, n);
  }
  if (a.act == Activation::Gelu) {
    if (a.dinp.numel() != a.inp.numel() || a.dout.numel() != a.inp.numel())
      throw RuntimeError(fmt::format("{}: dinp {}, inp {}, dout {} differ in size", op, a.dinp.describe(),
                                     a.inp.describe(), a.dout.describe()));
  } else {
    int64_t N, F;
    swiglu_dims(a.inp, a.dout, op, &N, &F);
    if (a.dinp.numel() != a.inp.numel()) throw RuntimeError("activation_backward: dgate_up must match gate_up");
  }
  check_maxima(a.maxima, a.act, a.dinp, op);
}

std::string cpu_check_fwd(const ActivationForwardArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"inp", &a.inp}, {"out", &a.out}, {"maxima", &a.maxima}}); !w.empty())
    return w;
  return detail::all_dtype(DType::F32, {{"inp", &a.inp}});
}
void cpu_fwd(const ActivationForwardArgs& a) {
  if (a.act == Activation::Gelu) {
    cpu::gelu_forward(a.out.ptr<float>(), a.inp.ptr<const float>(), a.inp.numel());
  } else {
    const int64_t F = a.inp.cols() / 2;
    cpu::swiglu_forward(a.out.ptr<float>(), a.inp.ptr<const float>(), a.inp.rows(), F);
    if (a.maxima.defined()) host_maxima(a.out.ptr<const float>(), a.inp.rows(), F, a.maxima.ptr<float>());
  }
}
std::string cpu_check_bwd(const ActivationBackwardArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"inp", &a.inp}, {"dinp", &a.dinp}, {"dout", &a.dout}, {"maxima", &a.maxima}});
      !w.empty())
    return w;
  return detail::all_dtype(DType::F32, {{"inp", &a.inp}});
}
void cpu_bwd(const ActivationBackwardArgs& a) {
  // The reference kernels add into dinp: zero it first, after keeping dout when GELU's backward
  // runs in place (dinp == dout, as the cuda backend's unfused GELU backward calls it).
  std::vector<float> dout_copy;
  const float* dout = a.dout.ptr<const float>();
  if (a.act == Activation::Gelu && !a.accumulate && a.dinp.data == a.dout.data) {
    dout_copy.assign(dout, dout + a.dout.numel());
    dout = dout_copy.data();
  }
  if (!a.accumulate) std::memset(a.dinp.data, 0, a.dinp.nbytes());
  if (a.act == Activation::Gelu) {
    cpu::gelu_backward(a.dinp.ptr<float>(), a.inp.ptr<const float>(), dout, a.inp.numel());
  } else {
    cpu::swiglu_backward(a.dinp.ptr<float>(), a.inp.ptr<const float>(), a.dout.ptr<const float>(),
                         a.inp.rows(), a.inp.cols() / 2);
    if (a.maxima.defined()) host_maxima(a.dinp.ptr<const float>(), a.inp.rows(), a.inp.cols(), a.maxima.ptr<float>());
  }
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string turbo_check(Activation act, const TensorView& inp, std::initializer_list<std::pair<const char*, const TensorView*>> all) {
  if (auto w = detail::all_on(Device::CUDA, all); !w.empty()) return w;
  if (inp.dtype != DType::F32 && inp.dtype != DType::BF16) return "dtype must be f32 or bf16";
  const int64_t width = 16 / static_cast<int64_t>(dtype_size(inp.dtype));
  const int64_t n = act == Activation::Gelu ? inp.numel() : inp.cols() / 2;
  if (n % width != 0)
    return fmt::format("{} must be a multiple of {} (128-bit vectors)", act == Activation::Gelu ? "numel" : "F", width);
  return "";
}
std::string turbo_check_fwd(const ActivationForwardArgs& a) {
  return turbo_check(a.act, a.inp, {{"inp", &a.inp}, {"out", &a.out}, {"maxima", &a.maxima}});
}
void turbo_fwd(const ActivationForwardArgs& a) {
  auto s = static_cast<cudaStream_t>(a.ctx.stream);
  if (a.act == Activation::Gelu)
    cuda::gelu_forward(a.inp.dtype, a.out.data, a.inp.data, a.inp.numel(), s);
  else
    cuda::swiglu_forward(a.inp.dtype, a.out.data, a.inp.data, a.inp.rows(), a.inp.cols() / 2, s,
                         a.maxima.defined() ? a.maxima.ptr<float>() : nullptr);
}
std::string turbo_check_bwd(const ActivationBackwardArgs& a) {
  return turbo_check(a.act, a.inp, {{"inp", &a.inp}, {"dinp", &a.dinp}, {"dout", &a.dout}, {"maxima", &a.maxima}});
}
void turbo_bwd(const ActivationBackwardArgs& a) {
  auto s = static_cast<cudaStream_t>(a.ctx.stream);
  if (a.act == Activation::Gelu)
    cuda::gelu_backward(a.inp.dtype, a.dinp.data, a.inp.data, a.dout.data, a.inp.numel(), a.accumulate, s);
  else
    cuda::swiglu_backward(a.inp.dtype, a.dinp.data, a.inp.data, a.dout.data, a.inp.rows(), a.inp.cols() / 2,
                          a.accumulate, s, a.maxima.defined() ? a.maxima.ptr<float>() : nullptr);
}
#endif

}  // namespace

std::string ActivationForwardArgs::key() const {
  return fmt::format("{}_forward inp={}{}", act_name(act), inp.describe(), maxima.defined() ? " maxima" : "");
}
std::string ActivationBackwardArgs::key() const {
  return fmt::format("{}_backward inp={} acc={}{}", act_name(act), inp.describe(), accumulate ? 1 : 0,
                     maxima.defined() ? " maxima" : "");
}

BackendType activation_forward(const ActivationForwardArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<ActivationForwardArgs>(
      "activation", PRIMUS_TURBO_FN(turbo_check_fwd), PRIMUS_TURBO_FN(turbo_fwd), cpu_check_fwd, cpu_fwd);
  return d->dispatch(args);
}

BackendType activation_backward(const ActivationBackwardArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<ActivationBackwardArgs>(
      "activation", PRIMUS_TURBO_FN(turbo_check_bwd), PRIMUS_TURBO_FN(turbo_bwd), cpu_check_bwd, cpu_bwd);
  return d->dispatch(args);
}

}  // namespace primus::turbo
