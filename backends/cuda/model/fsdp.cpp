#include "backends/cuda/model/fsdp.h"

#include <fmt/format.h>

#include <cstring>

#include "backends/cuda/model/grad_placement.h"
#include "core/util/error.h"

namespace primus::backends::cuda {
namespace {

constexpr int64_t kGranule = 64;  // chunk and place alignment (elements): 128-byte bf16 rows

int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

}  // namespace

int FsdpPlan::unit_at(int64_t begin) const {
  for (size_t u = 0; u < units.size(); ++u)
    if (units[u].begin == begin) return static_cast<int>(u);
  return -1;
}

FsdpPlan plan_fsdp(const train::ParamLayout& layout, int64_t num_layers, int world, int rank,
                   parallel::DpSharding sharding) {
  if (world < 1 || rank < 0 || rank >= world) throw RuntimeError(fmt::format("fsdp: rank {} of {}", rank, world));
  if (sharding == parallel::DpSharding::NoShard) throw RuntimeError("fsdp: a plan for no_shard");
  FsdpPlan p;
  p.world = world;
  p.rank = rank;
  p.shard_grads = parallel::shards_gradients(sharding);
  p.shard_params = sharding == parallel::DpSharding::OptimGradsParams;
  const bool shard_params = p.shard_params;
  // Layer ranges from the tensor names; everything before layer 0 is the embeddings unit, after
  // the last layer the top.
  std::vector<int64_t> lb(size_t(num_layers), -1), le(size_t(num_layers), -1);
  std::vector<int> unit_of(layout.tensors.size());
  int64_t last_layer = -1;
  for (const train::ParamTensor& t : layout.tensors) {
    const int64_t l = layer_of(t.name);
    if (l < 0) continue;
    if (l >= num_layers) throw RuntimeError(fmt::format("fsdp: tensor '{}' beyond {} layers", t.name, num_layers));
    if (l < last_layer || (l != last_layer && lb[size_t(l)] >= 0))
      throw RuntimeError(fmt::format("fsdp: layer {}'s tensors are not contiguous in the flat layout", l));
    if (l != last_layer) {
      if (t.name != fmt::format("layers.{}.norm1.weight", l))
        throw RuntimeError(fmt::format("fsdp: layer {} starts with '{}', not its norm1 weight", l, t.name));
      lb[size_t(l)] = t.offset;
    }
    le[size_t(l)] = t.offset + t.numel;
    last_layer = l;
  }
  for (int64_t l = 0; l < num_layers; ++l)
    if (lb[size_t(l)] < 0) throw RuntimeError(fmt::format("fsdp: layer {} has no tensors", l));
  const int64_t first = num_layers > 0 ? lb[0] : layout.total, top = num_layers > 0 ? le.back() : layout.total;
  auto add = [&](int64_t b, int64_t e, int64_t layer) {
    if (e <= b) return;
    FsdpUnit u;
    u.begin = b;
    u.end = e;
    u.layer = layer;
    u.chunk = round_up((e - b + world - 1) / world, kGranule);
    u.shard = p.shard_elems;
    p.shard_elems += u.chunk;
    p.max_chunk = std::max(p.max_chunk, u.chunk);
    p.units.push_back(u);
  };
  add(0, first, -1);
  for (int64_t l = 0; l < num_layers; ++l) add(lb[size_t(l)], le[size_t(l)], l);
  add(top, layout.total, -1);
  for (size_t i = 1; i < p.units.size(); ++i)
    if (p.units[i].begin != p.units[i - 1].end) throw RuntimeError("fsdp: the units do not tile the flat layout");

  // Places of the largest layer's span: the layers' gradients share three (l % 3: layer l's
  // backward writes its own and layer l - 1's last bias gradient while layer l + 1's is reduced),
  // their weights with shard_params two (l % 2); the other units have their own. optim's
  // gradients each have their own: they accumulate over the step's micro-batches.
  int64_t layer_span = 0;
  for (const FsdpUnit& u : p.units)
    if (u.layer >= 0) layer_span = std::max(layer_span, p.span(u));
  int64_t wpos = 0, gpos = 0;
  int64_t wwin[2] = {-1, -1}, gwin[3] = {-1, -1, -1};
  // A place of the unit's own (win null) or the shared window *win, taken where `pos` is at first use.
  auto place = [&](const FsdpUnit& u, int64_t& pos, int64_t* win) {
    const int64_t at = win && *win >= 0 ? *win : pos;
    if (!win || *win < 0) pos += win ? layer_span : p.span(u);
    if (win) *win = at;
    return at;
  };
  for (FsdpUnit& u : p.units) {
    const bool layer = u.layer >= 0;
    u.weight_base = place(u, wpos, layer && shard_params ? &wwin[u.layer % 2] : nullptr);
    u.grad_base = place(u, gpos, layer && p.shard_grads ? &gwin[u.layer % 3] : nullptr);
  }
  p.weight_elems = wpos;
  p.grad_elems = gpos;
  p.weight_offset.resize(layout.tensors.size());
  p.grad_offset.resize(layout.tensors.size());
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const train::ParamTensor& t = layout.tensors[i];
    for (const FsdpUnit& u : p.units) {
      if (t.offset < u.begin || t.offset >= u.end) continue;
      if (t.offset + t.numel > u.end) throw RuntimeError(fmt::format("fsdp: tensor '{}' crosses a unit", t.name));
      p.weight_offset[i] = u.weight_base + (t.offset - u.begin);
      p.grad_offset[i] = u.grad_base + (t.offset - u.begin);
    }
  }
  return p;
}

train::ParamLayout shard_layout(const FsdpPlan& plan, const train::ParamLayout& layout,
                                std::vector<int64_t>* origins) {
  train::ParamLayout s;
  if (origins) origins->clear();
  for (const FsdpUnit& u : plan.units) {
    const int64_t a = plan.owned_begin(u, plan.rank), b = plan.owned_end(u, plan.rank);
    for (const train::ParamTensor& t : layout.tensors) {
      const int64_t lo = std::max(a, t.offset), hi = std::min(b, t.offset + t.numel);
      if (hi <= lo) continue;
      train::ParamTensor piece;
      piece.name = t.name;
      piece.shape = {hi - lo};
      piece.offset = u.shard + (lo - a);
      piece.numel = hi - lo;
      piece.decay = t.decay;
      piece.trainable = t.trainable;
      s.tensors.push_back(std::move(piece));
      if (origins) origins->push_back(lo);
    }
  }
  s.total = plan.shard_elems;
  return s;
}

std::vector<ShardSpan> shard_spans(const FsdpPlan& plan, int64_t begin, int64_t count) {
  std::vector<ShardSpan> out;
  for (const FsdpUnit& u : plan.units) {
    const int64_t a = plan.owned_begin(u, plan.rank), b = plan.owned_end(u, plan.rank);
    const int64_t lo = std::max(a, begin), hi = std::min(b, begin + count);
    if (hi > lo) out.push_back({u.shard + (lo - a), lo, hi - lo});
  }
  return out;
}

void full_to_shard(const FsdpPlan& plan, const float* full, float* shard) {
  std::memset(shard, 0, size_t(plan.shard_elems) * sizeof(float));
  for (const FsdpUnit& u : plan.units) {
    const int64_t a = plan.owned_begin(u, plan.rank), b = plan.owned_end(u, plan.rank);
    if (b > a) std::memcpy(shard + u.shard, full + a, size_t(b - a) * sizeof(float));
  }
}

void shards_to_full(const FsdpPlan& plan, const float* gathered, float* full) {
  for (const FsdpUnit& u : plan.units) {
    for (int r = 0; r < plan.world; ++r) {
      const int64_t a = plan.owned_begin(u, r), b = plan.owned_end(u, r);
      if (b > a) std::memcpy(full + a, gathered + int64_t(r) * plan.shard_elems + u.shard, size_t(b - a) * sizeof(float));
    }
  }
}

}  // namespace primus::backends::cuda
