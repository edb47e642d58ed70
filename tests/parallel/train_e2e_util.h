// Shared by the end-to-end training tests with several ranks (data, tensor parallelism): the
// `primus launch` command line, the run's metrics by step, and the loss comparison they all make.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>

#include "io/checkpoint.h"
#include "io/metrics.h"

namespace primus::testing {

inline std::string launch(int n, const std::string& args, double timeout_s = 20) {
  std::ostringstream s;
  s << "launch --nproc-per-node " << n << " --timeout " << timeout_s << " -- " << args;
  return s.str();
}

inline std::filesystem::path find_file(const std::filesystem::path& root, const std::string& name) {
  for (auto& e : std::filesystem::recursive_directory_iterator(root)) {
    if (e.path().filename() == name) return e.path();
  }
  return {};
}

// step -> value of `key` (loss, val_loss, grad_norm, ...) from the run's metrics.jsonl (only rank 0
// writes it).
inline std::map<int64_t, double> losses(const std::filesystem::path& ws, const std::string& key = "loss") {
  std::map<int64_t, double> out;
  std::filesystem::path m = find_file(ws, "metrics.jsonl");
  EXPECT_FALSE(m.empty()) << "no metrics.jsonl under " << ws;
  if (m.empty()) return out;
  for (auto& j : primus::io::read_jsonl(m)) {
    if (j.contains(key)) out[j["step"].get<int64_t>()] = j[key].get<double>();
  }
  return out;
}

// Every step of `want` from `first` on has a value in `got` within `rel` relative, and no more.
inline void expect_same_losses(const std::map<int64_t, double>& want, const std::map<int64_t, double>& got,
                               const std::string& what, int64_t first = 1, double rel = 1e-5) {
  for (auto& [step, l] : want) {
    if (step < first) continue;
    auto it = got.find(step);
    ASSERT_NE(it, got.end()) << what << ": no value for step " << step;
    EXPECT_NEAR(it->second, l, rel * std::fabs(l)) << what << " step " << step;
  }
  EXPECT_EQ(static_cast<int64_t>(got.size()), static_cast<int64_t>(want.size()) - (first - 1)) << what;
}

// The checkpoint folder of a run (where its tracker file is).
inline std::filesystem::path save_dir(const std::filesystem::path& ws) {
  return find_file(ws, primus::io::kTrackerFile).parent_path();
}

}  // namespace primus::testing
