// The CUDA model under expert parallelism against itself on one rank: `ep` ranks as threads of this
// process (parallel/threaded_process_group.h; on the GPU the collectives go through device memory,
// parallel/cuda/threaded_device_ops.h), each building the map's local spec (num_experts / ep of
// every MoE layer's experts) and cutting the same initial weights, each training on its own
// kTrainBatch / ep rows of every step's batch, with the trainers' recipe (clip 1.0, AdamW). The
// one-rank run takes the whole batch: the dense gradients' mean over the ranks and the experts'
// sums over their tokens are the whole batch's, so the runs are the same model up to rounding.
// The switch aux loss is a product of per-batch means (not additive over rows): the specs here
// train without it (the host-mode trainer tests compare it under gradient accumulation). Shared by
// the host-mode test (CI) and the GPU one.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "cuda_fixture.h"
#include "parallel/threaded_process_group.h"
#include "threaded_ranks.h"
#include "train/expert_parallel.h"
#include "train/muon_layout.h"
#ifdef PRIMUS_EP_PARITY_DEVICE
#include "parallel/cuda/threaded_device_ops.h"
#endif

namespace primus::backends::cuda::testing {

struct EpRun {
  std::vector<double> loss, gnorm;   // per step: the mean over the ranks, rank 0's norm
  std::vector<std::vector<double>> rank_loss, rank_gnorm;  // [rank][step]: each its own tokens' loss, one norm
  std::vector<float> params;         // the final weights in the global layout
};

// The tiny MoE models (cuda_fixture.h) without the switch aux loss: Mixtral-style (8 experts,
// top-2) and DeepSeek-style (16 experts in 4 groups, sigmoid top-4, expert bias, a shared expert).
inline train::ModelSpec ep_spec(bool deepseek) {
  train::ModelSpec m = tiny_moe_spec(deepseek);
  m.moe.aux_loss_coeff = 0.0;
  return m;
}

// The recipe both sides train with. The optimizer in the backward (clip 0; each group's gradients
// averaged over the ep ranks, the experts' divided by ep, just before its update) with bf16 expert
// gradients and split masters is the MoE presets' fastest (docs/performance.md); FP8 experts
// (rowwise or blockwise, the linear layers too) run the grouped FP8 GEMMs over the held groups.
struct EpRecipe {
  bool in_backward = false;
  bool bf16_expert_grads = false;  // the device only (needs in_backward)
  bool split_master = false;       // the device only
  const turbo::Fp8Recipe* fp8 = nullptr;
  Recompute recompute = Recompute::None;  // every layer's policy
  bool muon = false;  // Muon for the matrices (each expert's whole on its rank), AdamW for the rest
};

// The same with every width a multiple of 128 (blockwise FP8's 128 x 128 weight blocks).
inline train::ModelSpec ep_spec_128(bool deepseek) {
  train::ModelSpec m = tiny_moe_spec_128(deepseek);
  m.moe.aux_loss_coeff = 0.0;
  return m;
}

// One case of the recipe tests (ep_host_test.cpp, ep_gpu_test.cpp): the tiny model (Mixtral- or
// DeepSeek-style, every width a multiple of 128 for blockwise FP8), ep, and the recipe. fast: split
// masters, and bf16 expert gradients where the experts are bf16 (FP8 experts' weight gradients are
// f32); the device only, with in_backward.
struct EpRecipeCase {
  const char* name;
  bool deepseek = false, block128 = false;
  int ep = 2;
  bool in_backward = false, fast = false;
  const char* fp8_format = nullptr;  // null: bf16 experts (host mode: fp32)
  const char* fp8_scaling = nullptr;
  Recompute recompute = Recompute::None;
  bool muon = false;
};

// The case's model and recipe (the FP8 recipe held here, which EpRecipe points to).
struct EpCase {
  train::ModelSpec spec;
  std::unique_ptr<turbo::Fp8Recipe> fp8;
  EpRecipe recipe;
};
inline std::unique_ptr<EpCase> ep_case(const EpRecipeCase& c) {
  auto e = std::make_unique<EpCase>();
  e->spec = c.block128 ? ep_spec_128(c.deepseek) : ep_spec(c.deepseek);
  if (c.fp8_format) e->fp8 = std::make_unique<turbo::Fp8Recipe>(fp8_test_recipe(c.fp8_format, c.fp8_scaling));
  e->recipe.fp8 = e->fp8.get();
  e->recipe.in_backward = c.in_backward || c.fast;
  e->recipe.split_master = c.fast;
  e->recipe.bf16_expert_grads = c.fast && !c.fp8_format;
  e->recipe.recompute = c.recompute;
  e->recipe.muon = c.muon;
  return e;
}

inline EpRun run_ep(const train::ModelSpec& spec, int ep, turbo::Device device, int steps, Attn attn = Attn::Default,
                    const EpRecipe& recipe = {}) {
  const int64_t T = spec.seq_length, B = kTrainBatch / ep;
  const Batches data(T, steps);
  const std::vector<float> init = initial_params(spec);
  EpRun run;
  std::vector<std::vector<double>>& loss = run.rank_loss;
  loss.resize(static_cast<size_t>(ep));
  run.rank_gnorm.resize(static_cast<size_t>(ep));
  std::vector<std::vector<float>> local(static_cast<size_t>(ep));
  std::vector<std::shared_ptr<train::EpShardMap>> maps(static_cast<size_t>(ep));
  if (ep > 1)
    for (int r = 0; r < ep; ++r) maps[r] = std::make_shared<train::EpShardMap>(spec, ep, r);

  auto rank_main = [&](int r, parallel::ProcessGroup* pg) {
    if (device == turbo::Device::CUDA) select_device(0);
    const train::ModelSpec& ls = ep > 1 ? maps[r]->local_spec() : spec;
    CudaModelOptions mo = options(ls, B, device);
    if (ep > 1) {
      mo.ep_group = pg;
      mo.ep_map = maps[r];
      mo.ep_dense_group = pg;  // the ep ranks are the dense layers' replicas (dp 1)
    }
    mo.optimizer_in_backward = recipe.in_backward;
    if (recipe.in_backward && ep > 1) mo.grad_mean_group = pg;
    mo.bf16_expert_grads = recipe.bf16_expert_grads;
    mo.split_master = recipe.split_master;
    CudaOps ops = ops_for(attn);
    if (recipe.fp8) use_fp8_recipe(ls, *recipe.fp8, ops, mo);
    if (recipe.muon) mo.muon = train::muon_tensors(ls, train::make_param_layout(ls));
    if (recipe.recompute != Recompute::None)
      ops.recompute_policy = [policy = recipe.recompute](int64_t, int64_t) { return policy; };
    CudaModel model(ls, mo, ops);
    std::vector<float> w(static_cast<size_t>(model.layout().total));
    if (ep > 1) maps[r]->to_local(init.data(), w.data());
    else w = init;
    model.set_params(w.data());
    for (int s = 0; s < steps; ++s) {
      const turbo::AdamWHyper hp = parity_hyper(s);
      if (recipe.in_backward) model.set_hyper(hp);
      model.zero_grad();
      const size_t at = static_cast<size_t>(r * B * T);
      model.forward(data.inputs[s].data() + at, data.targets[s].data() + at, B, T, 1.0f / float(B * T), 0);
      model.backward();
      if (!recipe.in_backward) model.grad_norm(1.0f);
      loss[r].push_back(model.read_loss_sum(1));
      run.rank_gnorm[r].push_back(model.read_grad_norm());
      if (recipe.muon) {  // Muon's defaults (Moonlight's) at the parity lr
        turbo::MuonHyper mh;
        mh.lr = hp.lr;
        mh.weight_decay = hp.weight_decay;
        model.set_muon_hyper(mh);
      }
      if (!recipe.in_backward) model.update(hp);
    }
    model.get_params(w.data());
    local[r] = std::move(w);
  };

  if (ep == 1) {
    rank_main(0, nullptr);
  } else {
    parallel::ThreadedGroup::OpsFactory ops;
#ifdef PRIMUS_EP_PARITY_DEVICE
    if (device == turbo::Device::CUDA) ops = parallel::DeviceMemoryOps::factory(0);
#endif
    run_threaded_ranks(ep, ops, "ep", rank_main);
  }
  for (int s = 0; s < steps; ++s) {
    double sum = 0;
    for (int r = 0; r < ep; ++r) sum += loss[r][s];
    run.loss.push_back(sum / ep);
    run.gnorm.push_back(run.rank_gnorm[0][s]);
  }
  if (ep == 1) {
    run.params = local[0];
  } else {
    run.params.assign(init.size(), 0.0f);
    for (int r = 0; r < ep; ++r) maps[r]->to_global(local[r].data(), run.params.data(), r > 0);
  }
  return run;
}

}  // namespace primus::backends::cuda::testing
