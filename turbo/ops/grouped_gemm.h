// Grouped GEMM: the expert products of a mixture-of-experts layer, one dense product per expert
// over that expert's rows of a permuted token buffer (turbo/ops/moe.h writes the buffer and its
// group offsets).
//
//   grouped_gemm_forward  out  [M,N] rows of group g = inp  [m_g,K] @ weight[g]^T   (overwrites)
//   grouped_gemm_dgrad    dinp [M,K] rows of group g = dout [m_g,N] @ weight[g]     (overwrites)
//   grouped_gemm_wgrad    dweight[g] [N,K] = dout_g^T @ inp_g   (+= when accumulate, else =: the first
//                         micro-batch writes, and a group without rows then gets zeros)
//
// weight [G,N,K]: nn.Linear per expert (expert g maps K input features to N outputs). offsets
// [G+1] i32 on the tensors' device: group g owns rows [offsets[g], offsets[g+1]); offsets[0] = 0,
// non-decreasing, offsets[G] <= M. M is only the buffers' bound (size them for the worst routing,
// moe_permuted_rows_max): rows from offsets[G] on are neither read nor written. On the device the
// offsets are never read by the host on the TURBO path, so a step can be captured as one CUDA graph.
// `align` is the caller's promise that every offset is a multiple of it (the MoE row plan pads
// each group to it); it is part of the dispatch key.
//
// dtypes: on the device inp, weight, dout, out, dinp bf16 and dweight f32 (fp32 accumulation), or
// dweight bf16 when it is written, not accumulated (the f32 sums rounded once, as
// torch._grouped_mm's bf16 output: a trainer whose optimizer reads bf16 gradients); on the host
// everything f32. All tensors contiguous (row-major).
//
// SwiGLU fused into the products of an expert MLP (its gate|up projection, then act = silu(gate) * up,
// then the down projection), as turbo/ops/activation.h's SwiGLU with F = the act's width:
//   grouped_gemm_forward with swiglu_out [M,F]: weight [G,2F,K] (gate rows, then up rows); out
//     [M,2F] = gate|up as without it, and swiglu_out = SwiGLU(out), rows of the groups only.
//   grouped_gemm_dgrad with swiglu_inp [M,2F] (the forward's gate|up): weight [G,N,F], and
//     dout [M,N] @ W[g] is act's gradient; dinp [M,2F] receives d(gate)|d(up) (overwritten),
//     rows of the groups only.
// The results are those of the product followed by activation_forward / activation_backward
// (the product rounded to bf16 first), bit for bit on TURBO; TURBO writes no dact or reread
// gate|up (F a multiple of 128, the ping-pong schedule), CPU composes the two on the host, CUBLASLT
// declines (dispatch then names every backend's reason).
//
// Backends:
//   TURBO     Turbo's Hopper kernel (turbo/kernels/cuda/grouped_gemm_sm90.h): persistent, tiles
//             scheduled across groups from the device offsets; graph-capturable. Takes any align >= 1
//             (tiles crossing a group's end are masked); needs sm_90, N and K multiples of 8.
//             Its tile count is sum_g ceil(m_g/128) row tiles (forward, dgrad) and ceil(m_g/64)
//             k-tiles (wgrad) for every align dividing 64, so padding beyond 64 only adds rows; at
//             multiples of 64 the weight gradient also skips cutting each group's last k-tile in
//             shared memory, and group starts fall on whole tiles' rows. The fastest alignment is
//             kGroupedGemmAlign = 64: olmoe's fc under the router's counts ran 1-6% slower per
//             product at align 16 than at 64, with 2% fewer rows (H200, 2026-12-01,
//             bench/results/grouped_gemm.jsonl, "router0_align16").
//   CUBLASLT  one cuBLASLt product per group. It copies the offsets to the host and waits for them,
//             so it is NOT graph-capturable: its can_handle refuses while the call's stream is being
//             captured. Any align >= 1. (cuBLASLt 13.1 declares no grouped matmul; cuBLAS's
//             cublasGemmGroupedBatchedEx takes the group sizes in host arrays, so it would not spare
//             the host read either.)
//   CPU       the reference (turbo/kernels/cpu/grouped_gemm.h), host f32 tensors, any align >= 1.
// Chosen per call by the dispatcher ("grouped_gemm": PRIMUS_TURBO_GROUPED_GEMM_BACKEND,
// set_backend); not autotuned (the weight gradient may accumulate in place).
#pragma once
#include <cstdint>
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

// The group alignment at which the TURBO kernel is fastest (see above): what MoE layers pad to.
inline constexpr int64_t kGroupedGemmAlign = 64;

struct GroupedGemmForwardArgs {
  TensorView out;      // [M,N]
  TensorView inp;      // [M,K]
  TensorView weight;   // [G,N,K]
  TensorView offsets;  // [G+1] i32
  int64_t align = 1;
  ExecContext ctx;
  TensorView swiglu_out{};  // optional [M,N/2]: SwiGLU(out) (see above)
};

struct GroupedGemmDgradArgs {
  TensorView dinp;     // [M,K], or [M,2K] with swiglu_inp
  TensorView dout;     // [M,N]
  TensorView weight;   // [G,N,K]
  TensorView offsets;  // [G+1] i32
  int64_t align = 1;
  ExecContext ctx;
  TensorView swiglu_inp{};  // optional [M,2K]: the forward's gate|up; dinp gets its gradient (see above)
};

struct GroupedGemmWgradArgs {
  TensorView dweight;  // [G,N,K] f32
  TensorView dout;     // [M,N]
  TensorView inp;      // [M,K]
  TensorView offsets;  // [G+1] i32
  int64_t align = 1;
  bool accumulate = false;
  ExecContext ctx;
  // The weight [G,N,K] whose gradient this is (optional; no product reads it): FP8 delayed scaling
  // finds the weight's amax histories by it (turbo/ops/grouped_gemm_fp8.h).
  TensorView weight{};
};

// Whether a SwiGLU call (swiglu_out / swiglu_inp) of act width F on `device` finds a backend: the
// host always (CPU composes), the device when the TURBO kernel runs there (sm_90, F a multiple of
// 128) and the user has not picked another grouped_gemm backend. For callers that choose between
// the fused call and the product then the activation.
bool grouped_gemm_swiglu_available(Device device, int64_t F);

// Each validates its arguments (RuntimeError naming the op, the argument and what it got), runs on
// the dispatched backend and returns which one ran.
BackendType grouped_gemm_forward(const GroupedGemmForwardArgs& args);
BackendType grouped_gemm_dgrad(const GroupedGemmDgradArgs& args);
BackendType grouped_gemm_wgrad(const GroupedGemmWgradArgs& args);

}  // namespace primus::turbo
