// The backends built into this binary: one registration line each. Adding a backend means a
// folder under backends/ and a line here; nothing under core/ changes.
#include "cli/builtin_backends.h"

#if __has_include("backends/reference/register.h")
#include "backends/reference/register.h"
#define PRIMUS_HAS_REFERENCE 1
#endif
#if __has_include("backends/cuda/register.h") && defined(PRIMUS_WITH_CUDA_BACKEND)
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
