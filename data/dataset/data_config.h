// The data component's config and the factory that builds the train and valid iterators from
// it (TorchTitan style: the trainer only assembles what this returns).
//
// data_path follows Megatron-LM's --data-path: one prefix ("out/shakespeare_text"), several
// prefixes (equal weights) or weight/prefix pairs ("0.7", "a", "0.3", "b"). With split < 1
// each dataset's first round(split * documents) documents train and the rest validate; when
// valid_data_path is set, split is not used and data_path trains on all its documents.
// train_data_path / valid_data_path instead name separate data, each a prefix or a
// "0.7 a 0.3 b" string (e.g. the P_train / P_valid of `primus data prepare --split`).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/dataset/batch_iterator.h"

namespace primus::data {

struct DataConfig {
  std::vector<std::string> data_path;
  std::string train_data_path;  // optional; excludes data_path
  std::string valid_data_path;  // optional
  std::string test_data_path;   // optional: the test data (else the split's test part, if any)
  double split = 1.0;           // fraction of data_path documents used for training, (0, 1]
                                // (ignored when valid_data_path is set)
  double valid_end = 1.0;       // validation takes the documents in [split, valid_end); those beyond
                                // (Megatron-LM's test part) are held out
  int seq_length = 1024;        // tokens per sample; each sample holds seq_length + 1 ids
  uint64_t seed = 1234;         // data order; valid data uses seed + 1
  bool mock_data = false;       // pseudo-random tokens instead of files
  int vocab_size = 0;           // > 0: every token read must be below it (required for mock)
};

struct DataIterators {
  std::unique_ptr<BatchIterator> train;
  std::unique_ptr<BatchIterator> valid;  // null when there is no validation data
  // Megatron-LM's test data, evaluated once after the last step: test_data_path, else the
  // documents past valid_end of split data_path; null when neither (and under mock data).
  // Shuffled with the validation data's seed: the same data in both gives the same batches.
  std::unique_ptr<BatchIterator> test;
};

// Builds the iterators for data-parallel rank dp_rank of dp_size. Throws ConfigError for an
// inconsistent config, IoError / FormatError naming the file for missing or corrupt data.
DataIterators build_data_iterators(const DataConfig& config, int dp_rank = 0, int dp_size = 1);

// Parses a Megatron blend list into (weight, prefix) pairs with weights summing to 1.
std::vector<std::pair<double, std::string>> parse_blend(const std::vector<std::string>& list);

}  // namespace primus::data
