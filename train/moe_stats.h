// What a training step's MoE layers did, summed over its micro-batches, for both backends:
// slots routed to each expert (the load the expert-bias update balances), slots dropped over
// capacity, and the aux and z losses. Reported per layer in metrics.jsonl and TensorBoard
// (moe/layer<l>/{load_min, load_max, load_cv, dropped, aux_loss, z_loss}, and a listed balancing
// type's own name beside aux_loss when several are listed) and summarised on the
// console (moe_aux: the mean aux loss over layers, moe_load_cv: the largest coefficient of
// variation of the expert loads).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/dist_checkpoint.h"
#include "train/model_spec.h"
#include "train/progress.h"

namespace primus::parallel {
class ProcessGroup;
}

namespace primus::train {

class MoeStepStats {
 public:
  explicit MoeStepStats(const ModelSpec& spec);
  bool enabled() const { return !layers_.empty(); }

  // One micro-batch of MoE layer `layer`: slots per expert, dropped slots, aux and z losses. aux
  // is the primary balancing loss's (MoeSpec::primary_balance), more_aux the other listed types'
  // (MoeSpec::more_balances, in that order; logged as moe/layer<l>/<type>).
  template <class Count>
  void add(int64_t layer, const Count* counts, int64_t dropped, double aux, double z,
           const std::vector<double>& more_aux = {}) {
    Layer& L = layers_.at(static_cast<size_t>(index_.at(static_cast<size_t>(layer))));
    for (size_t e = 0; e < L.load.size(); ++e) L.load[e] += static_cast<int64_t>(counts[e]);
    L.dropped += dropped;
    L.aux += aux;
    L.z += z;
    for (size_t i = 0; i < L.more_aux.size() && i < more_aux.size(); ++i) L.more_aux[i] += more_aux[i];
    ++L.micro_batches;
  }
  // Sums the loads and dropped slots and averages the losses over the ranks of `pg` (null: this
  // rank alone), so every rank sees the global batch's statistics.
  void all_reduce(parallel::ProcessGroup* pg);
  // The same over `world` ranks through `gather` (every rank's bytes in rank order), for a group
  // whose collectives take device buffers and so stage host ones (NcclProcessGroup::all_gather_host).
  void all_reduce(int world, const parallel::HostAllGather& gather);
  // Per layer [layer][expert] (empty for dense layers): for the expert-bias update.
  std::vector<std::vector<int64_t>> load() const;
  void report(StepStats& s) const;
  void reset();

 private:
  struct Layer {
    int64_t layer = 0;
    std::vector<int64_t> load;
    int64_t dropped = 0, micro_batches = 0;
    double aux = 0, z = 0;
    std::vector<double> more_aux;  // one per more_names_
  };
  int64_t num_layers_ = 0;
  std::vector<std::string> more_names_;  // the listed balancing types other than the primary
  std::vector<int64_t> index_;  // layer -> entry of layers_, -1 for dense layers
  std::vector<Layer> layers_;
};

}  // namespace primus::train
