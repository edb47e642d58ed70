// moe: the routing ops of an MoE layer (turbo/ops/moe.h) at the MoE presets' shapes (8192 tokens =
// 4 x 2048, hidden 2048 on a GPU; 256 tokens of 256 on the host), in GB/s of their minimal traffic
// (each input read once, each output written once):
//   router_fwd     logits in; probs, top-k indices and weights out (counts and sums are E-sized)
//   router_bwd     logits, dweight, top-k indices in; dlogits out
//   plan           top-k indices in, row_of_slot out: four small launches, bound by latency
//   plan_permute   the plan, then the tokens gathered into expert order (padding rows written as 0)
//   permute_bwd    the N*K kept rows in, the token gradients out
//   unpermute_fwd  the N*K kept rows and the weights in, the tokens out
//   unpermute_bwd  dout and the N*K kept rows in; dinp (padded) and dweight out
// Presets (configs/models/moe): olmoe-mini (E 64, top-8 softmax renormalised), mixtral-mini (E 8,
// top-2 softmax), deepseek-mini (E 64, top-6 sigmoid renormalised). Dropless, groups padded to 64
// rows (the grouped GEMM's fastest alignment); logits uniform in [-2, 2), so routing is near even.
#include <fmt/format.h>

#include <string>

#include "turbo/bench/harness.h"
#include "turbo/ops/moe.h"

namespace primus::turbo::bench {
namespace {

constexpr int64_t kMoeBenchAlign = 64;

struct MoeBenchPreset {
  std::string name;
  int64_t E, K;
  RouterScore score;
};

double moe_bytes(DType t, double n) { return static_cast<double>(dtype_size(t)) * n; }

Case moe_case(const MoeBenchPreset& m, int64_t N, int64_t C) {
  return {m.name, [=](CaseEnv& e) {
            const int64_t E = m.E, K = m.K, R = moe_permuted_rows_max(N, K, E, kMoeBenchAlign);
            const DType dt = e.dtype;
            RouterForwardArgs f;
            f.cfg.num_experts = E, f.cfg.topk = K, f.cfg.score = m.score;
            f.logits = e.rand(DType::F32, {N, E}, 2.0f);
            f.topk_idx = e.empty(DType::I32, {N, K}), f.topk_weight = e.empty(DType::F32, {N, K});
            f.probs = e.empty(DType::F32, {N, E}), f.counts = e.empty(DType::I32, {E});
            f.prob_sum = e.empty(DType::F32, {E}), f.z_sum = e.empty(DType::F32, {1});
            f.ctx = e.ctx;
            RouterBackwardArgs b;
            b.cfg = f.cfg;
            b.dlogits = e.empty(DType::F32, {N, E}), b.dweight = e.rand(DType::F32, {N, K});
            b.logits = f.logits, b.probs = f.probs, b.topk_idx = f.topk_idx, b.counts = f.counts;
            b.aux_coeff = 0.01, b.z_coeff = 0.001;
            b.ctx = e.ctx;
            MoePlanArgs p;
            p.topk_idx = f.topk_idx, p.topk_weight = f.topk_weight, p.counts = f.counts, p.align = kMoeBenchAlign;
            p.row_of_slot = e.empty(DType::I32, {N, K}), p.offsets = e.empty(DType::I32, {E + 1});
            p.kept = e.empty(DType::I32, {E});
            p.ctx = e.ctx;
            MoePermuteArgs pa;
            pa.inp = e.rand(dt, {N, C}), pa.out = e.zeros(dt, {R, C});
            pa.row_of_slot = p.row_of_slot, pa.offsets = p.offsets, pa.kept = p.kept, pa.ctx = e.ctx;
            MoePermuteBackwardArgs pb;
            pb.dout = e.rand(dt, {R, C}), pb.dinp = e.empty(dt, {N, C}), pb.row_of_slot = p.row_of_slot;
            pb.ctx = e.ctx;
            MoeUnpermuteArgs ua;
            ua.inp = e.rand(dt, {R, C}), ua.out = e.empty(dt, {N, C}), ua.weight = f.topk_weight;
            ua.row_of_slot = p.row_of_slot, ua.ctx = e.ctx;
            MoeUnpermuteBackwardArgs ub;
            ub.dinp = e.zeros(dt, {R, C}), ub.dweight = e.empty(DType::F32, {N, K}), ub.dout = e.rand(dt, {N, C});
            ub.inp = ua.inp, ub.weight = f.topk_weight, ub.row_of_slot = p.row_of_slot, ub.offsets = p.offsets;
            ub.kept = p.kept, ub.ctx = e.ctx;

            // The routing every timed call after the router sees, and the rows its groups span.
            router_forward(f);
            moe_plan_rows(p);
            e.dev.synchronize();
            const double used = e.dev.read(p.offsets).back(), slots = static_cast<double>(N * K);
            const double tokens = static_cast<double>(N * C), logits = static_cast<double>(N * E);
            const double idx_w = moe_bytes(DType::I32, slots) + moe_bytes(DType::F32, slots);
            const double plan = 2 * moe_bytes(DType::I32, slots);
            const std::string label = "/" + m.name;
            const std::string note = fmt::format("E {} K {} {}, {:.0f} rows of {} after padding", E, K,
                                                 m.score == RouterScore::Sigmoid ? "sigmoid" : "softmax", used, R);
            return std::vector<Timed>{
                {"router_fwd" + label, Metric::Bytes, 2 * moe_bytes(DType::F32, logits) + idx_w,
                 [f] { router_forward(f); }, note, {{"weight", f.topk_weight}, {"probs", f.probs}}},
                {"router_bwd" + label, Metric::Bytes, 2 * moe_bytes(DType::F32, logits) + idx_w,
                 [b] { router_backward(b); }, note, {{"dlogits", b.dlogits}}},
                {"plan" + label, Metric::Bytes, plan, [p] { moe_plan_rows(p); }, note},
                {"plan_permute" + label, Metric::Bytes, plan + moe_bytes(dt, tokens) + moe_bytes(dt, used * C),
                 [p, pa] {
                   moe_plan_rows(p);
                   moe_permute(pa);
                 },
                 note},
                {"permute_bwd" + label, Metric::Bytes, moe_bytes(dt, slots * C) + moe_bytes(dt, tokens),
                 [pb] { moe_permute_backward(pb); }, note, {{"dinp", pb.dinp}}},
                {"unpermute_fwd" + label, Metric::Bytes, moe_bytes(dt, slots * C) + moe_bytes(dt, tokens) + idx_w,
                 [ua] { moe_unpermute(ua); }, note, {{"out", ua.out}}},
                {"unpermute_bwd" + label, Metric::Bytes,
                 moe_bytes(dt, tokens) + moe_bytes(dt, slots * C) + moe_bytes(dt, used * C) + idx_w +
                     moe_bytes(DType::F32, slots),
                 [ub] { moe_unpermute_backward(ub); }, note, {{"dweight", ub.dweight}}}};
          }};
}

const MoeBenchPreset kMoePresets[] = {{"olmoe-mini", 64, 8, RouterScore::Softmax},
                                      {"mixtral-mini", 8, 2, RouterScore::Softmax},
                                      {"deepseek-mini", 64, 6, RouterScore::Sigmoid}};

}  // namespace

OpFamily moe_family() {
  OpFamily f;
  f.name = "moe";
  f.bench = "ops";
  f.dispatch_ops = {"moe"};
  f.backends = {BackendType::TURBO, BackendType::CPU};
  f.shape_syntax = "TxCxExK (tokens x hidden x experts x top-k): softmax router, dropless, groups padded to 64";
  f.defaults = [](const Scale& s) {
    std::vector<Case> cases;
    for (const MoeBenchPreset& m : kMoePresets) cases.push_back(moe_case(m, s.gpu ? 8192 : s.tokens, s.gpu ? 2048 : 256));
    return cases;
  };
  f.from_shape = [syntax = f.shape_syntax](const std::string& shape) {
    const auto d = parse_dims("moe", shape, 4, syntax);
    return moe_case({shape, d[2], d[3], RouterScore::Softmax}, d[0], d[1]);
  };
  return f;
}

}  // namespace primus::turbo::bench
