// Probe: how fast warpgroup MMAs run from shared memory at the shapes the attention kernels use,
// with no loads, no softmax and nothing else in the loop. Each block (one per SM) has W consumer
// warpgroups (1, 2 or 3) that each issue `iters` x 4 wgmma.m64nNk16 (bf16 in, f32 accumulate)
// over fixed 128-byte-swizzled tiles, one commit group per 4, at most two groups in flight:
//   ss  A (64 x 64) and B (N x 64) both from shared memory, K-major (S^T = K Q^T, dP^T, dQ);
//   rs  A from registers, B (64 x N) from shared memory, MN-major (dV += P^T dO, dK += dS^T Q).
// Printed: multiply-adds per SM clock (clock64 of each warpgroup, the slowest per block) and the
// TFLOP/s the whole grid reaches (cudaEvent time). The question it answers (session 23): is an
// m64n64k16 product with both operands in shared memory held back by shared-memory bandwidth
// (its A and B tiles are 4 KiB per 64 x 64 x 16 step) where n128 or a register A is not?
// Build (here): nvcc -O3 -arch=sm_90a -std=c++17 -I<repo> -o wgmma_rate bench/ops/probes/wgmma_rate.cu
// Run on the GPU machine: ./wgmma_rate [iters=4096]
// Not part of the product.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "turbo/kernels/cuda/attention_sm90_common.cuh"
#include "turbo/kernels/cuda/attention_wgmma_ops.cuh"
#include "probe_check.h"

using namespace primus::turbo::cuda::attn;
using T = __nv_bfloat16;

template <int N, bool kRs>
__global__ void __launch_bounds__(384, 1) wgmma_rate(int iters, float* sink, long long* cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const int wg = threadIdx.x / 128;
  // Per warpgroup: A tile 64 x 64 (8 KiB) and B tile N x 64 (ss) or 64 x N (rs), both swizzled.
  const uint32_t sA = base + wg * 40960, sB = sA + 8192;
  unsigned char* p = smem_raw + (sA - smem_addr(smem_raw));
  for (int i = threadIdx.x % 128; i < 40960 / 4; i += 128)
    reinterpret_cast<uint32_t*>(p)[i] = 0x3c003c00u ^ (i * 2654435761u & 0x00ff00ffu);  // small finite bf16 pairs
  fence_proxy_async();
  __syncthreads();
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  uint32_t a[4][4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int j = 0; j < 4; ++j) a[k][j] = 0x3c003c00u ^ ((threadIdx.x * 7 + k * 5 + j) & 0x00070007u);
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (kRs) {
        Wgmma<T>::template rs_tb<N>(acc, a[kk], make_desc(sB + kk * 2048, Sw128<64>::kSlab, 1024));
      } else {
        Wgmma<T>::template ss<N>(acc, make_desc(sA + kk * 32, 16, 1024), make_desc(sB + kk * 32, 16, 1024), 1);
      }
    }
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  fence_regs<N / 2>(acc);
  const long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += acc[i];
  if (s == 12345.678f) sink[threadIdx.x] = s;  // keeps the products
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 3 + wg] = t1 - t0;
#endif
}

template <int N, bool kRs>
void run(int iters, int wgs, int sms, float* sink, long long* cycles) {
  auto k = wgmma_rate<N, kRs>;
  const int smem = 3 * 40960 + 1024;
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k<<<sms, 128 * wgs, smem>>>(16, sink, cycles);  // warm-up
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0));
  k<<<sms, 128 * wgs, smem>>>(iters, sink, cycles);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0.0f;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  std::vector<long long> host(static_cast<size_t>(sms) * 3);
  CHECK(cudaMemcpy(host.data(), cycles, sizeof(long long) * host.size(), cudaMemcpyDeviceToHost));
  long long worst = 0;
  for (int b = 0; b < sms; ++b)
    for (int w = 0; w < wgs; ++w) worst = host[b * 3 + w] > worst ? host[b * 3 + w] : worst;
  const double macs_per_sm = static_cast<double>(wgs) * iters * 4 * 64.0 * N * 16;
  const double tflops = 2.0 * macs_per_sm * sms / (ms * 1e-3) / 1e12;
  std::printf("%-3s n%-4d warpgroups %d  %7.1f MAC/clk/SM  %6.1f TFLOP/s  (%.3f ms)\n", kRs ? "rs" : "ss", N, wgs,
              macs_per_sm / static_cast<double>(worst), tflops, ms);
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 4096;
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s, %d SMs, %d iterations of 4 wgmma per warpgroup\n", prop.name, sms, iters);
  float* sink = nullptr;
  long long* cycles = nullptr;
  CHECK(cudaMalloc(&sink, 384 * sizeof(float)));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms * 3));
  for (int wgs = 1; wgs <= 3; ++wgs) {
    run<64, false>(iters, wgs, sms, sink, cycles);
    run<128, false>(iters, wgs, sms, sink, cycles);
    run<64, true>(iters, wgs, sms, sink, cycles);
    run<128, true>(iters, wgs, sms, sink, cycles);
  }
  return 0;
}
