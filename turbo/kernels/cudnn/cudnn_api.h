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

#include "turbo/core/dynamic_library.h"

#define PRIMUS_CUDNN_FUNCTIONS(X)                                                                  \
  X(cudnnGetVersion) X(cudnnGetErrorString) X(cudnnGetLastErrorString) X(cudnnCreate)             \
  X(cudnnSetStream) X(cudnnBackendCreateDescriptor) X(cudnnBackendDestroyDescriptor)              \
  X(cudnnBackendSetAttribute) X(cudnnBackendGetAttribute) X(cudnnBackendFinalize)                  \
  X(cudnnBackendExecute)

namespace primus::turbo::cudnn {

struct CudnnApi {
  PRIMUS_CUDNN_FUNCTIONS(PRIMUS_DL_MEMBER)
};

// The library and its entry points; unavailable_reason() is what the CUDNN backend's
// can_handle reports on a machine without it.
ApiTable<CudnnApi>& library();
// The loaded entry points (loads at the first call; throws the loader's message when missing).
inline const CudnnApi& dnn() { return library().get(); }

}  // namespace primus::turbo::cudnn
