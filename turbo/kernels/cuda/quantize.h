// Launcher of the per-tensor FP8 quantisation with current scaling (quantize.cu). The recipe,
// and what a non-finite input gives, are those of the CPU reference, turbo/kernels/cpu/quantize.h;
// the results agree with it bit for bit (bytes and scale_inv).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "turbo/core/dtype.h"
#include "turbo/core/fp8_granularity.h"

namespace primus::turbo::cuda {

// Bytes of device scratch quantize_fp8_tensorwise needs (the per-block amax partials, at most
// 1024 of them): 4 KiB whatever the shape.
size_t quantize_fp8_scratch_bytes();

// inp [R, C] (f32 | bf16) with rows ld >= C elements apart; out [R, C] and/or out_t [C, R] of
// `fp8` (f8e4m3 | f8e5m2), contiguous row-major, either may be null (not both); scale_inv: one
// device f32, written; scratch: quantize_fp8_scratch_bytes() of device memory, 4-byte aligned,
// not read before it is written (nothing needs zeroing).
// Two launches on `stream`, no atomics, no allocation, no host synchronisation: deterministic and
// graph-capturable. Fast path (16-byte loads and stores, 128 x 128 tiles transposed through shared
// memory): inp 16-byte aligned with ld * sizeof(T) a multiple of 16, C a multiple of 16, outputs
// 16-byte aligned, and R a multiple of 16 when out_t is written; any other shape or alignment runs
// a plain element-wise kernel (correct, slower).
//
// Delayed scaling (cpu::quantize_fp8_with_scale): with scale_in (one device f32, positive and
// finite) the tensor is quantized with that scale in one launch (no amax launch, scratch unused)
// and each inf / NaN element becomes the poison byte. amax_out (one device f32, >= 0), when set,
// gets max |x| folded in with atomicMax on its bits (order-free: deterministic), under either
// scaling. amax_in (one device f32, current scaling): max |x| as the op that wrote inp took it
// (turbo::QuantizeFp8Args::maxima): no amax launch, one read of inp; the scale as from its own.
// rows_in_use (one device int32, not with amax_in): the amax is taken over rows
// [0, min(R, max(0, *rows_in_use))) only (turbo::QuantizeFp8Args::rows_in_use); all R rows are
// quantized with the scale. With scale_in the quantizing launch folds only those rows into
// amax_out (still one read of inp).
void quantize_fp8_tensorwise(DType in_dtype, DType fp8, const void* inp, int64_t R, int64_t C, int64_t ld,
                             void* out, void* out_t, float* scale_inv, void* scratch, cudaStream_t stream,
                             const float* scale_in = nullptr, float* amax_out = nullptr, const float* amax_in = nullptr,
                             const int32_t* rows_in_use = nullptr);

// Delayed scaling's bookkeeping for T tensors (cpu::fp8_delayed_update, same results bit for bit):
// history [T, len], scale [T], fp8_max [T], device f32; use_max: the largest entry, else the
// newest. One launch, graph-capturable. len at most kMaxDelayedHistory.
inline constexpr int64_t kMaxDelayedHistory = 8192;
void fp8_delayed_update(float* history, float* scale, const float* fp8_max, int64_t T, int64_t len, bool use_max,
                        int margin, cudaStream_t stream);

// Per-group scaling (Row, Block1x128, Block128x128; turbo/core/fp8_granularity.h), the CPU
// reference's cpu::quantize_fp8_grouped bit for bit: out [R, C] with scale_inv, out_t [C, R] (the
// quantisation of inp^T) with scale_inv_t, either pair may be null (not both). Needs R and C
// multiples of 16 (128 for the blocks), 16-byte aligned input rows and outputs; throws
// primus::RuntimeError otherwise. scratch: quantize_fp8_grouped_scratch_bytes of device memory
// (Row: the column and row maxima, then their scales). Block granularities: one launch; Row with
// out_t: the row-groups kernels with one group of R rows (a memset, the maxima launch, the scales
// launch, the quantizing launch); Row with out alone (no out_t; C a multiple of 16, any R): one
// launch that reads the input once (a warp per row), no scratch. Deterministic, graph-capturable,
// no allocation.
size_t quantize_fp8_grouped_scratch_bytes(int64_t R, int64_t C, Fp8Granularity g);
// maxima (Row with out_t; may be null): inp's row then column maxima as f32 [R + C] (the op that
// wrote inp took them, turbo::QuantizeFp8Args::maxima): copied into the scratch instead of the
// memset and the maxima launch, so the input is read once.
void quantize_fp8_grouped(DType in_dtype, DType fp8, const void* inp, int64_t R, int64_t C, int64_t ld,
                          Fp8Granularity g, void* out, float* scale_inv, void* out_t, float* scale_inv_t, void* scratch,
                          cudaStream_t stream, const float* maxima = nullptr);

// Row granularity with the rows of inp in G groups for out_t (cpu::quantize_fp8_row_groups_t bit
// for bit; with out, its per-row scaling as cpu::quantize_fp8_grouped at Row): out_t [C, R] gets
// fp8(x[r, c] * scale[g, c]) for r in group g, scale_inv_t [G, C] the inverses; out [R, C] (may
// be null) per-row scaled with scale_inv [R]. Groups: offsets (G + 1 device int32, read on the
// device only, so the call needs no host synchronisation and a captured graph replays with
// whatever plan the offsets hold then) or, when offsets is null, G equal groups of group_rows rows.
// Row r belongs to group #{k in 1..G : offsets[k] <= r} (G: no group, and its bytes of out_t are
// not written); for a valid array that is the group whose range holds r, and for any array it is
// a group in [0, G], so bad offsets give wrong bytes but never touch memory outside the tensors.
// Launches: a memset of the maxima, (1) per 128 x 128 tile the column maxima of each group's rows
// and the row maxima, folded with atomicMax on f32 bits (order-free), (2) maxima to scales (and
// scale_inv, scale_inv_t), (3) per 128 x 128 tile the quantisation, out_t transposed through shared
// memory. Deterministic, graph-capturable, no allocation. Fast path (16-byte loads and stores): R
// and C multiples of 16, inp rows and outputs 16-byte aligned; any other shape or alignment runs
// the same kernels element by element. scratch: quantize_fp8_row_groups_scratch_bytes (16-byte
// aligned), nothing needs zeroing. G and R below 2^31.
size_t quantize_fp8_row_groups_scratch_bytes(int64_t R, int64_t C, int64_t G, bool with_out);
void quantize_fp8_row_groups(DType in_dtype, DType fp8, const void* inp, int64_t R, int64_t C, int64_t ld,
                             const int32_t* offsets, int64_t group_rows, int64_t G, void* out, float* scale_inv,
                             void* out_t, float* scale_inv_t, void* scratch, cudaStream_t stream);

// Delayed per-tensor quantization of a SwiGLU output that no kernel wrote: the values are computed
// from gate_up [R, 2F] (and dout [R, F]) as they are read, each rounded to bf16 as the activation
// kernels (activation.cu) store it, then quantized as quantize_fp8_tensorwise does with scale_in:
//   forward  (backward = false): y = silu(gate) * up, [R, F]; dout unused
//   backward (backward = true):  dgate_up = [dgate | dup], [R, 2F], from dout = dL/dy
// out [R, C] and / or out_t [C, R] (C = F or 2F), scale_inv = 1 / *scale_in, max |value| folded into
// amax_out (when set) with atomicMax. The bytes equal activation_forward / activation_backward
// followed by quantize_fp8_tensorwise with the same scale, bit for bit. One launch,
// graph-capturable. Needs bf16 input, F a multiple of 16, R of 16 when out_t is written, 16-byte
// aligned bases (quantize_fp8_swiglu_unsupported_reason says which a call misses; never throws).
std::string quantize_fp8_swiglu_unsupported_reason(DType in_dtype, DType fp8, const void* gate_up, const void* dout,
                                                   int64_t R, int64_t F, const void* out, const void* out_t) noexcept;
void quantize_fp8_swiglu(bool backward, DType in_dtype, DType fp8, const void* gate_up, const void* dout, int64_t R,
                         int64_t F, void* out, void* out_t, const float* scale_in, float* scale_inv, float* amax_out,
                         cudaStream_t stream);

}  // namespace primus::turbo::cuda
