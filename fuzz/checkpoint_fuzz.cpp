// Fuzzes loading a training checkpoint the way `load=` and `primus generate` do: the tracker and
// manifest, both safetensors files and trainer_state.json, then unpacking the tensors into a tiny
// GPT-2's parameter layout (Hugging Face names, dtypes, shapes, the saved model description).
//
// Input: model.safetensors, a line "~~~~", optimizer.safetensors, "~~~~", trainer_state.json,
// optionally "~~~~" and manifest.json. Without a manifest the harness writes a correct one
// (sizes and CRC-32C of the files as given), so mutations reach the parsers behind the checksum.
// The seeds are a real checkpoint of the model below, written by the CLI (fuzz/make_seeds.py).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "fuzz/fuzz_target.h"
#include "io/checkpoint.h"
#include "io/crc32c.h"
#include "train/checkpointing.h"
#include "train/param_layout.h"

namespace {

// The model the seeds were saved for (examples/reference/shakespeare.yaml with num_layers=1
// hidden_size=4 num_attention_heads=1 ffn_hidden_size=8 seq_length=4).
primus::train::ModelSpec tiny_gpt2() {
  primus::train::ModelSpec m;
  m.model_type = "gpt2";
  m.vocab_size = m.padded_vocab_size = 256;
  m.seq_length = 4;
  m.num_layers = 1;
  m.hidden_size = 4;
  m.num_attention_heads = m.num_query_groups = 1;
  m.ffn_hidden_size = 8;
  return m;
}

}  // namespace

PRIMUS_FUZZ_TARGET(checkpoint) {
  using namespace primus;
  static const fuzz::Scratch dir("checkpoint");
  static const train::ModelSpec spec = tiny_gpt2();
  static const train::ParamLayout layout = train::make_param_layout(spec);
  dir.clear();
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto parts = fuzz::split_parts(in, "\n~~~~\n", 4);
  parts.resize(4);
  const auto ck = io::checkpoint_dir(dir.path(), 3);
  const auto sub = ck.filename().string() + "/";
  const char* names[] = {io::kModelFile, io::kOptimizerFile, io::kStateFile};
  nlohmann::json manifest = {{"format", "primus.checkpoint"}, {"version", 1}, {"iteration", 3},
                             {"checksum", "crc32c"}, {"files", nlohmann::json::object()}};
  for (int i = 0; i < 3; ++i) {
    dir.write(sub + names[i], parts[i]);
    manifest["files"][names[i]] = {{"size", parts[i].size()},
                                   {"crc32c", fmt::format("{:08x}", io::crc32c(parts[i]))}};
  }
  dir.write(sub + io::kManifestFile, in.find("\n~~~~\n") != std::string_view::npos && !parts[3].empty()
                                         ? std::string(parts[3])
                                         : manifest.dump());
  dir.write(io::kTrackerFile, "3");

  fuzz::refuse_only_with_primus_errors([&] {
    auto latest = io::find_latest(dir.path());
    io::CheckpointData d = io::load_checkpoint(ck);
    std::vector<float> params(static_cast<size_t>(layout.total)), m(params.size()), v(params.size());
    train::unpack_checkpoint(d, ck, spec, layout, params.data(), m.data(), v.data());
    (void)d.state.dump();
    (void)latest;
  });
}
