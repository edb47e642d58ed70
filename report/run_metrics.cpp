#include "report/run_metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/util/error.h"
#include "io/metrics.h"

namespace primus::report {
namespace fsys = std::filesystem;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string hms(double s) {
  if (!std::isfinite(s) || s < 0) return "-";
  const auto t = static_cast<int64_t>(std::llround(s));
  if (t < 60) return fmt::format("{:.1f}s", s);
  return fmt::format("{}:{:02d}:{:02d}", t / 3600, (t / 60) % 60, t % 60);
}

std::string num_or_dash(double v, const char* spec) {
  return std::isfinite(v) ? fmt::format(fmt::runtime(spec), v) : std::string("-");
}

// The top-level fields of one metrics record, through nlohmann's SAX interface: no JSON tree is
// built (a long MoE run logs hundreds of keys a step; the tree took most of the reading time).
class MetricsRecordSax final : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool has_step = false;
  int64_t step = 0;
  std::vector<std::pair<std::string, double>> values;  // NaN for null (a non-finite value)
  std::string error;                                   // why the record is refused

  bool null() override { return value(kNaN, "null"); }
  bool boolean(bool) override { return depth_ == 1 && key_ == "skipped" ? true : refuse("boolean"); }
  bool number_integer(number_integer_t v) override { return integer(static_cast<double>(v), true); }
  bool number_unsigned(number_unsigned_t v) override {
    return integer(static_cast<double>(v), v <= static_cast<number_unsigned_t>(INT64_MAX));
  }
  bool number_float(number_float_t v, const string_t&) override {
    if (depth_ == 1 && key_ == "step") return fail("a metrics record needs an integer \"step\"");
    return value(v, "number");
  }
  bool string(string_t&) override { return refuse("string"); }
  bool binary(binary_t&) override { return refuse("binary"); }
  bool start_object(std::size_t) override {
    if (depth_ == 1) return refuse("object");
    ++depth_;
    return true;
  }
  bool key(string_t& k) override {
    key_ = k;
    return true;
  }
  bool end_object() override {
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return refuse("array"); }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    return fail(std::string("not JSON: ") + e.what());
  }

 private:
  bool fail(std::string why) {
    if (error.empty()) error = std::move(why);
    return false;
  }
  // A value that is not a number where a number belongs, or a record that is not an object.
  bool refuse(const char* type) {
    if (depth_ == 0) return fail("not a JSON object");
    return fail(fmt::format("\"{}\" is {}, not a number", key_, type));
  }
  bool integer(double v, bool fits) {
    if (depth_ == 1 && key_ == "step") {
      if (!fits) return fail("\"step\" is out of range");
      has_step = true;
      step = static_cast<int64_t>(v);
      return true;
    }
    return value(v, "number");
  }
  bool value(double v, const char* type) {
    if (depth_ != 1) return refuse(type);
    if (key_ != "step" && key_ != "skipped") values.emplace_back(key_, v);
    else if (key_ == "step") return fail("a metrics record needs an integer \"step\"");
    return true;
  }
  int depth_ = 0;
  std::string key_;
};

using StepValues = std::vector<std::pair<int64_t, double>>;  // (step, value), steps ascending

// Appends (step, v); a step at or before the last one means the run was resumed from an earlier
// checkpoint and logs those steps again, so the older points from `step` on are dropped first.
// NaN (a null) drops the step's point without adding one.
void add_point(StepValues& pts, int64_t step, double v) {
  if (!pts.empty() && pts.back().first >= step) {
    auto from = std::lower_bound(pts.begin(), pts.end(), step, [](const auto& p, int64_t s) { return p.first < s; });
    pts.erase(from, pts.end());
  }
  if (std::isfinite(v)) pts.emplace_back(step, v);
}

// The value at `step`, or NaN.
double at_step(const StepValues* pts, int64_t step) {
  if (!pts) return kNaN;
  auto it = std::lower_bound(pts->begin(), pts->end(), step, [](const auto& p, int64_t s) { return p.first < s; });
  return it != pts->end() && it->first == step ? it->second : kNaN;
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
  std::unordered_map<std::string, StepValues> acc;  // key -> points, "tokens" among them
  bool any = false;
  io::for_each_jsonl_line(file, [&](int64_t line, const std::string& text) {
    MetricsRecordSax rec;
    if (!nlohmann::json::sax_parse(text, &rec) || !rec.error.empty() || !rec.has_step) {
      throw FormatError(fmt::format("'{}' line {}: {}", file.string(), line,
                                    !rec.error.empty() ? rec.error : "a metrics record needs an integer \"step\""));
    }
    for (auto& [k, v] : rec.values) add_point(acc[k], rec.step, v);
    any = true;
  });
  if (!any) throw FormatError(fmt::format("'{}' holds no metrics records", file.string()));

  RunData run;
  run.metrics = file;
  auto find = [&](const char* k) -> const StepValues* {
    auto it = acc.find(k);
    return it == acc.end() ? nullptr : &it->second;
  };
  const StepValues *logged = find("tokens"), *rate = find("tokens_per_s"), *secs = find("step_s");
  // Tokens through a step: the logged count, else step x the step's own tokens (tokens_per_s x
  // step_s: metrics written before the "tokens" field), else step x the run's last known tokens
  // per step (validation records). The batch is the same every step, so the products are exact.
  double per_step = kNaN;
  if (logged && !logged->empty() && logged->back().first > 0) {
    per_step = logged->back().second / static_cast<double>(logged->back().first);
  } else if (rate && secs) {
    for (auto it = secs->rbegin(); it != secs->rend() && !std::isfinite(per_step); ++it) {
      const double r = at_step(rate, it->first);
      if (r > 0 && it->second > 0) per_step = std::round(r * it->second);
    }
  }
  run.has_tokens = std::isfinite(per_step);
  auto tokens_at = [&](int64_t step) {
    if (double t = at_step(logged, step); std::isfinite(t)) return t;
    const double r = at_step(rate, step), s = at_step(secs, step);
    if (r > 0 && s > 0) return static_cast<double>(step) * std::round(r * s);
    return static_cast<double>(step) * per_step;
  };
  for (auto& [k, pts] : acc) {
    if (k == "tokens" || pts.empty()) continue;
    std::vector<Point>& out = run.series[k];
    out.reserve(pts.size());
    for (auto& [step, v] : pts) out.push_back({step, tokens_at(step), v});
    run.last_step = std::max(run.last_step, pts.back().first);
  }
  // Training time: every step's step_s; throughput without the run's first logged step, which
  // carries start-up.
  if (secs) {
    for (size_t i = 0; i < secs->size(); ++i) {
      const auto& [step, s] = (*secs)[i];
      run.wall_s += s;
      if (i == 0) continue;
      run.steady_s += s;
      if (const double r = at_step(rate, step); std::isfinite(r)) run.steady_tokens += r * s;
    }
  }
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
