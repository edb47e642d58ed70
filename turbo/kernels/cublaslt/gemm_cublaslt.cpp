// cuBLASLt works in column-major. A row-major matrix S[r,c] with leading dimension ld is the
// column-major matrix S^T[c,r] with the same ld, so the row-major product D = A @ B is computed
// as the column-major product D^T = B^T @ A^T: cuBLASLt's "A" is our B, its "B" is our A, and
// its m and n are our n and m. Epilogue vectors follow: cuBLASLt's per-row bias (length of its
// m) is our per-column bias (length n); its BGRADA reduces our B, its BGRADB our A.
#include "turbo/core/env_switch.h"
#include "turbo/kernels/cublaslt/gemm_cublaslt.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/util/error.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cublaslt/algo_cache.h"
#include "turbo/kernels/cublaslt/cublaslt_api.h"

namespace primus::turbo::cublaslt {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    case DType::F8E4M3: return CUDA_R_8F_E4M3;
    case DType::F8E5M2: return CUDA_R_8F_E5M2;
    default: return CUDA_R_32F;
  }
}

cublasLtEpilogue_t lt_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::None: return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::Gelu: return CUBLASLT_EPILOGUE_GELU;
    case Epilogue::GeluBias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case Epilogue::GeluAux: return CUBLASLT_EPILOGUE_GELU_AUX;
    case Epilogue::GeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::DGelu: return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::DGeluBGrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case Epilogue::BGradA: return CUBLASLT_EPILOGUE_BGRADB;  // our A is cuBLASLt's B
    case Epilogue::BGradB: return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// Largest power of two (<= 256) dividing the address: cuBLASLt's heuristic needs to know it.
uint32_t alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (v % a) != 0) a >>= 1;
  return a;
}

// Descriptors and the chosen algorithm for one problem key.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;  // cuBLASLt's A, B, C=D
  cublasLtMatmulAlgo_t algo{};
  // The row-order formulation: cuBLASLt's A, B, D are our A, B, D in CUBLASLT_ORDER_ROW (else
  // the column-order one at the top of the file: D^T = B^T A^T, operands swapped).
  bool row = false;
  ~Plan() {
    if (desc) lt().cublasLtMatmulDescDestroy(desc);
    if (la) lt().cublasLtMatrixLayoutDestroy(la);
    if (lb) lt().cublasLtMatrixLayoutDestroy(lb);
    if (ld) lt().cublasLtMatrixLayoutDestroy(ld);
  }
};

// PRIMUS_TURBO_CUBLASLT_ORDER: column (default), auto (search both formulations), row (force row
// order where eligible). Anything else is an error naming the variable.
Formulation formulation_from_env() {
  const char* e = std::getenv("PRIMUS_TURBO_CUBLASLT_ORDER");
  const std::string v = e ? e : "";
  if (v.empty() || v == "column") return Formulation::Column;
  if (v == "auto") return Formulation::Auto;
  if (v == "row") return Formulation::Row;
  throw RuntimeError(fmt::format("PRIMUS_TURBO_CUBLASLT_ORDER='{}': expected column, auto or row", v));
}

struct Context {
  std::mutex mu;
  // Column unless PRIMUS_TURBO_CUBLASLT_ORDER=auto|row (read when the context is made) or
  // set_formulation says otherwise: searching both measured slower in training (H200: GPT-2 -1.1%,
  // Llama -0.5%), although single products were 4-13% faster in row order.
  Formulation formulation = formulation_from_env();
  cublasLtHandle_t handle = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  bool ws_set = false;  // ws / ws_bytes decided (set_workspace, or the default at the first GEMM)
  std::unique_ptr<Arena> own_ws;
  int algo_search = 0;  // 0: not yet read from the environment
  std::unordered_map<std::string, std::unique_ptr<Plan>> plans;
  // The search's persistent cache (algo_cache.h), opened at the first plan that may search;
  // null when PRIMUS_TURBO_CUBLASLT_ALGO_CACHE=0 or no folder is known.
  bool cache_opened = false;
  std::unique_ptr<AlgoCacheFile> cache;
  std::unordered_map<int, std::string> device_ids;  // device ordinal -> "name|sm_XY|cublasLt V"
  int64_t searches = 0, cache_hits = 0;
  int64_t row_plans = 0;  // plans kept in the row-order formulation
};

static_assert(sizeof(cublasLtMatmulAlgo_t) == sizeof(CachedAlgo::data), "cublasLtMatmulAlgo_t is 8 uint64");

Context& ctx() {
  static Context* c = new Context();  // never destroyed: cuBLASLt may be gone at exit
  return *c;
}

cublasLtMatrixLayout_t make_layout(DType t, uint64_t rows, uint64_t cols, int64_t ld,
                                   int64_t batch, int64_t batch_stride) {
  cublasLtMatrixLayout_t l = nullptr;
  CUBLAS_CHECK(lt().cublasLtMatrixLayoutCreate(&l, cuda_type(t), rows, cols, ld));
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    CUBLAS_CHECK(lt().cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    CUBLAS_CHECK(lt().cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                  &batch_stride, sizeof(batch_stride)));
  }
  return l;
}

template <class T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  CUBLAS_CHECK(lt().cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
}

// cuBLASLt's operands for our problem (see the comment at the top of the file).
struct LtOperands {
  cublasOperation_t op_a, op_b;  // cuBLASLt's A (= our B) and B (= our A)
  uint64_t a_rows, a_cols, b_rows, b_cols;
};
LtOperands lt_operands(const GemmProblem& p) {
  LtOperands o{};
  // Our B stored row-major: not transposed -> stored [k,n] = column-major [n,k] = B^T (no op).
  o.op_a = p.b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  o.a_rows = p.b.transposed ? p.k : p.n;
  o.a_cols = p.b.transposed ? p.n : p.k;
  o.op_b = p.a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  o.b_rows = p.a.transposed ? p.m : p.k;
  o.b_cols = p.a.transposed ? p.k : p.m;
  return o;
}

std::string plan_key(const GemmProblem& p, const Context& c) {
  return fmt::format("{}|al{},{},{},{},{},{}|ws{}", describe(p), alignment_of(p.a.ptr),
                     alignment_of(p.b.ptr), alignment_of(p.d.ptr), alignment_of(p.bias),
                     alignment_of(p.aux), p.beta != 0.0f ? 1 : 0, c.ws_bytes);
}

using PrefPtr = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                                decltype(CublasLtApi::cublasLtMatmulPreferenceDestroy)>;

// The heuristic's constraints for the problem: the workspace and the operands' alignments (part
// of the plan key, so every algorithm it answers runs on every call with that key).
PrefPtr make_preference(const GemmProblem& p, const Context& c, bool row = false) {
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(lt().cublasLtMatmulPreferenceCreate(&pref));
  PrefPtr guard(pref, lt().cublasLtMatmulPreferenceDestroy);
  const uint64_t ws = c.ws_bytes;
  CUBLAS_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // cuBLASLt's A and B: our B and A (column order) or our A and B (row order)
  const uint32_t al_a = alignment_of(row ? p.a.ptr : p.b.ptr), al_b = alignment_of(row ? p.b.ptr : p.a.ptr),
                 al_d = alignment_of(p.d.ptr);
  CUBLAS_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  CUBLAS_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  CUBLAS_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d)));
  CUBLAS_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)));
  return guard;
}

// The row-order formulation applies to single plain products (no epilogue vectors, no FP8 scales,
// batch 1): what the search may try beside the column-order one.
// cuBLASLt's scale mode for one of our granularities. Its layouts are ours
// (turbo/core/fp8_granularity.h), found on an H200 by bench/fp8/scale_layout_probe.cu.
int32_t lt_scale_mode(Fp8Granularity g) {
  switch (g) {
    case Fp8Granularity::Tensor: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case Fp8Granularity::Row: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case Fp8Granularity::Block1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8Granularity::Block128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

bool row_order_eligible(const GemmProblem& p) {
  return p.batch == 1 && p.epilogue == Epilogue::None && !dtype_is_fp8(p.a.dtype);
}

cublasLtMatrixLayout_t make_row_layout(DType t, uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = make_layout(t, rows, cols, ld, 1, 0);
  const cublasLtOrder_t order = CUBLASLT_ORDER_ROW;
  CUBLAS_CHECK(lt().cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order)));
  return l;
}

std::unique_ptr<Plan> build_plan(const GemmProblem& p, Context& c, bool row = false) {
  auto plan = std::make_unique<Plan>();
  plan->row = row;
  const bool f32 = p.a.dtype == DType::F32;
  const cublasComputeType_t compute =
      f32 && p.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  CUBLAS_CHECK(lt().cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F));
  const LtOperands o = lt_operands(p);
  if (row) {  // our A [m,k] stored [k,m] when transposed; our B [k,n] stored [n,k] when transposed
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, p.a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, p.b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
  } else {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, o.op_a);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, o.op_b);
  }
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(p.epilogue));
  if (epilogue_uses_bias(p.epilogue)) {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(p.bias_dtype));
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
  }
  if (epilogue_reads_aux(p.epilogue) || epilogue_writes_aux(p.epilogue)) {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.aux);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, p.aux_ld);
  }
  if (dtype_is_fp8(p.a.dtype)) {  // cuBLASLt's A is our B (see the top of the file)
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, p.b_scale);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, p.a_scale);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(p.fp8_fast_accum ? 1 : 0));
    if (p.a_scaling != Fp8Granularity::Tensor || p.b_scaling != Fp8Granularity::Tensor) {
      set_desc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, lt_scale_mode(p.b_scaling));
      set_desc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, lt_scale_mode(p.a_scaling));
    }
  }
  if (row) {
    plan->la = make_row_layout(p.a.dtype, p.a.transposed ? p.k : p.m, p.a.transposed ? p.m : p.k, p.a.ld);
    plan->lb = make_row_layout(p.b.dtype, p.b.transposed ? p.n : p.k, p.b.transposed ? p.k : p.n, p.b.ld);
    plan->ld = make_row_layout(p.d.dtype, p.m, p.n, p.d.ld);
  } else {
    plan->la = make_layout(p.b.dtype, o.a_rows, o.a_cols, p.b.ld, p.batch, p.b.batch_stride);
    plan->lb = make_layout(p.a.dtype, o.b_rows, o.b_cols, p.a.ld, p.batch, p.a.batch_stride);
    plan->ld = make_layout(p.d.dtype, p.n, p.m, p.d.ld, p.batch, p.d.batch_stride);
  }

  PrefPtr pref = make_preference(p, c, row);
  cublasLtMatmulHeuristicResult_t result = {};
  int returned = 0;
  CUBLAS_CHECK(lt().cublasLtMatmulAlgoGetHeuristic(c.handle, plan->desc, plan->la, plan->lb, plan->ld,
                                              plan->ld, pref.get(), 1, &result, &returned));
  if (returned <= 0)
    throw RuntimeError(fmt::format("cuBLASLt has no algorithm for {}", describe(p)));
  plan->algo = result.algo;
  return plan;
}

cublasStatus_t try_run(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const GemmProblem& p, const Context& c,
                       cudaStream_t stream) {
  const void* a = plan.row ? p.a.ptr : p.b.ptr;  // cuBLASLt's A and B
  const void* b = plan.row ? p.b.ptr : p.a.ptr;
  return lt().cublasLtMatmul(c.handle, plan.desc, &p.alpha, a, plan.la, b, plan.lb, &p.beta, p.d.ptr, plan.ld,
                             const_cast<void*>(p.d.ptr), plan.ld, &algo, c.ws, c.ws_bytes, stream);
}
void run_plan(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const GemmProblem& p,
              const Context& c, cudaStream_t stream) {
  CUBLAS_CHECK(try_run(plan, algo, p, c, stream));
}

// D's bytes as stored (rows of n elements ld apart), for saving and restoring it around a search
// of an accumulating GEMM (beta != 0), whose timed reruns would otherwise add into it again.
struct SavedOutput {
  const GemmProblem& p;
  cudaStream_t stream;
  void* copy = nullptr;
  size_t row_bytes = 0;
  SavedOutput(const GemmProblem& prob, cudaStream_t s) : p(prob), stream(s) {
    if (p.beta == 0.0f) return;
    row_bytes = size_t(p.n) * dtype_size(p.d.dtype);
    CUDA_CHECK(cudaMalloc(&copy, row_bytes * size_t(p.m)));
    CUDA_CHECK(cudaMemcpy2DAsync(copy, row_bytes, p.d.ptr, size_t(p.d.ld) * dtype_size(p.d.dtype), row_bytes,
                                 size_t(p.m), cudaMemcpyDeviceToDevice, stream));
  }
  ~SavedOutput() {
    if (!copy) return;
    // No throwing from here: a failed restore surfaces at the next CUDA call on the stream.
    cudaMemcpy2DAsync(const_cast<void*>(p.d.ptr), size_t(p.d.ld) * dtype_size(p.d.dtype), copy, row_bytes, row_bytes,
                      size_t(p.m), cudaMemcpyDeviceToDevice, stream);
    cudaStreamSynchronize(stream);
    cudaFree(copy);
  }
};

// Times cuBLASLt's top candidates on the real problem and keeps the fastest in plan->algo.
// Returns the fastest time (5 runs, ms), or -1 when nothing was timed (one candidate only, or
// none ran). An accumulating GEMM (beta != 0, batch 1) is timed on the real operands too, with D
// saved before and put back after, so the call that follows accumulates exactly once.
float search_algo(Plan& plan, const GemmProblem& p, Context& c, cudaStream_t stream) {
  SavedOutput saved(p, stream);
  PrefPtr pref = make_preference(p, c, plan.row);
  constexpr int kMax = 8;
  cublasLtMatmulHeuristicResult_t results[kMax] = {};
  int returned = 0;
  CUBLAS_CHECK(lt().cublasLtMatmulAlgoGetHeuristic(c.handle, plan.desc, plan.la, plan.lb, plan.ld,
                                              plan.ld, pref.get(), std::min(c.algo_search, kMax),
                                              results, &returned));
  if (returned <= 1) return -1.0f;
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  float best_ms = 1e30f;
  for (int i = 0; i < returned; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    // The heuristic's answers assumed the alignments in the key; a candidate that fails to run
    // here is skipped, not fatal.
    if (try_run(plan, results[i].algo, p, c, stream) != CUBLAS_STATUS_SUCCESS) continue;
    run_plan(plan, results[i].algo, p, c, stream);  // second warm-up: clocks and caches settle
    CUDA_CHECK(cudaEventRecord(start, stream));
    for (int r = 0; r < 5; ++r) run_plan(plan, results[i].algo, p, c, stream);
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (ms < best_ms) { best_ms = ms; plan.algo = results[i].algo; }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best_ms < 1e29f ? best_ms : -1.0f;
}

int resolve_algo_search(Context& c) {
  if (c.algo_search == 0) {
    c.algo_search = static_cast<int>(env_int("PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH", 1, 1 << 20, 1));
  }
  return c.algo_search;
}

AlgoCacheFile* open_cache(Context& c) {
  if (!c.cache_opened) {
    c.cache_opened = true;
    const std::filesystem::path path = algo_cache_path_from_env();
    if (!path.empty()) {
      c.cache = std::make_unique<AlgoCacheFile>(path);
      c.cache->load();  // never throws; a corrupt file is logged and ignored
    }
  }
  return c.cache.get();
}

// The current device's part of the cache key: name, compute capability, cuBLASLt version.
const std::string& device_id(Context& c) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  auto it = c.device_ids.find(dev);
  if (it == c.device_ids.end()) {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    it = c.device_ids.emplace(dev, algo_cache_key("", prop.name, prop.major, prop.minor, lt().cublasLtGetVersion()))
             .first;
  }
  return it->second;
}

// The cached algorithm when cuBLASLt accepts it for this plan's descriptors and workspace.
bool use_cached(Plan& plan, const CachedAlgo& hit, const Context& c) {
  cublasLtMatmulAlgo_t algo;
  std::memcpy(&algo, hit.data.data(), sizeof(algo));
  cublasLtMatmulHeuristicResult_t check = {};
  if (lt().cublasLtMatmulAlgoCheck(c.handle, plan.desc, plan.la, plan.lb, plan.ld, plan.ld, &algo, &check) !=
          CUBLAS_STATUS_SUCCESS ||
      check.state != CUBLAS_STATUS_SUCCESS || check.workspaceSize > c.ws_bytes)
    return false;
  plan.algo = algo;
  return true;
}

// With the search on: the cache file's algorithm for this key if cuBLASLt accepts it, else the
// search's winner (saved to the file). With Formulation::Auto (PRIMUS_TURBO_CUBLASLT_ORDER=auto),
// plain products (row_order_eligible) are searched in both formulations and the faster kept: the
// row-order one reaches other kernels, 4-13% faster on some training shapes and slower on others
// (H200). The file keeps each formulation's
// winner, the row-order one under the key + "|row"; a key whose file entry predates that (no
// "|row" entry) keeps its column-order algorithm, so a resumed run still reproduces the earlier one.
void choose_algo(std::unique_ptr<Plan>& plan, const GemmProblem& p, const std::string& key, Context& c,
                 cudaStream_t stream) {
  const bool try_row = c.formulation != Formulation::Column && row_order_eligible(p);
  AlgoCacheFile* file = open_cache(c);
  std::string ckey;
  if (file) {
    ckey = device_id(c) + key;
    const auto hit_col = file->find(ckey);
    const auto hit_row = try_row ? file->find(ckey + "|row") : std::nullopt;
    if (hit_row && (!hit_col || hit_row->ms < hit_col->ms)) {
      std::unique_ptr<Plan> row_plan;
      try {
        row_plan = build_plan(p, c, true);
      } catch (const std::exception&) {  // this cuBLASLt has no row-order algorithm: the column entry
      }
      if (row_plan && use_cached(*row_plan, *hit_row, c)) {
        plan = std::move(row_plan);
        ++c.cache_hits;
        return;
      }
    }
    if (hit_col) {
      if (use_cached(*plan, *hit_col, c)) {
        ++c.cache_hits;
        return;
      }
      spdlog::warn("[turbo] cuBLASLt algorithm cache {}: the entry for {} is refused by this cuBLASLt; searching "
                   "again",
                   file->path().string(), describe(p));
    }
  }
  if (cuda_stream_is_capturing(stream)) return;  // nothing may run or sync: the heuristic's answer
  const float ms = search_algo(*plan, p, c, stream);
  if (ms < 0) return;
  ++c.searches;
  auto store = [&](const Plan& pl, float t, const std::string& k) {
    if (!file) return;
    CachedAlgo entry;
    std::memcpy(entry.data.data(), &pl.algo, sizeof(pl.algo));
    entry.ms = t;
    file->store(k, entry);  // logs (once) when it cannot write
  };
  store(*plan, ms, ckey);
  if (!try_row) return;
  std::unique_ptr<Plan> row_plan;
  try {
    row_plan = build_plan(p, c, true);
  } catch (const std::exception&) {
    return;  // no row-order algorithm for this problem: the column-order one stands
  }
  const float ms_row = search_algo(*row_plan, p, c, stream);
  if (ms_row < 0) return;
  store(*row_plan, ms_row, ckey + "|row");
  if (ms_row < ms) plan = std::move(row_plan);
}

}  // namespace

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::None: return "none";
    case Epilogue::Bias: return "bias";
    case Epilogue::Gelu: return "gelu";
    case Epilogue::GeluBias: return "gelu_bias";
    case Epilogue::GeluAux: return "gelu_aux";
    case Epilogue::GeluAuxBias: return "gelu_aux_bias";
    case Epilogue::DGelu: return "dgelu";
    case Epilogue::DGeluBGrad: return "dgelu_bgrad";
    case Epilogue::BGradA: return "bgrad_a";
    case Epilogue::BGradB: return "bgrad_b";
  }
  return "?";
}
bool epilogue_reads_aux(Epilogue e) { return e == Epilogue::DGelu || e == Epilogue::DGeluBGrad; }
bool epilogue_writes_aux(Epilogue e) { return e == Epilogue::GeluAux || e == Epilogue::GeluAuxBias; }
bool epilogue_uses_bias(Epilogue e) {
  return e == Epilogue::Bias || e == Epilogue::GeluBias || e == Epilogue::GeluAuxBias ||
         e == Epilogue::DGeluBGrad || e == Epilogue::BGradA || e == Epilogue::BGradB;
}

std::string describe(const GemmProblem& p) {
  const std::string scal = p.a_scaling == Fp8Granularity::Tensor && p.b_scaling == Fp8Granularity::Tensor
                               ? ""
                               : fmt::format(" scal {}/{}", fp8_granularity_name(p.a_scaling), fp8_granularity_name(p.b_scaling));
  return fmt::format("gemm m={} n={} k={} batch={} a={}{} ld{} bs{} b={}{} ld{} bs{} d={} ld{} bs{} "
                     "epi={} bias={} aux_ld={} beta0={} tf32={}{}{}",
                     p.m, p.n, p.k, p.batch, dtype_name(p.a.dtype), p.a.transposed ? "^T" : "",
                     p.a.ld, p.a.batch_stride, dtype_name(p.b.dtype), p.b.transposed ? "^T" : "",
                     p.b.ld, p.b.batch_stride, dtype_name(p.d.dtype), p.d.ld, p.d.batch_stride,
                     epilogue_name(p.epilogue), dtype_name(p.bias_dtype), p.aux_ld,
                     p.beta == 0.0f ? 1 : 0, p.allow_tf32 ? 1 : 0,
                     dtype_is_fp8(p.a.dtype) ? (p.fp8_fast_accum ? " fp8 fastacc" : " fp8") : "", scal);
}

namespace {
// unsupported_reason for FP8 operands (dims and pointers already checked; A and B may mix e4m3
// and e5m2).
std::string fp8_unsupported_reason(const GemmProblem& p) {
  if (!dtype_is_fp8(p.a.dtype) || !dtype_is_fp8(p.b.dtype))
    return fmt::format("A is {} but B is {}", dtype_name(p.a.dtype), dtype_name(p.b.dtype));
  if (p.a.dtype == DType::F8E5M2 && p.b.dtype == DType::F8E5M2) return "FP8 A and B are both f8e5m2";
  if (p.d.dtype != DType::BF16 && p.d.dtype != DType::F16 && p.d.dtype != DType::F32)
    return fmt::format("FP8 output {} (allowed: bf16, f16, f32)", dtype_name(p.d.dtype));
  if (!p.a_scale || !p.b_scale) return "FP8 operands need a_scale and b_scale";
  if (p.a.transposed || !p.b.transposed)
    return "FP8 operands must be K-contiguous: A row-major [m,k] and B a transposed row-major [n,k]";
  if (p.a.ld % 16 != 0 || p.b.ld % 16 != 0 || p.k % 16 != 0)
    return fmt::format("FP8 needs k ({}) and the leading dimensions ({}, {}) to be multiples of 16", p.k, p.a.ld,
                       p.b.ld);
  if (p.d.ld < p.n) return fmt::format("D leading dimension {} < n={}", p.d.ld, p.n);
  if (p.epilogue != Epilogue::None && p.epilogue != Epilogue::Bias)
    return fmt::format("epilogue {} with FP8 operands (served: none, bias)", epilogue_name(p.epilogue));
  if (p.epilogue == Epilogue::Bias && (!p.bias || p.bias_dtype != p.d.dtype))
    return "the FP8 bias epilogue needs a bias in the output type";
  return "";
}
}  // namespace

std::string unsupported_reason(const GemmProblem& p) noexcept {
  try {
    if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.batch <= 0)
      return fmt::format("empty problem m={} n={} k={} batch={}", p.m, p.n, p.k, p.batch);
    if (!p.a.ptr || !p.b.ptr || !p.d.ptr) return "null operand";
    if (dtype_is_fp8(p.a.dtype) || dtype_is_fp8(p.b.dtype)) return fp8_unsupported_reason(p);
    if (p.a.dtype != p.b.dtype)
      return fmt::format("A is {} but B is {}", dtype_name(p.a.dtype), dtype_name(p.b.dtype));
    const DType in = p.a.dtype;
    if (in != DType::BF16 && in != DType::F16 && in != DType::F32)
      return fmt::format("operand dtype {} is not a float type cuBLASLt serves here", dtype_name(in));
    if (!(p.d.dtype == in || p.d.dtype == DType::F32))
      return fmt::format("output {} with {} inputs (allowed: same type or f32)",
                         dtype_name(p.d.dtype), dtype_name(in));
    if (p.d.transposed) return "a transposed output is not supported (transpose the product instead)";
    const int64_t a_cols = p.a.transposed ? p.m : p.k, b_cols = p.b.transposed ? p.k : p.n;
    if (p.a.ld < a_cols) return fmt::format("A leading dimension {} < stored columns {}", p.a.ld, a_cols);
    if (p.b.ld < b_cols) return fmt::format("B leading dimension {} < stored columns {}", p.b.ld, b_cols);
    if (p.d.ld < p.n) return fmt::format("D leading dimension {} < n={}", p.d.ld, p.n);
    if (p.batch > 1 && p.epilogue != Epilogue::None && p.epilogue != Epilogue::Bias)
      return fmt::format("epilogue {} with batch {} (only none/bias are batched)",
                         epilogue_name(p.epilogue), p.batch);
    if (epilogue_uses_bias(p.epilogue)) {
      if (!p.bias) return fmt::format("epilogue {} needs a bias vector", epilogue_name(p.epilogue));
      if (p.bias_dtype != p.d.dtype)
        return fmt::format("bias is {} but cuBLASLt wants the output type {}",
                           dtype_name(p.bias_dtype), dtype_name(p.d.dtype));
    }
    if (epilogue_reads_aux(p.epilogue) || epilogue_writes_aux(p.epilogue)) {
      if (!p.aux) return fmt::format("epilogue {} needs an aux buffer", epilogue_name(p.epilogue));
      if (p.aux_ld < p.n || p.aux_ld % 8 != 0)
        return fmt::format("aux leading dimension {} must be >= n={} and a multiple of 8", p.aux_ld, p.n);
      if (reinterpret_cast<uintptr_t>(p.aux) % 16 != 0) return "aux buffer not 16-byte aligned";
    }
    return "";
  } catch (...) {
    return "problem could not be described";
  }
}

void set_workspace(void* ptr, size_t bytes) {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  c.ws = ptr;
  c.ws_bytes = ptr ? bytes : 0;
  c.ws_set = ptr != nullptr;  // nullptr: the default again at the next GEMM
  c.own_ws.reset();
  c.plans.clear();
}

void set_algo_search(int top_k) {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  c.algo_search = std::max(1, top_k);
  c.plans.clear();
}

int algo_search() {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  return resolve_algo_search(c);
}

std::string algo_cache_file() {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  if (c.cache_opened) return c.cache ? c.cache->path().string() : std::string();
  return algo_cache_path_from_env().string();
}

int64_t algo_search_count() {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  return c.searches;
}

int64_t algo_cache_hits() {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  return c.cache_hits;
}

size_t algo_cache_size() {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  return c.plans.size();
}

int64_t row_order_plan_count() {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  return c.row_plans;
}

void set_formulation(Formulation f) {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  c.formulation = f;
  c.plans.clear();
}

void clear_algo_cache() {
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  c.plans.clear();
  c.cache.reset();
  c.cache_opened = false;
}

void gemm(const GemmProblem& p, cudaStream_t stream) {
  if (std::string why = unsupported_reason(p); !why.empty())
    throw RuntimeError(fmt::format("cuBLASLt gemm: {} ({})", why, describe(p)));
  Context& c = ctx();
  std::lock_guard lock(c.mu);
  if (!c.handle) CUBLAS_CHECK(lt().cublasLtCreate(&c.handle));
  resolve_algo_search(c);
  if (!c.ws_set) {
    // PRIMUS_TURBO_CUBLASLT_WORKSPACE_MB (default 32, cuBLAS's recommendation on Hopper): 0 limits
    // the search and the heuristic to algorithms that need no workspace (and no zeroed counter in it).
    size_t bytes = kDefaultWorkspaceBytes;
    if (const char* e = std::getenv("PRIMUS_TURBO_CUBLASLT_WORKSPACE_MB"); e && *e) {
      char* end = nullptr;
      const long mb = std::strtol(e, &end, 10);
      if (*end || mb < 0 || mb > 4096)
        throw ConfigError(fmt::format("PRIMUS_TURBO_CUBLASLT_WORKSPACE_MB='{}': expected MiB in 0..4096", e));
      bytes = static_cast<size_t>(mb) << 20;
    }
    if (bytes > 0) {
      c.own_ws = make_device_arena(bytes);
      c.ws = c.own_ws->allocate(bytes, 256, "cuBLASLt workspace");
    }
    c.ws_bytes = bytes;
    c.ws_set = true;
  }
  const std::string key = plan_key(p, c);
  auto it = c.plans.find(key);
  if (it == c.plans.end()) {
    if (c.plans.size() >= 4096) c.plans.clear();  // shapes in training are few; this is a guard
    auto plan = build_plan(p, c);
    // Accumulating GEMMs are searched too (D saved and restored, search_algo), one matrix at a time.
    if (c.formulation == Formulation::Row && row_order_eligible(p)) plan = build_plan(p, c, true);
    else if (c.algo_search > 1 && (p.beta == 0.0f || p.batch == 1)) choose_algo(plan, p, key, c, stream);
    if (plan->row) ++c.row_plans;
    it = c.plans.emplace(key, std::move(plan)).first;
  }
  Plan& plan = *it->second;
  // Pointers change between calls of one shape; alignment is part of the key, so the algorithm
  // stays valid.
  if (epilogue_uses_bias(p.epilogue)) set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
  if (epilogue_reads_aux(p.epilogue) || epilogue_writes_aux(p.epilogue))
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.aux);
  if (dtype_is_fp8(p.a.dtype)) {
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, p.b_scale);
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, p.a_scale);
  }
  run_plan(plan, plan.algo, p, c, stream);
}

}  // namespace primus::turbo::cublaslt
