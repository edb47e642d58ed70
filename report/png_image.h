// A PNG read back through Cairo (the library that writes the reports), for checks of what a
// report drew: its size and the colour of each pixel.
#pragma once
#include <cstdint>
#include <filesystem>
#include <vector>

namespace primus::report {

struct RgbaImage {
  int width = 0, height = 0;
  std::vector<uint32_t> pixels;  // row-major, 0xAARRGGBB (Cairo's ARGB32, premultiplied)
  uint32_t at(int x, int y) const { return pixels[static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)]; }
};

// Throws IoError naming the file when it is not a readable PNG, RuntimeError without Cairo.
RgbaImage read_png(const std::filesystem::path& path);

}  // namespace primus::report
