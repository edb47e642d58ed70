#include "backends/cuda/model/decoder.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "backends/cuda/nvtx.h"
#include "core/util/error.h"
#include "turbo/kernels/cpu/loss.h"
#include "turbo/kernels/cuda/document_masks.h"
#include "turbo/kernels/cuda/elementwise.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/cast.h"
#include "turbo/ops/embedding.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/gemm_fp8.h"
#include "turbo/ops/grouped_gemm.h"
#include "turbo/ops/head_norm.h"
#include "turbo/ops/moe.h"
#include "turbo/ops/normalization.h"
#include "turbo/ops/rope.h"

namespace primus::backends::cuda {

namespace {

TensorView view(const TensorView& buf, std::initializer_list<int64_t> shape) {  // same memory, new shape
  return TensorView(buf.data, buf.dtype, buf.device, shape);
}

}  // namespace

std::vector<int64_t> grad_ready_points(const train::ParamLayout& layout) {
  std::vector<int64_t> pts;
  pts.push_back(layout.get("final_norm.weight").offset);
  for (int64_t l = 0;; ++l) {
    if (!layout.find(fmt::format("layers.{}.norm1.weight", l))) break;
    pts.insert(pts.begin() + 1, layout.get(fmt::format("layers.{}.norm1.weight", l)).offset);
  }
  pts.push_back(0);
  return pts;
}

Decoder::Decoder(const train::ModelSpec& spec, const train::ParamLayout& layout, const DecoderOptions& opt,
                 const CudaOps& ops, const MemoryPlan& plan, const ExecContext& ctx)
    : spec_(spec),
      opt_(opt),
      max_batch_(plan.options().max_batch),
      max_seq_(plan.options().max_seq),
      ones_pad_(plan.options().ones_pad),
      ops_(ops),
      edge_ops_(ops),
      p_(plan.params),
      a_(plan.acts),
      rope_table_(plan.state.rope_table),
      loss_slots_(plan.state.loss_slots),
      ctx_(ctx),
      policy_(plan.policy()) {
  sp_ = opt_.tp && opt_.tp->map().sequence_parallel();
  if (opt_.bf16_edge_layers > 0) {
    const CudaOps bf16 = CudaOps::defaults();
    edge_ops_.linear_forward = bf16.linear_forward;
    edge_ops_.linear_backward = bf16.linear_backward;
    edge_ops_.linear_backward_dgelu = bf16.linear_backward_dgelu;
    edge_ops_.moe_experts = bf16.moe_experts;
    edge_ops_.moe_experts_dgrad = bf16.moe_experts_dgrad;
    edge_ops_.moe_experts_wgrad = bf16.moe_experts_wgrad;
  }
  final_norm_ready_ = layout.get("final_norm.weight").offset;
  for (int64_t l = 0; l < spec_.num_layers; ++l)
    layer_ready_.push_back(layout.get(fmt::format("layers.{}.norm1.weight", l)).offset);
  const train::MoeSpec& e = spec_.moe;
  router_.num_experts = e.num_experts;
  router_.topk = e.topk;
  router_.score = e.sigmoid ? turbo::RouterScore::Sigmoid : turbo::RouterScore::Softmax;
  router_.pre_softmax = e.pre_softmax;
  router_.num_groups = e.num_groups;
  router_.group_topk = e.group_topk;
  router_.scaling_factor = e.topk_scaling_factor;
  moe_align_ = plan.options().moe_align;
  int64_t m = 0;
  for (int64_t l = 0; l < spec_.num_layers; ++l) moe_index_.push_back(spec_.is_moe_layer(l) ? m++ : -1);
}

// ---- forward ------------------------------------------------------------------------------

void Decoder::norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                           const TensorView& res_out, const TensorView& inp, const TensorView& residual,
                           const NormParams& p, int64_t N) {
  turbo::NormForwardArgs a;
  a.type = spec_.layernorm ? turbo::NormType::LayerNorm : turbo::NormType::RMSNorm;
  a.out = out.slice0(0, N);
  if (spec_.layernorm) a.mean = mean.slice0(0, N);
  a.rstd = rstd.slice0(0, N);
  a.inp = inp.slice0(0, N);
  if (residual.defined()) {
    a.residual = residual.slice0(0, N);
    a.residual_out = res_out.slice0(0, N);
  }
  a.weight = p.weight.w;
  a.bias = p.bias.w;
  a.eps = static_cast<float>(spec_.norm_epsilon);
  a.ctx = ctx_;
  ops_.norm_forward(a);
}

void Decoder::layer_forward(int64_t l, int64_t B, int64_t T, bool recompute) {
  const int64_t N = B * T;
  const int64_t H = spec_.num_attention_heads, KV = spec_.num_query_groups;
  const int64_t D = spec_.head_dim(), KVD = spec_.kv_dim(), QD = spec_.q_dim();
  const ExecContext c = ctx_;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  auto phase = [&](Phase p) {
    if (!recompute) mark(p);  // a recomputation is one Phase::Recompute span
  };
  const LayerActs& a = a_.layers[l];
  const LayerParams& p = p_.layers[l];
  lin_ = linears_for(l);
  phase(Phase::Norm);
  const int64_t n = local_rows(N);  // the residual stream's rows here (sequence parallelism: N / tp)
  if (l == 0 || recompute) {
    norm_forward(mine(a.ln1, N), a.mean1, a.rstd1, {}, a.x_in, {}, p.norm1, n);
  } else {  // x_in = x2 of the layer below + its MLP output (in a_.tmp), fused with norm1
    norm_forward(mine(a.ln1, N), a.mean1, a.rstd1, a.x_in, mine(a_.tmp, N), a_.layers[l - 1].x2, p.norm1, n);
  }
  gather(a.ln1, N);
  const TensorView ln1 = a.ln1.slice0(0, N);
  const TensorView& wqkv = p.qkv_w.w;
  const TensorView& bqkv = p.qkv_b.w;
  phase(Phase::QkvGemm);
  // One GEMM for q|k|v: its output rows pack them, and the attention reads strided views.
  const TensorView qkv = a.qkv.slice0(0, N);
  lin_->linear_forward(qkv, ln1, wqkv, bqkv, {}, c);
  const TensorView q4 = heads(qkv, B, T, 0, H), k4 = heads(qkv, B, T, QD, KV), v4 = heads(qkv, B, T, QD + KVD, KV);
  if (spec_.qk_layernorm) {  // in place on q|k, before RoPE; the pre-norm values are kept for the backward
    phase(Phase::Norm);
    if (spec_.qk_norm_whole) {
      qk_norm_whole(a, p, qkv, N, false);
    } else {
      turbo::head_norm(qk_norm_args(a, p, qkv, B, T));
    }
  }
  if (spec_.rope) {  // in place on q|k (adjacent columns, one rotation per position): only the rotated ones are needed later
    phase(Phase::Rope);
    const TensorView qk4 = heads(qkv, B, T, 0, H + KV);
    turbo::RopeArgs r;
    r.out = qk4;
    r.inp = qk4;
    r.positions = positions(B, T);
    r.table = rope_table_;
    r.base = spec_.rotary_base;
    r.scaling = spec_.rope_scaling;
    r.ctx = c;
    turbo::rope(r);
  }
  if (opt_.cp) {
    phase(Phase::Attention);
    opt_.cp->forward(a.att.slice0(0, N), a.lse.slice0(0, N * H), qkv, B, T, scale, c);
  } else {
  AttentionCall at;
  at.out = view(a.att, {B, T, H, D});
  at.lse = view(a.lse, {B, H, T});
  at.q = q4;
  at.k = k4;
  at.v = v4;
  at.scale = scale;
  at.window = spec_.sliding_window;
  at.cu_seqlens = doc_cu_seqlens(B, T);
  at.ctx = c;
  phase(Phase::Attention);
  ops_.attention_forward(at);
  }
  phase(Phase::ProjGemm);
  lin_->linear_forward(a_.tmp.slice0(0, N), a.att.slice0(0, N), p.proj_w.w, row_bias(p.proj_b), {}, c);
  row_sum(a_.tmp, N);
  phase(Phase::Norm);
  norm_forward(mine(a.ln2, N), a.mean2, a.rstd2, a.x2, mine(a_.tmp, N), a.x_in, p.norm2, n);
  gather(a.ln2, N);
  if (spec_.is_moe_layer(l)) {
    if (!recompute) {
      moe_forward(l, N);
      row_sum(a_.tmp, N);  // tensor parallelism: each rank's slice of every expert gave a part
    } else {  // full recompute: the experts again on the saved routing (the output is not needed)
      moe_recompute(l, N, true);
    }
    return;
  }
  phase(Phase::MlpUpGemm);
  if (spec_.swiglu || opt_.gelu_unfused_forward) {
    lin_->linear_forward(a.fc.slice0(0, N), a.ln2.slice0(0, N), p.fc_w.w, p.fc_b.w, {}, c);
    phase(Phase::Activation);
    // The next FP8 call that reads act: the down-projection's forward, or after a full
    // recomputation its weight gradient (transposed copy). Rowwise: the maxima pay where the
    // column-scaled copy is written (the saved FP8 copy, the weight gradient); the forward's
    // row-scaled copy alone is one pass anyway. Tensorwise: always.
    const TensorView act = a.act.slice0(0, N);
    if (folds_swiglu(l)) {
      put_swiglu(l, N, false);  // the down-projection's quantizer computes act
    } else {
      const bool pays = opt_.fp8_maxima && (recompute || a.act_q.defined() ||
                                            opt_.fp8_maxima->granularity() == turbo::Fp8Granularity::Tensor);
      const TensorView mx = spec_.swiglu && pays ? swiglu_maxima(l, act) : TensorView();
      turbo::activation_forward({spec_.swiglu ? turbo::Activation::SwiGLU : turbo::Activation::Gelu, act,
                                 a.fc.slice0(0, N), c, mx});
      put_maxima(act, mx);
    }
  } else {  // GELU fused into the GEMM epilogue; fc keeps the pre-activation for the backward
    lin_->linear_forward(a.act.slice0(0, N), a.ln2.slice0(0, N), p.fc_w.w, p.fc_b.w, a.fc.slice0(0, N), c);
  }
  if (recompute) return;  // the MLP output only feeds the next layer's forward
  phase(Phase::MlpDownGemm);
  lin_->linear_forward(a_.tmp.slice0(0, N), a.act.slice0(0, N), p.out_w.w, row_bias(p.out_b), {}, c);
  row_sum(a_.tmp, N);
}

// Document masking: slot_'s tables, built from its tokens before the embedding. On the device a
// kernel writes them (so a captured step replays it on each micro-batch's tokens); in host mode
// the host loop that kernel mirrors.
void Decoder::build_document_tables(int64_t B, int64_t T) {
  const int64_t N = B * T, at = slot_ * max_batch_ * max_seq_, cu_at = slot_ * (max_batch_ * max_seq_ + 1);
  const TensorView tokens = a_.tokens.slice0(at, at + N);
  int32_t* pos = a_.doc_positions.ptr<int32_t>() + at;
  int32_t* cu = a_.doc_cu.ptr<int32_t>() + cu_at;
  const int32_t eod = opt_.document_masking.eod_id;
  if (tokens.device == turbo::Device::CPU) {
    train::build_fixed_document_tables(tokens.ptr<const int32_t>(), B, T, eod, pos, cu);
  } else {
    turbo::cuda::build_document_tables(tokens.ptr<const int32_t>(), B, T, eod, pos, cu,
                                       static_cast<cudaStream_t>(ctx_.stream));
  }
}

TensorView Decoder::doc_positions(int64_t B, int64_t T) const {
  if (!opt_.document_masking.reset_position_ids) return {};
  const int64_t at = slot_ * max_batch_ * max_seq_;
  return view(a_.doc_positions.slice0(at, at + B * T), {B, T});
}

TensorView Decoder::doc_cu_seqlens(int64_t B, int64_t T) const {
  if (!opt_.document_masking.reset_attention_mask) return {};
  const int64_t at = slot_ * (max_batch_ * max_seq_ + 1);
  return a_.doc_cu.slice0(at, at + B * T + 1);
}

void Decoder::forward(int64_t B, int64_t T, float dloss, int64_t slot) {
  const int64_t N = B * T;
  NvtxRange range("forward");
  B_ = B;
  T_ = T;
  slot_ = slot;
  dloss_ = dloss;
  const int64_t C = spec_.hidden_size;
  const ExecContext c = ctx_;
  const int64_t at = slot * max_batch_ * max_seq_;
  const TensorView targets = a_.targets.slice0(at, at + N);

  if (opt_.document_masking.enabled()) build_document_tables(B, T);
  {
    mark(Phase::Embedding);
    turbo::EmbeddingArgs e;
    e.out = view(sp_ ? a_.tmp : a_.layers[0].x_in, {B, T, C});  // sp: the whole batch, then this rank's rows
    e.tokens = view(a_.tokens.slice0(at, at + N), {B, T});
    e.positions = positions(B, T);
    e.wte = p_.wte.w;
    e.wpe = p_.wpe.w;
    e.ctx = c;
    if (opt_.tp) {  // each rank its vocabulary rows (zeros for the others), rank 0 the positions; then the sum
      e.vocab_begin = opt_.tp->map().vocab_begin();
      if (opt_.tp->rank() != 0) e.wpe = TensorView();
    }
    turbo::embedding_forward(e);
    if (sp_) {
      if (N % opt_.tp->size() != 0)
        throw RuntimeError(fmt::format("sequence parallelism: {} tokens do not split over {} ranks", N, opt_.tp->size()));
      row_sum(a_.tmp, N);
      turbo::copy_rows(a_.layers[0].x_in.slice0(0, local_rows(N)), mine(a_.tmp, N), c);
    } else {
      tp_sum(a_.layers[0].x_in.slice0(0, N));
    }
  }
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    NvtxRange lr(fmt::format("layer {} fwd", l).c_str());
    if (opt_.fsdp) opt_.fsdp->use_layer(l, false);
    layer_forward(l, B, T, false);
  }
  {
    NvtxRange hr("head + loss");
    mark(Phase::Norm);
    norm_forward(mine(a_.lnf, N), a_.meanf, a_.rstdf, a_.x_final, mine(a_.tmp, N), a_.layers.back().x2, p_.final_norm,
                 local_rows(N));
    gather(a_.lnf, N);
    // Masked targets: the loss is the mean over the targets that keep one, counted here on the
    // device (a captured step replays for any batch) and over the context-parallel group (whose
    // ranks hold parts of the same sequences). The gradient's scale dloss x N (x cp) / kept is
    // dloss' 1 / N (mean over this rank's tokens) with kept for N; the balancing terms keep dloss.
    float ce_dloss = dloss, numerator = 1.0f;
    TensorView kept;
    if (opt_.masked_loss) {
      kept = a_.kept;
      turbo::count_kept(kept, targets, turbo::cpu::kIgnoreIndex, c);  // what the trainer masks with
      const int64_t cp = opt_.cp ? static_cast<int64_t>(opt_.cp->size()) : 1;
      if (opt_.cp) opt_.cp->all_reduce_sum(kept);
      numerator = static_cast<float>(N * cp);
      ce_dloss = static_cast<float>(static_cast<double>(dloss) * static_cast<double>(N * cp));
    }
    // Unfused weight gradient (DecoderOptions::unfused_wgrad): the row blocks' products sum in f32
    // scratch, rounded and added to the head's gradient once, after the last block.
    std::optional<turbo::ArenaScope> head_scope;
    TensorView head_g = p_.head.g;
    const bool head_accumulate = !fresh_head_;
    if (dloss != 0.0f && opt_.unfused_wgrad && p_.head.g.dtype == turbo::DType::F32) {
      head_scope.emplace(*c.scratch);
      head_g = scratch_like(p_.head.g);
    }
    for (int64_t r0 = 0; r0 < N; r0 += a_.head_rows) {
      const int64_t r1 = std::min(N, r0 + a_.head_rows);
      const TensorView logits = a_.logits.slice0(0, r1 - r0), lnf = a_.lnf.slice0(r0, r1);
      mark(Phase::HeadGemm);
      ops_.head_forward(logits, lnf, p_.head.w, {}, {}, c);
      mark(Phase::Loss);
      if (opt_.tp) {
        tp_loss(logits, targets.slice0(r0, r1), a_.losses.slice0(r0, r1), ce_dloss, kept);
      } else {
        turbo::CrossEntropyArgs ce;
        ce.logits = logits;
        if (dloss != 0.0f) ce.dlogits = logits;  // in place: no second [rows,V] buffer
        ce.losses = a_.losses.slice0(r0, r1);
        ce.targets = targets.slice0(r0, r1);
        ce.vocab = spec_.vocab_size;
        ce.dloss = ce_dloss;
        ce.kept = kept;
        ce.ctx = c;
        ops_.cross_entropy(ce);
      }
      // The head's backward now, while this block's dlogits exist: d(final norm output) into
      // a_.dln (untouched until backward() reads it) and the head weight's gradient (+=).
      if (dloss != 0.0f) {
        mark(Phase::HeadGemmBwd);
        const bool accumulate = head_scope ? r0 > 0 : !fresh_head_;
        ops_.head_backward(a_.dln.slice0(r0, r1), head_g, {}, logits, lnf, p_.head.w, false, c, accumulate);
        fresh_head_ = false;
      }
    }
    if (head_scope) turbo::add_gradient(p_.head.g, head_g, p_.head.w.dtype, head_accumulate, c);
    if (dloss != 0.0f) row_sum(a_.dln, N);  // each rank's vocabulary rows gave a part of d(final norm output)
    mark(Phase::Loss);
    turbo::sum_f32(loss_slots_.slice0(slot, slot + 1), a_.losses.slice0(0, N), c, kept, numerator);
  }
  have_grad_logits_ = dloss != 0.0f;
  if (have_grad_logits_) {
    train_tokens_ = N;
    train_seq_ = T;
  }
}

void Decoder::norm_backward(const TensorView& dres, const TensorView& dout, const TensorView& inp,
                            const TensorView& mean, const TensorView& rstd, const NormParams& p, int64_t N,
                            bool accumulate, const TensorView& dres_colsum) {
  turbo::NormBackwardArgs a;
  a.type = spec_.layernorm ? turbo::NormType::LayerNorm : turbo::NormType::RMSNorm;
  a.dinp = dres.slice0(0, N);
  a.dweight = p.weight.g;
  a.dbias = p.bias.g;
  a.dout = dout.slice0(0, N);
  a.inp = inp.slice0(0, N);
  a.weight = p.weight.w;
  if (spec_.layernorm) a.mean = mean.slice0(0, N);
  a.rstd = rstd.slice0(0, N);
  a.accumulate_dinp = accumulate;
  if (norm_colsum()) a.dinp_colsum = dres_colsum;
  a.ctx = ctx_;
  ops_.norm_backward(a);
}

TensorView Decoder::with_ones(const TensorView& t) const {
  if (ones_pad_ == 0 || t.ndim != 2 || t.stride(0) != t.size(1) + ones_pad_) return {};
  return TensorView(t.data, t.dtype, t.device, {t.size(0), t.stride(0)});
}

TensorView Decoder::scratch_like(const TensorView& g) const {
  if (!g.is_contiguous()) throw RuntimeError(fmt::format("cuda model: a weight gradient {} is not contiguous", g.describe()));
  TensorView s = g;
  s.dtype = turbo::DType::F32;
  s.data = ctx_.scratch->allocate(size_t(g.numel()) * 4, turbo::Arena::kDefaultAlign, "unfused weight gradient");
  return s;
}

template <class Product>
void Decoder::weight_grad(const TensorView& g, turbo::DType weight_dtype, bool accumulate, Product&& product) {
  if (!opt_.unfused_wgrad || !g.defined() || g.dtype != turbo::DType::F32) {
    product(g, accumulate);
    return;
  }
  turbo::ArenaScope scope(*ctx_.scratch);
  const TensorView s = scratch_like(g);
  product(s, false);
  turbo::add_gradient(g, s, weight_dtype, accumulate, ctx_);
}

void Decoder::linear_backward(const TensorView& dinp, const Param& w, const Param& b, const TensorView& dout,
                              const TensorView& inp, bool bias_done) {
  const ExecContext c = ctx_;
  // (the bias gradients add into b.g whatever the weight gradient's accumulate says)
  weight_grad(w.g, w.w.dtype, !fresh_layers_, [&](const TensorView& dw, bool accumulate) {
    if (b.g.defined() && !bias_done) {
      if (const TensorView ones = with_ones(inp); ones.defined()) {  // [weight | bias] gradient from one GEMM
        if (dinp.defined()) lin_->linear_backward(dinp, {}, {}, dout, inp, w.w, false, c, true);
        ops_.linear_weight_grad_ones(dw, b.g, dout, ones, c, accumulate);
        return;
      }
    }
    if (b.g.defined() && opt_.bias_grad != BiasGrad::Gemm) {  // first: dout was just written, partly still in L2
      if (!bias_done) ops_.bias_grad(b.g, dout, c);
      lin_->linear_backward(dinp, dw, {}, dout, inp, w.w, false, c, accumulate);
      return;
    }
    lin_->linear_backward(dinp, dw, b.g, dout, inp, w.w, false, c, accumulate);
  });
}

void Decoder::recompute_layer(int64_t l, int64_t B, int64_t T) {
  const Recompute r = policy_[l];
  if (r == Recompute::None) return;
  NvtxRange range(fmt::format("layer {} recompute ({})", l, recompute_name(r)).c_str());
  mark(Phase::Recompute);
  if (r == Recompute::Full) {
    layer_forward(l, B, T, true);
    return;
  }
  // Norms and selective: both norms from their stored inputs (the fused forward normalised the
  // same rounded residual it stored); selective also the MLP activation from its pre-activation.
  const int64_t N = B * T;
  const LayerActs& a = a_.layers[l];
  const LayerParams& p = p_.layers[l];
  norm_forward(mine(a.ln1, N), a.mean1, a.rstd1, {}, a.x_in, {}, p.norm1, local_rows(N));
  gather(a.ln1, N);
  norm_forward(mine(a.ln2, N), a.mean2, a.rstd2, {}, a.x2, {}, p.norm2, local_rows(N));
  gather(a.ln2, N);
  if (r == Recompute::Norms) return;
  if (spec_.is_moe_layer(l)) {
    moe_recompute(l, N, false);
    return;
  }
  // The MLP down-projection's weight gradient quantizes this act (transposed) next; folded, it
  // computes act itself (the backward puts its producer).
  if (folds_swiglu(l)) return;
  const TensorView act = a.act.slice0(0, N);
  const TensorView mx = spec_.swiglu ? swiglu_maxima(l, act) : TensorView();
  turbo::activation_forward({spec_.swiglu ? turbo::Activation::SwiGLU : turbo::Activation::Gelu, act,
                             a.fc.slice0(0, N), ctx_, mx});
  put_maxima(act, mx);
}

bool Decoder::folds_swiglu(int64_t l) const {
  if (!opt_.fp8_producers || !spec_.swiglu || linears_for(l) != &ops_ || spec_.is_moe_layer(l)) return false;
  const LayerParams& p = p_.layers[l];
  return !p.fc_b.w.defined() && !p.out_b.w.defined();  // the bias gradients read act and dgate_up themselves
}

void Decoder::put_swiglu(int64_t l, int64_t N, bool backward) const {
  const LayerActs& a = a_.layers[l];
  const TensorView fc = a.fc.slice0(0, N);
  if (backward)
    opt_.fp8_producers->put(a_.dfc.slice0(0, N), {turbo::QuantizePrologue::SwiGLUBackward, a_.dact.slice0(0, N), fc});
  else
    opt_.fp8_producers->put(a.act.slice0(0, N), {turbo::QuantizePrologue::SwiGLU, fc, {}});
}

TensorView Decoder::swiglu_maxima(int64_t l, const TensorView& y) const {
  if (!opt_.fp8_maxima || !a_.fp8_maxima.defined() || linears_for(l) != &ops_) return {};
  return a_.fp8_maxima.slice0(0, y.size(0) + y.size(1) + 1);
}

void Decoder::put_maxima(const TensorView& y, const TensorView& maxima) const {
  if (maxima.defined()) opt_.fp8_maxima->put(y, maxima);
}

turbo::HeadNormArgs Decoder::qk_norm_args(const LayerActs& a, const LayerParams& p, const TensorView& buf, int64_t B,
                                          int64_t T) const {
  const int64_t H = spec_.num_attention_heads, KV = spec_.num_query_groups, D = spec_.head_dim();
  turbo::HeadNormArgs hn;
  hn.x = heads(buf, B, T, 0, H + KV);
  hn.saved = view(a.qk_pre, {B, T, H + KV, D});
  hn.rstd = a.rstd_qk.slice0(0, B * T * (H + KV));
  hn.weight = p.q_norm.w;
  hn.weight_k = p.k_norm.w;
  hn.q_heads = H;
  hn.eps = static_cast<float>(spec_.norm_epsilon);
  hn.ctx = ctx_;
  return hn;
}

// The rows of q (k) are the q (k) columns of the packed buffer; the norm op reads dense rows and
// writes strided ones, and its backward reads and writes dense rows: so the forward copies the
// projection's q and k into qk_pre (dense [N, QD] then [N, KVD]: the norm's input, kept for the
// backward) and normalises from there into the packed columns; the backward copies d(normed q|k)
// out of dqkv into dense rows (dqk_dense), runs the norm's backward into datt (dead after the
// attention's backward) and copies the result back into dqkv's columns.
void Decoder::qk_norm_whole(const LayerActs& a, const LayerParams& p, const TensorView& buf, int64_t N,
                            bool backward) {
  const int64_t QD = spec_.q_dim(), KVD = spec_.kv_dim(), W = buf.size(1);
  const size_t es = turbo::dtype_size(buf.dtype);
  auto cols = [&](int64_t col, int64_t width) {  // [N, width] columns of the packed buffer
    TensorView v(static_cast<char*>(buf.data) + size_t(col) * es, buf.dtype, buf.device, {N, width});
    v.strides = {W, 1};
    return v;
  };
  auto dense = [&](const TensorView& flat, int64_t at, int64_t width) {  // [N, width] at element `at`
    return TensorView(static_cast<char*>(flat.data) + size_t(at) * turbo::dtype_size(flat.dtype), flat.dtype,
                      flat.device, {N, width});
  };
  const int64_t Nmax = a.qk_pre.size(0);  // k's dense rows start after all of q's, at the planned bound
  struct Part {
    int64_t col, width, at;
    const Param& w;
  };
  const Part parts[] = {{0, QD, 0, p.q_norm}, {QD, KVD, Nmax * QD, p.k_norm}};
  for (size_t i = 0; i < 2; ++i) {
    const Part& pt = parts[i];
    const TensorView pre = dense(a.qk_pre, pt.at, pt.width), packed = cols(pt.col, pt.width);
    const TensorView rstd = a.rstd_qk.slice0(int64_t(i) * Nmax, int64_t(i) * Nmax + N);
    if (!backward) {
      turbo::copy_rows(pre, packed, ctx_);
      turbo::NormForwardArgs n;
      n.type = turbo::NormType::RMSNorm;
      n.out = packed;
      n.rstd = rstd;
      n.inp = pre;
      n.weight = pt.w.w;
      n.eps = static_cast<float>(spec_.norm_epsilon);
      n.ctx = ctx_;
      ops_.norm_forward(n);
      continue;
    }
    const TensorView dout = dense(a_.dqk_dense, pt.at, pt.width), dinp = dense(a_.datt, 0, pt.width);
    turbo::copy_rows(dout, packed, ctx_);
    turbo::NormBackwardArgs n;
    n.type = turbo::NormType::RMSNorm;
    n.dinp = dinp;
    n.dweight = pt.w.g;
    n.dout = dout;
    n.inp = pre;
    n.weight = pt.w.w;
    n.rstd = rstd;
    n.accumulate_dinp = false;
    n.ctx = ctx_;
    ops_.norm_backward(n);
    turbo::copy_rows(packed, dinp, ctx_);
  }
}

void Decoder::moe_recompute(int64_t l, int64_t N, bool gemms) {
  const ExecContext c = ctx_;
  const MoeActs& m = a_.moe[l];
  const MoeParams& mp = p_.layers[l].moe;
  const TensorView ln2 = a_.layers[l].ln2.slice0(0, N);
  // The permute alone (the saved row plan stands): a dispatch would plan the rows again. Expert
  // parallelism: the rows go to their experts' ranks again by the layer's saved move plan (no host
  // read; every rank recomputes the same layers in the same order, so the all-to-alls pair up),
  // and with the GEMMs the held output comes back for the combine's backward (it reads yp).
  EpComm* ep = opt_.ep;
  const int64_t mi = ep ? moe_index_.at(l) : 0;
  const TensorView& groups = ep ? m.held_offsets : m.offsets;
  turbo::moe_permute({ep ? a_.moe_xl : m.xp, ln2, m.rows.slice0(0, N), m.offsets, moe_kept(slot_, l), c});
  if (ep) ep->dispatch(mi, a_.moe_xl, m.xp, a_.ep_send, a_.ep_recv);
  if (gemms && opt_.moe_swiglu_epilogue) {
    lin_->moe_experts({m.h, m.xp, mp.fc.w, groups, moe_align_, c, m.act});
  } else {
    if (gemms) lin_->moe_experts({m.h, m.xp, mp.fc.w, groups, moe_align_, c});
    turbo::activation_forward({turbo::Activation::SwiGLU, m.act, m.h, c});
  }
  if (gemms) lin_->moe_experts({ep ? a_.moe_yh : m.yp, m.act, mp.proj.w, groups, moe_align_, c});
  if (gemms && ep) ep->combine(mi, a_.moe_yh, m.yp, a_.ep_send, a_.ep_recv);
  if (mp.shared_fc.w.defined()) {  // the shared expert's output itself is not needed: only its inputs
    if (gemms) lin_->linear_forward(m.sfc.slice0(0, N), ln2, mp.shared_fc.w, {}, {}, c);
    turbo::activation_forward({turbo::Activation::SwiGLU, m.sact.slice0(0, N), m.sfc.slice0(0, N), c});
  }
}

void Decoder::backward() {
  if (!have_grad_logits_) throw RuntimeError("cuda model: backward() needs a forward with dloss != 0 first");
  have_grad_logits_ = false;
  NvtxRange range("backward");
  const int64_t B = B_, T = T_, N = B * T;
  const int64_t C = spec_.hidden_size, H = spec_.num_attention_heads, KV = spec_.num_query_groups;
  const int64_t D = spec_.head_dim(), KVD = spec_.kv_dim(), QD = spec_.q_dim();
  const ExecContext c = ctx_;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  {
    NvtxRange hr("final norm bwd");
    // forward() already ran the head's backward into a_.dln and p_.head.g.
    // dres = d(final residual): the start of the residual stream's gradient.
    mark(Phase::NormBwd);
    norm_backward(mine(a_.dres, N), mine(a_.dln, N), a_.x_final, a_.meanf, a_.rstdf, p_.final_norm, local_rows(N), false,
                  p_.layers.back().out_b.g);
    ready(final_norm_ready_);
  }
  const TensorView dres = a_.dres.slice0(0, N);
  for (int64_t l = spec_.num_layers - 1; l >= 0; --l) {
    NvtxRange lr(fmt::format("layer {} bwd", l).c_str());
    if (opt_.fsdp) opt_.fsdp->use_layer(l, true);
    recompute_layer(l, B, T);  // no-op unless the layer's policy dropped activations
    lin_ = linears_for(l);
    const LayerActs& a = a_.layers[l];
    const LayerParams& p = p_.layers[l];
    const int64_t n = local_rows(N);
    gather(a_.dres, N);  // sp: the row-parallel GEMMs' output gradient over the whole batch
    if (spec_.is_moe_layer(l)) {
      moe_backward(l, N);
      row_sum(a_.dln, N);  // each rank's expert slices and its part of the router's gradient
    } else {
    // MLP: dres is the gradient of the layer output x2 + mlp(ln2(x2)).
    const TensorView dfc = a_.dfc.slice0(0, N), act = a.act.slice0(0, N), fc = a.fc.slice0(0, N);
    mark(Phase::MlpDownGemmBwd);
    if (spec_.swiglu) {
      const TensorView dact = a_.dact.slice0(0, N);
      const bool fold = folds_swiglu(l);
      if (fold) put_swiglu(l, N, false);  // act was never written: its weight gradient computes it
      linear_backward(dact, p.out_w, p.out_b, dres, act, norm_colsum());
      mark(Phase::ActivationBwd);
      if (fold) {
        put_swiglu(l, N, true);  // the up-projection's gradients compute dgate_up as they quantize it
      } else {
        const TensorView mx = swiglu_maxima(l, dfc);  // for the up-projection's gradients right after
        turbo::activation_backward({turbo::Activation::SwiGLU, dfc, fc, dact, false, c, mx});
        put_maxima(dfc, mx);
      }
    } else if (opt_.gelu_unfused_backward) {
      linear_backward(dfc, p.out_w, p.out_b, dres, act, norm_colsum());  // dfc = d(act) here
      mark(Phase::ActivationBwd);
      turbo::activation_backward({turbo::Activation::Gelu, dfc, fc, dfc, false, c});  // in place
    } else {
      lin_->linear_backward_dgelu(dfc, {}, dres, p.out_w.w, fc, c);
      linear_backward({}, p.out_w, p.out_b, dres, act, norm_colsum());
    }
    mark(Phase::MlpUpGemmBwd);
    linear_backward(a_.dln.slice0(0, N), p.fc_w, p.fc_b, dfc, a.ln2.slice0(0, N));
    row_sum(a_.dln, N);  // column-parallel: each rank's slice of the FFN gave a part
    }
    mark(Phase::NormBwd);
    norm_backward(mine(a_.dres, N), mine(a_.dln, N), a.x2, a.mean2, a.rstd2, p.norm2, n, true, p.proj_b.g);
    gather(a_.dres, N);
    // Attention: dres is now the gradient of x2 = x_in + proj(attention(ln1(x_in))).
    mark(Phase::ProjGemmBwd);
    linear_backward(a_.datt.slice0(0, N), p.proj_w, p.proj_b, dres, a.att.slice0(0, N), norm_colsum());
    const TensorView dqkv = a_.dqkv.slice0(0, N), qkv = a.qkv.slice0(0, N);
    // With RoPE the attention's gradients are those of the rotated q/k (a_.dqk_rot); the rotation's
    // backward then writes dq|dk into dqkv (out of place: the reference RoPE cannot run in place).
    const TensorView dqk_rot = spec_.rope ? a_.dqk_rot.slice0(0, N) : TensorView();
    mark(Phase::AttentionBwd);
    if (opt_.cp) {
      const TensorView& dqk = spec_.rope ? dqk_rot : dqkv;
      opt_.cp->backward(columns(dqk, 0, QD), columns(dqk, QD, KVD), columns(dqkv, QD + KVD, KVD), a_.datt.slice0(0, N),
                        qkv, a.att.slice0(0, N), a.lse.slice0(0, N * H), B, T, scale, c);
    } else {
    AttentionGradCall g;
    g.dq = spec_.rope ? heads(dqk_rot, B, T, 0, H) : heads(dqkv, B, T, 0, H);
    g.dk = spec_.rope ? heads(dqk_rot, B, T, QD, KV) : heads(dqkv, B, T, QD, KV);
    g.dv = heads(dqkv, B, T, QD + KVD, KV);
    g.dout = view(a_.datt, {B, T, H, D});
    g.q = heads(qkv, B, T, 0, H);
    g.k = heads(qkv, B, T, QD, KV);
    g.v = heads(qkv, B, T, QD + KVD, KV);
    g.out = view(a.att, {B, T, H, D});
    g.lse = view(a.lse, {B, H, T});
    g.scale = scale;
    g.window = spec_.sliding_window;
    g.cu_seqlens = doc_cu_seqlens(B, T);
    g.ctx = c;
    ops_.attention_backward(g);
    }
    if (spec_.rope) {  // one rotation for dq|dk: they sit side by side in both buffers
      mark(Phase::RopeBwd);
      turbo::RopeArgs r;
      r.backward = true;
      r.out = heads(dqkv, B, T, 0, H + KV);
      r.inp = heads(dqk_rot, B, T, 0, H + KV);
      r.positions = positions(B, T);
      r.table = rope_table_;
      r.base = spec_.rotary_base;
      r.scaling = spec_.rope_scaling;
      r.ctx = c;
      turbo::rope(r);
    }
    if (spec_.qk_layernorm) {  // dq|dk of the normed q|k -> of the projection's, in place; the two weights' gradients (+=)
      mark(Phase::NormBwd);
      if (spec_.qk_norm_whole) {
        qk_norm_whole(a, p, dqkv, N, true);
      } else {
        turbo::HeadNormArgs hn = qk_norm_args(a, p, dqkv, B, T);
        hn.backward = true;
        hn.dweight = p.q_norm.g;
        hn.dweight_k = p.k_norm.g;
        turbo::head_norm(hn);
      }
    }
    const TensorView ln1 = a.ln1.slice0(0, N), dln = a_.dln.slice0(0, N);
    mark(Phase::QkvGemmBwd);
    // One dgrad and one wgrad (+ bias gradient) GEMM over the packed q|k|v columns.
    linear_backward(dln, p.qkv_w, p.qkv_b, dqkv, ln1);
    row_sum(a_.dln, N);  // column-parallel: each rank's heads gave a part
    mark(Phase::NormBwd);
    // The residual gradient it leaves is d(output of layer l - 1): its column sums are that
    // layer's MLP down-projection bias gradient.
    norm_backward(mine(a_.dres, N), mine(a_.dln, N), a.x_in, a.mean1, a.rstd1, p.norm1, n, true,
                  l > 0 ? p_.layers[l - 1].out_b.g : TensorView());
    ready(layer_ready_[l]);
  }
  {
    NvtxRange er("embedding bwd");
    mark(Phase::EmbeddingBwd);
    gather(a_.dres, N);
    const int64_t at = slot_ * max_batch_ * max_seq_;
    turbo::EmbeddingArgs e;
    e.backward = true;
    e.dwte = p_.wte.g;
    e.dwpe = p_.wpe.g;
    e.dout = view(a_.dres, {B, T, C});
    e.tokens = view(a_.tokens.slice0(at, at + N), {B, T});
    e.positions = positions(B, T);
    e.wte = p_.wte.w;
    e.wpe = p_.wpe.w;
    e.ctx = c;
    if (opt_.tp) e.vocab_begin = opt_.tp->map().vocab_begin();
    turbo::embedding_backward(e);
  }
  ready(0);
  fresh_layers_ = false;  // the next micro-batch of this step accumulates
}


void Decoder::tp_loss(const TensorView& logits, const TensorView& targets, const TensorView& losses,
                      float dloss, const TensorView& kept) const {
  const int64_t rows = logits.size(0), tp = opt_.tp->size(), hr = a_.head_rows;
  const train::TpShardMap& map = opt_.tp->map();
  turbo::VocabParallelCrossEntropyArgs v;
  v.logits = logits;
  v.targets = targets;
  v.stats = view(a_.tp_stats.slice0(0, rows * 3), {rows, 3});
  v.all_stats = view(a_.tp_stats.slice0(hr * 3, (hr + tp * rows) * 3), {tp, rows, 3});
  v.losses = losses;
  v.vocab = spec_.vocab_size;
  v.vocab_begin = map.vocab_begin();
  v.global_vocab = map.global_spec().vocab_size;
  v.dloss = dloss;
  v.kept = kept;
  v.ctx = ctx_;
  turbo::vocab_parallel_ce_stats(v);
  opt_.tp->all_gather(v.stats, v.all_stats);
  turbo::vocab_parallel_ce_finish(v);
}

// ---- mixture of experts -----------------------------------------------------------------------

// moe_counts [S, Lm, 2E] i32 = counts | kept; moe_sums [S, Lm, E+1] f32 = prob_sum | z_sum.
namespace {
TensorView moe_row(const TensorView& buf, int64_t slot, int64_t m, int64_t begin, int64_t n) {
  const int64_t Lm = buf.size(1), W = buf.size(2);
  char* p = static_cast<char*>(buf.data) + size_t((slot * Lm + m) * W + begin) * turbo::dtype_size(buf.dtype);
  return TensorView(p, buf.dtype, buf.device, {n});
}
}  // namespace

namespace {
// Rows [b, b + rows) of slot `slot`, MoE layer m of a [S, Lm, B, E] buffer, as [rows, E].
TensorView moe_seq_rows(const TensorView& buf, int64_t slot, int64_t m, int64_t b, int64_t rows) {
  const int64_t Lm = buf.size(1), B = buf.size(2), E = buf.size(3);
  if (b < 0 || rows < 1 || b + rows > B)
    throw RuntimeError(fmt::format("moe: sequences [{}, {}) of a micro-batch planned for {}", b, b + rows, B));
  char* p = static_cast<char*>(buf.data) + size_t(((slot * Lm + m) * B + b) * E) * turbo::dtype_size(buf.dtype);
  return TensorView(p, buf.dtype, buf.device, {rows, E});
}
}  // namespace

turbo::cpu::SequenceRuns Decoder::seq_runs(int64_t N, int64_t T) const {
  // Context parallelism: a rank's rows are its chunk of each sequence, then its second chunk of
  // each (cp_attention.h), T tokens a chunk.
  const int64_t chunks = opt_.cp ? 2 * static_cast<int64_t>(opt_.cp->size()) : 1;
  const int64_t per = opt_.cp ? 2 : 1;
  if (T < 1 || N % (per * T) != 0)
    throw RuntimeError(fmt::format("moe: {} tokens are not whole sequences of {} rows", N, per * T));
  return {N / (per * T), T, chunks * T};
}

TensorView Decoder::moe_seq_counts(int64_t slot, int64_t l, int64_t b, int64_t rows) const {
  return moe_seq_rows(a_.moe_seq_counts, slot, moe_index_.at(l), b, rows);
}
TensorView Decoder::moe_seq_sums(int64_t slot, int64_t l, int64_t b, int64_t rows) const {
  return moe_seq_rows(a_.moe_seq_sums, slot, moe_index_.at(l), b, rows);
}
TensorView Decoder::moe_counts(int64_t slot, int64_t l) const {
  return moe_row(a_.moe_counts, slot, moe_index_.at(l), 0, spec_.moe.num_experts);
}
TensorView Decoder::moe_kept(int64_t slot, int64_t l) const {
  const int64_t E = spec_.moe.num_experts;
  return moe_row(a_.moe_counts, slot, moe_index_.at(l), E, E);
}
TensorView Decoder::moe_prob_sum(int64_t slot, int64_t l) const {
  return moe_row(a_.moe_sums, slot, moe_index_.at(l), 0, spec_.moe.num_experts);
}
TensorView Decoder::moe_z_sum(int64_t slot, int64_t l) const {
  return moe_row(a_.moe_sums, slot, moe_index_.at(l), spec_.moe.num_experts, 1);
}

void Decoder::moe_forward(int64_t l, int64_t N) {
  const ExecContext c = ctx_;
  const MoeActs& m = a_.moe[l];
  const MoeParams& mp = p_.layers[l].moe;
  const TensorView ln2 = a_.layers[l].ln2.slice0(0, N), out = a_.tmp.slice0(0, N);
  const TensorView idx = m.topk_idx.slice0(0, N), w = m.topk_weight.slice0(0, N), rows = m.rows.slice0(0, N);
  const TensorView kept = moe_kept(slot_, l);
  mark(Phase::MoeRouter);
  {
    turbo::GemmArgs g;  // f32 logits from the bf16 GEMM: the router's softmax / top-k see full precision
    g.a = ln2;
    g.b = mp.router.w.transposed();
    g.d = m.logits.slice0(0, N);
    g.ctx = c;
    turbo::gemm(g);
  }
  if (spec_.moe.force_load_balancing)  // the draw replaces the logits; the backward passes straight through
    turbo::moe_random_logits({m.logits.slice0(0, N), train::moe_random_seed(l), c});
  turbo::RouterForwardArgs r;
  r.cfg = router_;
  r.logits = m.logits.slice0(0, N);
  r.bias = mp.expert_bias;
  r.topk_idx = idx;
  r.topk_weight = w;
  r.probs = m.probs.slice0(0, N);
  r.counts = moe_counts(slot_, l);
  r.prob_sum = moe_prob_sum(slot_, l);
  r.z_sum = moe_z_sum(slot_, l);
  r.ctx = c;
  ops_.moe_router(r);
  if (spec_.moe.global_aux_loss) {
    // The global batch's loads: the counts summed over the ranks holding other tokens, then over
    // the step's micro-batches so far (slot s's row adds slot s - 1's, which holds 1..s).
    const int64_t E = spec_.moe.num_experts;
    const TensorView g = moe_row(a_.moe_cp_counts, slot_, moe_index_.at(l), 0, E);
    turbo::cast(g, r.counts, c);
    if (opt_.balance_sum) opt_.balance_sum(g);
    if (slot_ > 0) {
      const TensorView prev = moe_row(a_.moe_cp_counts, slot_ - 1, moe_index_.at(l), 0, E);
      if (g.device == turbo::Device::CPU) {
        for (int64_t e = 0; e < E; ++e) g.ptr<float>()[e] += prev.ptr<const float>()[e];
      } else {
        turbo::cuda::add_inplace_f32(g.ptr<float>(), prev.ptr<const float>(), E, static_cast<cudaStream_t>(c.stream));
      }
    }
  }
  if (opt_.cp && spec_.moe.batch_aux_loss) {  // the switch loss is the whole sequences': counts summed over the group
    const int64_t E = spec_.moe.num_experts;
    const TensorView g = moe_row(a_.moe_cp_counts, slot_, moe_index_.at(l), cp_counts_row() * E, E);
    turbo::cast(g, r.counts, c);
    opt_.cp->all_reduce_sum(g);
  }
  if (spec_.moe.seq_aux_loss) {  // each sequence's counts and sums of p (the loss and its gradient)
    const turbo::cpu::SequenceRuns runs = seq_runs(N, T_);
    turbo::MoeSequenceStatsArgs q;
    q.topk_idx = idx;
    q.probs = r.probs;
    q.seq_len = runs.run;
    q.counts = moe_seq_counts(slot_, l, 0, runs.seqs);
    q.prob_sum = moe_seq_sums(slot_, l, 0, runs.seqs);
    q.ctx = c;
    turbo::moe_sequence_stats(q);
    if (opt_.cp) {  // this rank's two chunks of each sequence: the whole sequences' are the group's sum
      const TensorView f = a_.moe_cp_seq_counts.slice0(0, runs.seqs);
      turbo::cast(f, q.counts, c);
      opt_.cp->all_reduce_sum(f);
      turbo::cast(q.counts, f, c);
      opt_.cp->all_reduce_sum(q.prob_sum);
    }
  }
  turbo::MoePlanArgs pl;
  pl.topk_idx = idx;
  pl.topk_weight = w;
  pl.counts = r.counts;
  pl.align = moe_align_;
  pl.capacity = spec_.moe.capacity(N);
  pl.policy = spec_.moe.drop_by_position ? turbo::DropPolicy::Position : turbo::DropPolicy::Probs;
  pl.row_of_slot = rows;
  pl.offsets = m.offsets;
  pl.kept = kept;
  pl.ctx = c;
  mark(Phase::MoePermute);
  // Expert parallelism: the local groups go to their experts' ranks, and this rank's experts run
  // over what every rank sent them (the held groups).
  EpComm* ep = opt_.ep;
  const int64_t mi = moe_index_.at(l);
  ops_.moe_dispatch({pl, {ep ? a_.moe_xl : m.xp, ln2, rows, m.offsets, kept, c}});
  const TensorView& groups = ep ? m.held_offsets : m.offsets;
  if (ep) {
    ep->plan(mi, kept, m.held_offsets);
    ep->dispatch(mi, a_.moe_xl, m.xp, a_.ep_send, a_.ep_recv);
  }
  mark(Phase::MlpUpGemm);
  if (opt_.moe_swiglu_epilogue) {  // act from the up projection's epilogue
    lin_->moe_experts({m.h, m.xp, mp.fc.w, groups, moe_align_, c, m.act});
  } else {
    lin_->moe_experts({m.h, m.xp, mp.fc.w, groups, moe_align_, c});
    mark(Phase::Activation);
    turbo::activation_forward({turbo::Activation::SwiGLU, m.act, m.h, c});
  }
  mark(Phase::MlpDownGemm);
  lin_->moe_experts({ep ? a_.moe_yh : m.yp, m.act, mp.proj.w, groups, moe_align_, c});
  mark(Phase::MoePermute);
  if (ep) ep->combine(mi, a_.moe_yh, m.yp, a_.ep_send, a_.ep_recv);
  ops_.moe_combine({out, m.yp, w, rows, false, c});
  if (mp.shared_fc.w.defined()) {
    mark(Phase::MlpUpGemm);
    lin_->linear_forward(m.sfc.slice0(0, N), ln2, mp.shared_fc.w, {}, {}, c);
    mark(Phase::Activation);
    turbo::activation_forward({turbo::Activation::SwiGLU, m.sact.slice0(0, N), m.sfc.slice0(0, N), c});
    mark(Phase::MlpDownGemm);
    turbo::GemmArgs g;  // out += shared expert
    g.a = m.sact.slice0(0, N);
    g.b = mp.shared_proj.w.transposed();
    g.d = out;
    g.beta = 1.0f;
    g.ctx = c;
    turbo::gemm(g);
  }
}

void Decoder::moe_backward(int64_t l, int64_t N) {
  const ExecContext c = ctx_;
  const MoeActs& m = a_.moe[l];
  const MoeParams& mp = p_.layers[l].moe;
  const TensorView ln2 = a_.layers[l].ln2.slice0(0, N), dres = a_.dres.slice0(0, N), dln = a_.dln.slice0(0, N);
  const TensorView w = m.topk_weight.slice0(0, N), rows = m.rows.slice0(0, N);
  const TensorView kept = moe_kept(slot_, l);
  bool dln_written = false;
  if (mp.shared_fc.w.defined()) {
    mark(Phase::MlpDownGemmBwd);
    linear_backward(a_.dsact.slice0(0, N), mp.shared_proj, {}, dres, m.sact.slice0(0, N));
    mark(Phase::ActivationBwd);
    turbo::activation_backward({turbo::Activation::SwiGLU, a_.dsfc.slice0(0, N), m.sfc.slice0(0, N),
                                a_.dsact.slice0(0, N), false, c});
    mark(Phase::MlpUpGemmBwd);
    linear_backward(dln, mp.shared_fc, {}, a_.dsfc.slice0(0, N), ln2);
    dln_written = true;
  }
  mark(Phase::MoePermuteBwd);
  ops_.moe_combine_backward({a_.dyp, a_.dweight.slice0(0, N), dres, m.yp, w, rows, m.offsets, kept, c});
  // Expert parallelism: the output rows' gradient to the experts' ranks, the input rows' gradient
  // back (the held input gradient reuses the held output gradient, as dxp reuses dyp).
  EpComm* ep = opt_.ep;
  const int64_t mi = moe_index_.at(l);
  const TensorView& groups = ep ? m.held_offsets : m.offsets;
  const TensorView dy = ep ? a_.dyh : a_.dyp, dx = ep ? a_.dyh : a_.dxp;
  if (ep) ep->dispatch(mi, a_.dyp, a_.dyh, a_.ep_send, a_.ep_recv);
  mark(Phase::MlpDownGemmBwd);
  if (opt_.moe_swiglu_epilogue)  // the input gradient's epilogue takes dact through SwiGLU into dh
    lin_->moe_experts_dgrad({a_.dh, dy, mp.proj.w, groups, moe_align_, c, m.h});
  else
    lin_->moe_experts_dgrad({a_.dmact, dy, mp.proj.w, groups, moe_align_, c});
  weight_grad(mp.proj.g, mp.proj.w.dtype, !fresh_layers_, [&](const TensorView& dw, bool accumulate) {
    turbo::GroupedGemmWgradArgs wa{dw, dy, m.act, groups, moe_align_, accumulate, c};
    wa.weight = mp.proj.w;  // FP8 delayed scaling: its histories
    lin_->moe_experts_wgrad(wa);
  });
  if (!opt_.moe_swiglu_epilogue) {
    mark(Phase::ActivationBwd);
    turbo::activation_backward({turbo::Activation::SwiGLU, a_.dh, m.h, a_.dmact, false, c});
  }
  mark(Phase::MlpUpGemmBwd);
  lin_->moe_experts_dgrad({dx, a_.dh, mp.fc.w, groups, moe_align_, c});
  weight_grad(mp.fc.g, mp.fc.w.dtype, !fresh_layers_, [&](const TensorView& dw, bool accumulate) {
    turbo::GroupedGemmWgradArgs wa{dw, a_.dh, m.xp, groups, moe_align_, accumulate, c};
    wa.weight = mp.fc.w;
    lin_->moe_experts_wgrad(wa);
  });
  if (ep) ep->combine(mi, a_.dyh, a_.dxp, a_.ep_send, a_.ep_recv);
  mark(Phase::MoePermuteBwd);
  turbo::MoePermuteBackwardArgs pb;
  pb.dinp = dln;
  pb.dout = a_.dxp;
  pb.row_of_slot = rows;
  pb.accumulate = dln_written;
  pb.ctx = c;
  ops_.moe_dispatch_backward(pb);
  mark(Phase::MoeRouterBwd);
  // Under tensor parallelism every rank adds the aux and z terms, the same on each (the routing is
  // the whole batch's everywhere), to a logits gradient that is summed over the group: 1 / tp each.
  const double tp_share = opt_.tp ? 1.0 / static_cast<double>(opt_.tp->size()) : 1.0;
  const double scale = static_cast<double>(dloss_) * static_cast<double>(N) * tp_share;
  // Context parallelism: the switch loss is the whole sequences' (Megatron sums the counts over the
  // tp x cp group). Its gradient for this rank's tokens is E x C_e / (K (cp N)^2) with C_e the
  // group's counts; the weights' gradients are then averaged over the group, so each rank passes
  // cp times that: the kernel's E x count_e / (K N^2) with the summed counts, at 1 / cp.
  // global_aux_loss: the loss over the global micro-batch (N D tokens for D ranks) with the mean
  // of the step's micro-batches' counts, the sum over s + 1 of them: each rank passes D times its
  // tokens' part, as the weights' gradients are averaged over the D ranks, so the kernel takes the
  // summed counts at 1 / (D (s + 1)).
  // Each listed balancing loss is one term of the router backward (their gradients add).
  const train::MoeSpec& e = spec_.moe;
  const int64_t E = e.num_experts;
  turbo::RouterBackwardArgs rb;
  rb.cfg = router_;
  rb.ctx = c;
  rb.dlogits = a_.dlogits.slice0(0, N);
  rb.dweight = a_.dweight.slice0(0, N);
  rb.logits = m.logits.slice0(0, N);
  rb.probs = m.probs.slice0(0, N);
  rb.topk_idx = m.topk_idx.slice0(0, N);
  rb.z_coeff = e.z_loss_coeff * scale;
  std::vector<turbo::RouterBackwardArgs::AuxTerm> terms;
  // The row r of counts summed in the forward, as i32 for the kernel.
  const auto summed = [&](int64_t r) {
    const TensorView i = a_.moe_cp_counts_i.slice0(r, r + 1).reshape({E});
    turbo::cast(i, moe_row(a_.moe_cp_counts, slot_, moe_index_.at(l), r * E, E), c);
    return i;
  };
  if (e.batch_aux_loss && e.aux_loss_coeff > 0) {
    terms.push_back({moe_counts(slot_, l), e.aux_loss_coeff * scale});
    if (opt_.cp) {
      terms.back().counts = summed(cp_counts_row());
      terms.back().coeff /= static_cast<double>(opt_.cp->size());
    }
  }
  if (e.seq_aux_loss && e.seq_aux_loss_coeff > 0) {
    // DeepSeek-V3's sequence-wise loss, one term for all sequences: each token's gradient from its
    // sequence's counts (the whole sequence's under cp, summed in the forward). The mean over the S
    // sequences puts 1/S on each one's loss; under cp each rank passes cp times its tokens' part,
    // as the switch loss's does, since the weights' gradients are averaged over the group.
    const turbo::cpu::SequenceRuns runs = seq_runs(N, T_);
    const double cp_share = opt_.cp ? static_cast<double>(opt_.cp->size()) : 1.0;
    terms.push_back({moe_seq_counts(slot_, l, 0, runs.seqs),
                     e.seq_aux_loss_coeff * scale * cp_share / static_cast<double>(runs.seqs), runs.seq_len, runs.run});
  }
  if (e.global_aux_loss && e.global_aux_loss_coeff > 0) {
    terms.push_back({summed(0), e.global_aux_loss_coeff * scale /
                                    static_cast<double>(opt_.balance_ranks * (slot_ + 1))});
  }
  if (!terms.empty()) {
    rb.counts = terms.front().counts;
    rb.aux_coeff = terms.front().coeff;
    rb.seq_len = terms.front().seq_len;
    rb.seq_run = terms.front().seq_run;
    rb.more_aux.assign(terms.begin() + 1, terms.end());
  } else {
    rb.counts = moe_counts(slot_, l);  // read by no term: every coefficient is 0
  }
  ops_.moe_router_backward(rb);
  const TensorView dlog = a_.dlogits_act.slice0(0, N);
  turbo::cast(dlog, a_.dlogits.slice0(0, N), c);
  turbo::GemmArgs gi;  // dln += dlogits @ router
  gi.a = dlog;
  gi.b = mp.router.w;
  gi.d = dln;
  gi.beta = 1.0f;
  gi.ctx = c;
  turbo::gemm(gi);
  turbo::GemmArgs gw;  // router.g (+)= dlogits^T @ ln2
  gw.a = dlog.transposed();
  gw.b = ln2;
  gw.d = mp.router.g;
  gw.beta = fresh_layers_ ? 0.0f : 1.0f;
  gw.ctx = c;
  turbo::gemm(gw);
}

TensorView Decoder::columns(const TensorView& buf, int64_t col, int64_t width) {
  const int64_t W = buf.size(1);
  if (col + width > W) throw RuntimeError(fmt::format("cuda model: columns {}+{} outside {}", col, width, buf.describe()));
  TensorView v(static_cast<char*>(buf.data) + size_t(col) * turbo::dtype_size(buf.dtype), buf.dtype, buf.device,
               {buf.size(0), width});
  v.strides = {buf.stride(0), 1};
  return v;
}

TensorView Decoder::heads(const TensorView& buf, int64_t B, int64_t T, int64_t col, int64_t heads) const {
  const int64_t D = spec_.head_dim(), W = buf.size(1);
  if (col + heads * D > W) throw RuntimeError(fmt::format("cuda model: columns {}+{} outside {}", col, heads * D, buf.describe()));
  TensorView v(static_cast<char*>(buf.data) + size_t(col) * turbo::dtype_size(buf.dtype), buf.dtype, buf.device,
               {B, T, heads, D});
  v.strides = {T * W, W, D, 1};
  return v;
}


bool Decoder::written_by_first_gemm(const train::ModelSpec& spec, const std::string& name) {
  auto ends = [&](const char* s) {
    const size_t n = std::strlen(s);
    return name.size() >= n && name.compare(name.size() - n, n, s) == 0;
  };
  if (name.rfind("layers.", 0) == 0)
    return ends(".attn.qkv.weight") || ends(".attn.proj.weight") || ends(".mlp.fc.weight") || ends(".mlp.proj.weight") ||
           ends(".moe.router.weight") || ends(".moe.experts.fc.weight") || ends(".moe.experts.proj.weight") ||
           ends(".moe.shared.fc.weight") || ends(".moe.shared.proj.weight");
  // The head's weight: its own, or the tied embedding (the head's GEMM runs before the embedding's
  // backward adds its rows).
  return name == (spec.untied ? "output_layer.weight" : "embedding.weight");
}


}  // namespace primus::backends::cuda
