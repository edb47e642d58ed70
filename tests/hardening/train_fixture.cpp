#include "train_fixture.h"

#include <unistd.h>

#include <atomic>
#include <bit>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace primus::hardening {

ModelSize ModelSize::tiny() {
  return {{"num_layers=1", "hidden_size=32", "num_attention_heads=2", "ffn_hidden_size=64", "seq_length=32",
           "micro_batch_size=4", "global_batch_size=4"}};
}
ModelSize ModelSize::small() {
  return {{"num_layers=2", "hidden_size=128", "num_attention_heads=4", "ffn_hidden_size=512", "seq_length=64",
           "micro_batch_size=8", "global_batch_size=8"}};
}
ModelSize ModelSize::medium() {
  return {{"num_layers=2", "hidden_size=256", "num_attention_heads=4", "ffn_hidden_size=1024", "seq_length=64",
           "micro_batch_size=8", "global_batch_size=8"}};
}

void HardeningTest::SetUp() {
  static std::atomic<int> counter{0};
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "_" + info->name();
  for (char& c : name)
    if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  dir_ = fsys::temp_directory_path() /
         ("primus_hardening_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + "_" + name);
  fsys::remove_all(dir_);
  fsys::create_directories(dir_);
}

void HardeningTest::TearDown() {
  std::error_code ec;
  if (!HasFailure()) fsys::remove_all(dir_, ec);  // kept for a look when the test failed
}

std::vector<std::string> train_args(const fsys::path& workspace, const TrainOptions& o) {
  std::vector<std::string> a = {"train", "pretrain", "--config",
                                std::string(PRIMUS_SOURCE_DIR) + "/examples/reference/shakespeare.yaml"};
  a.insert(a.end(), o.model.overrides.begin(), o.model.overrides.end());
  for (std::string kv : {"eval_interval=0", "sample_tokens=0", "log_interval=1", "keep_last_k=3", "lr_warmup_iters=4"}) {
    a.push_back(kv);
  }
  a.push_back("workspace=" + workspace.string());
  a.push_back("train_iters=" + std::to_string(o.iters));
  a.push_back("lr_decay_iters=" + std::to_string(o.decay_iters));
  a.push_back("save_interval=" + std::to_string(o.save_interval));
  a.insert(a.end(), o.extra.begin(), o.extra.end());
  return a;
}

fsys::path output_dir(const fsys::path& workspace) { return workspace / "local" / "local" / "shakespeare"; }
fsys::path save_dir(const fsys::path& workspace) { return output_dir(workspace) / "checkpoints"; }

std::vector<std::pair<int64_t, double>> read_losses(const fsys::path& workspace) {
  std::vector<std::pair<int64_t, double>> out;
  std::ifstream in(output_dir(workspace) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.emplace_back(j["step"].get<int64_t>(), j["loss"].get<double>());
  }
  return out;
}

std::map<std::string, std::string> snapshot(const fsys::path& dir) {
  std::map<std::string, std::string> files;
  for (auto& e : fsys::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    files[fsys::relative(e.path(), dir).string()] = ss.str();
  }
  return files;
}

std::map<int64_t, double> reference_losses(const fsys::path& workspace, const TrainOptions& o) {
  auto r = run_primus(train_args(workspace, o));
  EXPECT_TRUE(r.status.exited && r.status.code == 0) << r.status.describe() << "\n" << r.output;
  std::map<int64_t, double> losses;
  for (auto [step, loss] : read_losses(workspace)) {
    EXPECT_EQ(losses.count(step), 0u) << "step " << step << " twice in an uninterrupted run";
    losses[step] = loss;
  }
  EXPECT_EQ(losses.size(), static_cast<size_t>(o.iters));
  return losses;
}

void expect_losses_match(const fsys::path& workspace, const std::map<int64_t, double>& reference,
                         int64_t last_step) {
  std::set<int64_t> seen;
  for (auto [step, loss] : read_losses(workspace)) {
    seen.insert(step);
    auto it = reference.find(step);
    ASSERT_NE(it, reference.end()) << "step " << step << " is not in the reference run";
    EXPECT_EQ(std::bit_cast<uint64_t>(loss), std::bit_cast<uint64_t>(it->second))
        << "step " << step << ": loss " << loss << " vs " << it->second << " uninterrupted";
  }
  for (int64_t s = 1; s <= last_step; ++s) EXPECT_TRUE(seen.count(s)) << "step " << s << " is missing";
}

}  // namespace primus::hardening
