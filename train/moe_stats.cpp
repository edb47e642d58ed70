#include "train/moe_stats.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "parallel/process_group.h"

namespace primus::train {

MoeStepStats::MoeStepStats(const ModelSpec& spec) : num_layers_(spec.num_layers) {
  for (MoeSpec::Balance b : spec.moe.more_balances()) more_names_.emplace_back(MoeSpec::balance_name(b));
  index_.assign(static_cast<size_t>(spec.num_layers), -1);
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    if (!spec.is_moe_layer(l)) continue;
    index_[l] = static_cast<int64_t>(layers_.size());
    Layer L;
    L.layer = l;
    L.load.assign(static_cast<size_t>(spec.moe.num_experts), 0);
    L.more_aux.assign(more_names_.size(), 0.0);
    layers_.push_back(std::move(L));
  }
}

void MoeStepStats::all_reduce(parallel::ProcessGroup* pg) {
  if (!pg) return;
  all_reduce(pg->world_size(), [pg](const void* send, void* recv, size_t bytes) {
    pg->all_gather(send, recv, bytes / 4, parallel::DType::F32);
  });
}

void MoeStepStats::all_reduce(int W, const parallel::HostAllGather& gather) {
  if (W <= 1 || layers_.empty()) return;
  // The process groups reduce floats only; loads may pass float's 2^24 exact integers. So every
  // rank's 64-bit values travel as bit patterns through an all-gather (which copies, never adds)
  // and are summed here, in the same order on every rank.
  std::vector<uint64_t> mine;
  for (const Layer& L : layers_) {
    for (int64_t v : L.load) mine.push_back(static_cast<uint64_t>(v));
    mine.push_back(static_cast<uint64_t>(L.dropped));
    uint64_t bits;
    std::memcpy(&bits, &L.aux, 8);
    mine.push_back(bits);
    std::memcpy(&bits, &L.z, 8);
    mine.push_back(bits);
    for (const double& m : L.more_aux) {
      std::memcpy(&bits, &m, 8);
      mine.push_back(bits);
    }
  }
  std::vector<uint64_t> all(mine.size() * static_cast<size_t>(W));
  gather(mine.data(), all.data(), mine.size() * sizeof(uint64_t));
  for (Layer& L : layers_) {
    std::fill(L.load.begin(), L.load.end(), 0);
    L.dropped = 0;
    L.aux = L.z = 0;
    std::fill(L.more_aux.begin(), L.more_aux.end(), 0.0);
  }
  for (int r = 0; r < W; ++r) {
    const uint64_t* p = all.data() + static_cast<size_t>(r) * mine.size();
    for (Layer& L : layers_) {
      for (int64_t& v : L.load) v += static_cast<int64_t>(*p++);
      L.dropped += static_cast<int64_t>(*p++);
      double d;
      std::memcpy(&d, p++, 8);
      L.aux += d / W;
      std::memcpy(&d, p++, 8);
      L.z += d / W;
      for (double& m : L.more_aux) {
        std::memcpy(&d, p++, 8);
        m += d / W;
      }
    }
  }
}

std::vector<std::vector<int64_t>> MoeStepStats::load() const {
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(num_layers_));
  for (const Layer& L : layers_) out[L.layer] = L.load;
  return out;
}

void MoeStepStats::report(StepStats& s) const {
  if (layers_.empty()) return;
  double aux_sum = 0, worst_cv = 0;
  for (const Layer& L : layers_) {
    const double n = static_cast<double>(L.load.size());
    double mean = 0, var = 0;
    for (int64_t v : L.load) mean += static_cast<double>(v);
    mean /= n;
    for (int64_t v : L.load) var += (static_cast<double>(v) - mean) * (static_cast<double>(v) - mean);
    const double cv = mean > 0 ? std::sqrt(var / n) / mean : 0.0;
    const double mb = std::max<int64_t>(1, L.micro_batches);
    const std::string p = fmt::format("moe/layer{}/", L.layer);
    s.details.emplace_back(p + "load_min", static_cast<double>(*std::min_element(L.load.begin(), L.load.end())));
    s.details.emplace_back(p + "load_max", static_cast<double>(*std::max_element(L.load.begin(), L.load.end())));
    s.details.emplace_back(p + "load_cv", cv);
    s.details.emplace_back(p + "dropped", static_cast<double>(L.dropped));
    s.details.emplace_back(p + "aux_loss", L.aux / mb);
    s.details.emplace_back(p + "z_loss", L.z / mb);
    for (size_t i = 0; i < more_names_.size(); ++i) s.details.emplace_back(p + more_names_[i], L.more_aux[i] / mb);
    aux_sum += L.aux / mb;
    worst_cv = std::max(worst_cv, cv);
  }
  s.extras.emplace_back("moe_aux", aux_sum / static_cast<double>(layers_.size()));
  s.extras.emplace_back("moe_load_cv", worst_cv);
}

void MoeStepStats::reset() {
  for (Layer& L : layers_) {
    std::fill(L.load.begin(), L.load.end(), 0);
    L.dropped = L.micro_batches = 0;
    L.aux = L.z = 0;
    std::fill(L.more_aux.begin(), L.more_aux.end(), 0.0);
  }
}

}  // namespace primus::train
