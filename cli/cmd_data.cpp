// primus data prepare | encode | inspect: tokenize corpora into Megatron indexed datasets,
// try a tokenizer on a string, and look inside a prepared dataset. See docs/data.md.
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "data/dataset/indexed_dataset.h"
#include "data/prepare/prepare.h"
#include "data/tokenizer/tokenizer.h"

namespace primus::cli {
namespace {

void setup_prepare(CLI::App& data) {
  auto o = std::make_shared<data::PrepareOptions>();
  auto split = std::make_shared<double>(0);
  auto quiet = std::make_shared<bool>(false);
  CLI::App* p = data.add_subcommand("prepare", "Tokenize text / JSON lines into .bin/.idx (Megatron format)");
  p->add_option("--input", o->inputs, "Input files: text (one document per line) or .jsonl/.json")
      ->required()
      ->expected(1, -1);
  p->add_option("--json-key", o->json_key, "Key of the document text in JSON records")->capture_default_str();
  p->add_option("--tokenizer", o->tokenizer, "gpt2, bytes, or a path to a tokenizer.json")->required();
  p->add_option("--output-prefix", o->output_prefix, "Writes PREFIX.bin/.idx (or PREFIX_train/_valid)")
      ->required();
  CLI::Option* split_opt =
      p->add_option("--split", *split, "Fraction of documents for PREFIX_train; the rest go to PREFIX_valid")
          ->check(CLI::Range(0.0, 1.0));
  p->add_option("--workers", o->workers, "Encoding threads")->capture_default_str()->check(CLI::PositiveNumber);
  p->add_flag("--quiet", *quiet, "No progress lines on stderr");
  p->callback([o, split, split_opt, quiet] {
    if (split_opt->count() > 0) o->split = *split;
    o->progress = !*quiet;
    auto r = data::prepare_dataset(*o);
    for (auto& out : r.outputs) {
      std::cout << fmt::format("wrote {}.bin/.idx: {} documents, {} tokens ({})\n", out.prefix,
                               out.documents, out.tokens, r.dtype);
    }
    std::cout << fmt::format("{:.1f} MB in {:.2f} s ({:.2f} MB/s, {} worker{})\n", r.input_bytes / 1e6,
                             r.seconds, r.input_bytes / 1e6 / std::max(r.seconds, 1e-9), o->workers,
                             o->workers == 1 ? "" : "s");
  });
}

void setup_encode(CLI::App& data) {
  struct Opts {
    std::string tokenizer, text;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* e = data.add_subcommand("encode", "Print the token ids of a text as a JSON array");
  e->add_option("--tokenizer", o->tokenizer, "gpt2, bytes, or a path to a tokenizer.json")->required();
  e->add_option("--text", o->text, "The text to encode")->required();
  e->callback([o] {
    auto tok = data::make_tokenizer(o->tokenizer);
    std::cout << nlohmann::json(tok->encode(o->text)).dump() << "\n";
  });
}

void setup_inspect(CLI::App& data) {
  struct Opts {
    std::string prefix, tokenizer;
    int show = 3;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* i = data.add_subcommand("inspect", "Summarise a .bin/.idx dataset and show its first documents");
  i->add_option("prefix", o->prefix, "Dataset prefix (PREFIX.bin, PREFIX.idx)")->required();
  i->add_option("--show", o->show, "Documents to print")->capture_default_str()->check(CLI::NonNegativeNumber);
  i->add_option("--tokenizer", o->tokenizer, "Decode the documents and check every id against its vocabulary");
  i->callback([o] {
    data::IndexedDataset ds(o->prefix);
    uint64_t docs = ds.document_count();
    uint64_t min_len = UINT64_MAX, max_len = 0;
    for (uint64_t d = 0; d < docs; ++d) {
      uint64_t n = ds.document_length(d);
      min_len = std::min(min_len, n);
      max_len = std::max(max_len, n);
    }
    std::cout << fmt::format("dataset    {}\n", o->prefix);
    std::cout << fmt::format("dtype      {}\n", data::dtype_name(ds.dtype()));
    std::cout << fmt::format("documents  {}\n", docs);
    std::cout << fmt::format("sequences  {}\n", ds.sequence_count());
    std::cout << fmt::format("tokens     {}\n", ds.total_tokens());
    if (docs > 0) {
      std::cout << fmt::format("per doc    min {}, mean {:.1f}, max {}\n", min_len,
                               static_cast<double>(ds.total_tokens()) / static_cast<double>(docs), max_len);
    }
    std::unique_ptr<data::Tokenizer> tok;
    if (!o->tokenizer.empty()) {
      tok = data::make_tokenizer(o->tokenizer);
      ds.check_token_range(tok->vocab_size());
      std::cout << fmt::format("token ids  all below the vocabulary size of {} ({})\n", tok->vocab_size(),
                               tok->name());
    }
    for (uint64_t d = 0; d < std::min<uint64_t>(docs, static_cast<uint64_t>(o->show)); ++d) {
      std::vector<int32_t> ids(ds.document_length(d));
      uint64_t at = 0;
      for (auto s = static_cast<uint64_t>(ds.document_index(d)); s < static_cast<uint64_t>(ds.document_index(d + 1)); ++s) {
        ds.read(s, 0, static_cast<uint64_t>(ds.sequence_length(s)), ids.data() + at);
        at += static_cast<uint64_t>(ds.sequence_length(s));
      }
      std::cout << fmt::format("\ndocument {} ({} tokens)\n  ids  {}\n", d, ids.size(), nlohmann::json(ids).dump());
      if (tok) {
        // JSON-quoted so that newlines and control characters stay visible.
        std::cout << "  text " << nlohmann::json(tok->decode(ids)).dump(-1, ' ', false,
                                                                         nlohmann::json::error_handler_t::replace)
                  << "\n";
      }
    }
  });
}

void setup_data(CLI::App& app) {
  app.require_subcommand(1);
  setup_prepare(app);
  setup_encode(app);
  setup_inspect(app);
}

CommandRegistrar reg_data({"data", "Prepare, encode and inspect training data", setup_data});

}  // namespace
}  // namespace primus::cli
