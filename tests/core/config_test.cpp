#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>

#include "core/config/experiment.h"
#include "core/config/yaml_loader.h"
#include "test_util.h"

using namespace primus;
using namespace primus::config;
using primus::testing::expect_error;
using primus::testing::TempDir;

namespace {
LoadOptions env_of(std::map<std::string, std::string> vars) {
  LoadOptions o;
  o.env = [vars](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
  return o;
}
}  // namespace

TEST(ConfigLoader, TypesPlainScalarsAndKeepsQuotedStrings) {
  Value v = parse_yaml_text("a: 12\nb: 3.5e-4\nc: true\nd: ~\ne: '12'\nf: hello\ng: -7\nh: 1e3\n", "t.yaml");
  EXPECT_EQ(v.find("a")->as_int(), 12);
  EXPECT_DOUBLE_EQ(v.find("b")->as_double(), 3.5e-4);
  EXPECT_TRUE(v.find("c")->as_bool());
  EXPECT_TRUE(v.find("d")->is_null());
  EXPECT_EQ(v.find("e")->kind(), Value::Kind::String);
  EXPECT_EQ(v.find("e")->as_string(), "12");
  EXPECT_EQ(v.find("f")->as_string(), "hello");
  EXPECT_EQ(v.find("g")->as_int(), -7);
  EXPECT_EQ(v.find("h")->kind(), Value::Kind::Float);
}

TEST(ConfigLoader, OriginsAreFileLineColumn) {
  Value v = parse_yaml_text("a: 1\nnested:\n  b: 2\n", "x.yaml");
  EXPECT_EQ(v.find("a")->origin().str(), "x.yaml:1:4");
  EXPECT_EQ(v.find_path("nested.b")->origin().str(), "x.yaml:3:6");
}

TEST(ConfigLoader, InterpolatesWithDefaultsAndTypesTheResult) {
  auto opts = env_of({{"STEPS", "250"}, {"NAME", "run"}});
  Value v = parse_yaml_text("a: ${STEPS}\nb: ${MISSING:0.5}\nc: pre-${NAME}-post\nd: ${MISSING:}\n", "t", opts);
  EXPECT_EQ(v.find("a")->as_int(), 250);
  EXPECT_DOUBLE_EQ(v.find("b")->as_double(), 0.5);
  EXPECT_EQ(v.find("c")->as_string(), "pre-run-post");
  EXPECT_TRUE(v.find("d")->is_null());
}

TEST(ConfigLoader, UnsetVariableIsAnErrorNamingPlaceAndVariable) {
  expect_error<ConfigError>([] { parse_yaml_text("x: 1\ny: ${NOPE_NOT_SET}\n", "f.yaml", env_of({})); },
                            {"f.yaml:2:4", "NOPE_NOT_SET", "not set"});
}

TEST(ConfigLoader, YamlSyntaxErrorHasLineAndColumn) {
  TempDir d;
  auto p = d.write("bad.yaml", "a: 1\nb: [1, 2\nc: 3\n");
  std::string msg = expect_error<ConfigError>([&] { load_yaml_file(p); }, {"bad.yaml:", "YAML syntax error"});
  EXPECT_NE(msg.find(":3:"), std::string::npos) << msg;
}

TEST(ConfigLoader, MissingFileIsNamed) {
  expect_error<ConfigError>([] { load_yaml_file("/no/such/dir/exp.yaml"); }, {"/no/such/dir/exp.yaml", "not found"});
}

TEST(ConfigLoader, DuplicateKeyInOneMappingIsAnError) {
  expect_error<ConfigError>([] { parse_yaml_text("lr: 1\nsteps: 2\nlr: 3\n", "d.yaml"); },
                            {"d.yaml:3", "'lr'", "twice", "line 1"});
}

TEST(ConfigLoader, ExtendsScalarAndListMergeInOrderAndReportOverrides) {
  TempDir d;
  d.write("base/a.yaml", "lr: 1.0\nsteps: 10\nopt:\n  beta1: 0.9\n  beta2: 0.95\n");
  d.write("base/b.yaml", "extends: a.yaml\nsteps: 20\n");
  d.write("c.yaml", "warmup: 5\nsteps: 30\n");
  auto top = d.write("top.yaml", "extends: [base/b.yaml, c.yaml]\nopt:\n  beta2: 0.99\n");
  std::vector<OverrideNote> notes;
  LoadOptions o;
  o.notes = &notes;
  Value v = load_yaml_file(top, o);
  EXPECT_EQ(v.find("steps")->as_int(), 30);
  EXPECT_EQ(v.find("warmup")->as_int(), 5);
  EXPECT_DOUBLE_EQ(v.find_path("opt.beta1")->as_double(), 0.9);
  EXPECT_DOUBLE_EQ(v.find_path("opt.beta2")->as_double(), 0.99);
  EXPECT_FALSE(v.find("extends"));
  // steps: a.yaml -> b.yaml -> c.yaml; both overrides are reported with both places.
  int steps_notes = 0;
  for (auto& n : notes) {
    if (n.key == "steps") {
      ++steps_notes;
      EXPECT_NE(n.earlier.file, n.later.file);
    }
  }
  EXPECT_EQ(steps_notes, 2);
  ASSERT_EQ(v.find("steps")->overridden().size(), 2u);
  EXPECT_NE(v.find("steps")->overridden()[0].file.find("a.yaml"), std::string::npos);
  EXPECT_NE(v.find("steps")->origin().file.find("c.yaml"), std::string::npos);
}

TEST(ConfigLoader, ExtendsCycleIsDetected) {
  TempDir d;
  d.write("a.yaml", "extends: b.yaml\nx: 1\n");
  d.write("b.yaml", "extends: [c.yaml]\n");
  d.write("c.yaml", "extends: a.yaml\n");
  expect_error<ConfigError>([&] { load_yaml_file(d.path() / "a.yaml"); }, {"extends cycle", "a.yaml", "b.yaml", "c.yaml"});
}

TEST(ConfigLoader, MissingExtendedFileNamesTheExtender) {
  TempDir d;
  auto p = d.write("a.yaml", "extends: gone.yaml\n");
  expect_error<ConfigError>([&] { load_yaml_file(p); }, {"gone.yaml", "extended from", "a.yaml"});
}

TEST(CliOverrides, ParsesAllForms) {
  auto o = parse_cli_overrides({"train_iters=5", "--lr", "3e-4", "--optimizer.beta2=0.99", "name='007'",
                                "data_path=[0.3, a, 0.7, b]", "--use-flash", "true"});
  ASSERT_EQ(o.size(), 6u);
  EXPECT_EQ(o[0].key, "train_iters");
  EXPECT_EQ(o[0].value.as_int(), 5);
  EXPECT_EQ(o[1].key, "lr");
  EXPECT_DOUBLE_EQ(o[1].value.as_double(), 3e-4);
  EXPECT_EQ(o[2].key, "optimizer.beta2");
  EXPECT_EQ(o[3].value.as_string(), "007");
  ASSERT_TRUE(o[4].value.is_list());
  EXPECT_EQ(o[4].value.items().size(), 4u);
  EXPECT_EQ(o[5].key, "use_flash");
  EXPECT_TRUE(o[5].value.as_bool());
  EXPECT_NE(o[0].value.origin().str().find("command line"), std::string::npos);
}

TEST(CliOverrides, RejectsMalformed) {
  EXPECT_THROW(parse_cli_overrides({"novalue"}), UsageError);
  EXPECT_THROW(parse_cli_overrides({"--dangling"}), UsageError);
  EXPECT_THROW(parse_cli_overrides({"a..b=1"}), UsageError);
}

class ExperimentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    d_.write("configs/models/tiny.yaml", "num_layers: 2\nhidden_size: 64\nlr: 0.1\n");
    d_.write("configs/modules/dummy/base.yaml", "train_iters: 100\n");
    d_.write("configs/modules/dummy/pretrain.yaml", "extends: base.yaml\nlr: 0.01\nglobal_batch_size: 16\n");
    schema_.integer("train_iters", 10, "steps", 0)
        .number("lr", 1e-3, "learning rate", 0.0)
        .integer("global_batch_size", 8, "batch", 1)
        .integer("micro_batch_size", 2, "micro batch", 1)
        .integer("num_layers", 1, "layers", 1)
        .integer("hidden_size", 8, "width", 1)
        .text("optimizer", "adamw", "optimizer", {"adamw", "sgd"})
        .flag("use_flash", false, "flash attention")
        .any("extra", KeyType::Map, "free-form");
    paths_.roots = {d_.path() / "configs"};
  }
  std::filesystem::path exp(const std::string& overrides) {
    return d_.write("exp.yaml",
                    "work_group: team\nuser_name: ${PRIMUS_TEST_USER:alice}\nexp_name: e1\nworkspace: /tmp/ws\n"
                    "modules:\n  pre_trainer:\n    framework: dummy\n    config: pretrain.yaml\n"
                    "    model: tiny.yaml\n    overrides:\n" + overrides);
  }
  ModuleConfig resolve(const std::string& overrides, std::vector<std::string> cli = {}) {
    auto e = load_experiment(exp(overrides), parse_cli_overrides(cli), {}, paths_);
    return resolve_module(e, "pre_trainer", schema_, {}, paths_);
  }
  TempDir d_;
  Schema schema_;
  ConfigPaths paths_;
};

TEST_F(ExperimentTest, LayersMergeModelThenModuleThenOverridesThenCli) {
  auto m = resolve("      micro_batch_size: 4\n      train_iters: 200\n", {"train_iters=300"});
  EXPECT_EQ(m.params.find("num_layers")->as_int(), 2);          // model preset
  EXPECT_DOUBLE_EQ(m.params.find("lr")->as_double(), 0.01);     // module preset beats model
  EXPECT_EQ(m.params.find("micro_batch_size")->as_int(), 4);    // experiment override
  EXPECT_EQ(m.params.find("train_iters")->as_int(), 300);       // command line wins
  EXPECT_EQ(m.params.find("optimizer")->as_string(), "adamw");  // schema default
  EXPECT_EQ(m.params.find("optimizer")->origin().str(), "<schema default>");
  // train_iters was set by base.yaml, the experiment and the command line: all places kept.
  const Value* ti = m.params.find("train_iters");
  ASSERT_EQ(ti->overridden().size(), 2u);
  EXPECT_NE(ti->overridden()[0].file.find("base.yaml"), std::string::npos);
  EXPECT_NE(ti->overridden()[1].file.find("exp.yaml"), std::string::npos);
  EXPECT_NE(ti->origin().str().find("command line"), std::string::npos);
  int lr_notes = 0;
  for (auto& n : m.notes) lr_notes += n.key == "lr";
  EXPECT_EQ(lr_notes, 1);
  EXPECT_EQ(m.layers.size(), 4u);
}

TEST_F(ExperimentTest, ExperimentFieldsInterpolateAndOutputDirIsBuilt) {
  auto e = load_experiment(exp("      lr: 0.2\n"), parse_cli_overrides({"exp_name=e2"}), {}, paths_);
  EXPECT_EQ(e.user_name, "alice");
  EXPECT_EQ(e.exp_name, "e2");
  EXPECT_EQ(e.output_dir(), std::filesystem::path("/tmp/ws/team/alice/e2"));
}

TEST_F(ExperimentTest, UnknownKeyNamesFileLineAndSuggestion) {
  std::string msg = expect_error<ConfigError>([&] { resolve("      lr: 0.2\n      trian_iters: 5\n"); },
                                              {"exp.yaml:12:", "unknown key 'trian_iters'", "did you mean 'train_iters'"});
}

// A config brought from another framework (here Primus' logging key and Megatron-LM's checkpoint
// format) names every key that does not carry over in one error, each with its place, in order.
TEST_F(ExperimentTest, EveryUnknownKeyIsNamedAtOnce) {
  const std::string msg = expect_error<ConfigError>(
      [&] { resolve("      wandb_project: p\n      lr: 0.2\n      ckpt_format: null\n      trian_iters: 5\n"); },
      {"3 unknown keys:", "exp.yaml:11:", "unknown key 'wandb_project'", "exp.yaml:13:", "unknown key 'ckpt_format'",
       "exp.yaml:14:", "did you mean 'train_iters'"});
  EXPECT_LT(msg.find("wandb_project"), msg.find("ckpt_format"));
  EXPECT_LT(msg.find("ckpt_format"), msg.find("trian_iters"));
}

// null means unset: a key set to null (as Primus' Megatron-LM configs write the keys they leave
// alone) takes its default, where the typed accessors would otherwise meet a null.
TEST_F(ExperimentTest, NullTakesTheDefault) {
  auto m = resolve("      train_iters: null\n");
  ASSERT_NE(m.params.find("train_iters"), nullptr);
  EXPECT_EQ(m.params.find("train_iters")->as_int(), 10);  // the schema's default, not an earlier layer's value
}

TEST_F(ExperimentTest, UnknownKeyFromCommandLine) {
  expect_error<ConfigError>([&] { resolve("      lr: 0.2\n", {"--micro_bach_size", "3"}); },
                            {"command line", "micro_bach_size", "did you mean 'micro_batch_size'"});
}

TEST_F(ExperimentTest, WrongTypeAndRangeAndChoice) {
  expect_error<ConfigError>([&] { resolve("      train_iters: many\n"); }, {"exp.yaml:11:", "train_iters", "expects an integer"});
  expect_error<ConfigError>([&] { resolve("      lr: -1\n"); }, {"lr", "out of range"});
  expect_error<ConfigError>([&] { resolve("      optimizer: lion\n"); }, {"optimizer", "not one of", "adamw"});
  expect_error<ConfigError>([&] { resolve("      use_flash: 3\n"); }, {"use_flash", "boolean"});
}

TEST_F(ExperimentTest, FreeFormMapSectionsAcceptSubKeys) {
  auto m = resolve("      extra:\n        anything: 1\n        deeper: {x: 2}\n");
  EXPECT_EQ(m.params.find_path("extra.anything")->as_int(), 1);
}

TEST_F(ExperimentTest, MissingPresetAndUnknownExperimentKeys) {
  auto p = d_.write("exp2.yaml", "modules:\n  pre_trainer:\n    framework: dummy\n    config: nope.yaml\n");
  auto e = load_experiment(p, {}, {}, paths_);
  expect_error<ConfigError>([&] { resolve_module(e, "pre_trainer", schema_, {}, paths_); }, {"module preset 'nope.yaml' not found"});
  auto q = d_.write("exp3.yaml", "exp_nmae: x\nmodules:\n  pre_trainer:\n    framework: dummy\n");
  expect_error<ConfigError>([&] { load_experiment(q, {}, {}, paths_); }, {"exp3.yaml:1:1", "exp_nmae", "did you mean 'exp_name'"});
  expect_error<ConfigError>([&] { load_experiment(d_.write("e4.yaml", "exp_name: x\n"), {}, {}, paths_); }, {"modules"});
}

// A model file of another project (Primus' names) is not found; the error names the nearest presets,
// the version suffix and the separators aside, and lists each folder it looked in once.
TEST_F(ExperimentTest, MissingModelPresetNamesTheNearestPresets) {
  d_.write("configs/models/moe/mixtral-8x7B.yaml", "num_layers: 2\n");
  d_.write("configs/models/moe/base.yaml", "num_layers: 1\n");
  d_.write("configs/models/llama/llama3-8B.yaml", "num_layers: 2\n");
  paths_.roots = {d_.path() / "configs", d_.path() / "configs"};
  auto p = d_.write("exp5.yaml", "modules:\n  pre_trainer:\n    framework: dummy\n    config: pretrain.yaml\n"
                                 "    model: mixtral_8x7B_v0.1.yaml\n");
  auto e = load_experiment(p, {}, {}, paths_);
  try {
    resolve_module(e, "pre_trainer", schema_, {}, paths_);
    ADD_FAILURE() << "a missing model preset resolved";
  } catch (const ConfigError& err) {
    const std::string m = err.what();
    EXPECT_NE(m.find("model preset 'mixtral_8x7B_v0.1.yaml' not found"), std::string::npos) << m;
    EXPECT_NE(m.find("nearest here: moe/mixtral-8x7B.yaml"), std::string::npos) << m;
    EXPECT_EQ(m.find("llama3-8B"), std::string::npos) << m;  // too far
    EXPECT_EQ(m.find("base.yaml"), std::string::npos) << m;   // a base is no preset
    const std::string once = (d_.path() / "configs/models/mixtral_8x7B_v0.1.yaml").string();
    EXPECT_EQ(m.find(once), m.rfind(once)) << m;
  }
  auto q = d_.write("exp6.yaml", "modules:\n  pre_trainer:\n    framework: dummy\n    config: pretrain.yaml\n"
                                 "    model: zzz.yaml\n");
  expect_error<ConfigError>([&] { resolve_module(load_experiment(q, {}, {}, paths_), "pre_trainer", schema_, {}, paths_); },
                            {"model preset 'zzz.yaml' not found"});
}

// An alias (another project's boolean for a value of a key) becomes its target in its own layer,
// so layers override across the two names as they do for one, and the value keeps the alias's
// place; one layer setting both differently, or a non-boolean, is an error naming the places.
TEST_F(ExperimentTest, AliasesBecomeTheirTargetInTheirOwnLayer) {
  schema_.alias("use_sgd", "optimizer", Value::string("sgd"), Value::string("adamw"), "true is optimizer: sgd");
  d_.write("configs/models/tiny.yaml", "num_layers: 2\nhidden_size: 64\noptimizer: sgd\n");
  auto m = resolve("      use_sgd: false\n");
  EXPECT_EQ(m.params.find("optimizer")->as_string(), "adamw");  // the later layer's alias wins
  EXPECT_NE(m.params.find("optimizer")->origin().str().find("exp.yaml:11:"), std::string::npos);
  EXPECT_EQ(m.params.find("use_sgd"), nullptr);
  ASSERT_EQ(m.params.find("optimizer")->overridden().size(), 1u);
  EXPECT_NE(m.params.find("optimizer")->overridden()[0].file.find("tiny.yaml"), std::string::npos);
  EXPECT_EQ(resolve("      use_sgd: false\n", {"optimizer=sgd"}).params.find("optimizer")->as_string(), "sgd");
  EXPECT_EQ(resolve("      optimizer: adamw\n", {"use_sgd=true"}).params.find("optimizer")->as_string(), "sgd");
  EXPECT_EQ(resolve("      use_sgd: true\n      optimizer: sgd\n").params.find("optimizer")->as_string(), "sgd");
  expect_error<ConfigError>([&] { resolve("      use_sgd: true\n      optimizer: adamw\n"); },
                            {"exp.yaml:11:", "use_sgd: true means optimizer: sgd", "exp.yaml:12:", "sets optimizer: adamw"});
  EXPECT_EQ(resolve("      use_sgd: 1\n").params.find("optimizer")->as_string(), "sgd");  // 1 is true
  expect_error<ConfigError>([&] { resolve("      use_sgd: 2\n"); }, {"exp.yaml:11:", "use_sgd", "expects a boolean"});
  EXPECT_EQ(schema_.nearest("use_sdg"), "use_sgd");
  // Within a preset's extends chain each file is a layer of its own: the extending file's alias
  // overrides its base's target.
  d_.write("configs/models/base_m.yaml", "num_layers: 2\noptimizer: adamw\n");
  d_.write("configs/models/tiny.yaml", "extends: base_m.yaml\nhidden_size: 64\nuse_sgd: true\n");
  auto chained = resolve("      lr: 0.2\n");
  EXPECT_EQ(chained.params.find("optimizer")->as_string(), "sgd");
  EXPECT_NE(chained.params.find("optimizer")->origin().str().find("tiny.yaml:3:"), std::string::npos);
  EXPECT_THROW(schema_.alias("lr", "optimizer", Value::string("sgd"), Value::string("adamw"), ""), std::logic_error);
  EXPECT_THROW(schema_.alias("x", "nope", Value::string("a"), Value::string("b"), ""), std::logic_error);
}

// An alias whose value stands for nothing (null) leaves the target as the layers set it, in the
// alias's own layer too (Megatron-LM's recompute_activations: false beside recompute_granularity).
TEST_F(ExperimentTest, AnAliasValueOfNothingLeavesTheTargetAlone) {
  schema_.alias("fast_opt", "optimizer", Value::string("sgd"), Value::null(), "true is optimizer: sgd");
  d_.write("configs/models/tiny.yaml", "num_layers: 2\nhidden_size: 64\noptimizer: sgd\n");
  auto m = resolve("      fast_opt: false\n");
  EXPECT_EQ(m.params.find("optimizer")->as_string(), "sgd");  // the model preset's, untouched
  EXPECT_NE(m.params.find("optimizer")->origin().str().find("tiny.yaml"), std::string::npos);
  EXPECT_EQ(m.params.find("fast_opt"), nullptr);
  EXPECT_EQ(resolve("      fast_opt: false\n      optimizer: adamw\n").params.find("optimizer")->as_string(), "adamw");
  EXPECT_EQ(resolve("      optimizer: adamw\n", {"fast_opt=true"}).params.find("optimizer")->as_string(), "sgd");
}

// Megatron-LM's configs as Primus writes them give booleans as 0 and 1 (`sequence_parallel: 1`): a
// boolean key reads them as false and true with their origin, from any layer (the model preset, the
// overrides, the command line); other integers, floats and strings stay errors, and an integer key
// keeps its 1.
TEST_F(ExperimentTest, ZeroAndOneAreBooleansForABooleanKey) {
  auto one = resolve("      use_flash: 1\n");
  ASSERT_EQ(one.params.find("use_flash")->kind(), Value::Kind::Bool);
  EXPECT_TRUE(one.params.find("use_flash")->as_bool());
  EXPECT_NE(one.params.find("use_flash")->origin().str().find("exp.yaml:11:"), std::string::npos);
  EXPECT_FALSE(resolve("      use_flash: true\n", {"use_flash=0"}).params.find("use_flash")->as_bool());
  d_.write("configs/models/tiny.yaml", "num_layers: 2\nhidden_size: 64\nuse_flash: 1\n");
  EXPECT_TRUE(resolve("      lr: 0.2\n").params.find("use_flash")->as_bool());
  EXPECT_EQ(resolve("      num_layers: 1\n").params.find("num_layers")->as_int(), 1);
  for (const char* bad : {"      use_flash: 2\n", "      use_flash: -1\n", "      use_flash: 1.0\n",
                          "      use_flash: \"1\"\n"}) {
    expect_error<ConfigError>([&] { resolve(bad); }, {"exp.yaml:11:", "use_flash", "expects a boolean"});
  }
}

TEST_F(ExperimentTest, ExplainShowsWhereEachKeyWasSet) {
  auto m = resolve("      micro_batch_size: 4\n");
  std::string s = render_yaml(m.params, true);
  EXPECT_NE(s.find("micro_batch_size: 4"), std::string::npos);
  EXPECT_NE(s.find("exp.yaml:11:"), std::string::npos) << s;
  EXPECT_NE(s.find("overrides"), std::string::npos) << s;
  EXPECT_NE(s.find("tiny.yaml:3"), std::string::npos) << s;  // lr from the model preset, overridden
}

TEST(Schema, NearestKey) {
  Schema s;
  s.integer("train_iters", 1, "").integer("seq_length", 1, "").integer("optimizer.warmup", 1, "");
  EXPECT_EQ(s.nearest("train_iter"), "train_iters");
  EXPECT_EQ(s.nearest("seq_lenght"), "seq_length");
  EXPECT_EQ(s.nearest("optimizer.wramup"), "optimizer.warmup");
  EXPECT_EQ(s.nearest("completely_different"), "");
}

// The UTF-8 check must refuse everything nlohmann::json refuses when it dumps a string (a key
// or value that passed it used to escape later as json type_error.316: a fuzz finding).
TEST(ConfigUtf8, AcceptsWellFormedAndRefusesOverlongSurrogateTruncatedAndOutOfRange) {
  for (std::string ok : {"", "plain", "caf\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\xF4\x8F\xBF\xBF",
                         "\xED\x9F\xBF", "\xEE\x80\x80"}) {
    EXPECT_TRUE(valid_utf8(ok)) << ok;
    EXPECT_NO_THROW((void)nlohmann::json(ok).dump());
  }
  for (std::string bad : {"\x80", "\xC0\xAF", "\xC1\xBF", "\xE0\x80\xAF", "\xED\xA0\x80", "\xF0\x80\x80\xAF",
                          "\xF4\x90\x80\x80", "\xF5\x80\x80\x80", "\xFF", "\xC5", "ab\xE3\x81", "x\x9Cy",
                          "\xE2\x28\xA1"}) {
    EXPECT_FALSE(valid_utf8(bad)) << ::testing::PrintToString(bad);
    EXPECT_THROW((void)nlohmann::json(bad).dump(), nlohmann::json::type_error) << ::testing::PrintToString(bad);
  }
}

TEST(ConfigUtf8, NonUtf8OverrideKeyIsAUsageError) {
  expect_error<UsageError>([] { parse_cli_overrides({std::string("extra\x9Cx=1")}); }, {"key", "UTF-8"});
}

// YAML aliases make a graph: an anchor used inside its own definition recursed until the stack
// overflowed (fuzz_config_yaml finding, CI smoke run), and aliases of aliases expand
// exponentially. Both are config errors naming the file and line.
TEST(ConfigYaml, RecursiveAliasIsAConfigErrorNotAStackOverflow) {
  expect_error<ConfigError>(
      [] { parse_yaml_text("base: &b {x: 1, y: 2}\nuse: *b\nm: &b\n  <<: *b\n  z: 3\n", "cyc.yaml"); },
      {"cyc.yaml:", "nested more than"});
}

TEST(ConfigYaml, AliasBombIsRefusedBeforeExhaustingMemory) {
  std::string y = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i <= 7; ++i) {  // 10^8 values once expanded
    y += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int k = 0; k < 10; ++k) y += (k ? ", *a" : "*a") + std::to_string(i - 1);
    y += "]\n";
  }
  expect_error<ConfigError>([&] { parse_yaml_text(y, "bomb.yaml"); }, {"bomb.yaml:", "expands to more than"});
}
