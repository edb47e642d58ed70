// cuBLASLt, loaded at first use (turbo/core/dynamic_library.h) instead of linked: a CUDA build
// of primus starts and runs its CPU paths where libcublasLt is absent. The entry points used by
// gemm_cublaslt.cpp are the members of CublasLtApi, typed from cublasLt.h itself (decltype), so
// a signature cannot drift from the header; a function used without being listed here fails to
// compile (`lt().f` does not exist) instead of failing at run time.
//
// Search: PRIMUS_CUBLASLT_LIBRARY (a file), the loader's path, /usr/local/cuda/lib64, then
// PyTorch's pip packages (nvidia/cublas/lib, nvidia/cu13/lib under Python's site-packages).
#pragma once
#include <cublasLt.h>

#include "turbo/core/dynamic_library.h"

#define PRIMUS_CUBLASLT_FUNCTIONS(X)                                                          \
  X(cublasLtCreate) X(cublasLtMatmul) X(cublasLtMatmulAlgoGetHeuristic)                      \
  X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute) \
  X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy)                               \
  X(cublasLtMatrixLayoutSetAttribute) X(cublasLtMatmulPreferenceCreate)                      \
  X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulPreferenceSetAttribute)                 \
  X(cublasLtMatmulAlgoCheck) X(cublasLtGetVersion)

namespace primus::turbo::cublaslt {

struct CublasLtApi {
  PRIMUS_CUBLASLT_FUNCTIONS(PRIMUS_DL_MEMBER)
};

// The library and its entry points; unavailable_reason() is what the CUBLASLT backend's
// can_handle reports on a machine without it.
ApiTable<CublasLtApi>& library();
// The loaded entry points (loads at the first call; throws the loader's message when missing).
inline const CublasLtApi& lt() { return library().get(); }

}  // namespace primus::turbo::cublaslt
