// cuDNN, loaded at first use (turbo/core/dynamic_library.h) instead of linked: a CUDA build of
// primus starts and runs everything but the CUDNN backend where libcudnn is absent. The entry
// points of the backend (graph) API that cudnn_graph.cpp and sdpa_cudnn.cpp call are the
// members of CudnnApi, typed from cudnn_graph.h itself (decltype); a function used without
// being listed here fails to compile.
//
// Search: PRIMUS_CUDNN_LIBRARY (a file), the loader's path, /usr/local/cuda/lib64, then
// PyTorch's pip package (nvidia/cudnn/lib under Python's site-packages). libcudnn.so.9 is the
// small front library; it loads its engine libraries from its own folder.
#pragma once
#include <cudnn_graph.h>

#include <string>

#define PRIMUS_CUDNN_FUNCTIONS(X)                                                                  \
  X(cudnnGetVersion) X(cudnnGetErrorString) X(cudnnGetLastErrorString) X(cudnnCreate)             \
  X(cudnnSetStream) X(cudnnBackendCreateDescriptor) X(cudnnBackendDestroyDescriptor)              \
  X(cudnnBackendSetAttribute) X(cudnnBackendGetAttribute) X(cudnnBackendFinalize)                  \
  X(cudnnBackendExecute)

namespace primus::turbo::cudnn {

struct CudnnApi {
#define PRIMUS_CUDNN_MEMBER(f) decltype(&::f) f = nullptr;
  PRIMUS_CUDNN_FUNCTIONS(PRIMUS_CUDNN_MEMBER)
#undef PRIMUS_CUDNN_MEMBER
};

// The loaded entry points. Throws primus::RuntimeError naming the library and every place tried
// when libcudnn cannot be loaded.
const CudnnApi& dnn();

// Empty when cuDNN loads (loading it on the first call), else the message dnn() would throw.
// Never throws: the dispatcher's can_handle asks it.
std::string library_unavailable_reason() noexcept;

// The file it was loaded from ("" when it was not).
std::string library_path();

}  // namespace primus::turbo::cudnn
