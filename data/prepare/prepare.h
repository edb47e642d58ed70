// `primus data prepare`: tokenize text into Megatron indexed datasets. Each document gets the
// tokenizer's end-of-document id appended. With `split`, documents are dealt to P_train and
// P_valid by a fixed rule: with v = 1 - split (in millionths), document i is validation when
// floor((i+1)v) > floor(iv), so validation documents are evenly spread and the first n
// documents hold exactly floor(n·v) of them (split 0.9: documents 9, 19, 29, ...). Without
// `split` all go to P. Workers encode chunks of documents in parallel; output order is input order, so
// the result does not depend on the number of workers.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace primus::data {

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string json_key = "text";
  std::string tokenizer = "gpt2";  // make_tokenizer spec
  std::string output_prefix;
  std::optional<double> split;  // training fraction in (0, 1)
  int workers = 1;
  bool progress = true;  // a progress line on stderr about every second
};

struct PreparedOutput {
  std::string prefix;
  uint64_t documents = 0;
  uint64_t tokens = 0;
};

struct PrepareResult {
  std::vector<PreparedOutput> outputs;
  std::string dtype;
  uint64_t input_bytes = 0;
  double seconds = 0;
};

// Throws ConfigError for bad options, IoError / FormatError naming the file for bad inputs.
PrepareResult prepare_dataset(const PrepareOptions& options);

// The split rule above: is document i a validation document?
bool is_validation_document(uint64_t i, double split);

}  // namespace primus::data
