#include "turbo/kernels/cublaslt/cublaslt_api.h"

#include <cublas_api.h>

namespace primus::turbo::cublaslt {
namespace {
void bind(LazyLibrary& lib, CublasLtApi& api) { PRIMUS_CUBLASLT_FUNCTIONS(PRIMUS_DL_BIND) }
}  // namespace

ApiTable<CublasLtApi>& library() {
  static auto* table = new ApiTable<CublasLtApi>(
      LibrarySpec{"cuBLASLt",
                  "libcublasLt.so." PRIMUS_DL_STR(CUBLAS_VER_MAJOR),  // the major version we were compiled against
                  "PRIMUS_CUBLASLT_LIBRARY",
                  "cublasLtCreate",
                  {"/usr/local/cuda/lib64"},
                  {"nvidia/cublas/lib", "nvidia/cu" PRIMUS_DL_STR(CUBLAS_VER_MAJOR) "/lib"}},
      bind);
  return *table;
}

}  // namespace primus::turbo::cublaslt
