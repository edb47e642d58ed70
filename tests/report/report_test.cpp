// primus report on synthetic metrics.jsonl files with known steps: what each panel plots per run
// (the --json sidecar), the PNG read back through Cairo (size, each run's colour in the loss
// panel), resumed and skipped steps, token alignment, the summary, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/util/error.h"
#include "core/util/fs.h"
#include "report/png_image.h"
#include "report/report.h"
#include "report/ticks.h"

namespace fsys = std::filesystem;
using namespace primus::report;

class ReportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fsys::temp_directory_path() / ("primus_report_" + std::to_string(rd()));
    fsys::create_directories(dir_);
  }
  void TearDown() override { fsys::remove_all(dir_); }
  fsys::path write(const std::string& rel, const std::string& text) {
    fsys::path p = dir_ / rel;
    fsys::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p;
  }
  // Run "alpha": 30 steps of 4096 tokens with the "tokens" field, validation every 10 steps.
  fsys::path write_alpha() {
    std::string s;
    for (int i = 1; i <= 30; ++i) {
      s += nlohmann::json({{"step", i}, {"loss", 5.0 - 0.1 * i}, {"lr", 1e-3 * std::min(1.0, i / 5.0)},
                           {"grad_norm", 1.0 + 0.01 * i}, {"tokens_per_s", 2048.0}, {"step_s", 2.0},
                           {"tokens", 4096 * i}})
               .dump() + "\n";
      if (i % 10 == 0) s += nlohmann::json({{"step", i}, {"val_loss", 5.2 - 0.1 * i}}).dump() + "\n";
    }
    write("runs/alpha/metrics.jsonl", s);
    return dir_ / "runs/alpha";
  }
  // Run "beta": metrics without the "tokens" field (8192 tokens a step from tokens_per_s x
  // step_s), resumed at step 10 after logging up to 15 (steps 11-15 logged twice, the second
  // time 0.5 lower), step 17 skipped (loss null), two MoE layers.
  fsys::path write_beta() {
    std::string s;
    auto line = [&](int i, double loss, bool skipped) {
      nlohmann::json j = {{"step", i}, {"lr", 2e-3}, {"grad_norm", 0.5}, {"tokens_per_s", 4096.0}, {"step_s", 2.0},
                          {"moe/layer1/load_cv", 0.1 * i}, {"moe/layer3/load_cv", 0.05 * i}, {"moe_load_cv", 0.1 * i},
                          {"moe/layer1/dropped", 0}, {"moe/layer3/dropped", 0}, {"moe/layer3/global_aux_loss", 1.0}};
      j["loss"] = skipped ? nlohmann::json(nullptr) : nlohmann::json(loss);
      if (skipped) j["skipped"] = true;
      s += j.dump() + "\n";
    };
    for (int i = 1; i <= 15; ++i) line(i, 4.0, false);
    for (int i = 11; i <= 20; ++i) line(i, i <= 15 ? 3.5 : 3.0, i == 17);
    write("runs/beta/metrics.jsonl", s);
    return dir_ / "runs/beta";
  }
  fsys::path dir_;
};

namespace {

const nlohmann::json* panel(const nlohmann::json& j, const std::string& id) {
  for (auto& p : j["panels"])
    if (p["id"] == id) return &p;
  return nullptr;
}
const nlohmann::json* series(const nlohmann::json& p, const std::string& run, const std::string& key) {
  for (auto& s : p["series"])
    if (s["run"] == run && s["key"] == key) return &s;
  return nullptr;
}
std::vector<int64_t> steps_of(const nlohmann::json* s) { return s ? (*s)["steps"].get<std::vector<int64_t>>() : std::vector<int64_t>{}; }
std::vector<int64_t> range(int64_t a, int64_t b) {
  std::vector<int64_t> v;
  for (int64_t i = a; i <= b; ++i) v.push_back(i);
  return v;
}

// Pixels of the area within `tol` of colour `hex` (#rrggbb) in each channel.
int count_colour(const RgbaImage& img, const nlohmann::json& area, const std::string& hex, int tol = 6) {
  const int r = std::stoi(hex.substr(1, 2), nullptr, 16), g = std::stoi(hex.substr(3, 2), nullptr, 16),
            b = std::stoi(hex.substr(5, 2), nullptr, 16);
  const int x0 = static_cast<int>(area["x"].get<double>()), y0 = static_cast<int>(area["y"].get<double>());
  const int x1 = x0 + static_cast<int>(area["w"].get<double>()), y1 = y0 + static_cast<int>(area["h"].get<double>());
  int n = 0;
  for (int y = y0; y < y1; ++y)
    for (int x = x0; x < x1; ++x) {
      const uint32_t v = img.at(x, y);
      const int pr = (v >> 16) & 0xff, pg = (v >> 8) & 0xff, pb = v & 0xff;
      n += std::abs(pr - r) <= tol && std::abs(pg - g) <= tol && std::abs(pb - b) <= tol;
    }
  return n;
}

}  // namespace

TEST_F(ReportTest, PanelsHoldEachRunsStepsAndThePngShowsEveryRun) {
  const auto runs = load_runs({write_alpha(), write_beta()});
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].name, "alpha");
  EXPECT_EQ(runs[1].name, "beta");
  ReportOptions o;
  o.out = dir_ / "out/report.png";
  o.json = dir_ / "out/report.json";
  write_report(runs, o);
  const auto j = nlohmann::json::parse(primus::fs::read_file(o.json));

  // Loss: alpha every step, its validation every 10; beta without the skipped step 17.
  const auto* loss = panel(j, "loss");
  ASSERT_NE(loss, nullptr);
  EXPECT_EQ(steps_of(series(*loss, "alpha", "loss")), range(1, 30));
  EXPECT_EQ(steps_of(series(*loss, "alpha", "val_loss")), (std::vector<int64_t>{10, 20, 30}));
  std::vector<int64_t> beta_steps = range(1, 20);
  beta_steps.erase(beta_steps.begin() + 16);  // step 17
  EXPECT_EQ(steps_of(series(*loss, "beta", "loss")), beta_steps);
  EXPECT_EQ(series(*loss, "beta", "val_loss"), nullptr);
  // The resumed steps keep their second record.
  const auto& bpts = (*series(*loss, "beta", "loss"))["points"];
  EXPECT_DOUBLE_EQ(bpts[11][1].get<double>(), 3.5);  // step 12
  EXPECT_DOUBLE_EQ(bpts[9][1].get<double>(), 4.0);   // step 10, logged once
  for (const char* id : {"lr", "grad_norm", "tokens_per_s"}) {
    ASSERT_NE(panel(j, id), nullptr) << id;
    EXPECT_EQ(steps_of(series(*panel(j, id), "alpha", id)), range(1, 30)) << id;
    EXPECT_EQ(steps_of(series(*panel(j, id), "beta", id)), range(1, 20)) << id;
  }
  // Panels no run has data for are left out; all-zero dropped slots too.
  for (const char* id : {"mfu", "tflops", "memory", "moe_aux", "moe_dropped"}) EXPECT_EQ(panel(j, id), nullptr) << id;
  // MoE load: beta's two layers and the summary line, none for the dense alpha.
  const auto* cv = panel(j, "moe_load_cv");
  ASSERT_NE(cv, nullptr);
  EXPECT_EQ((*cv)["series"].size(), 3u);
  EXPECT_EQ(steps_of(series(*cv, "beta", "moe/layer1/load_cv")), range(1, 20));
  EXPECT_EQ(steps_of(series(*cv, "beta", "moe/layer3/load_cv")), range(1, 20));
  EXPECT_EQ(steps_of(series(*cv, "beta", "moe_load_cv")), range(1, 20));
  // A listed balancing type's own key (global_aux_loss beside aux_loss) gets its panel.
  const auto* listed = panel(j, "moe_listed_aux");
  ASSERT_NE(listed, nullptr);
  EXPECT_EQ(steps_of(series(*listed, "beta", "moe/layer3/global_aux_loss")), range(1, 20));
  EXPECT_EQ(series(*listed, "alpha", "moe/layer3/global_aux_loss"), nullptr);

  // The PNG, read back with Cairo: the size the layout says, and each run's colour in the loss
  // panel (drawn lines), but not the colour of a third run that is not there.
  const RgbaImage img = read_png(o.out);
  EXPECT_EQ(img.width, j["width"].get<int>());
  EXPECT_EQ(img.height, j["height"].get<int>());
  EXPECT_EQ(img.width, 1500);
  EXPECT_GT(img.height, 3 * 300);  // three rows of panels and the table
  ASSERT_EQ(j["runs"].size(), 2u);
  const std::string ca = j["runs"][0]["color"], cb = j["runs"][1]["color"];
  EXPECT_NE(ca, cb);
  EXPECT_GT(count_colour(img, (*loss)["area"], ca), 100) << ca;
  EXPECT_GT(count_colour(img, (*loss)["area"], cb), 100) << cb;
  // Only beta has MoE data: alpha's colour must not appear in that panel.
  EXPECT_EQ(count_colour(img, (*cv)["area"], ca), 0);
  EXPECT_GT(count_colour(img, (*cv)["area"], cb), 50);
}

TEST_F(ReportTest, SummaryHasFinalLossesThroughputAndWallTime) {
  const auto runs = load_runs({write_alpha(), write_beta()});
  const RunSummary a = summarize(runs[0]), b = summarize(runs[1]);
  EXPECT_EQ(a.steps, 30);
  EXPECT_DOUBLE_EQ(a.final_loss, 5.0 - 0.1 * 30);
  EXPECT_DOUBLE_EQ(a.final_val_loss, 5.2 - 0.1 * 30);
  EXPECT_DOUBLE_EQ(a.mean_tokens_per_s, 2048.0);
  EXPECT_DOUBLE_EQ(a.wall_s, 60.0);  // 30 steps of 2 s
  EXPECT_EQ(b.steps, 20);
  EXPECT_DOUBLE_EQ(b.final_loss, 3.0);
  EXPECT_TRUE(std::isnan(b.final_val_loss));
  EXPECT_DOUBLE_EQ(b.wall_s, 40.0);  // 20 distinct steps: the re-logged ones count once
  const std::string t = summary_table({a, b});
  EXPECT_NE(t.find("final val loss"), std::string::npos) << t;
  EXPECT_NE(t.find("alpha"), std::string::npos) << t;
  EXPECT_NE(t.find("2.0000"), std::string::npos) << t;  // alpha's final loss
  EXPECT_NE(t.find("0:01:00"), std::string::npos) << t;  // alpha's wall time
}

TEST_F(ReportTest, TokensAxisUsesLoggedCountsOrRateTimesStepTime) {
  const auto runs = load_runs({write_alpha(), write_beta()});
  ReportOptions o;
  o.out = dir_ / "t.svg";
  o.json = dir_ / "t.json";
  o.x = XAxis::Tokens;
  write_report(runs, o);
  const auto j = nlohmann::json::parse(primus::fs::read_file(o.json));
  EXPECT_EQ(j["x"], "tokens");
  const auto* loss = panel(j, "loss");
  ASSERT_NE(loss, nullptr);
  const auto& a = (*series(*loss, "alpha", "loss"))["points"];
  const auto& av = (*series(*loss, "alpha", "val_loss"))["points"];
  const auto& b = (*series(*loss, "beta", "loss"))["points"];
  EXPECT_DOUBLE_EQ(a[0][0].get<double>(), 4096);
  EXPECT_DOUBLE_EQ(a[29][0].get<double>(), 30 * 4096);
  EXPECT_DOUBLE_EQ(av[0][0].get<double>(), 10 * 4096);  // validation records: step x tokens per step
  EXPECT_DOUBLE_EQ(b[19 - 1][0].get<double>(), 20 * 8192);  // the last point, step 20 (17 is missing)
  const std::string svg = primus::fs::read_file(o.out);
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u) << svg.substr(0, 40);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
}

TEST_F(ReportTest, PdfAndLogLoss) {
  const auto runs = load_runs({write_alpha()});
  ReportOptions o;
  o.out = dir_ / "r.PDF";  // the extension in any case
  o.json = dir_ / "r.json";
  o.log_loss = true;
  write_report(runs, o);
  EXPECT_EQ(primus::fs::read_file(o.out).rfind("%PDF", 0), 0u);
  const auto j = nlohmann::json::parse(primus::fs::read_file(o.json));
  EXPECT_TRUE((*panel(j, "loss"))["log_y"].get<bool>());
}

TEST_F(ReportTest, ErrorsNameTheFileAndLine) {
  // A folder without metrics.jsonl.
  fsys::create_directories(dir_ / "empty");
  try {
    load_run(dir_ / "empty");
    FAIL() << "no error";
  } catch (const primus::IoError& e) {
    EXPECT_NE(std::string(e.what()).find((dir_ / "empty").string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no metrics.jsonl"), std::string::npos) << e.what();
  }
  // A corrupt line.
  auto bad = write("bad/metrics.jsonl", "{\"step\": 1, \"loss\": 2.0}\n\n{\"step\": 2, \"loss\": 1.9\n");
  try {
    load_run(dir_ / "bad");
    FAIL() << "no error";
  } catch (const primus::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(bad.string() + "' line 3"), std::string::npos) << e.what();
  }
  // A record without a step; a value that is not a number.
  auto nostep = write("nostep/metrics.jsonl", "{\"step\": 1, \"loss\": 2.0}\n{\"loss\": 1.9}\n");
  try {
    load_run(nostep);
    FAIL() << "no error";
  } catch (const primus::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
  }
  // Values that are not numbers, records that are not objects, a step that is not an integer.
  const std::pair<const char*, const char*> kBad[] = {
      {"{\"step\": 1, \"loss\": \"low\"}", "line 1: \"loss\" is string, not a number"},
      {"{\"step\": 1, \"loss\": {\"a\": 1}}", "line 1: \"loss\" is object, not a number"},
      {"{\"step\": 1, \"loss\": [1]}", "line 1: \"loss\" is array, not a number"},
      {"[1, 2]", "line 1: not a JSON object"},
      {"7", "line 1: not a JSON object"},
      {"{\"step\": 1.5, \"loss\": 2}", "line 1: a metrics record needs an integer \"step\""},
      {"{\"step\": null, \"loss\": 2}", "line 1: a metrics record needs an integer \"step\""},
      {"{}", "line 1: a metrics record needs an integer \"step\""},
  };
  for (auto [text, want] : kBad) {
    auto f = write("typed/metrics.jsonl", std::string(text) + "\n");
    try {
      load_run(f);
      ADD_FAILURE() << "no error for " << text;
    } catch (const primus::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(f.string() + "' " + want), std::string::npos) << text << ": " << e.what();
    }
  }
  // An unknown extension, refused before anything is read or written.
  EXPECT_THROW(check_output_path(dir_ / "r.jpg"), primus::UsageError);
  EXPECT_THROW(check_output_path(dir_ / "report"), primus::UsageError);
  ReportOptions o;
  o.out = dir_ / "r.jpg";
  EXPECT_THROW(write_report(load_runs({write_alpha()}), o), primus::UsageError);
  EXPECT_FALSE(fsys::exists(o.out));
  // Tokens requested from a run without token counts.
  write("notok/metrics.jsonl", "{\"step\": 1, \"loss\": 2.0}\n");
  o.out = dir_ / "r.png";
  o.x = XAxis::Tokens;
  EXPECT_THROW(write_report(load_runs({dir_ / "notok"}), o), primus::UsageError);
}

TEST_F(ReportTest, LongRunsAreThinnedToThePanelsColumnsKeepingSpikes) {
  std::string s;
  for (int i = 1; i <= 20000; ++i) {
    const double loss = i == 12345 ? 9.0 : i == 777 ? 0.5 : 3.0 + 0.001 * (i % 7);
    s += nlohmann::json({{"step", i}, {"loss", loss}, {"lr", 1e-3}}).dump() + "\n";
  }
  write("long/metrics.jsonl", s);
  ReportOptions o;
  o.out = dir_ / "long.png";
  o.json = dir_ / "long.json";
  write_report(load_runs({dir_ / "long"}), o);
  const auto j = nlohmann::json::parse(primus::fs::read_file(o.json));
  const auto* loss = series(*panel(j, "loss"), "long", "loss");
  ASSERT_NE(loss, nullptr);
  const auto steps = steps_of(loss);
  const double columns = (*panel(j, "loss"))["area"]["w"].get<double>();
  EXPECT_EQ((*loss)["source_points"].get<int64_t>(), 20000);
  EXPECT_LE(static_cast<double>(steps.size()), 2 * (columns + 1));
  EXPECT_GT(static_cast<double>(steps.size()), columns / 2);
  EXPECT_TRUE(std::is_sorted(steps.begin(), steps.end()));
  // The spike and the dip survive the thinning.
  EXPECT_NE(std::find(steps.begin(), steps.end(), 12345), steps.end());
  EXPECT_NE(std::find(steps.begin(), steps.end(), 777), steps.end());
}

TEST_F(ReportTest, RunsWithTheSameFolderNameAreToldApart) {
  write("a/run/metrics.jsonl", "{\"step\": 1, \"loss\": 2.0}\n");
  write("b/run/metrics.jsonl", "{\"step\": 1, \"loss\": 2.0}\n");
  const auto runs = load_runs({dir_ / "a/run", dir_ / "b/run/metrics.jsonl"});
  EXPECT_EQ(runs[0].name, "a/run");
  EXPECT_EQ(runs[1].name, "b/run");
}

TEST_F(ReportTest, EndOfRunReportWritesBesideTheMetricsAndNeverThrows) {
  write_alpha();
  write_end_of_run_report(dir_ / "runs/alpha/metrics.jsonl");
  EXPECT_TRUE(fsys::exists(dir_ / "runs/alpha/report.png"));
  // A corrupt file is a warning, not an exception.
  write("bad/metrics.jsonl", "not json\n");
  EXPECT_NO_THROW(write_end_of_run_report(dir_ / "bad/metrics.jsonl"));
  EXPECT_FALSE(fsys::exists(dir_ / "bad/report.png"));
}

TEST(ReportTicks, NiceNumbersAndLabels) {
  Axis a = linear_axis(0.13, 0.97, 5);
  EXPECT_DOUBLE_EQ(a.step, 0.2);
  EXPECT_NEAR(a.lo, 0.0, 1e-12);
  EXPECT_NEAR(a.hi, 1.0, 1e-12);
  ASSERT_EQ(a.ticks.size(), 6u);
  EXPECT_EQ(tick_label(a.ticks[1], a), "0.2");
  Axis s = linear_axis(1, 30, 6);
  EXPECT_DOUBLE_EQ(s.step, 5);
  EXPECT_EQ(tick_label(30, s), "30");
  Axis t = linear_axis(0, 2.5e6, 5);
  EXPECT_DOUBLE_EQ(t.step, 5e5);
  EXPECT_EQ(tick_label(1.5e6, t), "1.5M");
  EXPECT_EQ(tick_label(2e6, t), "2M");
  Axis lr = linear_axis(0, 3e-4, 5);
  EXPECT_DOUBLE_EQ(lr.step, 1e-4);
  EXPECT_EQ(tick_label(3e-4, lr), "3e-4");
  EXPECT_EQ(tick_label(0, lr), "0");
  Axis same = linear_axis(2, 2, 5);  // a constant series still gets a range
  EXPECT_LT(same.lo, 2);
  EXPECT_GT(same.hi, 2);
  Axis lg = log_axis(0.05, 40, 5);
  EXPECT_TRUE(lg.log);
  EXPECT_DOUBLE_EQ(lg.lo, 0.01);
  EXPECT_DOUBLE_EQ(lg.hi, 100);
  EXPECT_EQ(tick_label(0.01, lg), "0.01");
  EXPECT_EQ(tick_label(100, lg), "100");
  Axis narrow = log_axis(2.1, 4.8, 5);  // within a decade: linear ticks inside the range
  EXPECT_TRUE(narrow.log);
  for (double v : narrow.ticks) EXPECT_TRUE(v >= 2.1 && v <= 4.8) << v;
  EXPECT_GE(narrow.ticks.size(), 2u);
}
