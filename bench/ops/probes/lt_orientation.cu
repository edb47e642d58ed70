// Probe (session 8): does describing a row-major GEMM to cuBLASLt in row order (A, B, D with
// CUBLASLT_ORDER_ROW, operands in their own roles) reach faster kernels than the column-major
// formulation the library uses (D^T = B^T A^T: operands swapped, column order)? For each product
// it times cuBLASLt's top 8 heuristic candidates of both formulations (3 warm-ups, median of 15)
// and prints the best of each. bf16 in/out, f32 accumulate, 32 MiB workspace, as
// turbo/kernels/cublaslt/gemm_cublaslt.cpp. Build (here): nvcc -O2 -o lt_orientation
// lt_orientation.cu -lcublasLt; run on the GPU machine. Not part of the product.
#include "lt_probe.h"

Result run(cublasLtHandle_t h, bool row_order, long M, long N, long K, Op a, Op b, const void* pa, const void* pb, void* pd,
           void* ws, size_t ws_bytes, cudaStream_t s) {
  cublasLtMatmulDesc_t desc;
  CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasLtMatrixLayout_t la, lb, ld;
  const void *A, *B;
  cublasOperation_t ta, tb;
  if (row_order) {
    // D[M,N] = op(A) op(B), every matrix in row order.
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, a.rows, a.cols, a.cols));
    CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, b.rows, b.cols, b.cols));
    CK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, M, N, N));
    cublasLtOrder_t o = CUBLASLT_ORDER_ROW;
    for (auto l : {la, lb, ld}) CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &o, sizeof(o)));
    A = pa, B = pb;
    ta = a.t ? CUBLAS_OP_T : CUBLAS_OP_N;
    tb = b.t ? CUBLAS_OP_T : CUBLAS_OP_N;
  } else {
    // Column order: D^T[N,M] = op(B)^T op(A)^T; a stored row-major [r x c] is column-major [c x r].
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, b.cols, b.rows, b.cols));  // cuBLASLt's A = our B
    CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, a.cols, a.rows, a.cols));  // cuBLASLt's B = our A
    CK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, N, M, N));
    A = pb, B = pa;
    ta = b.t ? CUBLAS_OP_T : CUBLAS_OP_N;
    tb = a.t ? CUBLAS_OP_T : CUBLAS_OP_N;
  }
  return time_and_release(h, desc, la, lb, ld, ta, tb, A, B, pd, 0.0f, 8, ws, ws_bytes, s);
}

int main() {
  const ProbeEnv env;
  const auto& [h, s, ws, ws_bytes] = env;
  const long T = 16384;
  struct Layer { const char* name; long C, OC; };
  const Layer layers[] = {{"gpt2/qkv", 768, 2304}, {"gpt2/attn_proj", 768, 768}, {"gpt2/fc", 768, 3072},
                          {"gpt2/fc_proj", 3072, 768}, {"gpt2/lm_head", 768, 50304}, {"llama/q_o", 2048, 2048},
                          {"llama/kv", 2048, 1024}, {"llama/gate_up", 2048, 16384}, {"llama/down", 8192, 2048}};
  std::printf("%-28s %6s %10s %6s %10s %8s\n", "product", "n_col", "col ms", "n_row", "row ms", "col/row");
  for (const Layer& L : layers) {
    __nv_bfloat16 *x, *w, *dy, *out;
    const size_t big = std::max({T * L.C, T * L.OC, L.OC * L.C});
    CK(cudaMalloc(&x, T * L.C * 2)); CK(cudaMalloc(&w, L.OC * L.C * 2)); CK(cudaMalloc(&dy, T * L.OC * 2));
    CK(cudaMalloc(&out, big * 2));
    fill<<<1024, 256>>>(x, T * L.C, 1); fill<<<1024, 256>>>(w, L.OC * L.C, 2); fill<<<1024, 256>>>(dy, T * L.OC, 3);
    CK(cudaDeviceSynchronize());
    struct Prod { const char* what; long M, N, K; Op a, b; const void *pa, *pb; };
    const Prod prods[] = {
        {"fwd", T, L.OC, L.C, {T, L.C, 0}, {L.OC, L.C, 1}, x, w},      // x @ w^T
        {"dgrad", T, L.C, L.OC, {T, L.OC, 0}, {L.OC, L.C, 0}, dy, w},  // dy @ w
        {"wgrad", L.OC, L.C, T, {T, L.OC, 1}, {T, L.C, 0}, dy, x},     // dy^T @ x
    };
    for (const Prod& p : prods) {
      const Result c = run(h, false, p.M, p.N, p.K, p.a, p.b, p.pa, p.pb, out, ws, ws_bytes, s);
      const Result r = run(h, true, p.M, p.N, p.K, p.a, p.b, p.pa, p.pb, out, ws, ws_bytes, s);
      char name[64]; std::snprintf(name, sizeof(name), "%s/%s", L.name, p.what);
      std::printf("%-28s %6d %10.4f %6d %10.4f %8.3f\n", name, c.returned, c.best_ms, r.returned, r.best_ms,
                  (c.best_ms > 0 && r.best_ms > 0) ? c.best_ms / r.best_ms : 0.0);
    }
    cudaFree(x); cudaFree(w); cudaFree(dy); cudaFree(out);
  }
  return 0;
}
