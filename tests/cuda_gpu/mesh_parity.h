// The CUDA model over a mesh of tensor, context and sharded data parallelism against one rank:
// tp x cp x dp ranks as threads of this process (Megatron's order, tp fastest; on the GPU the
// collectives go through device memory), each building its tp slice of the model (the shard map's
// local spec), holding its cp chunk slots of its dp replica's micro-batch, and sharding the
// optimizer state over the dp x cp ranks of its tp coordinate (optim, optim_grads or
// optim_grads_params; with dp x cp = 1 nothing is sharded), against one rank accumulating the dp
// micro-batches of every step, with the trainers' recipe (clip 1.0, AdamW). Shared by the
// host-mode test (CI) and the GPU one.
#pragma once
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "cp_parity.h"
#include "cuda_fixture.h"
#include "threaded_ranks.h"
#include "parallel/threaded_process_group.h"
#include "tp_parity.h"
#include "train/tensor_parallel.h"
#ifdef PRIMUS_MESH_PARITY_DEVICE
#include "parallel/cuda/threaded_device_ops.h"
#endif

namespace primus::backends::cuda::testing {

struct MeshShape {
  int tp = 1, cp = 1, dp = 1;
  bool sp = false;
  // With dp x cp > 1; NoShard only with dp 1 (the model averages the cp ranks' gradients itself;
  // plain data parallelism is the trainer's reducer, not the model's).
  parallel::DpSharding sharding = parallel::DpSharding::OptimGradsParams;
  int world() const { return tp * cp * dp; }
  bool sharded() const { return dp * cp > 1 && sharding != parallel::DpSharding::NoShard; }
  std::string name() const {
    return "tp" + std::to_string(tp) + (sp ? "sp" : "") + "_cp" + std::to_string(cp) + "_dp" + std::to_string(dp) +
           (sharded() ? std::string("_") + parallel::dp_sharding_name(sharding) : "");
  }
};

// One case of the mesh tests: a tp_spec model (0 GPT-2, 1 Llama, 2 Qwen3) on a layout.
struct MeshCase {
  int model;
  MeshShape shape;
};
// "<model>_<layout>" (tp_parity.h's model names).
inline std::string mesh_case_name(const MeshCase& c) { return std::string(tp_spec_name(c.model)) + "_" + c.shape.name(); }
inline void PrintTo(const MeshCase& c, std::ostream* os) { *os << mesh_case_name(c); }

// The layouts both tests run: every pairing once and the three together. tp x cp (GPT-2 with
// sequence parallelism, sharded over its cp ranks; Llama unsharded), FSDP x tp (Llama tp4: the
// key/value groups replicated and exchanged on the chunks; Qwen3 with sequence parallelism: its
// partial gradients summed on the chunks), FSDP over dp x cp, tp x cp x dp under ZeRO-2, and
// ZeRO-1 (the gradients whole, the optimizer state sharded) beside tp (Qwen3 with sequence
// parallelism) and beside tp x cp (Llama tp2 x cp2 x dp2, sharded over dp x cp = 4 ranks), and
// the MoE model's split experts under FSDP x tp with sequence parallelism, and beside cp (its
// switch loss over the cp group's summed counts) sharded over the cp ranks.
inline std::vector<MeshCase> mesh_layouts() {
  using parallel::DpSharding;
  return {MeshCase{0, {2, 2, 1, true}},
          MeshCase{1, {2, 2, 1, false, DpSharding::NoShard}},
          MeshCase{1, {4, 1, 2}},
          MeshCase{2, {2, 1, 2, true}},
          MeshCase{1, {1, 2, 2}},
          MeshCase{0, {2, 2, 2, false, DpSharding::OptimGrads}},
          MeshCase{2, {2, 1, 2, true, DpSharding::Optim}},
          MeshCase{1, {2, 2, 2, false, DpSharding::Optim}},
          MeshCase{3, {2, 1, 2, true}},
          MeshCase{3, {2, 2, 1, true}}};
}

struct MeshRun {
  std::vector<double> loss;                     // per step: the mean of the ranks' losses
  std::vector<std::vector<double>> rank_gnorm;  // [rank][step]
  const std::vector<double>& gnorm() const { return rank_gnorm.at(0); }  // per step: rank 0's norm
  std::vector<float> params;        // after the last step, in the global layout
};

// The mesh `m`, or with `one` the reference: one rank accumulating m.dp micro-batches a step. Step
// s's micro-batch k is Batches(T, steps x m.dp) entry s x m.dp + k (the reference's k, the mesh's
// dp coordinate).
inline MeshRun run_mesh(const train::ModelSpec& spec, MeshShape m, turbo::Device device, int steps, bool one = false,
                        Attn attn = Attn::Default) {
  const int64_t T = spec.seq_length, B = kTrainBatch;
  const int micro = m.dp;
  if (one) m = MeshShape{1, 1, 1, false, m.sharding};
  const Batches data(T, steps * micro);
  const std::vector<float> init = initial_params(spec);
  const int world = m.world();
  if (m.dp > 1 && !m.sharded()) throw RuntimeError("run_mesh: data parallelism here is sharded (FSDP's reduce-scatter)");
  MeshRun run;
  std::vector<std::vector<double>> loss(static_cast<size_t>(world));
  run.rank_gnorm.resize(size_t(world));
  std::vector<std::vector<float>> local(static_cast<size_t>(world));
  std::vector<std::shared_ptr<train::TpShardMap>> maps(size_t(m.tp));
  for (int r = 0; r < m.tp; ++r) maps[size_t(r)] = std::make_shared<train::TpShardMap>(spec, m.tp, r, m.sp && m.tp > 1);

  auto rank_main = [&](int r, parallel::ProcessGroup* pg) {
    if (device == turbo::Device::CUDA) select_device(0);
    const int t = r % m.tp, c = (r / m.tp) % m.cp, d = r / (m.tp * m.cp);
    // Each rank makes its tp group, its cp group, then its dp x cp group (the same order everywhere).
    std::unique_ptr<parallel::ProcessGroup> tp_g, cp_g, shard_g;
    auto ranks = [&](auto in_group) {
      std::vector<int> out;
      for (int q = 0; q < world; ++q)
        if (in_group(q % m.tp, (q / m.tp) % m.cp, q / (m.tp * m.cp))) out.push_back(q);
      return out;
    };
    if (m.tp > 1) tp_g = pg->new_subgroup(ranks([&](int, int qc, int qd) { return qc == c && qd == d; }), "tp" + std::to_string(c + m.cp * d));
    if (m.cp > 1) cp_g = pg->new_subgroup(ranks([&](int qt, int, int qd) { return qt == t && qd == d; }), "cp" + std::to_string(t + m.tp * d));
    if (m.sharded())
      shard_g = pg->new_subgroup(ranks([&](int qt, int, int) { return qt == t; }), "dpcp" + std::to_string(t));
    const train::TpShardMap& map = *maps[size_t(t)];
    const train::ModelSpec& ls = map.local_spec();
    const int64_t rows = m.cp == 1 ? B : 2 * B, Tl = m.cp == 1 ? T : T / (2 * m.cp);
    CudaModelOptions mo = options(ls, rows, device);
    mo.max_seq = Tl;
    if (world == 1) mo.loss_slots = micro;
    if (tp_g) {
      mo.tp_group = tp_g.get();
      mo.tp_map = maps[size_t(t)];
    }
    if (cp_g) mo.cp_group = cp_g.get();
    if (shard_g) {
      mo.dp_group = shard_g.get();
      mo.dp_sharding = m.sharding;
    }
    CudaModel model(ls, mo, ops_for(attn));
    std::vector<float> w(size_t(model.layout().total));
    map.to_local(init.data(), w.data());
    model.set_params(w.data());
    const int n = world == 1 ? micro : 1;
    for (int s = 0; s < steps; ++s) {
      model.zero_grad();
      for (int k = 0; k < n; ++k) {
        const size_t b = size_t(s * micro + (world == 1 ? k : d));
        const std::vector<int32_t> x = m.cp == 1 ? data.inputs[b] : cp_slot_rows(data.inputs[b], B, T, m.cp, c);
        const std::vector<int32_t> y = m.cp == 1 ? data.targets[b] : cp_slot_rows(data.targets[b], B, T, m.cp, c);
        model.forward(x.data(), y.data(), rows, Tl, 1.0f / float(rows * Tl * n), k);
        model.backward();
      }
      model.grad_norm(1.0f);
      loss[size_t(r)].push_back(model.read_loss_sum(n) / n);
      run.rank_gnorm[size_t(r)].push_back(model.read_grad_norm());
      model.check_step(n);
      model.update(parity_hyper(s));
    }
    model.get_params(w.data());  // collective under sharding: every rank calls it
    local[size_t(r)] = std::move(w);
  };

  if (world == 1) {
    rank_main(0, nullptr);
  } else {
    parallel::ThreadedGroup::OpsFactory ops;
#ifdef PRIMUS_MESH_PARITY_DEVICE
    if (device == turbo::Device::CUDA) ops = parallel::DeviceMemoryOps::factory(0);
#endif
    run_threaded_ranks(world, ops, "mesh", rank_main);
  }
  // The loss of the step: the mean over the ranks that split the batch (cp chunks, dp replicas);
  // the tp ranks of one coordinate hold the same loss.
  for (int s = 0; s < steps; ++s) {
    double sum = 0;
    for (int r = 0; r < world; r += m.tp) sum += loss[size_t(r)][size_t(s)];
    run.loss.push_back(sum / (world / m.tp));
  }
  run.params.assign(init.size(), 0.0f);
  for (int t = 0; t < m.tp; ++t) maps[size_t(t)]->to_global(local[size_t(t)].data(), run.params.data(), t > 0);
  return run;
}

}  // namespace primus::backends::cuda::testing
