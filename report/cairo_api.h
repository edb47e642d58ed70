// Cairo's entry points, loaded with dlopen at first use instead of linked: the CUDA build of
// primus is carried to GPU machines that have no Cairo, and a training run there must still start
// (its end-of-run report then becomes a warning). Where Cairo is installed (libcairo2, no -dev
// package needed) the report works the same. $PRIMUS_CAIRO_LIBRARY names a file to load instead.
#pragma once
#include <cairo-pdf.h>
#include <cairo-svg.h>
#include <cairo.h>

#include <memory>
#include <string>

#include "turbo/core/dynamic_library.h"

namespace primus::report {

#define PRIMUS_CAIRO_FUNCTIONS(X)                                                                        \
  X(cairo_image_surface_create) X(cairo_image_surface_create_from_png) X(cairo_image_surface_get_width)  \
  X(cairo_image_surface_get_height) X(cairo_image_surface_get_stride) X(cairo_image_surface_get_data)    \
  X(cairo_image_surface_get_format) X(cairo_svg_surface_create_for_stream)                              \
  X(cairo_pdf_surface_create_for_stream) X(cairo_surface_write_to_png_stream) X(cairo_surface_finish) X(cairo_surface_flush) X(cairo_surface_status)   \
  X(cairo_surface_destroy) X(cairo_create) X(cairo_destroy) X(cairo_status) X(cairo_status_to_string)    \
  X(cairo_save) X(cairo_restore) X(cairo_set_source_rgb) X(cairo_set_source_rgba) X(cairo_set_line_width) \
  X(cairo_set_line_join) X(cairo_set_dash) X(cairo_move_to) X(cairo_line_to) X(cairo_rectangle)          \
  X(cairo_arc) X(cairo_stroke) X(cairo_fill) X(cairo_paint) X(cairo_clip) X(cairo_new_path)               \
  X(cairo_translate) X(cairo_rotate) X(cairo_select_font_face) X(cairo_set_font_size) X(cairo_show_text) \
  X(cairo_text_extents) X(cairo_debug_reset_static_data)

struct CairoApi {
  PRIMUS_CAIRO_FUNCTIONS(PRIMUS_DL_MEMBER)
};

// Throws RuntimeError "Cairo is not available: ..." naming every place tried.
const CairoApi& cairo();

// Cairo objects owned like any other pointer; their destroy functions come from the loaded library.
template <class T>
struct CairoDestroy {
  void (*destroy)(T*) = nullptr;
  void operator()(T* p) const {
    if (p) destroy(p);
  }
};
using SurfacePtr = std::unique_ptr<cairo_surface_t, CairoDestroy<cairo_surface_t>>;
using ContextPtr = std::unique_ptr<cairo_t, CairoDestroy<cairo_t>>;
inline SurfacePtr own(const CairoApi& c, cairo_surface_t* s) { return SurfacePtr(s, {c.cairo_surface_destroy}); }
inline ContextPtr own(const CairoApi& c, cairo_t* cr) { return ContextPtr(cr, {c.cairo_destroy}); }
// Empty when Cairo loads with every entry point above; else why not. Never throws.
std::string cairo_unavailable_reason();

// Frees what Cairo and fontconfig cache for the life of the process (font faces, patterns, the
// font configuration). A report is drawn once per process, so nothing is lost, and a leak
// checker then sees no memory left behind (ASan's LeakSanitizer reports fontconfig's patterns
// otherwise, which fails every sanitizer test that trains). No Cairo object may be alive.
void release_cairo_caches();

}  // namespace primus::report
