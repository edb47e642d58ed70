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

#include <string>

#define PRIMUS_CUBLASLT_FUNCTIONS(X)                                                          \
  X(cublasLtCreate) X(cublasLtMatmul) X(cublasLtMatmulAlgoGetHeuristic)                      \
  X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute) \
  X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy)                               \
  X(cublasLtMatrixLayoutSetAttribute) X(cublasLtMatmulPreferenceCreate)                      \
  X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulPreferenceSetAttribute)

namespace primus::turbo::cublaslt {

struct CublasLtApi {
#define PRIMUS_CUBLASLT_MEMBER(f) decltype(&::f) f = nullptr;
  PRIMUS_CUBLASLT_FUNCTIONS(PRIMUS_CUBLASLT_MEMBER)
#undef PRIMUS_CUBLASLT_MEMBER
};

// The loaded entry points. Throws primus::RuntimeError naming the library and every place tried
// when libcublasLt cannot be loaded.
const CublasLtApi& lt();

// Empty when cuBLASLt loads (loading it on the first call), else the message lt() would throw.
// Never throws: the dispatcher's can_handle asks it.
std::string library_unavailable_reason() noexcept;

// The file it was loaded from ("" when it was not).
std::string library_path();

}  // namespace primus::turbo::cublaslt
