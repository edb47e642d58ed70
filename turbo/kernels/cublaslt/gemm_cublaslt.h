// Dense GEMM on NVIDIA's cuBLASLt, in row-major terms (the ops layer speaks row-major; the
// column-major translation lives in gemm_cublaslt.cpp only).
//
//   D[m,n] = epilogue(alpha * A[m,k] @ B[k,n] + beta * D)      (per batch entry)
//
// Each operand is stored row-major with a leading dimension `ld` (elements between stored
// rows); `transposed` says the logical operand is the transpose of what is stored (so W[OC,C]
// used as B = W^T is {W, ld=C, transposed=true}). D is never transposed.
//
// Types: A/B bf16 or f16 with D the same type or f32; A/B/D f32 (exact fp32 unless allow_tf32).
// FP8: A/B f8e4m3/f8e5m2 (not both e5m2) with D bf16/f16/f32 and device dequantization scales
// a_scale/b_scale (D = alpha * a_scale * b_scale * A @ B + beta * D); Hopper's FP8 tensor cores
// want both operands K-contiguous: A stored row-major [m,k] (not transposed) and B transposed
// (stored row-major [n,k]), leading dimensions multiples of 16. Accumulation is fp32 always
// (with fp8_fast_accum, cuBLASLt's faster accumulation without periodic fp32 promotion).
//
// The algorithm for each problem shape is chosen once by cuBLASLt's heuristic (optionally by
// timing its top candidates, see set_algo_search) and cached with its descriptors, keyed by
// shapes, layouts, dtypes, epilogue and pointer alignment. The search's winners are also kept
// in a file per machine (algo_cache.h), so later processes reuse them instead of timing again.
// The workspace is one device buffer set once (set_workspace) so that calls allocate nothing.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "turbo/core/dtype.h"
#include "turbo/core/fp8_granularity.h"

namespace primus::turbo::cublaslt {

enum class Epilogue : uint8_t {
  None,
  Bias,         // D += bias[n] (broadcast over rows)
  Gelu,         // D = gelu_tanh(D)
  GeluBias,     // D = gelu_tanh(D + bias[n])
  GeluAux,      // aux = D (pre-activation, kept for backward); D = gelu_tanh(D)
  GeluAuxBias,  // aux = D + bias[n]; D = gelu_tanh(aux)
  DGelu,        // D = D * gelu_tanh'(aux)          (backward through a GeluAux forward)
  DGeluBGrad,   // as DGelu, and bias[n] = column sums of D (the bias gradient; overwritten)
  BGradA,       // bias[m] = row sums of A over k   (overwritten; e.g. db from dout^T @ inp)
  BGradB,       // bias[n] = sums of B over k       (overwritten)
};
const char* epilogue_name(Epilogue e);
bool epilogue_reads_aux(Epilogue e);
bool epilogue_writes_aux(Epilogue e);
bool epilogue_uses_bias(Epilogue e);

struct Matrix {
  const void* ptr = nullptr;
  DType dtype = DType::BF16;
  int64_t ld = 0;            // elements between consecutive stored rows
  bool transposed = false;   // logical = stored^T
  int64_t batch_stride = 0;  // elements between batch entries (0 broadcasts one matrix)
};

struct GemmProblem {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  Matrix a, b;
  Matrix d;  // ptr written (const only to share the struct); never transposed
  float alpha = 1.0f, beta = 0.0f;
  Epilogue epilogue = Epilogue::None;
  void* bias = nullptr;  // input for Bias/GeluBias/GeluAuxBias, output for the BGrad kinds
  DType bias_dtype = DType::BF16;
  void* aux = nullptr;   // [m, aux_ld] row-major, dtype of D
  int64_t aux_ld = 0;
  bool allow_tf32 = false;
  const float* a_scale = nullptr;  // FP8 only: device f32 scales (pointers may change per call)
  const float* b_scale = nullptr;
  // FP8 only: the scales' granularities and layouts, as turbo::GemmArgs (turbo/ops/gemm.h) has them.
  Fp8Granularity a_scaling = Fp8Granularity::Tensor, b_scaling = Fp8Granularity::Tensor;
  bool fp8_fast_accum = false;
};

// Empty when cuBLASLt can run the problem, else the reason (dtype combination, alignment of
// the aux buffer, an epilogue with batch > 1, ...). Never throws.
std::string unsupported_reason(const GemmProblem& p) noexcept;

// Enqueues the GEMM on `stream`. Throws primus::RuntimeError (with the cuBLAS status and the
// problem) when cuBLASLt refuses or finds no algorithm.
void gemm(const GemmProblem& p, cudaStream_t stream);

// The workspace every call uses (device memory the caller owns, e.g. from an Arena; it must
// outlive all GEMMs in flight). Without one, 32 MiB (PRIMUS_TURBO_CUBLASLT_WORKSPACE_MB, 0..4096;
// 0: no workspace, which leaves cuBLASLt only slower kernels: GPT-2 124M trains 9% slower on an
// H200; 4 trains as fast as 32) are cudaMalloc'ed at the first call.
// Changing it clears the algorithm cache.
void set_workspace(void* ptr, size_t bytes);
inline constexpr size_t kDefaultWorkspaceBytes = 32u << 20;

// 1 (default): take cuBLASLt's first heuristic answer. k > 1: time the top k candidates once
// per shape (never while capturing a graph; an accumulating GEMM, beta != 0, is timed with its
// output saved first and restored after, so it still accumulates once; batched ones are not
// searched).
// Also read from PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH at first use; the gemm op sets 8 when
// PRIMUS_TURBO_AUTO_TUNE is on, the cuda trainer its `gemm_algo_search` key (default 8).
//
// With k > 1 the winners persist: a shape found in the cache file (algo_cache_file()) takes the
// file's algorithm (after cublasLtMatmulAlgoCheck accepts it for the plan; else it is searched
// again) instead of being timed, also while capturing a graph; each new search rewrites the file
// (atomically, merged with what other processes wrote). The same machine, cuBLASLt version and
// cache file therefore give the same algorithm per shape in every process.
// PRIMUS_TURBO_CUBLASLT_ALGO_CACHE=0 disables the file, =PATH names it; default
// $PRIMUS_CACHE_DIR/cublaslt_algos.json, $XDG_CACHE_HOME/primus/..., ~/.cache/primus/....
void set_algo_search(int top_k);
// Formulations of a problem: column order (D^T = B^T A^T, operands swapped; the default and the
// only one without the search) and row order (CUBLASLT_ORDER_ROW layouts, operands in place),
// whose kernels differ (4-13% faster on some training products, slower on others, measured
// standalone on an H200 by a probe that git history keeps). Auto: the search times plain
// products (no epilogue, no FP8, batch 1) in both and keeps the faster; Row runs every eligible
// problem in row order, searched or not; Column never uses row order. Default Column, or
// PRIMUS_TURBO_CUBLASLT_ORDER=column|auto|row; set_formulation (tests) overrides it and clears
// the in-memory plans. Auto stays opt-in until it is measured in training.
enum class Formulation { Auto, Column, Row };
void set_formulation(Formulation f);
int64_t row_order_plan_count();  // plans made so far that use the row-order formulation
int algo_search();  // the current k (reads the environment when nothing set it)
size_t algo_cache_size();
// Drops the in-memory plans and the loaded cache file: the next GEMM re-reads the environment's
// cache path and the file.
void clear_algo_cache();
// The cache file in use, or that will be opened ("" when disabled).
std::string algo_cache_file();
// Problem keys whose candidates this process timed, and those whose algorithm came from the
// cache file (since the process started).
int64_t algo_search_count();
int64_t algo_cache_hits();

// A one-line description of the problem for error messages and autotune keys.
std::string describe(const GemmProblem& p);

}  // namespace primus::turbo::cublaslt
