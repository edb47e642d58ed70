// The byte tokenizer: id = byte value, vocabulary 256. Useful for tests, for character-level
// models and as a tokenizer that needs no files. Its vocabulary has no room for a separate
// end-of-document token, so documents end with id 0, the NUL byte, which does not occur in
// text (a NUL inside a document would read as a document end; documented in docs/data.md).
#include <fmt/format.h>

#include "core/util/error.h"
#include "data/tokenizer/tokenizer.h"

namespace primus::data {
namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  void encode_into(std::string_view text, std::vector<int32_t>& out) const override {
    out.reserve(out.size() + text.size());
    for (unsigned char b : text) out.push_back(b);
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string s;
    s.reserve(ids.size());
    for (int32_t id : ids) {
      if (id < 0 || id > 255) {
        throw RuntimeError(fmt::format("tokenizer bytes: cannot decode id {}: not in [0, 256)", id));
      }
      s += static_cast<char>(id);
    }
    return s;
  }
  int vocab_size() const override { return 256; }
  int32_t eod_id() const override { return 0; }
  std::string name() const override { return "bytes"; }
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

}  // namespace primus::data
