// primus generate --checkpoint C (--prompt S ... | --prompts-file F | --prompt-ids 1,2,3 ...)
//                 [--backend cuda|reference] [--max-new-tokens N --temperature T --top-k K --top-p P --seed S]
//                 [--ignore-eod] [--print-ids] [--score]
// primus generate --checkpoint C --bench [--batch 1,8 --prompt-tokens 128 --max-new-tokens 256 --json FILE]
// primus export hf CHECKPOINT OUT/ [--dtype bf16|fp32]
// Checkpoints of every backend share one layout: the CPU reference model (recomputing the window
// per token) and the cuda inference engine (KV cache) both generate from any of them.
#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/command.h"

#ifdef PRIMUS_BACKEND_REFERENCE
#include "backends/reference/export.h"
#include "backends/reference/generate.h"
#include "core/util/error.h"
#include "data/tokenizer/tokenizer.h"
#include "train/checkpointing.h"
#include "train/inference_checkpoint.h"
#include "train/param_init.h"
#include "train/param_layout.h"
#include "train/sampling.h"
#ifdef PRIMUS_BACKEND_CUDA
#include <cuda_runtime_api.h>

#include <chrono>
#include <ctime>

#include "backends/cuda/device.h"
#include "backends/cuda/inference/engine.h"
#include "turbo/dispatch/backend_manager.h"
#endif

// A namespace of its own: the CLI builds as a unity build, where anonymous namespaces of
// different command files share one translation unit.
namespace primus::cli::generate_cmd {
namespace {

struct GenerateOpts {
  std::string checkpoint, prompts_file, backend, json, spec_file;
  std::vector<std::string> prompts, prompt_ids;
  train::SampleOptions sample;
  uint64_t seed = 1234;
  bool score = false, ignore_eod = false, print_ids = false, bench = false;
  std::vector<int64_t> batches{1, 8};
  int64_t prompt_tokens = 128;
};

bool have_gpu() {
#ifdef PRIMUS_BACKEND_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      const long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      throw UsageError(fmt::format("--prompt-ids: '{}' in '{}' is not a token id", item, s));
    }
  }
  if (ids.empty()) throw UsageError(fmt::format("--prompt-ids: '{}' holds no token id", s));
  return ids;
}

#ifdef PRIMUS_BACKEND_CUDA
// Per-token decode time with the KV cache against recomputing the window per token (the same
// engine, use_cache = false), greedy on random prompt ids, end-of-text ignored so that every
// sequence makes all its tokens.
void run_bench(const GenerateOpts& o) {
  const backends::cuda::DeviceInfo dev = backends::cuda::select_device(0);
  train::InferenceCheckpoint c;
  if (!o.spec_file.empty()) {  // a shape without its weights: random ones (the training init)
    std::ifstream in(o.spec_file);
    if (!in) throw IoError(fmt::format("--spec: cannot read {}", o.spec_file));
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
      c.spec = train::spec_from_json(j.contains("model_spec") ? j["model_spec"] : j);
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(fmt::format("--spec {}: not a model_spec JSON ({})", o.spec_file, e.what()));
    }
    const train::ParamLayout layout = train::make_param_layout(c.spec);
    c.params.resize(static_cast<size_t>(layout.total));
    train::init_params(c.spec, layout, o.seed, c.params.data());
    c.dir = o.spec_file + " (random weights)";
  } else {
    c = train::load_inference_checkpoint(o.checkpoint);
  }
  const int64_t bmax = *std::max_element(o.batches.begin(), o.batches.end());
  if (o.prompt_tokens + o.sample.max_new_tokens > c.spec.seq_length)
    throw ConfigError(fmt::format("--bench: --prompt-tokens {} + --max-new-tokens {} exceed the model's seq_length {}",
                                  o.prompt_tokens, o.sample.max_new_tokens, c.spec.seq_length));
  backends::cuda::InferenceEngine engine(c.spec, c.params.data(), bmax);
  // Prefill attention on Turbo's flash kernels where they serve the head dim: cuDNN builds an
  // execution plan per new sequence length, which the window recompute (a new length every step)
  // would pay at every token, flattering the cache's ratio. A user's own choice stands.
  const std::string attention_var = turbo::GlobalBackendManager::env_var_for("attention");
  const bool user_attention = std::getenv(attention_var.c_str()) != nullptr;
  std::string attention = "default (" + attention_var + ")";
  if (const int64_t D = c.spec.head_dim(); !user_attention && (D == 64 || D == 128)) {
    turbo::GlobalBackendManager::instance().set_backend("attention", turbo::BackendType::TURBO);
    attention = "TURBO";
  } else if (!user_attention) {
    attention = "default (cuDNN: a plan per new length)";
  }
  train::SampleOptions so = o.sample;
  so.temperature = 0;
  so.stop_at_eod = false;
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.spec.vocab_size - 1));
  std::ofstream json;
  if (!o.json.empty()) {
    json.open(o.json, std::ios::app);
    if (!json) throw IoError(fmt::format("--json: cannot append to {}", o.json));
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  const std::string commit = current_commit();
  std::printf("decode time per step (a new token for each sequence), %s, %s on %s; prefill attention %s\n",
              c.spec.summary().c_str(), c.dir.string().c_str(), dev.name.c_str(), attention.c_str());
  std::printf("%-6s %-7s %-6s %14s %16s %14s %9s %12s\n", "batch", "prompt", "new", "cache ms/step", "(without graphs)",
              "window ms/step", "ratio", "prefill ms");
  for (int64_t B : o.batches) {
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(B));
    for (auto& p : prompts)
      for (int64_t t = 0; t < o.prompt_tokens; ++t) p.push_back(tok(rng));
    {  // warm-up: plans, autotune, first-touch
      train::SampleOptions w = so;
      w.max_new_tokens = 3;
      backends::cuda::generate(engine, prompts, w, rng, true);
      backends::cuda::generate(engine, prompts, w, rng, false);
    }
    backends::cuda::GenerateStats with, plain, without;
    const bool graphs = engine.graphs();
    engine.set_graphs(false);
    backends::cuda::generate(engine, prompts, so, rng, true, &plain);
    engine.set_graphs(graphs);
    const auto a = backends::cuda::generate(engine, prompts, so, rng, true, &with);
    const auto b = backends::cuda::generate(engine, prompts, so, rng, false, &without);
    // The two paths compute the same function in bf16: report how many tokens agree (near-ties may differ).
    int64_t same = 0, total = 0;
    for (size_t i = 0; i < a.size(); ++i)
      for (size_t j = 0; j < std::min(a[i].size(), b[i].size()); ++j, ++total) same += a[i][j] == b[i][j];
    const double per_cache = with.decode_ms / std::max<int64_t>(1, with.decode_steps);
    const double per_window = without.decode_ms / std::max<int64_t>(1, without.decode_steps);
    const double per_plain = plain.decode_ms / std::max<int64_t>(1, plain.decode_steps);
    const double steps = static_cast<double>(std::max<int64_t>(1, with.decode_steps));
    std::printf("%-6ld %-7ld %-6ld %14.3f %16.3f %14.3f %8.1fx %12.2f   (%ld/%ld tokens equal)\n", static_cast<long>(B),
                static_cast<long>(o.prompt_tokens), static_cast<long>(so.max_new_tokens), per_cache, per_plain, per_window,
                per_window / per_cache, with.prefill_ms, static_cast<long>(same), static_cast<long>(total));
    std::printf("       of the cached step: logits to the host %.3f ms, sampling on the host %.3f ms\n",
                with.decode_copy_ms / steps, with.decode_sample_ms / steps);
    if (json.is_open()) {
      nlohmann::json j;
      j["bench"] = "generate";
      j["case"] = fmt::format("{} L{} C{} H{}/{} V{} batch {} prompt {} new {}", c.spec.model_type, c.spec.num_layers,
                              c.spec.hidden_size, c.spec.num_attention_heads, c.spec.num_query_groups,
                              c.spec.vocab_size, B, o.prompt_tokens, so.max_new_tokens);
      j["device"] = dev.name;
      j["date"] = date;
      j["commit"] = commit;
      j["metric"] = "decode ms per step (one new token for each sequence of the batch)";
      j["ours"] = per_cache;
      j["anchor"] = per_window;
      j["anchor_name"] = "same engine without KV cache (window recomputed per token)";
      j["ratio"] = per_window / per_cache;
      j["prefill_ms"] = with.prefill_ms;
      j["cuda_graphs"] = graphs;
      j["prefill_attention"] = attention;
      j["cache_without_graphs_ms"] = per_plain;
      j["logits_copy_ms"] = with.decode_copy_ms / steps;
      j["sampling_ms"] = with.decode_sample_ms / steps;
      j["tokens_equal"] = same;
      j["tokens"] = total;
      json << j.dump() << "\n";
    }
  }
}
#endif

void run_generate(const GenerateOpts& o) {
  if (o.checkpoint.empty() && !(o.bench && !o.spec_file.empty()))
    throw UsageError("--checkpoint is required (only --bench --spec measures without one)");
  if (o.score) {
    if (o.prompts.size() != 1) throw UsageError("--score takes one --prompt");
    std::cout << fmt::format("{:.8f}", backends::reference::score_checkpoint(o.checkpoint, o.prompts[0])) << "\n";
    return;
  }
  if (o.bench) {
#ifdef PRIMUS_BACKEND_CUDA
    run_bench(o);
    return;
#else
    throw ConfigError("--bench measures the cuda backend's KV cache; this build has no cuda backend");
#endif
  }
  std::string backend = o.backend.empty() ? (have_gpu() ? "cuda" : "reference") : o.backend;
#ifndef PRIMUS_BACKEND_CUDA
  if (backend == "cuda") throw ConfigError("--backend cuda: this build has no cuda backend (use --backend reference)");
#endif
  // Prompts: text (tokenised here) or token ids, in the order given.
  std::vector<std::string> texts = o.prompts;
  if (!o.prompts_file.empty()) {
    std::ifstream in(o.prompts_file);
    if (!in) throw IoError(fmt::format("--prompts-file: cannot read {}", o.prompts_file));
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) texts.push_back(line);
  }
  if (texts.empty() == o.prompt_ids.empty())
    throw UsageError("give prompts as text (--prompt / --prompts-file) or as token ids (--prompt-ids), one of them");
  // Only the tokenizer's name is needed here; the backends load the weights themselves.
  train::InferenceCheckpoint ck = train::load_inference_checkpoint(o.checkpoint);
  std::unique_ptr<data::Tokenizer> tok = data::make_tokenizer(ck.tokenizer);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& t : texts) {
    prompts.push_back(tok->encode(t));
    if (prompts.back().empty()) prompts.back().push_back(tok->eod_id() >= 0 ? tok->eod_id() : 0);
  }
  for (const auto& s : o.prompt_ids) prompts.push_back(parse_ids(s));
  train::SampleOptions so = o.sample;
  so.stop_at_eod = !o.ignore_eod && tok->eod_id() >= 0;
  if (tok->eod_id() >= 0) so.eod_id = tok->eod_id();
  train::check_sample_options(so);
  std::vector<std::vector<int32_t>> out;
  if (backend == "reference") {
    out = backends::reference::generate_ids(o.checkpoint, prompts, so, o.seed);
  } else {
#ifdef PRIMUS_BACKEND_CUDA
    backends::cuda::select_device(0);
    backends::cuda::InferenceEngine engine(ck.spec, ck.params.data(), static_cast<int64_t>(prompts.size()));
    std::mt19937_64 rng(o.seed);
    for (size_t i = 0; i < prompts.size(); ++i)
      for (int32_t t : prompts[i])
        if (t < 0 || t >= ck.spec.vocab_size)
          throw ConfigError(fmt::format("generate: prompt {} has token {} outside the vocabulary [0, {})", i, t,
                                        ck.spec.vocab_size));
    out = backends::cuda::generate(engine, prompts, so, rng, true);
#endif
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (o.print_ids) {
      std::cout << nlohmann::json{{"prompt", i}, {"backend", backend}, {"ids", out[i]}}.dump() << "\n";
      continue;
    }
    if (prompts.size() > 1) std::cout << fmt::format("[{}] ", i);
    std::cout << backends::reference::printable(tok->decode(prompts[i]) + tok->decode(out[i])) << "\n";
  }
}

void setup_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOpts>();
  app.add_option("--checkpoint,-c", o->checkpoint, "Checkpoint folder, or a save folder (its latest)");
  app.add_option("--prompt,-p", o->prompts, "Text to continue (repeat for a batch of prompts)");
  app.add_option("--prompts-file", o->prompts_file, "A file of prompts, one per line (empty lines skipped)");
  app.add_option("--prompt-ids", o->prompt_ids, "A prompt as comma-separated token ids (repeat for a batch)");
  app.add_option("--backend", o->backend, "cuda (KV cache on the GPU) or reference (CPU fp32); default cuda when a GPU is present")
      ->check(CLI::IsMember({"cuda", "reference"}));
  app.add_option("--max-new-tokens,-n", o->sample.max_new_tokens, "Tokens to generate per prompt")->check(CLI::NonNegativeNumber);
  app.add_option("--temperature,-t", o->sample.temperature, "Sampling temperature (0: greedy)")->check(CLI::NonNegativeNumber);
  app.add_option("--top-k,-k", o->sample.top_k, "Sample from the k most likely tokens (0: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", o->sample.top_p,
                 "Sample from the smallest set of most likely tokens whose probability reaches p (after top-k and "
                 "temperature, as transformers; 1: all)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", o->seed, "Sampling seed");
  app.add_flag("--ignore-eod", o->ignore_eod, "Keep generating after the tokenizer's end-of-text token");
  app.add_flag("--print-ids", o->print_ids, "Print each prompt's new token ids as a JSON line instead of text");
  app.add_flag("--score", o->score,
               "Print the mean next-token loss (nats, fp32, reference model) of the prompt instead of generating (e.g. "
               "to compare an `export hf` folder in another framework)");
  app.add_flag("--bench", o->bench,
               "Measure the cuda engine's decode time per token with the KV cache against recomputing the window per "
               "token (greedy, random prompt ids; --batch, --prompt-tokens, --max-new-tokens, --json)");
  app.add_option("--batch", o->batches, "--bench: batch sizes (e.g. 1,8)")->delimiter(',')->check(CLI::PositiveNumber);
  app.add_option("--prompt-tokens", o->prompt_tokens, "--bench: prompt length in tokens")->check(CLI::PositiveNumber);
  app.add_option("--spec", o->spec_file,
                 "--bench: a model spec JSON (trainer_state.json, or its model_spec) measured with random weights "
                 "instead of a checkpoint's (e.g. a 1B shape without writing its checkpoint)");
  app.add_option("--json", o->json, "--bench: append one JSON line per batch size to FILE (DESIGN.md, Measurements)");
  app.callback([o] { run_generate(*o); });
}

void setup_export(CLI::App& app) {
  app.require_subcommand(1);
  struct Opts {
    std::string checkpoint, out, dtype = "bf16";
  };
  auto o = std::make_shared<Opts>();
  CLI::App* hf = app.add_subcommand("hf", "Write a Hugging Face model folder (config.json + model.safetensors)");
  hf->add_option("checkpoint", o->checkpoint, "Checkpoint folder, or a save folder (its latest)")->required();
  hf->add_option("out", o->out, "Output folder")->required();
  hf->add_option("--dtype", o->dtype, "bf16 or fp32")->check(CLI::IsMember({"bf16", "fp32"}));
  hf->callback([o] { backends::reference::export_hf_checkpoint(o->checkpoint, o->out, o->dtype); });
}

CommandRegistrar reg_generate({"generate", "Generate text from a checkpoint", setup_generate});
CommandRegistrar reg_export({"export", "Export a checkpoint (hf)", setup_export});

}  // namespace
}  // namespace primus::cli::generate_cmd
#endif
