#include "backends/reference/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <type_traits>

#include "backends/reference/context_parallel.h"
#include "core/util/error.h"
#include "parallel/data_parallel.h"
#include "train/param_init.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/attention.h"
#include "turbo/kernels/cpu/embedding.h"
#include "turbo/kernels/cpu/loss.h"
#include "turbo/kernels/cpu/matmul.h"
#include "turbo/kernels/cpu/moe.h"
#include "turbo/kernels/cpu/normalization.h"
#include "turbo/kernels/cpu/residual.h"
#include "turbo/kernels/cpu/rope.h"

namespace primus::backends::reference {

namespace k = primus::turbo::cpu;

template <typename Real>
GptModel<Real>::GptModel(const train::ModelSpec& spec, int64_t max_batch, int64_t max_seq)
    : spec_(spec), layout_(train::make_param_layout(spec)), max_tokens_(max_batch * max_seq) {
  if (max_seq > spec.seq_length) {
    throw ConfigError(fmt::format("sequence length {} exceeds the model's seq_length {}", max_seq, spec.seq_length));
  }
  params.assign(layout_.total, Real(0));
  grads.assign(layout_.total, Real(0));
  const int64_t N = max_tokens_, C = spec.hidden_size, H = spec.num_attention_heads;
  const int64_t KVD = spec.kv_dim(), F = spec.ffn_hidden_size, FC = spec.fc_dim();
  const int64_t QD = spec.q_dim(), KV = spec.num_query_groups;
  acts_.resize(spec.num_layers);
  for (auto& a : acts_) {
    a.x_in.resize(N * C);
    a.ln1.resize(N * C);
    a.mean1.resize(N);
    a.rstd1.resize(N);
    a.q.resize(N * QD);
    a.k.resize(N * KVD);
    a.v.resize(N * KVD);
    if (spec.rope) {
      a.q_rot.resize(N * QD);
      a.k_rot.resize(N * KVD);
    }
    if (spec.qk_layernorm) {  // rstd per (token, head), or per token over the whole projection
      a.q_pre.resize(N * QD);
      a.k_pre.resize(N * KVD);
      a.rstd_q.resize(spec.qk_norm_whole ? N : N * H);
      a.rstd_k.resize(spec.qk_norm_whole ? N : N * KV);
    }
    a.att.resize(N * QD);
    a.lse.resize(N * H);
    a.x2.resize(N * C);
    a.ln2.resize(N * C);
    a.mean2.resize(N);
    a.rstd2.resize(N);
  }
  moe_.resize(spec.num_layers);
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    if (spec.is_moe_layer(l)) {
      moe_[l] = std::make_unique<MoeLayer<Real>>(spec_, N, l);
    } else {
      acts_[l].fc.resize(N * FC);
      acts_[l].act.resize(N * F);
    }
  }
  x_final_.resize(N * C);
  lnf_.resize(N * C);
  meanf_.resize(N);
  rstdf_.resize(N);
  logits_.resize(N * spec.padded_vocab_size);
  losses_.resize(N);
  dx_.resize(N * C);
  dln_.resize(N * C);
  datt_.resize(N * QD);
  dq_.resize(N * QD);
  dk_.resize(N * KVD);
  dv_.resize(N * KVD);
  if (spec.rope) {
    dq_rot_.resize(N * QD);
    dk_rot_.resize(N * KVD);
  }
  if (spec.qk_layernorm) {
    dq_pre_.resize(N * QD);
    dk_pre_.resize(N * KVD);
  }
  dfc_.resize(N * FC);
  dact_.resize(N * F);
}

template <typename Real>
void GptModel<Real>::init_weights(uint64_t seed) {
  train::init_params(spec_, layout_, seed, params.data());  // shared with the cuda backend
}

template <typename Real>
void GptModel<Real>::zero_grad() {
  std::fill(grads.begin(), grads.end(), Real(0));
}

template <typename Real>
void GptModel<Real>::norm_forward(Real* out, Real* mean, Real* rstd, const Real* inp,
                                  const std::string& name, int64_t N) {
  const Real* w = param(name + ".weight");
  if (spec_.layernorm) {
    k::layernorm_forward(out, mean, rstd, inp, w, weight_or_null(name + ".bias"), N, spec_.hidden_size, spec_.norm_epsilon);
  } else {
    k::rmsnorm_forward(out, rstd, inp, w, N, spec_.hidden_size, spec_.norm_epsilon);
  }
}

template <typename Real>
void GptModel<Real>::norm_backward(Real* dinp, const Real* dout, const Real* inp, const Real* mean,
                                   const Real* rstd, const std::string& name, int64_t N) {
  const Real* w = param(name + ".weight");
  if (spec_.layernorm) {
    k::layernorm_backward(dinp, grad(name + ".weight"), grad_or_null(name + ".bias"), dout, inp, w, mean, rstd, N,
                          spec_.hidden_size);
  } else {
    k::rmsnorm_backward(dinp, grad(name + ".weight"), dout, inp, w, rstd, N, spec_.hidden_size);
  }
}

template <typename Real>
double GptModel<Real>::forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, double dloss) {
  if (hooks_) hooks_->gather(0);
  const double loss = forward_body(tokens, targets, B, T, dloss);
  if (hooks_) hooks_->release(0);
  return loss;
}

template <typename Real>
void GptModel<Real>::backward() {
  if (hooks_) hooks_->gather(0);
  backward_body();
  if (hooks_) {
    hooks_->grads_ready(0);
    hooks_->release(0);
  }
}

template <typename Real>
double GptModel<Real>::forward_body(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, double dloss) {
  const int64_t N = B * T;
  if (N > max_tokens_ || T > spec_.seq_length) {
    throw RuntimeError(fmt::format("batch {}x{} exceeds the model's buffers ({} tokens, seq {})", B, T, max_tokens_,
                                   spec_.seq_length));
  }
  B_ = B;
  T_ = T;
  dloss_ = dloss;
  tokens_.assign(tokens, tokens + N);
  if (masking_.enabled()) train::build_document_tables(tokens, B, T, masking_, &doc_);
  if (cp_group_) {
    const int cp = cp_group_->world_size();
    const std::vector<int32_t> mine = cp_chunk_positions(T * cp, cp, cp_group_->rank());
    cp_positions_.resize(static_cast<size_t>(N));
    for (int64_t b = 0; b < B; ++b) std::copy(mine.begin(), mine.end(), cp_positions_.begin() + b * T);
  }
  const int64_t C = spec_.hidden_size, H = spec_.num_attention_heads, KV = spec_.num_query_groups;
  const int64_t D = spec_.head_dim(), KVD = spec_.kv_dim(), F = spec_.ffn_hidden_size, FC = spec_.fc_dim();
  const int64_t V = spec_.padded_vocab_size, QD = spec_.q_dim();
  const bool qkn = spec_.qk_layernorm;
  Real* x = acts_.empty() ? x_final_.data() : acts_[0].x_in.data();
  tp_row0_ = 0, tp_rows_ = N;
  if (tp() && tp_sp_) {
    const int64_t tp = tp_map_->tp();
    if (N % tp != 0) {
      throw RuntimeError(fmt::format("sequence_parallel: the micro-batch's {} tokens do not split over {} tp ranks", N, tp));
    }
    tp_rows_ = N / tp, tp_row0_ = tp_map_->rank() * tp_rows_;
  }
  // The residual stream and the norms run over rows [r0, r0 + R) of the tokens: all of them
  // unless sequence parallel.
  const int64_t r0 = tp_row0_, R = tp_rows_;
  if (tp()) {
    tp_embedding_forward(x, B, T);
  } else {
    k::embedding_forward(x, tokens, positions(), param("embedding.weight"), weight_or_null("position_embedding.weight"),
                         B, T, C, V, spec_.seq_length);
  }
  const k::AttentionParams ap = attention_params();
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    LayerActs& a = acts_[l];
    const std::string p = fmt::format("layers.{}.", l);
    if (hooks_) hooks_->gather(static_cast<int>(1 + l));
    norm_forward(a.ln1.data() + r0 * C, a.mean1.data() + r0, a.rstd1.data() + r0, a.x_in.data() + r0 * C, p + "norm1",
                 R);
    if (tp_sp_) tp_gather_rows(a.ln1.data(), C);
    const Real* wqkv = param(p + "attn.qkv.weight");
    const Real* bqkv = weight_or_null(p + "attn.qkv.bias");
    // With qk_layernorm the projection lands in q_pre / k_pre and the RMSNorm writes q / k, which
    // RoPE then rotates: per head (rows of one head's D features, weight shared by the heads) or
    // over the whole projection (rows of QD / KVD features, one weight each).
    k::matmul_forward(qkn ? a.q_pre.data() : a.q.data(), a.ln1.data(), wqkv, bqkv, N, C, QD);
    k::matmul_forward(qkn ? a.k_pre.data() : a.k.data(), a.ln1.data(), wqkv + QD * C, bqkv ? bqkv + QD : nullptr, N, C,
                      KVD);
    k::matmul_forward(a.v.data(), a.ln1.data(), wqkv + (QD + KVD) * C, bqkv ? bqkv + QD + KVD : nullptr, N, C, KVD);
    if (qkn) {
      const int64_t qd = spec_.q_norm_dim(), kd = spec_.k_norm_dim();
      k::rmsnorm_forward(a.q.data(), a.rstd_q.data(), a.q_pre.data(), param(p + "attn.q_norm.weight"), N * QD / qd, qd,
                         spec_.norm_epsilon);
      k::rmsnorm_forward(a.k.data(), a.rstd_k.data(), a.k_pre.data(), param(p + "attn.k_norm.weight"), N * KVD / kd,
                         kd, spec_.norm_epsilon);
    }
    const Real* q = a.q.data();
    const Real* kk = a.k.data();
    if (spec_.rope) {
      k::rope_forward(a.q_rot.data(), a.q.data(), positions(), B, T, H, D, spec_.rotary_base, spec_.rope_scaling);
      k::rope_forward(a.k_rot.data(), a.k.data(), positions(), B, T, KV, D, spec_.rotary_base, spec_.rope_scaling);
      q = a.q_rot.data();
      kk = a.k_rot.data();
    }
    if (cp_group_) {
      // (set_context_parallel refuses every Real but float)
      if constexpr (std::is_same_v<Real, float>) {
        ring_attention_forward(*cp_group_, a.att.data(), a.lse.data(), q, kk, a.v.data(), ap);
      }
    } else {
      k::attention_forward(a.att.data(), a.lse.data(), q, kk, a.v.data(), ap);
    }
    // x2 = x_in + att @ Wo^T + bo
    // Row-parallel: each rank's heads give a part of the projection; the bias goes on the sum.
    k::matmul_forward(a.x2.data(), a.att.data(), param(p + "attn.proj.weight"),
                      tp() ? nullptr : weight_or_null(p + "attn.proj.bias"), N, QD, C);
    if (tp()) {
      tp_reduce_rows(a.x2.data(), N, C);
      add_bias_rows(a.x2.data() + r0 * C, p + "attn.proj.bias", R);
    }
    k::residual_forward(a.x2.data() + r0 * C, a.x2.data() + r0 * C, a.x_in.data() + r0 * C, R * C);
    norm_forward(a.ln2.data() + r0 * C, a.mean2.data() + r0, a.rstd2.data() + r0, a.x2.data() + r0 * C, p + "norm2", R);
    if (tp_sp_) tp_gather_rows(a.ln2.data(), C);
    if (moe_[l]) {
      Real* next = l + 1 < spec_.num_layers ? acts_[l + 1].x_in.data() : x_final_.data();
      moe_[l]->forward(next, a.ln2.data(), moe_weights(l), N, T_);
      k::residual_forward(next, next, a.x2.data(), N * C);
      if (hooks_) hooks_->release(static_cast<int>(1 + l));
      continue;
    }
    k::matmul_forward(a.fc.data(), a.ln2.data(), param(p + "mlp.fc.weight"), weight_or_null(p + "mlp.fc.bias"), N, C, FC);
    if (spec_.swiglu) {
      k::swiglu_forward(a.act.data(), a.fc.data(), N, F);
    } else {
      k::gelu_forward(a.act.data(), a.fc.data(), N * F);
    }
    Real* next = l + 1 < spec_.num_layers ? acts_[l + 1].x_in.data() : x_final_.data();
    k::matmul_forward(next, a.act.data(), param(p + "mlp.proj.weight"), tp() ? nullptr : weight_or_null(p + "mlp.proj.bias"),
                      N, F, C);
    if (tp()) {
      tp_reduce_rows(next, N, C);
      add_bias_rows(next + r0 * C, p + "mlp.proj.bias", R);
    }
    k::residual_forward(next + r0 * C, next + r0 * C, a.x2.data() + r0 * C, R * C);
    if (hooks_) hooks_->release(static_cast<int>(1 + l));
  }
  norm_forward(lnf_.data() + r0 * C, meanf_.data() + r0, rstdf_.data() + r0, x_final_.data() + r0 * C, "final_norm", R);
  if (tp_sp_) tp_gather_rows(lnf_.data(), C);
  const Real* head = spec_.untied ? param("output_layer.weight") : param("embedding.weight");
  k::matmul_forward(logits_.data(), lnf_.data(), head, static_cast<const Real*>(nullptr), N, C, V);
  count_ = 0;
  if (!targets) return 0.0;
  const double ce_dloss = kept_targets_ == total_targets_
                              ? dloss
                              : dloss * static_cast<double>(total_targets_) /
                                    static_cast<double>(std::max<int64_t>(kept_targets_, 1));
  k::CrossEntropyResult res = tp() ? tp_cross_entropy(targets, N, ce_dloss) : plain_cross_entropy(targets, N, ce_dloss);
  if (cp_group_) {  // every rank's tokens are part of the same sequences: the group's mean
    res.loss_sum = parallel::global_sum(*cp_group_, res.loss_sum);
    res.count = std::llround(parallel::global_sum(*cp_group_, static_cast<double>(res.count)));
  }
  count_ = res.count;
  return res.mean();
}

template <typename Real>
turbo::cpu::CrossEntropyResult GptModel<Real>::plain_cross_entropy(const int32_t* targets, int64_t N, double dloss) {
  const int64_t V = spec_.padded_vocab_size;
  k::CrossEntropyResult r;
  // The softmax runs over the real vocabulary; padded columns are not classes (llm.c's and the
  // cuda backend's semantics, and what the exported Hugging Face model computes).
  const int64_t Vr = spec_.vocab_size;
  if (dloss != 0) {
    r = k::cross_entropy_forward_backward(logits_.data(), losses_.data(), logits_.data(), targets, N, Vr, dloss,
                                          k::kIgnoreIndex, V);
  } else {
    std::vector<Real> lse(N);
    r = k::cross_entropy_forward(losses_.data(), lse.data(), logits_.data(), targets, N, Vr, k::kIgnoreIndex, V);
  }
  return r;
}

template <typename Real>
void GptModel<Real>::set_context_parallel(parallel::ProcessGroup* group) {
  if (group && group->world_size() > 1 && !std::is_same_v<Real, float>) {
    throw RuntimeError("context parallelism runs the float model only");
  }
  cp_group_ = group && group->world_size() > 1 ? group : nullptr;
  for (auto& m : moe_)
    if (m) m->set_context_parallel(cp_group_);
}

template <typename Real>
void GptModel<Real>::set_expert_parallel(parallel::ProcessGroup* group) {
  for (auto& m : moe_)
    if (m) m->set_expert_parallel(group);
}

template <typename Real>
void GptModel<Real>::set_balance_group(parallel::ProcessGroup* group) {
  for (auto& m : moe_)
    if (m) m->set_balance_group(group);
}

template <typename Real>
void GptModel<Real>::begin_moe_step() {
  for (auto& m : moe_)
    if (m) m->begin_step();
}

template <typename Real>
void GptModel<Real>::backward_body() {
  const int64_t B = B_, T = T_, N = B * T;
  const int64_t C = spec_.hidden_size, H = spec_.num_attention_heads, KV = spec_.num_query_groups;
  const int64_t D = spec_.head_dim(), KVD = spec_.kv_dim(), F = spec_.ffn_hidden_size, FC = spec_.fc_dim();
  const int64_t V = spec_.padded_vocab_size, QD = spec_.q_dim();
  const bool qkn = spec_.qk_layernorm;
  auto zero = [](std::vector<Real>& v, int64_t n) { std::fill(v.begin(), v.begin() + n, Real(0)); };

  // Head: logits_ holds dlogits (written by the fused loss in forward).
  const bool tied = !spec_.untied;
  const Real* head = tied ? param("embedding.weight") : param("output_layer.weight");
  Real* dhead = tied ? grad("embedding.weight") : grad("output_layer.weight");
  zero(dln_, N * C);
  k::matmul_backward(dln_.data(), dhead, static_cast<Real*>(nullptr), logits_.data(), lnf_.data(), head, N, C, V);
  // Tensor parallel: every input gradient of a column-parallel product (the head; q/k/v and
  // gate/up below) is a part, summed over the group (reduce-scattered to the rank's rows under
  // sequence parallelism); the output gradient of a row-parallel one is needed whole (gathered).
  const int64_t r0 = tp_row0_, R = tp_rows_;
  if (tp()) tp_reduce_rows(dln_.data(), N, C);
  zero(dx_, N * C);
  norm_backward(dx_.data() + r0 * C, dln_.data() + r0 * C, x_final_.data() + r0 * C, meanf_.data() + r0,
                rstdf_.data() + r0, "final_norm", R);

  const k::AttentionParams ap = attention_params();
  for (int64_t l = spec_.num_layers - 1; l >= 0; --l) {
    LayerActs& a = acts_[l];
    const std::string p = fmt::format("layers.{}.", l);
    if (hooks_) hooks_->gather(static_cast<int>(1 + l));
    // MLP branch: dx is the gradient of the layer output = x2 + mlp(x2).
    if (tp_sp_) tp_gather_rows(dx_.data(), C);
    if (moe_[l]) {
      zero(dln_, N * C);
      moe_[l]->backward(dln_.data(), dx_.data(), a.ln2.data(), moe_weights(l), moe_grads(l),
                        dloss_ * static_cast<double>(N));
    } else {
    zero(dact_, N * F);
    k::matmul_backward(dact_.data(), grad(p + "mlp.proj.weight"), grad_or_null(p + "mlp.proj.bias"), dx_.data(),
                       a.act.data(), param(p + "mlp.proj.weight"), N, F, C);
    zero(dfc_, N * FC);
    if (spec_.swiglu) {
      k::swiglu_backward(dfc_.data(), a.fc.data(), dact_.data(), N, F);
    } else {
      k::gelu_backward(dfc_.data(), a.fc.data(), dact_.data(), N * F);
    }
    zero(dln_, N * C);
    k::matmul_backward(dln_.data(), grad(p + "mlp.fc.weight"), grad_or_null(p + "mlp.fc.bias"), dfc_.data(),
                       a.ln2.data(), param(p + "mlp.fc.weight"), N, C, FC);
    }
    if (tp()) tp_reduce_rows(dln_.data(), N, C);
    norm_backward(dx_.data() + r0 * C, dln_.data() + r0 * C, a.x2.data() + r0 * C, a.mean2.data() + r0,
                  a.rstd2.data() + r0, p + "norm2", R);
    if (tp_sp_) tp_gather_rows(dx_.data(), C);
    // Attention branch: dx is now the gradient of x2 = x_in + proj(att).
    zero(datt_, N * QD);
    k::matmul_backward(datt_.data(), grad(p + "attn.proj.weight"), grad_or_null(p + "attn.proj.bias"), dx_.data(),
                       a.att.data(), param(p + "attn.proj.weight"), N, QD, C);
    Real* dq = spec_.rope ? dq_rot_.data() : dq_.data();
    Real* dk = spec_.rope ? dk_rot_.data() : dk_.data();
    std::fill(dq, dq + N * QD, Real(0));
    std::fill(dk, dk + N * KVD, Real(0));
    zero(dv_, N * KVD);
    const Real* q = spec_.rope ? a.q_rot.data() : a.q.data();
    const Real* kk = spec_.rope ? a.k_rot.data() : a.k.data();
    if (cp_group_) {
      if constexpr (std::is_same_v<Real, float>) {
        ring_attention_backward(*cp_group_, dq, dk, dv_.data(), datt_.data(), q, kk, a.v.data(), a.att.data(),
                                a.lse.data(), ap);
      }
    } else {
      k::attention_backward(dq, dk, dv_.data(), datt_.data(), q, kk, a.v.data(), a.att.data(), a.lse.data(), ap);
    }
    if (spec_.rope) {
      zero(dq_, N * QD);
      zero(dk_, N * KVD);
      k::rope_backward(dq_.data(), dq_rot_.data(), positions(), B, T, H, D, spec_.rotary_base, spec_.rope_scaling);
      k::rope_backward(dk_.data(), dk_rot_.data(), positions(), B, T, KV, D, spec_.rotary_base, spec_.rope_scaling);
    }
    // dq_ / dk_ are now the gradients of the normalised q / k; through the per-head RMSNorm
    // into the projection's outputs (and the two norm weights).
    const Real* dq_proj = dq_.data();
    const Real* dk_proj = dk_.data();
    if (qkn) {
      zero(dq_pre_, N * QD);
      zero(dk_pre_, N * KVD);
      const int64_t qd = spec_.q_norm_dim(), kd = spec_.k_norm_dim();
      k::rmsnorm_backward(dq_pre_.data(), grad(p + "attn.q_norm.weight"), dq_.data(), a.q_pre.data(),
                          param(p + "attn.q_norm.weight"), a.rstd_q.data(), N * QD / qd, qd);
      k::rmsnorm_backward(dk_pre_.data(), grad(p + "attn.k_norm.weight"), dk_.data(), a.k_pre.data(),
                          param(p + "attn.k_norm.weight"), a.rstd_k.data(), N * KVD / kd, kd);
      dq_proj = dq_pre_.data();
      dk_proj = dk_pre_.data();
    }
    const Real* wqkv = param(p + "attn.qkv.weight");
    Real* dwqkv = grad(p + "attn.qkv.weight");
    Real* dbqkv = grad_or_null(p + "attn.qkv.bias");
    zero(dln_, N * C);
    k::matmul_backward(dln_.data(), dwqkv, dbqkv, dq_proj, a.ln1.data(), wqkv, N, C, QD);
    k::matmul_backward(dln_.data(), dwqkv + QD * C, dbqkv ? dbqkv + QD : nullptr, dk_proj, a.ln1.data(), wqkv + QD * C,
                       N, C, KVD);
    k::matmul_backward(dln_.data(), dwqkv + (QD + KVD) * C, dbqkv ? dbqkv + QD + KVD : nullptr, dv_.data(),
                       a.ln1.data(), wqkv + (QD + KVD) * C, N, C, KVD);
    if (tp()) tp_reduce_rows(dln_.data(), N, C);
    norm_backward(dx_.data() + r0 * C, dln_.data() + r0 * C, a.x_in.data() + r0 * C, a.mean1.data() + r0,
                  a.rstd1.data() + r0, p + "norm1", R);
    if (hooks_) {
      hooks_->grads_ready(static_cast<int>(1 + l));
      hooks_->release(static_cast<int>(1 + l));
    }
  }
  if (tp()) {
    tp_embedding_backward(B, T);
    return;
  }
  k::embedding_backward(grad("embedding.weight"), grad_or_null("position_embedding.weight"), dx_.data(),
                        tokens_.data(), positions(), B, T, C, V, spec_.seq_length);
}

template <typename Real>
void GptModel<Real>::set_tensor_parallel(const train::TpShardMap* map, parallel::ProcessGroup* group,
                                         bool sequence_parallel) {
  if (!map || map->tp() == 1) {
    tp_map_ = nullptr, tp_group_ = nullptr, tp_sp_ = false;
    return;
  }
  if constexpr (!std::is_same_v<Real, float>) {
    throw RuntimeError("tensor parallelism runs the float model only");
  }
  if (!group || group->world_size() != map->tp() || group->rank() != map->rank()) {
    throw RuntimeError(fmt::format("tensor parallelism: the group ({} of {}) is not the map's (rank {} of {})",
                                   group ? group->rank() : -1, group ? group->world_size() : 0, map->rank(), map->tp()));
  }
  if (layout_.total != map->local_layout().total) {
    throw RuntimeError("tensor parallelism: the model was not built from the map's local spec");
  }
  tp_map_ = map, tp_group_ = group, tp_sp_ = sequence_parallel;
}

template <typename Real>
void GptModel<Real>::tp_reduce_rows(Real* buf, int64_t N, int64_t C) {
  if (tp_sp_) {
    tp_group_->reduce_scatter(buf, buf + tp_row0_ * C, static_cast<size_t>(tp_rows_ * C), parallel::DType::F32,
                              parallel::ReduceOp::Sum);
  } else {
    tp_group_->all_reduce(buf, static_cast<size_t>(N * C), parallel::DType::F32, parallel::ReduceOp::Sum);
  }
}

template <typename Real>
void GptModel<Real>::tp_gather_rows(Real* buf, int64_t C) {
  tp_group_->all_gather(buf + tp_row0_ * C, buf, static_cast<size_t>(tp_rows_ * C), parallel::DType::F32);
}

template <typename Real>
void GptModel<Real>::add_bias_rows(Real* x, const std::string& bias, int64_t rows) {
  const Real* b = weight_or_null(bias);
  if (!b) return;
  const int64_t C = spec_.hidden_size;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t c = 0; c < C; ++c) x[n * C + c] += b[c];
}

template <typename Real>
void GptModel<Real>::tp_embedding_forward(Real* x, int64_t B, int64_t T) {
  const int64_t N = B * T, C = spec_.hidden_size, Vl = spec_.padded_vocab_size, v0 = tp_map_->vocab_begin();
  const int64_t Vg = tp_map_->global_spec().padded_vocab_size;
  const Real* wte = param("embedding.weight");
  // Each rank looks up the tokens of its vocabulary rows (zeros for the others); the sum over the
  // group is the embedding.
  for (int64_t n = 0; n < N; ++n) {
    const int64_t id = tokens_[n];
    if (id < 0 || id >= Vg) {
      throw RuntimeError(fmt::format("token id {} at position {} is outside the vocabulary [0, {})", id, n, Vg));
    }
    if (id >= v0 && id < v0 + Vl) {
      std::copy_n(wte + (id - v0) * C, C, x + n * C);
    } else {
      std::fill_n(x + n * C, C, Real(0));
    }
  }
  tp_reduce_rows(x, N, C);
  if (const Real* wpe = weight_or_null("position_embedding.weight")) {
    const int32_t* pos = positions();
    for (int64_t n = tp_row0_; n < tp_row0_ + tp_rows_; ++n) {
      const int64_t t = pos ? pos[n] : n % T;
      for (int64_t c = 0; c < C; ++c) x[n * C + c] += wpe[t * C + c];
    }
  }
}

template <typename Real>
void GptModel<Real>::tp_embedding_backward(int64_t B, int64_t T) {
  const int64_t N = B * T, C = spec_.hidden_size, Vl = spec_.padded_vocab_size, v0 = tp_map_->vocab_begin();
  if (tp_sp_) tp_gather_rows(dx_.data(), C);
  Real* dwte = grad("embedding.weight");
  Real* dwpe = grad_or_null("position_embedding.weight");
  const int32_t* pos = positions();
  for (int64_t n = 0; n < N; ++n) {
    const Real* d = dx_.data() + n * C;
    const int64_t id = tokens_[n];
    if (id >= v0 && id < v0 + Vl)
      for (int64_t c = 0; c < C; ++c) dwte[(id - v0) * C + c] += d[c];
    if (dwpe) {
      const int64_t t = pos ? pos[n] : n % T;
      for (int64_t c = 0; c < C; ++c) dwpe[t * C + c] += d[c];
    }
  }
}

template <typename Real>
turbo::cpu::CrossEntropyResult GptModel<Real>::tp_cross_entropy(const int32_t* targets, int64_t N, double dloss) {
  const int64_t Vl = spec_.padded_vocab_size, Vr = spec_.vocab_size, v0 = tp_map_->vocab_begin();
  const int64_t Vg = tp_map_->global_spec().vocab_size;
  const int tp = tp_map_->tp();
  Real* L = logits_.data();
  // The row maxima over the group (each rank's over its real columns), then the sums of exp and
  // the target's logit (from the rank that holds it) summed over the group: the softmax of the
  // whole vocabulary without gathering the logits.
  std::vector<float> mx(static_cast<size_t>(N)), all(static_cast<size_t>(N) * tp), st(2 * static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < Vr; ++j) m = std::max(m, static_cast<float>(L[n * Vl + j]));
    mx[n] = m;
  }
  tp_group_->all_gather(mx.data(), all.data(), static_cast<size_t>(N), parallel::DType::F32);
  for (int64_t n = 0; n < N; ++n) {
    for (int r = 0; r < tp; ++r) mx[n] = std::max(mx[n], all[r * N + n]);
    const int32_t tgt = targets[n];
    if (tgt != k::kIgnoreIndex && (tgt < 0 || tgt >= Vg)) {
      throw RuntimeError(fmt::format("target {} at position {} is outside the vocabulary [0, {})", tgt, n, Vg));
    }
    double s = 0;
    for (int64_t j = 0; j < Vr; ++j) s += std::exp(static_cast<double>(L[n * Vl + j]) - mx[n]);
    st[n] = static_cast<float>(s);
    st[N + n] = tgt >= v0 && tgt < v0 + Vr ? static_cast<float>(L[n * Vl + tgt - v0]) : 0.f;
  }
  tp_group_->all_reduce(st.data(), st.size(), parallel::DType::F32, parallel::ReduceOp::Sum);
  k::CrossEntropyResult r;
  for (int64_t n = 0; n < N; ++n) {
    const int32_t tgt = targets[n];
    Real* row = L + n * Vl;
    if (tgt == k::kIgnoreIndex) {
      losses_[n] = Real(0);
      if (dloss != 0) std::fill_n(row, Vl, Real(0));
      continue;
    }
    const double loss = std::log(static_cast<double>(st[n])) + mx[n] - st[N + n];
    losses_[n] = static_cast<Real>(loss);
    r.loss_sum += loss;
    ++r.count;
    if (dloss == 0) continue;
    const double scale = dloss / static_cast<double>(st[n]);
    for (int64_t j = 0; j < Vr; ++j) row[j] = static_cast<Real>(std::exp(static_cast<double>(row[j]) - mx[n]) * scale);
    std::fill(row + Vr, row + Vl, Real(0));  // padded columns: not classes
    if (tgt >= v0 && tgt < v0 + Vr) row[tgt - v0] -= static_cast<Real>(dloss);
  }
  return r;
}

template <typename Real>
void GptModel<Real>::reduce_tp_partial_grads() {
  if (!tp()) return;
  const auto& ts = layout_.tensors;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!tp_map_->partial_grad(i)) continue;
    tp_group_->all_reduce(grads.data() + ts[i].offset, static_cast<size_t>(ts[i].numel), parallel::DType::F32,
                          parallel::ReduceOp::Sum);
  }
  // Replicated key/value rows (tp above num_query_groups): each replica's part summed through the
  // global k|v range of the tensor (train/tensor_parallel.h).
  std::vector<float> x;
  for (const train::TpKvExchange& e : tp_map_->kv_exchanges()) {
    x.assign(static_cast<size_t>(e.elems), 0.0f);
    for (const train::TpPiece& p : e.pieces)
      for (int64_t j = 0; j < p.count; ++j) x[size_t(p.global - e.global_begin + j)] = static_cast<float>(grads[size_t(p.local + j)]);
    tp_group_->all_reduce(x.data(), x.size(), parallel::DType::F32, parallel::ReduceOp::Sum);
    for (const train::TpPiece& p : e.pieces)
      for (int64_t j = 0; j < p.count; ++j) grads[size_t(p.local + j)] = static_cast<Real>(x[size_t(p.global - e.global_begin + j)]);
  }
}

template <typename Real>
turbo::cpu::AttentionParams GptModel<Real>::attention_params() const {
  k::AttentionParams ap;
  ap.B = B_, ap.T = T_, ap.H = spec_.num_attention_heads, ap.KVH = spec_.num_query_groups, ap.D = spec_.head_dim();
  ap.causal = true;
  ap.window = spec_.sliding_window;
  if (masking_.reset_attention_mask) {
    ap.cu_seqlens = doc_.cu_seqlens.data();
    ap.num_docs = static_cast<int64_t>(doc_.cu_seqlens.size()) - 1;
  }
  return ap;
}

template <typename Real>
typename MoeLayer<Real>::Weights GptModel<Real>::moe_weights(int64_t l) {
  const std::string p = fmt::format("layers.{}.moe.", l);
  typename MoeLayer<Real>::Weights w;
  w.router = param(p + "router.weight");
  w.expert_bias = weight_or_null(p + "router.expert_bias");
  w.fc = param(p + "experts.fc.weight");
  w.proj = param(p + "experts.proj.weight");
  w.shared_fc = weight_or_null(p + "shared.fc.weight");
  w.shared_proj = weight_or_null(p + "shared.proj.weight");
  return w;
}

template <typename Real>
typename MoeLayer<Real>::Grads GptModel<Real>::moe_grads(int64_t l) {
  const std::string p = fmt::format("layers.{}.moe.", l);
  typename MoeLayer<Real>::Grads g;
  g.router = grad(p + "router.weight");
  g.fc = grad(p + "experts.fc.weight");
  g.proj = grad(p + "experts.proj.weight");
  g.shared_fc = grad_or_null(p + "shared.fc.weight");
  g.shared_proj = grad_or_null(p + "shared.proj.weight");
  return g;
}

template <typename Real>
double GptModel<Real>::moe_loss() const {
  double s = 0;
  for (const auto& m : moe_)
    if (m) {
      s += spec_.moe.aux_loss_coeff * m->stats().batch_aux + spec_.moe.seq_aux_loss_coeff * m->stats().seq_aux +
           spec_.moe.global_aux_loss_coeff * m->stats().global_aux + spec_.moe.z_loss_coeff * m->stats().z;
    }
  return s;
}

template <typename Real>
void GptModel<Real>::update_expert_bias(const std::vector<std::vector<int64_t>>& load) {
  if (!spec_.moe.expert_bias) return;
  std::vector<float> b;
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    if (!moe_[l]) continue;
    Real* bias = param(fmt::format("layers.{}.moe.router.expert_bias", l));
    b.assign(bias, bias + spec_.moe.num_experts);
    k::router_bias_update(b.data(), load.at(static_cast<size_t>(l)).data(), spec_.moe.num_experts,
                          spec_.moe.bias_update_rate);
    std::copy(b.begin(), b.end(), bias);
  }
}

template class GptModel<float>;
template class GptModel<double>;

}  // namespace primus::backends::reference
