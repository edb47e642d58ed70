// primus report end to end: two short runs of the embedded demo each draw report.png at the end
// (not with report_at_end=false, and only a warning without Cairo); `primus report` on both writes
// one chart whose series hold the steps each run logged, read back through Cairo; and the CLI's
// errors for a folder without metrics, a corrupt line and an unknown extension.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "core/util/fs.h"
#include "report/png_image.h"

using primus::testing::run_primus;
using primus::testing::tiny_run_args;
using primus::testing::Workdir;
namespace fsys = std::filesystem;

namespace {
// The tiny demo for 6 steps, validation every 3, named `name` under the workdir.
primus::testing::CliResult demo_run(const Workdir& w, const std::string& name, const std::string& extra = "",
                                    const std::string& env = "") {
  return run_primus(tiny_run_args(w.str()) + " train_iters=6 eval_interval=3 save_interval=0 save_at_end=false " + extra,
                    env + " PRIMUS_EXP_NAME=" + name);
}
fsys::path run_dir(const Workdir& w, const std::string& name) { return w.path() / "local/local" / name; }

std::vector<int64_t> steps_of(const nlohmann::json& j, const std::string& panel, const std::string& run,
                              const std::string& key) {
  for (auto& p : j["panels"])
    if (p["id"] == panel)
      for (auto& s : p["series"])
        if (s["run"] == run && s["key"] == key) return s["steps"].get<std::vector<int64_t>>();
  return {};
}
}  // namespace

TEST(ReportE2E, TwoDemoRunsDrawTheirOwnReportsAndOneComparison) {
  Workdir w;
  auto a = demo_run(w, "demo_a");
  ASSERT_EQ(a.code, 0) << a.out;
  auto b = demo_run(w, "demo_b", "lr=1e-3 micro_batch_size=2 global_batch_size=4");
  ASSERT_EQ(b.code, 0) << b.out;
  for (auto* r : {&a, &b}) EXPECT_NE(r->out.find("[report] charts of this run: "), std::string::npos) << r->out;
  for (const char* name : {"demo_a", "demo_b"}) {
    const fsys::path png = run_dir(w, name) / "report.png";
    ASSERT_TRUE(fsys::exists(png)) << png;
    EXPECT_EQ(primus::report::read_png(png).width, 1500);
  }

  const fsys::path out = w.path() / "cmp.png", json = w.path() / "cmp.json";
  auto r = run_primus("report " + run_dir(w, "demo_a").string() + " " + run_dir(w, "demo_b").string() +
                      " --x tokens --out " + out.string() + " --json " + json.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("final val loss"), std::string::npos) << r.out;  // the summary on stdout
  EXPECT_NE(r.out.find("demo_a"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("demo_b"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("report: " + out.string()), std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(primus::fs::read_file(json));
  const std::vector<int64_t> all = {1, 2, 3, 4, 5, 6}, evals = {3, 6};
  for (const char* run : {"demo_a", "demo_b"}) {
    EXPECT_EQ(steps_of(j, "loss", run, "loss"), all) << run;
    EXPECT_EQ(steps_of(j, "loss", run, "val_loss"), evals) << run;
    EXPECT_EQ(steps_of(j, "lr", run, "lr"), all) << run;
    EXPECT_EQ(steps_of(j, "grad_norm", run, "grad_norm"), all) << run;
    EXPECT_EQ(steps_of(j, "tokens_per_s", run, "tokens_per_s"), all) << run;
  }
  // Aligned by tokens: 8 x 32 tokens a step for demo_a, 4 x 32 for demo_b.
  for (auto& p : j["panels"])
    if (p["id"] == "loss")
      for (auto& s : p["series"])
        if (s["key"] == "loss") {
          const double per_step = s["run"] == "demo_a" ? 256 : 128;
          EXPECT_DOUBLE_EQ(s["points"][5][0].get<double>(), 6 * per_step) << s["run"];
        }
  const auto img = primus::report::read_png(out);
  EXPECT_EQ(img.width, j["width"].get<int>());
  EXPECT_EQ(img.height, j["height"].get<int>());
}

TEST(ReportE2E, EndOfRunReportCanBeTurnedOffAndOnlyWarnsWithoutCairo) {
  Workdir w;
  auto off = demo_run(w, "off", "report_at_end=false");
  ASSERT_EQ(off.code, 0) << off.out;
  EXPECT_FALSE(fsys::exists(run_dir(w, "off") / "report.png"));
  EXPECT_EQ(off.out.find("[report]"), std::string::npos) << off.out;
  // A machine without Cairo (as the GPU machines the binary is carried to): the run succeeds.
  auto bare = demo_run(w, "bare", "", "PRIMUS_CAIRO_LIBRARY=/nonexistent/libcairo.so.2");
  ASSERT_EQ(bare.code, 0) << bare.out;
  EXPECT_NE(bare.out.find("not written: Cairo is not available"), std::string::npos) << bare.out;
  EXPECT_FALSE(fsys::exists(run_dir(w, "bare") / "report.png"));
  EXPECT_TRUE(fsys::exists(run_dir(w, "bare") / "metrics.jsonl"));
}

TEST(ReportE2E, ErrorsNameTheFolderFileAndLine) {
  Workdir w;
  fsys::create_directories(w.path() / "empty");
  auto none = run_primus("report " + (w.path() / "empty").string());
  EXPECT_EQ(none.code, 3) << none.out;
  EXPECT_NE(none.out.find("'" + (w.path() / "empty").string() + "' has no metrics.jsonl"), std::string::npos) << none.out;
  const fsys::path bad = w.write("bad/metrics.jsonl", "{\"step\": 1, \"loss\": 2.5}\n{\"step\": 2, \"loss\": 2.4}\n{\"step\": 3,\n");
  auto corrupt = run_primus("report " + (w.path() / "bad").string() + " --out " + (w.path() / "r.png").string());
  EXPECT_EQ(corrupt.code, 3) << corrupt.out;
  EXPECT_NE(corrupt.out.find("'" + bad.string() + "' line 3: not JSON"), std::string::npos) << corrupt.out;
  EXPECT_FALSE(fsys::exists(w.path() / "r.png"));
  auto ext = run_primus("report " + (w.path() / "bad").string() + " --out " + (w.path() / "r.gif").string());
  EXPECT_EQ(ext.code, 2) << ext.out;
  EXPECT_NE(ext.out.find("unknown output extension '.gif'; use .png, .svg, .pdf or .html"), std::string::npos) << ext.out;
}
