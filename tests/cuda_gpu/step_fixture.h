// A trainer-shaped loop over the tiny models for the step machinery's tests (host mode and GPU):
// each step stages its micro-batches, sets AdamW's scalars (a rising learning rate, so a captured
// step must read them from the device), then runs zero_grad, forward + backward per micro-batch,
// grad norm (clip 1.0), the on-device non-finite check and AdamW through a StepGraph (eager, or
// captured at step 2 and replayed), and reads the status once, as CudaTrainer does. With the
// optimizer in the backward (model_options sets it) the backward does the last three.
#pragma once
#include <functional>
#include <vector>

#include "backends/cuda/model.h"
#include "backends/cuda/profile.h"
#include "cuda_fixture.h"

namespace primus::backends::cuda::testing {

struct StepRunOptions {
  bool llama = false;
  const train::ModelSpec* spec = nullptr;  // instead of tiny_spec(llama), e.g. a tiny MoE
  float clip = 1.0f;                       // grad_norm's max_norm (0: no clipping)
  Attn attn = Attn::Default;
  turbo::Device device = turbo::Device::CPU;
  std::function<RecomputePolicyFn> recompute;  // empty: none
  bool graph = false;
  const turbo::Fp8Recipe* fp8 = nullptr;  // the linear slots in FP8 (patch cuda.linear.fp8), an MoE's experts too
  bool profile = false;  // a StepProfiler over every step after the first
  int steps = 3;
  int micro = 2;  // micro-batches per step (kTrainBatch / micro sequences each)
  std::function<void(int step, CudaModel&)> before_step, after_step;  // after: the status is read
  std::function<void(CudaModelOptions&)> model_options;  // e.g. the step's variants (bias_grad, gelu_unfused_*)
};

struct StepRun {
  std::vector<double> losses, norms;
  std::vector<bool> finite;
  std::vector<float> grads0;  // the gradients of step 0 (empty with the optimizer in the backward)
  std::vector<float> params;  // the master weights after the last step
  std::vector<float> m, v;    // and the AdamW moments
  int64_t grad_elems = 0;     // of the model's gradient buffer
  size_t activation_bytes = 0;
  int64_t graph_launches = 0;
  int64_t profiled_steps = 0;
  std::vector<std::pair<Phase, double>> phase_ms;  // phases that took time, summed over the profiled steps
  double profile_total_ms = 0;
};

StepRun run_steps(const StepRunOptions& o);

// Step 0's gradients of a run of `o` with CudaModelOptions::bias_grad = mode ("ones", "norm",
// "separate", "gemm") and of the same run with mode "separate" (every bias gradient its own column-sum reduction) agree per tensor: max |a - b|
// <= tol * max |b| (and each bias gradient is nonzero). Asserts the ones column was used exactly
// when `mode` is "ones".
void expect_bias_grad_mode_matches_separate(const char* mode, StepRunOptions o, double tol);

// gradient_accumulation_fusion: false (CudaModelOptions::unfused_wgrad) against the fused run of
// `o`, step 0's gradients. One micro-batch: each linear weight's gradient (transformer layers',
// experts', an untied output layer's) is the fused one rounded to the weights' dtype (bf16 on the
// device, unchanged in host mode) bit for bit, and every other gradient (norms, biases, router,
// embeddings) is the fused one bit for bit, except a tied embedding (the output layer's rounded part
// plus the lookup's), within 1e-2 of its largest element. `o.micro` micro-batches (more than one):
// within `tol` relative L2 of the fused run, and on the device not equal to it. Returns the
// largest relative L2 difference over the tensors.
double expect_unfused_wgrad_matches_fused(StepRunOptions o, double tol);

inline std::function<RecomputePolicyFn> recompute_all(Recompute r) {
  return [r](int64_t, int64_t) { return r; };
}

}  // namespace primus::backends::cuda::testing
