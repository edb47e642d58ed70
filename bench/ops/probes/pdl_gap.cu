// Probe: what a kernel boundary costs inside a CUDA graph on this GPU, and how much of it
// programmatic dependent launch (PDL) takes back. A chain of K dependent kernels, each a
// memory-bound pass over `mb` MB (read + write, like a norm or an elementwise op), is captured
// into a graph three ways:
//   plain     ordinary launches;
//   pdl       every kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization and
//             waiting (griddepcontrol.wait) before it touches memory;
//   pdl+trig  as pdl, and each kernel also signals (griddepcontrol.launch_dependents) once its
//             blocks have issued their loads, so the next grid may be scheduled during the tail.
// For each: the marginal time of one more kernel in the chain ((time of 2K - time of K) / K), i.e.
// a kernel plus one boundary; the modes' difference is what PDL saves per boundary.
// Build (here): nvcc -O2 -arch=sm_90a -o pdl_gap pdl_gap.cu ; run on the GPU machine:
//   ./pdl_gap [K=200] [mb=25]
// Not part of the product.
#include <cuda_runtime.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

template <bool kWait, bool kTrigger>
__global__ void pass(float4* __restrict__ dst, const float4* __restrict__ src, long n) {
  if constexpr (kWait) asm volatile("griddepcontrol.wait;" ::: "memory");
  const long stride = long(gridDim.x) * blockDim.x;
  long i = long(blockIdx.x) * blockDim.x + threadIdx.x;
  // Four loads in flight per thread, then the stores.
  for (; i + 3 * stride < n; i += 4 * stride) {
    float4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    if (kTrigger && i + 4 * stride >= n) asm volatile("griddepcontrol.launch_dependents;");
    a.x += 1.0f, b.x += 1.0f, c.x += 1.0f, d.x += 1.0f;
    dst[i] = a, dst[i + stride] = b, dst[i + 2 * stride] = c, dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) {
    float4 a = src[i];
    a.x += 1.0f;
    dst[i] = a;
  }
}

template <bool kWait, bool kTrigger>
void launch(float4* dst, const float4* src, long n, int grid, cudaStream_t s, bool pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(512);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  CHECK(cudaLaunchKernelEx(&cfg, pass<kWait, kTrigger>, dst, src, n));
}

int main(int argc, char** argv) {
  const int K = argc > 1 ? std::atoi(argv[1]) : 200;
  const double mb = argc > 2 ? std::atof(argv[2]) : 25.0;
  const long n = long(mb * 1e6 / 16);
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int grid = sms * 4;
  float4 *a, *b;
  CHECK(cudaMalloc(&a, n * 16));
  CHECK(cudaMalloc(&b, n * 16));
  CHECK(cudaMemset(a, 0, n * 16));
  CHECK(cudaMemset(b, 0, n * 16));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  // mode 0 plain, 1 pdl, 2 pdl+trig; `count` kernels alternating a->b, b->a.
  auto build = [&](int mode, int count) {
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int k = 0; k < count; ++k) {
      float4* dst = k % 2 ? a : b;
      const float4* src = k % 2 ? b : a;
      if (mode == 0) launch<false, false>(dst, src, n, grid, s, false);
      else if (mode == 1) launch<true, false>(dst, src, n, grid, s, true);
      else launch<true, true>(dst, src, n, grid, s, true);
    }
    CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t x;
    CHECK(cudaGraphInstantiate(&x, g, 0));
    CHECK(cudaGraphDestroy(g));
    return x;
  };
  auto time = [&](cudaGraphExec_t x, int reps) {
    CHECK(cudaGraphLaunch(x, s));
    CHECK(cudaStreamSynchronize(s));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
      CHECK(cudaEventRecord(e0, s));
      CHECK(cudaGraphLaunch(x, s));
      CHECK(cudaEventRecord(e1, s));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return double(t[t.size() / 2]);
  };
  std::printf("chains of %d and %d kernels, %.1f MB read + %.1f MB written each, grid %d x 512\n", K, 2 * K, mb, mb, grid);
  const char* names[] = {"plain", "pdl", "pdl+trig"};
  for (int mode = 0; mode < 3; ++mode) {
    cudaGraphExec_t c1 = build(mode, K), c2 = build(mode, 2 * K);
    const double t1 = time(c1, 11) * 1e3, t2 = time(c2, 11) * 1e3;
    const double per = (t2 - t1) / K;  // the marginal kernel: its own time plus one boundary
    std::printf("%-9s %d kernels %9.1f us, %d kernels %9.1f us: %7.3f us per kernel (%.2f TB/s)\n", names[mode], K, t1,
                2 * K, t2, per, 2 * mb * 1e6 / (per * 1e-6) / 1e12);
    CHECK(cudaGraphExecDestroy(c1));
    CHECK(cudaGraphExecDestroy(c2));
  }
  return 0;
}
