#include "turbo/kernels/cublaslt/cublaslt_api.h"

#include <cublas_api.h>

#include "turbo/core/dynamic_library.h"

#define PRIMUS_STR2(x) #x
#define PRIMUS_STR(x) PRIMUS_STR2(x)

namespace primus::turbo::cublaslt {
namespace {

LazyLibrary& library() {
  static LazyLibrary* lib = new LazyLibrary(LibrarySpec{
      "cuBLASLt",
      "libcublasLt.so." PRIMUS_STR(CUBLAS_VER_MAJOR),  // the major version we were compiled against
      "PRIMUS_CUBLASLT_LIBRARY",
      "cublasLtCreate",
      {"/usr/local/cuda/lib64"},
      {"nvidia/cublas/lib", "nvidia/cu" PRIMUS_STR(CUBLAS_VER_MAJOR) "/lib"}});
  return *lib;
}

}  // namespace

const CublasLtApi& lt() {
  static const CublasLtApi* api = [] {
    auto* a = new CublasLtApi();
#define PRIMUS_CUBLASLT_BIND(f) a->f = reinterpret_cast<decltype(a->f)>(library().symbol(#f));
    PRIMUS_CUBLASLT_FUNCTIONS(PRIMUS_CUBLASLT_BIND)
#undef PRIMUS_CUBLASLT_BIND
    return a;
  }();  // a throw leaves the static unset: the next call throws the same message again
  return *api;
}

std::string library_unavailable_reason() noexcept {
  try {
    if (!library().available()) return library().error();
    (void)lt();  // every listed symbol present
    return "";
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "cuBLASLt could not be loaded";
  }
}

std::string library_path() { return library().path(); }

}  // namespace primus::turbo::cublaslt
