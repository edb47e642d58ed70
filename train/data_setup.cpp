#include "train/data_setup.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/util/error.h"
#include "data/prepare/prepare.h"
#include "io/checkpoint.h"

namespace primus::train {

namespace fsys = std::filesystem;

namespace {

bool is_text_input(const std::string& p) {
  const auto ext = fsys::path(p).extension().string();
  return (ext == ".txt" || ext == ".jsonl" || ext == ".json") && fsys::is_regular_file(p);
}

// train_data_path and test_data_path take prepared .bin/.idx prefixes; only data_path prepares text.
void refuse_text_inputs(const char* key, const std::vector<std::string>& paths) {
  for (const auto& p : paths) {
    if (is_text_input(p)) {
      throw ConfigError(fmt::format("{}: {} is a text input; {} takes prepared .bin/.idx prefixes (a text file goes in "
                                    "data_path, or through `primus data prepare`)",
                                    key, p, key));
    }
  }
}

// A text input is prepared once into <output>/data/<stem>-<tokenizer>_{train,valid}, then reused
// while it is newer than the input.
std::pair<std::string, std::string> prepare_text(const std::string& input, const TrainingArgs& t) {
  std::string tok_tag = t.data.tokenizer;
  for (char& c : tok_tag)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  const fsys::path prefix = t.output_dir / "data" / (fsys::path(input).stem().string() + "-" + tok_tag);
  const std::string train = prefix.string() + "_train", valid = prefix.string() + "_valid";
  const bool fresh = fsys::exists(train + ".idx") && fsys::exists(valid + ".idx") &&
                     fsys::last_write_time(train + ".idx") >= fsys::last_write_time(input);
  if (t.data.valid_end < 1.0) {
    throw ConfigError(fmt::format("split with a test part ({:.4g} of the documents) and the text input {}: a text "
                                  "input is prepared into training and validation documents only; hold the test "
                                  "documents out with `primus data prepare` and a .bin/.idx data_path",
                                  1.0 - t.data.valid_end, input));
  }
  if (!fresh) {
    fsys::create_directories(prefix.parent_path());
    data::PrepareOptions po;
    po.inputs = {input};
    po.tokenizer = t.data.tokenizer;
    po.output_prefix = prefix.string();
    po.split = t.data.split < 1.0 ? t.data.split : 0.95;
    po.progress = false;
    auto r = data::prepare_dataset(po);
    spdlog::info("[data] prepared {} into {}_{{train,valid}} ({} tokens, {:.1f}s)", input, prefix.string(),
                 r.outputs.empty() ? 0 : r.outputs[0].tokens, r.seconds);
  }
  return {train, valid};
}

}  // namespace

data::DataIterators build_data(const TrainingArgs& t, const ModelSpec& spec) {
  data::DataConfig dc;
  dc.seq_length = static_cast<int>(spec.seq_length);
  dc.seed = t.seed;
  dc.mock_data = t.data.mock_data;
  dc.vocab_size = static_cast<int>(spec.vocab_size);
  dc.split = t.data.split;
  dc.valid_end = t.data.valid_end;
  if (!t.data.mock_data) {
    refuse_text_inputs("test_data_path", t.data.test_data_path);
    dc.test_data_path = fmt::format("{}", fmt::join(t.data.test_data_path, " "));
    if (t.data.train_whole) {  // train_data_path: every document trains, validation only from valid_data_path
      refuse_text_inputs("train_data_path", t.data.data_path);
      dc.train_data_path = fmt::format("{}", fmt::join(t.data.data_path, " "));
      dc.valid_data_path = fmt::format("{}", fmt::join(t.data.valid_data_path, " "));
    } else if (t.data.data_path.size() == 1 && is_text_input(t.data.data_path[0])) {
      auto [tr, va] = prepare_text(t.data.data_path[0], t);
      dc.train_data_path = tr;
      dc.valid_data_path = va;
    } else if (!t.data.valid_data_path.empty()) {
      dc.train_data_path = fmt::format("{}", fmt::join(t.data.data_path, " "));
      dc.valid_data_path = fmt::format("{}", fmt::join(t.data.valid_data_path, " "));
    } else {
      dc.data_path = t.data.data_path;
    }
  }
  return data::build_data_iterators(dc, 0, 1);
}

fsys::path checkpoint_in(const fsys::path& load) {
  if (fsys::exists(load / io::kManifestFile)) return load;
  auto latest = io::find_latest(load);
  if (!latest) throw IoError(fmt::format("load: no checkpoint in '{}'", load.string()));
  return latest->dir;
}

fsys::path resume_dir(const CheckpointArgs& c) {
  if (c.auto_continue_train) {
    if (auto latest = io::find_latest(c.save)) return latest->dir;
  }
  // finetune reads only the weights of `load` (load_initial_weights): nothing is resumed.
  if (c.load.empty() || c.finetune) return {};
  const fsys::path dir = checkpoint_in(c.load);
  // `primus import hf` writes weights without optimizer state or data positions: nothing to resume.
  std::ifstream state(dir / io::kStateFile);
  nlohmann::json s = nlohmann::json::parse(state, nullptr, /*allow_exceptions=*/false);
  if (s.is_object() && s.value("weights_only", false)) {
    throw ConfigError(fmt::format("load: {} holds imported weights only (primus import hf), nothing to resume; start "
                                  "from the Hugging Face folder with load_hf: {} instead",
                                  dir.string(), s.value("imported_from", std::string("HF_DIR"))));
  }
  return dir;
}

void check_eod_mask_loss(const DataArgs& d, const data::Tokenizer& tokenizer) {
  if (d.eod_mask_loss && tokenizer.eod_id() < 0) {
    throw ConfigError(fmt::format("eod_mask_loss: tokenizer '{}' has no end-of-document token to mask the loss at",
                                  tokenizer.name()));
  }
}

}  // namespace primus::train
