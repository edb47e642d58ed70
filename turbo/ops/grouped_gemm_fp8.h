// FP8 grouped GEMM: the expert products of a mixture-of-experts layer (turbo/ops/grouped_gemm.h)
// with FP8 operands and rowwise scales (torchao's rowwise recipe for MoE training: one scale per
// row of each operand along the reduction dimension; the weight gradient's token operands get one
// scale per feature and per group, as the tokens of one expert are reduced together).
//
//   grouped_gemm_fp8_forward  out  [M,N] rows of g = (sx ⊙ q(x))_g @ (sw ⊙ q(W_g))^T
//                             x [M,K] per-row scales [M]; W [G,N,K] per-(g,n) scales [G,N]
//   grouped_gemm_fp8_dgrad    dinp [M,K] rows of g = (sd ⊙ q(dout))_g @ W_g, with W_g read from its
//                             transposed copy w_t [K][G*N] (columns g*N.. are W_g^T) and scales
//                             [G,K] (per input feature of each expert)
//   grouped_gemm_fp8_wgrad    dweight[g] [N,K] (=, or += when accumulate) = dout_g^T @ x_g, from the
//                             transposed copies dout_t [N][M] and x_t [K][M] and their per-group
//                             scales [G,N] and [G,K]; on the device the offsets must be multiples
//                             of 16 (`align`)
//
// q(.) are the FP8 bytes and the scales the scale_inv that turbo::quantize_fp8 writes: Row
// granularity for x and dout ([M]), and its row groups (offsets, or group_rows = N for the weight
// viewed as [G*N, K]) for the transposed copies.
//
// granularity Block (DeepSeek-V3's blockwise recipe, layouts of turbo/core/fp8_granularity.h): the
// token operands in 1x128 tiles along the reduction dimension, the weight in 128 x 128 blocks:
//   forward  inp_scale [K/128, M] (Block1x128 of x); weight_scale [G*N/128, pad4(K/128)]
//            (Block128x128 of W viewed as [G*N, K])
//   dgrad    dout_scale [N/128, M]; weight_t_scale [K/128, pad4(G*N/128)] (the copy's blocks:
//            quantize_fp8's out_t of W viewed as [G*N, K] at Block128x128)
//   wgrad    dout_t_scale [M/128, N], inp_t_scale [M/128, K] (quantize_fp8's out_t at Block1x128:
//            one scale per feature and 128 consecutive tokens); the offsets must be multiples of
//            128 (`align`), so that no 128-token block holds two experts' tokens
// N and K must be multiples of 128, and M for the weight gradient. Groups as in grouped_gemm.h: offsets [G+1] i32 on
// the tensors' device, read on the device by the TURBO backend (graph-capturable); rows from
// offsets[G] on are neither read into a written value nor written.
//
// dtypes: x, W and their copies E4M3; dout E4M3 or E5M2 (the hybrid recipe). On the device out and
// dinp are bf16, dweight f32; on the host (the reference: dequantize, then the f32 grouped GEMM)
// out, dinp and dweight are f32.
// Backends: TURBO (turbo/kernels/cuda/grouped_gemm_sm90.h's FP8 kernel: N and K multiples of 16,
// and M too for the weight gradient; blockwise, 128 and the weight gradient's align 128) and CPU. Dispatcher "grouped_gemm_fp8"
// (PRIMUS_TURBO_GROUPED_GEMM_FP8_BACKEND).
#pragma once
#include <cstdint>

#include "turbo/core/fp8_granularity.h"
#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"
#include "turbo/ops/grouped_gemm.h"

namespace primus::turbo {

class Fp8WeightCache;     // turbo/ops/gemm_fp8.h
class Fp8DelayedScaling;  // turbo/ops/fp8_delayed.h

// The scales of a call: Row (rowwise, the default) or Block (blockwise), as described above; and
// Tensor for the bf16-operand products below: one scale per operand tensor (Primus-Turbo's
// tensorwise grouped GEMM), which run as Row products whose scale vectors hold that one scale.
// The FP8-operand calls take Row or Block.
enum class GroupedFp8Scaling { Row, Block, Tensor };

struct GroupedGemmFp8ForwardArgs {
  TensorView out;           // [M,N]
  TensorView inp;           // [M,K] FP8
  TensorView inp_scale;     // [M] f32
  TensorView weight;        // [G,N,K] FP8
  TensorView weight_scale;  // [G,N] f32
  TensorView offsets;       // [G+1] i32
  ExecContext ctx;
  GroupedFp8Scaling scaling = GroupedFp8Scaling::Row;
};

struct GroupedGemmFp8DgradArgs {
  TensorView dinp;            // [M,K]
  TensorView dout;            // [M,N] FP8
  TensorView dout_scale;      // [M] f32
  TensorView weight_t;        // [K, G*N] FP8
  TensorView weight_t_scale;  // [G,K] f32
  TensorView offsets;         // [G+1] i32
  ExecContext ctx;
  GroupedFp8Scaling scaling = GroupedFp8Scaling::Row;
};

struct GroupedGemmFp8WgradArgs {
  TensorView dweight;       // [G,N,K] f32
  TensorView dout_t;        // [N,M] FP8
  TensorView dout_t_scale;  // [G,N] f32
  TensorView inp_t;         // [K,M] FP8
  TensorView inp_t_scale;   // [G,K] f32
  TensorView offsets;       // [G+1] i32
  // The caller's promise that every offset is a multiple of it; the TURBO backend needs 16 (its
  // token boxes start on 16-byte boundaries), the CPU backend any.
  int64_t align = 1;
  bool accumulate = false;
  ExecContext ctx;
  GroupedFp8Scaling scaling = GroupedFp8Scaling::Row;  // Block: align must be a multiple of 128
};

// Each validates its arguments (RuntimeError naming the op, the argument and what it got), runs on
// the dispatched backend and returns which one ran.
BackendType grouped_gemm_fp8_forward(const GroupedGemmFp8ForwardArgs& args);
BackendType grouped_gemm_fp8_dgrad(const GroupedGemmFp8DgradArgs& args);
BackendType grouped_gemm_fp8_wgrad(const GroupedGemmFp8WgradArgs& args);

// The products of grouped_gemm.h on its bf16 (host: f32) operands, in FP8 with current rowwise
// scaling: each operand is quantized (turbo::quantize_fp8, Row granularity; the transposed copies
// with the token groups of `offsets`, or of the experts for the weight) into ctx.scratch right
// before its GEMM, as turbo::linear_*_fp8 do for dense layers. x and W in `fwd`, dout in `grad`
// (E4M3 / E5M2 for the hybrid format). The weight gradient needs, on the device, M and align
// multiples of 16 (the forward and input gradient take any groups). grouped_gemm_fp8_scratch_bytes: the most one call (either scaling)
// borrows for M rows, G experts of [N, K].
// With scaling Block: blockwise scales (x and dout Block1x128, W Block128x128 in both layouts, the
// weight gradient's copies Block1x128 along the tokens), which needs M, N, K and the weight
// gradient's align multiples of 128.
// With scaling Tensor: current per-tensor scaling (turbo::quantize_fp8 at Tensor granularity): x,
// dout and all G experts' weights each take one scale from their own amax, the token operands'
// over the rows of the plan only (rows_in_use = offsets[G]: rows past it may hold anything, e.g.
// stale data of an earlier step, and must not set the scale); each product is then the Row
// product with that scale in every entry of its scale vectors (turbo::broadcast).
// delayed (scaling Tensor only): delayed scaling (Transformer Engine's DelayedScaling) with the
// histories `delayed` keeps for the expert weight (registered by its data pointer, as the linear
// layers' are): x, W and dout take their roles' scales instead of their own amax once a step has
// been recorded (Fp8DelayedScaling::use_history), and each quantization folds its amax (the token
// operands' over the plan's rows) into the role's history entry (record). Null: current scaling.
// weights: the step's FP8 weight copies (gradient accumulation: the experts' weights quantized
// once per optimizer step). When it is enabled and holds a slot for args.weight, the product reads
// the slot's copies instead of quantizing the weight: q [G*N*K] with its scales (rowwise and
// tensorwise [G*N], blockwise Block128x128 of [G*N, K]) and q_t, the [K][G*N] copy ([G, K];
// Block128x128 of [K, G*N]); the first call of a step that finds the slot not valid fills both
// (blockwise and tensorwise in one pass) and marks it valid. Null, disabled or without a slot: the weight is quantized here.
void grouped_gemm_forward_fp8(const GroupedGemmForwardArgs& args, DType fwd,
                              GroupedFp8Scaling scaling = GroupedFp8Scaling::Row, Fp8WeightCache* weights = nullptr,
                              const Fp8DelayedScaling* delayed = nullptr);
void grouped_gemm_dgrad_fp8(const GroupedGemmDgradArgs& args, DType fwd, DType grad,
                            GroupedFp8Scaling scaling = GroupedFp8Scaling::Row, Fp8WeightCache* weights = nullptr,
                            const Fp8DelayedScaling* delayed = nullptr);
// The scale counts of a weight [G, N, K]'s two copies under `scaling` (Fp8WeightCache's slots).
int64_t grouped_fp8_weight_scales(GroupedFp8Scaling scaling, int64_t G, int64_t N, int64_t K);
int64_t grouped_fp8_weight_t_scales(GroupedFp8Scaling scaling, int64_t G, int64_t N, int64_t K);
void grouped_gemm_wgrad_fp8(const GroupedGemmWgradArgs& args, DType fwd, DType grad,
                            GroupedFp8Scaling scaling = GroupedFp8Scaling::Row, const Fp8DelayedScaling* delayed = nullptr);
size_t grouped_gemm_fp8_scratch_bytes(int64_t M, int64_t G, int64_t N, int64_t K);

}  // namespace primus::turbo
