#include "report/png_image.h"

#include <fmt/format.h>

#include <cstring>

#include "core/util/error.h"
#include "report/cairo_api.h"

namespace primus::report {

RgbaImage read_png(const std::filesystem::path& path) {
  const CairoApi& c = cairo();
  SurfacePtr s = own(c, c.cairo_image_surface_create_from_png(path.c_str()));
  if (const cairo_status_t st = c.cairo_surface_status(s.get()); st != CAIRO_STATUS_SUCCESS) {
    throw IoError(fmt::format("cannot read '{}' as PNG: {}", path.string(), c.cairo_status_to_string(st)));
  }
  const cairo_format_t format = c.cairo_image_surface_get_format(s.get());
  if (format != CAIRO_FORMAT_ARGB32 && format != CAIRO_FORMAT_RGB24) {
    throw IoError(fmt::format("'{}': a PNG in Cairo format {} (expected ARGB32 or RGB24)", path.string(),
                              static_cast<int>(format)));
  }
  c.cairo_surface_flush(s.get());
  RgbaImage img;
  img.width = c.cairo_image_surface_get_width(s.get());
  img.height = c.cairo_image_surface_get_height(s.get());
  const int stride = c.cairo_image_surface_get_stride(s.get());
  const unsigned char* data = c.cairo_image_surface_get_data(s.get());
  img.pixels.resize(static_cast<size_t>(img.width) * static_cast<size_t>(img.height));
  for (int y = 0; y < img.height; ++y) {
    const unsigned char* row = data + static_cast<ptrdiff_t>(y) * stride;
    for (int x = 0; x < img.width; ++x) {
      uint32_t v = 0;
      std::memcpy(&v, row + 4 * x, 4);
      if (format == CAIRO_FORMAT_RGB24) v |= 0xff000000u;  // the unused byte is undefined
      img.pixels[static_cast<size_t>(y) * static_cast<size_t>(img.width) + static_cast<size_t>(x)] = v;
    }
  }
  return img;
}

}  // namespace primus::report
