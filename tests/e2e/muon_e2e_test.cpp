// Muon and the WSD schedule through the binary on the reference backend: a Muon run resumes bit
// for bit (its momentum is in the checkpoint), learns, differs from AdamW's run, logs the WSD
// learning rates Megatron's formulas give, and bad keys are refused naming them.
#include <gtest/gtest.h>

#include <cmath>

#include "cli_runner.h"
#include "core/util/fs.h"
#include "io/checkpoint.h"
#include "io/metrics.h"

using primus::testing::run_primus;
using primus::testing::tiny_run_args;
using primus::testing::Workdir;
namespace fsys = std::filesystem;

namespace {
fsys::path muon_run_dir(const Workdir& w) { return w.path() / "local/local/shakespeare"; }

std::vector<nlohmann::json> step_rows(const Workdir& w) {
  std::vector<nlohmann::json> out;
  for (auto& j : primus::io::read_jsonl(muon_run_dir(w) / "metrics.jsonl"))
    if (j.contains("loss")) out.push_back(j);
  return out;
}

// lr 3e-3 to 0 over 20 steps, 2 of warmup, the last 8 a minus_sqrt decay.
const std::string kMuonWsd =
    " optimizer=muon lr=3e-3 min_lr=0 lr_decay_style=WSD lr_wsd_decay_iters=8 lr_wsd_decay_style=minus_sqrt";
}  // namespace

TEST(MuonE2E, ResumesBitIdenticalLearnsAndFollowsTheWsdSchedule) {
  Workdir straight, resumed, adamw;
  auto a = run_primus(tiny_run_args(straight.str()) + kMuonWsd);
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_NE(a.out.find("optimizer: Muon for 4 weight matrices"), std::string::npos) << a.out;
  auto b1 = run_primus(tiny_run_args(resumed.str()) + kMuonWsd + " train_iters=10");
  ASSERT_EQ(b1.code, 0) << b1.out;
  auto b2 = run_primus(tiny_run_args(resumed.str()) + kMuonWsd + " auto_continue_train=true");
  ASSERT_EQ(b2.code, 0) << b2.out;
  EXPECT_NE(b2.out.find("resumed from"), std::string::npos) << b2.out;
  auto ra = step_rows(straight), rb = step_rows(resumed);
  ASSERT_EQ(ra.size(), 20u);
  ASSERT_EQ(rb.size(), 20u);
  for (size_t i = 0; i < ra.size(); ++i) {
    EXPECT_EQ(ra[i]["loss"].get<double>(), rb[i]["loss"].get<double>()) << "step " << i + 1;  // bitwise
  }
  EXPECT_LT(ra.back()["loss"].get<double>(), ra.front()["loss"].get<double>());  // it learns
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_TRUE(primus::fs::read_file(muon_run_dir(straight) / "checkpoints/iter_0000020" / f) ==
                primus::fs::read_file(muon_run_dir(resumed) / "checkpoints/iter_0000020" / f))
        << f << " differs after the resume";
  }
  // The momentum is saved (non-zero: the matrices' gradients went into it).
  auto ck = primus::io::load_checkpoint(muon_run_dir(straight) / "checkpoints/iter_0000020");
  ASSERT_TRUE(ck.optimizer.count("muon_momentum")) << "no muon_momentum in the checkpoint";
  double sq = 0;
  for (float x : ck.optimizer.at("muon_momentum").as<float>()) sq += double(x) * x;
  EXPECT_GT(sq, 0.0);

  // WSD, minus_sqrt: stable at 3e-3 after warmup until step index 12, then 3e-3 (1 - sqrt(r)),
  // r = (index - 12) / 8 (the lr logged at step s is that of index s - 1).
  EXPECT_NEAR(ra[0]["lr"].get<double>(), 1.5e-3, 1e-12);  // warmup: (0 + 1) / 2
  for (int s = 2; s <= 13; ++s) EXPECT_NEAR(ra[s - 1]["lr"].get<double>(), 3e-3, 1e-12) << "step " << s;
  for (int s = 14; s <= 20; ++s) {
    const double r = (s - 1 - 12) / 8.0;
    EXPECT_NEAR(ra[s - 1]["lr"].get<double>(), 3e-3 * (1 - std::sqrt(r)), 1e-12) << "step " << s;
  }

  // AdamW on the same schedule takes another path.
  auto c = run_primus(tiny_run_args(adamw.str()) +
                      " optimizer=adamw lr=3e-3 min_lr=0 lr_decay_style=WSD lr_wsd_decay_iters=8");
  ASSERT_EQ(c.code, 0) << c.out;
  auto rc = step_rows(adamw);
  ASSERT_EQ(rc.size(), 20u);
  EXPECT_EQ(ra[0]["loss"].get<double>(), rc[0]["loss"].get<double>());  // the same start
  EXPECT_NE(ra[19]["loss"].get<double>(), rc[19]["loss"].get<double>());
}

TEST(MuonE2E, BadScheduleAndOptimizerKeysAreRefusedNamingThem) {
  Workdir w;
  auto r1 = run_primus(tiny_run_args(w.str()) + " lr_decay_style=WSD");
  EXPECT_EQ(r1.code, 2) << r1.out;
  EXPECT_NE(r1.out.find("lr_decay_style WSD needs lr_wsd_decay_iters"), std::string::npos) << r1.out;
  auto r2 = run_primus(tiny_run_args(w.str()) + " lr_decay_style=WSD lr_wsd_decay_iters=19");
  EXPECT_EQ(r2.code, 2) << r2.out;
  EXPECT_NE(r2.out.find("lr_wsd_decay_iters 19 is longer than the schedule after warmup"), std::string::npos) << r2.out;
  auto r3 = run_primus(tiny_run_args(w.str()) + " optimizer=sgd");
  EXPECT_EQ(r3.code, 2) << r3.out;
  EXPECT_NE(r3.out.find("optimizer"), std::string::npos) << r3.out;
  EXPECT_NE(r3.out.find("muon"), std::string::npos) << r3.out;
  auto r4 = run_primus(tiny_run_args(w.str()) + " lr_wsd_decay_style=square");
  EXPECT_EQ(r4.code, 2) << r4.out;
  EXPECT_NE(r4.out.find("minus_sqrt"), std::string::npos) << r4.out;
}
