// primus generate --checkpoint C --prompt S [--max-new-tokens N --temperature T --top-k K --seed S] [--score]
// primus export hf CHECKPOINT OUT/ [--dtype bf16|fp32]
// Checkpoints of every backend share one layout, so the CPU reference model serves both.
#include <fmt/format.h>

#include <iostream>

#include "cli/command.h"

#ifdef PRIMUS_BACKEND_REFERENCE
#include "backends/reference/export.h"
#include "backends/reference/generate.h"

namespace primus::cli {
namespace {

void setup_generate(CLI::App& app) {
  struct Opts {
    std::string checkpoint, prompt;
    backends::reference::SampleOptions sample;
    uint64_t seed = 1234;
    bool score = false;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--checkpoint,-c", o->checkpoint, "Checkpoint folder, or a save folder (its latest)")->required();
  app.add_option("--prompt,-p", o->prompt, "Text to continue")->required();
  app.add_option("--max-new-tokens,-n", o->sample.max_new_tokens, "Tokens to generate")->check(CLI::NonNegativeNumber);
  app.add_option("--temperature,-t", o->sample.temperature, "Sampling temperature (0: greedy)")->check(CLI::NonNegativeNumber);
  app.add_option("--top-k,-k", o->sample.top_k, "Sample from the k most likely tokens (0: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", o->seed, "Sampling seed");
  app.add_flag("--score", o->score,
               "Print the mean next-token loss (nats, fp32) of the prompt instead of generating (e.g. to compare an "
               "`export hf` folder in another framework)");
  app.callback([o] {
    if (o->score) {
      std::cout << fmt::format("{:.8f}", backends::reference::score_checkpoint(o->checkpoint, o->prompt)) << "\n";
      return;
    }
    std::cout << backends::reference::generate_from_checkpoint(o->checkpoint, o->prompt, o->sample, o->seed) << "\n";
  });
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
}  // namespace primus::cli
#endif
