// Turbo's Hopper grouped GEMM (the TURBO backend of turbo/ops/grouped_gemm.h; kernel in
// grouped_gemm_sm90.cu), the expert products of a mixture-of-experts layer:
//
//   Forward  out  [M,N] rows of group g = inp  [m_g,K] @ weight[g]^T     (bf16 out)
//   Dgrad    dinp [M,K] rows of group g = dout [m_g,N] @ weight[g]       (bf16 out)
//   Wgrad    dweight[g] [N,K] (=, or += when accumulate) = dout_g^T @ inp_g   (f32 out)
//
// weight [G,N,K] bf16 (nn.Linear per expert), token matrices row-major bf16, fp32 accumulation.
// Groups come from offsets [G+1] int32 in device memory (rows [offsets[g], offsets[g+1]) are group
// g's; offsets[0] = 0, non-decreasing, offsets[G] <= M): the kernel reads them itself, so a launch
// needs no host synchronisation and can be captured in a CUDA graph. Rows from offsets[G] on are
// neither read into any written value nor written. Any group sizes work (no alignment needed):
// tiles that cross a group's end are masked in the epilogue (forward, dgrad), and the weight
// gradient's last k-tile of a group is cut at the group's end in shared memory. The cost is set by
// sum_g ceil(m_g / 128) tiles (forward, dgrad) and ceil(m_g / 64) k-tiles (wgrad); groups padded to
// a multiple of 64 rows also skip the wgrad's cut (see turbo/ops/grouped_gemm.h for the alignment
// the model uses).
//
// Needs compute capability 9.0 (sm_90a code), 16-byte aligned bases and N, K multiples of 8 (TMA's
// 16-byte row strides), G >= 1. grouped_gemm_sm90_unsupported_reason says which a call misses.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace primus::turbo::cuda {

enum class GroupedGemmKind { Forward = 0, Dgrad = 1, Wgrad = 2 };

// SwiGLU fused into the epilogue of an MoE expert MLP's two bf16 products (the ping-pong schedule):
//   SwiGLU forward, kind Forward: weight [G, 2F, K] (gate rows, then up rows), d = gate|up [M, 2F]
//     as the plain product writes it, and aux = act [M, F] = silu(gate) * up, as the activation
//     kernel would compute it from d (turbo/ops/activation.h).
//   SwiGLU backward, kind Dgrad: weight [G, N, F], dout [M, N]; the product dact = dout @ W[g] is
//     the gradient of act, aux = the forward's gate|up [M, 2F] (read), and d [M, 2F] receives
//     d(gate)|d(up) instead of dact.
// Both round each value as the unfused path does (the product to bf16, then the activation's
// arithmetic on bf16 inputs), so the results are the unfused ones bit for bit. F must be a multiple
// of 128 (whole 128-column tiles of act and dact, 16-byte rows). They run the ping-pong schedule
// whatever PRIMUS_TURBO_GROUPED_GEMM_SCHEDULE says (the epilogue is built for its 128 x 128 tiles).
enum class GroupedGemmGlu { None = 0, SwiGLU = 1 };

struct GroupedGemmSm90Problem {
  GroupedGemmKind kind = GroupedGemmKind::Forward;
  int64_t groups = 0;  // G
  int64_t rows = 0;    // M, the token buffers' rows (a bound: the offsets say which are used)
  int64_t n = 0, k = 0;  // the weight's [N, K] per group
  const int32_t* offsets = nullptr;  // device [G+1]
  const void* a = nullptr;  // Forward: inp [M,K]; Dgrad and Wgrad: dout [M,N]
  const void* b = nullptr;  // Forward and Dgrad: weight [G,N,K]; Wgrad: inp [M,K]
  void* d = nullptr;        // Forward: out [M,N]; Dgrad: dinp [M,K]; Wgrad: dweight [G,N,K] f32
  bool accumulate = false;  // Wgrad: dweight += (else =)
  // Wgrad: dweight in bf16 (the f32 accumulators rounded once, as torch._grouped_mm's bf16 output);
  // written, never accumulated (a bf16 running sum would round every addition).
  bool d_bf16 = false;
  GroupedGemmGlu glu = GroupedGemmGlu::None;  // Forward, Dgrad: the SwiGLU epilogue above
  void* aux = nullptr;                        // with glu: act [M, F] (Forward) or gate|up [M, 2F] (Dgrad)
};

// Whether the current device runs this kernel (sm_90 and the driver's TMA encoder). Never throws.
bool grouped_gemm_sm90_device_ok() noexcept;

// Empty when grouped_gemm_sm90 can run `p` on the current device, else the reason. Never throws.
std::string grouped_gemm_sm90_unsupported_reason(const GroupedGemmSm90Problem& p) noexcept;

// Enqueues the products on `stream`. Throws primus::RuntimeError when the problem is unsupported
// (with the reason above) or a CUDA call fails.
void grouped_gemm_sm90(const GroupedGemmSm90Problem& p, cudaStream_t stream);

// The same kernel on FP8 operands with rowwise scales (the TURBO backend of
// turbo/ops/grouped_gemm_fp8.h): FP8 wgmma reads both operands K-major, so each product takes the
// layout that makes its reduction dimension contiguous, and the f32 accumulators are multiplied by
// the scales of their row and column before the same epilogues:
//   Forward  a = q(inp) [M,K], scale_a [M];          b = q(W) [G,N,K], scale_b [G,N];  d [M,N] bf16
//   Dgrad    a = q(dout) [M,N], scale_a [M];         b = q(W)^T stored [K][G*N] (group g's
//            W_g^T is columns g*N..), scale_b [G,K];                                 d [M,K] bf16
//   Wgrad    a = q(dout)^T [N][M], scale_a [G,N];    b = q(inp)^T [K][M], scale_b [G,K] (the
//            scales of group g's tokens);                                              d [G,N,K] f32
// k-tiles are 128 elements. Forward and Dgrad take any group sizes. The weight gradient reads each
// group's tokens as the innermost dimension, where TMA starts a box only on a 16-byte boundary: its
// offsets must be multiples of 16 (the caller's promise, like grouped_gemm's align; the MoE row
// plan pads groups to 64), and it cuts a group's last k-tile at the group's end in shared memory.
// Needs N, K multiples of 16, and M too for Wgrad (TMA's 16-byte row strides), scale_a 4-byte and
// scale_b 8-byte aligned (blockwise: both 16), A in E4M3 or E5M2 and B in E4M3.
struct GroupedGemmFp8Sm90Problem {
  GroupedGemmKind kind = GroupedGemmKind::Forward;
  int64_t groups = 0, rows = 0, n = 0, k = 0;  // as GroupedGemmSm90Problem
  const int32_t* offsets = nullptr;            // device [G+1]
  const void* a = nullptr;
  const float* scale_a = nullptr;
  const void* b = nullptr;
  const float* scale_b = nullptr;
  void* d = nullptr;
  bool a_e5m2 = false;  // A is E5M2 (the hybrid recipe's gradients), else E4M3
  bool accumulate = false;
  // Blockwise scales (DeepSeek-V3's recipe; turbo/core/fp8_granularity.h's layouts) instead of the
  // rowwise ones above, each 128-element k-tile's partial product scaled on its own:
  //   Forward  scale_a [K/128][M] (1x128 tiles of inp's rows); scale_b of W as [G*N, K] in
  //            128 x 128 blocks, [G*N/128][pad4(K/128)]
  //   Dgrad    scale_a [N/128][M]; scale_b of the copy [K][G*N] in 128 x 128 blocks,
  //            [K/128][pad4(G*N/128)]
  //   Wgrad    scale_a [M/128][N], scale_b [M/128][K] (the copies' 1x128 tiles along the tokens);
  //            offsets must be multiples of 128 (a k-tile never spans two groups' tokens)
  // N and K must be multiples of 128, M too for Wgrad. The schedule is the cooperative one with
  // 128 x 128 tiles (a k-tile's partial product and the accumulators both live in registers).
  bool blockwise = false;
};
std::string grouped_gemm_fp8_sm90_unsupported_reason(const GroupedGemmFp8Sm90Problem& p) noexcept;
void grouped_gemm_fp8_sm90(const GroupedGemmFp8Sm90Problem& p, cudaStream_t stream);

}  // namespace primus::turbo::cuda
