// Runs the real build/bin/primus in a shell and captures its exit code and output, so the
// end-to-end tests see what a user sees.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

namespace primus::testing {

struct CliResult {
  int code = -1;
  std::string out;  // stdout and stderr together
};

// The binary: $PRIMUS_BIN (a GPU run unpacks it away from the build), else this build's.
inline std::string primus_binary() {
  if (const char* b = std::getenv("PRIMUS_BIN"); b && *b) return b;
  return std::string(PRIMUS_BINARY_DIR) + "/bin/primus";
}

inline CliResult run_primus(const std::string& args, const std::string& env = "") {
  std::string cmd = env + " OMP_NUM_THREADS=1 " + primus_binary() + " " + args + " 2>&1";
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

class Workdir {
 public:
  Workdir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("primus_e2e_" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~Workdir() { std::filesystem::remove_all(path_); }
  std::filesystem::path write(const std::string& rel, const std::string& text) const {
    auto p = path_ / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p;
  }
  std::string str() const { return path_.string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A fast reference run: a tiny model on tinyshakespeare (bytes), writing under `ws`.
inline std::string tiny_run_args(const std::string& ws) {
  return "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) +
         "/examples/reference/shakespeare.yaml num_layers=1 hidden_size=32 num_attention_heads=2 ffn_hidden_size=64 "
         "seq_length=32 micro_batch_size=4 global_batch_size=8 train_iters=20 eval_interval=10 eval_iters=2 "
         "log_interval=5 sample_tokens=0 save_interval=10 lr_warmup_iters=2 lr_decay_iters=20 workspace=" + ws;
}

}  // namespace primus::testing
