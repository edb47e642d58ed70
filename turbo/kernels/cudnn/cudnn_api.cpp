#include "turbo/kernels/cudnn/cudnn_api.h"

#include <cudnn_version.h>

namespace primus::turbo::cudnn {
namespace {
void bind(LazyLibrary& lib, CudnnApi& api) { PRIMUS_CUDNN_FUNCTIONS(PRIMUS_DL_BIND) }
}  // namespace

ApiTable<CudnnApi>& library() {
  static auto* table = new ApiTable<CudnnApi>(
      LibrarySpec{"cuDNN",
                  "libcudnn.so." PRIMUS_DL_STR(CUDNN_MAJOR),  // the major version we were compiled against
                  "PRIMUS_CUDNN_LIBRARY",
                  "cudnnBackendCreateDescriptor",
                  {"/usr/local/cuda/lib64"},
                  {"nvidia/cudnn/lib"}},
      bind);
  return *table;
}

}  // namespace primus::turbo::cudnn
