#include "io/digest_writer.h"

#include <cerrno>
#include <cstring>

#include "core/util/error.h"
#include "io/crc32c.h"

namespace primus::io {

void DigestWriter::write(const void* data, size_t n) {
  if (n == 0) return;
  if (std::fwrite(data, 1, n, f_) != n) {
    throw IoError(fmt::format("short write to '{}' ({} bytes at offset {}): {}", where_, n,
                              digest_.size, std::strerror(errno)));
  }
  digest_.crc32c = crc32c_extend(digest_.crc32c, data, n);
  digest_.size += n;
}

}  // namespace primus::io
