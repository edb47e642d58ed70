#include "report/png_image.h"

#include <fmt/format.h>

#include <cstring>

#include "core/util/error.h"
#include "report/cairo_api.h"

namespace primus::report {

RgbaImage read_png(const std::filesystem::path& path) {
  const CairoApi& c = cairo();
  cairo_surface_t* s = c.cairo_image_surface_create_from_png(path.c_str());
  const cairo_status_t st = c.cairo_surface_status(s);
  if (st != CAIRO_STATUS_SUCCESS) {
    c.cairo_surface_destroy(s);
    throw IoError(fmt::format("cannot read '{}' as PNG: {}", path.string(), c.cairo_status_to_string(st)));
  }
  c.cairo_surface_flush(s);
  RgbaImage img;
  img.width = c.cairo_image_surface_get_width(s);
  img.height = c.cairo_image_surface_get_height(s);
  const int stride = c.cairo_image_surface_get_stride(s);
  const cairo_format_t fmt = c.cairo_image_surface_get_format(s);
  const unsigned char* data = c.cairo_image_surface_get_data(s);
  img.pixels.resize(static_cast<size_t>(img.width) * static_cast<size_t>(img.height));
  for (int y = 0; y < img.height; ++y) {
    const unsigned char* row = data + static_cast<ptrdiff_t>(y) * stride;
    for (int x = 0; x < img.width; ++x) {
      uint32_t v = 0;
      if (fmt == CAIRO_FORMAT_ARGB32 || fmt == CAIRO_FORMAT_RGB24) {
        std::memcpy(&v, row + 4 * x, 4);
        if (fmt == CAIRO_FORMAT_RGB24) v |= 0xff000000u;  // the unused byte is undefined
      } else {
        c.cairo_surface_destroy(s);
        throw IoError(fmt::format("'{}': a PNG in Cairo format {} (expected ARGB32 or RGB24)", path.string(),
                                  static_cast<int>(fmt)));
      }
      img.pixels[static_cast<size_t>(y) * static_cast<size_t>(img.width) + static_cast<size_t>(x)] = v;
    }
  }
  c.cairo_surface_destroy(s);
  return img;
}

}  // namespace primus::report
