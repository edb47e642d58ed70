// Fuzzes the Hugging Face tokenizer.json loader (model, vocabulary, merges, pre-tokenizer,
// decoder, added tokens, tokenizer_config.json's eos_token) and then encodes and decodes with
// whatever it accepted.
//
// Input: tokenizer.json, optionally followed by a line "~~~~" and tokenizer_config.json, and by
// another "~~~~" line and a text to encode.
#include "data/tokenizer/tokenizer.h"
#include "fuzz/fuzz_target.h"

PRIMUS_FUZZ_TARGET(tokenizer_json) {
  static const primus::fuzz::Scratch dir("tokenizer_json");
  dir.clear();
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto parts = primus::fuzz::split_parts(in, "\n~~~~\n", 3);
  auto path = dir.write("tokenizer.json", parts[0]);
  if (parts.size() > 1) dir.write("tokenizer_config.json", parts[1]);
  std::string_view text = parts.size() > 2 ? parts[2] : std::string_view("Hello world, <|endoftext|> 123 'll");

  primus::fuzz::refuse_only_with_primus_errors([&] {
    auto tok = primus::data::make_hf_tokenizer(path);
    const int vocab = tok->vocab_size();
    if (vocab <= 0) primus::fuzz::finding("a tokenizer was built with an empty vocabulary");
    if (tok->eod_id() >= vocab) primus::fuzz::finding("eod_id outside the vocabulary");
    (void)tok->name();
    std::vector<int32_t> ids = tok->encode(text);
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab) primus::fuzz::finding("encode produced id " + std::to_string(id) + " outside the vocabulary");
    }
    (void)tok->decode(ids);  // every id encode produced must decode
    // Decoding arbitrary ids is refused with an error, never read out of bounds.
    for (int32_t id : {-1, 0, vocab - 1, vocab, INT32_MAX}) {
      primus::fuzz::refuse_only_with_primus_errors([&] { (void)tok->decode(std::span<const int32_t>(&id, 1)); });
    }
  });
}
