#include "turbo/ops/head_norm.h"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "turbo/kernels/cpu/normalization.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/head_norm.h"
#endif

namespace primus::turbo {
namespace {

const char* head_norm_op(const HeadNormArgs& a) { return a.backward ? "head_norm_backward" : "head_norm_forward"; }

void head_norm_validate(const HeadNormArgs& a) {
  const char* op = head_norm_op(a);
  check_defined(a.x, op, "x");
  check_shape(a.x, {-1, -1, -1, -1}, op, "x");
  detail::token_rows(a.x, op, "x");
  const int64_t B = a.x.shape[0], T = a.x.shape[1], Hx = a.x.shape[2], D = a.x.shape[3];
  check_shape(a.saved, {B, T, Hx, D}, op, "saved");
  check_contiguous(a.saved, op, "saved");
  check_dtype(a.saved, a.x.dtype, op, "saved");
  check_shape(a.rstd, {B * T * Hx}, op, "rstd");
  check_dtype(a.rstd, DType::F32, op, "rstd");
  check_shape(a.weight, {D}, op, "weight");
  check_shape(a.weight_k, {D}, op, "weight_k");
  check_dtype(a.weight, a.x.dtype, op, "weight");
  check_dtype(a.weight_k, a.x.dtype, op, "weight_k");
  if (a.q_heads < 0 || a.q_heads > Hx)
    throw RuntimeError(fmt::format("{}: q_heads {} outside [0, {}] heads", op, a.q_heads, Hx));
  if (a.backward) {
    check_shape(a.dweight, {D}, op, "dweight");
    check_shape(a.dweight_k, {D}, op, "dweight_k");
    check_dtype(a.dweight, DType::F32, op, "dweight");
    check_dtype(a.dweight_k, DType::F32, op, "dweight_k");
  }
}

std::string head_norm_cpu_check(const HeadNormArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"x", &a.x}, {"saved", &a.saved}, {"rstd", &a.rstd}, {"weight", &a.weight},
                                            {"weight_k", &a.weight_k}, {"dweight", &a.dweight}, {"dweight_k", &a.dweight_k}});
      !w.empty())
    return w;
  return detail::all_dtype(DType::F32, {{"x", &a.x}});
}

void head_norm_cpu_run(const HeadNormArgs& a) {
  const auto& s = a.x.shape;
  const int64_t N = s[0] * s[1], Hx = s[2], D = s[3];
  // The reference kernels read dense rows: a strided x goes through a dense copy.
  detail::DenseRows dense(a.ctx, head_norm_op(a));
  const TensorView x = dense.in(a.x);
  const float* wq = a.weight.ptr<const float>();
  const float* wk = a.weight_k.ptr<const float>();
  if (!a.backward) {
    std::memcpy(a.saved.data, x.data, x.nbytes());
    cpu::head_rmsnorm_forward(x.ptr<float>(), a.rstd.ptr<float>(), a.saved.ptr<const float>(), wq, wk, N, Hx,
                              a.q_heads, D, static_cast<double>(a.eps));
  } else {
    // The reference backward accumulates into dinp: start from zero beside the incoming gradient.
    std::vector<float> dy(x.ptr<const float>(), x.ptr<const float>() + N * Hx * D);
    std::memset(x.data, 0, x.nbytes());
    cpu::head_rmsnorm_backward(x.ptr<float>(), a.dweight.ptr<float>(), a.dweight_k.ptr<float>(), dy.data(),
                               a.saved.ptr<const float>(), wq, wk, a.rstd.ptr<const float>(), N, Hx, a.q_heads, D);
  }
  dense.finish(a.x, x);
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string head_norm_turbo_check(const HeadNormArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"x", &a.x}, {"saved", &a.saved}, {"rstd", &a.rstd}, {"weight", &a.weight},
                                             {"weight_k", &a.weight_k}, {"dweight", &a.dweight}, {"dweight_k", &a.dweight_k}});
      !w.empty())
    return w;
  if (a.x.dtype != DType::F32 && a.x.dtype != DType::BF16) return "dtype must be f32 or bf16";
  if (a.x.shape[3] > cuda::kHeadNormMaxDim) return fmt::format("head dim above {}", cuda::kHeadNormMaxDim);
  if (a.backward && !a.ctx.scratch) return "the backward needs a scratch arena";
  return "";
}
void head_norm_turbo_run(const HeadNormArgs& a) {
  const auto& s = a.x.shape;
  const int64_t N = s[0] * s[1], Hx = s[2], D = s[3], row = a.x.strides[1];
  auto st = static_cast<cudaStream_t>(a.ctx.stream);
  if (!a.backward) {
    cuda::head_norm_forward(a.x.dtype, a.x.data, row, a.saved.data, a.rstd.ptr<float>(), a.weight.data, a.weight_k.data,
                            N, Hx, a.q_heads, D, a.eps, st);
    return;
  }
  Arena& arena = detail::scratch_of(a.ctx, "head_norm_backward");
  ArenaScope scope(arena);
  TensorView partials =
      arena.tensor(DType::F32, {static_cast<int64_t>(cuda::head_norm_backward_scratch_bytes(N, D) / sizeof(float))},
                   "head_norm_backward partials");
  cuda::head_norm_backward(a.x.dtype, a.x.data, row, a.saved.data, a.rstd.ptr<const float>(), a.weight.data,
                           a.weight_k.data, a.dweight.ptr<float>(), a.dweight_k.ptr<float>(), N, Hx, a.q_heads, D,
                           partials.data, st);
}
#endif

}  // namespace

std::string HeadNormArgs::key() const {
  return fmt::format("{} x={} q_heads={}", head_norm_op(*this), x.describe(), q_heads);
}

BackendType head_norm(const HeadNormArgs& args) {
  head_norm_validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<HeadNormArgs>(
      "head_norm", PRIMUS_TURBO_FN(head_norm_turbo_check), PRIMUS_TURBO_FN(head_norm_turbo_run), head_norm_cpu_check,
      head_norm_cpu_run);
  return d->dispatch(args);
}

size_t head_norm_scratch_bytes(int64_t tokens, int64_t D) {
#ifdef PRIMUS_TURBO_WITH_CUDA
  return cuda::head_norm_backward_scratch_bytes(tokens, D) + Arena::kDefaultAlign;
#else
  (void)tokens;
  (void)D;
  return 0;
#endif
}

}  // namespace primus::turbo
