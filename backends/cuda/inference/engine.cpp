#include "backends/cuda/inference/engine.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>

#include "core/util/error.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/decode_attention.h"
#include "turbo/ops/embedding.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/grouped_gemm.h"
#include "turbo/ops/head_norm.h"
#include "turbo/ops/moe.h"
#include "turbo/ops/normalization.h"
#include "turbo/ops/rope.h"
#ifdef PRIMUS_CUDA_HAVE_TURBO_ATTENTION
#include "turbo/ops/attention.h"
#endif

namespace primus::backends::cuda {

using turbo::DType;
using turbo::TensorView;

namespace {

constexpr size_t kAlign = turbo::Arena::kDefaultAlign;
constexpr int64_t kMaxRows = 16384;  // about 1.3 GiB of bf16 activations at Llama-3.2-1B's widths
size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// [B,T,nh,D] heads starting at column `col` of the row-major [rows, W] buffer (token rows W apart).
TensorView heads(const TensorView& buf, int64_t B, int64_t T, int64_t col, int64_t nh, int64_t D) {
  TensorView v = buf;
  const int64_t W = buf.shape[1];
  v.data = static_cast<char*>(buf.data) + col * static_cast<int64_t>(turbo::dtype_size(buf.dtype));
  v.ndim = 4;
  v.shape = {B, T, nh, D};
  v.strides = {T * W, W, D, 1};
  return v;
}
// The same columns as [N, nh, D] (one row per token).
TensorView rows3(const TensorView& buf, int64_t N, int64_t col, int64_t nh, int64_t D) {
  TensorView v = heads(buf, 1, N, col, nh, D);
  v.ndim = 3;
  v.shape = {N, nh, D, 0};
  v.strides = {buf.shape[1], D, 1, 0};
  return v;
}
TensorView reshaped(const TensorView& t, std::initializer_list<int64_t> shape) { return t.reshape(shape); }

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void check_supported(const train::ModelSpec& s) {
  // Which tokens an expert drops depends on how many tokens one call routes (a prefill's, a decode
  // step's), so only dropless routing gives a sequence the same tokens in every call pattern.
  if (s.moe.enabled() && s.moe.capacity_factor > 0)
    throw ConfigError(fmt::format("inference engine: moe_expert_capacity_factor {} (token dropping) is not supported: "
                                  "generation routes dropless; use --backend reference, or a checkpoint without it",
                                  s.moe.capacity_factor));
  if (s.moe.enabled() && s.moe.force_load_balancing)
    throw ConfigError("inference engine: moe_router_force_load_balancing (a benchmark setting, routing by a "
                      "pseudo-random draw) is not supported: generation routes by the router's weights");
  if (s.seq_length <= 0 || s.num_layers <= 0 || s.padded_vocab_size <= 0)
    throw ConfigError(fmt::format("inference engine: model spec without seq_length / num_layers / vocabulary ({})",
                                  s.summary()));
}

}  // namespace

InferenceEngine::InferenceEngine(const train::ModelSpec& spec, const float* host_params, int64_t max_batch,
                                 turbo::Device device)
    : spec_(spec), layout_(train::make_param_layout(spec)), max_batch_(max_batch), device_(device),
      act_dtype_(device == turbo::Device::CPU ? DType::F32 : DType::BF16) {
  check_supported(spec_);
  if (max_batch < 1) throw ConfigError(fmt::format("inference engine: batch {} < 1", max_batch));
  if (const char* e = std::getenv("PRIMUS_INFERENCE_GRAPHS")) {
    const std::string v = e;
    if (v != "0" && v != "1") throw ConfigError(fmt::format("PRIMUS_INFERENCE_GRAPHS='{}': expected 1 or 0", v));
    use_graphs_ = v == "1";
  }

  auto make_arena = [&](size_t bytes) {
    return host() ? turbo::make_host_arena(bytes) : turbo::make_device_arena(bytes);
  };
  const size_t es = turbo::dtype_size(act_dtype_);
  const int64_t S = spec_.seq_length, C = spec_.hidden_size, H = spec_.num_attention_heads;
  const int64_t KV = spec_.num_query_groups, D = spec_.head_dim(), QD = spec_.q_dim(), KVD = spec_.kv_dim();
  const int64_t Vp = spec_.padded_vocab_size;
  // Activation rows: a whole window per slot up to kMaxRows tokens in one prefill (generate()
  // splits larger batched prefills), at least one full window.
  rows_ = std::max(S, std::min(max_batch_ * S, kMaxRows));

  // Weights: each tensor bf16 (host mode: f32) in its own aligned block (GEMM operands want
  // 16-byte alignment; the flat layout's offsets need not be).
  size_t wbytes = 0;
  auto kept_f32 = [](const std::string& name) { return name.ends_with("router.expert_bias"); };
  for (const auto& t : layout_.tensors) wbytes += aligned(static_cast<size_t>(t.numel) * (kept_f32(t.name) ? 4 : es));
  weights_ = make_arena(wbytes + kAlign);
  std::vector<uint16_t> bits;
  // The router's expert bias stays f32 (it only ranks experts; the router op takes it so).
  auto upload = [&](const std::string& name) -> TensorView {
    const train::ParamTensor* t = layout_.find(name);
    if (!t) return {};
    const float* src = host_params + t->offset;
    const bool f32 = kept_f32(name);
    const DType dt = f32 ? DType::F32 : act_dtype_;
    TensorView v;
    if (t->shape.size() == 1) v = weights_->tensor(dt, {t->shape[0]}, t->name.c_str());
    else if (t->shape.size() == 2) v = weights_->tensor(dt, {t->shape[0], t->shape[1]}, t->name.c_str());
    else if (t->shape.size() == 3) v = weights_->tensor(dt, {t->shape[0], t->shape[1], t->shape[2]}, t->name.c_str());
    else throw ConfigError(fmt::format("inference engine: tensor {} of {} dims is not supported", name, t->shape.size()));
    if (host()) {
      std::memcpy(v.data, src, v.nbytes());
      return v;
    }
    if (f32) {
      CUDA_CHECK(cudaMemcpy(v.data, src, v.nbytes(), cudaMemcpyHostToDevice));
      return v;
    }
    bits.resize(static_cast<size_t>(t->numel));
    for (int64_t i = 0; i < t->numel; ++i) bits[i] = turbo::float_to_bf16_bits(src[i]);
    CUDA_CHECK(cudaMemcpy(v.data, bits.data(), v.nbytes(), cudaMemcpyHostToDevice));
    return v;
  };
  wte_ = upload("embedding.weight");
  wpe_ = upload("position_embedding.weight");
  lnf_w_ = upload("final_norm.weight");
  lnf_b_ = upload("final_norm.bias");
  head_w_ = spec_.untied ? upload("output_layer.weight") : wte_;

  // Cache, activations, logits, tables.
  const int64_t FC = spec_.fc_dim(), F = spec_.ffn_hidden_size;
  const size_t cache_bytes = aligned(static_cast<size_t>(max_batch_ * S * KVD) * es);
  size_t sbytes = 2 * spec_.num_layers * cache_bytes;
  for (int64_t w : {C, C, C, spec_.qkv_dim(), QD, FC, F, C}) sbytes += aligned(static_cast<size_t>(rows_ * w) * es);
  sbytes += 2 * aligned(static_cast<size_t>(rows_) * 4) + aligned(static_cast<size_t>(rows_ * H) * 4);
  sbytes += aligned(static_cast<size_t>(rows_ * (H + KV) * D) * es) + aligned(static_cast<size_t>(rows_ * (H + KV)) * 4);
  sbytes += 4 * aligned(static_cast<size_t>(rows_) * 4) + aligned(static_cast<size_t>(max_batch_ * Vp) * 4);
  sbytes += aligned(static_cast<size_t>(S * D) * 4) + aligned(static_cast<size_t>(rows_ * std::max(QD, KVD)) * es) + kAlign;
  // Decode attention's split-KV partials (f32), sized for any decode batch up to max_batch_.
  const int64_t decode_ws_bytes = host() ? 0 : turbo::decode_attention_workspace_bytes(max_batch_, H, KV, D, S);
  if (decode_ws_bytes > 0) sbytes += aligned(static_cast<size_t>(decode_ws_bytes));
  const train::MoeSpec& moe = spec_.moe;
  const int64_t E = moe.num_experts, K = moe.topk, Fe = moe.ffn_hidden_size, Fs = moe.shared_ffn_hidden_size;
  const int64_t M = moe.enabled() ? turbo::moe_permuted_rows_max(rows_, K, E, turbo::kGroupedGemmAlign) : 0;
  if (moe.enabled()) {
    sbytes += 2 * aligned(static_cast<size_t>(rows_ * E) * 4) + 3 * aligned(static_cast<size_t>(rows_ * K) * 4);
    sbytes += 4 * aligned(static_cast<size_t>(E + 1) * 4) + aligned(4);
    for (int64_t w : {C, 2 * Fe, Fe, C}) sbytes += aligned(static_cast<size_t>(M * w) * es);
    for (int64_t w : {2 * Fs, Fs}) sbytes += aligned(static_cast<size_t>(rows_ * w) * es);
  }
  state_ = make_arena(sbytes);
  layers_.resize(static_cast<size_t>(spec_.num_layers));
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    LayerWeights& w = layers_[l];
    const std::string p = fmt::format("layers.{}.", l);
    w.norm1_w = upload(p + "norm1.weight");
    w.norm1_b = upload(p + "norm1.bias");
    w.qkv_w = upload(p + "attn.qkv.weight");
    w.qkv_b = upload(p + "attn.qkv.bias");
    w.q_norm = upload(p + "attn.q_norm.weight");
    w.k_norm = upload(p + "attn.k_norm.weight");
    w.proj_w = upload(p + "attn.proj.weight");
    w.proj_b = upload(p + "attn.proj.bias");
    w.norm2_w = upload(p + "norm2.weight");
    w.norm2_b = upload(p + "norm2.bias");
    w.fc_w = upload(p + "mlp.fc.weight");
    w.fc_b = upload(p + "mlp.fc.bias");
    w.out_w = upload(p + "mlp.proj.weight");
    w.out_b = upload(p + "mlp.proj.bias");
    if (spec_.is_moe_layer(l)) {
      const std::string m = p + "moe.";
      w.router_w = upload(m + "router.weight");
      w.expert_bias = upload(m + "router.expert_bias");
      w.experts_fc = upload(m + "experts.fc.weight");
      w.experts_proj = upload(m + "experts.proj.weight");
      w.shared_fc = upload(m + "shared.fc.weight");
      w.shared_proj = upload(m + "shared.proj.weight");
    }
    if (!w.qkv_w.defined() || (spec_.is_moe_layer(l) ? !w.router_w.defined() || !w.experts_fc.defined()
                                                      : !w.fc_w.defined() || !w.out_w.defined()))
      throw ConfigError(fmt::format("inference engine: layer {} lacks the qkv / MLP weights its spec implies", l));
    w.k_cache = state_->tensor(act_dtype_, {max_batch_, S, KV, D}, "k cache");
    w.v_cache = state_->tensor(act_dtype_, {max_batch_, S, KV, D}, "v cache");
  }
  for (auto& h : h_) h = state_->tensor(act_dtype_, {rows_, C}, "residual");
  ln_ = state_->tensor(act_dtype_, {rows_, C}, "ln");
  tmp_ = state_->tensor(act_dtype_, {rows_, C}, "branch out");
  qkv_ = state_->tensor(act_dtype_, {rows_, spec_.qkv_dim()}, "qkv");
  att_ = state_->tensor(act_dtype_, {rows_, QD}, "att");
  fc_ = state_->tensor(act_dtype_, {rows_, FC}, "fc");
  act_ = state_->tensor(act_dtype_, {rows_, F}, "act");
  mean_ = state_->tensor(DType::F32, {rows_}, "mean");
  rstd_ = state_->tensor(DType::F32, {rows_}, "rstd");
  lse_ = state_->tensor(DType::F32, {rows_ * H}, "lse");
  qk_saved_ = state_->tensor(act_dtype_, {rows_ * (H + KV) * D}, "qk saved");
  qk_rstd_ = state_->tensor(DType::F32, {rows_ * (H + KV)}, "qk rstd");
  if (spec_.qk_layernorm && spec_.qk_norm_whole) qk_dense_ = state_->tensor(act_dtype_, {rows_ * std::max(QD, KVD)}, "qk dense");
  tokens_ = state_->tensor(DType::I32, {rows_}, "tokens");
  positions_ = state_->tensor(DType::I32, {rows_}, "positions");
  slot_ = state_->tensor(DType::I32, {rows_}, "slots");
  len_dev_ = state_->tensor(DType::I32, {rows_}, "lengths");
  logits_ = state_->tensor(DType::F32, {max_batch_, Vp}, "logits");
  if (decode_ws_bytes > 0) decode_ws_ = state_->tensor(DType::F32, {decode_ws_bytes / 4}, "decode attention partials");
  if (moe.enabled()) {
    MoeBuffers& b = moe_;
    b.logits = state_->tensor(DType::F32, {rows_, E}, "router logits");
    b.probs = state_->tensor(DType::F32, {rows_, E}, "router scores");
    b.topk_idx = state_->tensor(DType::I32, {rows_, K}, "chosen experts");
    b.topk_weight = state_->tensor(DType::F32, {rows_, K}, "routing weights");
    b.rows = state_->tensor(DType::I32, {rows_, K}, "slot rows");
    b.offsets = state_->tensor(DType::I32, {E + 1}, "group offsets");
    b.counts = state_->tensor(DType::I32, {E}, "expert counts");
    b.kept = state_->tensor(DType::I32, {E}, "expert kept");
    b.prob_sum = state_->tensor(DType::F32, {E}, "prob sums");
    b.z_sum = state_->tensor(DType::F32, {1}, "z sum");
    b.xp = state_->tensor(act_dtype_, {M, C}, "permuted input");
    b.h = state_->tensor(act_dtype_, {M, 2 * Fe}, "expert gate|up");
    b.act = state_->tensor(act_dtype_, {M, Fe}, "expert activation");
    b.yp = state_->tensor(act_dtype_, {M, C}, "expert output");
    if (Fs > 0) {
      b.sfc = state_->tensor(act_dtype_, {rows_, 2 * Fs}, "shared gate|up");
      b.sact = state_->tensor(act_dtype_, {rows_, Fs}, "shared activation");
    }
    router_.num_experts = E;
    router_.topk = K;
    router_.score = moe.sigmoid ? turbo::RouterScore::Sigmoid : turbo::RouterScore::Softmax;
    router_.pre_softmax = moe.pre_softmax;
    router_.num_groups = moe.num_groups;
    router_.group_topk = moe.group_topk;
    router_.scaling_factor = moe.topk_scaling_factor;
  }
  // The stream and the pinned buffer last: the destructor releases them, and a constructor that
  // throws runs no destructor (the arenas free themselves).
  if (!host()) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (auto& e : copy_events_) CUDA_CHECK(cudaEventCreate(&e));
  }
  if (spec_.rope && !host()) {  // the CPU backend computes the angles from the base
    rope_table_ = state_->tensor(DType::F32, {S, D / 2, 2}, "rope table");
    turbo::rope_build_table(rope_table_, spec_.rotary_base, {stream_, nullptr}, spec_.rope_scaling);
  }
  if (!host()) {
    pinned_count_ = static_cast<size_t>(max_batch_ * Vp);
    CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_logits_), pinned_count_ * 4));
  }
  // Attention's workspace (cuDNN's plan, Turbo's kernels) and the ops' small borrows.
  scratch_ = make_arena(host() ? size_t{16} << 20 : size_t{256} << 20);
  len_.assign(static_cast<size_t>(max_batch_), 0);
  if (!host()) CUDA_CHECK(cudaStreamSynchronize(stream_));
}

InferenceEngine::~InferenceEngine() {
  for (auto& [n, g] : graphs_)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  if (pinned_logits_) cudaFreeHost(pinned_logits_);
  for (auto& e : copy_events_)
    if (e) cudaEventDestroy(e);
  if (stream_) cudaStreamDestroy(stream_);
}

void InferenceEngine::upload(void* dst, const void* src, size_t bytes) {
  if (host()) std::memcpy(dst, src, bytes);
  else CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
}

void InferenceEngine::copy_rows(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, int64_t rows) {
  if (!host()) {
    CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, static_cast<size_t>(rows), cudaMemcpyDeviceToDevice,
                                 stream_));
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
}

size_t InferenceEngine::device_bytes() const {
  return weights_->capacity() + state_->capacity() + scratch_->capacity();
}

void InferenceEngine::norm(const TensorView& out, const TensorView& resid_out, const TensorView& inp,
                           const TensorView& resid, const TensorView& w, const TensorView& b, int64_t N) {
  turbo::NormForwardArgs a;
  a.type = spec_.layernorm ? turbo::NormType::LayerNorm : turbo::NormType::RMSNorm;
  a.out = out.slice0(0, N);
  if (spec_.layernorm) a.mean = mean_.slice0(0, N);
  a.rstd = rstd_.slice0(0, N);
  if (resid.defined()) {
    a.residual_out = resid_out.slice0(0, N);
    a.residual = resid.slice0(0, N);
  }
  a.inp = inp.slice0(0, N);
  a.weight = w;
  a.bias = b;
  a.eps = static_cast<float>(spec_.norm_epsilon);
  a.ctx = {stream_, scratch_.get()};
  turbo::norm_forward(a);
}

const float* InferenceEngine::run(int64_t B, int64_t T, bool decoding, bool all_rows, float* logits_dev) {
  return fetch(enqueue(B, T, decoding, all_rows, logits_dev), logits_dev);
}

int64_t InferenceEngine::enqueue(int64_t B, int64_t T, bool decoding, bool all_rows, float* logits_dev) {
  const int64_t N = B * T, C = spec_.hidden_size, H = spec_.num_attention_heads, KV = spec_.num_query_groups;
  const int64_t D = spec_.head_dim(), QD = spec_.q_dim(), KVD = spec_.kv_dim(), Vp = spec_.padded_vocab_size;
  const turbo::ExecContext c{stream_, scratch_.get()};
  const TensorView pos = decoding ? reshaped(positions_.slice0(0, N), {B, T}) : TensorView{};
  {
    turbo::EmbeddingArgs e;
    e.out = reshaped(h_[0].slice0(0, N), {B, T, C});
    e.tokens = reshaped(tokens_.slice0(0, N), {B, T});
    e.positions = pos;
    e.wte = wte_;
    e.wpe = wpe_;
    e.ctx = c;
    turbo::embedding_forward(e);
  }
  cur_ = 0;
  // Every norm but the first adds the branch output (tmp_) to the residual stream on the way:
  // h_[cur_ ^ 1] = h_[cur_] + tmp_, then cur_ flips.
  auto add_norm = [&](const TensorView& w, const TensorView& b) {
    norm(ln_, h_[cur_ ^ 1], tmp_, h_[cur_], w, b, N);
    cur_ ^= 1;
  };
  const TensorView qkv = qkv_.slice0(0, N);
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    const LayerWeights& w = layers_[l];
    if (l == 0) norm(ln_, {}, h_[0], {}, w.norm1_w, w.norm1_b, N);
    else add_norm(w.norm1_w, w.norm1_b);
    turbo::linear_forward(qkv, ln_.slice0(0, N), w.qkv_w, w.qkv_b, {}, c);
    if (spec_.qk_layernorm && spec_.qk_norm_whole) {
      // One RMSNorm over the whole q and one over the whole k (OLMoE): the columns are copied to
      // dense rows, normalised back into place.
      const size_t es = turbo::dtype_size(qkv.dtype), W = static_cast<size_t>(qkv.shape[1]);
      for (auto [col, width, wt] : {std::tuple{int64_t{0}, QD, &w.q_norm}, std::tuple{QD, KVD, &w.k_norm}}) {
        const TensorView dense = qk_dense_.slice0(0, N * width).reshape({N, width});
        TensorView packed(static_cast<char*>(qkv.data) + col * es, qkv.dtype, qkv.device, {N, width});
        packed.strides = {static_cast<int64_t>(W), 1, 0, 0};
        copy_rows(dense.data, width * es, packed.data, W * es, width * es, N);
        turbo::NormForwardArgs a;
        a.type = turbo::NormType::RMSNorm;
        a.out = packed;
        a.rstd = rstd_.slice0(0, N);
        a.inp = dense;
        a.weight = *wt;
        a.eps = static_cast<float>(spec_.norm_epsilon);
        a.ctx = c;
        turbo::norm_forward(a);
      }
    } else if (spec_.qk_layernorm) {
      turbo::HeadNormArgs hn;
      hn.x = heads(qkv, B, T, 0, H + KV, D);
      hn.saved = reshaped(qk_saved_.slice0(0, N * (H + KV) * D), {B, T, H + KV, D});
      hn.rstd = qk_rstd_.slice0(0, N * (H + KV));
      hn.weight = w.q_norm;
      hn.weight_k = w.k_norm;
      hn.q_heads = H;
      hn.eps = static_cast<float>(spec_.norm_epsilon);
      hn.ctx = c;
      turbo::head_norm(hn);
    }
    if (spec_.rope) {
      turbo::RopeArgs r;
      r.out = r.inp = heads(qkv, B, T, 0, H + KV, D);
      r.positions = pos;
      r.table = rope_table_;
      r.base = spec_.rotary_base;
      r.scaling = spec_.rope_scaling;
      r.ctx = c;
      turbo::rope(r);
    }
    // The keys and values of these tokens into the cache (prefill: positions 0..T-1 of one slot).
    turbo::KvCacheWriteArgs kw;
    kw.k_cache = w.k_cache;
    kw.v_cache = w.v_cache;
    kw.k = rows3(qkv, N, QD, KV, D);
    kw.v = rows3(qkv, N, QD + KVD, KV, D);
    kw.slot = slot_.slice0(0, N);
    kw.len = len_dev_.slice0(0, N);
    kw.ctx = c;
    turbo::kv_cache_write(kw);
    if (decoding) {
      turbo::DecodeAttentionArgs da;
      da.out = reshaped(att_.slice0(0, N), {N, H, D});
      da.q = rows3(qkv, N, 0, H, D);
      da.k_cache = w.k_cache;
      da.v_cache = w.v_cache;
      da.slot = slot_.slice0(0, N);
      da.len = len_dev_.slice0(0, N);
      da.window = spec_.sliding_window;
      da.workspace = decode_ws_;
      da.ctx = c;
      turbo::decode_attention(da);
    } else {
#ifdef PRIMUS_CUDA_HAVE_TURBO_ATTENTION
      turbo::AttentionForwardArgs at;
      at.out = reshaped(att_.slice0(0, N), {B, T, H, D});
      at.lse = reshaped(lse_.slice0(0, N * H), {B, H, T});
      at.q = heads(qkv, B, T, 0, H, D);
      at.k = heads(qkv, B, T, QD, KV, D);
      at.v = heads(qkv, B, T, QD + KVD, KV, D);
      at.opt.causal = true;
      at.opt.window = spec_.sliding_window;
      at.ctx = c;
      turbo::attention_forward(at);
#else
      throw ConfigError("inference engine: this build has no Turbo attention op (turbo/ops/attention.cpp)");
#endif
    }
    turbo::linear_forward(tmp_.slice0(0, N), att_.slice0(0, N), w.proj_w, w.proj_b, {}, c);
    add_norm(w.norm2_w, w.norm2_b);
    if (spec_.is_moe_layer(l)) {
      moe_forward(w, N);
      continue;
    }
    turbo::linear_forward(fc_.slice0(0, N), ln_.slice0(0, N), w.fc_w, w.fc_b, {}, c);
    turbo::activation_forward({spec_.swiglu ? turbo::Activation::SwiGLU : turbo::Activation::Gelu, act_.slice0(0, N),
                               fc_.slice0(0, N), c});
    turbo::linear_forward(tmp_.slice0(0, N), act_.slice0(0, N), w.out_w, w.out_b, {}, c);
  }
  add_norm(lnf_w_, lnf_b_);
  // The head reads every row (decode, all_rows) or each sequence's last one, gathered into tmp_
  // (free after the final norm) when there are several sequences.
  int64_t head_rows = N;
  TensorView head_in = ln_.slice0(0, N);
  if (!decoding && !all_rows) {
    head_rows = B;
    if (B == 1) {
      head_in = ln_.slice0(N - 1, N);
    } else {
      const size_t row = static_cast<size_t>(C) * turbo::dtype_size(act_dtype_);
      copy_rows(tmp_.data, row, static_cast<char*>(ln_.data) + (T - 1) * row, T * row, row, B);
      head_in = tmp_.slice0(0, B);
    }
  }
  const TensorView out{logits_dev, DType::F32, device_, {head_rows, Vp}};
  turbo::linear_forward(out, head_in, head_w_, {}, {}, c);
  return head_rows;
}

// router -> row plan -> permute -> grouped expert GEMMs (SwiGLU between) -> weighted unpermute,
// the shared expert added on top: the training decoder's MoE forward (dropless) into tmp_.
void InferenceEngine::moe_forward(const LayerWeights& w, int64_t N) {
  const turbo::ExecContext c{stream_, scratch_.get()};
  const MoeBuffers& b = moe_;
  const TensorView ln = ln_.slice0(0, N), out = tmp_.slice0(0, N);
  const TensorView idx = b.topk_idx.slice0(0, N), wt = b.topk_weight.slice0(0, N), rows = b.rows.slice0(0, N);
  {
    turbo::GemmArgs g;  // f32 logits from the bf16 GEMM: the softmax and top-k see full precision
    g.a = ln;
    g.b = w.router_w.transposed();
    g.d = b.logits.slice0(0, N);
    g.ctx = c;
    turbo::gemm(g);
  }
  turbo::RouterForwardArgs r;
  r.cfg = router_;
  r.logits = b.logits.slice0(0, N);
  r.bias = w.expert_bias;
  r.topk_idx = idx;
  r.topk_weight = wt;
  r.probs = b.probs.slice0(0, N);
  r.counts = b.counts;
  r.prob_sum = b.prob_sum;
  r.z_sum = b.z_sum;
  r.ctx = c;
  turbo::router_forward(r);
  turbo::MoePlanArgs pl;
  pl.topk_idx = idx;
  pl.topk_weight = wt;
  pl.counts = b.counts;
  pl.align = turbo::kGroupedGemmAlign;
  pl.capacity = -1;
  pl.row_of_slot = rows;
  pl.offsets = b.offsets;
  pl.kept = b.kept;
  pl.ctx = c;
  turbo::moe_plan_rows(pl);
  turbo::moe_permute({b.xp, ln, rows, b.offsets, b.kept, c});
  turbo::grouped_gemm_forward({b.h, b.xp, w.experts_fc, b.offsets, turbo::kGroupedGemmAlign, c});
  turbo::activation_forward({turbo::Activation::SwiGLU, b.act, b.h, c});
  turbo::grouped_gemm_forward({b.yp, b.act, w.experts_proj, b.offsets, turbo::kGroupedGemmAlign, c});
  turbo::moe_unpermute({out, b.yp, wt, rows, false, c});
  if (w.shared_fc.defined()) {
    turbo::linear_forward(b.sfc.slice0(0, N), ln, w.shared_fc, {}, {}, c);
    turbo::activation_forward({turbo::Activation::SwiGLU, b.sact.slice0(0, N), b.sfc.slice0(0, N), c});
    turbo::GemmArgs g;  // out += shared expert
    g.a = b.sact.slice0(0, N);
    g.b = w.shared_proj.transposed();
    g.d = out;
    g.beta = 1.0f;
    g.ctx = c;
    turbo::gemm(g);
  }
}

const float* InferenceEngine::fetch(int64_t head_rows, float* logits_dev) {
  // Pinned memory for the rows of a decode or prefill step (a pageable copy of Llama-3's 8 x 128K
  // logits would take about twice as long); a larger all-rows request goes through a vector.
  const size_t count = static_cast<size_t>(head_rows * spec_.padded_vocab_size);
  if (host()) return logits_dev;
  float* dst = count <= pinned_count_ ? pinned_logits_ : (host_logits_.resize(count), host_logits_.data());
  CUDA_CHECK(cudaEventRecord(copy_events_[0], stream_));
  CUDA_CHECK(cudaMemcpyAsync(dst, logits_dev, count * 4, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaEventRecord(copy_events_[1], stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, copy_events_[0], copy_events_[1]));
  logits_copy_ms_ += ms;
  return dst;
}

const float* InferenceEngine::prefill(int64_t slot, const int32_t* tokens, int64_t n, bool all_rows) {
  const int32_t s32 = static_cast<int32_t>(slot);
  if (!all_rows) return prefill_batch(&s32, tokens, 1, n);
  // Every row's logits: a buffer of its own (tests and scoring; generation needs the last row only).
  stage_prefill(&s32, tokens, 1, n);
  const size_t count = static_cast<size_t>(n * spec_.padded_vocab_size);
  if (host()) {
    host_logits_.resize(count);
    return run(1, n, false, true, host_logits_.data());
  }
  float* buf = nullptr;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buf), count * 4));
  const float* rows = nullptr;
  try {
    rows = run(1, n, false, true, buf);
  } catch (...) {
    cudaFree(buf);
    throw;
  }
  CUDA_CHECK(cudaFree(buf));
  return rows;
}

const float* InferenceEngine::prefill_batch(const int32_t* slots, const int32_t* tokens, int64_t B, int64_t T) {
  if (B < 1 || B > max_batch_) throw RuntimeError(fmt::format("prefill: {} sequences outside [1, {}]", B, max_batch_));
  stage_prefill(slots, tokens, B, T);
  return run(B, T, false, false, logits_.ptr<float>());
}

void InferenceEngine::stage_prefill(const int32_t* slots, const int32_t* tokens, int64_t B, int64_t T) {
  if (T < 1 || T > capacity())
    throw RuntimeError(fmt::format("prefill: {} tokens outside [1, {}] (the model's seq_length)", T, capacity()));
  if (B * T > rows_) throw RuntimeError(fmt::format("prefill: {} x {} tokens exceed the engine's {} rows", B, T, rows_));
  const int64_t N = B * T;
  std::vector<int32_t> staged(static_cast<size_t>(3 * N));
  std::vector<bool> seen(static_cast<size_t>(max_batch_), false);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = slots[b];
    if (s < 0 || s >= max_batch_ || seen[s])
      throw RuntimeError(fmt::format("prefill: slot {} (entry {}) outside [0, {}) or listed twice", s, b, max_batch_));
    seen[s] = true;
    for (int64_t t = 0; t < T; ++t) {
      const int32_t id = tokens[b * T + t];
      if (id < 0 || id >= spec_.vocab_size)
        throw RuntimeError(fmt::format("prefill: token {} at {} of slot {} outside the vocabulary [0, {})", id, t, s,
                                       spec_.vocab_size));
      staged[b * T + t] = id;
      staged[N + b * T + t] = static_cast<int32_t>(s);
      staged[2 * N + b * T + t] = static_cast<int32_t>(t + 1);
    }
  }
  upload(tokens_.data, staged.data(), N * 4);
  upload(slot_.data, staged.data() + N, N * 4);
  upload(len_dev_.data, staged.data() + 2 * N, N * 4);
  for (int64_t b = 0; b < B; ++b) len_[slots[b]] = static_cast<int32_t>(T);
}

const float* InferenceEngine::decode(const int32_t* slots, const int32_t* tokens, int64_t n) {
  if (n < 1 || n > max_batch_) throw RuntimeError(fmt::format("decode: {} sequences outside [1, {}]", n, max_batch_));
  std::vector<int32_t> staged(static_cast<size_t>(4 * n));
  std::vector<bool> seen(static_cast<size_t>(max_batch_), false);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = slots[i];
    if (s < 0 || s >= max_batch_ || seen[s])
      throw RuntimeError(fmt::format("decode: slot {} (entry {}) outside [0, {}) or listed twice", s, i, max_batch_));
    seen[s] = true;
    if (len_[s] < 1 || len_[s] >= capacity())
      throw RuntimeError(fmt::format("decode: slot {} holds {} positions; decoding needs 1 to {} (prefill it first; "
                                     "past seq_length recompute the window)",
                                     s, len_[s], capacity() - 1));
    if (tokens[i] < 0 || tokens[i] >= spec_.vocab_size)
      throw RuntimeError(fmt::format("decode: token {} of slot {} outside the vocabulary [0, {})", tokens[i], s, spec_.vocab_size));
    staged[i] = tokens[i];
    staged[n + i] = len_[s];  // the new token's position
    staged[2 * n + i] = static_cast<int32_t>(s);
    staged[3 * n + i] = len_[s] + 1;
  }
  upload(tokens_.data, staged.data(), n * 4);
  upload(positions_.data, staged.data() + n, n * 4);
  upload(slot_.data, staged.data() + 2 * n, n * 4);
  upload(len_dev_.data, staged.data() + 3 * n, n * 4);
  for (int64_t i = 0; i < n; ++i) ++len_[slots[i]];
  float* logits = logits_.ptr<float>();
  if (host() || !use_graphs_) return run(n, 1, true, false, logits);
  // A decode step of n sequences is the same launches every time (the inputs sit in fixed
  // buffers): captured once as a CUDA graph after a first plain run (which lets the GEMMs pick
  // their algorithms outside the capture), then replayed, so a small model's step is not bound
  // by launching some 10 kernels per layer.
  Graph& g = graphs_[n];
  if (!g.exec && g.plain_runs++ >= 1) capture(g, n);
  if (!g.exec) return run(n, 1, true, false, logits);
  CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
  return fetch(n, logits);
}

void InferenceEngine::capture(Graph& g, int64_t n) {
  cudaGraph_t graph = nullptr;
  const turbo::GlobalBackendManager::CaptureScope scope;  // no autotune timing while capturing
  CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue(n, 1, true, false, logits_.ptr<float>());
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&g.exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
  } catch (const std::exception& e) {
    // An op that cannot be captured: decode without graphs from now on (same results, slower).
    cudaStreamCaptureStatus st;
    if (cudaStreamIsCapturing(stream_, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
      cudaStreamEndCapture(stream_, &graph);
    }
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    g.exec = nullptr;
    use_graphs_ = false;
    spdlog::warn("[generate] decode steps run without CUDA graphs: capturing one failed ({})", e.what());
  }
}

std::vector<std::vector<int32_t>> generate(InferenceEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                           const train::SampleOptions& o, std::mt19937_64& rng, bool use_cache,
                                           GenerateStats* stats) {
  train::check_sample_options(o);
  const int64_t n = static_cast<int64_t>(prompts.size()), S = engine.capacity();
  const int64_t V = engine.spec().vocab_size, Vp = engine.spec().padded_vocab_size;
  if (n < 1 || n > engine.max_batch())
    throw ConfigError(fmt::format("generate: {} prompts; the engine holds 1 to {}", n, engine.max_batch()));
  GenerateStats st;
  std::vector<std::vector<int32_t>> ids(prompts), out(static_cast<size_t>(n));
  std::vector<bool> done(static_cast<size_t>(n), o.max_new_tokens == 0);
  for (int64_t b = 0; b < n; ++b) {
    if (prompts[b].empty()) throw ConfigError(fmt::format("generate: prompt {} is empty", b));
    st.prompt_tokens += static_cast<int64_t>(prompts[b].size());
  }
  train::Sampler sampler;
  using clock = std::chrono::steady_clock;
  double sample_ms = 0;
  auto take = [&](int64_t b, const float* row) {
    const auto ts = clock::now();
    const int32_t next = sampler(row, V, o, rng);
    sample_ms += ms_since(ts);
    ids[b].push_back(next);
    out[b].push_back(next);
    ++st.new_tokens;
    if (static_cast<int64_t>(out[b].size()) >= o.max_new_tokens || (o.stop_at_eod && next == o.eod_id)) done[b] = true;
  };
  // Logits for the listed sequences, row_of[b] (host rows of the padded vocabulary): a batched
  // decode of those with the cache whose next position fits, and for the rest the last min(S, size)
  // tokens from position 0, one batched prefill per window length (the prompts' prefill; every step
  // without the cache; past seq_length, where positions cannot grow further). A call reuses the
  // engine's host buffer, so the rows of all calls but the last are copied out.
  std::vector<const float*> row_of(static_cast<size_t>(n), nullptr);
  std::vector<std::vector<float>> copies;
  std::vector<int32_t> slots, toks;
  auto logits_for = [&](const std::vector<int64_t>& rows, bool cached) {
    copies.clear();
    std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> calls;  // (slots, tokens); T = 0: decode
    std::vector<int64_t> lens;
    slots.clear();
    toks.clear();
    std::map<int64_t, std::vector<int64_t>> by_len;
    for (int64_t b : rows) {
      if (cached && static_cast<int64_t>(ids[b].size()) <= S) {
        slots.push_back(static_cast<int32_t>(b));
        toks.push_back(ids[b].back());
      } else {
        by_len[std::min<int64_t>(S, static_cast<int64_t>(ids[b].size()))].push_back(b);
      }
    }
    if (!slots.empty()) calls.emplace_back(slots, toks), lens.push_back(0);
    const int64_t per_call = std::max<int64_t>(1, engine.rows() / S);  // windows of up to S tokens per prefill
    for (const auto& [T, members] : by_len) {
      for (size_t at = 0; at < members.size(); at += static_cast<size_t>(per_call)) {
        const size_t end = std::min(members.size(), at + static_cast<size_t>(per_call));
        std::vector<int32_t> g(members.begin() + at, members.begin() + end), flat;
        for (size_t i = at; i < end; ++i) flat.insert(flat.end(), ids[members[i]].end() - T, ids[members[i]].end());
        calls.emplace_back(std::move(g), std::move(flat));
        lens.push_back(T);
      }
    }
    copies.reserve(calls.size());  // row_of points into them
    for (size_t k = 0; k < calls.size(); ++k) {
      const auto& [g, t] = calls[k];
      const int64_t B = static_cast<int64_t>(g.size());
      const float* l = lens[k] == 0 ? engine.decode(g.data(), t.data(), B) : engine.prefill_batch(g.data(), t.data(), B, lens[k]);
      if (k + 1 < calls.size()) {
        copies.emplace_back(l, l + B * Vp);
        l = copies.back().data();
      }
      for (int64_t i = 0; i < B; ++i) row_of[g[i]] = l + i * Vp;
    }
  };
  auto active = [&] {
    std::vector<int64_t> rows;
    for (int64_t b = 0; b < n; ++b)
      if (!done[b]) rows.push_back(b);
    return rows;
  };
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> rows = active();
  logits_for(rows, false);
  for (int64_t b : rows) take(b, row_of[b]);  // in prompt order: one generator, a fixed order of draws
  st.prefill_ms = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  const double copy0 = engine.logits_copy_ms(), sample0 = sample_ms;
  for (rows = active(); !rows.empty(); rows = active()) {
    logits_for(rows, use_cache);
    for (int64_t b : rows) take(b, row_of[b]);
    ++st.decode_steps;
  }
  st.decode_ms = ms_since(t0);
  st.decode_copy_ms = engine.logits_copy_ms() - copy0;
  st.decode_sample_ms = sample_ms - sample0;
  if (stats) *stats = st;
  return out;
}

}  // namespace primus::backends::cuda
