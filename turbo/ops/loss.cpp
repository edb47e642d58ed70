#include "turbo/ops/loss.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "turbo/kernels/cpu/loss.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/cross_entropy.h"
#include "turbo/kernels/cuda/vocab_parallel_ce.h"
#endif

namespace primus::turbo {
namespace {

int64_t vocab_of(const CrossEntropyArgs& a) { return a.vocab > 0 ? a.vocab : a.logits.cols(); }

void validate(const CrossEntropyArgs& a) {
  const char* op = "cross_entropy";
  check_shape(a.logits, {-1, -1}, op, "logits");
  check_contiguous(a.logits, op, "logits");
  const int64_t N = a.logits.shape[0];
  check_shape(a.targets, {N}, op, "targets");
  check_dtype(a.targets, DType::I32, op, "targets");
  if (vocab_of(a) > a.logits.shape[1])
    throw RuntimeError(fmt::format("{}: vocab {} exceeds the logits row {}", op, vocab_of(a), a.logits.describe()));
  if (a.dlogits.defined()) {
    check_shape(a.dlogits, {N, a.logits.shape[1]}, op, "dlogits");
    check_dtype(a.dlogits, a.logits.dtype, op, "dlogits");
  }
  for (auto [n, t] : {std::pair{"losses", &a.losses}, {"lse", &a.lse}}) {
    if (!t->defined()) continue;
    check_shape(*t, {N}, op, n);
    check_dtype(*t, DType::F32, op, n);
  }
  if (a.kept.defined()) {
    check_shape(a.kept, {1}, op, "kept");
    check_dtype(a.kept, DType::F32, op, "kept");
    check_same_device(a.kept, a.logits, op);
  }
}

// dloss / max(kept, 1) on the host (kept a host tensor), else dloss.
float host_dloss(float dloss, const TensorView& kept) {
  return kept.defined() ? dloss / std::max(kept.ptr<const float>()[0], 1.0f) : dloss;
}

std::string cpu_check(const CrossEntropyArgs& a) {
  if (auto w = detail::all_on(Device::CPU, {{"logits", &a.logits}, {"dlogits", &a.dlogits}, {"targets", &a.targets}, {"losses", &a.losses}, {"lse", &a.lse}}); !w.empty()) return w;
  if (auto w = detail::all_dtype(DType::F32, {{"logits", &a.logits}}); !w.empty()) return w;
  return "";
}
void cpu_run(const CrossEntropyArgs& a) {
  const int64_t N = a.logits.rows(), V = vocab_of(a);
  std::vector<float> lse_tmp;
  float* lse = a.lse.ptr<float>();
  if (!lse) {
    lse_tmp.resize(static_cast<size_t>(N));
    lse = lse_tmp.data();
  }
  // Forward first: it only reads the logits, which the backward may then overwrite in place.
  cpu::cross_entropy_forward(a.losses.ptr<float>(), lse, a.logits.ptr<const float>(), a.targets.ptr<const int32_t>(),
                             N, V, a.ignore_index, a.logits.cols());
  if (a.dlogits.defined())
    cpu::cross_entropy_backward(a.dlogits.ptr<float>(), a.logits.ptr<const float>(), lse,
                                a.targets.ptr<const int32_t>(), N, V, host_dloss(a.dloss, a.kept), a.ignore_index,
                                a.logits.cols());
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string turbo_check(const CrossEntropyArgs& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"logits", &a.logits}, {"dlogits", &a.dlogits}, {"targets", &a.targets}, {"losses", &a.losses}, {"lse", &a.lse}}); !w.empty()) return w;
  if (a.logits.dtype != DType::F32 && a.logits.dtype != DType::BF16) return "dtype must be f32 or bf16";
  if (a.logits.cols() % (16 / static_cast<int64_t>(dtype_size(a.logits.dtype))) != 0)
    return "the logits row must be a multiple of 128 bits (pad the vocabulary)";
  return "";
}
void turbo_run(const CrossEntropyArgs& a) {
  cuda::cross_entropy_forward_backward(a.logits.dtype, a.dlogits.data, a.losses.ptr<float>(), a.lse.ptr<float>(),
                                       a.logits.data, a.targets.ptr<const int32_t>(), a.logits.rows(), vocab_of(a),
                                       a.logits.cols(), a.dloss, a.kept.defined() ? a.kept.ptr<const float>() : nullptr,
                                       a.ignore_index,
                                       static_cast<cudaStream_t>(a.ctx.stream),
                                       a.legacy_kernel         ? cuda::CrossEntropyKernel::Legacy
                                       : a.one_row_per_cluster ? cuda::CrossEntropyKernel::OneRowPerCluster
                                                               : cuda::CrossEntropyKernel::Auto);
}
#endif

}  // namespace

int cross_entropy_turbo_cluster(DType dtype, int64_t Vp) {
#ifdef PRIMUS_TURBO_WITH_CUDA
  return cuda::cross_entropy_onchip_cluster(dtype, Vp);
#else
  (void)dtype;
  (void)Vp;
  return 0;
#endif
}

std::string CrossEntropyArgs::key() const {
  return fmt::format("cross_entropy logits={} V={} grad={} inplace={}{}{}", logits.describe(), vocab_of(*this),
                     dlogits.defined() ? 1 : 0, dlogits.data == logits.data ? 1 : 0, legacy_kernel ? " legacy" : "",
                     one_row_per_cluster ? " one_row_per_cluster" : "");
}

BackendType cross_entropy(const CrossEntropyArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<CrossEntropyArgs>("cross_entropy", PRIMUS_TURBO_FN(turbo_check),
                                                                       PRIMUS_TURBO_FN(turbo_run), cpu_check, cpu_run);
  return d->dispatch(args);
}

void sum_f32(const TensorView& out, const TensorView& x, const ExecContext& ctx, const TensorView& kept,
             float numerator) {
  check_dtype(out, DType::F32, "sum_f32", "out");
  check_dtype(x, DType::F32, "sum_f32", "x");
  check_same_device(out, x, "sum_f32");
  if (kept.defined()) {
    check_shape(kept, {1}, "sum_f32", "kept");
    check_dtype(kept, DType::F32, "sum_f32", "kept");
    check_same_device(kept, x, "sum_f32");
  }
  if (x.device == Device::CPU) {
    double s = 0.0;
    for (int64_t i = 0; i < x.numel(); ++i) s += x.ptr<const float>()[i];
    out.ptr<float>()[0] = static_cast<float>(kept.defined() ? s * host_dloss(numerator, kept) : s);
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  cuda::sum_f32(out.ptr<float>(), x.ptr<const float>(), x.numel(), kept.defined() ? kept.ptr<const float>() : nullptr,
                numerator, static_cast<cudaStream_t>(ctx.stream));
#else
  (void)ctx;
  throw RuntimeError("sum_f32: this build has no CUDA");
#endif
}

void count_kept(const TensorView& out, const TensorView& targets, int32_t ignore_index, const ExecContext& ctx) {
  check_shape(out, {1}, "count_kept", "out");
  check_dtype(out, DType::F32, "count_kept", "out");
  check_dtype(targets, DType::I32, "count_kept", "targets");
  check_same_device(out, targets, "count_kept");
  if (targets.device == Device::CPU) {
    int64_t c = 0;
    for (int64_t i = 0; i < targets.numel(); ++i) c += targets.ptr<const int32_t>()[i] != ignore_index;
    out.ptr<float>()[0] = static_cast<float>(c);
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  cuda::count_kept(out.ptr<float>(), targets.ptr<const int32_t>(), targets.numel(), ignore_index,
                   static_cast<cudaStream_t>(ctx.stream));
#else
  (void)ctx;
  throw RuntimeError("count_kept: this build has no CUDA");
#endif
}

namespace {
int64_t vp_rows(const VocabParallelCrossEntropyArgs& a, const char* op) {
  check_shape(a.logits, {-1, -1}, op, "logits");
  check_contiguous(a.logits, op, "logits");
  const int64_t N = a.logits.shape[0];
  check_shape(a.targets, {N}, op, "targets");
  check_dtype(a.targets, DType::I32, op, "targets");
  if (a.vocab < 0 || a.vocab > a.logits.shape[1])
    throw RuntimeError(fmt::format("{}: vocab {} outside the logits row {}", op, a.vocab, a.logits.describe()));
  return N;
}
}  // namespace

void vocab_parallel_ce_stats(const VocabParallelCrossEntropyArgs& a) {
  const char* op = "vocab_parallel_ce_stats";
  const int64_t N = vp_rows(a, op), ld = a.logits.shape[1], V = a.vocab, v0 = a.vocab_begin;
  check_shape(a.stats, {N, 3}, op, "stats");
  check_dtype(a.stats, DType::F32, op, "stats");
  check_same_device(a.stats, a.logits, op);
  if (a.logits.device == Device::CPU) {
    check_dtype(a.logits, DType::F32, op, "logits");
    const float* L = a.logits.ptr<const float>();
    const int32_t* tg = a.targets.ptr<const int32_t>();
    float* st = a.stats.ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
      const float* row = L + n * ld;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < V; ++j) m = std::max(m, row[j]);
      double s = 0;  // a NaN logit reaches the sum (std::max above may drop it)
      for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<double>(row[j]) - m);
      const int64_t t = static_cast<int64_t>(tg[n]) - v0;
      st[3 * n] = m;
      st[3 * n + 1] = static_cast<float>(s);
      st[3 * n + 2] = t >= 0 && t < V ? row[t] : 0.0f;
    }
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  cuda::vocab_parallel_ce_stats(a.logits.dtype, a.logits.data, N, ld, V, v0, a.targets.ptr<const int32_t>(),
                                a.stats.ptr<float>(), static_cast<cudaStream_t>(a.ctx.stream));
#else
  throw RuntimeError(fmt::format("{}: this build has no CUDA", op));
#endif
}

void vocab_parallel_ce_finish(const VocabParallelCrossEntropyArgs& a) {
  const char* op = "vocab_parallel_ce_finish";
  const int64_t N = vp_rows(a, op), ld = a.logits.shape[1], V = a.vocab, v0 = a.vocab_begin;
  check_shape(a.all_stats, {-1, N, 3}, op, "all_stats");
  check_dtype(a.all_stats, DType::F32, op, "all_stats");
  check_shape(a.losses, {N}, op, "losses");
  check_dtype(a.losses, DType::F32, op, "losses");
  check_same_device(a.all_stats, a.logits, op);
  check_same_device(a.losses, a.logits, op);
  if (a.kept.defined()) {
    check_shape(a.kept, {1}, op, "kept");
    check_dtype(a.kept, DType::F32, op, "kept");
    check_same_device(a.kept, a.logits, op);
  }
  const int tp = static_cast<int>(a.all_stats.shape[0]);
  if (a.logits.device == Device::CPU) {
    check_dtype(a.logits, DType::F32, op, "logits");
    float* L = a.logits.ptr<float>();
    const int32_t* tg = a.targets.ptr<const int32_t>();
    const float* all = a.all_stats.ptr<const float>();
    float* losses = a.losses.ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
      const int32_t target = tg[n];
      const bool ignored = target == a.ignore_index;
      if (!ignored && (target < 0 || target >= a.global_vocab)) {
        throw RuntimeError(fmt::format("{}: target {} at row {} is outside the vocabulary [0, {})", op, target, n,
                                       a.global_vocab));
      }
      float M = -std::numeric_limits<float>::infinity(), z = 0.0f;
      for (int r = 0; r < tp; ++r) {
        M = std::max(M, all[(r * N + n) * 3]);
        z += all[(r * N + n) * 3 + 2];
      }
      double S = 0;
      for (int r = 0; r < tp; ++r) S += all[(r * N + n) * 3 + 1] * std::exp(static_cast<double>(all[(r * N + n) * 3]) - M);
      const double lse = M + std::log(S);
      losses[n] = ignored ? 0.0f : static_cast<float>(lse - z);
      if (a.dloss == 0.0f) continue;
      const double dloss = host_dloss(a.dloss, a.kept);
      float* row = L + n * ld;
      const int64_t t = ignored ? -1 : static_cast<int64_t>(target) - v0;
      for (int64_t j = 0; j < ld; ++j) {
        double g = 0;
        if (!ignored && j < V) g = std::exp(static_cast<double>(row[j]) - lse) * dloss - (j == t ? dloss : 0.0);
        row[j] = static_cast<float>(g);
      }
    }
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  cuda::vocab_parallel_ce_finish(a.logits.dtype, a.logits.data, N, ld, V, v0, a.global_vocab,
                                 a.targets.ptr<const int32_t>(), a.all_stats.ptr<const float>(), tp,
                                 a.losses.ptr<float>(), a.dloss, a.kept.defined() ? a.kept.ptr<const float>() : nullptr,
                                 a.ignore_index,
                                 static_cast<cudaStream_t>(a.ctx.stream));
#else
  throw RuntimeError(fmt::format("{}: this build has no CUDA", op));
#endif
}

}  // namespace primus::turbo
