// `primus report`: charts of one or more training runs, overlaid (one colour per run) and aligned
// by step or by tokens, with a summary table, drawn with Cairo into one PNG, SVG or PDF, or an HTML
// page that inlines Cairo's SVG of the panels and holds the summary as an HTML table.
//
// Panels, each left out when no run has its data: loss (train solid, validation dashed with
// markers; optionally log scale), learning rate, gradient norm, tokens/s, MFU, TFLOP/s, memory
// (device memory in use, the model's arenas), and for MoE runs the expert-load coefficient of
// variation, the aux loss and dropped slots (each layer thin, the summary over layers bold).
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "report/run_metrics.h"

namespace primus::report {

enum class XAxis { Step, Tokens };

struct ReportOptions {
  std::filesystem::path out = "report.png";  // .png, .svg, .pdf or .html (chosen by the extension)
  XAxis x = XAxis::Step;
  bool log_loss = false;
  // Also write what was drawn as JSON: the runs and their colours, and per panel its area in the
  // image (pixels from the top left) and per run and series the plotted points.
  std::filesystem::path json;
};

// Throws UsageError for an extension other than .png, .svg, .pdf, .html (checked before anything is read).
void check_output_path(const std::filesystem::path& out);
// Draws `runs` into opts.out (written to a temporary file, then renamed). Throws RuntimeError when
// Cairo is not available or fails, UsageError for --x tokens with a run that has no token counts.
void write_report(const std::vector<RunData>& runs, const ReportOptions& opts);

// The end of a training run: draws <folder of metrics>/report.png from `metrics` and logs its
// path. Never throws: a report that cannot be drawn (no Cairo on this machine, a full disk) is a
// warning, since the run itself succeeded.
void write_end_of_run_report(const std::filesystem::path& metrics);

}  // namespace primus::report
