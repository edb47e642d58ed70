// A trainer run's metrics.jsonl as step -> loss and step -> validation loss (the tests that run
// the cuda trainer end to end compare these).
#pragma once
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace primus::backends::cuda::testing {

struct TrainerMetrics {
  std::map<int64_t, double> loss, val;
};

inline TrainerMetrics read_trainer_metrics(const std::filesystem::path& p) {
  TrainerMetrics m;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) m.loss[j["step"]] = j["loss"];
    if (j.contains("val_loss")) m.val[j["step"]] = j["val_loss"];
  }
  return m;
}

}  // namespace primus::backends::cuda::testing
