// DeviceMemoryOps: copies and the rank-order reduction of the threaded group's collectives on one
// GPU. The reduction reads k peers' buffers element by element and adds them (or, for Max, takes
// the largest) in rank order in f32, so every rank's chunk, and the host reference, come out bit
// for bit the same; it is a bandwidth-bound grid-stride loop, which is all a stand-in for NCCL on
// one GPU needs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>

#include "core/util/error.h"
#include "parallel/cuda/threaded_device_ops.h"
#include "turbo/core/cuda_check.h"

namespace primus::parallel {

namespace {

// Kernel parameters are passed by value: 64 pointers are 512 bytes, well inside the limit.
struct ReduceSources {
  const void* p[DeviceMemoryOps::kMaxSources];
};

__device__ __forceinline__ float threaded_load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float threaded_load(const __nv_bfloat16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void threaded_store(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void threaded_store(__nv_bfloat16* p, size_t i, float v) { p[i] = __float2bfloat16_rn(v); }

template <class T>
__global__ void threaded_reduce_kernel(T* dst, ReduceSources src, int k, size_t count, bool average, bool max) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float acc = threaded_load(static_cast<const T*>(src.p[0]), i);
    for (int j = 1; j < k; ++j) {
      const float x = threaded_load(static_cast<const T*>(src.p[j]), i);
      acc = max ? fmaxf(acc, x) : acc + x;  // fmaxf: a NaN gives way, as std::fmax on the host
    }
    // A true division, as on the host (nvcc's default -prec-div=true keeps it IEEE).
    threaded_store(dst, i, average ? acc / static_cast<float>(k) : acc);
  }
}

}  // namespace

void launch_threaded_reduce(void* dst, const void* const* srcs, size_t k, size_t count, DType dtype, ReduceOp op,
                            cudaStream_t stream) {
  if (k == 0 || count == 0) return;
  if (k > DeviceMemoryOps::kMaxSources) {
    throw RuntimeError(fmt::format("threaded device reduction of {} sources: at most {} (ranks on one GPU)", k,
                                   DeviceMemoryOps::kMaxSources));
  }
  ReduceSources s{};
  for (size_t j = 0; j < k; ++j) s.p[j] = srcs[j];
  constexpr int kThreads = 256;
  const size_t want = (count + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 4096 ? want : 4096);
  const bool avg = op == ReduceOp::Avg, max = op == ReduceOp::Max;
  if (dtype == DType::F32) {
    threaded_reduce_kernel<float>
        <<<blocks, kThreads, 0, stream>>>(static_cast<float*>(dst), s, static_cast<int>(k), count, avg, max);
  } else {
    threaded_reduce_kernel<__nv_bfloat16>
        <<<blocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), s, static_cast<int>(k), count, avg, max);
  }
  CUDA_CHECK_LAST();
}

DeviceMemoryOps::DeviceMemoryOps(int device, cudaStream_t stream) : device_(device), stream_(stream) {
  CUDA_CHECK(cudaSetDevice(device_));
  if (!stream_) {
    CUDA_CHECK(cudaStreamCreate(&stream_));
    owned_ = true;
  }
}

DeviceMemoryOps::~DeviceMemoryOps() {
  if (owned_) (void)cudaStreamDestroy(stream_);
}

// The current device is per thread, and each rank's thread calls these: set it every time.
void DeviceMemoryOps::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
}

void DeviceMemoryOps::reduce(void* dst, const void* const* srcs, size_t k, size_t count, DType dtype, ReduceOp op) {
  CUDA_CHECK(cudaSetDevice(device_));
  launch_threaded_reduce(dst, srcs, k, count, dtype, op, stream_);
}

void DeviceMemoryOps::synchronize() {
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

ThreadedGroup::OpsFactory DeviceMemoryOps::factory(int device) {
  return [device](int) -> std::unique_ptr<MemoryOps> { return std::make_unique<DeviceMemoryOps>(device); };
}

}  // namespace primus::parallel
