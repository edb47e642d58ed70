// Turbo's own Hopper GEMM (the TURBO backend of turbo::gemm; kernel in gemm_sm90.cu):
//
//   D[m,n] = alpha * A[m,k] @ B[k,n] + beta * D (+ bias[n])      fp32 accumulation
//
// then the epilogue (GemmSm90Epilogue): none, GeluAux (aux = that value, D = gelu_tanh(aux)) or
// DGelu (D = that value * gelu_tanh'(aux), aux read; no bias); the GELU epilogues need a 16-bit D.
// GELU uses the hardware tanh (relative error ~2^-11), below the 16-bit outputs' rounding. Each
// epilogue is its own kernel instantiation (no run-time branching on it inside the kernel).
//
// A and B are bf16 or f16 (the same type), each stored row-major with a leading dimension `ld`
// (elements between stored rows); `transposed` says the logical operand is the transpose of what
// is stored, exactly as in turbo/ops/gemm_problem.h. So A may be K-major (stored [m][k]) or
// M-major (stored [k][m]), B N-major (stored [k][n]) or K-major (stored [n][k]): the forward,
// input-gradient and weight-gradient products of a linear layer are all served. D is row-major,
// of the input type or f32, with any leading dimension; bias (optional) has D's dtype.
//
// Needs a compute capability 9.0 device (the code is sm_90a: wgmma, TMA), 16-byte aligned A/B
// base pointers and leading dimensions that are multiples of 8 elements (TMA's 16-byte rule), one
// matrix (no batch) and k >= 1. gemm_sm90_unsupported_reason says which of these a call misses.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

struct GemmSm90Operand {
  const void* ptr = nullptr;
  int64_t ld = 0;           // elements between stored rows
  bool transposed = false;  // logical = stored^T
};

enum class GemmSm90Epilogue { None = 0, GeluAux = 1, DGelu = 2 };
struct GemmSm90Problem {
  int64_t m = 0, n = 0, k = 0;
  DType in_dtype = DType::BF16;  // of A and B
  GemmSm90Operand a, b;
  void* d = nullptr;
  int64_t ldd = 0;
  DType d_dtype = DType::BF16;
  float alpha = 1.0f, beta = 0.0f;  // beta == 0: D is never read (it may hold NaN)
  const void* bias = nullptr;       // [n], dtype d_dtype; nullptr: no bias
  GemmSm90Epilogue epilogue = GemmSm90Epilogue::None;
  void* aux = nullptr;  // [m] rows of n, ld_aux apart, dtype d_dtype: GeluAux writes it, DGelu reads it
  int64_t ld_aux = 0;
};

// Empty when gemm_sm90 can run `p` on the current device, else the reason. Never throws.
std::string gemm_sm90_unsupported_reason(const GemmSm90Problem& p) noexcept;

// Schedules of the persistent (splits == 1) kernel:
//   Coop      both consumer warpgroups share one 128 x bn tile (64 rows each) and write it out
//             together, while the tensor cores wait (the epilogue is not overlapped)
//   Pingpong  each consumer warpgroup owns a whole 128 x 128 tile; the two alternate, so one
//             warpgroup's epilogue runs under the other's MMAs (CUTLASS's sm90 "pingpong")
// Split-k plans (splits > 1) always run the cooperative kernel. The schedule comes from
// gemm_sm90_force_schedule if set, else from PRIMUS_TURBO_GEMM_SCHEDULE=coop|pingpong (read once
// per process), else the default (Coop until Pingpong has been measured on a GPU).
enum class GemmSm90Schedule { Auto = 0, Coop = 1, Pingpong = 2 };
GemmSm90Schedule gemm_sm90_schedule();  // the one in effect (never Auto)
const char* gemm_sm90_schedule_name(GemmSm90Schedule s) noexcept;

// How a problem is run (chosen per call from its shape and the device):
//   bn        tile width, 128, 160 or 256 (the tile is 128 x bn, k in steps of 64; 160 only with the
//             linear / bias epilogues, e.g. GPT-2's 3072 x 768 weight gradients: 120 tiles, one wave)
//   splits    1: persistent CTAs walk the tiles; s > 1: each tile's k range is split over a cluster
//             of s CTAs whose fp32 partial tiles are summed through distributed shared memory in a
//             fixed order (deterministic), for shapes with too few tiles to fill the GPU
//   grid      CTAs launched
//   pingpong  the ping-pong kernel (splits 1, bn 128) rather than the cooperative one
//   streamk   stream-K (cooperative kernel, bn 256, splits 1, no clusters; gemm_sm90_streamk.h):
//             whole tiles while at least two waves remain, then every CTA the same share of the
//             remaining tiles' k-iterations; a tile shared by several CTAs is summed by its first
//             one from the others' fp32 partials in a global workspace (fixed order: deterministic)
struct GemmSm90Plan {
  int bn = 0, splits = 0, grid = 0, stages = 0;
  bool pingpong = false;
  bool streamk = false;
};
GemmSm90Plan gemm_sm90_plan(const GemmSm90Problem& p);

// gemm_sm90_plan's choice as a function of the shape and the device, for tests without a GPU:
// `sms` multiprocessors, cluster_slots(bn, s) clusters of s CTAs that fit at once (0: none).
// Stream-K is a candidate when forced or when `streamk` is set (PRIMUS_TURBO_GEMM_STREAMK=1, read
// on every call: off by default until measured on a GPU), and is then taken only where the cost
// model puts it 3% or more below the best other plan.
struct GemmSm90PlanQuery {
  int64_t m = 0, n = 0, k = 0;
  int sms = 0;
  bool pingpong = false;  // the ping-pong schedule is in effect
  bool streamk = false;   // stream-K may be chosen
  bool bn160 = false;     // the 160-wide tile may be chosen (linear / bias epilogues: its only kernels)
  int force_bn = 0, force_splits = 0;  // as gemm_sm90_force_plan (0: automatic)
};
using GemmSm90ClusterSlots = int (*)(int bn, int splits);
GemmSm90Plan gemm_sm90_choose_plan(const GemmSm90PlanQuery& q, GemmSm90ClusterSlots cluster_slots);

// Enqueues the GEMM on `stream`. Throws primus::RuntimeError when the problem is unsupported
// (with gemm_sm90_unsupported_reason's text) or a CUDA call fails.
void gemm_sm90(const GemmSm90Problem& p, cudaStream_t stream);

// Tests and experiments: force the tile width (128 / 160 / 256) and the split count (1..8, or
// kGemmSm90StreamK: the stream-K plan, bn 0 or 256) of every following call; 0 restores the
// automatic choice. Not thread-safe against concurrent GEMMs. PRIMUS_TURBO_GEMM_PLAN=<bn>x<splits>
// does the same from the environment ("256xsk": stream-K).
constexpr int kGemmSm90StreamK = -1;
void gemm_sm90_force_plan(int bn, int splits);
// PRIMUS_TURBO_GEMM_PLAN's value as {bn, splits} ({0, 0} for null or empty: automatic); anything
// but <bn>x<splits> or <bn>xsk as above throws primus::RuntimeError naming the variable.
std::pair<int, int> gemm_sm90_parse_plan(const char* value);
// Tests and the benchmark: force the schedule of every following call; Auto restores the
// environment / default choice. Not thread-safe against concurrent GEMMs.
void gemm_sm90_force_schedule(GemmSm90Schedule s);

}  // namespace primus::turbo::cuda
