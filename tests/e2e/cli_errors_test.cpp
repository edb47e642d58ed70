// Bad input through the real binary: each case is one clear message, exit code 2, no trace.
#include <gtest/gtest.h>

#include "cli_runner.h"

using primus::testing::run_primus;
using primus::testing::Workdir;

namespace {

void expect_clean_error(const primus::testing::CliResult& r, int code, std::initializer_list<std::string> parts) {
  EXPECT_EQ(r.code, code) << r.out;
  for (auto& p : parts) EXPECT_NE(r.out.find(p), std::string::npos) << "missing '" << p << "' in:\n" << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("Aborted"), std::string::npos) << r.out;
}

std::string exp_yaml(const std::string& overrides, const std::string& framework = "reference") {
  return "modules:\n  pre_trainer:\n    framework: " + framework +
         "\n    config: pretrain.yaml\n    model: gpt2/tiny.yaml\n    overrides:\n      mock_data: true\n" + overrides;
}

}  // namespace

TEST(CliErrors, MissingConfigFile) {
  expect_clean_error(run_primus("train pretrain --config /nonexistent/exp.yaml"), 2,
                     {"primus: error:", "/nonexistent/exp.yaml", "not found"});
}

TEST(CliErrors, YamlSyntaxErrorHasFileLineColumn) {
  Workdir w;
  auto p = w.write("bad.yaml", "modules:\n  pre_trainer: {framework: reference\n");
  expect_clean_error(run_primus("train pretrain --config " + p.string()), 2, {"bad.yaml:", "YAML syntax error"});
}

TEST(CliErrors, UnknownKeyWithSuggestion) {
  Workdir w;
  auto p = w.write("e.yaml", exp_yaml("      trian_iters: 5\n"));
  expect_clean_error(run_primus("train pretrain --config " + p.string()), 2,
                     {"e.yaml:8:", "unknown key 'trian_iters'", "did you mean 'train_iters'"});
  expect_clean_error(run_primus("train pretrain --config " + p.string() + " --dry-run"), 2, {"trian_iters"});
}

TEST(CliErrors, UnsetVariable) {
  Workdir w;
  auto p = w.write("e.yaml", "exp_name: ${PRIMUS_SURELY_UNSET_VAR}\n" + exp_yaml(""));
  expect_clean_error(run_primus("train pretrain --config " + p.string()), 2,
                     {"e.yaml:1:", "PRIMUS_SURELY_UNSET_VAR", "not set"});
}

TEST(CliErrors, ExtendsCycle) {
  Workdir w;
  w.write("a.yaml", "extends: b.yaml\n");
  w.write("b.yaml", "extends: a.yaml\n");
  expect_clean_error(run_primus("train pretrain --config " + (w.path() / "a.yaml").string()), 2, {"extends cycle"});
}

TEST(CliErrors, UnknownBackendListsKnownOnes) {
  Workdir w;
  auto p = w.write("e.yaml", exp_yaml("", "megatron"));
  expect_clean_error(run_primus("train pretrain --config " + p.string()), 2, {"unknown backend 'megatron'", "reference"});
}

TEST(CliErrors, UnknownPatchIdInPrimusPatches) {
  Workdir w;
  auto p = w.write("e.yaml", exp_yaml(""));
  expect_clean_error(run_primus("train pretrain --config " + p.string(), "PRIMUS_PATCHES=reference.args.grad_acum"), 2,
                     {"PRIMUS_PATCHES", "reference.args.grad_acum", "did you mean 'reference.args.grad_accum'"});
}

TEST(CliErrors, WrongTypeForAKey) {
  Workdir w;
  auto p = w.write("e.yaml", exp_yaml("      train_iters: lots\n"));
  expect_clean_error(run_primus("train pretrain --config " + p.string()), 2,
                     {"e.yaml:8:", "train_iters", "expects an integer", "lots"});
  expect_clean_error(run_primus("train pretrain --config " + p.string() + " train_iters=12 micro_batch_size=0"), 2,
                     {"command line", "micro_batch_size", "out of range"});
}

TEST(CliErrors, BadOverrideSyntaxIsAUsageError) {
  Workdir w;
  auto p = w.write("e.yaml", exp_yaml(""));
  expect_clean_error(run_primus("train pretrain --config " + p.string() + " just_a_word"), 2, {"key=value"});
}

TEST(Cli, DryRunPrintsThePlanAndRunsNothing) {
  Workdir w;
  auto p = w.write("e.yaml", "workspace: " + w.str() + "/ws\n" + exp_yaml("      global_batch_size: 16\n"));
  auto r = run_primus("train pretrain --config " + p.string() + " --dry-run micro_batch_size=4");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[build_args] apply reference.args.mock_data: condition true (mock_data=true)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[setup] skip  reference.runtime.num_threads"), std::string::npos) << r.out;
  // What the build_args patches change, as the trainer would get it: 16 / 4 micro-batches.
  const size_t set = r.out.find("backend args set by build_args patches:");
  ASSERT_NE(set, std::string::npos) << r.out;
  EXPECT_NE(r.out.find("grad_accum_steps: 1 -> 4", set), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("data: (empty) -> mock", set), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[patches:build_args]"), std::string::npos) << "the plan above says it; not logged again\n" << r.out;
  EXPECT_NE(r.out.find("Dry run: nothing was run."), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(w.path() / "ws"));
  // A build_args patch that refuses the config fails the dry run as it would fail the run.
  auto bad = run_primus("train pretrain --config " + p.string() + " --dry-run micro_batch_size=5");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("global_batch_size 16 is not a multiple of micro_batch_size 5"), std::string::npos) << bad.out;
}

TEST(Cli, ConfigShowExplainNamesEveryLayer) {
  Workdir w;
  auto p = w.write("e.yaml", exp_yaml("      lr: 0.01\n"));
  auto r = run_primus("config show --config " + p.string() + " --explain seed=7");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("lr: 0.01"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("e.yaml:8:11  (overrides"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("trainer_base.yaml:5:5"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("seed: 7"), std::string::npos);
  EXPECT_NE(r.out.find("<command line: seed=7>"), std::string::npos);
  EXPECT_NE(r.out.find("hidden_size: 64"), std::string::npos);  // from the model preset
  auto j = run_primus("config show --config " + p.string() + " --format json");
  EXPECT_EQ(j.code, 0);
  EXPECT_NE(j.out.find("\"framework\": \"reference\""), std::string::npos) << j.out;
}

TEST(Cli, PatchesListAndShow) {
  Workdir w;
  auto p = w.write("e.yaml", exp_yaml("      num_threads: 2\n"));
  auto r = run_primus("patches list --backend reference --config " + p.string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("| Patch | What it does | Patch logic | Code location | How to enable | Applies with this config |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("`reference.runtime.num_threads`"), std::string::npos);
  EXPECT_NE(r.out.find("yes: condition true (num_threads=2)"), std::string::npos) << r.out;
  auto j = run_primus("patches list --format json");
  EXPECT_EQ(j.code, 0);
  EXPECT_NE(j.out.find("\"id\": \"reference.args.grad_accum\""), std::string::npos) << j.out;
  auto s = run_primus("patches show reference.args.mock_data");
  EXPECT_EQ(s.code, 0) << s.out;
  EXPECT_NE(s.out.find("## Porting to another framework"), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("train/common_patches.cpp:"), std::string::npos);
  expect_clean_error(run_primus("patches show reference.nope"), 2, {"unknown patch id"});
}

TEST(CliErrors, UnknownLogLevelIsAUsageError) {
  auto r = run_primus("backends", "PRIMUS_LOG_LEVEL=loud");
  expect_clean_error(r, 2, {"PRIMUS_LOG_LEVEL=loud", "debug"});
}

// A key set in two layers is never overwritten silently: one info line names every such key,
// and PRIMUS_LOG_LEVEL=debug gives both places of each.
TEST(CliErrors, KeysSetInTwoLayersAreNamedAndDebugGivesBothPlaces) {
  Workdir w;
  auto p = w.write("e.yaml", "workspace: " + w.str() + "/ws\n" + exp_yaml("      train_iters: 1\n      eval_interval: 0\n      tokenizer_type: bytes\n"));
  auto r = run_primus("train pretrain --config " + p.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("key(s) set in more than one layer"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" train_iters"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("overrides"), std::string::npos) << r.out;
  auto d = run_primus("train pretrain --config " + p.string(), "PRIMUS_LOG_LEVEL=debug");
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("train_iters = 1 (" + p.string()), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("overrides 1000"), std::string::npos) << d.out;
}

// Megatron-LM's model keys that Primus' own names replace or that have one implemented value: a
// Megatron-style model section trains as written (swiglu becomes activation, with its place),
// and each value no backend implements is refused naming the key and its line.
TEST(Cli, MegatronModelKeysCarryOverAndUnimplementedValuesAreNamed) {
  Workdir w;
  const std::string megatron =
      "      normalization: RMSNorm\n      position_embedding_type: rope\n      swiglu: true\n"
      "      group_query_attention: true\n      num_attention_heads: 4\n      num_query_groups: 2\n"
      "      attention_dropout: 0.0\n      hidden_dropout: 0.0\n      add_bias_linear: false\n";
  auto exp = w.write("megatron.yaml", exp_yaml(megatron));
  auto show = run_primus("config show --config " + exp.string() + " --explain");
  EXPECT_EQ(show.code, 0) << show.out;
  EXPECT_NE(show.out.find("activation: swiglu"), std::string::npos) << show.out;
  EXPECT_NE(show.out.find("megatron.yaml:10:"), std::string::npos) << show.out;  // swiglu's line
  EXPECT_EQ(show.out.find("\nswiglu:"), std::string::npos) << show.out;
  auto dry = run_primus("train pretrain --config " + exp.string() + " --dry-run workspace=" + w.str());
  EXPECT_EQ(dry.code, 0) << dry.out;
  EXPECT_NE(dry.out.find("activation: gelu ("), std::string::npos) << dry.out;  // the preset's, overridden
  EXPECT_NE(dry.out.find("-> swiglu (" + exp.string() + ":10:"), std::string::npos) << dry.out;
  expect_clean_error(run_primus("train pretrain --config " + exp.string() + " --dry-run hidden_dropout=0.1"), 2,
                     {"hidden_dropout 0.1: dropout is not implemented"});
  auto drop = w.write("drop.yaml", exp_yaml("      attention_dropout: 0.1\n"));
  expect_clean_error(run_primus("train pretrain --config " + drop.string() + " --dry-run"), 2,
                     {"drop.yaml:8:", "attention_dropout 0.1: dropout is not implemented"});
  auto gqa = w.write("gqa.yaml", exp_yaml("      group_query_attention: true\n"));
  expect_clean_error(run_primus("train pretrain --config " + gqa.string() + " --dry-run"), 2,
                     {"gqa.yaml:8:", "group_query_attention: true needs num_query_groups"});
  auto mha = w.write("mha.yaml", exp_yaml("      num_attention_heads: 4\n      num_query_groups: 2\n"
                                          "      group_query_attention: false\n"));
  expect_clean_error(run_primus("train pretrain --config " + mha.string() + " --dry-run"), 2,
                     {"mha.yaml:10:", "group_query_attention: false with num_query_groups 2", "mha.yaml:9:"});
  EXPECT_EQ(run_primus("train pretrain --config " + exp.string() + " --dry-run max_position_embeddings=131072").code, 0);
  expect_clean_error(run_primus("train pretrain --config " + exp.string() + " --dry-run max_position_embeddings=64"), 2,
                     {"seq_length 128", "exceeds max_position_embeddings 64"});
  auto learned = w.write("learned.yaml", exp_yaml("      max_position_embeddings: 1024\n"));
  expect_clean_error(run_primus("train pretrain --config " + learned.string() + " --dry-run"), 2,
                     {"learned.yaml:8:", "max_position_embeddings 1024 with learned positions"});
  EXPECT_EQ(run_primus("train pretrain --config " + learned.string() + " --dry-run seq_length=1024").code, 0);
  auto both = w.write("both.yaml", exp_yaml("      swiglu: true\n      activation: gelu\n"));
  expect_clean_error(run_primus("train pretrain --config " + both.string() + " --dry-run"), 2,
                     {"both.yaml:8:", "swiglu: true means activation: swiglu", "both.yaml:9:"});
}

// Megatron-LM's `split: train,valid,test` weights: normalised; a text input (prepared into
// training and validation documents only) takes them without a test part and refuses one by name.
TEST(Cli, MegatronSplitWeights) {
  Workdir w;
  const std::string run = primus::testing::tiny_run_args(w.str()) + " train_iters=2 eval_interval=2 save_interval=0 "
                          "save_at_end=false";
  auto ok = run_primus(run + " split=95,5,0");
  EXPECT_EQ(ok.code, 0) << ok.out;
  auto slash = run_primus(run + " split=95/5 exp_name=slash");
  EXPECT_EQ(slash.code, 0) << slash.out;
  expect_clean_error(run_primus(run + " split=90,5,5 exp_name=test"), 2,
                     {"split with a test part (0.05 of the documents)", "primus data prepare"});
  expect_clean_error(run_primus(run + " split=95,x exp_name=bad"), 2,
                     {"<command line: split=95,x>", "split '95,x'", "train,valid,test"});
  auto spaced = run_primus(run + " 'split=95, 5, 0' exp_name=spaced");
  EXPECT_EQ(spaced.code, 0) << spaced.out;
  // A quoted fraction is one part, which would train on every document: refused, not taken.
  expect_clean_error(run_primus(run + " \"split='0.9'\" exp_name=quoted"), 2, {"split '0.9'", "two or three parts"});
}
