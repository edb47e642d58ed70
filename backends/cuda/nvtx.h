// NVTX ranges for Nsight Systems: `NvtxRange r("layer 3 fwd");` marks the scope. Header-only
// NVTX v3 (CUDA 12+: nvtx3/nvToolsExt.h); without it (PRIMUS_CUDA_HAVE_NVTX unset) the ranges
// compile to nothing. With no profiler attached, a range costs a few nanoseconds.
#pragma once
#ifdef PRIMUS_CUDA_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace primus::backends::cuda {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
#ifdef PRIMUS_CUDA_HAVE_NVTX
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~NvtxRange() {
#ifdef PRIMUS_CUDA_HAVE_NVTX
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace primus::backends::cuda
