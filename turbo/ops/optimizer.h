// Multi-tensor AdamW and the global gradient norm, over every parameter tensor in one launch
// each (turbo/kernels/cpu/optimizer.h and reduce.h are the reference: torch.optim.AdamW with
// decoupled weight decay; torch.nn.utils.clip_grad_norm_'s factor).
//
// Each tensor: fp32 master weights, fp32 moments m and v, a gradient (f32 or bf16, each tensor
// its own; the CPU reference takes f32 only), an optional bf16 model copy rewritten after the
// update, and a decay flag (norm weights and biases are usually not decayed). All tensors live on
// one device.
//
// Split master weights (`master` u16): the fp32 master is held as two 16-bit words, the bf16 model
// copy as its high word and `master` as its low word (turbo/core/dtype.h, split_f32_hi / lo). The
// update reads both, computes in fp32 as with an f32 master and writes both back: the same fp32
// master values, with 2 bytes a parameter less in memory and in the update's traffic (no separate
// bf16 write). The model copy then rounds to nearest with ties away from zero (round-to-nearest-
// even cannot be split: turbo/core/dtype.h says why), so it differs from an f32 master's bf16
// copy in the exact ties only, by one bf16 ulp. A table is all split or all f32.
//
// bf16 moments (m and / or v BF16, each uniform over a table; Megatron's exp_avg_dtype /
// exp_avg_sq_dtype): read widened, the update computed in fp32 as with f32 moments, the new
// moment stored rounded stochastically with the bits of sr_hash(sr_key + i, step)
// (turbo/core/stochastic_round.h, which says why not to nearest): 2 bytes a parameter less memory
// each, 4 less update traffic. sr_key is the tensor's first element's key; callers pass its
// offset in the flat parameter layout, so the bits do not depend on how tables cut the tensors.
//
// A MultiTensorAdamW is built once after the buffers exist: on the GPU it uploads a descriptor
// table (from `arena`), so a step launches with no host-to-device copy and can be captured in
// a CUDA graph. It holds views, not memory: the buffers must outlive it.
#pragma once
#include <string>
#include <vector>

#include "turbo/core/arena.h"
#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

struct AdamWTensor {
  TensorView master, model, grad, m, v;  // model optional (bf16); required when master is u16 (split)
  bool decay = true;
  int64_t sr_key = 0;  // bf16 moments: element 0's stochastic-rounding key (>= 0)
};

struct AdamWHyper {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;  // 1-based count including this update
};

class MultiTensorAdamW {
 public:
  // Throws primus::RuntimeError naming the tensor index for mismatched shapes/dtypes/devices.
  MultiTensorAdamW(std::vector<AdamWTensor> tensors, Arena* device_arena);

  // One update. grad_scale: f32 [1] on the tensors' device multiplying every gradient (the clip
  // factor, out[1] of grad_norm), or undefined for 1; a non-finite grad_scale (NaN, inf) skips
  // the update, leaving master, moments and model copy untouched, so a caller can veto a
  // non-finite step on the device (no host round trip, graph-capturable). device_scalars: f32 [3] on the device =
  // {lr, 1 - beta1^step, 1 - beta2^step}, or f32 [4] adding the step (required with bf16 moments, whose
  // rounding it keys), overriding hp's (for graph replays), or undefined.
  // norm_out (optional) f32 [2] = {L2 norm of the gradients this update read (unscaled; NaN when
  // it was skipped), 1}, computed in the same pass over the gradients (the GPU path takes scratch
  // from ctx.scratch): what the optimizer in the backward logs and checks after each group.
  BackendType step(const AdamWHyper& hp, const TensorView& grad_scale, const TensorView& device_scalars,
                   const ExecContext& ctx, const TensorView& norm_out = {});

  // out f32 [2] = {L2 norm of all gradients, min(1, max_norm / (norm + 1e-6))} (1 if
  // max_norm <= 0), on the tensors' device. Deterministic. The GPU path takes scratch from
  // ctx.scratch.
  BackendType grad_norm(const TensorView& out, float max_norm, const ExecContext& ctx);

  const std::vector<AdamWTensor>& tensors() const { return tensors_; }
  Device device() const { return device_; }
  // F32 when every gradient is f32, else BF16 (mixed_grads: some of each).
  DType grad_dtype() const { return grad_dtype_; }
  bool mixed_grads() const { return mixed_grads_; }
  // The masters are split (u16 low words, the model copies their high words).
  bool split_master() const { return split_master_; }
  DType m_dtype() const { return m_dtype_; }
  DType v_dtype() const { return v_dtype_; }
  int64_t total_numel() const { return total_numel_; }
  const void* device_table() const { return table_; }
  int64_t num_chunks() const { return chunks_; }

 private:
  std::vector<AdamWTensor> tensors_;
  Device device_ = Device::CPU;
  DType grad_dtype_ = DType::F32;
  bool mixed_grads_ = false;
  bool split_master_ = false;
  DType m_dtype_ = DType::F32, v_dtype_ = DType::F32;
  int64_t total_numel_ = 0;
  void* table_ = nullptr;  // device descriptor table (CUDA only)
  int64_t chunks_ = 0;
};

// The dispatcher's argument for both calls (public so the dispatcher tests can name it).
struct OptimizerArgs {
  enum class Kind : uint8_t { AdamW, GradNorm } kind = Kind::AdamW;
  MultiTensorAdamW* opt = nullptr;
  AdamWHyper hp;
  TensorView grad_scale, device_scalars, out;
  float max_norm = 0.0f;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(opt->grad_dtype()); }
};

}  // namespace primus::turbo
