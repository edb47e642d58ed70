// The SDPA operation graphs. The fused attention engines match a fixed pattern of nodes, so the
// order and types below follow what those engines expect (cuDNN's documentation of its fused
// flash attention graphs): scores in f32, the probabilities cast to the I/O type before the
// second matmul, the causal mask as generated row/column indices compared and selected, and
// the softmax written out as max / subtract / exp / sum / log / add / divide.
#include "turbo/core/env_switch.h"
#include "turbo/kernels/cudnn/sdpa_cudnn.h"

#include <fmt/format.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"
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

// How many engine configurations to time per shape (PRIMUS_TURBO_CUDNN_SDPA_SEARCH; 1: the
// heuristics' first) and whether knob variants join them (PRIMUS_TURBO_CUDNN_SDPA_KNOBS=1).
// Read when a shape's plans are built; set_sdpa_search overrides the environment.
std::atomic<int> g_search{0};
int search_count() {
  const int forced = g_search.load();
  if (forced > 0) return forced;
  return static_cast<int>(env_int("PRIMUS_TURBO_CUDNN_SDPA_SEARCH", 1, 1 << 20, 1));
}
bool search_knobs() {
  return env_choice("PRIMUS_TURBO_CUDNN_SDPA_KNOBS", {"0", "1"}, "0") == "1";
}

// The candidate plans of one graph and the one in use (the first until a search picks another).
struct Plans {
  std::vector<Plan> all;
  size_t chosen = 0;
  bool searched = false;
  const Plan& plan() const { return all[chosen]; }
  int64_t max_workspace() const {
    int64_t w = 0;
    for (const Plan& p : all) w = std::max(w, p.workspace_bytes);
    return w;
  }
};
Plans plans_for(cudnnHandle_t h, const GraphBuilder::Graph& g, bool deterministic) {
  // A deterministic backward must pick the same engine in every process: no timing there.
  const int n = deterministic ? 1 : search_count();
  Plans p;
  p.all = make_plans(h, g, static_cast<size_t>(n), n > 1 && search_knobs());
  p.searched = p.all.size() <= 1;
  return p;
}

// Bytes of the rows [B*T] of width `width` elements, `row` elements apart, at `ptr` (16-bit).
struct Region {
  const void* ptr;
  int64_t rows, width, row;
};
std::vector<uint16_t> download(const Region& r) {
  std::vector<uint16_t> h(static_cast<size_t>(r.rows * r.width));
  CUDA_CHECK(cudaMemcpy2D(h.data(), static_cast<size_t>(r.width) * 2, r.ptr, static_cast<size_t>(r.row) * 2,
                          static_cast<size_t>(r.width) * 2, static_cast<size_t>(r.rows), cudaMemcpyDeviceToHost));
  return h;
}
// Largest |a - b| over the elements, relative to the largest |a| (NaN anywhere: infinity).
double relative_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, DType t) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = t == DType::BF16 ? bf16_bits_to_float(a[i]) : f16_bits_to_float(a[i]);
    const double y = t == DType::BF16 ? bf16_bits_to_float(b[i]) : f16_bits_to_float(b[i]);
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::fabs(x - y));
    scale = std::max(scale, std::fabs(x));
  }
  return scale > 0 ? diff / scale : diff;
}

// Times every candidate of `p` on the call's own buffers (run(i) executes candidate i; the
// outputs it overwrites are `outs`) and keeps the fastest whose outputs agree with the first
// candidate's (a knob variant that cuDNN finalizes but computes differently is never used).
// Runs once per shape, outside stream capture; the chosen candidate runs last, so the outputs
// the caller sees are its own.
template <class Run>
void search(Plans& p, const Run& run, const std::vector<Region>& outs, DType dtype, const char* what,
            const std::string& key, cudaStream_t stream) {
  p.searched = true;
  std::vector<std::vector<uint16_t>> ref;
  struct Events {  // destroyed on every way out, a rethrow included
    cudaEvent_t start = nullptr, stop = nullptr;
    Events() {
      CUDA_CHECK(cudaEventCreate(&start));
      CUDA_CHECK(cudaEventCreate(&stop));
    }
    ~Events() {
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    }
  } ev;
  cudaEvent_t start = ev.start, stop = ev.stop;
  float best = 1e30f;
  std::string log;
  for (size_t i = 0; i < p.all.size(); ++i) {
    try {
      run(i);
      CUDA_CHECK(cudaStreamSynchronize(stream));
    } catch (const std::exception& e) {
      if (i == 0) throw;  // the heuristics' own choice, what runs without a search: a real error
      log += fmt::format(" [{}: failed: {}]", i, e.what());
      continue;
    }
    double diff = 0;
    if (i == 0) {
      for (const Region& r : outs) ref.push_back(download(r));
    } else {
      for (size_t o = 0; o < outs.size(); ++o) diff = std::max(diff, relative_diff(ref[o], download(outs[o]), dtype));
      if (!(diff <= 2e-2)) {
        log += fmt::format(" [{}: outputs differ by {:.3g} of their scale: not used]", i, diff);
        continue;
      }
    }
    CUDA_CHECK(cudaEventRecord(start, stream));
    for (int r = 0; r < 5; ++r) run(i);
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    ms /= 5;
    log += fmt::format(" [{}: {:.4f} ms, {}]", i, ms, p.all[i].engine);
    if (ms < best) {
      best = ms;
      p.chosen = i;
    }
  }
  run(p.chosen);
  spdlog::info("[turbo] cuDNN SDPA {} [{}]: {} candidates timed, using {}:{}", what, key, p.all.size(), p.chosen, log);
}

struct FwdGraph {
  Plans plans;
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
  f.plans = plans_for(h, g.build(h), s.deterministic);
  return f;
}

struct BwdGraph {
  Plans plans;
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

  f.plans = plans_for(h, g.build(h), s.deterministic);
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
G& require(Entry<G>& e, const char* what, const SdpaShape& s) {
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
  return align_up(static_cast<size_t>(f.plans.max_workspace()));
}

size_t sdpa_backward_workspace(const SdpaShape& s) {
  std::lock_guard lock(mu());
  BwdGraph& f = require(entry(bwd_cache(), s, build_backward), "backward", s);
  return align_up(f.softmax_sum_bytes) + align_up(f.dq_accum_bytes) + align_up(static_cast<size_t>(f.plans.max_workspace()));
}

void sdpa_forward(const SdpaShape& s, void* out, float* lse, const void* q, const void* k, const void* v,
                  float scale, void* workspace, cudaStream_t stream) {
  std::lock_guard lock(mu());
  FwdGraph& f = require(entry(fwd_cache(), s, build_forward), "forward", s);
  cudnnHandle_t h = handle_for_current_device();
  PRIMUS_CUDNN_CHECK(dnn().cudnnSetStream(h, stream));
  float scale_v = scale, neg = masked_value();
  std::vector<int64_t> uids{f.q, f.k, f.v, f.o, f.stats, f.scale};
  std::vector<void*> ptrs{const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), out, lse, &scale_v};
  if (f.neg_inf) {
    uids.push_back(f.neg_inf);
    ptrs.push_back(&neg);
  }
  auto run = [&](size_t i) {
    execute(h, f.plans.all[i], uids, ptrs, f.plans.all[i].workspace_bytes > 0 ? workspace : nullptr);
  };
  if (!f.plans.searched && !cuda_stream_is_capturing(stream)) {
    search(f.plans, run, {Region{out, s.B * s.T, s.H * s.D, s.H * s.D}}, s.dtype, "forward", s.key(), stream);
    return;
  }
  run(f.plans.chosen);
}

void sdpa_backward(const SdpaShape& s, void* dq, void* dk, void* dv, const void* dout, const void* q,
                   const void* k, const void* v, const void* out, const float* lse, float scale,
                   void* workspace, cudaStream_t stream) {
  std::lock_guard lock(mu());
  BwdGraph& f = require(entry(bwd_cache(), s, build_backward), "backward", s);
  cudnnHandle_t h = handle_for_current_device();
  PRIMUS_CUDNN_CHECK(dnn().cudnnSetStream(h, stream));
  char* ws = static_cast<char*>(workspace);
  PRIMUS_CHECK(ws != nullptr, "cuDNN SDPA backward needs a workspace");
  void* softmax_sum = ws;
  void* dq_accum = ws + align_up(f.softmax_sum_bytes);
  void* engine_ws = ws + align_up(f.softmax_sum_bytes) + align_up(f.dq_accum_bytes);
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
  auto run = [&](size_t i) {
    // Before 9.6 the engine expected its f32 dQ accumulator zeroed by the caller.
    if (f.dq_accum_bytes > 0 && runtime_version() < 90600) {
      const cudaError_t err = cudaMemsetAsync(dq_accum, 0, f.dq_accum_bytes, stream);
      PRIMUS_CHECK(err == cudaSuccess, "cudaMemsetAsync: {}", cudaGetErrorString(err));
    }
    execute(h, f.plans.all[i], uids, ptrs, engine_ws);
  };
  if (!f.plans.searched && !cuda_stream_is_capturing(stream)) {
    const int64_t rows = s.B * s.T;
    search(f.plans, run,
           {Region{dq, rows, s.H * s.D, s.dq_row ? s.dq_row : s.H * s.D},
            Region{dk, rows, s.KVH * s.D, s.dk_row ? s.dk_row : s.KVH * s.D},
            Region{dv, rows, s.KVH * s.D, s.dv_row ? s.dv_row : s.KVH * s.D}},
           s.dtype, "backward", s.key(), stream);
    return;
  }
  run(f.plans.chosen);
}

size_t cudnn_runtime_version() { return runtime_version(); }

void set_sdpa_search(int candidates) { g_search.store(std::max(0, candidates)); }

SdpaPlanInfo sdpa_plan_info(const SdpaShape& s, bool backward) {
  std::lock_guard lock(mu());
  int dev = 0;
  cudaGetDevice(&dev);
  const std::string key = fmt::format("dev{} {}", dev, s.key());
  auto info = [](const Plans& p) {
    SdpaPlanInfo i;
    i.candidates = static_cast<int>(p.all.size());
    i.chosen = static_cast<int>(p.chosen);
    i.searched = p.searched;
    i.engine = p.plan().engine;
    return i;
  };
  if (backward) {
    auto it = bwd_cache().find(key);
    return it != bwd_cache().end() && it->second.graph ? info(it->second.graph->plans) : SdpaPlanInfo{};
  }
  auto it = fwd_cache().find(key);
  return it != fwd_cache().end() && it->second.graph ? info(it->second.graph->plans) : SdpaPlanInfo{};
}
int sdpa_search() { return search_count(); }

}  // namespace primus::turbo::cudnn
