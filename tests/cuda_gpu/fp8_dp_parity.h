// fp8_recipe delayed under data parallelism (CudaModelOptions::fp8_amax_groups,
// CudaModel::reduce_fp8_amaxes): two replicas of the tiny Llama as threads of this process over the
// threaded group (on the GPU both on one device, the collectives through device memory), each
// training on its half of every batch with its gradients averaged over the group as plain data
// parallelism averages them (parallel/cuda/grad_reducer.h), against one model that accumulates
// both halves as two micro-batches. On GPUs the trainer's data parallelism needs one GPU per rank (NCCL),
// so this is its step without the trainer: the same calls in the same order (backward, gradient
// mean, amax reduction, norm, update). Shared by the host-mode test (CI) and the GPU one.
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/cuda/hooks.h"
#include "cuda_fixture.h"
#include "threaded_ranks.h"
#ifdef PRIMUS_FP8_DP_PARITY_DEVICE
#include "parallel/cuda/threaded_device_ops.h"
#endif

namespace primus::backends::cuda::testing {

inline constexpr int kFp8DpSteps = 4;
inline constexpr int64_t kFp8DpHalf = kTrainBatch / 2;  // each replica's rows, and each micro-batch's

struct Fp8DpRun {
  std::vector<double> loss;                       // per step: the mean loss over the whole batch
  std::vector<CudaModel::Fp8DelayedState> state;  // per rank, after the last step
};

// ranks 1: one model, the halves as micro-batches 0 and 1. ranks 2: two replicas, each on its half;
// `reduce`: their amaxes are max-reduced over the group every step (fp8_amax_groups). `learn`:
// AdamW at the parity runs' rate; else at rate 0, so the weights stay the initial ones.
inline Fp8DpRun run_fp8_dp(int ranks, const turbo::Fp8DelayedOptions& delayed, bool reduce, bool learn,
                           turbo::Device device) {
  const train::ModelSpec spec = tiny_spec(true);
  const int64_t T = spec.seq_length, half_tokens = kFp8DpHalf * T;
  const Batches data(T, kFp8DpSteps);
  const std::vector<float> init = initial_params(spec);
  const int64_t micro = ranks == 1 ? 2 : 1;
  Fp8DpRun run;
  run.state.resize(static_cast<size_t>(ranks));
  std::vector<std::vector<double>> losses(static_cast<size_t>(ranks));
  auto rank_main = [&](int r, parallel::ProcessGroup* pg) {
    if (device == turbo::Device::CUDA) select_device(0);
    const turbo::Fp8Recipe recipe = fp8_test_recipe("hybrid", "delayed", {.delayed = delayed});
    CudaOps ops = CudaOps::defaults();
    use_fp8_linear(ops, recipe);
    CudaModelOptions mo = options(spec, kFp8DpHalf, device);
    mo.loss_slots = micro;
    mo.fp8_linear = true;
    mo.fp8_delayed = recipe.delayed;
    if (reduce) mo.fp8_amax_groups = {pg};
    CudaModel model(spec, mo, ops);
    model.set_params(init.data());
    for (int s = 0; s < kFp8DpSteps; ++s) {
      model.zero_grad();
      for (int64_t m = 0; m < micro; ++m) {
        const int64_t half = ranks == 1 ? m : r;
        // Each model's loss is the mean over its own tokens; the gradient mean below makes the
        // replicas' update the one model's.
        model.forward(data.inputs[s].data() + half * half_tokens, data.targets[s].data() + half * half_tokens,
                      kFp8DpHalf, T, 1.0f / float(kFp8DpHalf * T * micro), m);
        model.backward();
      }
      if (pg) {
        model.sync();  // the threaded group reads the gradients from its own stream
        const TensorView& g = model.grads();
        pg->all_reduce(g.data, size_t(g.numel()), parallel::DType::F32, parallel::ReduceOp::Avg);
      }
      model.reduce_fp8_amaxes();
      model.grad_norm(1.0f);
      losses[static_cast<size_t>(r)].push_back(model.read_loss_sum(micro) / double(micro));
      turbo::AdamWHyper hp = parity_hyper(s);
      if (!learn) hp.lr = 0.0f;
      model.update(hp);
    }
    run.state[static_cast<size_t>(r)] = model.get_fp8_delayed();
  };
  if (ranks == 1) {
    rank_main(0, nullptr);
  } else {
    parallel::ThreadedGroup::OpsFactory ops;
#ifdef PRIMUS_FP8_DP_PARITY_DEVICE
    if (device == turbo::Device::CUDA) ops = parallel::DeviceMemoryOps::factory(0);
#endif
    run_threaded_ranks(ranks, ops, "dp", rank_main);
  }
  for (int s = 0; s < kFp8DpSteps; ++s) {
    double sum = 0;
    for (const auto& l : losses) sum += l[static_cast<size_t>(s)];
    run.loss.push_back(sum / ranks);
  }
  return run;
}

// Tensor t's role is dy (Fp8DelayedScaling's numbering: x, w, dy).
inline bool fp8_dp_is_grad(int64_t t) {
  return t % turbo::Fp8DelayedScaling::kRoles == turbo::Fp8DelayedScaling::kGrad;
}

// What a replica's entry is against the one model's: x and w the same, dy twice its amaxes and
// half its scales (each replica's loss gradient is the mean over half the tokens, which the
// gradient mean halves again; a power of two, so the FP8 values dequantize alike).
inline float fp8_dp_factor(int64_t t) { return fp8_dp_is_grad(t) ? 2.0f : 1.0f; }

// The largest relative distance of a replica's histories and scales from the one model's (so
// scaled); infinite when a size differs or an entry of the one model's is not positive.
inline double fp8_dp_distance(const CudaModel::Fp8DelayedState& two, const CudaModel::Fp8DelayedState& one) {
  if (two.history.size() != one.history.size() || two.scale.size() != one.scale.size() || one.tensors == 0)
    return INFINITY;
  const int64_t len = one.history_len;
  double worst = 0;
  for (int64_t t = 0; t < one.tensors; ++t) {
    const double f = fp8_dp_factor(t);
    for (int64_t e = 0; e < len; ++e) {
      const double want = f * one.history[static_cast<size_t>(t * len + e)];
      if (!(want > 0)) return INFINITY;
      worst = std::max(worst, std::abs(two.history[static_cast<size_t>(t * len + e)] - want) / want);
    }
    const double want = one.scale[static_cast<size_t>(t)] / f;
    worst = std::max(worst, std::abs(two.scale[static_cast<size_t>(t)] - want) / want);
  }
  return worst;
}

}  // namespace primus::backends::cuda::testing
