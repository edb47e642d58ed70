// The primus binary has no load-time dependency on cuBLASLt or cuDNN (they are dlopen'ed at first
// use, turbo/core/dynamic_library.h): a CPU-only run must start on a machine without them.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>

namespace {

std::string shell(const std::string& cmd) {
  std::string out;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    std::array<char, 4096> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
    pclose(p);
  }
  return out;
}

}  // namespace

TEST(VendorLibraries, PrimusNeedsNeitherCublasLtNorCudnnToStart) {
  const std::string bin = std::string(PRIMUS_BINARY_DIR) + "/bin/primus";
  const std::string dyn = shell("readelf -d '" + bin + "' 2>/dev/null");
  if (dyn.find("NEEDED") == std::string::npos) GTEST_SKIP() << "readelf unavailable or " << bin << " not an ELF file";
  EXPECT_NE(dyn.find("libc.so"), std::string::npos) << dyn;  // the listing is real
  EXPECT_EQ(dyn.find("libcublas"), std::string::npos) << dyn;
  EXPECT_EQ(dyn.find("libcudnn"), std::string::npos) << dyn;
}
