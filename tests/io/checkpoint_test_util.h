// Helpers shared by the checkpoint tests: random checkpoint contents and a deep comparison.
#pragma once
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include "io/checkpoint.h"
#include "io_test_util.h"

namespace primus::io::testing {

class CheckpointTest : public TempDirTest {
 protected:
  std::filesystem::path save_dir() const { return dir() / "ckpt"; }

  // A GPT-2-like set of fp32 tensors (HF names) plus Adam moments, about `floats` values each.
  CheckpointData make_data(int64_t iteration, size_t floats = 1000) {
    CheckpointData d;
    for (const char* name : {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight",
                             "transformer.ln_f.bias"}) {
      d.model[name] = TensorBlob::from_vector<float>({static_cast<int64_t>(floats / 10), 10},
                                                      random_floats(floats / 10 * 10));
      for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
        d.optimizer[fmt::format("{}.{}", name, moment)] =
            TensorBlob::from_vector<float>({static_cast<int64_t>(floats)}, random_floats(floats));
      }
    }
    d.optimizer["step"] = TensorBlob::from_vector<int64_t>({}, {iteration});
    d.state = {{"iteration", iteration},
               {"rng", {{"seed", 1234}, {"offset", rng_()}}},
               {"data", {{"epoch", 0}, {"sample", iteration * 64}}},
               {"config", {{"lr", 6e-4}, {"model", "gpt2"}}}};
    return d;
  }

  static void expect_same(const std::map<std::string, TensorBlob>& a,
                          const std::map<std::string, TensorBlob>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [name, blob] : a) {
      auto it = b.find(name);
      ASSERT_NE(it, b.end()) << name;
      EXPECT_EQ(it->second.dtype(), blob.dtype()) << name;
      EXPECT_EQ(it->second.shape(), blob.shape()) << name;
      ASSERT_EQ(it->second.nbytes(), blob.nbytes()) << name;
      EXPECT_EQ(std::memcmp(it->second.data(), blob.data(), blob.nbytes()), 0) << name;
    }
  }
  static void expect_same(const CheckpointData& a, const CheckpointData& b) {
    expect_same(a.model, b.model);
    expect_same(a.optimizer, b.optimizer);
    EXPECT_EQ(a.state, b.state);
  }

  std::string tracker() const { return read_bytes(save_dir() / kTrackerFile); }

  // Names in save_dir() starting with `prefix`.
  std::vector<std::string> entries(const std::string& prefix = "") const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(save_dir())) {
      auto n = e.path().filename().string();
      if (n.starts_with(prefix)) out.push_back(n);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // Runs `body` in a child process and returns its wait status. The child never returns into
  // the test framework.
  static int run_child(const std::function<void()>& body) {
    std::fflush(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      try {
        body();
        ::_exit(0);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child: %s\n", e.what());
        ::_exit(1);
      }
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return status;
  }
};

}  // namespace primus::io::testing
