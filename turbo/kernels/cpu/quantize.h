// Per-tensor ("tensorwise") FP8 quantisation with current scaling, the recipe of Transformer
// Engine's current scaling and torchao's tensorwise float8:
//   amax      = max |x| over the whole tensor
//   scale     = fp8_max / amax   (448 e4m3, 57344 e5m2); 1 when amax == 0; FLT_MAX when the
//               quotient overflows (amax below fp8_max / FLT_MAX, i.e. f32 subnormals)
//   q         = fp8(x * scale), the product rounded to f32, then to the FP8 format to nearest
//               even with saturation to +-fp8_max (dtype.h's float_to_f8*_bits)
//   scale_inv = 1 / scale        (what an FP8 GEMM multiplies its product by)
// Non-finite input: amax is then inf or NaN (a NaN wins over inf), and the result is made to
// look non-finite instead of silently finite: scale and scale_inv are NaN (0x7fc00000) and every
// output byte is 0x7f, a NaN in both e4m3 and e5m2.
//
// This is the reference of the TURBO kernels (turbo/kernels/cuda/quantize.cu): they compute the
// same f32 operations in the same order, so the bytes and scale_inv agree bit for bit.
#pragma once
#include <cstdint>

#include "turbo/core/dtype.h"
#include "turbo/core/fp8_granularity.h"

namespace primus::turbo::cpu {

// The largest finite value of an FP8 dtype (f8e4m3: 448, f8e5m2: 57344); 0 for other dtypes.
float fp8_max(DType fp8);

// The byte every output element gets when amax is not finite: a NaN in e4m3 and in e5m2.
inline constexpr uint8_t kFp8PoisonByte = 0x7f;

struct Fp8Scaling {
  float amax = 0.0f;       // max |x| (inf / NaN when the tensor holds one)
  float scale = 1.0f;      // what x is multiplied by before rounding to FP8
  float scale_inv = 1.0f;  // 1 / scale
  bool finite() const;     // amax is finite: the outputs are real quantised values
};

// The scaling of a tensor whose max |x| is `amax` (see the top of this file).
Fp8Scaling fp8_tensorwise_scaling(float amax, DType fp8);

// The f32 bit pattern of max |x| over inp [R, C] (f32, or bf16 as raw uint16_t bits) with rows
// `ld` elements apart (ld >= C). Compared as integers: |x|'s bits order like its values, and a
// NaN's bits are above inf's, so a NaN anywhere wins and the result does not depend on the order.
uint32_t absmax_bits(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld);

// Quantises inp [R, C] (f32 or bf16; row pitch ld >= C elements) to `fp8` (f8e4m3 | f8e5m2):
// out [R, C] and/or out_t [C, R] (the transpose), both contiguous row-major; either may be null.
// Returns the scaling (its scale_inv is what the op writes out). Throws primus::RuntimeError for
// an input dtype other than f32/bf16 or a non-FP8 `fp8`. amax_rows in [0, R] (-1: R): the amax
// over the first amax_rows rows only (turbo::QuantizeFp8Args::rows_in_use); every row is
// quantized with that scale (a finite scale: each element as above, a NaN byte for a NaN).
Fp8Scaling quantize_fp8_tensorwise(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld,
                                   uint8_t* out, uint8_t* out_t, DType fp8, int64_t amax_rows = -1);

// Per-group current scaling at granularity g (turbo/core/fp8_granularity.h): each group's scale
// is fp8_tensorwise_scaling of that group's amax, the elements as in quantize_fp8_tensorwise.
// out [R, C] with its scales scale_inv (fp8_scale_shape(g, R, C)); out_t [C, R], the
// quantisation of inp^T at g (groups along out_t's rows), with scale_inv_t
// (fp8_scale_shape(g, C, R)). Either pair may be null (not both); at Tensor granularity
// scale_inv_t may be null (one scale for both). Padding entries of a scale tensor are set to 1.
// Throws primus::RuntimeError for a wrong dtype or, at the block granularities, R or C not a
// multiple of 128.
void quantize_fp8_grouped(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld, Fp8Granularity g,
                          uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t, DType fp8);

// Row granularity's transposed output with the rows of inp cut into G groups of consecutive rows
// (MoE: the tokens of each expert, so that a column of out_t, a K-row of a weight-gradient GEMM's
// operand, never shares a scale across experts): group g is rows [offsets[g], offsets[g + 1]),
// rows from offsets[G] on belong to none. Element (c, r) of out_t [C, R], r in group g, is
// fp8(x[r, c] * scale[g, c]) with the scaling (fp8_tensorwise_scaling) of max |x| over column c of
// group g's rows; scale_inv_t [G, C] gets its scale_inv: 1 for a group with no rows, NaN for a
// segment holding an inf or NaN (whose bytes are then all kFp8PoisonByte). Columns of out_t at rows
// of no group are left as they were. offsets: G + 1 host int32 entries, checked as
// check_row_groups does (the error names this function). Throws primus::RuntimeError for a wrong
// dtype too.
void quantize_fp8_row_groups_t(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld,
                               const int32_t* offsets, int64_t G, uint8_t* out_t, float* scale_inv_t, DType fp8);

// Throws primus::RuntimeError naming `op` and the first bad entry unless offsets [G + 1] starts at
// 0, never decreases and ends at most at R (a broken array must not reach rows past the tensor);
// rows_name is what the message calls R (the grouped GEMMs' M).
void check_row_groups(const int32_t* offsets, int64_t G, int64_t R, const char* op, const char* rows_name = "R");

// Delayed scaling (Transformer Engine's DelayedScaling): the tensor is quantised with a scale
// that earlier steps' amax history gave (`scale`, positive and finite), not one of its own:
//   q = fp8(x * scale) as above, saturating, for a finite x; an inf or NaN element becomes the
//       poison byte (only that element: the scale is not the tensor's own, so nothing else is
//       known to be wrong)
// Returns max |x|'s f32 bits over inp (as absmax_bits: a NaN above inf above any finite value),
// which the caller folds into the tensor's amax history; over the first amax_rows rows only when
// amax_rows is in [0, R] (-1: all). out / out_t as in quantize_fp8_tensorwise.
uint32_t quantize_fp8_with_scale(const void* inp, DType in_dtype, int64_t R, int64_t C, int64_t ld, float scale,
                                 uint8_t* out, uint8_t* out_t, DType fp8, int64_t amax_rows = -1);

// One step of delayed scaling's bookkeeping, for T tensors with histories of `len` entries each:
// history [T, len] (row t: tensor t's amaxes, entry 0 the one being recorded this step),
// scale [T], fp8_max [T] (the largest value of each tensor's FP8 format). For each t:
//   1. entry 0 that is not finite (a step with an inf or NaN, which training skips) becomes 0;
//   2. amax = the largest entry (use_max) or entry 0 (the newest);
//   3. amax > 0: scale = fp8_max / amax (FLT_MAX when that overflows), divided by 2^margin;
//      amax == 0 (nothing recorded yet): the scale is kept;
//   4. the history moves one entry along (entry i takes entry i - 1, the oldest drops out) and
//      entry 0 becomes 0, ready for the next step's amax.
void fp8_delayed_update(float* history, float* scale, const float* fp8_max, int64_t T, int64_t len, bool use_max,
                        int margin);

}  // namespace primus::turbo::cpu
