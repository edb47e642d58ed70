#include "backends/reference/muon.h"

#include <algorithm>

#include "parallel/dist_checkpoint.h"
#include "turbo/kernels/cpu/muon.h"

namespace primus::backends::reference {

MuonOptimizer::MuonOptimizer(const train::ModelSpec& spec, const train::ParamLayout& layout, int rank, int world,
                             bool sharded)
    : layout_(layout), tensors_(train::muon_tensors(spec, layout)), rank_(rank), sharded_(sharded && world > 1) {
  train::assign_muon_owners(tensors_, layout, sharded_ ? world : 1);
  mask_ = train::muon_mask(tensors_, layout);
  int64_t off = 0;
  for (size_t k = 0; k < tensors_.size(); ++k) {
    if (sharded_ && tensors_[k].owner != rank_) continue;
    mine_.push_back(k);
    mine_off_.push_back(off);
    off += layout.tensors[tensors_[k].index].numel;
  }
  momentum_.assign(static_cast<size_t>(off), 0.f);
}

void MuonOptimizer::update(float* params, const float* grads, const train::OptimizerArgs& o, double lr,
                           double grad_scale) {
  turbo::cpu::MuonParams hp;
  hp.lr = lr;
  hp.momentum = o.muon_momentum;
  hp.nesterov = o.muon_nesterov;
  hp.ns_steps = o.muon_ns_steps;
  hp.scale_mode = turbo::cpu::muon_scale_from_name(o.muon_scale_mode);
  hp.extra_scale = o.muon_extra_scale_factor;
  hp.grad_scale = grad_scale;
  for (size_t j = 0; j < mine_.size(); ++j) {
    const train::MuonTensor& mt = tensors_[mine_[j]];
    const train::ParamTensor& pt = layout_.tensors[mt.index];
    hp.weight_decay = pt.decay ? o.weight_decay : 0.0;
    float* m = momentum_.data() + mine_off_[j];
    for (const train::MuonBlock& b : mt.blocks) {
      turbo::cpu::muon_update(params + b.offset, grads + b.offset, m + (b.offset - pt.offset), b.rows, b.cols, hp);
    }
  }
}

void MuonOptimizer::share(parallel::ProcessGroup& pg, float* params) const {
  if (!sharded_) return;
  for (const train::MuonTensor& mt : tensors_) {
    const train::ParamTensor& pt = layout_.tensors[mt.index];
    pg.broadcast(params + pt.offset, static_cast<size_t>(pt.numel), parallel::DType::F32, mt.owner);
  }
}

std::vector<float> MuonOptimizer::flat_momentum(parallel::ProcessGroup& pg) const {
  std::vector<float> flat(static_cast<size_t>(layout_.total), 0.f);
  for (size_t j = 0; j < mine_.size(); ++j) {
    const train::ParamTensor& pt = layout_.tensors[tensors_[mine_[j]].index];
    std::copy_n(momentum_.data() + mine_off_[j], pt.numel, flat.data() + pt.offset);
  }
  // One owner per element, zeros elsewhere: the sum is exact.
  if (sharded_) pg.all_reduce(flat.data(), flat.size(), parallel::DType::F32, parallel::ReduceOp::Sum);
  return flat;
}

void MuonOptimizer::load(const io::CheckpointData& data, const std::filesystem::path& dir,
                         const train::ModelShardMap* map) {
  std::vector<parallel::FlatSegment> windows;
  for (size_t k : mine_) {
    const train::ParamTensor& pt = layout_.tensors[tensors_[k].index];
    if (!map) {
      windows.push_back({pt.offset, pt.offset + pt.numel});
      continue;
    }
    // The map's pieces in local order: the tensor's elements, in order, from wherever they lie.
    for (const train::TpPiece& p : map->pieces()) {
      const int64_t lo = std::max(pt.offset, p.local), hi = std::min(pt.offset + pt.numel, p.local + p.count);
      if (lo < hi) windows.push_back({p.global + (lo - p.local), p.global + (hi - p.local)});
    }
  }
  parallel::read_flat_states(data, dir, {kStateName}, map ? map->global_layout().total : layout_.total, windows,
                             {momentum_.data()});
}

}  // namespace primus::backends::reference
