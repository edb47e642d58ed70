// The CUDA model under sharded data parallelism (backends/cuda/model/fsdp.h) against itself on one
// rank: `world` ranks as threads of this process (parallel/threaded_process_group.h; on the GPU the
// collectives go through device memory), each with its own micro-batch of every step, against one
// rank accumulating the same micro-batches, with the trainers' recipe (clip 1.0, AdamW). Shared
// by the host-mode test (CI) and the GPU one.
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "cuda_fixture.h"
#include "threaded_ranks.h"
#include "parallel/threaded_process_group.h"
#ifdef PRIMUS_FSDP_PARITY_DEVICE
#include "parallel/cuda/threaded_device_ops.h"
#endif

namespace primus::backends::cuda::testing {

// A host group that counts the reduce-scatters it forwards (how often the gradients were
// reduced: optim once a step, the others once a micro-batch).
class CountingGroup : public parallel::ProcessGroup {
 public:
  explicit CountingGroup(parallel::ProcessGroup& g) : g_(g) {}
  int rank() const override { return g_.rank(); }
  int world_size() const override { return g_.world_size(); }
  std::string backend() const override { return g_.backend(); }
  std::chrono::milliseconds timeout() const override { return g_.timeout(); }
  void all_reduce(void* b, size_t n, parallel::DType t, parallel::ReduceOp op) override { g_.all_reduce(b, n, t, op); }
  void reduce_scatter(const void* s, void* r, size_t n, parallel::DType t, parallel::ReduceOp op) override {
    ++reduce_scatters;
    g_.reduce_scatter(s, r, n, t, op);
  }
  void all_gather(const void* s, void* r, size_t n, parallel::DType t) override { g_.all_gather(s, r, n, t); }
  void broadcast(void* b, size_t n, parallel::DType t, int root) override { g_.broadcast(b, n, t, root); }
  void barrier() override { g_.barrier(); }
  void synchronize() override { g_.synchronize(); }
  void abort() override { g_.abort(); }
  int64_t reduce_scatters = 0;

 private:
  parallel::ProcessGroup& g_;
};

// `world` ranks as threads over one ThreadedGroup ("dp"); on the GPU (in the GPU tests' build) its
// collectives go through device memory.
inline void run_dp_ranks(int world, turbo::Device device, const std::function<void(int, parallel::ProcessGroup*)>& rank_main) {
  parallel::ThreadedGroup::OpsFactory ops;
#ifdef PRIMUS_FSDP_PARITY_DEVICE
  if (device == turbo::Device::CUDA) ops = parallel::DeviceMemoryOps::factory(0);
#else
  (void)device;
#endif
  run_threaded_ranks(world, ops, "dp", rank_main);
}

struct FsdpRun {
  std::vector<std::vector<double>> loss, gnorm;  // [rank][step]; one rank: the mean over its micro-batches
  std::vector<float> params, m, v;               // after the last step, in the full layout (rank 0's view)
  std::vector<size_t> reserved_bytes;            // per rank: the model's device arenas
  size_t state_bytes = 0;                        // rank 0: the state buffers the plan names below
  size_t sharded_bytes = 0;                      // rank 0: master, moments, averaged gradient, bf16 chunk
  int64_t reduce_scatters = -1;                  // rank 0 in host mode: the group's reduce-scatters (-1: not counted)
  int64_t grad_elems = 0;                        // rank 0: the gradient buffer's elements (run_dp_in_backward)
};

// world == 1 with NoShard: the reference, one model accumulating `micro` micro-batches per step.
// Otherwise `world` ranks, rank r taking micro-batches r x n .. r x n + n - 1 of every step, n =
// micro / world of them (micro must be a multiple of world).
// `fp8` (optional): the linear layers in FP8 with that recipe (patch cuda.linear.fp8), an MoE's
// experts too (cuda.moe.fp8), each model with recipe state of its own.
inline FsdpRun run_fsdp(const train::ModelSpec& spec, int world, parallel::DpSharding sharding, turbo::Device device,
                        int steps, int micro, Attn attn = Attn::Default, const char* fp8_format = nullptr,
                        const char* fp8_scaling = nullptr) {
  const int64_t T = spec.seq_length;
  const Batches data(T, steps * micro);
  const std::vector<float> init = initial_params(spec);
  FsdpRun run;
  run.loss.resize(static_cast<size_t>(world));
  run.gnorm.resize(static_cast<size_t>(world));
  run.reserved_bytes.resize(static_cast<size_t>(world));
  if (micro % world != 0) throw RuntimeError("run_fsdp: micro must be a multiple of world");
  const int n = micro / world;  // micro-batches per rank and step
  const float dloss = 1.0f / float(kTrainBatch * T * n);

  auto rank_main = [&](int r, parallel::ProcessGroup* group) {
    if (device == turbo::Device::CUDA) select_device(0);
    // Host mode takes any group: counted there (a device model needs the threaded group itself).
    std::unique_ptr<CountingGroup> counted;
    if (group && device == turbo::Device::CPU) counted = std::make_unique<CountingGroup>(*group);
    parallel::ProcessGroup* pg = counted ? counted.get() : group;
    CudaModelOptions mo = options(spec, kTrainBatch, device);
    mo.loss_slots = n;
    if (pg) {
      mo.dp_group = pg;
      mo.dp_sharding = sharding;
    }
    CudaOps ops = ops_for(attn);
    if (fp8_format) {
      const turbo::Fp8Recipe recipe = fp8_test_recipe(fp8_format, fp8_scaling, {});
      use_fp8_linear(ops, recipe);
      mo.fp8_linear = true;
      mo.fp8_multiple = turbo::linear_fp8_multiple(recipe);
      if (spec.moe.enabled()) {
        use_fp8_moe(ops, recipe);
        mo.fp8_moe = true;
      }
    }
    CudaModel model(spec, mo, ops);
    model.set_params(init.data());
    for (int s = 0; s < steps; ++s) {
      model.zero_grad();
      for (int k = 0; k < n; ++k) {
        const int b = s * micro + r * n + k;
        model.forward(data.inputs[b].data(), data.targets[b].data(), kTrainBatch, T, dloss, k);
        model.begin_backward(k + 1 == n);
        model.backward();
      }
      model.grad_norm(1.0f);
      run.loss[r].push_back(model.read_loss_sum(n) / n);
      run.gnorm[r].push_back(model.read_grad_norm());
      const turbo::AdamWHyper hp = parity_hyper(s);
      model.check_step(n);
      model.update(hp);
    }
    std::vector<float> w(size_t(model.layout().total)), m(w.size()), v(w.size());
    model.get_params(w.data());  // collective under sharding: every rank calls it
    model.get_moments(m.data(), v.data());
    run.reserved_bytes[r] = model.reserved_bytes();
    if (r == 0 && counted) run.reduce_scatters = counted->reduce_scatters;
    if (r == 0) {
      run.params = std::move(w);
      run.m = std::move(m);
      run.v = std::move(v);
    }
  };

  if (world == 1 && sharding == parallel::DpSharding::NoShard) {
    rank_main(0, nullptr);
  } else {
    run_dp_ranks(world, device, rank_main);
  }
  return run;
}

// The optimizer in the backward beside plain data parallelism (CudaModelOptions::grad_mean_group,
// clip 0): `world` replicas as threads, replica r taking batch s x world + r of step s (kTrainBatch
// rows), each layer's gradients averaged over them before its update; or with world == 1 the
// reference, one model taking all `world_of_ref` batches of a step as one micro-batch of
// world_of_ref x kTrainBatch rows (the loss the mean over them all). bf16_expert_grads: the MoE
// experts' gradients in bf16 (the device only). Rank 0's weights; every rank's losses and norms.
inline FsdpRun run_dp_in_backward(const train::ModelSpec& spec, int world, int world_of_ref, turbo::Device device,
                                  int steps, Attn attn = Attn::Default, bool bf16_expert_grads = false) {
  const int64_t T = spec.seq_length;
  const int per_step = world == 1 ? world_of_ref : world;
  const Batches data(T, steps * per_step);
  const std::vector<float> init = initial_params(spec);
  FsdpRun run;
  run.loss.resize(static_cast<size_t>(world));
  run.gnorm.resize(static_cast<size_t>(world));
  run.reserved_bytes.resize(static_cast<size_t>(world));
  const int64_t rows = world == 1 ? int64_t(world_of_ref) * kTrainBatch : kTrainBatch;
  auto rank_main = [&](int r, parallel::ProcessGroup* group) {
    if (device == turbo::Device::CUDA) select_device(0);
    CudaModelOptions mo = options(spec, rows, device);
    mo.optimizer_in_backward = true;
    mo.bf16_expert_grads = bf16_expert_grads;
    mo.grad_mean_group = group;
    CudaModel model(spec, mo, ops_for(attn));
    model.set_params(init.data());
    std::vector<int32_t> x, y;
    for (int s = 0; s < steps; ++s) {
      x.clear();
      y.clear();
      for (int k = world == 1 ? 0 : r; k < (world == 1 ? world_of_ref : r + 1); ++k) {
        const auto b = static_cast<size_t>(s * per_step + k);
        x.insert(x.end(), data.inputs[b].begin(), data.inputs[b].end());
        y.insert(y.end(), data.targets[b].begin(), data.targets[b].end());
      }
      model.set_hyper(parity_hyper(s));
      model.zero_grad();
      model.forward(x.data(), y.data(), rows, T, 1.0f / float(rows * T), 0);
      model.backward();
      run.loss[r].push_back(model.read_loss_sum(1));
      run.gnorm[r].push_back(model.read_grad_norm());
    }
    run.reserved_bytes[r] = model.reserved_bytes();
    if (r == 0) {
      run.grad_elems = model.grads().numel();
      run.params.resize(size_t(model.layout().total));
      model.get_params(run.params.data());
    }
  };
  if (world == 1) {
    rank_main(0, nullptr);
  } else {
    run_dp_ranks(world, device, rank_main);
  }
  return run;
}

// The state the memory plan holds for a model built with these options: all of it, and the part
// named as this rank's shard.
inline std::pair<size_t, size_t> planned_state_bytes(const train::ModelSpec& spec, const CudaModelOptions& mo) {
  const train::ParamLayout layout = train::make_param_layout(spec);
  MemoryPlanOptions mp = memory_plan_options(spec, layout, mo, ops_for(Attn::Default));
  mp.query_device = false;
  const MemoryPlanSizes sz = MemoryPlan::sizes(spec, layout, mp);
  size_t all = 0, shard = 0;
  for (const PlannedBuffer& b : sz.buffers) {
    if (!b.state) continue;
    all += b.bytes;
    if (b.what.find("this rank's shard") != std::string::npos) shard += b.bytes;
  }
  return {all, shard};
}

}  // namespace primus::backends::cuda::testing
