// The backends built into this binary: one registration line each. Adding a backend means a
// folder under backends/ and a line here; nothing under core/ changes.
#include "cli/builtin_backends.h"

// PRIMUS_BACKEND_<NAME> is defined by cli/CMakeLists.txt for each backend library built.
#ifdef PRIMUS_BACKEND_REFERENCE
#include "backends/reference/register.h"
#define PRIMUS_HAS_REFERENCE 1
#endif
#ifdef PRIMUS_BACKEND_CUDA
#include "backends/cuda/register.h"
#define PRIMUS_HAS_CUDA 1
#endif

namespace primus::cli {

void register_builtin_backends() {
  static bool done = false;
  if (done) return;
  done = true;
#ifdef PRIMUS_HAS_REFERENCE
  backends::reference::register_backend(BackendRegistry::global(), patches::PatchRegistry::global());
#endif
#ifdef PRIMUS_HAS_CUDA
  backends::cuda::register_backend(BackendRegistry::global(), patches::PatchRegistry::global());
#endif
}

}  // namespace primus::cli
