#include "backends/cuda/model/cp_attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backends/cuda/model/cp_kernels.h"
#include "backends/cuda/model/group_order.h"
#include "core/util/error.h"
#include "parallel/cuda/nccl_process_group.h"
#include "turbo/core/cuda_check.h"
#include "turbo/ops/cast.h"

namespace primus::backends::cuda {
namespace {

cudaStream_t stream_of(const ExecContext& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

// Host twins of cp_kernels.h (fp32 activations).
void host_merge(float* acc_out, float* acc_lse, const float* out, const float* lse, int64_t B, int64_t T, int64_t H,
                int64_t D, bool first) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = (b * T + t) * H + h, li = (b * H + h) * T + t;
        float* a = acc_out + row * D;
        const float* o = out + row * D;
        if (first) {
          std::copy_n(o, D, a);
          acc_lse[li] = lse[li];
          continue;
        }
        const float l_old = acc_lse[li], l_new = lse[li], m = std::max(l_old, l_new);
        const float w_old = std::exp(l_old - m), w_new = std::exp(l_new - m), sum = w_old + w_new;
        for (int64_t d = 0; d < D; ++d) a[d] = a[d] * (w_old / sum) + o[d] * (w_new / sum);
        acc_lse[li] = m + std::log(sum);
      }
}

}  // namespace

CpAttention::CpAttention(parallel::ProcessGroup& group, const ActivationBuffers& acts, const CudaOps& ops,
                         const ModelStream& stream, int64_t heads, int64_t kv_heads, int64_t head_dim)
    : group_(group), a_(acts), ops_(ops), stream_(stream), rank_(group.rank()), size_(group.world_size()), H_(heads),
      KV_(kv_heads), D_(head_dim) {
  nccl_ = device_group(group_, stream_, "context parallelism");
}

template <class F>
void CpAttention::ordered(F&& call) const {
  in_stream_order(nccl_, stream_, call);
}

TensorView CpAttention::positions(int64_t B2, int64_t Tc) {
  const TensorView buf = a_.cp_positions.slice0(0, B2 * Tc);
  if (B2 != pos_B2_ || Tc != pos_Tc_) {
    if (B2 % 2 != 0) throw RuntimeError(fmt::format("context parallelism: a micro-batch of {} rows (two chunks each)", B2));
    std::vector<int32_t> pos(size_t(B2 * Tc));
    for (int64_t r = 0; r < B2; ++r) {
      const int64_t first = chunk(r < B2 / 2 ? 0 : 1) * Tc;
      for (int64_t t = 0; t < Tc; ++t) pos[size_t(r * Tc + t)] = static_cast<int32_t>(first + t);
    }
    stream_.to_model(buf.data, pos.data(), pos.size() * sizeof(int32_t));
    if (!stream_.host) stream_.sync();  // the host vector goes out of scope
    pos_B2_ = B2;
    pos_Tc_ = Tc;
  }
  return TensorView(buf.data, buf.dtype, buf.device, {B2, Tc});
}

TensorView CpAttention::heads4(const TensorView& rows, int64_t B, int64_t Tc, int64_t col, int64_t n) const {
  const int64_t W = rows.size(1);
  TensorView v(static_cast<char*>(rows.data) + size_t(col) * turbo::dtype_size(rows.dtype), rows.dtype, rows.device,
               {B, Tc, n, D_});
  v.strides = {Tc * W, W, D_, 1};
  return v;
}

int64_t CpAttention::slot_chunk(int64_t owner, int slot) const { return slot == 0 ? owner : 2 * size_ - 1 - owner; }

void CpAttention::exchange(const TensorView& send, const TensorView& recv) const {
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const parallel::DType dt = comm_dtype(send, "context parallelism: a ring step");
  issue_in_order(nccl_, stream_,
                 [&] { group_.send_recv(send.data, next, recv.data, prev, size_t(send.numel()), dt); });
}

void CpAttention::own_kv(const TensorView& qkv, const TensorView& dst, const ExecContext& ctx) const {
  const int64_t KVD = KV_ * D_, QD = H_ * D_, N = dst.size(0);
  TensorView src(static_cast<char*>(qkv.data) + size_t(QD) * turbo::dtype_size(qkv.dtype), qkv.dtype, qkv.device,
                 {N, 2 * KVD});
  src.strides = {qkv.stride(0), 1};
  turbo::copy_rows(dst, src, ctx);
}

void CpAttention::forward(const TensorView& att, const TensorView& lse, const TensorView& qkv, int64_t B2, int64_t Tc,
                          float scale, const ExecContext& ctx) {
  const int64_t B = B2 / 2, N = B2 * Tc, n = B * Tc, QD = H_ * D_, KVD = KV_ * D_;
  const TensorView kv[2] = {a_.cp_kv_all.slice0(0, N), a_.cp_kv_all.slice0(N, 2 * N)};
  own_kv(qkv, kv[0], ctx);
  const TensorView acc = a_.cp_out.slice0(0, N), acc_lse = a_.cp_lse.slice0(0, N * H_);
  const TensorView part = a_.cp_tmp_out.slice0(0, n), part_lse = a_.cp_tmp_lse.slice0(0, n * H_);
  bool started[2] = {false, false};
  // Step s holds the k|v of rank r - s; it is passed on while this step's products run.
  for (int s = 0; s < size_; ++s) {
    const TensorView& cur = kv[s % 2];
    if (s > 0) await_group(nccl_, stream_);  // cur has arrived
    if (s + 1 < size_) exchange(cur, kv[(s + 1) % 2]);
    const int64_t owner = (rank_ - s + size_) % size_;
    for (int a = 0; a < 2; ++a) {
      const int64_t c = chunk(a);
      const TensorView q = heads4(qkv.slice0(a * n, (a + 1) * n), B, Tc, 0, H_);
      for (int b = 0; b < 2; ++b) {
        const int64_t j = slot_chunk(owner, b);
        if (j > c) continue;  // later keys: masked for every query of chunk c
        const TensorView keys = cur.slice0(b * n, (b + 1) * n);
        AttentionCall at;
        at.out = TensorView(part.data, part.dtype, part.device, {B, Tc, H_, D_});
        at.lse = TensorView(part_lse.data, part_lse.dtype, part_lse.device, {B, H_, Tc});
        at.q = q;
        at.k = heads4(keys, B, Tc, 0, KV_);
        at.v = heads4(keys, B, Tc, KVD, KV_);
        at.scale = scale;
        at.causal = j == c;
        at.ctx = ctx;
        ops_.attention_forward(at);
        float* out_a = acc.ptr<float>() + a * n * QD;
        float* lse_a = acc_lse.ptr<float>() + a * n * H_;
        if (stream_.host) {
          host_merge(out_a, lse_a, part.ptr<const float>(), part_lse.ptr<const float>(), B, Tc, H_, D_, !started[a]);
        } else {
          cp::merge_partial(out_a, lse_a, part.data, part_lse.ptr<const float>(), B, Tc, H_, D_, !started[a],
                            stream_of(ctx));
        }
        started[a] = true;
      }
    }
  }
  // The merged output and log-sum-exp (lse [B2, H, Tc]: slot a is rows a*B..), both slots at once.
  if (stream_.host) {
    for (int64_t r = 0; r < N; ++r)
      std::copy_n(acc.ptr<const float>() + r * QD, QD, att.ptr<float>() + r * att.stride(0));
    std::copy_n(acc_lse.ptr<const float>(), N * H_, lse.ptr<float>());
  } else {
    cp::rows_cast(att.data, att.stride(0), acc.ptr<const float>(), QD, N, QD, stream_of(ctx));
    CUDA_CHECK(cudaMemcpyAsync(lse.data, acc_lse.data, size_t(N * H_) * sizeof(float), cudaMemcpyDeviceToDevice,
                               stream_of(ctx)));
  }
}

void CpAttention::backward(const TensorView& dq, const TensorView& dk, const TensorView& dv, const TensorView& datt,
                           const TensorView& qkv, const TensorView& att, const TensorView& lse, int64_t B2, int64_t Tc,
                           float scale, const ExecContext& ctx) {
  const int64_t B = B2 / 2, N = B2 * Tc, n = B * Tc, QD = H_ * D_, KVD = KV_ * D_;
  const TensorView kv[2] = {a_.cp_kv_all.slice0(0, N), a_.cp_kv_all.slice0(N, 2 * N)};
  const TensorView dkv[2] = {a_.cp_dkv.slice0(0, N), a_.cp_dkv.slice0(N, 2 * N)};
  own_kv(qkv, kv[0], ctx);
  const TensorView dq_acc = a_.cp_dq.slice0(0, N);
  stream_.zero(dq_acc);
  stream_.zero(dkv[0]);
  const TensorView dq_part = a_.cp_dq_tmp.slice0(0, n), dkv_part = a_.cp_dkv_tmp.slice0(0, n);
  auto accumulate = [&](const TensorView& dst, const TensorView& src, int64_t cols) {
    if (stream_.host) {
      for (int64_t r = 0; r < dst.size(0); ++r)
        for (int64_t k = 0; k < cols; ++k)
          dst.ptr<float>()[r * dst.stride(0) + k] += src.ptr<const float>()[r * src.stride(0) + k];
    } else {
      cp::rows_accumulate(dst.ptr<float>(), dst.stride(0), src.data, src.stride(0), dst.size(0), cols, stream_of(ctx));
    }
  };
  // Step s holds rank (r - s)'s k|v and the gradient of its chunks gathered so far; after this
  // step's products the gradient moves on with them, and after the last step it reaches its owner.
  for (int s = 0; s < size_; ++s) {
    const TensorView& cur = kv[s % 2];
    const TensorView& dcur = dkv[s % 2];
    if (s > 0) await_group(nccl_, stream_);  // cur and dcur have arrived
    if (s + 1 < size_) exchange(cur, kv[(s + 1) % 2]);
    const int64_t owner = (rank_ - s + size_) % size_;
    for (int a = 0; a < 2; ++a) {
      const int64_t c = chunk(a);
      const TensorView rows = qkv.slice0(a * n, (a + 1) * n);
      const TensorView out_rows = att.slice0(a * n, (a + 1) * n), dout_rows = datt.slice0(a * n, (a + 1) * n);
      const TensorView lse_rows = lse.slice0(a * n * H_, (a + 1) * n * H_);
      for (int b = 0; b < 2; ++b) {
        const int64_t j = slot_chunk(owner, b);
        if (j > c) continue;
        const TensorView keys = cur.slice0(b * n, (b + 1) * n);
        AttentionGradCall g;
        g.dq = TensorView(dq_part.data, dq_part.dtype, dq_part.device, {B, Tc, H_, D_});
        g.dk = heads4(dkv_part, B, Tc, 0, KV_);
        g.dv = heads4(dkv_part, B, Tc, KVD, KV_);
        g.dout = heads4(dout_rows, B, Tc, 0, H_);
        g.q = heads4(rows, B, Tc, 0, H_);
        g.k = heads4(keys, B, Tc, 0, KV_);
        g.v = heads4(keys, B, Tc, KVD, KV_);
        g.out = heads4(out_rows, B, Tc, 0, H_);
        g.lse = TensorView(lse_rows.data, lse_rows.dtype, lse_rows.device, {B, H_, Tc});
        g.scale = scale;
        g.causal = j == c;
        g.ctx = ctx;
        ops_.attention_backward(g);
        accumulate(dq_acc.slice0(a * n, (a + 1) * n), dq_part, QD);
        accumulate(dcur.slice0(b * n, (b + 1) * n), dkv_part, 2 * KVD);
      }
    }
    // The gradient of the chunks held goes where they go next (the last step: home).
    exchange(dcur, dkv[(s + 1) % 2]);
  }
  await_group(nccl_, stream_);
  const TensorView mine = dkv[size_ % 2];
  auto cast = [&](const TensorView& dst, const float* src, int64_t ld, int64_t cols) {
    if (stream_.host) {
      for (int64_t r = 0; r < N; ++r) std::copy_n(src + r * ld, cols, dst.ptr<float>() + r * dst.stride(0));
    } else {
      cp::rows_cast(dst.data, dst.stride(0), src, ld, N, cols, stream_of(ctx));
    }
  };
  cast(dq, dq_acc.ptr<const float>(), QD, QD);
  cast(dk, mine.ptr<const float>(), 2 * KVD, KVD);
  cast(dv, mine.ptr<const float>() + KVD, 2 * KVD, KVD);
}

void CpAttention::all_reduce_mean(const TensorView& t) const {
  const parallel::DType dt = comm_dtype(t, "context parallelism: a gradient's mean");
  ordered([&] { group_.all_reduce(t.data, size_t(t.numel()), dt, parallel::ReduceOp::Avg); });
}

void CpAttention::all_reduce_sum(const TensorView& t) const {
  ordered([&] { group_.all_reduce(t.data, size_t(t.numel()), parallel::DType::F32, parallel::ReduceOp::Sum); });
}

}  // namespace primus::backends::cuda
