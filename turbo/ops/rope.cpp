#include "turbo/ops/rope.h"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "turbo/kernels/cpu/rope.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/rope.h"
#endif

namespace primus::turbo {
namespace {

void validate(const RopeArgs& a) {
  const char* op = a.backward ? "rope_backward" : "rope_forward";
  check_defined(a.inp, op, "inp");
  check_defined(a.out, op, "out");
  check_shape(a.inp, {-1, -1, -1, -1}, op, "inp");
  detail::token_rows(a.inp, op, "inp");  // token rows may be strided (q|k slices of a packed qkv)
  detail::token_rows(a.out, op, "out");
  check_shape(a.out, {a.inp.shape[0], a.inp.shape[1], a.inp.shape[2], a.inp.shape[3]}, op, "out");
  check_dtype(a.out, a.inp.dtype, op, "out");
  if (a.inp.shape[3] % 2 != 0) throw RuntimeError(fmt::format("{}: head dim of {} is odd", op, a.inp.describe()));
  if (a.positions.defined()) {
    check_shape(a.positions, {a.inp.shape[0], a.inp.shape[1]}, op, "positions");
    check_dtype(a.positions, DType::I32, op, "positions");
  }
  if (a.backward && a.accumulate && a.out.data == a.inp.data)
    throw RuntimeError("rope_backward: dinp may not alias dout when accumulating");
}

std::string cpu_check(const RopeArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"inp", &a.inp}, {"out", &a.out}, {"positions", &a.positions}}); !w.empty()) return w;
  if (auto w = detail::all_dtype(DType::F32, {{"inp", &a.inp}}); !w.empty()) return w;
  if (a.backward && a.out.data == a.inp.data) return "the reference backward cannot run in place";
  return "";
}
void cpu_run(const RopeArgs& a) {
  const auto& s = a.inp.shape;
  const int32_t* pos = a.positions.defined() ? a.positions.ptr<const int32_t>() : nullptr;
  // The reference kernels read and write contiguous [B,T,H,D]: strided views go through copies
  // (the output's too when the backward accumulates onto it).
  detail::DenseRows dense(a.ctx, a.backward ? "rope_backward" : "rope_forward");
  const TensorView inp = dense.in(a.inp), out = a.backward && a.accumulate ? dense.in(a.out) : dense.out(a.out);
  if (!a.backward) {
    cpu::rope_forward(out.ptr<float>(), inp.ptr<const float>(), pos, s[0], s[1], s[2], s[3], a.base, a.scaling);
  } else {
    if (!a.accumulate) std::memset(out.data, 0, out.nbytes());
    cpu::rope_backward(out.ptr<float>(), inp.ptr<const float>(), pos, s[0], s[1], s[2], s[3], a.base, a.scaling);
  }
  dense.finish(a.out, out);
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string turbo_check(const RopeArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"inp", &a.inp}, {"out", &a.out}, {"positions", &a.positions}, {"table", &a.table}}); !w.empty()) return w;
  if (a.inp.dtype != DType::F32 && a.inp.dtype != DType::BF16) return "dtype must be f32 or bf16";
  if (a.inp.shape[3] % 8 != 0) return "head dim must be a multiple of 8";
  for (const TensorView* t : {&a.inp, &a.out}) {
    if (t->strides[1] % 8 != 0 || reinterpret_cast<uintptr_t>(t->data) % 16 != 0)
      return fmt::format("token rows of {} must be 16-byte aligned (row stride a multiple of 8)", t->describe());
  }
  if (!a.table.defined() || a.table.dtype != DType::F32 || a.table.ndim != 3 ||
      a.table.shape[1] != a.inp.shape[3] / 2 || a.table.shape[2] != 2)
    return fmt::format("needs a cos/sin table f32 [max_pos, {}, 2] (rope_build_table)", a.inp.shape[3] / 2);
  return "";
}
void turbo_run(const RopeArgs& a) {
  const auto& s = a.inp.shape;
  const int32_t* pos = a.positions.defined() ? a.positions.ptr<const int32_t>() : nullptr;
  auto st = static_cast<cudaStream_t>(a.ctx.stream);
  if (!a.backward)
    cuda::rope_forward(a.inp.dtype, a.out.data, a.inp.data, pos, a.table.data, s[0], s[1], s[2], s[3], a.table.shape[0], st,
                       a.inp.strides[1], a.out.strides[1]);
  else
    cuda::rope_backward(a.inp.dtype, a.out.data, a.inp.data, pos, a.table.data, s[0], s[1], s[2], s[3],
                        a.table.shape[0], a.accumulate, st, a.inp.strides[1], a.out.strides[1]);
}
#endif

}  // namespace

std::string RopeArgs::key() const {
  return fmt::format("rope_{} inp={} positions={} acc={}", backward ? "backward" : "forward", inp.describe(),
                     positions.defined() ? 1 : 0, accumulate ? 1 : 0);
}

BackendType rope(const RopeArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<RopeArgs>("rope", PRIMUS_TURBO_FN(turbo_check),
                                                               PRIMUS_TURBO_FN(turbo_run), cpu_check, cpu_run);
  return d->dispatch(args);
}

void rope_build_table(const TensorView& table, double base, const ExecContext& ctx, const RopeScaling& scaling) {
  check_device(table, Device::CUDA, "rope_build_table", "table");
  check_dtype(table, DType::F32, "rope_build_table", "table");
  check_shape(table, {-1, -1, 2}, "rope_build_table", "table");
#ifdef PRIMUS_TURBO_WITH_CUDA
  const int64_t D = table.shape[1] * 2;
  std::vector<double> inv_freq(static_cast<size_t>(D / 2));
  cpu::rope_inv_freq(inv_freq.data(), D, base, scaling);
  cuda::rope_build_table(table.data, table.shape[0], D, inv_freq.data(), static_cast<cudaStream_t>(ctx.stream));
#else
  (void)base;
  (void)ctx;
  (void)scaling;
  throw RuntimeError("rope_build_table: this build has no CUDA");
#endif
}

}  // namespace primus::turbo
