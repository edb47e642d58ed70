// Fuzzes the Megatron .idx/.bin reader (header, counts, lengths, pointers, document indices
// against both file sizes) and the GPT sample index built on it (document order, samples that
// span documents and epochs).
//
// Input: byte 0: vocabulary size selector and sequence length; bytes 1-4: the .idx size N
// (little-endian, clamped); then N bytes of .idx and the rest is the .bin.
#include <algorithm>
#include <cstring>

#include "data/dataset/gpt_dataset.h"
#include "data/dataset/indexed_dataset.h"
#include "fuzz/fuzz_target.h"

PRIMUS_FUZZ_TARGET(indexed_dataset) {
  using namespace primus::data;
  static const primus::fuzz::Scratch dir("indexed_dataset");
  if (size < 5) return;
  const uint8_t ctl = data[0];
  uint32_t idx_size = 0;
  std::memcpy(&idx_size, data + 1, 4);
  data += 5;
  size -= 5;
  idx_size = static_cast<uint32_t>(std::min<size_t>(idx_size, size));
  std::string prefix = (dir.path() / "ds").string();
  dir.write("ds.idx", std::string_view(reinterpret_cast<const char*>(data), idx_size));
  dir.write("ds.bin", std::string_view(reinterpret_cast<const char*>(data) + idx_size, size - idx_size));

  static const int64_t kVocab[] = {0, 1, 256, 50257};
  const int64_t vocab = kVocab[ctl & 3];
  const int seq_length = 1 + (ctl >> 2);  // 1..64
  primus::fuzz::refuse_only_with_primus_errors([&] {
    auto ds = std::make_shared<const IndexedDataset>(prefix);
    uint64_t tokens = 0;
    std::vector<int32_t> buf;
    for (uint64_t s = 0; s < ds->sequence_count(); ++s) {
      auto len = static_cast<uint64_t>(ds->sequence_length(s));
      buf.resize(len);
      primus::fuzz::refuse_only_with_primus_errors([&] { ds->read(s, 0, len, buf.data(), vocab); });
      tokens += len;
    }
    if (tokens != ds->total_tokens()) primus::fuzz::finding("total_tokens disagrees with the lengths");
    uint64_t doc_tokens = 0;
    for (uint64_t d = 0; d < ds->document_count(); ++d) doc_tokens += ds->document_length(d);
    if (doc_tokens != tokens) primus::fuzz::finding("document lengths do not add up to the tokens");
    primus::fuzz::refuse_only_with_primus_errors([&] { ds->check_token_range(vocab); });

    if (ds->document_count() == 0) return;
    GptDataset gpt(ds, 0, ds->document_count(), seq_length, /*seed=*/ctl, vocab);
    std::vector<int32_t> sample(static_cast<size_t>(seq_length) + 1);
    for (uint64_t i = 0; i < 8; ++i) gpt.sample(i * 7919, sample.data());
    (void)gpt.describe().dump();
  });
}
