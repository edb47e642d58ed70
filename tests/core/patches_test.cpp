#include <gtest/gtest.h>

#include <cstdlib>
#include <sstream>

#include "core/patches/inventory.h"
#include "core/patches/registry.h"
#include "core/runtime/runtime.h"
#include "dummy_backend.h"
#include "test_util.h"

using namespace primus;
using namespace primus::patches;
using primus::testing::expect_error;
using primus::testing::TempDir;

TEST(PatchRegistry, OneSpecRegistersWithBackendAndSiteDerived) {
  PatchRegistry r;
  const int line = __LINE__ + 1;
  r.add({.id = "x.area.one", .description = "one", .logic = "rewrites args: nothing", .apply = [](PatchContext&) {}});
  const Patch& p = r.get("x.area.one");
  EXPECT_EQ(p.backend, "x");
  EXPECT_EQ(p.phase, Phase::BuildArgs);
  EXPECT_EQ(p.priority, 50);
  EXPECT_NE(p.file.find("tests/core/patches_test.cpp"), std::string::npos) << p.file;
  EXPECT_EQ(p.line, line);
  r.add({.id = "*.area.every", .description = "any backend", .phase = Phase::AfterTrain, .apply = [](PatchContext&) {}});
  EXPECT_EQ(r.get("*.area.every").backend, "*");
  EXPECT_EQ(r.get("*.area.every").order, 1);
  EXPECT_EQ(r.for_backend("y").size(), 1u);
  expect_error<ConfigError>([&] { r.get("x.area.onee"); }, {"unknown patch id", "did you mean 'x.area.one'"});
}

TEST(PatchRegistry, RejectsSpecsTheEngineCannotHonour) {
  PatchRegistry r;
  auto body = [](PatchContext&) {};
  r.add({.id = "x.area.one", .description = "d", .logic = "l", .apply = body});
  auto rejects = [&](const PatchSpec& s, const std::string& why) {
    try {
      r.add(s);
      ADD_FAILURE() << s.id << " was accepted; expected: " << why;
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("tests/core/patches_test.cpp:"), std::string::npos) << e.what();
    }
  };
  rejects({.id = "x.area.one", .description = "d", .logic = "l", .apply = body}, "the id is taken");
  for (const char* id : {"nodots", "x.two", "x.a.b.c", "X.area.one", "x..one", ".area.one", "x.area.", "x.ar-ea.one"})
    rejects({.id = id, .description = "d", .logic = "l", .apply = body}, "<backend>.<area>.<name>");
  rejects({.id = "x.area.two", .logic = "l", .apply = body}, "no description");
  rejects({.id = "x.area.two", .description = "d", .logic = "l"}, "no body");
  rejects({.id = "x.area.two", .description = "d", .slots = {"y.slot"}, .apply = body},
          "slot 'y.slot' is not a slot of backend x");
  rejects({.id = "x.area.two", .description = "d", .slots = {"x.s", "x.s"}, .apply = body}, "declared twice");
  rejects({.id = "x.area.two", .description = "d", .apply = body}, "must say what it changes");
  rejects({.id = "x.area.two", .description = "d", .phase = Phase::Setup, .apply = body}, "must say what it changes");
  for (const char* range : {">=1.0,", "1.x", "~1.0", ">= 1..2"})
    rejects({.id = "x.area.two", .description = "d", .backend_versions = range, .logic = "l", .apply = body},
            "backend_versions");
  // Lifecycle patches may leave slots and logic empty; "*" patches may name any backend's slot.
  r.add({.id = "x.area.two", .description = "d", .phase = Phase::BeforeTrain, .backend_versions = ">= 1.0, <2",
         .apply = body});
  r.add({.id = "*.area.three", .description = "d", .slots = {"y.slot"}, .apply = body});
  EXPECT_EQ(r.all().size(), 3u);
}

TEST(PatchRegistry, VersionRanges) {
  EXPECT_TRUE(version_in_range("1.2.0", ""));
  EXPECT_TRUE(version_in_range("1.2.0", ">=1.0,<2.0"));
  EXPECT_FALSE(version_in_range("2.0", ">=1.0,<2.0"));
  EXPECT_TRUE(version_in_range("1.10", ">1.9"));  // numeric, not lexical
  EXPECT_TRUE(version_in_range("0.9.1", "<1.0"));
  EXPECT_FALSE(version_in_range("1.0", "!=1.0.0"));
  EXPECT_TRUE(version_in_range("13.0", "==13"));
}

TEST(PatchFilter, ParsesAllNoneAndListsAndRejectsUnknownIds) {
  PatchRegistry r;
  BackendRegistry backends;
  dummy::register_backend(backends, r);
  EXPECT_TRUE(PatchFilter::parse("all", r).allows("dummy.env.marker"));
  EXPECT_FALSE(PatchFilter::parse("none", r).allows("dummy.env.marker"));
  auto f = PatchFilter::parse("dummy.env.marker, dummy.greet.fancy", r);
  EXPECT_TRUE(f.allows("dummy.greet.fancy"));
  EXPECT_FALSE(f.allows("dummy.args.grad_accum"));
  expect_error<ConfigError>([&] { PatchFilter::parse("dummy.env.marker,dummy.nope.x", r); },
                            {"PRIMUS_PATCHES", "dummy.nope.x"});
}

TEST(HookTable, ReplaceAndWrapRecordThePatch) {
  HookTable h;
  using F = int(int);
  h.define<F>("t.double", [](int x) { return 2 * x; });
  EXPECT_EQ(h.get<F>("t.double")(3), 6);
  h.wrap<F>("t.double", [](std::function<F> in) { return std::function<F>([in](int x) { return in(x) + 1; }); }, "p.a.wrap");
  EXPECT_EQ(h.get<F>("t.double")(3), 7);
  h.replace<F>("t.double", [](int x) { return x; }, "p.a.repl");
  EXPECT_EQ(h.get<F>("t.double")(3), 3);
  ASSERT_EQ(h.history("t.double").size(), 2u);
  EXPECT_EQ(h.history("t.double")[0].patch_id, "p.a.wrap");
  EXPECT_EQ(h.history("t.double")[1].action, "replace");
  EXPECT_THROW(h.get<int(double)>("t.double"), RuntimeError);
  EXPECT_THROW(h.get<F>("t.none"), RuntimeError);
}

// The dummy backend driven through the runtime: lifecycle order, patch phases and ordering,
// conditions, version gates, filtering and failure handling.
class RuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dummy::register_backend(backends_, patches_);
    dummy::journal().clear();
    d_.write("configs/modules/dummy/pretrain.yaml", "train_iters: 3\n");
    paths_.roots = {d_.path() / "configs"};
    ::unsetenv("PRIMUS_PATCHES");
    ::unsetenv("PRIMUS_DUMMY_MARKER");
  }
  config::Experiment experiment(const std::string& overrides, const std::string& framework = "dummy") {
    auto p = d_.write("exp.yaml", "modules:\n  pre_trainer:\n    framework: " + framework +
                                      "\n    config: pretrain.yaml\n    overrides:\n" + overrides);
    return config::load_experiment(p, {}, {}, paths_);
  }
  void run(const config::Experiment& e, bool dry = false) {
    // resolve_module looks presets up in the default roots; point them at the fixture.
    ::setenv("PRIMUS_CONFIG_DIR", (d_.path() / "configs").c_str(), 1);
    runtime_.run(e, RunOptions{"", "pretrain", dry}, out_);
  }
  BackendRegistry backends_;
  PatchRegistry patches_;
  PrimusRuntime runtime_{backends_, patches_};
  TempDir d_;
  config::ConfigPaths paths_;
  std::ostringstream out_;
};

TEST_F(RuntimeTest, LifecycleAndPatchPhasesRunInOrder) {
  run(experiment("      use_fancy_greeting: true\n"));
  std::vector<std::string> want = {"patch:dummy.env.marker", "prepare", "convert_config",
                                   "patch:dummy.greet.fancy", "patch:dummy.args.grad_accum=4",
                                   "setup", "init", "patch:dummy.lifecycle.before",
                                   "train:*hello world*", "patch:*.lifecycle.after", "cleanup"};
  EXPECT_EQ(dummy::journal(), want);
  std::vector<std::string> events = {"patches:setup", "prepare", "convert_config", "patches:build_args",
                                     "create_trainer", "trainer.setup", "trainer.init", "patches:before_train",
                                     "trainer.train", "patches:after_train", "trainer.cleanup"};
  EXPECT_EQ(runtime_.events(), events);
  EXPECT_STREQ(std::getenv("PRIMUS_DUMMY_MARKER"), "1");
  // The version gate skipped the <1.0 patch and says why.
  bool found = false;
  for (auto& r : runtime_.reports())
    for (auto& d : r.decisions)
      if (d.patch->id == "dummy.compat.old_versions") {
        found = true;
        EXPECT_FALSE(d.applies);
        EXPECT_NE(d.reason.find("1.2.0 not in <1.0"), std::string::npos);
      }
  EXPECT_TRUE(found);
}

TEST_F(RuntimeTest, ConditionFalseSkipsAndRecordsTheKeys) {
  run(experiment("      train_iters: 2\n"));
  EXPECT_EQ(dummy::journal()[5 - 1], "setup");  // no fancy patch in the journal
  for (auto& r : runtime_.reports())
    for (auto& d : r.decisions)
      if (d.patch->id == "dummy.greet.fancy") {
        EXPECT_FALSE(d.applies);
        ASSERT_EQ(d.keys.size(), 1u);
        EXPECT_EQ(d.keys[0], "use_fancy_greeting=false");
      }
}

TEST_F(RuntimeTest, FailingTrainRunsCleanupOnErrorAndSkipsAfterTrain) {
  EXPECT_THROW(run(experiment("      train_iters: -1\n")), RuntimeError);
  auto& j = dummy::journal();
  EXPECT_EQ(j.back(), "cleanup:error");
  EXPECT_EQ(std::count(j.begin(), j.end(), "patch:*.lifecycle.after"), 0);
  EXPECT_EQ(runtime_.events().back(), "trainer.cleanup(on_error)");
}

TEST_F(RuntimeTest, ThrowingPatchStopsTheRunNamingThePatch) {
  expect_error<Error>([&] { run(experiment("      fail_in_setup_patch: true\n")); },
                             {"patch dummy.env.marker failed in phase setup", "boom"});
  EXPECT_EQ(std::count(dummy::journal().begin(), dummy::journal().end(), "prepare"), 0);
}

TEST_F(RuntimeTest, PrimusPatchesAllowList) {
  ::setenv("PRIMUS_PATCHES", "*.lifecycle.after", 1);
  run(experiment("      use_fancy_greeting: true\n"));
  std::vector<std::string> want = {"prepare", "convert_config", "setup", "init", "train:hello world",
                                   "patch:*.lifecycle.after", "cleanup"};
  EXPECT_EQ(dummy::journal(), want);
  ::setenv("PRIMUS_PATCHES", "dummy.no.such", 1);
  expect_error<ConfigError>([&] { run(experiment("      lr: 0.1\n")); }, {"PRIMUS_PATCHES", "dummy.no.such"});
  ::unsetenv("PRIMUS_PATCHES");
}

TEST_F(RuntimeTest, DryRunPrintsThePlanAndRunsNothing) {
  run(experiment("      use_fancy_greeting: true\n      global_batch_size: 32\n"), true);
  // The build_args patches run (they rewrite the args the plan shows); nothing of the run does:
  // no prepare, no trainer, no setup / before_train / after_train patches.
  EXPECT_EQ(dummy::journal(),
            (std::vector<std::string>{"convert_config", "patch:dummy.greet.fancy", "patch:dummy.args.grad_accum=16"}));
  std::string plan = out_.str();
  EXPECT_NE(plan.find("backend args set by build_args patches:\n    grad_accum: 1 -> 16\n"), std::string::npos) << plan;
  EXPECT_NE(plan.find("[build_args] apply dummy.greet.fancy: condition true (use_fancy_greeting=true)"), std::string::npos) << plan;
  EXPECT_NE(plan.find("[before_train] skip  dummy.compat.old_versions"), std::string::npos) << plan;
  EXPECT_NE(plan.find("Dry run: nothing was run."), std::string::npos);
  EXPECT_EQ(std::getenv("PRIMUS_DUMMY_MARKER"), nullptr);
}

TEST_F(RuntimeTest, UnknownBackendListsTheKnownOnes) {
  expect_error<ConfigError>([&] { run(experiment("      lr: 0.1\n", "megatron")); }, {"unknown backend 'megatron'", "dummy"});
}

TEST_F(RuntimeTest, UndeclaredSlotChangeIsRefused) {
  patches_.add({
      .id = "dummy.greet.sneaky",
      .description = "changes a slot it did not declare",
      .logic = "claims to change no slot",
      .apply =
          [](PatchContext& c) {
            c.replace<std::string(const std::string&)>("dummy.greet",
                                                       [](const std::string&) { return std::string("x"); });
          },
  });
  expect_error<Error>([&] { run(experiment("      lr: 0.1\n")); }, {"dummy.greet.sneaky", "without declaring"});
}

TEST_F(RuntimeTest, InventoryComesFromTheRegistry) {
  config::Value defaults = config::Value::map();
  auto adapter = backends_.create("dummy");
  adapter->schema().apply_defaults(defaults);
  auto rows = inventory(patches_, "dummy", "1.2.0", defaults, false);
  ASSERT_EQ(rows.size(), 6u);
  std::string md = inventory_markdown(rows, "dummy", false);
  EXPECT_NE(md.find("| Patch | What it does | Patch logic | Code location | How to enable |"), std::string::npos);
  EXPECT_NE(md.find("## greet"), std::string::npos);
  EXPECT_NE(md.find("replaces/wraps hook `dummy.greet`"), std::string::npos);
  EXPECT_NE(md.find("`use_fancy_greeting`; phase=build_args"), std::string::npos) << md;
  EXPECT_NE(md.find("tests/core/dummy_backend.cpp:"), std::string::npos);
  EXPECT_NE(md.find("backend <1.0"), std::string::npos);
  defaults.set("use_fancy_greeting", config::Value::boolean(true));
  auto with = inventory(patches_, "dummy", "1.2.0", defaults, true);
  int seen = 0;
  for (auto& r : with) {
    if (r.patch->id == "dummy.greet.fancy") {
      EXPECT_TRUE(r.applies);
      ++seen;
    }
    if (r.patch->id == "dummy.compat.old_versions") {
      EXPECT_FALSE(r.applies);
      ++seen;
    }
  }
  EXPECT_EQ(seen, 2) << "both dummy patches are in the inventory";
  std::string details = patch_details(with[0]);
  EXPECT_NE(details.find("## Porting to another framework"), std::string::npos);
}
