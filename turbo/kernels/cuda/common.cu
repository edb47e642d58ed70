#include "turbo/kernels/cuda/common.cuh"

namespace primus::turbo::cuda {

int sm_count() {
  // One value per process: Turbo runs one device per process (NCCL ranks are processes).
  static const int n = [] {
    int dev = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return sms;
  }();
  return n;
}

}  // namespace primus::turbo::cuda
