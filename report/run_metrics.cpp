#include "report/run_metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "core/util/error.h"
#include "io/metrics.h"

namespace primus::report {
namespace fsys = std::filesystem;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Fields of a record that are not series of their own.
bool is_bookkeeping_field(const std::string& k) { return k == "step" || k == "skipped" || k == "tokens"; }

std::string hms(double s) {
  if (!std::isfinite(s) || s < 0) return "-";
  const auto t = static_cast<int64_t>(std::llround(s));
  if (t < 60) return fmt::format("{:.1f}s", s);
  return fmt::format("{}:{:02d}:{:02d}", t / 3600, (t / 60) % 60, t % 60);
}

std::string num_or_dash(double v, const char* spec) {
  return std::isfinite(v) ? fmt::format(fmt::runtime(spec), v) : std::string("-");
}

}  // namespace

const std::vector<Point>* RunData::find(const std::string& key) const {
  auto it = series.find(key);
  return it == series.end() ? nullptr : &it->second;
}

RunData load_run(const fsys::path& path) {
  std::error_code ec;
  const fsys::path file = fsys::is_directory(path, ec) ? path / "metrics.jsonl" : path;
  if (!fsys::is_regular_file(file, ec)) {
    throw IoError(fmt::format("'{}' has no metrics.jsonl (pass a run's output folder, the one that holds "
                              "metrics.jsonl, or the file itself)",
                              path.string()));
  }
  // step -> key -> value; later records of a step replace earlier ones (a resumed run re-logs
  // the steps after its checkpoint). A null (a non-finite value) removes the point.
  std::map<int64_t, std::map<std::string, double>> by_step;
  std::map<int64_t, double> tokens_at;           // the "tokens" field where written
  std::map<int64_t, std::pair<double, double>> rate;  // step -> (tokens_per_s, step_s)
  for (const auto& [line, j] : io::read_jsonl_records(file)) {
    auto st = j.find("step");
    if (st == j.end() || !st->is_number_integer()) {
      throw FormatError(fmt::format("'{}' line {}: a metrics record needs an integer \"step\"", file.string(), line));
    }
    const int64_t step = st->get<int64_t>();
    auto& row = by_step[step];
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (is_bookkeeping_field(it.key())) continue;
      if (it->is_number()) {
        const double v = it->get<double>();
        if (std::isfinite(v)) row[it.key()] = v;
        else row.erase(it.key());
      } else if (it->is_null()) {
        row.erase(it.key());
      } else {
        throw FormatError(fmt::format("'{}' line {}: \"{}\" is {}, not a number", file.string(), line, it.key(),
                                      it->type_name()));
      }
    }
    if (auto t = j.find("tokens"); t != j.end() && t->is_number()) tokens_at[step] = t->get<double>();
  }

  RunData run;
  run.metrics = file;
  // Tokens through a step: the logged count, else step x the step's own tokens (tokens_per_s x
  // step_s; metrics written before the "tokens" field), else step x the run's last known tokens
  // per step (validation records). The batch is the same every step, so the products are exact.
  double per_step = kNaN;
  for (auto& [step, row] : by_step) {
    if (tokens_at.count(step) && step > 0) per_step = tokens_at[step] / static_cast<double>(step);
    auto r = row.find("tokens_per_s"), s = row.find("step_s");
    if (r != row.end() && s != row.end() && r->second > 0 && s->second > 0) {
      if (!tokens_at.count(step)) per_step = std::round(r->second * s->second);
      rate[step] = {r->second, s->second};
    }
  }
  run.has_tokens = std::isfinite(per_step);
  double known_per_step = per_step;  // the last known; earlier steps of an old file use it too
  bool first = true;
  for (auto& [step, row] : by_step) {
    double tokens = kNaN;
    if (auto t = tokens_at.find(step); t != tokens_at.end()) {
      tokens = t->second;
    } else if (auto r = rate.find(step); r != rate.end()) {
      tokens = static_cast<double>(step) * std::round(r->second.first * r->second.second);
    } else if (std::isfinite(known_per_step)) {
      tokens = static_cast<double>(step) * known_per_step;
    }
    for (auto& [k, v] : row) run.series[k].push_back({step, tokens, v});
    if (auto s = row.find("step_s"); s != row.end()) {  // a training step (validation records have none)
      run.wall_s += s->second;
      if (!first) {
        run.steady_s += s->second;
        if (auto r = row.find("tokens_per_s"); r != row.end()) run.steady_tokens += r->second * s->second;
      }
      first = false;
    }
    run.last_step = std::max(run.last_step, step);
  }
  if (by_step.empty()) throw FormatError(fmt::format("'{}' holds no metrics records", file.string()));
  return run;
}

std::vector<RunData> load_runs(const std::vector<fsys::path>& paths) {
  std::vector<RunData> runs;
  std::vector<std::vector<std::string>> parts;  // folder names from the innermost outwards
  for (const auto& p : paths) {
    runs.push_back(load_run(p));
    fsys::path dir = fsys::absolute(runs.back().metrics).lexically_normal().parent_path();
    std::vector<std::string> names;
    for (; dir.has_relative_path(); dir = dir.parent_path()) names.push_back(dir.filename().string());
    if (names.empty()) names.push_back("/");
    parts.push_back(names);
  }
  // The shortest suffix of the folder path that tells every run apart (the same folder passed
  // twice keeps the same name, which the legend then shows twice).
  for (size_t depth = 1;; ++depth) {
    std::set<std::string> seen;
    bool unique = true, exhausted = true;
    for (size_t i = 0; i < runs.size(); ++i) {
      const size_t d = std::min(depth, parts[i].size());
      exhausted &= d == parts[i].size();
      std::string name;
      for (size_t k = d; k-- > 0;) name += (name.empty() ? "" : "/") + parts[i][k];
      runs[i].name = name;
      unique &= seen.insert(name).second;
    }
    if (unique || exhausted) break;
  }
  return runs;
}

RunSummary summarize(const RunData& run) {
  RunSummary s;
  s.name = run.name;
  s.final_loss = s.final_val_loss = s.mean_tokens_per_s = kNaN;
  if (auto* l = run.find("loss"); l && !l->empty()) {
    s.final_loss = l->back().value;
    s.steps = l->back().step;
  } else {
    s.steps = run.last_step;
  }
  if (auto* v = run.find("val_loss"); v && !v->empty()) s.final_val_loss = v->back().value;
  if (run.steady_s > 0 && run.steady_tokens > 0) {
    s.mean_tokens_per_s = run.steady_tokens / run.steady_s;
  } else if (auto* t = run.find("tokens_per_s"); t && !t->empty()) {
    s.mean_tokens_per_s = t->front().value;  // a single step: its own rate, start-up included
  }
  s.wall_s = run.wall_s;
  return s;
}

std::vector<std::string> summary_header() {
  return {"run", "steps", "final loss", "final val loss", "mean tok/s", "wall time"};
}

std::vector<std::string> summary_cells(const RunSummary& s) {
  return {s.name, std::to_string(s.steps), num_or_dash(s.final_loss, "{:.4f}"), num_or_dash(s.final_val_loss, "{:.4f}"),
          num_or_dash(s.mean_tokens_per_s, "{:.0f}"), hms(s.wall_s)};
}

std::string summary_table(const std::vector<RunSummary>& rows) {
  std::vector<std::vector<std::string>> cells = {summary_header()};
  for (const auto& r : rows) cells.push_back(summary_cells(r));
  std::vector<size_t> width(cells[0].size(), 0);
  for (auto& row : cells)
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  std::string out;
  for (auto& row : cells) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      // The run name left-aligned, the figures right-aligned.
      line += c == 0 ? fmt::format("{:<{}}", row[c], width[c]) : fmt::format("  {:>{}}", row[c], width[c]);
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace primus::report
