#include "turbo/ops/decode_attention.h"

#include <fmt/format.h>

#include <cmath>

#include "turbo/kernels/cpu/decode_attention.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/decode_attention.h"
#endif

namespace primus::turbo {
namespace {

// Rows of a [n, X, D] view whose last two dims are contiguous; returns the row stride.
int64_t rows_of(const TensorView& t, const char* op, const char* arg) {
  check_shape(t, {-1, -1, -1}, op, arg);
  if (t.strides[2] != 1 || t.strides[1] != t.shape[2] || t.strides[0] < t.shape[1] * t.shape[2])
    throw RuntimeError(fmt::format("{}: {}: {} must have contiguous [X,D] rows", op, arg, t.describe()));
  return t.strides[0];
}

void validate_cache(const TensorView& kc, const TensorView& vc, const TensorView& slot, const TensorView& len,
                    int64_t n, const char* op) {
  check_shape(kc, {-1, -1, -1, -1}, op, "k_cache");
  check_contiguous(kc, op, "k_cache");
  check_contiguous(vc, op, "v_cache");
  check_shape(vc, {kc.shape[0], kc.shape[1], kc.shape[2], kc.shape[3]}, op, "v_cache");
  check_dtype(vc, kc.dtype, op, "v_cache");
  check_shape(slot, {n}, op, "slot");
  check_shape(len, {n}, op, "len");
  check_dtype(slot, DType::I32, op, "slot");
  check_dtype(len, DType::I32, op, "len");
}

cpu::DecodeAttentionParams params_of(const DecodeAttentionArgs& a) {
  cpu::DecodeAttentionParams p;
  p.n = a.q.shape[0], p.H = a.q.shape[1], p.D = a.q.shape[2], p.KVH = a.k_cache.shape[2];
  p.slots = a.k_cache.shape[0], p.cap = a.k_cache.shape[1];
  p.window = a.window;
  p.scale = a.softmax_scale ? *a.softmax_scale : 0.0;
  p.q_row = a.q.strides[0];
  return p;
}

void validate(const DecodeAttentionArgs& a) {
  const char* op = "decode_attention";
  for (auto [n, t] : {std::pair{"out", &a.out}, {"q", &a.q}, {"k_cache", &a.k_cache}, {"v_cache", &a.v_cache},
                      {"slot", &a.slot}, {"len", &a.len}})
    check_defined(*t, op, n);
  rows_of(a.q, op, "q");
  const int64_t n = a.q.shape[0], H = a.q.shape[1], D = a.q.shape[2];
  check_shape(a.out, {n, H, D}, op, "out");
  check_contiguous(a.out, op, "out");
  check_dtype(a.out, a.q.dtype, op, "out");
  validate_cache(a.k_cache, a.v_cache, a.slot, a.len, n, op);
  check_dtype(a.k_cache, a.q.dtype, op, "k_cache");
  if (a.k_cache.shape[3] != D)
    throw RuntimeError(fmt::format("{}: k_cache {} has head dim {}, q has {}", op, a.k_cache.describe(), a.k_cache.shape[3], D));
  const int64_t KVH = a.k_cache.shape[2];
  if (KVH <= 0 || H % KVH != 0)
    throw RuntimeError(fmt::format("{}: {} query heads are not a multiple of {} kv heads", op, H, KVH));
  if (a.window < 0) throw RuntimeError(fmt::format("{}: window {} is negative", op, a.window));
}

void validate(const KvCacheWriteArgs& a) {
  const char* op = "kv_cache_write";
  for (auto [n, t] : {std::pair{"k_cache", &a.k_cache}, {"v_cache", &a.v_cache}, {"k", &a.k}, {"v", &a.v},
                      {"slot", &a.slot}, {"len", &a.len}})
    check_defined(*t, op, n);
  const int64_t rk = rows_of(a.k, op, "k"), rv = rows_of(a.v, op, "v");
  if (rk != rv) throw RuntimeError(fmt::format("{}: k and v rows are {} and {} elements apart", op, rk, rv));
  const int64_t n = a.k.shape[0];
  check_shape(a.v, {n, a.k.shape[1], a.k.shape[2]}, op, "v");
  validate_cache(a.k_cache, a.v_cache, a.slot, a.len, n, op);
  check_shape(a.k_cache, {-1, -1, a.k.shape[1], a.k.shape[2]}, op, "k_cache");
  for (auto [nm, t] : {std::pair{"v", &a.v}, {"k_cache", &a.k_cache}}) check_dtype(*t, a.k.dtype, op, nm);
}

std::string cpu_check(const DecodeAttentionArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"out", &a.out}, {"q", &a.q}, {"k_cache", &a.k_cache}, {"v_cache", &a.v_cache},
                                            {"slot", &a.slot}, {"len", &a.len}});
      !w.empty())
    return w;
  return detail::all_dtype(DType::F32, {{"q", &a.q}});
}
void cpu_run(const DecodeAttentionArgs& a) {
  cpu::decode_attention_forward(a.out.ptr<float>(), a.q.ptr<const float>(), a.k_cache.ptr<const float>(),
                                a.v_cache.ptr<const float>(), a.slot.ptr<const int32_t>(), a.len.ptr<const int32_t>(),
                                params_of(a));
}
std::string cpu_check_w(const KvCacheWriteArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"k_cache", &a.k_cache}, {"v_cache", &a.v_cache}, {"k", &a.k}, {"v", &a.v},
                                            {"slot", &a.slot}, {"len", &a.len}});
      !w.empty())
    return w;
  return detail::all_dtype(DType::F32, {{"k", &a.k}});
}
void cpu_run_w(const KvCacheWriteArgs& a) {
  cpu::DecodeAttentionParams p;
  p.n = a.k.shape[0], p.KVH = a.k.shape[1], p.D = a.k.shape[2], p.slots = a.k_cache.shape[0], p.cap = a.k_cache.shape[1];
  cpu::kv_cache_write(a.k_cache.ptr<float>(), a.v_cache.ptr<float>(), a.k.ptr<const float>(), a.v.ptr<const float>(),
                      a.k.strides[0], a.slot.ptr<const int32_t>(), a.len.ptr<const int32_t>(), p);
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string turbo_check(const DecodeAttentionArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"out", &a.out}, {"q", &a.q}, {"k_cache", &a.k_cache}, {"v_cache", &a.v_cache},
                                             {"slot", &a.slot}, {"len", &a.len}});
      !w.empty())
    return w;
  if (a.q.dtype != DType::F32 && a.q.dtype != DType::BF16) return "dtype must be f32 or bf16";
  if (a.q.shape[2] > cuda::kDecodeAttentionMaxDim) return fmt::format("head dim above {}", cuda::kDecodeAttentionMaxDim);
  if (a.workspace.defined() && a.workspace.device != Device::CUDA) return "workspace must be on CUDA";
  return "";
}
void turbo_run(const DecodeAttentionArgs& a) {
  const cpu::DecodeAttentionParams p = params_of(a);
  const float scale = a.softmax_scale ? *a.softmax_scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.D)));
  cuda::decode_attention_forward(a.q.dtype, a.out.data, a.q.data, a.k_cache.data, a.v_cache.data,
                                 a.slot.ptr<const int32_t>(), a.len.ptr<const int32_t>(), p.n, p.H, p.KVH, p.D, p.cap,
                                 p.window, scale, p.q_row, a.workspace.defined() ? a.workspace.data : nullptr,
                                 a.workspace.defined() ? static_cast<int64_t>(a.workspace.nbytes()) : 0,
                                 static_cast<cudaStream_t>(a.ctx.stream));
}
std::string turbo_check_w(const KvCacheWriteArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"k_cache", &a.k_cache}, {"v_cache", &a.v_cache}, {"k", &a.k}, {"v", &a.v},
                                             {"slot", &a.slot}, {"len", &a.len}});
      !w.empty())
    return w;
  if (a.k.dtype != DType::F32 && a.k.dtype != DType::BF16) return "dtype must be f32 or bf16";
  return "";
}
void turbo_run_w(const KvCacheWriteArgs& a) {
  cuda::kv_cache_write(a.k.dtype, a.k_cache.data, a.v_cache.data, a.k.data, a.v.data, a.k.strides[0],
                       a.slot.ptr<const int32_t>(), a.len.ptr<const int32_t>(), a.k.shape[0], a.k.shape[1], a.k.shape[2],
                       a.k_cache.shape[1], static_cast<cudaStream_t>(a.ctx.stream));
}
#endif

}  // namespace

std::string DecodeAttentionArgs::key() const {
  return fmt::format("decode_attention q={} cache={} window={}", q.describe(), k_cache.describe(), window);
}
std::string KvCacheWriteArgs::key() const {
  return fmt::format("kv_cache_write k={} cache={}", k.describe(), k_cache.describe());
}

int64_t decode_attention_workspace_bytes(int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t cap) {
#ifdef PRIMUS_TURBO_WITH_CUDA
  return cuda::decode_attention_workspace_bytes(n, H, KVH, D, cap);
#else
  (void)n, (void)H, (void)KVH, (void)D, (void)cap;
  return 0;
#endif
}

BackendType decode_attention(const DecodeAttentionArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<DecodeAttentionArgs>(
      "decode_attention", PRIMUS_TURBO_FN(turbo_check), PRIMUS_TURBO_FN(turbo_run), cpu_check, cpu_run);
  return d->dispatch(args);
}

BackendType kv_cache_write(const KvCacheWriteArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<KvCacheWriteArgs>(
      "kv_cache_write", PRIMUS_TURBO_FN(turbo_check_w), PRIMUS_TURBO_FN(turbo_run_w), cpu_check_w, cpu_run_w);
  return d->dispatch(args);
}

}  // namespace primus::turbo
