// primus report RUN_DIR... [--out report.png|.svg|.pdf|.html] [--x step|tokens] [--log-loss] [--json FILE]
// Charts of training runs (report/report.h) and their summary table, also printed here.
#include <iostream>

#include "cli/command.h"

#ifdef PRIMUS_REPORT
#include "report/report.h"

namespace primus::cli {
namespace {

void setup_report(CLI::App& app) {
  struct Opts {
    std::vector<std::string> runs;
    std::string out = "report.png", x = "step", json;
    bool log_loss = false;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("runs", o->runs, "Run output folders (each holding metrics.jsonl) or metrics.jsonl files")->required();
  app.add_option("--out,-o", o->out, "The chart file: .png, .svg, .pdf or .html (by its extension)")->capture_default_str();
  app.add_option("--x", o->x, "Align the runs by step or by tokens seen")->capture_default_str()->check(CLI::IsMember({"step", "tokens"}));
  app.add_flag("--log-loss", o->log_loss, "Loss on a log scale");
  app.add_option("--json", o->json, "Also write the plotted points per panel and run, and the summary, as JSON");
  app.callback([o] {
    report::ReportOptions opts;
    opts.out = o->out;
    opts.x = o->x == "tokens" ? report::XAxis::Tokens : report::XAxis::Step;
    opts.log_loss = o->log_loss;
    opts.json = o->json;
    report::check_output_path(opts.out);  // a typo in --out fails before any file is read
    std::vector<std::filesystem::path> paths(o->runs.begin(), o->runs.end());
    const auto runs = report::load_runs(paths);
    report::write_report(runs, opts);
    std::vector<report::RunSummary> rows;
    for (const auto& r : runs) rows.push_back(report::summarize(r));
    std::cout << report::summary_table(rows) << "report: " << opts.out.string() << "\n";
  });
}

CommandRegistrar reg_report({"report", "Charts of training runs (loss, lr, throughput, memory, MoE load) and a summary",
                             setup_report});

}  // namespace
}  // namespace primus::cli
#endif
