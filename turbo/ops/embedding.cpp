#include "turbo/ops/embedding.h"

#include <fmt/format.h>

#include "turbo/kernels/cpu/embedding.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/embedding.h"
#endif

namespace primus::turbo {
namespace {

struct EmbeddingDims {
  int64_t B, T, C, V, max_pos;
};

// V and max_pos come from the tables (forward) or the gradient tables (backward).
EmbeddingDims validate(const EmbeddingArgs& a) {
  const char* op = a.backward ? "embedding_backward" : "embedding_forward";
  check_shape(a.tokens, {-1, -1}, op, "tokens");
  check_dtype(a.tokens, DType::I32, op, "tokens");
  EmbeddingDims d{a.tokens.shape[0], a.tokens.shape[1], 0, 0, 0};
  const TensorView& table = a.backward ? a.dwte : a.wte;
  const TensorView& ptable = a.backward ? a.dwpe : a.wpe;
  check_shape(table, {-1, -1}, op, a.backward ? "dwte" : "wte");
  d.V = table.shape[0];
  d.C = table.shape[1];
  if (ptable.defined()) {
    check_shape(ptable, {-1, d.C}, op, a.backward ? "dwpe" : "wpe");
    d.max_pos = ptable.shape[0];
  }
  if (a.positions.defined()) {
    check_shape(a.positions, {d.B, d.T}, op, "positions");
    check_dtype(a.positions, DType::I32, op, "positions");
  }
  const TensorView& act = a.backward ? a.dout : a.out;
  check_shape(act, {d.B, d.T, d.C}, op, a.backward ? "dout" : "out");
  check_contiguous(act, op, a.backward ? "dout" : "out");
  if (a.backward) {
    check_dtype(a.dwte, DType::F32, op, "dwte");
    if (a.dwpe.defined()) check_dtype(a.dwpe, DType::F32, op, "dwpe");
  } else {
    check_dtype(a.out, a.wte.dtype, op, "out");
    if (a.wpe.defined()) check_dtype(a.wpe, a.wte.dtype, op, "wpe");
  }
  return d;
}

std::string cpu_check(const EmbeddingArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"out", &a.out}, {"dout", &a.dout}, {"tokens", &a.tokens}, {"positions", &a.positions}, {"wte", &a.wte}, {"wpe", &a.wpe}, {"dwte", &a.dwte}, {"dwpe", &a.dwpe}}); !w.empty()) return w;
  return detail::all_dtype(DType::F32, {{"out", &a.out}, {"dout", &a.dout}, {"wte", &a.wte}});
}
void cpu_run(const EmbeddingArgs& a) {
  const EmbeddingDims d = validate(a);
  const int32_t* pos = a.positions.defined() ? a.positions.ptr<const int32_t>() : nullptr;
  if (!a.backward)
    cpu::embedding_forward(a.out.ptr<float>(), a.tokens.ptr<const int32_t>(), pos, a.wte.ptr<const float>(),
                           a.wpe.ptr<const float>(), d.B, d.T, d.C, d.V, d.max_pos, a.vocab_begin);
  else
    cpu::embedding_backward(a.dwte.ptr<float>(), a.dwpe.ptr<float>(), a.dout.ptr<const float>(),
                            a.tokens.ptr<const int32_t>(), pos, d.B, d.T, d.C, d.V, d.max_pos, a.vocab_begin);
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string turbo_check(const EmbeddingArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"out", &a.out}, {"dout", &a.dout}, {"tokens", &a.tokens}, {"positions", &a.positions}, {"wte", &a.wte}, {"wpe", &a.wpe}, {"dwte", &a.dwte}, {"dwpe", &a.dwpe}}); !w.empty()) return w;
  const DType dt = a.backward ? a.dout.dtype : a.wte.dtype;
  if (dt != DType::F32 && dt != DType::BF16) return "dtype must be f32 or bf16";
  const int64_t C = a.backward ? a.dwte.cols() : a.wte.cols();
  if (C % 8 != 0) return "C must be a multiple of 8";
  if (a.backward && !a.ctx.scratch) return "needs ExecContext::scratch for the sort";
  return "";
}
void turbo_run(const EmbeddingArgs& a) {
  const EmbeddingDims d = validate(a);
  const int32_t* pos = a.positions.defined() ? a.positions.ptr<const int32_t>() : nullptr;
  auto s = static_cast<cudaStream_t>(a.ctx.stream);
  if (!a.backward) {
    cuda::embedding_forward(a.wte.dtype, a.out.data, a.tokens.ptr<const int32_t>(), pos, a.wte.data, a.wpe.data,
                            d.B, d.T, d.C, d.V, d.max_pos, s, a.vocab_begin);
    return;
  }
  Arena& arena = detail::scratch_of(a.ctx, "embedding_backward");
  ArenaScope scope(arena);
  void* scratch = arena.allocate(cuda::embedding_backward_scratch_bytes(d.B * d.T), 256, "embedding_backward sort");
  cuda::embedding_backward(a.dout.dtype, a.dwte.ptr<float>(), a.dwpe.ptr<float>(), a.dout.data,
                           a.tokens.ptr<const int32_t>(), pos, d.B, d.T, d.C, d.V, d.max_pos, scratch, s,
                           a.vocab_begin);
}
#endif

}  // namespace

std::string EmbeddingArgs::key() const {
  return fmt::format("embedding_{} tokens={} table={} pos_table={} positions={}{}", backward ? "backward" : "forward",
                     tokens.describe(), (backward ? dwte : wte).describe(), (backward ? dwpe : wpe).defined() ? 1 : 0,
                     positions.defined() ? 1 : 0, vocab_begin >= 0 ? fmt::format(" vocab_begin={}", vocab_begin) : "");
}

BackendType embedding_forward(const EmbeddingArgs& args) {
  EmbeddingArgs a = args;
  a.backward = false;
  validate(a);
  static auto* d = detail::make_turbo_cpu_dispatcher<EmbeddingArgs>("embedding", PRIMUS_TURBO_FN(turbo_check),
                                                                    PRIMUS_TURBO_FN(turbo_run), cpu_check, cpu_run);
  return d->dispatch(a);
}

BackendType embedding_backward(const EmbeddingArgs& args) {
  EmbeddingArgs a = args;
  a.backward = true;
  validate(a);
  static auto* d = detail::make_turbo_cpu_dispatcher<EmbeddingArgs>("embedding", PRIMUS_TURBO_FN(turbo_check),
                                                                    PRIMUS_TURBO_FN(turbo_run), cpu_check, cpu_run);
  return d->dispatch(a);
}

}  // namespace primus::turbo
