// Megatron-LM's tokenizer_model for HuggingFaceTokenizer: a local folder or tokenizer.json, else a
// Hub id found offline in the Hugging Face cache (the snapshot refs/main names, else one that has
// a tokenizer.json), else an error that names what was looked for.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

#include "core/util/error.h"
#include "data/tokenizer/tokenizer.h"
#include "tests/core/test_util.h"

using primus::data::resolve_hf_tokenizer_model;
namespace fsys = std::filesystem;

namespace {
void touch(const fsys::path& p, const std::string& text = "{}") {
  fsys::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

// Sets an environment variable for the scope, restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::optional<std::string>& value) : name_(name) {
    if (const char* v = std::getenv(name)) old_ = v;
    if (value) ::setenv(name, value->c_str(), 1); else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1); else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

std::string error_of(const std::string& model) {
  try {
    resolve_hf_tokenizer_model(model);
  } catch (const primus::ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(HfTokenizerModel, LocalFolderOrFile) {
  primus::testing::TempDir dir;
  touch(dir.path() / "tok/tokenizer.json");
  EXPECT_EQ(resolve_hf_tokenizer_model((dir.path() / "tok").string()), dir.path() / "tok/tokenizer.json");
  EXPECT_EQ(resolve_hf_tokenizer_model((dir.path() / "tok/tokenizer.json").string()),
            dir.path() / "tok/tokenizer.json");
  fsys::create_directories(dir.path() / "empty");
  EXPECT_NE(error_of((dir.path() / "empty").string()).find("holds no tokenizer.json"), std::string::npos);
}

TEST(HfTokenizerModel, HubIdFromTheCacheAsTransformersFindsIt) {
  primus::testing::TempDir dir;
  const fsys::path repo = dir.path() / "hub/models--meta-llama--Llama-3.1-8B";
  touch(repo / "snapshots/aaa/tokenizer.json");
  touch(repo / "snapshots/bbb/tokenizer.json");
  touch(repo / "refs/main", "bbb\n");
  {
    ScopedEnv cache("HF_HUB_CACHE", (dir.path() / "hub").string());
    EXPECT_EQ(resolve_hf_tokenizer_model("meta-llama/Llama-3.1-8B"), repo / "snapshots/bbb/tokenizer.json");
    fsys::remove(repo / "refs/main");
    EXPECT_EQ(resolve_hf_tokenizer_model("meta-llama/Llama-3.1-8B"), repo / "snapshots/aaa/tokenizer.json");
    const std::string e = error_of("Qwen/Qwen3-8B");
    EXPECT_NE(e.find("tokenizer_model 'Qwen/Qwen3-8B'"), std::string::npos) << e;
    EXPECT_NE(e.find((dir.path() / "hub").string()), std::string::npos) << e;
    EXPECT_NE(e.find("huggingface-cli download Qwen/Qwen3-8B"), std::string::npos) << e;
  }
  {
    ScopedEnv cache("HF_HUB_CACHE", std::nullopt);
    ScopedEnv home("HF_HOME", dir.path().string());
    EXPECT_EQ(resolve_hf_tokenizer_model("meta-llama/Llama-3.1-8B"), repo / "snapshots/aaa/tokenizer.json");
  }
  EXPECT_NE(error_of("no-such-thing").find("no such folder or file"), std::string::npos);
}
