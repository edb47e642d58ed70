#include "report/cairo_api.h"

#include <dlfcn.h>

#include "core/util/error.h"

namespace primus::report {
namespace {

void bind_cairo(turbo::LazyLibrary& lib, CairoApi& api) { PRIMUS_CAIRO_FUNCTIONS(PRIMUS_DL_BIND) }

turbo::ApiTable<CairoApi>& cairo_table() {
  // libcairo.so.2 has been the soname since Cairo 1.0; the Debian/Ubuntu package is libcairo2.
  static turbo::ApiTable<CairoApi> table(
      turbo::LibrarySpec{"Cairo", "libcairo.so.2", "PRIMUS_CAIRO_LIBRARY", "cairo_create", {}, {}}, bind_cairo);
  return table;
}

}  // namespace

const CairoApi& cairo() {
  auto& t = cairo_table();
  if (std::string why = t.unavailable_reason(); !why.empty()) {
    throw RuntimeError("Cairo is not available (install libcairo2 to draw reports): " + why);
  }
  return t.get();
}

std::string cairo_unavailable_reason() { return cairo_table().unavailable_reason(); }

void release_cairo_caches() {
  cairo().cairo_debug_reset_static_data();
  // fontconfig is Cairo's dependency, not ours: reached only when Cairo already loaded it.
  if (void* fc = dlopen("libfontconfig.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) {
    if (auto fini = reinterpret_cast<void (*)()>(dlsym(fc, "FcFini"))) fini();
    dlclose(fc);
  }
}

}  // namespace primus::report
