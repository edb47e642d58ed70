// Launchers of the fused residual-add + LayerNorm / RMSNorm kernels (normalization.cu).
// Layout: rows of C contiguous elements (N = B*T rows), T = f32 or bf16 storage selected by
// `dtype`; weight/bias [C] in the same dtype; statistics mean/rstd [N] and parameter gradients
// dweight/dbias [C] always f32. C must be a multiple of 16 / sizeof(T) (128-bit vectors) and
// at most 8192 (bf16) / 4096 (f32); every pointer 16-byte aligned.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

enum class NormKind : uint8_t { LayerNorm, RMSNorm };

// Without residual (residual == nullptr): out = norm(inp).
// With residual: residual_out = inp + residual (rounded to T), out = norm(residual_out).
// Writes mean [N] (LayerNorm only; may be nullptr for RMSNorm) and rstd [N] for the backward.
// bias may be nullptr (RMSNorm never has one). ld_out: out's row stride in elements (0: C; else
// >= C and a multiple of the 16-byte vector); the columns past C are left as they are.
void norm_forward(NormKind kind, DType dtype, void* out, float* mean, float* rstd,
                  void* residual_out, const void* inp, const void* residual, const void* weight,
                  const void* bias, int64_t N, int64_t C, float eps, cudaStream_t stream, int64_t ld_out = 0);

// Backward from dout [N,C]: dinp [N,C] += (or = when !accumulate_dinp) the input gradient,
// dweight [C] += and dbias [C] += (dbias may be nullptr). `inp` is the tensor that was
// normalised (residual_out when the forward was fused). Adding into dinp is the fused residual
// backward: pass the residual stream's gradient buffer. `scratch` holds
// norm_backward_scratch_bytes(N, C) bytes of device memory; the parameter gradients are summed
// in a fixed order through it, so results are bitwise reproducible.
// dinp_colsum (f32 [C], optional): += the column sums over the N rows of dinp as stored by
// this call (after the accumulate, the values rounded to T), computed in the same pass and
// summed in the same fixed order. In a transformer it is the bias gradient of the linear layers
// that write into the residual stream whose gradient dinp is.
// Kernels: rows of up to 768 bf16 / 384 f32 columns take the staged kernel (one warp per row,
// the warp's next rows copied into shared memory with cp.async while it computes one, 16 warps
// per SM); longer rows the row-group kernel (one row per group of 1-8 warps, shuffle reductions,
// no block barriers per row). PRIMUS_TURBO_NORM_BWD_KERNEL=rowgroup forces the row-group kernel,
// =legacy the previous block-synchronised one (not for calls with a dinp_colsum, which take the
// default); PRIMUS_TURBO_NORM_BWD_STAGES=2..4 sets the staged kernel's rows per warp (default 3).
// For A/B timing.
void norm_backward(NormKind kind, DType dtype, void* dinp, float* dweight, float* dbias,
                   const void* dout, const void* inp, const void* weight, const float* mean,
                   const float* rstd, int64_t N, int64_t C, bool accumulate_dinp, void* scratch,
                   cudaStream_t stream, float* dinp_colsum = nullptr);
size_t norm_backward_scratch_bytes(int64_t N, int64_t C);

// Empty when the launchers above can serve (dtype, C); otherwise the reason.
const char* norm_unsupported_reason(DType dtype, int64_t C);

}  // namespace primus::turbo::cuda
