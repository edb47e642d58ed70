#include "io/crc32c.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace {

using namespace primus::io;

// Published check values for CRC-32C (RFC 3720 appendix B.4 and the common "check" value).
TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xff), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<unsigned char>(i);
  for (int i = 0; i < 32; ++i) dec[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c(dec.data(), 32), 0x113FDB5Cu);
}

// The portable (slicing-by-8) and SSE4.2 paths agree on every length and misalignment, and
// extending in pieces equals one pass.
TEST(Crc32c, PathsAgreeAndExtendComposes) {
  std::mt19937 rng(std::random_device{}());
  std::vector<unsigned char> buf(4096 + 16);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t start = 0; start < 9; ++start) {
    for (size_t len : {0, 1, 7, 8, 9, 15, 63, 64, 65, 1000, 4096}) {
      uint32_t ref = crc32c_extend_portable(0, buf.data() + start, len);
      uint32_t hw;
      if (crc32c_extend_hw(0, buf.data() + start, len, &hw)) {
        EXPECT_EQ(hw, ref) << len;
      }
      EXPECT_EQ(crc32c(buf.data() + start, len), ref);
      size_t cut = len / 3;
      uint32_t split = crc32c_extend(crc32c(buf.data() + start, cut), buf.data() + start + cut,
                                     len - cut);
      EXPECT_EQ(split, ref) << "start " << start << " len " << len;
    }
  }
}

TEST(Crc32c, MaskRoundTripsAndMatchesDefinition) {
  std::mt19937 rng(std::random_device{}());
  for (int i = 0; i < 1000; ++i) {
    uint32_t c = rng();
    uint32_t m = crc32c_mask(c);
    EXPECT_EQ(m, ((c >> 15) | (c << 17)) + 0xa282ead8u);
    EXPECT_EQ(crc32c_unmask(m), c);
  }
}

}  // namespace
