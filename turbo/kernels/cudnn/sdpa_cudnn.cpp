// The SDPA operation graphs. The fused attention engines match a fixed pattern of nodes, so the
// order and types below follow what those engines expect (cuDNN's documentation of its fused
// flash attention graphs): scores in f32, the probabilities cast to the I/O type before the
// second matmul, the causal mask as generated row/column indices compared and selected, and
// the softmax written out as max / subtract / exp / sum / log / add / divide.
#include "turbo/kernels/cudnn/sdpa_cudnn.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#include "core/util/error.h"
#include "turbo/kernels/cudnn/cudnn_graph.h"

namespace primus::turbo::cudnn {
namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

cudnnDataType_t io_type(DType t) { return t == DType::F16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16; }

// [b, heads, T, D] over memory laid out [B, T, heads, D] whose tokens are `row` elements apart
// (0: heads * D, dense; more for a column slice of a packed q|k|v projection).
TensorSpec bhsd(const SdpaShape& s, int64_t heads, int64_t row = 0, bool is_virtual = false) {
  if (row == 0) row = heads * s.D;
  return {{s.B, heads, s.T, s.D}, {s.T * row, s.D, row, 1}, io_type(s.dtype), is_virtual};
}
// The transposed view [b, heads, D, T] of the same memory (what the backend wants for K^T, V^T).
TensorSpec bhds(const SdpaShape& s, int64_t heads, int64_t row = 0) {
  if (row == 0) row = heads * s.D;
  return {{s.B, heads, s.D, s.T}, {s.T * row, s.D, 1, row}, io_type(s.dtype), false};
}
TensorSpec scores(const SdpaShape& s) {
  return {{s.B, s.H, s.T, s.T}, {s.H * s.T * s.T, s.T * s.T, s.T, 1}, CUDNN_DATA_FLOAT, true};
}
TensorSpec row_stat(const SdpaShape& s, bool is_virtual) {
  return {{s.B, s.H, s.T, 1}, {s.H * s.T, s.T, 1, 1}, CUDNN_DATA_FLOAT, is_virtual};
}

// Applies the causal mask to `x` (keys after the query get -inf); returns the masked tensor.
int64_t causal_mask(GraphBuilder& g, int64_t x, int64_t neg_inf) {
  const int64_t row = g.virtual_like(x, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, row, 0, 0, CUDNN_DATA_FLOAT, 2);
  const int64_t col = g.virtual_like(x, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, col, 0, 0, CUDNN_DATA_FLOAT, 3);
  const int64_t keep = g.virtual_like(x, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, keep, col, 0, CUDNN_DATA_BOOLEAN);
  const int64_t y = g.virtual_like(x, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, y, neg_inf, keep);
  return y;
}

// -inf for masked scores (cuDNN before 9.1 wanted the lowest finite float instead).
float masked_value() {
  return runtime_version() < 91000 ? std::numeric_limits<float>::lowest()
                                   : -std::numeric_limits<float>::infinity();
}

struct FwdGraph {
  Plan plan;
  int64_t q, k, v, o, stats, scale, neg_inf = 0;
};

FwdGraph build_forward(const SdpaShape& s, cudnnHandle_t h) {
  GraphBuilder g;
  FwdGraph f;
  f.q = g.tensor(bhsd(s, s.H, s.q_row));
  f.k = g.tensor(bhds(s, s.KVH, s.k_row));
  f.v = g.tensor(bhsd(s, s.KVH, s.v_row));
  f.o = g.tensor(bhsd(s, s.H));
  f.stats = g.tensor(row_stat(s, false));
  f.scale = g.scalar();
  const int64_t sc = g.tensor(scores(s));
  g.matmul(f.q, f.k, sc);
  int64_t last = g.virtual_like(sc, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, sc, last, f.scale);
  if (s.causal) {
    f.neg_inf = g.scalar();
    last = causal_mask(g, last, f.neg_inf);
  }
  const int64_t mx = g.tensor(row_stat(s, true));
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, last, mx);
  const int64_t sub = g.virtual_like(last, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_SUB, last, sub, mx);
  const int64_t ex = g.virtual_like(last, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_EXP, sub, ex);
  const int64_t sum = g.tensor(row_stat(s, true));
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, ex, sum);
  const int64_t lg = g.tensor(row_stat(s, true));
  g.pointwise(CUDNN_POINTWISE_LOG, sum, lg);
  g.pointwise(CUDNN_POINTWISE_ADD, mx, f.stats, lg);
  const int64_t p = g.virtual_like(ex, io_type(s.dtype));
  g.pointwise(CUDNN_POINTWISE_DIV, ex, p, sum);
  g.matmul(p, f.v, f.o);
  f.plan = make_plan(h, g.build(h));
  return f;
}

struct BwdGraph {
  Plan plan;
  int64_t q, k, v, o, dout, stats, dq, dk, dv, scale, one, neg_inf = 0;
  int64_t softmax_sum, dq_accum;  // f32 buffers the graph keeps in our workspace
  size_t softmax_sum_bytes = 0, dq_accum_bytes = 0;
};

// dst = sum over each kv head's query heads of full [b, H, T, D] (GQA), or full itself (MHA).
void matmul_into_kv(GraphBuilder& g, const SdpaShape& s, int64_t a, int64_t b, int64_t dst) {
  if (s.H == s.KVH) {
    g.matmul(a, b, dst);
    return;
  }
  const int64_t full = g.tensor({{s.B, s.H, s.T, s.D}, {s.H * s.T * s.D, s.T * s.D, s.D, 1}, io_type(s.dtype), true});
  g.matmul(a, b, full);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, dst);
}

BwdGraph build_backward(const SdpaShape& s, cudnnHandle_t h) {
  GraphBuilder g;
  BwdGraph f;
  f.q = g.tensor(bhsd(s, s.H, s.q_row));
  f.k = g.tensor(bhds(s, s.KVH, s.k_row));  // K^T
  f.v = g.tensor(bhds(s, s.KVH, s.v_row));  // V^T
  f.o = g.tensor(bhsd(s, s.H));
  f.dout = g.tensor(bhsd(s, s.H));
  f.stats = g.tensor(row_stat(s, false));
  f.dq = g.tensor(bhsd(s, s.H, s.dq_row));
  f.dk = g.tensor(bhsd(s, s.KVH, s.dk_row));
  f.dv = g.tensor(bhsd(s, s.KVH, s.dv_row));
  f.scale = g.scalar();
  f.one = g.scalar();

  // softmax_sum = rowsum(dO * O): the "delta" of the flash-attention backward.
  const int64_t doo = g.tensor({{s.B, s.H, s.T, s.D}, {s.H * s.T * s.D, s.T * s.D, s.H * s.D, 1}, CUDNN_DATA_FLOAT, true});
  g.pointwise(CUDNN_POINTWISE_MUL, f.dout, doo, f.o);
  const int64_t red = g.tensor(row_stat(s, true));
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, doo, red);
  f.softmax_sum = g.tensor(row_stat(s, false));
  g.pointwise(CUDNN_POINTWISE_MUL, red, f.softmax_sum, f.one);
  f.softmax_sum_bytes = static_cast<size_t>(s.B * s.H * s.T) * sizeof(float);

  // P = exp(scale * Q K^T - lse), masked.
  const int64_t sc = g.tensor(scores(s));
  g.matmul(f.q, f.k, sc);
  int64_t last = g.virtual_like(sc, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, sc, last, f.scale);
  const int64_t centred = g.virtual_like(last, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_SUB, last, centred, f.stats);
  last = centred;
  if (s.causal) {
    f.neg_inf = g.scalar();
    last = causal_mask(g, last, f.neg_inf);
  }
  const int64_t p = g.virtual_like(last, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_EXP, last, p);

  // dV = P^T dO.
  const int64_t pt = g.tensor({{s.B, s.H, s.T, s.T}, {s.H * s.T * s.T, s.T * s.T, 1, s.T}, io_type(s.dtype), true});
  g.reshape(p, pt);
  matmul_into_kv(g, s, pt, f.dout, f.dv);

  // dS = P * (dO V^T - softmax_sum) * scale.
  const int64_t dp = g.tensor(scores(s));
  g.matmul(f.dout, f.v, dp);
  const int64_t dp2 = g.virtual_like(dp, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, dp2, f.softmax_sum);
  const int64_t dp3 = g.virtual_like(dp, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, dp2, dp3, p);
  const int64_t ds = g.virtual_like(dp, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, dp3, ds, f.scale);

  // dK = dS^T Q.
  const int64_t dst = g.tensor({{s.B, s.H, s.T, s.T}, {s.H * s.T * s.T, s.T * s.T, 1, s.T}, io_type(s.dtype), true});
  g.reshape(ds, dst);
  matmul_into_kv(g, s, dst, f.q, f.dk);

  // dQ = dS K: accumulated in f32 and then cast, or (deterministic) written directly.
  const int64_t kk = g.tensor({{s.B, s.KVH, s.T, s.D}, {s.T * s.KVH * s.D, s.D, s.KVH * s.D, 1}, io_type(s.dtype), true});
  g.reshape(f.k, kk);
  if (s.deterministic) {
    f.dq_accum = 0;
    g.matmul(ds, kk, f.dq);
  } else {
    f.dq_accum = g.tensor({{s.B, s.H, s.T, s.D}, {s.H * s.T * s.D, s.T * s.D, s.D, 1}, CUDNN_DATA_FLOAT, false});
    f.dq_accum_bytes = static_cast<size_t>(s.B * s.H * s.T * s.D) * sizeof(float);
    g.matmul(ds, kk, f.dq_accum);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, f.dq_accum, f.dq);
  }

  f.plan = make_plan(h, g.build(h));
  return f;
}

// Plans per shape key; a failed build is remembered as its message.
template <class G>
struct Entry {
  std::unique_ptr<G> graph;
  std::string error;
};

std::mutex& mu() {
  static std::mutex m;
  return m;
}

std::string shape_reason(const SdpaShape& s) {
  if (s.dtype != DType::BF16 && s.dtype != DType::F16) return fmt::format("dtype {} (cuDNN SDPA: bf16/f16)", dtype_name(s.dtype));
  if (s.D % 8 != 0 || s.D > 256) return fmt::format("head_dim {} (cuDNN SDPA: a multiple of 8, at most 256)", s.D);
  if (s.H % s.KVH != 0) return "H not a multiple of KVH";
  if (s.B <= 0 || s.T <= 0) return "empty shape";
  return "";
}

template <class G>
Entry<G>& entry(std::map<std::string, Entry<G>>& cache, const SdpaShape& s, G (*build)(const SdpaShape&, cudnnHandle_t)) {
  int dev = 0;
  cudaGetDevice(&dev);
  const std::string key = fmt::format("dev{} {}", dev, s.key());
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  Entry<G> e;
  if (std::string why = shape_reason(s); !why.empty()) {
    e.error = why;
  } else {
    try {
      e.graph = std::make_unique<G>(build(s, handle_for_current_device()));
    } catch (const std::exception& ex) {
      e.error = ex.what();
    }
  }
  return cache.emplace(key, std::move(e)).first->second;
}

std::map<std::string, Entry<FwdGraph>>& fwd_cache() {
  static std::map<std::string, Entry<FwdGraph>> c;
  return c;
}
std::map<std::string, Entry<BwdGraph>>& bwd_cache() {
  static std::map<std::string, Entry<BwdGraph>> c;
  return c;
}

template <class G>
const G& require(Entry<G>& e, const char* what, const SdpaShape& s) {
  if (!e.graph) throw RuntimeError(fmt::format("cuDNN SDPA {} [{}]: {}", what, s.key(), e.error));
  return *e.graph;
}

}  // namespace

std::string SdpaShape::key() const {
  std::string k = fmt::format("B={} T={} H={} KVH={} D={} causal={} {}{}", B, T, H, KVH, D, causal ? 1 : 0,
                              dtype_name(dtype), deterministic ? " deterministic" : "");
  if (q_row || k_row || v_row || dq_row || dk_row || dv_row)
    k += fmt::format(" rows q={} k={} v={} dq={} dk={} dv={}", q_row, k_row, v_row, dq_row, dk_row, dv_row);
  return k;
}

std::string sdpa_forward_unsupported(const SdpaShape& s) noexcept {
  try {
    std::lock_guard lock(mu());
    return entry(fwd_cache(), s, build_forward).error;
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::string sdpa_backward_unsupported(const SdpaShape& s) noexcept {
  try {
    std::lock_guard lock(mu());
    return entry(bwd_cache(), s, build_backward).error;
  } catch (const std::exception& e) {
    return e.what();
  }
}

size_t sdpa_forward_workspace(const SdpaShape& s) {
  std::lock_guard lock(mu());
  const FwdGraph& f = require(entry(fwd_cache(), s, build_forward), "forward", s);
  return align_up(static_cast<size_t>(f.plan.workspace_bytes));
}

size_t sdpa_backward_workspace(const SdpaShape& s) {
  std::lock_guard lock(mu());
  const BwdGraph& f = require(entry(bwd_cache(), s, build_backward), "backward", s);
  return align_up(f.softmax_sum_bytes) + align_up(f.dq_accum_bytes) + align_up(static_cast<size_t>(f.plan.workspace_bytes));
}

void sdpa_forward(const SdpaShape& s, void* out, float* lse, const void* q, const void* k, const void* v,
                  float scale, void* workspace, cudaStream_t stream) {
  std::lock_guard lock(mu());
  const FwdGraph& f = require(entry(fwd_cache(), s, build_forward), "forward", s);
  cudnnHandle_t h = handle_for_current_device();
  PRIMUS_CUDNN_CHECK(dnn().cudnnSetStream(h, stream));
  float scale_v = scale, neg = masked_value();
  std::vector<int64_t> uids{f.q, f.k, f.v, f.o, f.stats, f.scale};
  std::vector<void*> ptrs{const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), out, lse, &scale_v};
  if (f.neg_inf) {
    uids.push_back(f.neg_inf);
    ptrs.push_back(&neg);
  }
  execute(h, f.plan, uids, ptrs, f.plan.workspace_bytes > 0 ? workspace : nullptr);
}

void sdpa_backward(const SdpaShape& s, void* dq, void* dk, void* dv, const void* dout, const void* q,
                   const void* k, const void* v, const void* out, const float* lse, float scale,
                   void* workspace, cudaStream_t stream) {
  std::lock_guard lock(mu());
  const BwdGraph& f = require(entry(bwd_cache(), s, build_backward), "backward", s);
  cudnnHandle_t h = handle_for_current_device();
  PRIMUS_CUDNN_CHECK(dnn().cudnnSetStream(h, stream));
  char* ws = static_cast<char*>(workspace);
  PRIMUS_CHECK(ws != nullptr, "cuDNN SDPA backward needs a workspace");
  void* softmax_sum = ws;
  void* dq_accum = ws + align_up(f.softmax_sum_bytes);
  void* engine_ws = ws + align_up(f.softmax_sum_bytes) + align_up(f.dq_accum_bytes);
  // Before 9.6 the engine expected its f32 dQ accumulator zeroed by the caller.
  if (f.dq_accum_bytes > 0 && runtime_version() < 90600) {
    const cudaError_t err = cudaMemsetAsync(dq_accum, 0, f.dq_accum_bytes, stream);
    PRIMUS_CHECK(err == cudaSuccess, "cudaMemsetAsync: {}", cudaGetErrorString(err));
  }
  float scale_v = scale, one = 1.0f, neg = masked_value();
  std::vector<int64_t> uids{f.q, f.k, f.v, f.o, f.dout, f.stats, f.dq, f.dk, f.dv, f.scale, f.one,
                            f.softmax_sum};
  std::vector<void*> ptrs{const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v),
                          const_cast<void*>(out), const_cast<void*>(dout), const_cast<float*>(lse),
                          dq, dk, dv, &scale_v, &one, softmax_sum};
  if (f.dq_accum) {
    uids.push_back(f.dq_accum);
    ptrs.push_back(dq_accum);
  }
  if (f.neg_inf) {
    uids.push_back(f.neg_inf);
    ptrs.push_back(&neg);
  }
  execute(h, f.plan, uids, ptrs, engine_ws);
}

size_t cudnn_runtime_version() { return runtime_version(); }

}  // namespace primus::turbo::cudnn
