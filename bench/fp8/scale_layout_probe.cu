// Which scale-tensor layouts cuBLASLt reads for its FP8 scale modes on this GPU (outer vector,
// 1x128 vectors, 128x128 blocks), found by comparing its product against CPU products under
// each candidate layout; then the time of each mode on training shapes. Standalone: build with
//   nvcc -O2 -arch=sm_90a -o scale_layout_probe bench/fp8/scale_layout_probe.cu -lcublasLt
// In cuBLAS's column-major terms: A is M x K stored K-contiguous (TRANSA = T), B is K x N stored
// K-contiguous, D is M x N bf16.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { std::printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); std::exit(1); } } while (0)

static cublasLtHandle_t lt;
static void* ws;
static const size_t kWs = 64u << 20;

static int mode_of(const std::string& s) {
  if (s == "tensor") return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  if (s == "outer") return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  if (s == "vec128") return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
}

// D = A x B with the modes; returns the cublas status (0 = ok). fast: fast accumulation.
static int matmul(int M, int N, int K, const void* A, const void* B, void* D, const float* sa, const float* sb,
                  const std::string& ma, const std::string& mb, bool fast, cudaStream_t st, int reps = 1, float* ms = nullptr) {
  cublasLtMatmulDesc_t desc;
  cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n);
  int32_t a_mode = mode_of(ma), b_mode = mode_of(mb);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof a_mode);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof b_mode);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb);
  int8_t f = fast ? 1 : 0;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &f, sizeof f);
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, M, K);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, N, K);
  cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, M, N, M);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWs, sizeof kWs);
  cublasLtMatmulHeuristicResult_t h{};
  int got = 0;
  int s = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &h, &got);
  if (s == 0 && got == 0) s = CUBLAS_STATUS_NOT_SUPPORTED;
  float one = 1, zero = 0;
  if (s == 0) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0); cudaEventCreate(&e1);
    s = cublasLtMatmul(lt, desc, &one, A, la, B, lb, &zero, D, ld, D, ld, &h.algo, ws, kWs, st);
    if (reps > 1 && s == 0) {
      cudaEventRecord(e0, st);
      for (int i = 0; i < reps; ++i) cublasLtMatmul(lt, desc, &one, A, la, B, lb, &zero, D, ld, D, ld, &h.algo, ws, kWs, st);
      cudaEventRecord(e1, st);
      cudaEventSynchronize(e1);
      cudaEventElapsedTime(ms, e0, e1);
      *ms /= reps;
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  return s;
}

static float fp8v(uint8_t b) { __nv_fp8_e4m3 x; x.__x = b; return float(x); }

int main() {
  cublasLtCreate(&lt);
  CK(cudaMalloc(&ws, kWs));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const int M = 384, N = 640, K = 384;  // 3 x 5 x 3 blocks of 128: no block count a multiple of 4
  const int Kb = K / 128;
  std::mt19937 rng(7);
  std::vector<uint8_t> A(size_t(M) * K), B(size_t(N) * K);
  auto rnd8 = [&] { uint8_t b; do { b = uint8_t(rng()); } while ((b & 0x7f) == 0x7f || std::fabs(fp8v(b)) > 8); return b; };
  for (auto& x : A) x = rnd8();
  for (auto& x : B) x = rnd8();
  auto pow2 = [&] { return std::ldexp(1.0f, int(rng() % 7) - 3); };
  std::vector<float> SA(4096), SB(4096);  // larger than any layout needs
  for (auto& x : SA) x = pow2();
  for (auto& x : SB) x = pow2();
  void *dA, *dB, *dD; float *dSA, *dSB;
  CK(cudaMalloc(&dA, A.size())); CK(cudaMalloc(&dB, B.size())); CK(cudaMalloc(&dD, size_t(M) * N * 2));
  CK(cudaMalloc(&dSA, SA.size() * 4)); CK(cudaMalloc(&dSB, SB.size() * 4));
  CK(cudaMemcpy(dA, A.data(), A.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dB, B.data(), B.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dSA, SA.data(), SA.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dSB, SB.size() ? SB.data() : nullptr, SB.size() * 4, cudaMemcpyHostToDevice));
  // Candidate layouts: the scale of row r (of R rows), k-block kb, for a mode.
  using Idx = std::function<int(int r, int kb, int R)>;
  auto rup4 = [](int x) { return (x + 3) / 4 * 4; };
  std::vector<std::pair<std::string, Idx>> vec = {
      {"vec128 [Kb][R] (R-major)", [&](int r, int kb, int R) { return kb * R + r; }},
      {"vec128 [R][Kb] (K-major)", [&](int r, int kb, int) { return r * Kb + kb; }},
  };
  std::vector<std::pair<std::string, Idx>> blk = {
      {"blk [Kb][Rb] (R-major)", [&](int r, int kb, int R) { return kb * (R / 128) + r / 128; }},
      {"blk [Rb][Kb] (K-major)", [&](int r, int kb, int) { return (r / 128) * Kb + kb; }},
      {"blk [Kb][rup4(Rb)]", [&](int r, int kb, int R) { return kb * rup4(R / 128) + r / 128; }},
      {"blk [Rb][rup4(Kb)]", [&](int r, int kb, int) { return (r / 128) * rup4(Kb) + kb; }},
  };
  std::vector<std::pair<std::string, Idx>> outer = {{"outer [R]", [&](int r, int, int) { return r; }}};
  std::vector<std::pair<std::string, Idx>> tensor = {{"tensor [1]", [&](int, int, int) { return 0; }}};
  auto cands = [&](const std::string& m) { return m == "vec128" ? vec : m == "blk" ? blk : m == "outer" ? outer : tensor; };
  std::vector<__nv_bfloat16> D(size_t(M) * N);
  std::vector<double> P(size_t(M) * N * Kb);  // the unscaled partial product of each K block
  for (int n = 0; n < N; ++n)
    for (int m = 0; m < M; ++m)
      for (int kb = 0; kb < Kb; ++kb) {
        double part = 0;
        for (int k = kb * 128; k < kb * 128 + 128; ++k) part += double(fp8v(A[size_t(m) * K + k])) * fp8v(B[size_t(n) * K + k]);
        P[(size_t(n) * M + m) * Kb + kb] = part;
      }
  const char* combos[][2] = {{"outer", "outer"}, {"vec128", "vec128"}, {"blk", "vec128"}, {"vec128", "blk"}, {"blk", "blk"}, {"tensor", "tensor"}};
  std::printf("layout probe M=%d N=%d K=%d (A: M x K, B: K x N, both K-contiguous)\n", M, N, K);
  for (auto& c : combos) {
    int s = matmul(M, N, K, dA, dB, dD, dSA, dSB, c[0], c[1], false, st);
    CK(cudaStreamSynchronize(st));
    if (s) { std::printf("A %-6s B %-6s: cublas status %d (unsupported)\n", c[0], c[1], s); continue; }
    CK(cudaMemcpy(D.data(), dD, D.size() * 2, cudaMemcpyDeviceToHost));
    for (auto& ca : cands(c[0]))
      for (auto& cb : cands(c[1])) {
        double err = 0, ref = 0;
        for (int n = 0; n < N; ++n)
          for (int m = 0; m < M; ++m) {
            double acc = 0;
            for (int kb = 0; kb < Kb; ++kb)
              acc += P[(size_t(n) * M + m) * Kb + kb] * SA[ca.second(m, kb, M)] * SB[cb.second(n, kb, N)];
            const double d = float(D[size_t(n) * M + m]);
            err = std::max(err, std::fabs(d - acc));
            ref = std::max(ref, std::fabs(acc));
          }
        std::printf("A %-6s B %-6s  %-26s %-26s max err / max |ref| = %.3g%s\n", c[0], c[1], ca.first.c_str(),
                    cb.first.c_str(), err / ref, err / ref < 1e-2 ? "   <== MATCH" : "");
      }
  }
  // Timing, bf16 output, TN, per mode; shapes (M, N, K) in cuBLAS terms.
  const int shapes[][3] = {{8192, 8192, 8192}, {8192, 16384, 2048}, {2048, 16384, 8192}, {2048, 8192, 16384},
                           {3072, 16384, 2048}, {2048, 16384, 2048}, {768, 16384, 3072}, {2304, 16384, 768}};
  size_t maxA = 0, maxB = 0, maxD = 0;
  for (auto& s : shapes) { maxA = std::max(maxA, size_t(s[0]) * s[2]); maxB = std::max(maxB, size_t(s[1]) * s[2]); maxD = std::max(maxD, size_t(s[0]) * s[1]); }
  void *tA, *tB, *tD; float *tS1, *tS2;
  CK(cudaMalloc(&tA, maxA)); CK(cudaMalloc(&tB, maxB)); CK(cudaMalloc(&tD, maxD * 2));
  CK(cudaMalloc(&tS1, 64 << 20)); CK(cudaMalloc(&tS2, 64 << 20));
  CK(cudaMemset(tA, 0x30, maxA)); CK(cudaMemset(tB, 0x30, maxB));
  std::vector<float> ones(16 << 20, 1.0f);
  CK(cudaMemcpy(tS1, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(tS2, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  std::printf("\n%-20s %-24s %10s %10s\n", "M x N x K", "A/B modes", "ms", "TFLOP/s");
  const char* tcombos[][3] = {{"tensor", "tensor", "fast"}, {"tensor", "tensor", ""}, {"outer", "outer", "fast"}, {"outer", "outer", ""},
                              {"blk", "vec128", ""}, {"vec128", "vec128", ""}};
  for (auto& s : shapes)
    for (auto& c : tcombos) {
      float ms = 0;
      int r = matmul(s[0], s[1], s[2], tA, tB, tD, tS1, tS2, c[0], c[1], c[2][0] != 0, st, 1, &ms);  // warm
      if (r == 0) r = matmul(s[0], s[1], s[2], tA, tB, tD, tS1, tS2, c[0], c[1], c[2][0] != 0, st, 20, &ms);
      char shape[64], modes[64];
      std::snprintf(shape, sizeof shape, "%dx%dx%d", s[0], s[1], s[2]);
      std::snprintf(modes, sizeof modes, "%s/%s%s", c[0], c[1], c[2][0] ? " fast" : "");
      if (r) std::printf("%-20s %-24s status %d\n", shape, modes, r);
      else std::printf("%-20s %-24s %10.4f %10.1f\n", shape, modes, ms, 2.0 * s[0] * s[1] * s[2] / ms / 1e9);
    }
  return 0;
}
