#include "train/inference_checkpoint.h"

#include <fmt/format.h>

#include "core/util/error.h"
#include "io/checkpoint.h"
#include "train/checkpointing.h"
#include "train/param_layout.h"

namespace primus::train {

InferenceCheckpoint load_inference_checkpoint(const std::string& checkpoint) {
  std::filesystem::path dir = checkpoint;
  if (!std::filesystem::exists(dir / io::kManifestFile)) {
    auto latest = io::find_latest(dir);
    if (!latest) throw IoError(fmt::format("no checkpoint in '{}'", checkpoint));
    dir = latest->dir;
  }
  io::CheckpointData data = io::load_checkpoint(dir);
  if (!data.state.contains("model_spec") || !data.state.contains("tokenizer"))
    throw FormatError(fmt::format("checkpoint {}: trainer_state.json lacks model_spec/tokenizer", dir.string()));
  InferenceCheckpoint c;
  c.dir = dir;
  c.spec = spec_from_json(data.state["model_spec"]);
  c.tokenizer = checkpoint_tokenizer(data.state["tokenizer"].get<std::string>(), dir);
  const ParamLayout layout = make_param_layout(c.spec);
  c.params.assign(static_cast<size_t>(layout.total), 0.0f);
  unpack_checkpoint(data, dir, c.spec, layout, c.params.data(), nullptr, nullptr);
  return c;
}

std::string checkpoint_tokenizer(const std::string& recorded, const std::filesystem::path& dir) {
  const std::filesystem::path p = recorded;
  std::error_code ec;
  if (recorded == "gpt2" || recorded == "bytes") return recorded;  // make_tokenizer's built-in names
  if (!recorded.empty() && p.is_relative() && std::filesystem::exists(dir / p, ec)) return (dir / p).string();
  return recorded;
}

}  // namespace primus::train
