#include "turbo/ops/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "turbo/kernels/cpu/moe.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/moe.h"
#endif

namespace primus::turbo {
namespace {

// All nine ops dispatch under one name: PRIMUS_TURBO_MOE_BACKEND picks the backend of the whole
// routing path, which only works end to end on one device anyway.
constexpr const char* kMoeOp = "moe";

const char* moe_score_name(const RouterConfig& c) {
  if (c.score == RouterScore::Sigmoid) return "sigmoid";
  return c.pre_softmax ? "pre_softmax" : "softmax";
}

// A contiguous tensor of `dt` whose rows x columns are (rows, cols); -1 accepts any count.
void moe_check(const TensorView& t, int64_t rows, int64_t cols, DType dt, const char* op, const char* arg) {
  check_defined(t, op, arg);
  check_contiguous(t, op, arg);
  check_dtype(t, dt, op, arg);
  if (t.ndim < 1 || (rows >= 0 && t.rows() != rows) || (cols >= 0 && t.cols() != cols))
    throw RuntimeError(fmt::format("{}: {}: expected [{}, {}] got {}", op, arg, rows < 0 ? "*" : std::to_string(rows),
                                   cols < 0 ? "*" : std::to_string(cols), t.describe()));
}
// A contiguous vector of n elements of `dt`.
void moe_check_vec(const TensorView& t, int64_t n, DType dt, const char* op, const char* arg) {
  check_defined(t, op, arg);
  check_contiguous(t, op, arg);
  check_dtype(t, dt, op, arg);
  if (t.numel() != n) throw RuntimeError(fmt::format("{}: {}: expected {} elements got {}", op, arg, n, t.describe()));
}
// Token tensors: f32 or bf16 (the backends narrow further).
void moe_check_token_dtype(const TensorView& t, const char* op, const char* arg) {
  if (t.dtype != DType::F32 && t.dtype != DType::BF16)
    throw RuntimeError(fmt::format("{}: {}: expected f32 or bf16 got {}", op, arg, t.describe()));
}

void moe_check_config(const RouterConfig& c, const char* op) {
  const int64_t E = c.num_experts, K = c.topk;
  if (E < 1 || K < 1 || K > E)
    throw RuntimeError(fmt::format("{}: cfg: num_experts {} and topk {} need 1 <= topk <= num_experts", op, E, K));
  if (c.num_groups > 1) {
    const int64_t G = c.num_groups;
    if (E % G != 0)
      throw RuntimeError(fmt::format("{}: cfg: num_experts {} is not a multiple of num_groups {}", op, E, G));
    if (c.group_topk < 1 || c.group_topk > G)
      throw RuntimeError(fmt::format("{}: cfg: group_topk {} outside [1, num_groups {}]", op, c.group_topk, G));
    if (K < c.group_topk || c.group_topk * (E / G) < K)
      throw RuntimeError(fmt::format(
          "{}: cfg: topk {} must lie in [group_topk {}, group_topk * experts per group {}] (each chosen group scores "
          "its best topk / group_topk experts, and the chosen groups must hold topk experts)",
          op, K, c.group_topk, c.group_topk * (E / G)));
  }
  if (!std::isfinite(c.scaling_factor))
    throw RuntimeError(fmt::format("{}: cfg: scaling_factor {} is not finite", op, c.scaling_factor));
}

// ---- validation ----------------------------------------------------------------------------------
struct MoeDims {
  int64_t N = 0, K = 0, E = 0, C = 0, rows = 0;
};

MoeDims validate(const RouterForwardArgs& a) {
  const char* op = "router_forward";
  moe_check_config(a.cfg, op);
  const int64_t E = a.cfg.num_experts, K = a.cfg.topk;
  moe_check(a.logits, -1, E, DType::F32, op, "logits");
  const int64_t N = a.logits.rows();
  if (a.bias.defined()) moe_check_vec(a.bias, E, DType::F32, op, "bias");
  moe_check(a.topk_idx, N, K, DType::I32, op, "topk_idx");
  moe_check(a.topk_weight, N, K, DType::F32, op, "topk_weight");
  moe_check(a.probs, N, E, DType::F32, op, "probs");
  moe_check_vec(a.counts, E, DType::I32, op, "counts");
  moe_check_vec(a.prob_sum, E, DType::F32, op, "prob_sum");
  moe_check_vec(a.z_sum, 1, DType::F32, op, "z_sum");
  return {N, K, E, 0, 0};
}

// The sequence-wise statistics' rows: runs of `run` rows that divide the N tokens, and counts
// [S,E] i32 whose S sequences divide the runs. Returns S.
int64_t moe_check_sequence_rows(const TensorView& counts, int64_t N, int64_t run, int64_t E, const char* op) {
  if (run < 1 || N % run != 0)
    throw RuntimeError(fmt::format("{}: a sequence's run of {} rows does not divide the {} tokens", op, run, N));
  moe_check(counts, -1, E, DType::I32, op, "counts");
  const int64_t S = counts.rows();
  if (S < 1 || (N / run) % S != 0)
    throw RuntimeError(fmt::format("{}: counts of {} sequences do not divide the {} runs of {} rows", op, S, N / run,
                                   run));
  return S;
}

MoeDims validate(const RouterBackwardArgs& a) {
  const char* op = "router_backward";
  moe_check_config(a.cfg, op);
  const int64_t E = a.cfg.num_experts, K = a.cfg.topk;
  moe_check(a.logits, -1, E, DType::F32, op, "logits");
  const int64_t N = a.logits.rows();
  moe_check(a.dlogits, N, E, DType::F32, op, "dlogits");
  moe_check(a.dweight, N, K, DType::F32, op, "dweight");
  // probs: both backends recompute p from the logits in fp64, so it may be left unset.
  if (a.probs.defined()) moe_check(a.probs, N, E, DType::F32, op, "probs");
  moe_check(a.topk_idx, N, K, DType::I32, op, "topk_idx");
  // A balancing term's counts: [E], or [S, E] laid out as sequence runs.
  const auto check_counts = [&](const TensorView& counts, int64_t seq_len, int64_t seq_run, const char* name) {
    if (seq_len > 0) {
      moe_check_sequence_rows(counts, N, seq_run > 0 ? seq_run : seq_len, E, op);
    } else {
      moe_check_vec(counts, E, DType::I32, op, name);
    }
  };
  check_counts(a.counts, a.seq_len, a.seq_run, "counts");
  if (!std::isfinite(a.aux_coeff) || !std::isfinite(a.z_coeff))
    throw RuntimeError(fmt::format("{}: aux_coeff {} and z_coeff {} must be finite", op, a.aux_coeff, a.z_coeff));
  if (a.more_aux.size() > 2)
    throw RuntimeError(fmt::format("{}: {} further balancing losses (at most 2)", op, a.more_aux.size()));
  for (const RouterBackwardArgs::AuxTerm& t : a.more_aux) {
    check_counts(t.counts, t.seq_len, t.seq_run, "more_aux counts");
    if (!std::isfinite(t.coeff))
      throw RuntimeError(fmt::format("{}: a further aux coefficient {} is not finite", op, t.coeff));
  }
  return {N, K, E, 0, 0};
}

MoeDims validate(const MoeRandomLogitsArgs& a) {
  moe_check(a.logits, -1, -1, DType::F32, "moe_random_logits", "logits");
  return {a.logits.rows(), 0, a.logits.cols(), 0, 0};
}

MoeDims validate(const MoeSequenceStatsArgs& a) {
  const char* op = "moe_sequence_stats";
  moe_check(a.topk_idx, -1, -1, DType::I32, op, "topk_idx");
  const int64_t N = a.topk_idx.rows(), K = a.topk_idx.cols();
  moe_check(a.probs, N, -1, DType::F32, op, "probs");
  const int64_t E = a.probs.cols();
  const int64_t S = moe_check_sequence_rows(a.counts, N, a.seq_len, E, op);
  moe_check(a.prob_sum, S, E, DType::F32, op, "prob_sum");
  return {N, K, E, 0, 0};
}

MoeDims validate(const MoePlanArgs& a) {
  const char* op = "moe_plan_rows";
  moe_check(a.topk_idx, -1, -1, DType::I32, op, "topk_idx");
  const int64_t N = a.topk_idx.rows(), K = a.topk_idx.cols();
  check_defined(a.kept, op, "kept");
  const int64_t E = a.kept.numel();
  if (E < 1) throw RuntimeError(fmt::format("{}: kept: expected one element per expert got {}", op, a.kept.describe()));
  moe_check_vec(a.kept, E, DType::I32, op, "kept");
  moe_check_vec(a.offsets, E + 1, DType::I32, op, "offsets");
  if (a.counts.defined()) moe_check_vec(a.counts, E, DType::I32, op, "counts");
  moe_check(a.row_of_slot, N, K, DType::I32, op, "row_of_slot");
  if (a.topk_weight.defined() || (a.capacity >= 0 && a.policy == DropPolicy::Probs))
    moe_check(a.topk_weight, N, K, DType::F32, op, "topk_weight (read by the Probs drop policy)");
  if (a.align < 1) throw RuntimeError(fmt::format("{}: align {} must be >= 1", op, a.align));
  if (moe_permuted_rows_max(N, K, E, a.align) > INT32_MAX)
    throw RuntimeError(fmt::format("{}: N*K + E*(align-1) = {} rows do not fit the i32 row indices", op,
                                   moe_permuted_rows_max(N, K, E, a.align)));
  return {N, K, E, 0, 0};
}

// The permutes: N, K from row_of_slot [N,K]; C and the permuted rows from the token tensors.
MoeDims validate(const MoePermuteArgs& a) {
  const char* op = "moe_permute";
  moe_check(a.row_of_slot, -1, -1, DType::I32, op, "row_of_slot");
  const int64_t N = a.row_of_slot.rows(), K = a.row_of_slot.cols();
  check_defined(a.inp, op, "inp");
  moe_check_token_dtype(a.inp, op, "inp");
  moe_check(a.inp, N, -1, a.inp.dtype, op, "inp");
  const int64_t C = a.inp.cols();
  moe_check(a.out, -1, C, a.inp.dtype, op, "out");
  check_defined(a.kept, op, "kept");
  const int64_t E = a.kept.numel();
  moe_check_vec(a.kept, E, DType::I32, op, "kept");
  moe_check_vec(a.offsets, E + 1, DType::I32, op, "offsets");
  return {N, K, E, C, a.out.rows()};
}

MoeDims validate(const MoePermuteBackwardArgs& a) {
  const char* op = "moe_permute_backward";
  moe_check(a.row_of_slot, -1, -1, DType::I32, op, "row_of_slot");
  const int64_t N = a.row_of_slot.rows(), K = a.row_of_slot.cols();
  check_defined(a.dout, op, "dout");
  moe_check_token_dtype(a.dout, op, "dout");
  moe_check(a.dout, -1, -1, a.dout.dtype, op, "dout");
  const int64_t C = a.dout.cols();
  moe_check(a.dinp, N, C, a.dout.dtype, op, "dinp");
  return {N, K, 0, C, a.dout.rows()};
}

MoeDims validate(const MoeUnpermuteArgs& a) {
  const char* op = "moe_unpermute";
  moe_check(a.row_of_slot, -1, -1, DType::I32, op, "row_of_slot");
  const int64_t N = a.row_of_slot.rows(), K = a.row_of_slot.cols();
  check_defined(a.inp, op, "inp");
  moe_check_token_dtype(a.inp, op, "inp");
  moe_check(a.inp, -1, -1, a.inp.dtype, op, "inp");
  const int64_t C = a.inp.cols();
  moe_check(a.out, N, C, a.inp.dtype, op, "out");
  moe_check(a.weight, N, K, DType::F32, op, "weight");
  return {N, K, 0, C, a.inp.rows()};
}

MoeDims validate(const MoeUnpermuteBackwardArgs& a) {
  const char* op = "moe_unpermute_backward";
  moe_check(a.row_of_slot, -1, -1, DType::I32, op, "row_of_slot");
  const int64_t N = a.row_of_slot.rows(), K = a.row_of_slot.cols();
  check_defined(a.dout, op, "dout");
  moe_check_token_dtype(a.dout, op, "dout");
  moe_check(a.dout, N, -1, a.dout.dtype, op, "dout");
  const int64_t C = a.dout.cols();
  moe_check(a.inp, -1, C, a.dout.dtype, op, "inp");
  moe_check(a.dinp, a.inp.rows(), C, a.dout.dtype, op, "dinp");
  moe_check(a.weight, N, K, DType::F32, op, "weight");
  moe_check(a.dweight, N, K, DType::F32, op, "dweight");
  check_defined(a.kept, op, "kept");
  const int64_t E = a.kept.numel();
  moe_check_vec(a.kept, E, DType::I32, op, "kept");
  moe_check_vec(a.offsets, E + 1, DType::I32, op, "offsets");
  return {N, K, E, C, a.inp.rows()};
}

// ---- CPU: the reference kernels on host f32 tensors ----------------------------------------------
std::string moe_cpu_check(std::initializer_list<std::pair<const char*, const TensorView*>> all,
                          std::initializer_list<std::pair<const char*, const TensorView*>> tokens) {
  if (auto w = detail::all_on(Device::CPU, all); !w.empty()) return w;
  return detail::all_dtype(DType::F32, tokens);
}

// The reference writes wherever the plan's rows point: on the host the plan can be read, so a
// plan that does not fit the permuted buffer is an error here rather than a stray write.
void moe_cpu_check_rows(const TensorView& offsets, int64_t E, int64_t rows, const char* op) {
  const int32_t* o = offsets.ptr<const int32_t>();
  for (int64_t e = 0; e < E; ++e)
    if (o[e] < 0 || o[e + 1] < o[e])
      throw RuntimeError(fmt::format("{}: offsets are not a non-decreasing sequence from 0 (offsets[{}] = {}, [{}] = {})",
                                     op, e, o[e], e + 1, o[e + 1]));
  if (o[E] > rows)
    throw RuntimeError(fmt::format("{}: the plan spans offsets[E] = {} rows, the permuted tensor has {}", op, o[E], rows));
}
void moe_cpu_check_slots(const TensorView& row_of_slot, int64_t rows, const char* op) {
  const int32_t* r = row_of_slot.ptr<const int32_t>();
  for (int64_t s = 0; s < row_of_slot.numel(); ++s)
    if (r[s] >= rows)
      throw RuntimeError(fmt::format("{}: row_of_slot[{}] = {} is past the permuted tensor's {} rows", op, s, r[s], rows));
}

std::string cpu_check_router_fwd(const RouterForwardArgs& a) {
  return moe_cpu_check({{"logits", &a.logits}, {"bias", &a.bias}, {"topk_idx", &a.topk_idx},
                        {"topk_weight", &a.topk_weight}, {"probs", &a.probs}, {"counts", &a.counts},
                        {"prob_sum", &a.prob_sum}, {"z_sum", &a.z_sum}},
                       {});
}
void cpu_router_fwd(const RouterForwardArgs& a) {
  const MoeDims d = validate(a);
  cpu::router_forward<float>(a.topk_idx.ptr<int32_t>(), a.topk_weight.ptr<float>(), a.probs.ptr<float>(),
                             a.counts.ptr<int32_t>(), a.prob_sum.ptr<float>(), a.z_sum.ptr<float>(),
                             a.logits.ptr<const float>(), a.bias.defined() ? a.bias.ptr<const float>() : nullptr, d.N,
                             a.cfg);
}
// The further aux terms' counts (undefined where there is none: the checks skip those).
const TensorView* more_counts(const RouterBackwardArgs& a, size_t i) {
  static const TensorView none;
  return i < a.more_aux.size() ? &a.more_aux[i].counts : &none;
}
std::string cpu_check_router_bwd(const RouterBackwardArgs& a) {
  return moe_cpu_check({{"dlogits", &a.dlogits}, {"dweight", &a.dweight}, {"logits", &a.logits}, {"probs", &a.probs},
                        {"topk_idx", &a.topk_idx}, {"counts", &a.counts}, {"more_aux counts", more_counts(a, 0)},
                        {"more_aux counts", more_counts(a, 1)}},
                       {});
}
cpu::SequenceRuns sequence_runs(const TensorView& counts, int64_t seq_len, int64_t seq_run) {
  if (seq_len <= 0) return {};
  return {counts.rows(), seq_run > 0 ? seq_run : seq_len, seq_len};
}
cpu::SequenceRuns sequence_runs(const RouterBackwardArgs& a) { return sequence_runs(a.counts, a.seq_len, a.seq_run); }
std::vector<cpu::AuxTerm> more_aux_terms(const RouterBackwardArgs& a) {
  std::vector<cpu::AuxTerm> v;
  for (const RouterBackwardArgs::AuxTerm& t : a.more_aux)
    v.push_back({t.counts.ptr<const int32_t>(), t.coeff, sequence_runs(t.counts, t.seq_len, t.seq_run)});
  return v;
}
void cpu_router_bwd(const RouterBackwardArgs& a) {
  const MoeDims d = validate(a);
  const cpu::SequenceRuns runs = sequence_runs(a);
  const std::vector<cpu::AuxTerm> more = more_aux_terms(a);
  cpu::router_backward<float>(a.dlogits.ptr<float>(), a.dweight.ptr<const float>(), a.logits.ptr<const float>(),
                              a.probs.defined() ? a.probs.ptr<const float>() : nullptr, a.topk_idx.ptr<const int32_t>(),
                              a.counts.ptr<const int32_t>(), d.N, a.cfg, a.aux_coeff, a.z_coeff,
                              a.seq_len > 0 ? &runs : nullptr, more.data(), more.size());
}
std::string cpu_check_random_logits(const MoeRandomLogitsArgs& a) { return moe_cpu_check({{"logits", &a.logits}}, {}); }
void cpu_random_logits(const MoeRandomLogitsArgs& a) {
  const MoeDims d = validate(a);
  cpu::moe_random_logits(a.logits.ptr<float>(), d.N, d.E, a.seed);
}
std::string cpu_check_seq_stats(const MoeSequenceStatsArgs& a) {
  return moe_cpu_check({{"topk_idx", &a.topk_idx}, {"probs", &a.probs}, {"counts", &a.counts},
                        {"prob_sum", &a.prob_sum}},
                       {});
}
void cpu_seq_stats(const MoeSequenceStatsArgs& a) {
  const MoeDims d = validate(a);
  cpu::moe_sequence_stats<float>(a.counts.ptr<int32_t>(), a.prob_sum.ptr<float>(), a.topk_idx.ptr<const int32_t>(),
                                 a.probs.ptr<const float>(), d.N, {a.counts.rows(), a.seq_len, 1}, d.K, d.E);
}
std::string cpu_check_plan(const MoePlanArgs& a) {
  return moe_cpu_check({{"topk_idx", &a.topk_idx}, {"topk_weight", &a.topk_weight}, {"counts", &a.counts},
                        {"row_of_slot", &a.row_of_slot}, {"offsets", &a.offsets}, {"kept", &a.kept}},
                       {});
}
void cpu_plan(const MoePlanArgs& a) {
  const MoeDims d = validate(a);
  const int32_t* idx = a.topk_idx.ptr<const int32_t>();
  for (int64_t s = 0; s < d.N * d.K; ++s)
    if (idx[s] < 0 || idx[s] >= d.E)
      throw RuntimeError(fmt::format("moe_plan_rows: topk_idx[{}] = {} is not an expert in [0, {})", s, idx[s], d.E));
  cpu::moe_plan_rows<float>(a.row_of_slot.ptr<int32_t>(), a.offsets.ptr<int32_t>(), a.kept.ptr<int32_t>(), idx,
                            a.topk_weight.defined() ? a.topk_weight.ptr<const float>() : nullptr,
                            a.counts.defined() ? a.counts.ptr<const int32_t>() : nullptr, d.N, d.K, d.E, a.align,
                            a.capacity, a.policy);
}
std::string cpu_check_permute(const MoePermuteArgs& a) {
  return moe_cpu_check({{"out", &a.out}, {"inp", &a.inp}, {"row_of_slot", &a.row_of_slot}, {"offsets", &a.offsets},
                        {"kept", &a.kept}},
                       {{"inp", &a.inp}});
}
void cpu_permute(const MoePermuteArgs& a) {
  const MoeDims d = validate(a);
  moe_cpu_check_rows(a.offsets, d.E, d.rows, "moe_permute");
  moe_cpu_check_slots(a.row_of_slot, d.rows, "moe_permute");
  cpu::moe_permute<float>(a.out.ptr<float>(), a.inp.ptr<const float>(), a.row_of_slot.ptr<const int32_t>(),
                          a.offsets.ptr<const int32_t>(), a.kept.ptr<const int32_t>(), d.N, d.K, d.E, d.C);
}
std::string cpu_check_permute_bwd(const MoePermuteBackwardArgs& a) {
  return moe_cpu_check({{"dinp", &a.dinp}, {"dout", &a.dout}, {"row_of_slot", &a.row_of_slot}}, {{"dout", &a.dout}});
}
void cpu_permute_bwd(const MoePermuteBackwardArgs& a) {
  const MoeDims d = validate(a);
  moe_cpu_check_slots(a.row_of_slot, d.rows, "moe_permute_backward");
  cpu::moe_permute_backward<float>(a.dinp.ptr<float>(), a.dout.ptr<const float>(), a.row_of_slot.ptr<const int32_t>(),
                                   d.N, d.K, d.C, a.accumulate);
}
std::string cpu_check_unpermute(const MoeUnpermuteArgs& a) {
  return moe_cpu_check({{"out", &a.out}, {"inp", &a.inp}, {"weight", &a.weight}, {"row_of_slot", &a.row_of_slot}},
                       {{"inp", &a.inp}});
}
void cpu_unpermute(const MoeUnpermuteArgs& a) {
  const MoeDims d = validate(a);
  moe_cpu_check_slots(a.row_of_slot, d.rows, "moe_unpermute");
  cpu::moe_unpermute<float>(a.out.ptr<float>(), a.inp.ptr<const float>(), a.weight.ptr<const float>(),
                            a.row_of_slot.ptr<const int32_t>(), d.N, d.K, d.C, a.accumulate);
}
std::string cpu_check_unpermute_bwd(const MoeUnpermuteBackwardArgs& a) {
  return moe_cpu_check({{"dinp", &a.dinp}, {"dweight", &a.dweight}, {"dout", &a.dout}, {"inp", &a.inp},
                        {"weight", &a.weight}, {"row_of_slot", &a.row_of_slot}, {"offsets", &a.offsets},
                        {"kept", &a.kept}},
                       {{"dout", &a.dout}});
}
void cpu_unpermute_bwd(const MoeUnpermuteBackwardArgs& a) {
  const MoeDims d = validate(a);
  moe_cpu_check_rows(a.offsets, d.E, d.rows, "moe_unpermute_backward");
  moe_cpu_check_slots(a.row_of_slot, d.rows, "moe_unpermute_backward");
  cpu::moe_unpermute_backward<float>(a.dinp.ptr<float>(), a.dweight.ptr<float>(), a.dout.ptr<const float>(),
                                     a.inp.ptr<const float>(), a.weight.ptr<const float>(),
                                     a.row_of_slot.ptr<const int32_t>(), a.offsets.ptr<const int32_t>(),
                                     a.kept.ptr<const int32_t>(), d.N, d.K, d.E, d.C);
}

// ---- TURBO: turbo/kernels/cuda/moe.cu on device tensors ------------------------------------------
#ifdef PRIMUS_TURBO_WITH_CUDA
std::string moe_turbo_check(std::initializer_list<std::pair<const char*, const TensorView*>> all, int64_t K) {
  if (auto w = detail::all_on(Device::CUDA, all); !w.empty()) return w;
  if (K > cuda::kMoeMaxTopK) return fmt::format("K = {} slots per token (at most {})", K, cuda::kMoeMaxTopK);
  return "";
}
std::string moe_turbo_router_check(const RouterConfig& c) {
  if (c.num_experts > cuda::kMoeMaxRouterExperts)
    return fmt::format("num_experts = {} (at most {})", c.num_experts, cuda::kMoeMaxRouterExperts);
  if (c.num_groups > cuda::kMoeMaxGroups)
    return fmt::format("num_groups = {} (at most {})", c.num_groups, cuda::kMoeMaxGroups);
  return "";
}
cudaStream_t moe_stream(const ExecContext& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

std::string turbo_check_router_fwd(const RouterForwardArgs& a) {
  if (auto w = moe_turbo_check({{"logits", &a.logits}, {"bias", &a.bias}, {"topk_idx", &a.topk_idx},
                                {"topk_weight", &a.topk_weight}, {"probs", &a.probs}, {"counts", &a.counts},
                                {"prob_sum", &a.prob_sum}, {"z_sum", &a.z_sum}},
                               a.cfg.topk);
      !w.empty())
    return w;
  if (!a.ctx.scratch) return "needs ExecContext::scratch (device arena) for the per-block partial sums";
  return moe_turbo_router_check(a.cfg);
}
void turbo_router_fwd(const RouterForwardArgs& a) {
  const MoeDims d = validate(a);
  Arena& arena = detail::scratch_of(a.ctx, "router_forward");
  ArenaScope scope(arena);
  void* scratch = arena.allocate(cuda::router_forward_scratch_bytes(d.N, d.E), 256, "router_forward partials");
  cuda::router_forward(a.topk_idx.ptr<int32_t>(), a.topk_weight.ptr<float>(), a.probs.ptr<float>(),
                       a.counts.ptr<int32_t>(), a.prob_sum.ptr<float>(), a.z_sum.ptr<float>(),
                       a.logits.ptr<const float>(), a.bias.defined() ? a.bias.ptr<const float>() : nullptr, d.N, a.cfg,
                       scratch, moe_stream(a.ctx));
}
std::string turbo_check_router_bwd(const RouterBackwardArgs& a) {
  if (auto w = moe_turbo_check({{"dlogits", &a.dlogits}, {"dweight", &a.dweight}, {"logits", &a.logits},
                                {"probs", &a.probs}, {"topk_idx", &a.topk_idx}, {"counts", &a.counts},
                                {"more_aux counts", more_counts(a, 0)}, {"more_aux counts", more_counts(a, 1)}},
                               a.cfg.topk);
      !w.empty())
    return w;
  return moe_turbo_router_check(a.cfg);
}
void turbo_router_bwd(const RouterBackwardArgs& a) {
  const MoeDims d = validate(a);
  const std::vector<cpu::AuxTerm> more = more_aux_terms(a);
  cuda::router_backward(a.dlogits.ptr<float>(), a.dweight.ptr<const float>(), a.logits.ptr<const float>(),
                        a.topk_idx.ptr<const int32_t>(), a.counts.ptr<const int32_t>(), d.N, a.cfg, a.aux_coeff,
                        a.z_coeff, sequence_runs(a), moe_stream(a.ctx), more.data(), more.size());
}
std::string turbo_check_random_logits(const MoeRandomLogitsArgs& a) {
  return detail::all_on(Device::CUDA, {{"logits", &a.logits}});
}
void turbo_random_logits(const MoeRandomLogitsArgs& a) {
  const MoeDims d = validate(a);
  cuda::moe_random_logits(a.logits.ptr<float>(), d.N, d.E, a.seed, moe_stream(a.ctx));
}
std::string turbo_check_seq_stats(const MoeSequenceStatsArgs& a) {
  return moe_turbo_check({{"topk_idx", &a.topk_idx}, {"probs", &a.probs}, {"counts", &a.counts},
                          {"prob_sum", &a.prob_sum}},
                         a.topk_idx.cols());
}
void turbo_seq_stats(const MoeSequenceStatsArgs& a) {
  const MoeDims d = validate(a);
  cuda::moe_sequence_stats(a.counts.ptr<int32_t>(), a.prob_sum.ptr<float>(), a.topk_idx.ptr<const int32_t>(),
                           a.probs.ptr<const float>(), d.N, {a.counts.rows(), a.seq_len, 1}, d.K, d.E,
                           moe_stream(a.ctx));
}
std::string turbo_check_plan(const MoePlanArgs& a) {
  if (auto w = moe_turbo_check({{"topk_idx", &a.topk_idx}, {"topk_weight", &a.topk_weight}, {"counts", &a.counts},
                                {"row_of_slot", &a.row_of_slot}, {"offsets", &a.offsets}, {"kept", &a.kept}},
                               a.topk_idx.cols());
      !w.empty())
    return w;
  if (a.kept.numel() > cuda::kMoeMaxPlanExperts)
    return fmt::format("{} experts (at most {})", a.kept.numel(), cuda::kMoeMaxPlanExperts);
  if (!a.ctx.scratch) return "needs ExecContext::scratch (device arena) for the per-block counts";
  return "";
}
void turbo_plan(const MoePlanArgs& a) {
  const MoeDims d = validate(a);
  Arena& arena = detail::scratch_of(a.ctx, "moe_plan_rows");
  ArenaScope scope(arena);
  void* scratch =
      arena.allocate(cuda::moe_plan_scratch_bytes(d.N, d.K, d.E, a.capacity, a.policy), 256, "moe_plan_rows tables");
  cuda::moe_plan_rows(a.row_of_slot.ptr<int32_t>(), a.offsets.ptr<int32_t>(), a.kept.ptr<int32_t>(),
                      a.topk_idx.ptr<const int32_t>(), a.topk_weight.defined() ? a.topk_weight.ptr<const float>() : nullptr,
                      d.N, d.K, d.E, a.align, a.capacity, a.policy, scratch, moe_stream(a.ctx));
}
std::string turbo_check_permute(const MoePermuteArgs& a) {
  return moe_turbo_check({{"out", &a.out}, {"inp", &a.inp}, {"row_of_slot", &a.row_of_slot}, {"offsets", &a.offsets},
                          {"kept", &a.kept}},
                         a.row_of_slot.cols());
}
void turbo_permute(const MoePermuteArgs& a) {
  const MoeDims d = validate(a);
  cuda::moe_permute(a.inp.dtype, a.out.data, a.inp.data, a.row_of_slot.ptr<const int32_t>(),
                    a.offsets.ptr<const int32_t>(), a.kept.ptr<const int32_t>(), d.N, d.K, d.E, d.C, d.rows,
                    moe_stream(a.ctx));
}
std::string turbo_check_permute_bwd(const MoePermuteBackwardArgs& a) {
  return moe_turbo_check({{"dinp", &a.dinp}, {"dout", &a.dout}, {"row_of_slot", &a.row_of_slot}}, a.row_of_slot.cols());
}
void turbo_permute_bwd(const MoePermuteBackwardArgs& a) {
  const MoeDims d = validate(a);
  cuda::moe_permute_backward(a.dout.dtype, a.dinp.data, a.dout.data, a.row_of_slot.ptr<const int32_t>(), d.N, d.K, d.C,
                             d.rows, a.accumulate, moe_stream(a.ctx));
}
std::string turbo_check_unpermute(const MoeUnpermuteArgs& a) {
  return moe_turbo_check({{"out", &a.out}, {"inp", &a.inp}, {"weight", &a.weight}, {"row_of_slot", &a.row_of_slot}},
                         a.row_of_slot.cols());
}
void turbo_unpermute(const MoeUnpermuteArgs& a) {
  const MoeDims d = validate(a);
  cuda::moe_unpermute(a.inp.dtype, a.out.data, a.inp.data, a.weight.ptr<const float>(),
                      a.row_of_slot.ptr<const int32_t>(), d.N, d.K, d.C, d.rows, a.accumulate, moe_stream(a.ctx));
}
std::string turbo_check_unpermute_bwd(const MoeUnpermuteBackwardArgs& a) {
  return moe_turbo_check({{"dinp", &a.dinp}, {"dweight", &a.dweight}, {"dout", &a.dout}, {"inp", &a.inp},
                          {"weight", &a.weight}, {"row_of_slot", &a.row_of_slot}, {"offsets", &a.offsets},
                          {"kept", &a.kept}},
                         a.row_of_slot.cols());
}
void turbo_unpermute_bwd(const MoeUnpermuteBackwardArgs& a) {
  const MoeDims d = validate(a);
  cuda::moe_unpermute_backward(a.dout.dtype, a.dinp.data, a.dweight.ptr<float>(), a.dout.data, a.inp.data,
                               a.weight.ptr<const float>(), a.row_of_slot.ptr<const int32_t>(),
                               a.offsets.ptr<const int32_t>(), a.kept.ptr<const int32_t>(), d.N, d.K, d.E, d.C, d.rows,
                               moe_stream(a.ctx));
}
#endif

}  // namespace

std::string RouterForwardArgs::key() const {
  return fmt::format("router_forward logits={} E={} K={} {} groups={}/{} bias={}", logits.describe(), cfg.num_experts,
                     cfg.topk, moe_score_name(cfg), cfg.group_topk, cfg.num_groups, bias.defined() ? 1 : 0);
}
std::string RouterBackwardArgs::key() const {
  return fmt::format("router_backward logits={} E={} K={} {} seq={}/{} aux_terms={}", logits.describe(), cfg.num_experts,
                     cfg.topk, moe_score_name(cfg), seq_len, seq_run, 1 + more_aux.size());
}
std::string MoeRandomLogitsArgs::key() const {
  return fmt::format("moe_random_logits logits={}", logits.describe());
}
std::string MoeSequenceStatsArgs::key() const {
  return fmt::format("moe_sequence_stats topk_idx={} probs={} seq_len={}", topk_idx.describe(), probs.describe(),
                     seq_len);
}
std::string MoePlanArgs::key() const {
  return fmt::format("moe_plan_rows topk_idx={} E={} align={} capacity={} policy={}", topk_idx.describe(), kept.numel(),
                     align, capacity, policy == DropPolicy::Probs ? "probs" : "position");
}
std::string MoePermuteArgs::key() const {
  return fmt::format("moe_permute inp={} out={} slots={}", inp.describe(), out.describe(), row_of_slot.describe());
}
std::string MoePermuteBackwardArgs::key() const {
  return fmt::format("moe_permute_backward dout={} dinp={} slots={} acc={}", dout.describe(), dinp.describe(),
                     row_of_slot.describe(), accumulate ? 1 : 0);
}
std::string MoeUnpermuteArgs::key() const {
  return fmt::format("moe_unpermute inp={} out={} slots={} acc={}", inp.describe(), out.describe(),
                     row_of_slot.describe(), accumulate ? 1 : 0);
}
std::string MoeUnpermuteBackwardArgs::key() const {
  return fmt::format("moe_unpermute_backward dout={} inp={} slots={}", dout.describe(), inp.describe(),
                     row_of_slot.describe());
}

BackendType router_forward(const RouterForwardArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<RouterForwardArgs>(
      kMoeOp, PRIMUS_TURBO_FN(turbo_check_router_fwd), PRIMUS_TURBO_FN(turbo_router_fwd), cpu_check_router_fwd,
      cpu_router_fwd);
  return d->dispatch(args);
}
BackendType router_backward(const RouterBackwardArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<RouterBackwardArgs>(
      kMoeOp, PRIMUS_TURBO_FN(turbo_check_router_bwd), PRIMUS_TURBO_FN(turbo_router_bwd), cpu_check_router_bwd,
      cpu_router_bwd);
  return d->dispatch(args);
}
BackendType moe_random_logits(const MoeRandomLogitsArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<MoeRandomLogitsArgs>(
      kMoeOp, PRIMUS_TURBO_FN(turbo_check_random_logits), PRIMUS_TURBO_FN(turbo_random_logits), cpu_check_random_logits,
      cpu_random_logits);
  return d->dispatch(args);
}
BackendType moe_sequence_stats(const MoeSequenceStatsArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<MoeSequenceStatsArgs>(
      kMoeOp, PRIMUS_TURBO_FN(turbo_check_seq_stats), PRIMUS_TURBO_FN(turbo_seq_stats), cpu_check_seq_stats,
      cpu_seq_stats);
  return d->dispatch(args);
}
BackendType moe_plan_rows(const MoePlanArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<MoePlanArgs>(kMoeOp, PRIMUS_TURBO_FN(turbo_check_plan),
                                                                   PRIMUS_TURBO_FN(turbo_plan), cpu_check_plan, cpu_plan);
  return d->dispatch(args);
}
BackendType moe_permute(const MoePermuteArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<MoePermuteArgs>(
      kMoeOp, PRIMUS_TURBO_FN(turbo_check_permute), PRIMUS_TURBO_FN(turbo_permute), cpu_check_permute, cpu_permute);
  return d->dispatch(args);
}
BackendType moe_permute_backward(const MoePermuteBackwardArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<MoePermuteBackwardArgs>(
      kMoeOp, PRIMUS_TURBO_FN(turbo_check_permute_bwd), PRIMUS_TURBO_FN(turbo_permute_bwd), cpu_check_permute_bwd,
      cpu_permute_bwd);
  return d->dispatch(args);
}
BackendType moe_unpermute(const MoeUnpermuteArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<MoeUnpermuteArgs>(
      kMoeOp, PRIMUS_TURBO_FN(turbo_check_unpermute), PRIMUS_TURBO_FN(turbo_unpermute), cpu_check_unpermute,
      cpu_unpermute);
  return d->dispatch(args);
}
BackendType moe_unpermute_backward(const MoeUnpermuteBackwardArgs& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<MoeUnpermuteBackwardArgs>(
      kMoeOp, PRIMUS_TURBO_FN(turbo_check_unpermute_bwd), PRIMUS_TURBO_FN(turbo_unpermute_bwd), cpu_check_unpermute_bwd,
      cpu_unpermute_bwd);
  return d->dispatch(args);
}

size_t moe_scratch_bytes(int64_t N, int64_t K, int64_t E, int64_t capacity, DropPolicy policy) {
#ifdef PRIMUS_TURBO_WITH_CUDA
  // + 256: the borrows are 256-byte aligned in the arena.
  return std::max(cuda::router_forward_scratch_bytes(N, E), cuda::moe_plan_scratch_bytes(N, K, E, capacity, policy)) +
         256;
#else
  (void)N, (void)K, (void)E, (void)capacity, (void)policy;
  return 0;
#endif
}

}  // namespace primus::turbo
