// Probe (session 26): what does the weight gradient's f32 output cost in cuBLASLt? Our wgrad GEMMs write
// the f32 gradient buffers directly (beta 0 on the first micro-batch, beta 1 after): in training they run
// "tss" nvjet kernels where torch.compile's autocast step runs bf16-output ones for the same products, and
// our backward GEMMs took ~5 ms more of the Llama step than torch's (bench/train/split_step.sh + gaps.sh,
// NOTES.md session 26). Result there: no consistent cost (0.98-1.08x). Per product, cuBLASLt's top 16 heuristic candidates (3 warm-ups, median of 15) with D in
// bf16 (beta 0), D in f32 (beta 0) and D in f32 accumulating (beta 1, C = D); column formulation and
// 32 MiB workspace as turbo/kernels/cublaslt/gemm_cublaslt.cpp. Also the forward and dgrad (bf16 out) for
// scale. Build: nvcc -O2 -arch=sm_90a -o lt_wgrad_dtype lt_wgrad_dtype.cu -lcublasLt. Not part of the product.
#include "lt_probe.h"

// D[M,N] (row-major) = op(A) op(B) as cuBLASLt's column-major D^T = op(B)^T op(A)^T.
Result run(cublasLtHandle_t h, long M, long N, Op a, Op b, const void* pa, const void* pb, void* pd,
           cudaDataType_t dt, float beta, void* ws, size_t ws_bytes, cudaStream_t s) {
  cublasLtMatmulDesc_t desc;
  CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasLtMatrixLayout_t la, lb, ld;
  CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, b.cols, b.rows, b.cols));
  CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, a.cols, a.rows, a.cols));
  CK(cublasLtMatrixLayoutCreate(&ld, dt, N, M, N));
  cublasOperation_t ta = b.t ? CUBLAS_OP_T : CUBLAS_OP_N, tb = a.t ? CUBLAS_OP_T : CUBLAS_OP_N;
  return time_and_release(h, desc, la, lb, ld, ta, tb, pb, pa, pd, beta, 16, ws, ws_bytes, s);
}

int main() {
  const ProbeEnv env;
  const auto& [h, s, ws, ws_bytes] = env;
  struct Layer { const char* name; long T, C, OC; };
  const Layer layers[] = {{"gpt2/qkv", 16384, 768, 2304}, {"gpt2/attn_proj", 16384, 768, 768},
                          {"gpt2/fc", 16384, 768, 3072}, {"gpt2/fc_proj", 16384, 3072, 768},
                          {"gpt2/lm_head_block", 4096, 768, 50304}, {"llama/qkv", 16384, 2048, 3072},
                          {"llama/o", 16384, 2048, 2048}, {"llama/gate_up", 16384, 2048, 16384},
                          {"llama/down", 16384, 8192, 2048}, {"llama/lm_head_block", 4096, 2048, 128256}};
  std::printf("%-26s %9s %9s %9s %9s %9s | %8s %8s  (ms; TFLOP/s of the best wgrad in brackets; tile ids)\n", "product",
              "fwd", "dgrad", "wg bf16", "wg f32", "wg f32+=", "f32/bf16", "+=/bf16");
  for (const Layer& L : layers) {
    const long T = L.T;
    __nv_bfloat16 *x, *w, *dy, *out;
    const size_t big = std::max({T * L.C, T * L.OC, L.OC * L.C}) * 4;
    CK(cudaMalloc(&x, T * L.C * 2)); CK(cudaMalloc(&w, L.OC * L.C * 2)); CK(cudaMalloc(&dy, T * L.OC * 2));
    CK(cudaMalloc(&out, big));
    fill<<<1024, 256>>>(x, T * L.C, 1); fill<<<1024, 256>>>(w, L.OC * L.C, 2); fill<<<1024, 256>>>(dy, T * L.OC, 3);
    CK(cudaMemset(out, 0, big));
    CK(cudaDeviceSynchronize());
    const Result fwd = run(h, T, L.OC, {T, L.C, 0}, {L.OC, L.C, 1}, x, w, out, CUDA_R_16BF, 0.f, ws, ws_bytes, s);
    const Result dg = run(h, T, L.C, {T, L.OC, 0}, {L.OC, L.C, 0}, dy, w, out, CUDA_R_16BF, 0.f, ws, ws_bytes, s);
    const Op a{T, L.OC, 1}, b{T, L.C, 0};
    const Result wb = run(h, L.OC, L.C, a, b, dy, x, out, CUDA_R_16BF, 0.f, ws, ws_bytes, s);
    const Result wf = run(h, L.OC, L.C, a, b, dy, x, out, CUDA_R_32F, 0.f, ws, ws_bytes, s);
    const Result wa = run(h, L.OC, L.C, a, b, dy, x, out, CUDA_R_32F, 1.f, ws, ws_bytes, s);
    const double tf = 2.0 * T * L.C * L.OC / 1e9;
    std::printf("%-26s %9.4f %9.4f %9.4f %9.4f %9.4f | %8.3f %8.3f  (%.0f / %.0f / %.0f; tiles %d %d %d)\n", L.name,
                fwd.best_ms, dg.best_ms, wb.best_ms, wf.best_ms, wa.best_ms, wf.best_ms / wb.best_ms,
                wa.best_ms / wb.best_ms, tf / wb.best_ms, tf / wf.best_ms, tf / wa.best_ms, wb.best_tile, wf.best_tile,
                wa.best_tile);
    cudaFree(x); cudaFree(w); cudaFree(dy); cudaFree(out);
  }
  return 0;
}
