// Mixture-of-experts routing on the host: the reference every device kernel of turbo/ops/moe.h is
// tested against (fp32 for training, fp64 for the finite-difference gradient checks).
//
// Shapes: N tokens, E experts, K experts per token (top-k), C hidden. A "slot" is one (token, k)
// pair; slot s = n * K + k.
//
// Router semantics follow Megatron-LM's TopKRouter:
//   softmax, pre_softmax = false   topk over logits (+ bias), weights = softmax over the K chosen
//                                  logits (Mixtral; = the normalised top-k of the full softmax)
//   softmax, pre_softmax = true    probs = softmax(logits); topk over probs (+ bias), weights = the
//                                  chosen probs, not renormalised (OLMoE, Qwen2-MoE)
//   sigmoid                        scores = sigmoid(logits); topk over scores (+ bias), weights =
//                                  the chosen scores, divided by their sum when K > 1 (DeepSeek-V3)
// then weights *= scaling_factor. The expert bias (aux-loss-free balancing) only steers the
// choice, never the weights. Group-limited routing (num_groups > 1): the E experts form
// num_groups groups of E / num_groups; a group's score is the sum of its top (K / group_topk)
// selection scores; only the group_topk best groups may be chosen from. Ties go to the lower
// expert (or group) index, so routing is a pure function of the logits.
//
// Auxiliary losses, per call (the caller multiplies by its own loss scale):
//   aux (switch-style, Megatron's "aux_loss"): E / (N * K * N) * sum_e count_e * sum_n p_ne,
//       p = softmax(logits) for the softmax router, sigmoid(logits) normalised per token for the
//       sigmoid router; counts are not differentiated.
//   sequence-wise aux (DeepSeek-V3, Megatron's "seq_aux_loss"): the mean over S sequences of T
//       tokens of the aux above with each sequence's own counts and sums of p over its T tokens
//       (moe_sequence_stats, sequence_aux_loss). Where a call's rows lie: SequenceRuns.
//   z: mean_n logsumexp(logits_n)^2.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace primus::turbo::cpu {

enum class RouterScore : uint8_t { Softmax, Sigmoid };

struct RouterConfig {
  int64_t num_experts = 0, topk = 0;
  RouterScore score = RouterScore::Softmax;
  bool pre_softmax = false;
  int64_t num_groups = 1, group_topk = 1;  // num_groups <= 1: no group limit
  double scaling_factor = 1.0;
};

// logits [N,E]; bias [E] or nullptr. Writes topk_idx [N,K] (expert ids, in descending selection
// score, ties to the lower id), topk_weight [N,K], probs [N,E] (the aux loss's p), counts [E]
// (slots per expert, overwritten), prob_sum [E] (sum_n p_ne, overwritten), and *z_sum
// (sum_n logsumexp(logits_n)^2). Returns nothing; the loss values are router_losses().
// forced_idx [N,K] (tests only; nullptr otherwise): use these experts instead of choosing, with
// the weights the router gives them (teacher forcing: comparing two implementations whose
// rounding may break a near-tie differently, on the same routing).
template <typename Real>
void router_forward(int32_t* topk_idx, Real* topk_weight, Real* probs, int32_t* counts, Real* prob_sum,
                    Real* z_sum, const Real* logits, const Real* bias, int64_t N, const RouterConfig& cfg,
                    const int32_t* forced_idx = nullptr);

// aux and z from the forward's statistics (see the header comment).
template <typename Real>
void router_losses(double* aux, double* z, const int32_t* counts, const Real* prob_sum, Real z_sum, int64_t N,
                   const RouterConfig& cfg);

// The sequence-wise loss's rows: a call's N rows are runs of `run` consecutive rows, run r a part of
// sequence r mod `seqs`, and a whole sequence has `seq_len` tokens. One process: run = seq_len = T,
// seqs = N / T. Context parallelism (a rank holds chunks r and 2cp - 1 - r of each of B sequences,
// all the first chunks, then all the second): run = T / 2cp, seqs = B, seq_len = T, so runs b and
// b + B are both sequence b's, whose statistics are then summed over the group.
struct SequenceRuns {
  int64_t seqs = 0, run = 0, seq_len = 0;
  int64_t of(int64_t n) const { return (n / run) % seqs; }
};
// Throws std::invalid_argument naming `op` and the numbers unless run >= 1 divides N, seqs >= 1
// divides N / run, and seq_len >= 1 (the device kernels' wrappers call it too).
inline void check_sequence_runs(const char* op, const SequenceRuns& q, int64_t N) {
  if (q.run < 1 || N % q.run != 0 || q.seqs < 1 || (N / q.run) % q.seqs != 0 || q.seq_len < 1)
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(q.seqs) + " sequences in runs of " +
                                std::to_string(q.run) + " rows (of " + std::to_string(q.seq_len) +
                                " tokens a sequence) do not lay out " + std::to_string(N) + " rows");
}

// dlogits [N,E] (overwritten) from dweight [N,K] (the gradient of topk_weight) plus
// aux_coeff * d aux + z_coeff * d z (coefficients already scaled by the caller's loss scale).
// seq == nullptr: the switch loss over the N tokens, counts [E]. Otherwise the sequence-wise loss's
// sum over sequences: counts [seqs, E], token n's gradient from its sequence's row, seq_len in
// place of N (the caller's aux_coeff carries 1 / S for the mean); the z loss stays the mean over N.
// `more` adds further balancing losses (moe_router_load_balancing_type lists: the micro-batch's,
// the sequences' and the global batch's at once), each with its own counts, layout and coefficient,
// exactly as the first term is taken; their gradients add.
struct AuxTerm {
  const int32_t* counts = nullptr;
  double coeff = 0;
  SequenceRuns seq{};  // seqs 0: the switch loss over the N rows, counts [E]
};
template <typename Real>
void router_backward(Real* dlogits, const Real* dweight, const Real* logits, const Real* probs,
                     const int32_t* topk_idx, const int32_t* counts, int64_t N, const RouterConfig& cfg,
                     double aux_coeff, double z_coeff, const SequenceRuns* seq = nullptr,
                     const AuxTerm* more = nullptr, size_t n_more = 0);

// The sequence-wise aux loss's statistics over the N rows laid out as q (q.seq_len is not read):
// counts [q.seqs, E] = slots routed to each expert within each sequence's rows, prob_sum [q.seqs, E]
// = sum of p over them (summed in fp64 run by run in order, then rounded); both overwritten.
template <typename Real>
void moe_sequence_stats(int32_t* counts, Real* prob_sum, const int32_t* topk_idx, const Real* probs, int64_t N,
                        const SequenceRuns& q, int64_t K, int64_t E);
// The sequence-wise aux loss from those statistics: the mean over the S sequences of
// router_losses()'s aux with each one's row and N = T.
template <typename Real>
double sequence_aux_loss(const int32_t* counts, const Real* prob_sum, int64_t S, int64_t T, const RouterConfig& cfg);

// Megatron's moe_router_force_load_balancing, a benchmark setting: the router's logits [N,E]
// replaced by a pseudo-random draw (the gradient passes straight through, as Megatron's
// straight-through estimator has it), uniform in [0, 1) on a 2^-24 grid, a pure function of
// (seed, n, e) that the device kernel reproduces bit for bit. Every expert then receives about
// N * K / E slots.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline float moe_random_logit(uint64_t seed, int64_t n, int64_t e) {
  // splitmix64 of the seed and the element's place.
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(n) * 0x100000001B3ull + static_cast<uint64_t>(e) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}
template <typename Real>
void moe_random_logits(Real* logits, int64_t N, int64_t E, uint64_t seed);

// Token dropping when an expert's capacity is exceeded (moe_expert_capacity_factor).
enum class DropPolicy : uint8_t { Probs, Position };

// Where every slot goes. Expert e's group holds its kept slots in token order at rows
// [offsets[e], offsets[e] + kept[e]), then zero rows up to offsets[e + 1], a multiple of `align`
// (offsets[0] = 0). capacity < 0: dropless (kept = counts). Otherwise an expert keeps at most
// `capacity` slots: the highest topk_weight (Probs; ties to the earlier token) or the earliest
// tokens (Position). Writes row_of_slot [N*K] (-1 for a dropped slot), offsets [E+1], kept [E].
// Returns offsets[E], the rows the groups span. The bound for any routing:
// moe_permuted_rows_max(N, K, E, align).
template <typename Real>
int64_t moe_plan_rows(int32_t* row_of_slot, int32_t* offsets, int32_t* kept, const int32_t* topk_idx,
                      const Real* topk_weight, const int32_t* counts, int64_t N, int64_t K, int64_t E,
                      int64_t align, int64_t capacity, DropPolicy policy);
inline int64_t moe_permuted_rows_max(int64_t N, int64_t K, int64_t E, int64_t align) {
  return N * K + E * (align - 1);
}

// out[row_of_slot[s]] = inp[s / K] for every kept slot; the padding rows of every group (rows
// [offsets[e] + kept[e], offsets[e + 1])) are set to zero, because the expert GEMMs read them.
// Rows from offsets[E] on are left as they are.
template <typename Real>
void moe_permute(Real* out, const Real* inp, const int32_t* row_of_slot, const int32_t* offsets,
                 const int32_t* kept, int64_t N, int64_t K, int64_t E, int64_t C);
// dinp [N,C] (+= when accumulate) = sum over the token's kept slots of dout[row].
template <typename Real>
void moe_permute_backward(Real* dinp, const Real* dout, const int32_t* row_of_slot, int64_t N, int64_t K,
                          int64_t C, bool accumulate);
// out [N,C] (+= when accumulate) = sum_k weight[n,k] * inp[row_of_slot[n,k]] over kept slots.
template <typename Real>
void moe_unpermute(Real* out, const Real* inp, const Real* weight, const int32_t* row_of_slot, int64_t N,
                   int64_t K, int64_t C, bool accumulate);
// dinp [offsets[E], C]: row_of_slot[s] gets weight[s] * dout[s / K], the groups' padding rows 0
// (overwritten; rows from offsets[E] on are left as they are); dweight [N,K] = <dout[n], inp[row]>
// (0 for a dropped slot, overwritten).
template <typename Real>
void moe_unpermute_backward(Real* dinp, Real* dweight, const Real* dout, const Real* inp, const Real* weight,
                            const int32_t* row_of_slot, const int32_t* offsets, const int32_t* kept, int64_t N,
                            int64_t K, int64_t E, int64_t C);

// Aux-loss-free balancing (DeepSeek-V3): bias[e] += rate * sign(mean(load) - load[e]), load the
// slots routed to each expert over the step (before dropping).
void router_bias_update(float* bias, const int64_t* load, int64_t E, double rate);

}  // namespace primus::turbo::cpu
