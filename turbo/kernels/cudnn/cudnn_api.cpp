#include "turbo/kernels/cudnn/cudnn_api.h"

#include <cudnn_version.h>

#include "turbo/core/dynamic_library.h"

#define PRIMUS_STR2(x) #x
#define PRIMUS_STR(x) PRIMUS_STR2(x)

namespace primus::turbo::cudnn {
namespace {

LazyLibrary& library() {
  static LazyLibrary* lib = new LazyLibrary(LibrarySpec{
      "cuDNN",
      "libcudnn.so." PRIMUS_STR(CUDNN_MAJOR),  // the major version we were compiled against
      "PRIMUS_CUDNN_LIBRARY",
      "cudnnBackendCreateDescriptor",
      {"/usr/local/cuda/lib64"},
      {"nvidia/cudnn/lib"}});
  return *lib;
}

}  // namespace

const CudnnApi& dnn() {
  static const CudnnApi* api = [] {
    auto* a = new CudnnApi();
#define PRIMUS_CUDNN_BIND(f) a->f = reinterpret_cast<decltype(a->f)>(library().symbol(#f));
    PRIMUS_CUDNN_FUNCTIONS(PRIMUS_CUDNN_BIND)
#undef PRIMUS_CUDNN_BIND
    return a;
  }();  // a throw leaves the static unset: the next call throws the same message again
  return *api;
}

std::string library_unavailable_reason() noexcept {
  try {
    if (!library().available()) return library().error();
    (void)dnn();  // every listed symbol present
    return "";
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "cuDNN could not be loaded";
  }
}

std::string library_path() { return library().path(); }

}  // namespace primus::turbo::cudnn
