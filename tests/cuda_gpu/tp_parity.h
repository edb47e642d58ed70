// The CUDA model under tensor parallelism against itself on one rank: `tp` ranks as threads of
// this process (parallel/threaded_process_group.h; on the GPU the collectives go through device
// memory, parallel/cuda/threaded_device_ops.h), each building its part of the model from the
// shard map's local spec and cutting the same initial weights, on the same batches, with the
// trainers' recipe (clip 1.0, AdamW), with or without sequence parallelism. Shared by the
// host-mode test (CI) and the GPU one.
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_fixture.h"
#include "train/muon_layout.h"
#include "threaded_ranks.h"
#include "parallel/threaded_process_group.h"
#include "train/tensor_parallel.h"
#ifdef PRIMUS_TP_PARITY_DEVICE
#include "parallel/cuda/threaded_device_ops.h"
#endif

namespace primus::backends::cuda::testing {

struct TpRun {
  std::vector<std::vector<double>> loss, gnorm;  // [rank][step]
  std::vector<float> params;                     // the final weights in the global layout
  std::vector<size_t> reserved_bytes;            // per rank: the model's device arenas
  std::vector<size_t> activation_bytes;          // per rank: its activations arena
  std::vector<size_t> saved_slots;               // per rank: FP8 saved-input slots its model made
};

// The tiny models tensor parallelism can split in two: GPT-2 (2 heads, tied head, learned
// positions, biases; vocabulary 250 of 256 rows, so the second rank's rows end in padding), a
// Llama with 4 query heads in 2 kv groups, the same with Qwen3's per-head q|k norms (whose
// gradients are summed over the group), and a DeepSeek-style MoE on the Llama (16 experts of 64,
// sigmoid router in 4 groups, expert bias, a shared expert of 96, the switch aux loss and the
// z-loss; the first layer dense): every expert split over the ranks, the router's gradient
// summed over them.
inline train::ModelSpec tp_spec(int which) {
  if (which == 3) return tiny_moe_spec(true);
  if (which == 0) {
    train::ModelSpec m = tiny_spec(false);
    m.vocab_size = 250;
    return m;
  }
  train::ModelSpec m = tiny_qwen3_spec(false);
  if (which == 1) {
    m.model_type = "llama";
    m.qk_layernorm = false;
  }
  return m;
}
inline const char* tp_spec_name(int which) {
  return which == 0 ? "gpt2" : which == 1 ? "llama" : which == 2 ? "qwen3" : "deepseek_moe";
}

// fp8: each rank's own FP8 recipe (its registries are the rank's model's), or none. in_backward:
// the optimizer in the backward (clip 0: no global norm before the updates), else AdamW after the
// backward with clip 1.0.
inline TpRun run_tp(const train::ModelSpec& spec, int tp, turbo::Device device, int steps, Attn attn = Attn::Default,
                    bool sequence_parallel = false, const std::function<turbo::Fp8Recipe()>& fp8 = {},
                    bool in_backward = false, bool muon = false) {
  const int64_t T = spec.seq_length;
  const Batches data(T, steps);
  const std::vector<float> init = initial_params(spec);
  TpRun run;
  run.loss.resize(static_cast<size_t>(tp));
  run.gnorm.resize(static_cast<size_t>(tp));
  run.reserved_bytes.resize(static_cast<size_t>(tp));
  run.activation_bytes.resize(static_cast<size_t>(tp));
  run.saved_slots.resize(static_cast<size_t>(tp));
  std::vector<std::vector<float>> local(static_cast<size_t>(tp));
  std::vector<std::shared_ptr<train::TpShardMap>> maps(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) maps[r] = std::make_shared<train::TpShardMap>(spec, tp, r, sequence_parallel && tp > 1);

  auto rank_main = [&](int r, parallel::ProcessGroup* pg) {
    if (device == turbo::Device::CUDA) select_device(0);
    const train::TpShardMap& map = *maps[r];
    const train::ModelSpec& ls = map.local_spec();
    CudaModelOptions mo = options(ls, kTrainBatch, device);
    mo.optimizer_in_backward = in_backward;
    if (tp > 1) {
      mo.tp_group = pg;
      mo.tp_map = maps[r];
    }
    CudaOps ops = ops_for(attn);
    turbo::Fp8Recipe recipe;
    if (fp8) use_fp8_recipe(ls, recipe = fp8(), ops, mo);
    // Muon: the model's matrices (under tp its blocks, pieces of the global ones) and Muon's
    // defaults (Moonlight's: Nesterov 0.95, 5 steps, spectral scale x 0.2) at the parity lr.
    if (muon) mo.muon = train::muon_tensors(ls, train::make_param_layout(ls));
    CudaModel model(ls, mo, ops);
    if (recipe.saved) run.saved_slots[r] = recipe.saved->size();
    std::vector<float> w(static_cast<size_t>(model.layout().total));
    map.to_local(init.data(), w.data());
    model.set_params(w.data());
    for (int s = 0; s < steps; ++s) {
      const turbo::AdamWHyper hp = parity_hyper(s);
      if (in_backward) model.set_hyper(hp);
      model.zero_grad();
      model.forward(data.inputs[s].data(), data.targets[s].data(), kTrainBatch, T, 1.0f / float(kTrainBatch * T), 0);
      model.backward();
      if (!in_backward) model.grad_norm(1.0f);
      run.loss[r].push_back(model.read_loss_sum(1));
      run.gnorm[r].push_back(model.read_grad_norm());
      if (muon) {
        turbo::MuonHyper mh;
        mh.lr = hp.lr;
        mh.weight_decay = hp.weight_decay;
        model.set_muon_hyper(mh);
      }
      if (!in_backward) model.update(hp);
    }
    model.get_params(w.data());
    local[r] = std::move(w);
    run.reserved_bytes[r] = model.reserved_bytes();
    run.activation_bytes[r] = model.activation_bytes();
  };

  if (tp == 1) {
    rank_main(0, nullptr);
  } else {
    parallel::ThreadedGroup::OpsFactory ops;
#ifdef PRIMUS_TP_PARITY_DEVICE
    if (device == turbo::Device::CUDA) ops = parallel::DeviceMemoryOps::factory(0);
#endif
    run_threaded_ranks(tp, ops, "tp", rank_main);
  }
  run.params.assign(init.size(), 0.0f);
  for (int r = 0; r < tp; ++r) maps[r]->to_global(local[r].data(), run.params.data(), r > 0);
  return run;
}

}  // namespace primus::backends::cuda::testing
