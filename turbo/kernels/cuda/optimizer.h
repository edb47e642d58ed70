// Launchers of the multi-tensor optimizer kernels (optimizer.cu): AdamW over every parameter in
// one launch, and the global gradient norm with its clip factor, computed on the device.
// Semantics match turbo/kernels/cpu/optimizer.h and reduce.h (torch.optim.AdamW, decoupled
// weight decay; torch.nn.utils.clip_grad_norm_).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

// One parameter tensor; every pointer is device memory the caller owns.
struct MultiTensorEntry {
  float* master = nullptr;      // fp32 master weights [numel], updated in place (nullptr when split)
  void* model = nullptr;        // bf16 copy written after the update (nullptr: none); split: the high words
  const void* grad = nullptr;   // gradient [numel], f32 or (grad_bf16) bf16
  void* m = nullptr;            // first moment [numel], f32 or (AdamWStorage::m_bf16) bf16
  void* v = nullptr;            // second moment [numel], f32 or (AdamWStorage::v_bf16) bf16
  int64_t numel = 0;
  int32_t decay = 1;            // 0: no weight decay for this tensor (norms, biases)
  int32_t grad_bf16 = 0;        // 1: grad is bf16 (tensors of one table may differ)
  uint16_t* master_lo = nullptr;  // split master: the low words (turbo/ops/optimizer.h), master nullptr
  int64_t sr_key = 0;           // bf16 moments: element 0's stochastic-rounding key (turbo/core/stochastic_round.h)
};

// How a table's tensors are stored (uniform over a table): split masters; bf16 moments, rounded
// stochastically (sr_hash(entry.sr_key + i, step)) when stored, the update itself using the fp32 values.
struct AdamWStorage {
  bool split_master = false, m_bf16 = false, v_bf16 = false;
};

// The device-side table of entries: built once at setup (after the buffers exist) and reused
// by every step, so a step launches with no host-to-device copies (and can be graph-captured).
// multi_tensor_table_build copies synchronously and returns the number of chunks, the grid of
// the kernels below. Throws primus::RuntimeError for an empty tensor list or null pointers.
size_t multi_tensor_table_bytes(int num_tensors);
int64_t multi_tensor_table_build(void* device_table, const MultiTensorEntry* entries, int num_tensors);

struct AdamWStep {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;  // 1-based, including this update (bias correction)
};

// Updates master, m, v (and model) of every tensor in the table. grad_scale: device pointer to
// one float multiplying every gradient (the clip factor from grad_norm), or nullptr for 1; a
// non-finite *grad_scale skips the update (nothing is written: the on-device NaN-step skip).
// device_scalars: device pointer to {lr, 1 - beta1^step, 1 - beta2^step} (and the step as a float,
// needed with bf16 moments: their rounding's key), overriding the host values (for CUDA graphs,
// where host arguments are frozen at capture), or nullptr.
// norm_out (optional): out[0] = the L2 norm of the gradients it read (unscaled; NaN when the
// update was skipped), out[1] = 1, in the same pass (scratch: grad_norm_scratch_bytes(num_chunks)).
// storage.split_master: every entry's master is split (master_lo and model), else every entry has master.
void adamw_multi_tensor(const void* table, int num_tensors, int64_t num_chunks, const AdamWStep& hp,
                        const float* grad_scale, const float* device_scalars, cudaStream_t stream,
                        float* norm_out = nullptr, void* scratch = nullptr, const AdamWStorage& storage = {});

// out[0] = L2 norm over every tensor's gradient, out[1] = min(1, max_norm / (norm + 1e-6))
// (1 when max_norm <= 0). Two kernels (per-chunk partial sums, then one block in chunk order):
// deterministic. scratch holds grad_norm_scratch_bytes(num_chunks) bytes.
void grad_norm_multi_tensor(float* out, const void* table, int num_tensors, int64_t num_chunks, float max_norm,
                            void* scratch, cudaStream_t stream);
size_t grad_norm_scratch_bytes(int64_t num_chunks);

inline constexpr int64_t kMultiTensorChunk = 4096;  // elements per block

}  // namespace primus::turbo::cuda
