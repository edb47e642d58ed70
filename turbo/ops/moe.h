// Mixture-of-experts routing ops: the fused router, the row plan (which permuted row each
// (token, k) slot goes to), permute / unpermute with the routing weights folded into the
// unpermute, and their backwards. The expert GEMMs themselves are turbo/ops/grouped_gemm.h.
//
// Semantics (score functions, group-limited top-k, the aux and z losses, capacity and dropping,
// the row layout of the permuted buffer) are those of the reference kernels, documented in
// turbo/kernels/cpu/moe.h; every device kernel is tested against them.
//
// One MoE layer's forward:  [moe_random_logits ->] router_forward [-> moe_sequence_stats] -> moe_plan_rows -> moe_permute -> expert GEMMs ->
// moe_unpermute; its backward: moe_unpermute_backward -> expert GEMMs' backward ->
// moe_permute_backward, router_backward. Every size a step needs is fixed by (N, K, E, align),
// not by the routing: buffers are sized for moe_permuted_rows_max() rows, the ops read the actual
// group offsets from device memory, so a whole step can be captured as one CUDA graph.
//
// dtypes: logits, probs, weights and their gradients f32; token tensors (inp/out/dout/dinp of the
// permutes) bf16 or f32; indices, offsets and counts i32. Backends: TURBO (device tensors), CPU
// (host tensors; token tensors f32).
#pragma once
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/kernels/cpu/moe.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

using cpu::DropPolicy;
using cpu::moe_permuted_rows_max;
using cpu::RouterConfig;
using cpu::RouterScore;

struct RouterForwardArgs {
  RouterConfig cfg;
  TensorView logits;       // [N,E] f32
  TensorView bias;         // [E] f32 expert bias (selection only), or undefined
  TensorView topk_idx;     // out [N,K] i32
  TensorView topk_weight;  // out [N,K] f32
  TensorView probs;        // out [N,E] f32, saved for the backward (the aux loss's p)
  TensorView counts;       // out [E] i32, slots routed to each expert (before dropping)
  TensorView prob_sum;     // out [E] f32, sum over tokens of p
  TensorView z_sum;        // out [1] f32, sum over tokens of logsumexp(logits)^2
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return Precision::FP32; }
};

struct RouterBackwardArgs {
  RouterConfig cfg;
  TensorView dlogits;                         // out [N,E] f32 (overwritten)
  TensorView dweight;                         // [N,K] f32, gradient of topk_weight
  TensorView logits, probs, topk_idx, counts;  // the forward's
  double aux_coeff = 0, z_coeff = 0;          // loss coefficients times the caller's loss scale
  // The sequence-wise loss (cpu::SequenceRuns): seq_len > 0 makes counts [S,E] (each sequence's,
  // moe_sequence_stats), seq_len the tokens of a whole sequence, seq_run (0: seq_len) the rows of
  // one sequence that lie together here, run r being sequence r mod S. One launch for all of them.
  int64_t seq_len = 0, seq_run = 0;
  // Further balancing losses beside the one above (moe_router_load_balancing_type lists several:
  // the micro-batch's, the sequences' and the global batch's), at most two, each laid out and
  // scaled as the first; their gradients add.
  struct AuxTerm {
    TensorView counts;  // [E] i32, or [S,E] with seq_len > 0
    double coeff = 0;
    int64_t seq_len = 0, seq_run = 0;
  };
  std::vector<AuxTerm> more_aux;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return Precision::FP32; }
};

// moe_router_force_load_balancing (a benchmark setting): the logits overwritten by the
// pseudo-random draw cpu::moe_random_logit(seed, n, e).
struct MoeRandomLogitsArgs {
  TensorView logits;  // [N,E] f32, overwritten
  uint64_t seed = 0;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return Precision::FP32; }
};

// DeepSeek-V3's sequence-wise aux loss reads each sequence's own statistics: the N rows as runs
// of seq_len rows, run r a part of sequence r mod S (S = counts' rows, which must divide the
// N / seq_len runs; cpu::SequenceRuns). One process: S = N / seq_len, a run per sequence.
struct MoeSequenceStatsArgs {
  TensorView topk_idx;  // [N,K] i32, the router's
  TensorView probs;     // [N,E] f32, the router's
  int64_t seq_len = 0;  // rows of a run
  TensorView counts;    // out [S,E] i32: slots routed to each expert within each sequence
  TensorView prob_sum;  // out [S,E] f32: sum of p over each sequence's tokens
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return Precision::FP32; }
};

struct MoePlanArgs {
  TensorView topk_idx, topk_weight, counts;  // the router's
  int64_t align = 16;                        // every group padded to a multiple of this many rows
  int64_t capacity = -1;                     // slots an expert keeps; < 0: dropless
  DropPolicy policy = DropPolicy::Probs;
  TensorView row_of_slot;                    // out [N,K] i32 (-1: dropped)
  TensorView offsets;                        // out [E+1] i32
  TensorView kept;                           // out [E] i32
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return Precision::FP32; }
};

// The row plan: ops read offsets[E] (the rows in use) from `offsets`.
struct MoePermuteArgs {
  TensorView out;   // [rows_max, C]: groups in expert order, padding rows zeroed
  TensorView inp;   // [N, C]
  TensorView row_of_slot, offsets, kept;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};
struct MoePermuteBackwardArgs {
  TensorView dinp;  // [N, C] (+= when accumulate)
  TensorView dout;  // [rows_max, C]
  TensorView row_of_slot;
  bool accumulate = false;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(dout.dtype); }
};
struct MoeUnpermuteArgs {
  TensorView out;     // [N, C] (+= when accumulate): sum_k weight * inp[row]
  TensorView inp;     // [rows_max, C] the experts' outputs
  TensorView weight;  // [N, K] f32
  TensorView row_of_slot;
  bool accumulate = false;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};
struct MoeUnpermuteBackwardArgs {
  TensorView dinp;     // out [rows_max, C]: weight * dout at each kept slot's row, padding rows 0
  TensorView dweight;  // out [N, K] f32
  TensorView dout;     // [N, C]
  TensorView inp, weight, row_of_slot, offsets, kept;  // the forward's
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(dout.dtype); }
};

BackendType router_forward(const RouterForwardArgs& args);
BackendType router_backward(const RouterBackwardArgs& args);
BackendType moe_sequence_stats(const MoeSequenceStatsArgs& args);
BackendType moe_random_logits(const MoeRandomLogitsArgs& args);
BackendType moe_plan_rows(const MoePlanArgs& args);
BackendType moe_permute(const MoePermuteArgs& args);
BackendType moe_permute_backward(const MoePermuteBackwardArgs& args);
BackendType moe_unpermute(const MoeUnpermuteArgs& args);
BackendType moe_unpermute_backward(const MoeUnpermuteBackwardArgs& args);

// Bytes of ExecContext::scratch the largest single borrow of these ops needs on the device for N
// tokens, top-K of E experts and the row plan's capacity and drop policy (each op borrows within
// the call and gives it back); 0 in builds without CUDA (the CPU backend borrows none).
size_t moe_scratch_bytes(int64_t N, int64_t K, int64_t E, int64_t capacity, DropPolicy policy);

}  // namespace primus::turbo
