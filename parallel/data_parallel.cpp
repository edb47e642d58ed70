#include "parallel/data_parallel.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/util/error.h"
#include "parallel/parallel_dims.h"

namespace primus::parallel {

DataParallelArgs DataParallelArgs::from_config(const config::Value& p) {
  DataParallelArgs a;
  // data_parallel_sharding_strategy: optim is use_distributed_optimizer's newer name. The
  // strategies beyond it are refused by ParallelSizes::check_implemented, not here.
  a.distributed_optimizer = dp_sharding_from_config(p) != DpSharding::NoShard;
  const config::Value* mb = p.find_path("ddp_bucket_size_mb");
  if (mb && !mb->is_null()) a.bucket_size_mb = mb->as_double();
  if (const config::Value* v = p.find_path("ddp_bucket_size"); v && !v->is_null()) {
    if (config::set_by_a_layer(mb))
      throw ConfigError(fmt::format("{}: ddp_bucket_size (elements, Megatron-LM's) and {} ddp_bucket_size_mb: set one "
                                    "of them",
                                    v->origin().str(), mb->origin().str()));
    a.bucket_elements = v->as_int();
  }
  return a;
}

int64_t DataParallelArgs::bucket_elems(size_t elem_bytes) const {
  if (bucket_elements > 0) return bucket_elements;
  double n = bucket_size_mb * 1024.0 * 1024.0 / static_cast<double>(elem_bytes);
  return std::max<int64_t>(1, static_cast<int64_t>(n));
}

void add_data_parallel_schema(config::Schema& s) {
  s.flag("use_distributed_optimizer", false,
         "ZeRO-1: each data-parallel rank keeps and updates only its shard of the optimizer state "
         "(gradients reduce-scattered, weights all-gathered); the same as data_parallel_sharding_strategy: optim")
      .number("ddp_bucket_size_mb", 160.0, "gradients are reduced across ranks in buckets of this many MiB", 0.001,
              65536.0)
      .integer("ddp_bucket_size", std::nullopt,
               "Megatron-LM's bucket size in gradient elements, in place of ddp_bucket_size_mb (set one of them)", 1)
      .flag("overlap_param_gather", false,
            "Megatron-LM's switch: the all-gather of the updated weights under the next forward. Without a sharded "
            "optimizer there is no gather and true holds trivially; with one (ZeRO-1, FSDP) the gather runs after "
            "the update, and true is refused");
}

BatchSlice rank_batch_slice(int64_t global_batch, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw ConfigError(fmt::format("data-parallel rank {} of {} is not valid", rank, world));
  }
  if (global_batch < 1 || global_batch % world != 0) {
    throw ConfigError(fmt::format("global_batch_size {} is not a multiple of the data-parallel size {} (WORLD_SIZE)",
                                  global_batch, world));
  }
  int64_t per = global_batch / world;
  return {per * rank, per};
}

RankBatchReader::RankBatchReader(int64_t global_batch, int64_t micro_batch, int rank, int world)
    : global_(global_batch), micro_(micro_batch), slice_(rank_batch_slice(global_batch, rank, world)) {
  if (micro_ < 1 || slice_.count % micro_ != 0) {
    throw ConfigError(fmt::format("global_batch_size {} is not a multiple of micro_batch_size {} x data-parallel "
                                  "size {}",
                                  global_batch, micro_batch, world));
  }
}

void RankBatchReader::read(const data::BatchIterator& it, int64_t micro, int32_t* out) const {
  PRIMUS_CHECK(micro >= 0 && micro < micro_batches(), "micro-batch {} of {}", micro, micro_batches());
  it.read_at(static_cast<uint64_t>(slice_.first + micro * micro_), static_cast<int>(micro_), out);
}

int64_t ShardLayout::valid_end(int rank) const { return std::clamp(end(rank), begin(rank), std::max(total, begin(rank))); }

ShardLayout shard_layout(int64_t total, int world, int64_t align) {
  PRIMUS_CHECK(total >= 0 && world >= 1 && align >= 1, "shard_layout({}, {}, {})", total, world, align);
  ShardLayout l;
  l.total = total;
  l.world = world;
  int64_t unit = static_cast<int64_t>(world) * align;
  l.padded = (total + unit - 1) / unit * unit;
  l.shard = l.padded / world;
  return l;
}

std::vector<FlatSegment> layout_segments(const ShardLayout& l, int rank) {
  PRIMUS_CHECK(rank >= 0 && rank < l.world, "rank {} of a shard layout for {}", rank, l.world);
  if (l.valid_count(rank) <= 0) return {};
  return {{l.begin(rank), l.valid_end(rank)}};
}

std::vector<FlatSegment> bucket_chunk_segments(const std::vector<FlatSegment>& buckets, int64_t total, int rank,
                                               int world) {
  PRIMUS_CHECK(world >= 1 && rank >= 0 && rank < world && total >= 0, "bucket_chunk_segments: rank {} of {}", rank,
               world);
  std::vector<FlatSegment> out;
  for (const auto& b : buckets) {
    if (b.begin < 0 || b.end < b.begin || b.size() % world != 0) {
      throw RuntimeError(fmt::format("bucket [{}, {}) cannot be cut into {} equal chunks", b.begin, b.end, world));
    }
    const int64_t c = b.size() / world, lo = b.begin + rank * c, hi = std::min(lo + c, total);
    if (lo < hi) out.push_back({lo, hi});
  }
  return out;
}

double global_sum(parallel::ProcessGroup& pg, double local) {
  if (pg.world_size() == 1) return local;
  // hi + lo holds the double to ~48 bits; all_gather moves bits, so every rank sums the same
  // values in the same order.
  float mine[2] = {0.f, 0.f};
  if (std::fabs(local) <= static_cast<double>(std::numeric_limits<float>::max())) {
    mine[0] = static_cast<float>(local);
    mine[1] = static_cast<float>(local - static_cast<double>(mine[0]));
  } else {  // inf, nan, or beyond float: stays non-finite (a double-to-float overflow is UB)
    mine[0] = std::isnan(local) ? std::numeric_limits<float>::quiet_NaN()
                                : std::copysign(std::numeric_limits<float>::infinity(), static_cast<float>(local > 0 ? 1 : -1));
  }
  std::vector<float> all(2 * static_cast<size_t>(pg.world_size()));
  pg.all_gather(mine, all.data(), 2, parallel::DType::F32);
  double sum = 0;
  for (int r = 0; r < pg.world_size(); ++r) sum += static_cast<double>(all[2 * r]) + static_cast<double>(all[2 * r + 1]);
  return sum;
}

double global_norm(parallel::ProcessGroup& pg, double local_sum_squares) {
  return std::sqrt(global_sum(pg, local_sum_squares));
}

void configure_rank_logging(int rank, int world) {
  if (world > 1 && !writes_logs(rank) && spdlog::get_level() < spdlog::level::warn) {
    spdlog::set_level(spdlog::level::warn);
  }
}

}  // namespace primus::parallel
