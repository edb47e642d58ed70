// Sharded data parallelism in the CUDA model: Megatron's data_parallel_sharding_strategy
// optim_grads (ZeRO-2) and optim_grads_params (ZeRO-3 / FSDP) over the data-parallel group, the
// GPU counterpart of backends/reference/fsdp.h (the oracle it is tested against).
//
// Units. The flat layout (train/param_layout.h) is cut where the decoder reports gradients ready:
// the embeddings [0, layers.0), each transformer layer, and the top (final norm and an untied head)
// [final_norm, total). Each unit is split into world equal chunks (a multiple of 64 elements; the
// last rank's ends in zero padding); rank r owns chunk r of every unit. For its chunks alone a rank
// keeps the fp32 master weights, the AdamW moments, the averaged gradient and (on the device) the
// bf16 weights the next all-gather sends: the optimizer state, the gradients and the weights at
// rest are 1/world of the model's.
//
// Working copies. A unit's weights are all-gathered into a place of world x chunk elements and its
// gradient is written into one of the same size, reduce-scattered (mean over the ranks) into the
// owners' chunks as soon as the decoder reports the unit done, added to the averaged gradient
// (micro-batches accumulate there) and cleared. The transformer layers share two weight places
// and three gradient places (layer l uses weight place l % 2 and gradient place l % 3): with
// optim_grads_params layer l + 1's weights are gathered while layer l runs (l - 1 in the backward:
// one layer of prefetch), and layer l + 1's gradient is reduced while layer l's backward writes its
// own place and, at its end, layer l - 1's last bias gradient (the norm's column sums) into a third. The embeddings and the
// top keep places of their own, gathered after each update and kept (FSDP's root unit, which is
// not resharded: it is used first and last in every step). optim_grads keeps every unit's weights
// whole, all gathered after each update.
//
// optim (ZeRO-1, Megatron's distributed optimizer) shards the optimizer state alone: every unit
// keeps a gradient place of its own (the whole model's gradients, as without sharding), the
// micro-batches of a step accumulate there, and each unit is reduce-scattered into the owners'
// averaged gradient once, on the step's last micro-batch, as the backward finishes it. The weights
// are whole, as with optim_grads.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel/parallel_dims.h"
#include "train/param_layout.h"

namespace primus::backends::cuda {

struct FsdpUnit {
  int64_t begin = 0, end = 0;  // layout range
  int64_t layer = -1;          // the transformer layer, or -1 (embeddings, top)
  int64_t chunk = 0;           // elements per rank
  int64_t shard = 0;           // where this rank's chunk starts in the shard buffers
  int64_t weight_base = 0;     // where the gathered weights start in the weight buffer
  int64_t grad_base = 0;       // where its gradient starts in the gradient buffer
};

struct FsdpPlan {
  int world = 1, rank = 0;
  bool shard_grads = true;    // optim_grads and optim_grads_params (optim: false)
  bool shard_params = false;  // optim_grads_params
  std::vector<FsdpUnit> units;
  int64_t shard_elems = 0;    // sum of the chunks
  int64_t max_chunk = 0;
  int64_t weight_elems = 0, grad_elems = 0;
  std::vector<int64_t> weight_offset, grad_offset;  // per layout tensor
  int64_t span(const FsdpUnit& u) const { return u.chunk * world; }  // a unit's gathered elements
  // The unit whose range starts at `begin` (a ready point), or -1.
  int unit_at(int64_t begin) const;
  // The layout elements [a, b) rank `r` owns of unit u (clipped to the unit: b <= a when none).
  int64_t owned_begin(const FsdpUnit& u, int r) const { return u.begin + r * u.chunk; }
  int64_t owned_end(const FsdpUnit& u, int r) const { return std::min(u.end, u.begin + (r + 1) * u.chunk); }
};

// The plan for rank `rank` of `world` under `sharding` (optim, optim_grads or optim_grads_params).
// Throws RuntimeError for no_shard, when a layer's tensors are not contiguous or a layer does not
// start with its norm1 weight (the decoder's ready point).
FsdpPlan plan_fsdp(const train::ParamLayout& layout, int64_t num_layers, int world, int rank,
                   parallel::DpSharding sharding);

// The shard as a layout of its own: per owned piece of a tensor, a ParamTensor named like the
// tensor, at its shard offset, with the tensor's decay flag (what the shard's AdamW reads).
// origins (optional): each piece's first element's offset in `layout` (its rounding key,
// OptimizerState).
train::ParamLayout shard_layout(const FsdpPlan& plan, const train::ParamLayout& layout,
                                std::vector<int64_t>* origins = nullptr);

// The part of layout range [begin, begin + count) this rank owns, as pieces of its shard: each
// piece's shard offset, layout offset and length, in layout order (none when it owns nothing).
struct ShardSpan {
  int64_t shard = 0, local = 0, count = 0;
};
std::vector<ShardSpan> shard_spans(const FsdpPlan& plan, int64_t begin, int64_t count);

// Host conversions between a full layout-ordered array and this rank's shard (zero padding);
// gathered: every rank's shard concatenated (world x shard_elems) to the full array.
void full_to_shard(const FsdpPlan& plan, const float* full, float* shard);
void shards_to_full(const FsdpPlan& plan, const float* gathered, float* full);

}  // namespace primus::backends::cuda
