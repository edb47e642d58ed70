// AdamW's bf16 moments (Megatron's use_precision_aware_optimizer with exp_avg_dtype /
// exp_avg_sq_dtype: bf16) through the binary on the reference backend: the run starts like the
// fp32 one and stays within 2% of its losses without being the same run, resumes bit for bit,
// saves bf16 values in its checkpoint, and bad settings are refused naming the key.
#include <gtest/gtest.h>

#include <cmath>

#include "cli_runner.h"
#include "core/util/fs.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "turbo/core/dtype.h"

using primus::testing::run_primus;
using primus::testing::tiny_run_args;
using primus::testing::Workdir;
namespace fsys = std::filesystem;

namespace {
fsys::path run_dir(const Workdir& w) { return w.path() / "local/local/shakespeare"; }

std::vector<double> losses(const Workdir& w) {
  std::vector<double> out;
  for (auto& j : primus::io::read_jsonl(run_dir(w) / "metrics.jsonl"))
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  return out;
}

const std::string kBf16 = " lr=3e-3 adam_beta2=0.999 use_precision_aware_optimizer=true exp_avg_dtype=bf16 "
                          "exp_avg_sq_dtype=bf16";
}  // namespace

TEST(AdamWMomentsE2E, Bf16MomentsTrackFp32ResumeBitIdenticalAndSaveBf16Values) {
  Workdir f32, straight, resumed;
  auto a = run_primus(tiny_run_args(f32.str()) + " lr=3e-3 adam_beta2=0.999");
  ASSERT_EQ(a.code, 0) << a.out;
  auto b = run_primus(tiny_run_args(straight.str()) + kBf16);
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("AdamW moments exp_avg bf16, exp_avg_sq bf16"), std::string::npos) << b.out;
  const std::vector<double> la = losses(f32), lb = losses(straight);
  ASSERT_EQ(la.size(), 20u);
  ASSERT_EQ(lb.size(), 20u);
  EXPECT_EQ(la[0], lb[0]) << "the same start";
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) worst = std::max(worst, std::abs(lb[i] - la[i]) / la[i]);
  EXPECT_LT(worst, 0.02) << "bf16 moments follow the fp32 run";
  EXPECT_NE(la.back(), lb.back()) << "the moments were rounded";
  EXPECT_LT(lb.back(), lb.front() - 0.5) << "it learns";

  auto c1 = run_primus(tiny_run_args(resumed.str()) + kBf16 + " train_iters=10");
  ASSERT_EQ(c1.code, 0) << c1.out;
  auto c2 = run_primus(tiny_run_args(resumed.str()) + kBf16 + " auto_continue_train=true");
  ASSERT_EQ(c2.code, 0) << c2.out;
  EXPECT_NE(c2.out.find("resumed from"), std::string::npos) << c2.out;
  const std::vector<double> lc = losses(resumed);
  ASSERT_EQ(lc.size(), 20u);
  for (size_t i = 0; i < lb.size(); ++i) EXPECT_EQ(lb[i], lc[i]) << "step " << i + 1;  // bitwise
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_TRUE(primus::fs::read_file(run_dir(straight) / "checkpoints/iter_0000020" / f) ==
                primus::fs::read_file(run_dir(resumed) / "checkpoints/iter_0000020" / f))
        << f << " differs after the resume";
  }
  // The checkpoint keeps the moments as f32 tensors holding bf16 values (so an fp32 run can load them).
  auto ck = primus::io::load_checkpoint(run_dir(straight) / "checkpoints/iter_0000020");
  for (const char* name : {"exp_avg", "exp_avg_sq"}) {
    ASSERT_TRUE(ck.optimizer.count(name)) << name;
    double sq = 0;
    for (float x : ck.optimizer.at(name).as<float>()) {
      ASSERT_EQ(x, primus::turbo::bf16_bits_to_float(primus::turbo::float_to_bf16_bits(x))) << name;
      sq += double(x) * x;
    }
    EXPECT_GT(sq, 0.0) << name;
  }
}

TEST(AdamWMomentsE2E, BadMomentDtypesAreRefusedNamingTheKey) {
  Workdir w;
  auto dry = run_primus(tiny_run_args(w.str()) + " --dry-run use_precision_aware_optimizer=true exp_avg_sq_dtype=bf16");
  EXPECT_EQ(dry.code, 0) << dry.out;
  EXPECT_NE(dry.out.find("exp_avg fp32, exp_avg_sq bf16"), std::string::npos) << dry.out;
  auto r1 = run_primus(tiny_run_args(w.str()) + " exp_avg_dtype=bf16");
  EXPECT_EQ(r1.code, 2) << r1.out;
  EXPECT_NE(r1.out.find("exp_avg_dtype: bf16 needs use_precision_aware_optimizer: true"), std::string::npos) << r1.out;
  auto r2 = run_primus(tiny_run_args(w.str()) + " use_precision_aware_optimizer=true exp_avg_sq_dtype=fp16");
  EXPECT_EQ(r2.code, 2) << r2.out;
  EXPECT_NE(r2.out.find("exp_avg_sq_dtype: fp16 is not implemented"), std::string::npos) << r2.out;
  auto r3 = run_primus(tiny_run_args(w.str()) + " use_precision_aware_optimizer=true exp_avg_dtype=int8");
  EXPECT_EQ(r3.code, 2) << r3.out;
  EXPECT_NE(r3.out.find("exp_avg_dtype"), std::string::npos) << r3.out;
  EXPECT_NE(r3.out.find("bf16"), std::string::npos) << r3.out;
}
