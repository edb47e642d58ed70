// Shared parts of the standalone cuBLASLt probes in this folder (lt_orientation.cu, lt_wgrad_dtype.cu):
// a status check, a deterministic bf16 fill, and the timing of cuBLASLt's top heuristic candidates for
// one matmul description (3 warm-ups, median of 15 single-call events, the best candidate kept).
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { auto e_ = (x); if (e_ != 0) { std::printf("error %d at %s:%d\n", (int)e_, __FILE__, __LINE__); std::exit(1); } } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.1f);
  }
}

// An operand as stored: row-major [rows x cols]; logical = stored (t = 0) or stored^T (t = 1).
struct Op { long rows, cols; int t; };

// returned: candidates the heuristic offered; best_ms: the fastest one's median (-1: none ran);
// best_tile: its CUBLASLT_ALGO_CONFIG_TILE_ID.
struct Result { int returned = 0; float best_ms = -1; int best_tile = -1; };

// Times up to max_candidates of cuBLASLt's heuristic answers for D = alpha A B + beta D (A, B, D as
// cuBLASLt sees them), and destroys the preference it made (the caller owns desc and the layouts).
inline Result time_candidates(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                              cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld, const void* A, const void* B,
                              void* D, float beta, int max_candidates, void* ws, size_t ws_bytes, cudaStream_t s) {
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsb = ws_bytes;
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  std::vector<cublasLtMatmulHeuristicResult_t> res(max_candidates);
  Result r;
  if (cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, max_candidates, res.data(), &r.returned) !=
      CUBLAS_STATUS_SUCCESS)
    r.returned = 0;
  const float alpha = 1.0f;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int i = 0; i < r.returned; ++i) {
    bool ok = true;
    for (int w = 0; w < 3 && ok; ++w)
      ok = cublasLtMatmul(h, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &res[i].algo, ws, ws_bytes, s) ==
           CUBLAS_STATUS_SUCCESS;
    if (!ok) continue;
    std::vector<float> t;
    for (int k = 0; k < 15; ++k) {
      cudaEventRecord(e0, s);
      cublasLtMatmul(h, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &res[i].algo, ws, ws_bytes, s);
      cudaEventRecord(e1, s);
      cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms);
    }
    std::nth_element(t.begin(), t.begin() + 7, t.end());
    if (r.best_ms < 0 || t[7] < r.best_ms) {
      r.best_ms = t[7];
      size_t written = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &r.best_tile,
                                           sizeof(r.best_tile), &written);
    }
  }
  cudaEventDestroy(e0); cudaEventDestroy(e1);
  cublasLtMatmulPreferenceDestroy(pref);
  return r;
}

// Sets the transposes, times the candidates, then destroys desc and the three layouts.
inline Result time_and_release(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                               cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld, cublasOperation_t ta,
                               cublasOperation_t tb, const void* A, const void* B, void* D, float beta,
                               int max_candidates, void* ws, size_t ws_bytes, cudaStream_t s) {
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const Result r = time_candidates(h, desc, la, lb, ld, A, B, D, beta, max_candidates, ws, ws_bytes, s);
  cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  return r;
}

// The handle, stream and 32 MiB workspace (turbo/kernels/cublaslt/gemm_cublaslt.cpp's default) a probe uses.
struct ProbeEnv {
  cublasLtHandle_t h = nullptr;
  cudaStream_t s = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 32u << 20;
  ProbeEnv() {
    CK(cublasLtCreate(&h));
    CK(cudaStreamCreate(&s));
    CK(cudaMalloc(&ws, ws_bytes));
  }
};
