#include "parallel/cuda/grad_reducer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/util/error.h"
#include "parallel/launch_env.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cuda/cast.h"
#include "turbo/kernels/cuda/dp_norm.h"
#include "turbo/kernels/cuda/optimizer.h"

namespace primus::parallel {

namespace kernels = turbo::cuda;

namespace {
int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }
}  // namespace

int rank_device(int configured) {
  const parallel::DistEnv env = parallel::read_dist_env();
  if (env.world_size <= 1) return configured;
  if (configured != 0) {
    throw ConfigError(fmt::format("device: {} is set, but under a multi-rank launch ({}) each rank trains on GPU "
                                  "LOCAL_RANK; leave device unset",
                                  configured, parallel::describe(env)));
  }
  return turbo::cuda_device_count_or_zero() == 1 ? 0 : env.local_rank;
}

std::vector<GradBucket> plan_buckets(const std::vector<int64_t>& ready_points, int64_t total, int64_t granule,
                                     int64_t bucket_elems) {
  if (granule < 1 || total < 1 || total % granule != 0) {
    throw RuntimeError(fmt::format("plan_buckets: total {} must be a positive multiple of the granule {}", total, granule));
  }
  if (bucket_elems < 1) throw RuntimeError(fmt::format("plan_buckets: bucket size {} must be positive", bucket_elems));
  if (ready_points.empty() || ready_points.back() != 0) {
    throw RuntimeError("plan_buckets: the ready points must end with 0 (the end of the backward)");
  }
  std::vector<GradBucket> out;
  int64_t top = total;
  for (size_t i = 0; i < ready_points.size(); ++i) {
    const int64_t x = ready_points[i];
    if (x < 0 || x > total || (i > 0 && x > ready_points[i - 1])) {
      throw RuntimeError(fmt::format("plan_buckets: ready point {} ({}) is out of order or outside [0, {}]", i, x, total));
    }
    const int64_t b = std::min(round_up(x, granule), top);
    if (b < top && (top - b >= bucket_elems || x == 0)) {
      out.push_back({b, top, x});
      top = b;
    }
  }
  return out;
}

int64_t zero1_padded_total(const train::ParamLayout& layout, int world) {
  return round_up(layout.total, zero1_granule(world));
}

DataParallel::DataParallel(const ReplicaBuffers& model, NcclProcessGroup& pg, const DataParallelOptions& opt)
    : model_(model), pg_(pg), opt_(opt), rank_(pg.rank()), world_(pg.world_size()) {
  if (!model_.layout) throw RuntimeError("DataParallel: the replica has no parameter layout");
  const train::ParamLayout& layout = *model_.layout;
  const TensorView& grads = model_.grads;
  const int64_t total = grads.numel();
  const int64_t granule = opt_.zero1 ? zero1_granule(world_) : 1;
  if (opt_.zero1 && total != zero1_padded_total(layout, world_)) {
    throw RuntimeError(fmt::format("ZeRO-1: the model's gradient buffer holds {} elements, expected {} (padded for {} "
                                   "ranks)",
                                   total, zero1_padded_total(layout, world_), world_));
  }
  buckets_ = plan_buckets(model_.ready_points, total, granule, std::max<int64_t>(opt_.bucket_elems, granule));

  if (opt_.bf16_reduce) {
    int64_t biggest = 0;
    for (const auto& b : buckets_) biggest = std::max(biggest, b.end - b.begin);
    CUDA_CHECK(cudaMalloc(&stage_, size_t(biggest) * 2));
  }
  // Everything below lives on this rank's GPU; average()'s scalar too.
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scalar_), kMaxAverage * sizeof(float)));
  if (!opt_.zero1) return;
  int64_t off = 0;
  for (const auto& b : buckets_) {
    shard_offset_.push_back(off);
    off += chunk(b);
  }
  shard_ = off;
  // The pieces of the model's tensors inside this rank's chunks, for AdamW.
  struct Piece {
    int64_t global, shard, n;
    bool decay;
  };
  std::vector<Piece> pieces;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const int64_t g0 = buckets_[k].begin + rank_ * chunk(buckets_[k]), g1 = g0 + chunk(buckets_[k]);
    for (const auto& t : layout.tensors) {
      const int64_t a = std::max(g0, t.offset), e = std::min(g1, t.offset + t.numel);
      if (a < e) pieces.push_back({a, shard_offset_[k] + (a - g0), e - a, t.decay});
    }
  }
  const size_t table = turbo::cuda::multi_tensor_table_bytes(static_cast<int>(std::max<size_t>(pieces.size(), 1)));
  const size_t align = turbo::Arena::kDefaultAlign;
  const size_t shard_bytes = (static_cast<size_t>(std::max<int64_t>(shard_, 1)) * 4 + align) / align * align;
  state_ = turbo::make_device_arena(3 * shard_bytes + table + 4 * align);
  master_ = state_->tensor(turbo::DType::F32, {std::max<int64_t>(shard_, 1)}, "ZeRO-1 fp32 master shard");
  m_ = state_->tensor(turbo::DType::F32, {std::max<int64_t>(shard_, 1)}, "ZeRO-1 AdamW first moments");
  v_ = state_->tensor(turbo::DType::F32, {std::max<int64_t>(shard_, 1)}, "ZeRO-1 AdamW second moments");
  norm_ = model_.grad_norm;  // the model reads the norm and clip factor from there
  CUDA_CHECK(cudaMemset(master_.data, 0, master_.nbytes()));
  CUDA_CHECK(cudaMemset(m_.data, 0, m_.nbytes()));
  CUDA_CHECK(cudaMemset(v_.data, 0, v_.nbytes()));
  const TensorView& weights = model_.weights;
  std::vector<turbo::AdamWTensor> ts;
  for (const auto& p : pieces) {
    turbo::AdamWTensor a;
    a.master = master_.slice0(p.shard, p.shard + p.n);
    a.m = m_.slice0(p.shard, p.shard + p.n);
    a.v = v_.slice0(p.shard, p.shard + p.n);
    a.grad = grads.slice0(p.global, p.global + p.n);
    a.model = weights.slice0(p.global, p.global + p.n);
    a.decay = p.decay;
    ts.push_back(a);
  }
  if (ts.empty()) throw RuntimeError(fmt::format("ZeRO-1: rank {} of {} owns no parameters (model too small)", rank_, world_));
  adamw_ = std::make_unique<turbo::MultiTensorAdamW>(std::move(ts), state_.get());
  scratch_ = turbo::make_device_arena(turbo::cuda::grad_norm_scratch_bytes(adamw_->num_chunks()) + 4 * align);
}

DataParallel::~DataParallel() {
  if (scalar_) cudaFree(scalar_);
  if (stage_) cudaFree(stage_);
}

size_t DataParallel::optimizer_bytes() const { return opt_.zero1 ? 3 * size_t(shard_) * 4 : 0; }

size_t DataParallel::device_bytes() const {
  size_t b = kMaxAverage * sizeof(float);
  if (state_) b += state_->capacity();
  if (scratch_) b += scratch_->capacity();
  if (stage_) {
    int64_t biggest = 0;
    for (const auto& k : buckets_) biggest = std::max(biggest, k.end - k.begin);
    b += size_t(biggest) * 2;
  }
  return b;
}

void DataParallel::launch(const GradBucket& b) {
  auto* base = static_cast<float*>(model_.grads.data);
  if (opt_.bf16_reduce) {  // on the group's stream, which already waits for the backward so far
    auto* st = static_cast<uint16_t*>(stage_);
    const int64_t n = b.end - b.begin;
    kernels::cast_f32_to_bf16(st, base + b.begin, n, pg_.stream());
    if (opt_.zero1) {
      const int64_t c = chunk(b);
      pg_.reduce_scatter(st, st + rank_ * c, static_cast<size_t>(c), parallel::DType::BF16, parallel::ReduceOp::Avg);
      kernels::bf16_to_f32(base + b.begin + rank_ * c, st + rank_ * c, c, pg_.stream());
    } else {
      pg_.all_reduce(st, static_cast<size_t>(n), parallel::DType::BF16, parallel::ReduceOp::Avg);
      kernels::bf16_to_f32(base + b.begin, st, n, pg_.stream());
    }
    return;
  }
  if (opt_.zero1) {
    pg_.reduce_scatter(base + b.begin, base + b.begin + rank_ * chunk(b), static_cast<size_t>(chunk(b)),
                       parallel::DType::F32, parallel::ReduceOp::Avg);
  } else {
    pg_.all_reduce(base + b.begin, static_cast<size_t>(b.end - b.begin), parallel::DType::F32, parallel::ReduceOp::Avg);
  }
}

void DataParallel::on_ready(int64_t offset) {
  if (next_ >= buckets_.size() || buckets_[next_].begin < offset) return;
  pg_.wait_for(model_.stream);  // the gradients so far are written
  while (next_ < buckets_.size() && buckets_[next_].begin >= offset) launch(buckets_[next_++]);
}

void DataParallel::end_backward() {
  if (next_ < buckets_.size()) {
    pg_.wait_for(model_.stream);
    while (next_ < buckets_.size()) launch(buckets_[next_++]);
  }
  next_ = 0;
  armed_ = false;
  pg_.make_wait(model_.stream);
}

std::vector<double> DataParallel::average(const std::vector<double>& local) {
  if (local.empty() || local.size() > kMaxAverage) {
    throw RuntimeError(fmt::format("DataParallel::average: {} values (1..{})", local.size(), kMaxAverage));
  }
  std::vector<float> v(local.begin(), local.end());
  pg_.wait_for(model_.stream);
  CUDA_CHECK(cudaMemcpyAsync(scalar_, v.data(), v.size() * 4, cudaMemcpyHostToDevice, pg_.stream()));
  pg_.all_reduce(scalar_, v.size(), parallel::DType::F32, parallel::ReduceOp::Avg);
  CUDA_CHECK(cudaMemcpyAsync(v.data(), scalar_, v.size() * 4, cudaMemcpyDeviceToHost, pg_.stream()));
  pg_.synchronize();
  return std::vector<double>(v.begin(), v.end());
}

void DataParallel::grad_norm(float max_norm) {
  if (!opt_.zero1) throw RuntimeError("DataParallel::grad_norm is for ZeRO-1 (plain DP uses the model's)");
  auto stream = model_.stream;
  turbo::ExecContext ctx;
  ctx.stream = stream;
  ctx.scratch = scratch_.get();
  adamw_->grad_norm(norm_, max_norm, ctx);
  kernels::square_norm(norm_.ptr<float>(), stream);
  pg_.wait_for(stream);
  pg_.all_reduce(norm_.data, 1, parallel::DType::F32, parallel::ReduceOp::Sum);
  pg_.make_wait(stream);
  kernels::finish_norm(norm_.ptr<float>(), max_norm, stream);
}

void DataParallel::update(const turbo::AdamWHyper& hp) {
  if (!opt_.zero1) throw RuntimeError("DataParallel::update is for ZeRO-1 (plain DP uses the model's)");
  auto stream = model_.stream;
  turbo::ExecContext ctx;
  ctx.stream = stream;
  ctx.scratch = scratch_.get();
  adamw_->step(hp, norm_.slice0(1, 2), TensorView(), ctx);
  // Every rank's bf16 chunks to every rank, bucket by bucket, in place.
  pg_.wait_for(stream);
  auto* w = static_cast<uint16_t*>(model_.weights.data);
  for (const auto& b : buckets_) {
    pg_.all_gather(w + b.begin + rank_ * chunk(b), w + b.begin, static_cast<size_t>(chunk(b)), parallel::DType::BF16);
  }
  pg_.make_wait(stream);
}

std::vector<parallel::FlatSegment> DataParallel::shard_segments(int rank) const {
  if (!opt_.zero1) throw RuntimeError("DataParallel::shard_segments is for ZeRO-1");
  std::vector<parallel::FlatSegment> bs;
  for (const auto& b : buckets_) bs.push_back({b.begin, b.end});
  return parallel::bucket_chunk_segments(bs, model_.layout->total, rank, world_);
}

std::vector<DataParallel::OwnedPiece> DataParallel::owned_pieces() const {
  std::vector<OwnedPiece> out;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    // The same clipping as shard_segments(), bucket by bucket: a segment starts where its chunk
    // does, at shard_offset_[k] in the shard buffers (only its end is clipped).
    for (const auto& seg :
         parallel::bucket_chunk_segments({{buckets_[k].begin, buckets_[k].end}}, model_.layout->total, rank_, world_)) {
      out.push_back({shard_offset_[k], seg});
    }
  }
  return out;
}

int64_t DataParallel::owned_elems() const {
  if (!opt_.zero1) throw RuntimeError("DataParallel::owned_elems is for ZeRO-1");
  int64_t n = 0;
  for (const auto& p : owned_pieces()) n += p.seg.size();
  return n;
}

void DataParallel::read_shard(float* master, float* m, float* v) {
  if (!opt_.zero1) throw RuntimeError("DataParallel::read_shard is for ZeRO-1");
  const auto pieces = owned_pieces();
  auto stream = model_.stream;  // AdamW writes the shard there
  for (auto [src, dst] : {std::pair{&master_, master}, std::pair{&m_, m}, std::pair{&v_, v}}) {
    if (!dst) continue;
    int64_t off = 0;
    for (const auto& p : pieces) {
      CUDA_CHECK(cudaMemcpyAsync(dst + off, src->ptr<float>() + p.shard, size_t(p.seg.size()) * 4,
                                 cudaMemcpyDeviceToHost, stream));
      off += p.seg.size();
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

void DataParallel::write_shard(const float* master, const float* m, const float* v) {
  if (!opt_.zero1) throw RuntimeError("DataParallel::write_shard is for ZeRO-1");
  const auto pieces = owned_pieces();
  std::vector<float> host(static_cast<size_t>(shard_));
  for (auto [dst, src] : {std::pair{&master_, master}, std::pair{&m_, m}, std::pair{&v_, v}}) {
    std::fill(host.begin(), host.end(), 0.0f);  // the padding (and a null source) stays zero
    if (src) {
      int64_t off = 0;
      for (const auto& p : pieces) {
        std::memcpy(&host[p.shard], src + off, size_t(p.seg.size()) * 4);
        off += p.seg.size();
      }
    }
    CUDA_CHECK(cudaMemcpy(dst->data, host.data(), size_t(shard_) * 4, cudaMemcpyHostToDevice));
  }
}

void DataParallel::set_state(const float* master, const float* m, const float* v) {
  if (!opt_.zero1) throw RuntimeError("DataParallel::set_state is for ZeRO-1");
  const auto pieces = owned_pieces();
  const int64_t own = owned_elems();
  std::vector<float> pm, pv, pw;
  auto pack = [&](const float* full, std::vector<float>& out) -> const float* {
    if (!full) return nullptr;
    out.resize(static_cast<size_t>(own));
    int64_t off = 0;
    for (const auto& p : pieces) {
      std::memcpy(&out[off], full + p.seg.begin, size_t(p.seg.size()) * 4);
      off += p.seg.size();
    }
    return out.data();
  };
  write_shard(pack(master, pw), pack(m, pm), pack(v, pv));
}

void DataParallel::gather_master(float* master) {
  if (!opt_.zero1) throw RuntimeError("DataParallel::gather_master is for ZeRO-1");
  const int64_t total = model_.layout->total;
  int64_t biggest = 0;
  for (const auto& b : buckets_) biggest = std::max(biggest, b.end - b.begin);
  float* tmp = nullptr;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&tmp), size_t(biggest) * 4));
  std::vector<float> host(master ? static_cast<size_t>(biggest) : 0);
  try {
    pg_.wait_for(model_.stream);  // AdamW's last update of the shard is written
    // Every rank joins every all_gather (a collective); only the ranks given a destination keep
    // the result. Skipping the gathers where master is null left rank 0 waiting in its first one.
    for (size_t k = 0; k < buckets_.size(); ++k) {
      const GradBucket& b = buckets_[k];
      const int64_t c = chunk(b);
      CUDA_CHECK(cudaMemcpyAsync(tmp + rank_ * c, master_.ptr<float>() + shard_offset_[k], size_t(c) * 4,
                                 cudaMemcpyDeviceToDevice, pg_.stream()));
      pg_.all_gather(tmp + rank_ * c, tmp, static_cast<size_t>(c), parallel::DType::F32);
      if (master) {
        CUDA_CHECK(cudaMemcpyAsync(host.data(), tmp, size_t(b.end - b.begin) * 4, cudaMemcpyDeviceToHost,
                                   pg_.stream()));
      }
      pg_.synchronize();  // tmp is reused by the next bucket
      const int64_t n = std::min(b.end, total) - b.begin;
      if (master && n > 0) std::memcpy(master + b.begin, host.data(), size_t(n) * 4);
    }
  } catch (...) {
    cudaFree(tmp);
    throw;
  }
  CUDA_CHECK(cudaFree(tmp));
}

void DataParallel::all_gather_host(const void* send, void* recv, size_t bytes) {
  pg_.all_gather_host(send, recv, bytes);
}

}  // namespace primus::parallel
