#include "backends/cuda/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "backends/cuda/kernels/cast.h"
#include "backends/cuda/kernels/step_check.h"
#include "backends/cuda/nvtx.h"
#include "core/util/error.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cuda/elementwise.h"
#include "turbo/kernels/cuda/embedding.h"
#include "turbo/kernels/cuda/normalization.h"
#include "turbo/kernels/cuda/optimizer.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/embedding.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/gemm_fp8.h"
#include "turbo/ops/rope.h"

namespace primus::backends::cuda {

using turbo::Arena;
using turbo::DType;
using turbo::Device;

namespace {

enum class Pool { State, Acts };

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// The first pass of CudaModel::plan only adds up sizes; the second takes the buffers from the
// arenas sized by the first, so the two can never disagree.
class BufferPlan {
 public:
  BufferPlan(Arena* state, Arena* acts) : state_(state), acts_(acts) {}
  TensorView operator()(Pool pool, DType t, std::initializer_list<int64_t> shape, const char* what) {
    Arena* a = pool == Pool::State ? state_ : acts_;
    if (a) return a->tensor(t, shape, what);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    (pool == Pool::State ? state_bytes : acts_bytes) += round_up(size_t(n) * turbo::dtype_size(t), Arena::kDefaultAlign);
    return TensorView();
  }
  size_t state_bytes = 0, acts_bytes = 0;

 private:
  Arena *state_, *acts_;
};

void check_shapes(const train::ModelSpec& s) {
  auto need8 = [](int64_t v, const char* what) {
    if (v % 8 != 0) {
      throw ConfigError(fmt::format("the cuda backend needs {} to be a multiple of 8 (16-byte bf16 vectors), got {}",
                                    what, v));
    }
  };
  need8(s.hidden_size, "hidden_size");
  need8(s.head_dim(), "the head dimension (hidden_size / num_attention_heads)");
  need8(s.ffn_hidden_size, "ffn_hidden_size");
  if (s.padded_vocab_size % 8 != 0) {
    throw ConfigError(fmt::format("the cuda backend needs the padded vocabulary ({}) to be a multiple of 8: set "
                                  "make_vocab_size_divisible_by (128 is usual)",
                                  s.padded_vocab_size));
  }
}

// An A/B switch `name`: false when unset, empty or `off`, true when `on`; anything else is a
// ConfigError naming the variable and both values.
bool env_switch(const char* name, const char* off, const char* on) {
  const char* e = std::getenv(name);
  if (!e || !*e || std::strcmp(e, off) == 0) return false;
  if (std::strcmp(e, on) == 0) return true;
  throw ConfigError(fmt::format("{}='{}': expected {} or {}", name, e, off, on));
}

}  // namespace

CudaModel::CudaModel(const train::ModelSpec& spec, const CudaModelOptions& opt, CudaOps ops)
    : spec_(spec), layout_(train::make_param_layout(spec)), opt_(opt), ops_(std::move(ops)) {
  if (opt_.max_seq == 0) opt_.max_seq = spec_.seq_length;
  if (opt_.max_seq > spec_.seq_length) {
    throw ConfigError(fmt::format("sequence length {} exceeds the model's seq_length {}", opt_.max_seq, spec_.seq_length));
  }
  check_shapes(spec_);
  if (opt_.fp8_linear && opt_.device == Device::CUDA) {  // FP8 tensor cores: sm_89 (Ada) and sm_90 (Hopper) on
    int dev = 0;
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    if (prop.major * 10 + prop.minor < 89) {
      throw ConfigError(fmt::format("fp8: {} (compute capability {}.{}) has no FP8 tensor cores; FP8 GEMMs need "
                                    "compute capability 8.9 or newer (set fp8: none)",
                                    prop.name, prop.major, prop.minor));
    }
  }
  if (opt_.fp8_linear) {  // Hopper's FP8 GEMMs want every dimension a multiple of 16
    const int64_t N = opt_.max_batch * opt_.max_seq;
    for (const auto& [what, v] : {std::pair<const char*, int64_t>{"hidden_size", spec_.hidden_size},
                                  {"ffn_hidden_size", spec_.ffn_hidden_size},
                                  {"the kv projection width (num_query_groups x head dim)", spec_.kv_dim()},
                                  {"micro_batch_size x seq_length", N}}) {
      if (v % 16 != 0)
        throw ConfigError(fmt::format("fp8: FP8 GEMMs need {} to be a multiple of 16, got {}", what, v));
    }
  }
  if (const char* e = std::getenv("PRIMUS_CUDA_BIAS_GRAD"); e && *e) {  // empty: unset, as the other switches
    const std::string v = e;
    if (v == "gemm") bias_grad_ = BiasGrad::Gemm;
    else if (v == "separate") bias_grad_ = BiasGrad::Separate;
    else if (v == "norm") bias_grad_ = BiasGrad::Norm;
    else if (v == "ones") bias_grad_ = BiasGrad::Ones;
    else throw ConfigError(fmt::format("PRIMUS_CUDA_BIAS_GRAD='{}': expected ones, norm, separate or gemm", v));
  }
  // The ones column needs biases on the linear layers and the bf16 GEMMs (the FP8 slots quantize
  // their inputs whole, padding included).
  if (bias_grad_ == BiasGrad::Ones && spec_.bias && !opt_.fp8_linear) ones_pad_ = kOnesPad;
  // A/B switches read from the environment (unset: the default).
  zero_grad_full_ = env_switch("PRIMUS_CUDA_ZERO_GRAD", "ranges", "full");       // see zero_grad()
  gelu_unfused_fwd_ = env_switch("PRIMUS_CUDA_GELU_FWD", "epilogue", "unfused");  // see layer_forward()
  gelu_unfused_bwd_ = env_switch("PRIMUS_CUDA_GELU_BWD", "epilogue", "unfused");  // see backward()
  opt_.loss_slots = std::max<int64_t>(1, opt_.loss_slots);
  host_ = opt_.device == Device::CPU;
  if (host_ && (!opt_.optimizer_state || opt_.flat_elems != 0)) {
    throw RuntimeError("cuda model: host mode keeps its own optimizer state and unpadded buffers");
  }
  if (opt_.flat_elems != 0 && opt_.flat_elems < layout_.total) {
    throw RuntimeError(fmt::format("cuda model: flat_elems {} is below the parameter count {}", opt_.flat_elems,
                                   layout_.total));
  }
  act_ = host_ ? DType::F32 : DType::BF16;
  if (!host_) CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  policy_.resize(static_cast<size_t>(spec_.num_layers));
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    policy_[l] = ops_.recompute_policy ? ops_.recompute_policy(l, spec_.num_layers) : Recompute::None;
  }

  // The gradient ranges zero_grad() clears: all but those a beta-0 GEMM writes first each step.
  // Large ones (an untied token embedding: 1 GB for Llama-3's vocabulary) go to cudaMemsetAsync,
  // which runs at full rate (the ranges kernel measured 0.78 TB/s on it, 1.35 ms per Llama step on
  // an H200); the many small ones (norms, biases) to one zero_ranges kernel.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& t : layout_.tensors) {
    if (written_by_first_gemm(t.name)) continue;
    if (!ranges.empty() && ranges.back().first + ranges.back().second == t.offset)
      ranges.back().second += t.numel;
    else
      ranges.emplace_back(t.offset, t.numel);
  }
  for (const auto& r : ranges) (r.second >= kMemsetRange ? memset_ranges_ : zero_ranges_).push_back(r);
  for (const auto& r : zero_ranges_) zero_total_ += r.second;

  BufferPlan count(nullptr, nullptr);
  plan(count);
  const size_t table = round_up(turbo::cuda::multi_tensor_table_bytes(static_cast<int>(layout_.tensors.size())),
                                Arena::kDefaultAlign);
  const int64_t N = opt_.max_batch * opt_.max_seq, C = spec_.hidden_size;
  // Scratch: the largest single borrow of any op, the attention's included (they borrow one at a
  // time, in stream order, each within an ArenaScope). On the host only the fallback attention
  // and the FP8 linear layers borrow.
  // (the optimizer's chunks hold at least 256 elements each)
  if (!host_) {
    const size_t chunks_bound = size_t(layout_.total / 256) + layout_.tensors.size() + 1;
    scratch_bytes_ = std::max({turbo::cuda::norm_backward_scratch_bytes(N, C),
                               turbo::cuda::embedding_backward_scratch_bytes(N),
                               turbo::cuda::grad_norm_scratch_bytes(int64_t(chunks_bound)),
                               size_t(spec_.qkv_dim() + spec_.fc_dim()) * 4,
                               ones_pad_ == 0 ? size_t{0} : std::max(turbo::linear_backward_weight_ones_scratch_bytes(spec_.qkv_dim(), C + ones_pad_),
                                                                     turbo::linear_backward_weight_ones_scratch_bytes(spec_.fc_dim(), C + ones_pad_)),
                               size_t(std::max({turbo::cuda::column_sum_partials(N, spec_.qkv_dim()),
                                                turbo::cuda::column_sum_partials(N, spec_.fc_dim()),
                                                turbo::cuda::column_sum_partials(N, C)})) * 4 + Arena::kDefaultAlign});
  }
  if (opt_.fp8_linear) {  // the linear slots' quantized copies (one layer at a time)
    const int64_t F = spec_.fc_dim(), Fin = spec_.swiglu ? spec_.ffn_hidden_size : spec_.fc_dim();
    scratch_bytes_ = std::max({scratch_bytes_, turbo::linear_fp8_scratch_bytes(N, C, spec_.qkv_dim()),
                               turbo::linear_fp8_scratch_bytes(N, C, C), turbo::linear_fp8_scratch_bytes(N, C, F),
                               turbo::linear_fp8_scratch_bytes(N, Fin, C)});
  }
  // Attention: what the caller says its implementation needs, and on the device at least room
  // for Turbo's flash backward (f32 dq and row sums) and a cuDNN workspace.
  const int64_t H = spec_.num_attention_heads;
  const size_t turbo_attention = size_t(2 * N * C) * 4 + size_t(N * H) * 4 + (size_t{256} << 20);
  scratch_bytes_ = std::max(scratch_bytes_,
                            host_ ? opt_.attention_scratch_bytes : std::max(opt_.attention_scratch_bytes, turbo_attention));
  scratch_bytes_ = round_up(scratch_bytes_, size_t{1} << 20);
  auto make_arena = [this](size_t bytes) {
    return host_ ? turbo::make_host_arena(bytes) : turbo::make_device_arena(bytes);
  };
  state_ = make_arena(count.state_bytes + table + Arena::kDefaultAlign);
  acts_ = make_arena(count.acts_bytes + Arena::kDefaultAlign);
  scratch_ = make_arena(scratch_bytes_);
  BufferPlan take(state_.get(), acts_.get());
  plan(take);
  if (host_) weights_ = master_;  // fp32 compute on the master weights themselves

  // Parameter views into the flat buffers.
  wte_ = param("embedding.weight", true);
  wpe_ = param("position_embedding.weight", !spec_.rope);
  head_ = spec_.untied ? param("output_layer.weight", true) : wte_;
  final_norm_ = {param("final_norm.weight", true), param("final_norm.bias", false)};
  params_.resize(spec_.num_layers);
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    LayerParams& lp = params_[l];
    lp.norm1 = {param(p + "norm1.weight", true), param(p + "norm1.bias", false)};
    lp.norm2 = {param(p + "norm2.weight", true), param(p + "norm2.bias", false)};
    lp.qkv_w = param(p + "attn.qkv.weight", true);
    lp.qkv_b = param(p + "attn.qkv.bias", false);
    lp.proj_w = param(p + "attn.proj.weight", true);
    lp.proj_b = param(p + "attn.proj.bias", false);
    lp.fc_w = param(p + "mlp.fc.weight", true);
    lp.fc_b = param(p + "mlp.fc.bias", false);
    lp.out_w = param(p + "mlp.proj.weight", true);
    lp.out_b = param(p + "mlp.proj.bias", false);
  }

  // Optimizer over every tensor: fp32 master and moments, f32 gradients, the bf16 copy it refreshes.
  std::vector<turbo::AdamWTensor> ts;
  for (const auto& t : opt_.optimizer_state ? layout_.tensors : std::vector<train::ParamTensor>{}) {
    turbo::AdamWTensor a;
    a.master = master_.slice0(t.offset, t.offset + t.numel);
    if (!host_) a.model = weights_.slice0(t.offset, t.offset + t.numel);
    a.grad = grads_.slice0(t.offset, t.offset + t.numel);
    a.m = m_.slice0(t.offset, t.offset + t.numel);
    a.v = v_.slice0(t.offset, t.offset + t.numel);
    a.decay = t.decay;
    ts.push_back(a);
  }
  if (opt_.optimizer_state) adamw_ = std::make_unique<turbo::MultiTensorAdamW>(std::move(ts), state_.get());
  if (spec_.rope && !host_) turbo::rope_build_table(rope_table_, spec_.rotary_base, ctx());
  if (host_) {
    status_host_mem_.resize(2 * static_cast<size_t>(status_.numel()));
  } else {
    init_staging();
  }
  zero(status_);
  if (opt_.optimizer_state) set_moments(nullptr, nullptr);
  if (zero_table_.defined()) {
    std::vector<int64_t> t(static_cast<size_t>(zero_table_.numel()));
    const size_t n = zero_ranges_.size();
    for (size_t r = 0; r < n; ++r) {
      t[r + 1] = t[r] + zero_ranges_[r].second;
      t[n + 1 + r] = zero_ranges_[r].first;
    }
    to_model(zero_table_.data, t.data(), t.size() * sizeof(int64_t));
  }
  if (!ones_buffers_.empty()) {  // the padded norm outputs' extra columns: 1, 0, 0, ... in every row
    const size_t es = turbo::dtype_size(act_);
    std::vector<unsigned char> row(size_t(kOnesPad) * es, 0);
    if (act_ == DType::F32) {
      const float one = 1.0f;
      std::memcpy(row.data(), &one, es);
    } else {  // bf16 1.0 = 0x3f80, f16 1.0 = 0x3c00 (little-endian)
      const uint16_t one = act_ == DType::BF16 ? 0x3f80 : 0x3c00;
      std::memcpy(row.data(), &one, es);
    }
    // Every buffer has the same rows: one packed copy of the padding for all of them. From pageable
    // memory an H2D copy has taken the bytes when it returns, so `pattern` may go out of scope.
    const int64_t rows = ones_buffers_.front().size(0);
    std::vector<unsigned char> pattern(size_t(rows) * row.size());
    for (int64_t r = 0; r < rows; ++r) std::memcpy(pattern.data() + size_t(r) * row.size(), row.data(), row.size());
    for (const TensorView& t : ones_buffers_) {
      const int64_t width = t.size(1), C = width - kOnesPad;
      char* dst = static_cast<char*>(t.data) + size_t(C) * es;
      if (host_) {
        for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + size_t(r * width) * es, row.data(), row.size());
      } else {
        CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(width) * es, pattern.data(), row.size(), row.size(), size_t(rows),
                                     cudaMemcpyHostToDevice, stream_));
      }
    }
  }
  zero(grads_);  // once: the padding of a ZeRO-1 buffer and every tensor start at zero
  zero_grad();
  sync();
}

CudaModel::~CudaModel() {
  if (stream_) {
    cudaStreamSynchronize(stream_);  // no throwing from a destructor; errors surface elsewhere
    cudaStreamDestroy(stream_);
  }
  free_staging();
}

void CudaModel::init_staging() {
  const size_t slot_elems = size_t(opt_.max_batch * opt_.max_seq);
  const size_t batch_bytes = size_t(opt_.loss_slots) * 2 * slot_elems * 4;
  const size_t bytes = batch_bytes + 16 + status_.nbytes();
  for (StagingSet& set : staging_) {
    CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&set.mem), bytes));
    set.batch = reinterpret_cast<int32_t*>(set.mem);
    set.hyper = reinterpret_cast<float*>(set.mem + batch_bytes);
    set.status = reinterpret_cast<float*>(set.mem + batch_bytes + 16);
    set.batch_done.assign(static_cast<size_t>(opt_.loss_slots), nullptr);
    for (cudaEvent_t& e : set.batch_done) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&set.hyper_done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&set.status_done, cudaEventDisableTiming));
  }
}

void CudaModel::free_staging() {  // no throwing: called from the destructor
  for (StagingSet& set : staging_) {
    for (cudaEvent_t e : set.batch_done) (void)cudaEventDestroy(e);
    if (set.hyper_done) (void)cudaEventDestroy(set.hyper_done);
    if (set.status_done) (void)cudaEventDestroy(set.status_done);
    if (set.mem) (void)cudaFreeHost(set.mem);
    set = StagingSet{};
  }
}

template <class Take>
void CudaModel::plan(Take&& take) {
  const int64_t P = layout_.total, N = opt_.max_batch * opt_.max_seq;
  const int64_t C = spec_.hidden_size, H = spec_.num_attention_heads, KVD = spec_.kv_dim();
  const int64_t F = spec_.ffn_hidden_size, FC = spec_.fc_dim(), V = spec_.padded_vocab_size;
  const int64_t PF = std::max(P, opt_.flat_elems);  // padded for ZeRO-1 (CudaModelOptions)
  if (opt_.optimizer_state) master_ = take(Pool::State, DType::F32, {P}, "fp32 master weights");
  grads_ = take(Pool::State, DType::F32, {PF}, "fp32 gradients");
  if (opt_.optimizer_state) {
    m_ = take(Pool::State, DType::F32, {P}, "AdamW first moments");
    v_ = take(Pool::State, DType::F32, {P}, "AdamW second moments");
  }
  if (!host_) weights_ = take(Pool::State, DType::BF16, {PF}, "bf16 weights");
  if (spec_.rope && !host_) rope_table_ = take(Pool::State, DType::F32, {spec_.seq_length, spec_.head_dim() / 2, 2}, "RoPE table");
  const int64_t S = opt_.loss_slots;
  status_ = take(Pool::State, DType::F32, {S + 3}, "step status: loss sums, grad norm, clip factor, finite flag");
  if (status_.defined()) {
    loss_slots_ = status_.slice0(0, S);
    norm_ = status_.slice0(S, S + 2);
  }
  hyper_ = take(Pool::State, DType::F32, {3}, "AdamW lr and bias corrections");
  if (!host_ && !zero_ranges_.empty())  // the kernel's table (host mode clears range by range)
    zero_table_ = take(Pool::State, DType::I64, {2 * static_cast<int64_t>(zero_ranges_.size()) + 1},
                       "zero_grad ranges (prefix sums, offsets)");

  // Per layer, the tensors its recompute policy keeps get memory of their own; the others alias
  // one shared set (work_), which the forward and backward()'s recomputation refill layer by
  // layer. `keep` is the coarsest policy that still keeps the tensor.
  struct Field {
    TensorView LayerActs::*member;
    DType dtype;
    int64_t cols;
    bool flat;  // [N * cols] instead of [N, cols]
    Recompute keep;
    const char* what;
    int64_t pad = 0;  // rows `pad` columns longer than the view (the ones column; see BiasGrad)
  };
  const DType f32 = DType::F32;
  const Field fields[] = {
      {&LayerActs::x_in, act_, C, false, Recompute::Full, "layer input (residual stream)"},
      {&LayerActs::ln1, act_, C, false, Recompute::None, "norm1 output", ones_pad_},
      {&LayerActs::mean1, f32, 1, true, Recompute::None, "norm1 mean"},
      {&LayerActs::rstd1, f32, 1, true, Recompute::None, "norm1 rstd"},
      {&LayerActs::qkv, act_, C + 2 * KVD, false, Recompute::Selective, "q|k|v (packed projection)"},
      {&LayerActs::att, act_, C, false, Recompute::Selective, "attention output"},
      {&LayerActs::lse, f32, H, true, Recompute::Selective, "attention log-sum-exp"},
      {&LayerActs::x2, act_, C, false, Recompute::Selective, "residual after attention"},
      {&LayerActs::ln2, act_, C, false, Recompute::None, "norm2 output", ones_pad_},
      {&LayerActs::mean2, f32, 1, true, Recompute::None, "norm2 mean"},
      {&LayerActs::rstd2, f32, 1, true, Recompute::None, "norm2 rstd"},
      {&LayerActs::fc, act_, FC, false, Recompute::Selective, "MLP pre-activation"},
      {&LayerActs::act, act_, F, false, Recompute::Norms, "MLP activation"},
  };
  const int64_t L = spec_.num_layers;
  layers_.assign(static_cast<size_t>(L), LayerActs{});
  work_ = LayerActs{};
  for (const Field& f : fields) {
    auto take_field = [&] {
      if (f.flat) return take(Pool::Acts, f.dtype, {N * f.cols}, f.what);
      if (f.pad == 0) return take(Pool::Acts, f.dtype, {N, f.cols}, f.what);
      TensorView t = take(Pool::Acts, f.dtype, {N, f.cols + f.pad}, f.what);
      if (!t.defined()) return t;
      ones_buffers_.push_back(t);
      TensorView v(t.data, t.dtype, t.device, {N, f.cols});
      v.strides = {f.cols + f.pad, 1};
      return v;
    };
    bool shared = false;
    for (int64_t l = 0; l < L; ++l) {
      if (policy_[l] <= f.keep)
        layers_[l].*f.member = take_field();
      else
        shared = true;
    }
    if (!shared) continue;
    work_.*f.member = take_field();
    for (int64_t l = 0; l < L; ++l)
      if (policy_[l] > f.keep) layers_[l].*f.member = work_.*f.member;
  }
  tmp_ = take(Pool::Acts, act_, {N, C}, "projection output");
  x_final_ = take(Pool::Acts, act_, {N, C}, "final residual");
  lnf_ = take(Pool::Acts, act_, {N, C}, "final norm output");
  meanf_ = take(Pool::Acts, DType::F32, {N}, "final norm mean");
  rstdf_ = take(Pool::Acts, DType::F32, {N}, "final norm rstd");
  // The head runs in row blocks (forward() does its backward right after the loss; see kHeadBlockBytes),
  // so the logits buffer holds one block of B*T/chunks rows instead of all of them.
  const int64_t logits_bytes = N * V * static_cast<int64_t>(turbo::dtype_size(act_));
  const int64_t chunks = std::max(kMinHeadChunks, (logits_bytes + kHeadBlockBytes - 1) / kHeadBlockBytes);
  head_rows_ = (N + chunks - 1) / chunks;
  logits_ = take(Pool::Acts, act_, {head_rows_, V}, "logits / dlogits (one head block)");
  losses_ = take(Pool::Acts, DType::F32, {N}, "per-token losses");
  // One token and target buffer per micro-batch: a step's batches are all staged before it runs.
  tokens_ = take(Pool::Acts, DType::I32, {S * N}, "tokens (one slot per micro-batch)");
  targets_ = take(Pool::Acts, DType::I32, {S * N}, "targets (one slot per micro-batch)");
  dres_ = take(Pool::Acts, act_, {N, C}, "residual gradient");
  dln_ = take(Pool::Acts, act_, {N, C}, "norm output gradient");
  // One region for the backward's per-layer working gradients: the MLP's (dfc, dact) are dead
  // before the attention's (datt, dq|dk|dv and the rotated dq|dk) are written, and those are
  // dead before the next layer's MLP, so the two sets overlap.
  const bool rope = spec_.rope;
  const int64_t mlp_cols = FC + (spec_.swiglu ? F : 0);
  const int64_t att_cols = 2 * C + 2 * KVD + (rope ? C + KVD : 0);
  const TensorView bwd = take(Pool::Acts, act_, {N * std::max(mlp_cols, att_cols)}, "backward working gradients");
  // [N, cols] block starting `col0` columns-worth of N rows into the region.
  auto carve = [&](int64_t col0, int64_t cols) {
    if (!bwd.defined()) return TensorView();
    void* p = static_cast<char*>(bwd.data) + size_t(N * col0) * turbo::dtype_size(act_);
    return TensorView(p, act_, bwd.device, {N, cols});
  };
  dfc_ = carve(0, FC);
  dact_ = spec_.swiglu ? carve(FC, F) : TensorView();
  datt_ = carve(0, C);
  dqkv_ = carve(C, C + 2 * KVD);
  if (rope) dqk_rot_ = carve(2 * C + 2 * KVD, C + KVD);  // RoPE's backward reads these, writes dqkv_
}

CudaModel::Param CudaModel::param(const std::string& name, bool required) const {
  const train::ParamTensor* t = layout_.find(name);
  if (!t) {
    if (required) throw RuntimeError(fmt::format("cuda model: no parameter '{}'", name));
    return {};
  }
  auto shaped = [&](const TensorView& flat) {
    void* p = static_cast<char*>(flat.data) + size_t(t->offset) * turbo::dtype_size(flat.dtype);
    return t->shape.size() == 2 ? TensorView(p, flat.dtype, flat.device, {t->shape[0], t->shape[1]})
                                : TensorView(p, flat.dtype, flat.device, {t->shape[0]});
  };
  return {shaped(weights_), shaped(grads_)};
}

TensorView CudaModel::view(const TensorView& buf, std::initializer_list<int64_t> shape) const {
  return TensorView(buf.data, buf.dtype, buf.device, shape);
}

TensorView CudaModel::heads(const TensorView& buf, int64_t B, int64_t T, int64_t col, int64_t heads) const {
  const int64_t D = spec_.head_dim(), W = buf.size(1);
  if (col + heads * D > W) throw RuntimeError(fmt::format("cuda model: columns {}+{} outside {}", col, heads * D, buf.describe()));
  TensorView v(static_cast<char*>(buf.data) + size_t(col) * turbo::dtype_size(buf.dtype), buf.dtype, buf.device,
               {B, T, heads, D});
  v.strides = {T * W, W, D, 1};
  return v;
}

void CudaModel::to_model(void* dst, const void* src, size_t bytes) const {
  if (host_)
    std::memcpy(dst, src, bytes);
  else
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
}

void CudaModel::from_model(void* dst, const void* src, size_t bytes) const {
  if (host_) {
    std::memcpy(dst, src, bytes);
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaModel::zero(const TensorView& t) const {
  if (host_)
    std::memset(t.data, 0, t.nbytes());
  else
    CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), stream_));
}

void CudaModel::sync() const {
  if (!host_) CUDA_CHECK(cudaStreamSynchronize(stream_));
}

ExecContext CudaModel::ctx() const {
  ExecContext c;
  c.stream = stream_;
  c.scratch = scratch_.get();
  return c;
}

// ---- host copies --------------------------------------------------------------------------

void CudaModel::set_params(const float* host) {
  if (!opt_.optimizer_state) {  // no master copy: stage the fp32 weights in the gradient buffer
    to_model(grads_.data, host, size_t(layout_.total) * 4);
    kernels::cast_f32_to_bf16(weights_.data, grads_.ptr<float>(), layout_.total, stream_);
    zero_grad();
    sync();
    return;
  }
  to_model(master_.data, host, master_.nbytes());
  if (!host_) kernels::cast_f32_to_bf16(weights_.data, master_.ptr<float>(), layout_.total, stream_);
  sync();
}

void CudaModel::get_params(float* host) const {
  need_optimizer_state("get_params");
  from_model(host, master_.data, master_.nbytes());
}

void CudaModel::need_optimizer_state(const char* what) const {
  if (!opt_.optimizer_state) {
    throw RuntimeError(fmt::format("cuda model: {} needs the optimizer state, which this model (ZeRO-1) does not keep",
                                   what));
  }
}

void CudaModel::set_moments(const float* m, const float* v) {
  need_optimizer_state("set_moments");
  for (auto [dst, src] : {std::pair{&m_, m}, std::pair{&v_, v}}) {
    if (src)
      to_model(dst->data, src, dst->nbytes());
    else
      zero(*dst);
  }
  sync();
}

void CudaModel::get_moments(float* m, float* v) const {
  need_optimizer_state("get_moments");
  from_model(m, m_.data, m_.nbytes());
  from_model(v, v_.data, v_.nbytes());
}

void CudaModel::get_grads(float* host) const { from_model(host, grads_.data, grads_.nbytes()); }

bool CudaModel::written_by_first_gemm(const std::string& name) const {
  auto ends = [&](const char* s) {
    const size_t n = std::strlen(s);
    return name.size() >= n && name.compare(name.size() - n, n, s) == 0;
  };
  if (name.rfind("layers.", 0) == 0)
    return ends(".attn.qkv.weight") || ends(".attn.proj.weight") || ends(".mlp.fc.weight") || ends(".mlp.proj.weight");
  // The head's weight: its own, or the tied embedding (the head's GEMM runs before the embedding's
  // backward adds its rows).
  return name == (spec_.untied ? "output_layer.weight" : "embedding.weight");
}

void CudaModel::zero_grad() {
  mark(Phase::ZeroGrad);
  if (zero_grad_full_) {  // PRIMUS_CUDA_ZERO_GRAD=full: clear everything, every GEMM accumulates
    zero(grads_);
    return;
  }
  fresh_head_ = fresh_layers_ = true;
  for (const auto& [off, n] : memset_ranges_) zero(grads_.slice0(off, off + n));
  if (host_) {
    for (const auto& [off, n] : zero_ranges_) zero(grads_.slice0(off, off + n));
  } else if (zero_table_.defined()) {
    kernels::zero_ranges_f32(grads_.ptr<float>(), zero_table_.ptr<const int64_t>(),
                             static_cast<int>(zero_ranges_.size()), zero_total_, stream_);
  }
}

// ---- forward ------------------------------------------------------------------------------

void CudaModel::norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd,
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
  a.ctx = ctx();
  ops_.norm_forward(a);
}

void CudaModel::stage_batch(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, int64_t slot) {
  const int64_t N = B * T;
  if (B > opt_.max_batch || T > opt_.max_seq || B < 1 || T < 1) {
    throw RuntimeError(fmt::format("cuda model: batch {}x{} exceeds the buffers ({}x{})", B, T, opt_.max_batch,
                                   opt_.max_seq));
  }
  if (slot < 0 || slot >= opt_.loss_slots) {
    throw RuntimeError(fmt::format("cuda model: batch slot {} out of range (0..{})", slot, opt_.loss_slots - 1));
  }
  if (!tokens || !targets) throw RuntimeError("cuda model: stage_batch needs tokens and targets (the loss is fused with the head)");
  const size_t at = size_t(slot * opt_.max_batch * opt_.max_seq) * 4;
  if (host_) {
    to_model(static_cast<char*>(tokens_.data) + at, tokens, size_t(N) * 4);
    to_model(static_cast<char*>(targets_.data) + at, targets, size_t(N) * 4);
    return;
  }
  StagingSet& set = staging_[staging_set_];
  cudaEvent_t done = set.batch_done[static_cast<size_t>(slot)];
  CUDA_CHECK(cudaEventSynchronize(done));  // the region's last copy has read it
  int32_t* pinned = set.batch + size_t(slot) * 2 * size_t(opt_.max_batch * opt_.max_seq);
  std::copy_n(tokens, N, pinned);
  std::copy_n(targets, N, pinned + N);
  CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(tokens_.data) + at, pinned, size_t(N) * 4, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(targets_.data) + at, pinned + N, size_t(N) * 4, cudaMemcpyHostToDevice,
                             stream_));
  CUDA_CHECK(cudaEventRecord(done, stream_));
}

void CudaModel::layer_forward(int64_t l, int64_t B, int64_t T, bool recompute) {
  const int64_t N = B * T;
  const int64_t C = spec_.hidden_size, H = spec_.num_attention_heads, KV = spec_.num_query_groups;
  const int64_t D = spec_.head_dim(), KVD = spec_.kv_dim();
  const ExecContext c = ctx();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  auto phase = [&](Phase p) {
    if (!recompute) mark(p);  // a recomputation is one Phase::Recompute span
  };
  LayerActs& a = layers_[l];
  const LayerParams& p = params_[l];
  phase(Phase::Norm);
  if (l == 0 || recompute) {
    norm_forward(a.ln1, a.mean1, a.rstd1, {}, a.x_in, {}, p.norm1, N);
  } else {  // x_in = x2 of the layer below + its MLP output (in tmp_), fused with norm1
    norm_forward(a.ln1, a.mean1, a.rstd1, a.x_in, tmp_, layers_[l - 1].x2, p.norm1, N);
  }
  const TensorView ln1 = a.ln1.slice0(0, N);
  const TensorView& wqkv = p.qkv_w.w;
  const TensorView& bqkv = p.qkv_b.w;
  phase(Phase::QkvGemm);
  // One GEMM for q|k|v: its output rows pack them, and the attention reads strided views.
  const TensorView qkv = a.qkv.slice0(0, N);
  ops_.linear_forward(qkv, ln1, wqkv, bqkv, {}, c);
  const TensorView q4 = heads(qkv, B, T, 0, H), k4 = heads(qkv, B, T, C, KV), v4 = heads(qkv, B, T, C + KVD, KV);
  if (spec_.rope) {  // in place on q|k (adjacent columns, one rotation per position): only the rotated ones are needed later
    phase(Phase::Rope);
    const TensorView qk4 = heads(qkv, B, T, 0, H + KV);
    turbo::RopeArgs r;
    r.out = qk4;
    r.inp = qk4;
    r.table = rope_table_;
    r.base = spec_.rotary_base;
    r.ctx = c;
    turbo::rope(r);
  }
  AttentionCall at;
  at.out = view(a.att, {B, T, H, D});
  at.lse = view(a.lse, {B, H, T});
  at.q = q4;
  at.k = k4;
  at.v = v4;
  at.scale = scale;
  at.ctx = c;
  phase(Phase::Attention);
  ops_.attention_forward(at);
  phase(Phase::ProjGemm);
  ops_.linear_forward(tmp_.slice0(0, N), a.att.slice0(0, N), p.proj_w.w, p.proj_b.w, {}, c);
  phase(Phase::Norm);
  norm_forward(a.ln2, a.mean2, a.rstd2, a.x2, tmp_, a.x_in, p.norm2, N);
  phase(Phase::MlpUpGemm);
  if (spec_.swiglu || gelu_unfused_fwd_) {
    ops_.linear_forward(a.fc.slice0(0, N), a.ln2.slice0(0, N), p.fc_w.w, p.fc_b.w, {}, c);
    phase(Phase::Activation);
    turbo::activation_forward({spec_.swiglu ? turbo::Activation::SwiGLU : turbo::Activation::Gelu, a.act.slice0(0, N),
                               a.fc.slice0(0, N), c});
  } else {  // GELU fused into the GEMM epilogue; fc keeps the pre-activation for the backward
    ops_.linear_forward(a.act.slice0(0, N), a.ln2.slice0(0, N), p.fc_w.w, p.fc_b.w, a.fc.slice0(0, N), c);
  }
  if (recompute) return;  // the MLP output only feeds the next layer's forward
  phase(Phase::MlpDownGemm);
  ops_.linear_forward(tmp_.slice0(0, N), a.act.slice0(0, N), p.out_w.w, p.out_b.w, {}, c);
}

void CudaModel::forward_staged(int64_t B, int64_t T, float dloss, int64_t slot) {
  const int64_t N = B * T;
  if (B > opt_.max_batch || T > opt_.max_seq || B < 1 || T < 1) {
    throw RuntimeError(fmt::format("cuda model: batch {}x{} exceeds the buffers ({}x{})", B, T, opt_.max_batch,
                                   opt_.max_seq));
  }
  if (slot < 0 || slot >= opt_.loss_slots) {
    throw RuntimeError(fmt::format("cuda model: loss slot {} out of range (0..{})", slot, opt_.loss_slots - 1));
  }
  NvtxRange range("forward");
  B_ = B;
  T_ = T;
  slot_ = slot;
  const int64_t C = spec_.hidden_size;
  const ExecContext c = ctx();
  const int64_t at = slot * opt_.max_batch * opt_.max_seq;
  const TensorView targets = targets_.slice0(at, at + N);

  {
    mark(Phase::Embedding);
    turbo::EmbeddingArgs e;
    e.out = view(layers_[0].x_in, {B, T, C});
    e.tokens = view(tokens_.slice0(at, at + N), {B, T});
    e.wte = wte_.w;
    e.wpe = wpe_.w;
    e.ctx = c;
    turbo::embedding_forward(e);
  }
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    NvtxRange lr(fmt::format("layer {} fwd", l).c_str());
    layer_forward(l, B, T, false);
  }
  {
    NvtxRange hr("head + loss");
    mark(Phase::Norm);
    norm_forward(lnf_, meanf_, rstdf_, x_final_, tmp_, layers_.back().x2, final_norm_, N);
    for (int64_t r0 = 0; r0 < N; r0 += head_rows_) {
      const int64_t r1 = std::min(N, r0 + head_rows_);
      const TensorView logits = logits_.slice0(0, r1 - r0), lnf = lnf_.slice0(r0, r1);
      mark(Phase::HeadGemm);
      ops_.head_forward(logits, lnf, head_.w, {}, {}, c);
      turbo::CrossEntropyArgs ce;
      ce.logits = logits;
      if (dloss != 0.0f) ce.dlogits = logits;  // in place: no second [rows,V] buffer
      ce.losses = losses_.slice0(r0, r1);
      ce.targets = targets.slice0(r0, r1);
      ce.vocab = spec_.vocab_size;
      ce.dloss = dloss;
      ce.ctx = c;
      mark(Phase::Loss);
      ops_.cross_entropy(ce);
      // The head's backward now, while this block's dlogits exist: d(final norm output) into
      // dln_ (untouched until backward() reads it) and the head weight's gradient (+=).
      if (dloss != 0.0f) {
        mark(Phase::HeadGemmBwd);
        ops_.head_backward(dln_.slice0(r0, r1), head_.g, {}, logits, lnf, head_.w, false, c, !fresh_head_);
        fresh_head_ = false;
      }
    }
    mark(Phase::Loss);
    turbo::sum_f32(loss_slots_.slice0(slot, slot + 1), losses_.slice0(0, N), c);
  }
  have_grad_logits_ = dloss != 0.0f;
  if (have_grad_logits_) train_tokens_ = N;
}

// ---- backward -----------------------------------------------------------------------------

void CudaModel::norm_backward(const TensorView& dres, const TensorView& dout, const TensorView& inp,
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
  a.ctx = ctx();
  ops_.norm_backward(a);
}

TensorView CudaModel::with_ones(const TensorView& t) const {
  if (ones_pad_ == 0 || t.ndim != 2 || t.stride(0) != t.size(1) + ones_pad_) return {};
  return TensorView(t.data, t.dtype, t.device, {t.size(0), t.stride(0)});
}

void CudaModel::linear_backward(const TensorView& dinp, const Param& w, const Param& b, const TensorView& dout,
                                const TensorView& inp, bool bias_done) {
  const ExecContext c = ctx();
  if (b.g.defined() && !bias_done) {
    if (const TensorView ones = with_ones(inp); ones.defined()) {  // [weight | bias] gradient from one GEMM
      if (dinp.defined()) ops_.linear_backward(dinp, {}, {}, dout, inp, w.w, false, c, true);
      ops_.linear_weight_grad_ones(w.g, b.g, dout, ones, c, !fresh_layers_);
      return;
    }
  }
  if (b.g.defined() && bias_grad_ != BiasGrad::Gemm) {  // first: dout was just written, partly still in L2
    if (!bias_done) ops_.bias_grad(b.g, dout, c);
    ops_.linear_backward(dinp, w.g, {}, dout, inp, w.w, false, c, !fresh_layers_);
    return;
  }
  ops_.linear_backward(dinp, w.g, b.g, dout, inp, w.w, false, c, !fresh_layers_);
}

void CudaModel::recompute_layer(int64_t l, int64_t B, int64_t T) {
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
  LayerActs& a = layers_[l];
  const LayerParams& p = params_[l];
  norm_forward(a.ln1, a.mean1, a.rstd1, {}, a.x_in, {}, p.norm1, N);
  norm_forward(a.ln2, a.mean2, a.rstd2, {}, a.x2, {}, p.norm2, N);
  if (r == Recompute::Norms) return;
  turbo::activation_forward({spec_.swiglu ? turbo::Activation::SwiGLU : turbo::Activation::Gelu, a.act.slice0(0, N),
                             a.fc.slice0(0, N), ctx()});
}

void CudaModel::backward() {
  if (!have_grad_logits_) throw RuntimeError("cuda model: backward() needs a forward with dloss != 0 first");
  have_grad_logits_ = false;
  NvtxRange range("backward");
  const int64_t B = B_, T = T_, N = B * T;
  const int64_t C = spec_.hidden_size, H = spec_.num_attention_heads, KV = spec_.num_query_groups;
  const int64_t D = spec_.head_dim(), KVD = spec_.kv_dim();
  const ExecContext c = ctx();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  {
    NvtxRange hr("final norm bwd");
    // forward() already ran the head's backward into dln_ and head_.g.
    // dres = d(final residual): the start of the residual stream's gradient.
    mark(Phase::NormBwd);
    norm_backward(dres_, dln_, x_final_, meanf_, rstdf_, final_norm_, N, false, params_.back().out_b.g);
  }
  const TensorView dres = dres_.slice0(0, N);
  for (int64_t l = spec_.num_layers - 1; l >= 0; --l) {
    NvtxRange lr(fmt::format("layer {} bwd", l).c_str());
    recompute_layer(l, B, T);  // no-op unless the layer's policy dropped activations
    LayerActs& a = layers_[l];
    const LayerParams& p = params_[l];
    // MLP: dres is the gradient of the layer output x2 + mlp(ln2(x2)).
    const TensorView dfc = dfc_.slice0(0, N), act = a.act.slice0(0, N), fc = a.fc.slice0(0, N);
    mark(Phase::MlpDownGemmBwd);
    if (spec_.swiglu) {
      const TensorView dact = dact_.slice0(0, N);
      linear_backward(dact, p.out_w, p.out_b, dres, act, norm_colsum());
      mark(Phase::ActivationBwd);
      turbo::activation_backward({turbo::Activation::SwiGLU, dfc, fc, dact, false, c});
    } else if (gelu_unfused_bwd_) {
      linear_backward(dfc, p.out_w, p.out_b, dres, act, norm_colsum());  // dfc = d(act) here
      mark(Phase::ActivationBwd);
      turbo::activation_backward({turbo::Activation::Gelu, dfc, fc, dfc, false, c});  // in place
    } else {
      ops_.linear_backward_dgelu(dfc, {}, dres, p.out_w.w, fc, c);
      linear_backward({}, p.out_w, p.out_b, dres, act, norm_colsum());
    }
    mark(Phase::MlpUpGemmBwd);
    linear_backward(dln_.slice0(0, N), p.fc_w, p.fc_b, dfc, a.ln2.slice0(0, N));
    mark(Phase::NormBwd);
    norm_backward(dres_, dln_, a.x2, a.mean2, a.rstd2, p.norm2, N, true, p.proj_b.g);
    // Attention: dres is now the gradient of x2 = x_in + proj(attention(ln1(x_in))).
    mark(Phase::ProjGemmBwd);
    linear_backward(datt_.slice0(0, N), p.proj_w, p.proj_b, dres, a.att.slice0(0, N), norm_colsum());
    const TensorView dqkv = dqkv_.slice0(0, N), qkv = a.qkv.slice0(0, N);
    // With RoPE the attention's gradients are those of the rotated q/k (dqk_rot_); the rotation's
    // backward then writes dq|dk into dqkv (out of place: the reference RoPE cannot run in place).
    const TensorView dqk_rot = spec_.rope ? dqk_rot_.slice0(0, N) : TensorView();
    AttentionGradCall g;
    g.dq = spec_.rope ? heads(dqk_rot, B, T, 0, H) : heads(dqkv, B, T, 0, H);
    g.dk = spec_.rope ? heads(dqk_rot, B, T, C, KV) : heads(dqkv, B, T, C, KV);
    g.dv = heads(dqkv, B, T, C + KVD, KV);
    g.dout = view(datt_, {B, T, H, D});
    g.q = heads(qkv, B, T, 0, H);
    g.k = heads(qkv, B, T, C, KV);
    g.v = heads(qkv, B, T, C + KVD, KV);
    g.out = view(a.att, {B, T, H, D});
    g.lse = view(a.lse, {B, H, T});
    g.scale = scale;
    g.ctx = c;
    mark(Phase::AttentionBwd);
    ops_.attention_backward(g);
    if (spec_.rope) {  // one rotation for dq|dk: they sit side by side in both buffers
      mark(Phase::RopeBwd);
      turbo::RopeArgs r;
      r.backward = true;
      r.out = heads(dqkv, B, T, 0, H + KV);
      r.inp = heads(dqk_rot, B, T, 0, H + KV);
      r.table = rope_table_;
      r.base = spec_.rotary_base;
      r.ctx = c;
      turbo::rope(r);
    }
    const TensorView ln1 = a.ln1.slice0(0, N), dln = dln_.slice0(0, N);
    mark(Phase::QkvGemmBwd);
    // One dgrad and one wgrad (+ bias gradient) GEMM over the packed q|k|v columns.
    linear_backward(dln, p.qkv_w, p.qkv_b, dqkv, ln1);
    mark(Phase::NormBwd);
    // The residual gradient it leaves is d(output of layer l - 1): its column sums are that
    // layer's MLP down-projection bias gradient.
    norm_backward(dres_, dln_, a.x_in, a.mean1, a.rstd1, p.norm1, N, true, l > 0 ? params_[l - 1].out_b.g : TensorView());
  }
  {
    NvtxRange er("embedding bwd");
    mark(Phase::EmbeddingBwd);
    const int64_t at = slot_ * opt_.max_batch * opt_.max_seq;
    turbo::EmbeddingArgs e;
    e.backward = true;
    e.dwte = wte_.g;
    e.dwpe = wpe_.g;
    e.dout = view(dres_, {B, T, C});
    e.tokens = view(tokens_.slice0(at, at + N), {B, T});
    e.wte = wte_.w;
    e.wpe = wpe_.w;
    e.ctx = c;
    turbo::embedding_backward(e);
  }
  fresh_layers_ = false;  // the next micro-batch of this step accumulates
}

// ---- optimizer ----------------------------------------------------------------------------

void CudaModel::grad_norm(float max_norm) {
  NvtxRange r("grad norm");
  mark(Phase::GradNorm);
  need_optimizer_state("grad_norm");
  ops_.grad_norm(*adamw_, norm_, max_norm, ctx());
}

void CudaModel::check_step(int64_t n) {
  const int64_t S = opt_.loss_slots;
  if (n < 1 || n > S) throw RuntimeError(fmt::format("cuda model: check_step over {} loss slots (1..{})", n, S));
  mark(Phase::StepCheck);
  if (!host_) {
    kernels::step_check(status_.ptr<float>(), n, S, stream_);
    return;
  }
  float* st = status_.ptr<float>();  // host mode: the ops ran synchronously
  bool ok = std::isfinite(st[S]);
  for (int64_t i = 0; i < n; ++i) ok = ok && std::isfinite(st[i]);
  st[S + 2] = ok ? 1.0f : 0.0f;
  if (!ok) st[S + 1] = std::numeric_limits<float>::quiet_NaN();
}

void CudaModel::set_hyper(const turbo::AdamWHyper& hp) {
  hp_ = hp;
  if (host_) return;  // the CPU optimizer takes hp itself
  // The kernel's own host-side formula, so eager and graph steps compute the same bits.
  StagingSet& set = staging_[staging_set_];
  CUDA_CHECK(cudaEventSynchronize(set.hyper_done));  // the last copy from these scalars has read them
  set.hyper[0] = hp.lr;
  set.hyper[1] = static_cast<float>(1.0 - std::pow(static_cast<double>(hp.beta1), static_cast<double>(hp.step)));
  set.hyper[2] = static_cast<float>(1.0 - std::pow(static_cast<double>(hp.beta2), static_cast<double>(hp.step)));
  CUDA_CHECK(cudaMemcpyAsync(hyper_.data, set.hyper, 3 * sizeof(float), cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(set.hyper_done, stream_));
}

void CudaModel::update() {
  NvtxRange r("adamw");
  mark(Phase::Optimizer);
  need_optimizer_state("update");
  ops_.adamw(*adamw_, hp_, norm_.slice0(1, 2), host_ ? TensorView() : hyper_, ctx());
}

int CudaModel::enqueue_step_status() {
  const int ticket = staging_set_;
  if (host_) {  // the step has run: its status into this ticket's half
    std::memcpy(status_host_mem_.data() + ticket * status_.numel(), status_.data, status_.nbytes());
    staging_set_ ^= 1;
    return ticket;
  }
  StagingSet& set = staging_[ticket];
  CUDA_CHECK(cudaEventSynchronize(set.status_done));  // its last copy has landed (and was read)
  CUDA_CHECK(cudaMemcpyAsync(set.status, status_.data, status_.nbytes(), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaEventRecord(set.status_done, stream_));
  staging_set_ ^= 1;
  return ticket;
}

CudaModel::StepStatus CudaModel::wait_step_status(int ticket, int64_t n) const {
  const int64_t S = opt_.loss_slots;
  n = std::min(n, S);
  if (ticket < 0 || ticket > 1) throw RuntimeError(fmt::format("cuda model: step status ticket {} (0 or 1)", ticket));
  const float* status = status_host_mem_.data() + ticket * status_.numel();
  if (!host_) {
    CUDA_CHECK(cudaEventSynchronize(staging_[ticket].status_done));  // that step's copy, not later work
    status = staging_[ticket].status;
  }
  StepStatus st;
  // The training forward's tokens: a graph replay runs no host code, so B_ and T_ may be an
  // evaluation's since (train_tokens_ is only set by a forward with a gradient).
  const double tokens = static_cast<double>(train_tokens_);
  for (int64_t i = 0; i < n; ++i) st.loss_sum += static_cast<double>(status[i]) / tokens;
  st.grad_norm = status[S];
  st.finite = status[S + 2] != 0.0f;
  return st;
}

double CudaModel::read_loss_sum(int64_t n) const {
  n = std::min(n, opt_.loss_slots);
  std::vector<float> sums(static_cast<size_t>(n));
  from_model(sums.data(), loss_slots_.data, size_t(n) * 4);
  const double tokens = static_cast<double>(B_ * T_);
  double total = 0;
  for (float s : sums) total += static_cast<double>(s) / tokens;
  return total;
}

double CudaModel::read_grad_norm() const {
  float v[2];
  from_model(v, norm_.data, sizeof(v));
  return v[0];
}

size_t CudaModel::reserved_bytes() const { return state_->capacity() + acts_->capacity() + scratch_->capacity(); }
size_t CudaModel::activation_bytes() const { return acts_->capacity(); }
size_t CudaModel::scratch_high_water() const { return scratch_->high_water(); }

}  // namespace primus::backends::cuda
