// Internal to turbo/ops: what every op's dispatcher setup shares.
#pragma once
#include <cstddef>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "turbo/core/arena.h"
#include "turbo/dispatch/dispatcher.h"
#include "turbo/ops/exec_context.h"

// A TURBO backend function in CUDA builds, nullptr otherwise.
#ifdef PRIMUS_TURBO_WITH_CUDA
#define PRIMUS_TURBO_FN(f) (f)
#else
#define PRIMUS_TURBO_FN(f) nullptr
#endif

namespace primus::turbo::detail {

#ifdef PRIMUS_TURBO_WITH_CUDA
inline constexpr BackendType kDeviceDefault = BackendType::TURBO;
#else
inline constexpr BackendType kDeviceDefault = BackendType::CPU;  // CPU-only build
#endif

// Device-side helpers (defined only in CUDA builds; see cuda_support.cpp).
double cuda_time_ms(void* stream, const std::function<void()>& run);  // median of event-timed runs
bool cuda_capturing(void* stream);

// Autotune on the GPU times with CUDA events on the call's stream and never while it is
// being captured into a graph.
template <class Args>
void install_cuda_hooks(OpDispatcher<Args>& d) {
#ifdef PRIMUS_TURBO_WITH_CUDA
  d.set_timer([](const Args& a, const std::function<void()>& run) { return cuda_time_ms(a.ctx.stream, run); });
  d.set_capture_probe([](const Args& a) { return cuda_capturing(a.ctx.stream); });
#else
  (void)d;
#endif
}

// An op served by Turbo's CUDA kernels on the device and the reference kernels on the host.
// turbo_check / turbo_run are null in a CPU-only build (write them with PRIMUS_TURBO_FN).
// Ops that write in place or accumulate are not autotuned (timing would run them repeatedly).
template <class Args>
OpDispatcher<Args>* make_turbo_cpu_dispatcher(const char* op,
                                              typename FunctionBackend<Args>::CheckFn turbo_check,
                                              typename FunctionBackend<Args>::RunFn turbo_run,
                                              typename FunctionBackend<Args>::CheckFn cpu_check,
                                              typename FunctionBackend<Args>::RunFn cpu_run) {
  auto* d = new OpDispatcher<Args>(op, kDeviceDefault, DispatcherOptions{false, 16});
  if (turbo_check && turbo_run)
    d->register_backend(make_backend<Args>(BackendType::TURBO, turbo_check, turbo_run));
  d->register_backend(make_backend<Args>(BackendType::CPU, cpu_check, cpu_run));
  install_cuda_hooks(*d);
  return d;
}

// "" when every defined view is on `dev`, else which one is not.
std::string all_on(Device dev, std::initializer_list<std::pair<const char*, const TensorView*>> views);
// "" when every defined view has dtype `t`.
std::string all_dtype(DType t, std::initializer_list<std::pair<const char*, const TensorView*>> views);
// Throws RuntimeError "<op>: needs a scratch arena" when ctx.scratch is null.
Arena& scratch_of(const ExecContext& ctx, const char* op);

// Token-major [B,T,Hx,D] views whose tokens may lie further apart than Hx*D elements, e.g. q, k
// or v as column slices of one packed [B*T, (H+2*KVH)*D] projection: the last two dims are
// contiguous and the batch stride is T token rows. Returns the token row stride in elements
// (Hx*D when contiguous); throws RuntimeError naming op and arg for any other layout.
int64_t token_rows(const TensorView& t, const char* op, const char* name);
// dst = src for two such views of one shape and dtype, on the host or the device (ordered on
// `stream`, asynchronous there): row by row, so either side may be packed or contiguous.
void copy_token_rows(const TensorView& dst, const TensorView& src, void* stream);

// Dense [B,T,H,D] stand-ins for token-strided views, for kernels that read (and write) densely:
// host buffers, or the scratch arena on the device (its scope ends with this object).
class DenseRows {
 public:
  DenseRows(const ExecContext& ctx, const char* op) : ctx_(ctx), op_(op) {}
  // t itself when contiguous, else a dense copy of it.
  TensorView in(const TensorView& t);
  // t itself when contiguous, else an uninitialised dense stand-in (finish() copies it back).
  TensorView out(const TensorView& t);
  // dst = dense unless they are the same memory.
  void finish(const TensorView& dst, const TensorView& dense) const;

 private:
  TensorView alloc(const TensorView& t);
  ExecContext ctx_;
  const char* op_;
  std::deque<std::vector<std::byte>> host_;  // a deque keeps earlier buffers in place
  std::optional<ArenaScope> scope_;
};
#ifdef PRIMUS_TURBO_WITH_CUDA
void cuda_copy_rows(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, int64_t row_bytes,
                    int64_t rows, void* stream);  // pitches in bytes
#endif

}  // namespace primus::turbo::detail
