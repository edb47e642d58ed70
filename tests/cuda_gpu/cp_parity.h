// The CUDA model under context parallelism (backends/cuda/model/cp_attention.h) against itself on
// one rank: `cp` ranks as threads of this process (on the GPU the collectives go through device
// memory), each holding its two chunks of every sequence (slot-major: chunk r of each sequence,
// then chunk 2cp - 1 - r of each), on the same batches with the trainers' recipe (clip 1.0, AdamW).
// Shared by the host-mode test (CI) and the GPU one.
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "cuda_fixture.h"
#include "threaded_ranks.h"
#include "parallel/threaded_process_group.h"
#ifdef PRIMUS_CP_PARITY_DEVICE
#include "parallel/cuda/threaded_device_ops.h"
#endif

namespace primus::backends::cuda::testing {

struct CpRun {
  std::vector<std::vector<double>> loss, gnorm;  // [rank][step]: each rank's own tokens' mean loss
  std::vector<float> params;                     // rank 0's final weights
  std::vector<size_t> activation_bytes;          // per rank
  std::vector<size_t> saved_slots;               // per rank: FP8 saved-input slots its model made
};

// Rank `rank`'s rows of [B, T] tokens: [2B, T / 2cp], chunk `rank` of every sequence, then chunk
// 2cp - 1 - rank of every sequence.
inline std::vector<int32_t> cp_slot_rows(const std::vector<int32_t>& full, int64_t B, int64_t T, int cp, int rank) {
  const int64_t Tc = T / (2 * cp);
  std::vector<int32_t> out;
  out.reserve(size_t(2 * B * Tc));
  for (int64_t c : {int64_t(rank), int64_t(2 * cp - 1 - rank)})
    for (int64_t b = 0; b < B; ++b)
      out.insert(out.end(), full.begin() + b * T + c * Tc, full.begin() + b * T + (c + 1) * Tc);
  return out;
}

// fp8: each rank's own FP8 recipe (its registries are the rank's model's), or none for bf16/fp32.
// in_backward: the optimizer in the backward (clip 0), else AdamW after the backward with clip 1.0.
inline CpRun run_cp(const train::ModelSpec& spec, int cp, turbo::Device device, int steps, Attn attn = Attn::Default,
                    const std::function<turbo::Fp8Recipe()>& fp8 = {}, bool in_backward = false) {
  const int64_t T = spec.seq_length, B = kTrainBatch;
  const Batches data(T, steps);
  const std::vector<float> init = initial_params(spec);
  CpRun run;
  run.loss.resize(static_cast<size_t>(cp));
  run.gnorm.resize(static_cast<size_t>(cp));
  run.activation_bytes.resize(static_cast<size_t>(cp));
  run.saved_slots.resize(static_cast<size_t>(cp));

  auto rank_main = [&](int r, parallel::ProcessGroup* pg) {
    if (device == turbo::Device::CUDA) select_device(0);
    const int64_t rows = cp == 1 ? B : 2 * B, Tl = cp == 1 ? T : T / (2 * cp);
    CudaModelOptions mo = options(spec, rows, device);
    mo.max_seq = Tl;
    mo.optimizer_in_backward = in_backward;
    if (cp > 1) mo.cp_group = pg;
    CudaOps ops = ops_for(attn);
    turbo::Fp8Recipe recipe;
    if (fp8) use_fp8_recipe(spec, recipe = fp8(), ops, mo);
    CudaModel model(spec, mo, ops);
    if (recipe.saved) run.saved_slots[r] = recipe.saved->size();
    model.set_params(init.data());
    for (int s = 0; s < steps; ++s) {
      const std::vector<int32_t> x = cp == 1 ? data.inputs[s] : cp_slot_rows(data.inputs[s], B, T, cp, r);
      const std::vector<int32_t> y = cp == 1 ? data.targets[s] : cp_slot_rows(data.targets[s], B, T, cp, r);
      const turbo::AdamWHyper hp = parity_hyper(s);
      if (in_backward) model.set_hyper(hp);
      model.zero_grad();
      model.forward(x.data(), y.data(), rows, Tl, 1.0f / float(rows * Tl), 0);
      model.backward();
      if (!in_backward) model.grad_norm(1.0f);
      run.loss[r].push_back(model.read_loss_sum(1));
      run.gnorm[r].push_back(model.read_grad_norm());
      if (!in_backward) model.update(hp);
    }
    run.activation_bytes[r] = model.activation_bytes();
    if (r == 0) {
      run.params.resize(size_t(model.layout().total));
      model.get_params(run.params.data());
    }
  };

  if (cp == 1) {
    rank_main(0, nullptr);
    return run;
  }
  parallel::ThreadedGroup::OpsFactory ops;
#ifdef PRIMUS_CP_PARITY_DEVICE
  if (device == turbo::Device::CUDA) ops = parallel::DeviceMemoryOps::factory(0);
#endif
  run_threaded_ranks(cp, ops, "cp", rank_main);
  return run;
}

}  // namespace primus::backends::cuda::testing
