// Launchers of Muon's elementwise kernels (muon.cu). Newton-Schulz's GEMMs run through
// turbo::gemm; these are the steps around them, for one matrix [rows, cols] (row-major):
//   muon_momentum:   m = momentum m + s g;  u = nesterov ? s g + momentum m : m   (s = *grad_scale)
//                    and per-block partial sums of u^2 (deterministic order)
//   muon_normalize:  x (bf16) = u / (||u||_F + 1e-7), written transposed ([cols, rows]) when tall
//   muon_sum_squares: the same partial sums of u^2 alone (u put together from tensor-parallel pieces)
//   muon_apply:      master = master (1 - lr wd) - lr rms_scale O, model = bf16(master), O read
//                    back from x (transposed when tall); master [rows, cols] may be the piece of a
//                    [full_rows, full_cols] O at (row0, col0) (tensor parallelism; else the whole)
// The reference is turbo/kernels/cpu/muon.h. A non-finite *grad_scale (the step check's veto)
// makes every kernel return without writing, as the AdamW kernel does. lr: device_lr[0] *
// lr_scale when device_lr is given (a graph replay reads the step's lr there), else lr.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::turbo::cuda {

inline constexpr int kMuonMaxParts = 256;  // blocks of muon_momentum = partial sums it writes

// partial: kMuonMaxParts floats.
void muon_momentum(const float* grad, float* m, float* u, int64_t n, float momentum, bool nesterov,
                   const float* grad_scale, float* partial, cudaStream_t stream);
void muon_normalize(const float* u, void* x_bf16, int64_t rows, int64_t cols, const float* partial,
                    const float* grad_scale, cudaStream_t stream);
void muon_sum_squares(const float* u, int64_t n, const float* grad_scale, float* partial, cudaStream_t stream);
void muon_apply(float* master, void* model_bf16, const void* x_bf16, int64_t rows, int64_t cols, int64_t full_rows,
                int64_t full_cols, int64_t row0, int64_t col0, float lr, const float* device_lr, float lr_scale,
                float weight_decay, float rms_scale, const float* grad_scale, cudaStream_t stream);
// out = alpha x + beta y over n bf16 elements (fp32 arithmetic): Newton-Schulz's b A + c A A and
// a X + B X, each rounded to bf16 once as the torch reference's bf16 tensors are.
void muon_axpby(const void* x_bf16, const void* y_bf16, void* out_bf16, int64_t n, float alpha, float beta,
                const float* grad_scale, cudaStream_t stream);

}  // namespace primus::turbo::cuda
