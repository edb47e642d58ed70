#include "report/report.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <mutex>
#include <numbers>
#include <nlohmann/json.hpp>

#include "core/util/error.h"
#include "core/util/fs.h"
#include "report/cairo_api.h"
#include "report/ticks.h"

namespace primus::report {
namespace fsys = std::filesystem;

namespace {

struct Rgb {
  double r, g, b;
};
// One colour per run, far apart in hue and readable on white; a ninth run reuses the first.
constexpr Rgb kRunColours[] = {{0.12, 0.38, 0.72}, {0.86, 0.35, 0.05}, {0.16, 0.58, 0.22}, {0.78, 0.10, 0.20},
                               {0.50, 0.30, 0.70}, {0.55, 0.35, 0.20}, {0.85, 0.25, 0.65}, {0.05, 0.60, 0.65}};
Rgb run_colour(size_t i) { return kRunColours[i % std::size(kRunColours)]; }
std::string hex_colour(Rgb c) {
  auto b = [](double v) { return static_cast<int>(std::lround(v * 255)); };
  return fmt::format("#{:02x}{:02x}{:02x}", b(c.r), b(c.g), b(c.b));
}

enum class Stroke { Solid, Dashed, Thin };

// A series of a panel: one metrics key, or a per-layer family (moe/layer<l>/<suffix>).
struct SeriesSpec {
  std::string key{};          // exact key; empty for a family
  std::string family_suffix{};  // "/load_cv": every key "moe/layer<l>/load_cv"
  Stroke stroke = Stroke::Solid;
  bool markers = false;
  std::string label{};        // in the panel's style legend ("" when the panel has one series)
  double scale = 1;           // MFU is logged as a fraction, drawn in percent
};

struct PanelSpec {
  std::string id{}, title{};
  std::vector<SeriesSpec> series{};
  bool log_y = false;
  bool hide_if_all_zero = false;  // dropped slots: all zero in a dropless run says nothing
};

std::vector<PanelSpec> report_panels(bool log_loss) {
  auto one = [](const char* key) { return std::vector<SeriesSpec>{{.key = key}}; };
  auto layers = [](const char* suffix) {
    return SeriesSpec{.family_suffix = suffix, .stroke = Stroke::Thin, .label = "per layer"};
  };
  return {
      {.id = "loss",
       .title = log_loss ? "Loss (log scale)" : "Loss",
       .series = {{.key = "loss", .label = "train"},
                  {.key = "val_loss", .stroke = Stroke::Dashed, .markers = true, .label = "validation"}},
       .log_y = log_loss},
      {.id = "lr", .title = "Learning rate", .series = one("lr")},
      {.id = "grad_norm", .title = "Gradient norm (before clipping)", .series = one("grad_norm")},
      {.id = "tokens_per_s", .title = "Throughput (tokens/s)", .series = one("tokens_per_s")},
      {.id = "mfu", .title = "MFU (%)", .series = {{.key = "mfu", .scale = 100.0}}},
      {.id = "tflops", .title = "Model TFLOP/s", .series = one("tflops")},
      {.id = "memory",
       .title = "Memory (GiB)",
       // cuda runs log device memory and arenas, reference runs the process's peak resident set and
       // the model's buffers: labels that hold for both.
       .series = {{.key = "mem_gib", .label = "in use (device / process peak)"},
                  {.key = "arena_gib", .stroke = Stroke::Dashed, .label = "model buffers"}}},
      {.id = "moe_load_cv",
       .title = "MoE expert load, coefficient of variation",
       .series = {layers("/load_cv"), {.key = "moe_load_cv", .label = "max over layers"}}},
      {.id = "moe_aux",
       .title = "MoE aux loss",
       .series = {layers("/aux_loss"), {.key = "moe_aux", .label = "mean over layers"}}},
      // A list of balancing types logs its other types under their own names (docs/moe.md).
      {.id = "moe_listed_aux",
       .title = "MoE balancing losses listed beside aux_loss",
       .series = {{.family_suffix = "/seq_aux_loss", .stroke = Stroke::Thin, .label = "seq_aux_loss, per layer"},
                  {.family_suffix = "/global_aux_loss",
                   .stroke = Stroke::Dashed,
                   .label = "global_aux_loss, per layer"}}},
      {.id = "moe_dropped",
       .title = "MoE slots dropped over capacity",
       .series = {layers("/dropped")},
       .hide_if_all_zero = true},
  };
}

// The layer number of "moe/layer<l>/<suffix>", or -1 when `key` is not of that family.
int64_t family_layer(const std::string& key, const std::string& suffix) {
  static const std::string prefix = "moe/layer";
  if (key.size() <= prefix.size() + suffix.size() || key.compare(0, prefix.size(), prefix) != 0 ||
      key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const std::string mid = key.substr(prefix.size(), key.size() - prefix.size() - suffix.size());
  if (mid.empty() || mid.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(mid);
}

struct XY {
  int64_t step;
  double x, y;
};

struct DrawnSeries {
  size_t run = 0;
  std::string key;
  const SeriesSpec* spec = nullptr;
  std::vector<XY> points;  // what is drawn (thinned when a series has more points than pixels)
  size_t source_points = 0;
};

struct Panel {
  const PanelSpec* spec = nullptr;
  std::vector<DrawnSeries> series;
  Axis xa, ya;
  double x = 0, y = 0, w = 0, h = 0;          // the panel's box
  double px = 0, py = 0, pw = 0, ph = 0;      // its plot area
};

// Layout, in pixels for PNG and points for SVG/PDF.
constexpr double kWidth = 1500, kMargin = 24, kGap = 22, kPanelH = 300;
constexpr double kPlotLeft = 78, kPlotRight = 14, kPlotTop = 34, kPlotBottom = 44;
constexpr double kRowH = 24;

// Keeps, per pixel column, the lowest and the highest point (in step order): a spike stays
// visible, and a 100k-step run draws about as fast as a short one (Cairo's time goes with the
// segments it strokes; points beyond two a column add segments no one can see).
std::vector<XY> thin_points(const std::vector<XY>& pts, double x0, double x1, double columns) {
  if (pts.size() <= static_cast<size_t>(2 * columns) || !(x1 > x0)) return pts;
  std::vector<XY> out;
  size_t i = 0;
  auto column = [&](size_t k) { return static_cast<int64_t>((pts[k].x - x0) / (x1 - x0) * columns); };
  while (i < pts.size()) {
    const int64_t col = column(i);
    size_t lo = i, hi = i, j = i;
    for (; j < pts.size() && column(j) == col; ++j) {
      if (pts[j].y < pts[lo].y) lo = j;
      if (pts[j].y > pts[hi].y) hi = j;
    }
    out.push_back(pts[std::min(lo, hi)]);
    if (hi != lo) out.push_back(pts[std::max(lo, hi)]);
    i = j;
  }
  return out;
}

std::vector<Panel> collect_panels(const std::vector<PanelSpec>& specs, const std::vector<RunData>& runs, XAxis xaxis) {
  std::vector<Panel> panels;
  for (const PanelSpec& ps : specs) {
    Panel p;
    p.spec = &ps;
    bool nonzero = false;
    for (size_t r = 0; r < runs.size(); ++r) {
      for (const SeriesSpec& ss : ps.series) {
        std::vector<std::pair<int64_t, std::string>> keys;  // (layer, key), layers in numeric order
        if (!ss.key.empty()) {
          if (runs[r].find(ss.key)) keys.emplace_back(0, ss.key);
        } else {
          for (auto& [k, pts] : runs[r].series)
            if (int64_t l = family_layer(k, ss.family_suffix); l >= 0) keys.emplace_back(l, k);
          std::sort(keys.begin(), keys.end());
        }
        for (auto& [layer, key] : keys) {
          DrawnSeries ds;
          ds.run = r;
          ds.key = key;
          ds.spec = &ss;
          for (const Point& pt : *runs[r].find(key)) {
            const double x = xaxis == XAxis::Step ? static_cast<double>(pt.step) : pt.tokens;
            const double y = pt.value * ss.scale;
            if (!std::isfinite(x) || !std::isfinite(y)) continue;
            if (ps.log_y && y <= 0) continue;  // no place on a log axis
            ds.points.push_back({pt.step, x, y});
            nonzero |= y != 0;
          }
          ds.source_points = ds.points.size();
          if (!ds.points.empty()) p.series.push_back(std::move(ds));
        }
      }
    }
    if (p.series.empty() || (ps.hide_if_all_zero && !nonzero)) continue;
    panels.push_back(std::move(p));
  }
  return panels;
}

// ---- drawing -------------------------------------------------------------------------------

// Text and lines over the toy text API: a report needs a few sizes of one sans-serif face.
class Painter {
 public:
  Painter(const CairoApi& api, cairo_t* cr) : c_(api), cr_(cr) {}
  void font(double size, bool bold = false) {
    c_.cairo_select_font_face(cr_, "sans-serif", CAIRO_FONT_SLANT_NORMAL,
                              bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
    c_.cairo_set_font_size(cr_, size);
  }
  double text_width(const std::string& s) {
    cairo_text_extents_t e;
    c_.cairo_text_extents(cr_, s.c_str(), &e);
    return e.x_advance;
  }
  // align: 0 left, 0.5 centre, 1 right of x; y is the baseline.
  void text(const std::string& s, double x, double y, double align = 0) {
    c_.cairo_move_to(cr_, x - align * text_width(s), y);
    c_.cairo_show_text(cr_, s.c_str());
  }
  void colour(Rgb c, double alpha = 1) { c_.cairo_set_source_rgba(cr_, c.r, c.g, c.b, alpha); }
  void grey(double v) { c_.cairo_set_source_rgb(cr_, v, v, v); }
  void stroke_style(Stroke s) {
    static const double kDash[] = {7, 4};
    c_.cairo_set_line_width(cr_, s == Stroke::Thin ? 1.0 : 2.0);
    c_.cairo_set_dash(cr_, kDash, s == Stroke::Dashed ? 2 : 0, 0);
  }
  void line(double x0, double y0, double x1, double y1) {
    c_.cairo_move_to(cr_, x0, y0);
    c_.cairo_line_to(cr_, x1, y1);
    c_.cairo_stroke(cr_);
  }
  void rect(double x, double y, double w, double h, bool fill) {
    c_.cairo_rectangle(cr_, x, y, w, h);
    fill ? c_.cairo_fill(cr_) : c_.cairo_stroke(cr_);
  }
  void dot(double x, double y, double r) {
    c_.cairo_new_path(cr_);
    c_.cairo_arc(cr_, x, y, r, 0, 2 * std::numbers::pi);
    c_.cairo_fill(cr_);
  }
  const CairoApi& api() const { return c_; }
  cairo_t* cr() const { return cr_; }

 private:
  const CairoApi& c_;
  cairo_t* cr_;
};

// The axes' ends sit this far inside the frame, so a series at its panel's extreme (a constant
// learning rate, the first step's loss) stays visible instead of merging with the frame.
constexpr double kInset = 6;

double map_x(const Panel& p, double x) {
  return p.px + kInset + (x - p.xa.lo) / (p.xa.hi - p.xa.lo) * (p.pw - 2 * kInset);
}
double map_y(const Panel& p, double y) {
  const double f = p.ya.log ? (std::log10(y) - std::log10(p.ya.lo)) / (std::log10(p.ya.hi) - std::log10(p.ya.lo))
                            : (y - p.ya.lo) / (p.ya.hi - p.ya.lo);
  return p.py + p.ph - kInset - f * (p.ph - 2 * kInset);
}

void set_axes(Panel& p) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (auto& s : p.series)
    for (auto& q : s.points) {
      x0 = std::min(x0, q.x), x1 = std::max(x1, q.x);
      y0 = std::min(y0, q.y), y1 = std::max(y1, q.y);
    }
  p.xa = linear_axis(x0, x1, 6);
  if (p.spec->log_y) {
    p.ya = log_axis(y0, y1, 5);
  } else {
    // A range that sits far from zero keeps its own scale; one that nearly reaches it starts at it.
    if (y0 > 0 && y0 < 0.25 * y1) y0 = 0;
    p.ya = linear_axis(y0, y1, 5);
  }
}

void draw_panel(Painter& pt, Panel& p, XAxis xaxis, const std::vector<Rgb>& colours) {
  pt.grey(1.0);
  pt.rect(p.x, p.y, p.w, p.h, true);
  pt.grey(0.82);
  pt.api().cairo_set_line_width(pt.cr(), 1);
  pt.rect(p.x + 0.5, p.y + 0.5, p.w - 1, p.h - 1, false);
  pt.grey(0.1);
  pt.font(15, true);
  pt.text(p.spec->title, p.x + 12, p.y + 22);
  // The style legend (train / validation ...) in grey: colours belong to runs.
  std::vector<const SeriesSpec*> styles;
  for (auto& s : p.series)
    if (!s.spec->label.empty() && std::find(styles.begin(), styles.end(), s.spec) == styles.end()) styles.push_back(s.spec);
  if (styles.size() > 1) {
    pt.font(12);
    double x = p.x + p.w - 12;
    for (size_t i = styles.size(); i-- > 0;) {
      const SeriesSpec* s = styles[i];
      x -= pt.text_width(s->label);
      pt.grey(0.25);
      pt.text(s->label, x, p.y + 21);
      pt.grey(0.35);
      pt.stroke_style(s->stroke);
      pt.line(x - 30, p.y + 17, x - 6, p.y + 17);
      if (s->markers) pt.dot(x - 18, p.y + 17, 3);
      x -= 46;
    }
  }
  // Grid and tick labels.
  pt.api().cairo_set_dash(pt.cr(), nullptr, 0, 0);
  pt.api().cairo_set_line_width(pt.cr(), 1);
  pt.font(12);
  for (double v : p.ya.ticks) {
    const double y = std::round(map_y(p, v)) + 0.5;
    pt.grey(0.9);
    pt.line(p.px, y, p.px + p.pw, y);
    pt.grey(0.3);
    pt.text(tick_label(v, p.ya), p.px - 6, y + 4, 1);
  }
  for (double v : p.xa.ticks) {
    const double x = std::round(map_x(p, v)) + 0.5;
    pt.grey(0.9);
    pt.line(x, p.py, x, p.py + p.ph);
    pt.grey(0.3);
    pt.text(tick_label(v, p.xa), x, p.py + p.ph + 16, 0.5);
  }
  pt.grey(0.45);
  pt.text(xaxis == XAxis::Step ? "step" : "tokens", p.px + p.pw / 2, p.py + p.ph + 34, 0.5);
  pt.grey(0.6);
  pt.rect(p.px + 0.5, p.py + 0.5, p.pw, p.ph, false);
  // The series, clipped to the plot area; per-layer lines first so the summaries stay on top.
  auto& c = pt.api();
  c.cairo_save(pt.cr());
  c.cairo_rectangle(pt.cr(), p.px, p.py, p.pw + 1, p.ph + 1);
  c.cairo_clip(pt.cr());
  c.cairo_set_line_join(pt.cr(), CAIRO_LINE_JOIN_ROUND);
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& s : p.series) {
      if ((s.spec->stroke == Stroke::Thin) != (pass == 0)) continue;
      pt.colour(colours[s.run], s.spec->stroke == Stroke::Thin ? 0.45 : 1.0);
      pt.stroke_style(s.spec->stroke);
      // Stroked in pieces: Cairo resolves where a stroked path crosses itself, which grows
      // faster than the path's length for noisy series (measured 4.6 s in one piece against
      // 1.0 s in pieces of 64 for 48 series of 1,250 random points).
      c.cairo_new_path(pt.cr());
      for (size_t i = 0; i < s.points.size(); ++i) {
        const double x = map_x(p, s.points[i].x), y = map_y(p, s.points[i].y);
        i == 0 ? c.cairo_move_to(pt.cr(), x, y) : c.cairo_line_to(pt.cr(), x, y);
        if (i % 64 == 63 && i + 1 < s.points.size()) {
          c.cairo_stroke(pt.cr());
          c.cairo_move_to(pt.cr(), x, y);
        }
      }
      c.cairo_stroke(pt.cr());
      if (s.spec->markers || s.points.size() == 1)
        for (auto& q : s.points) pt.dot(map_x(p, q.x), map_y(p, q.y), 3);
    }
  }
  c.cairo_restore(pt.cr());
}

// Column x positions of the summary table (left edges), from the widest cell of each column.
std::vector<double> table_columns(Painter& pt, const std::vector<std::vector<std::string>>& rows, double x0) {
  std::vector<double> xs;
  double x = x0 + 22;  // room for the run's colour swatch
  for (size_t c = 0; c < rows[0].size(); ++c) {
    double w = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      pt.font(13, r == 0);
      w = std::max(w, pt.text_width(rows[r][c]));
    }
    xs.push_back(x);
    x += w + 28;
  }
  xs.push_back(x);
  return xs;
}

struct Layout {
  double height = 0, legend_y = 0, panels_y = 0, table_y = 0;
  std::vector<std::pair<double, double>> legend_at;  // per run: x, baseline
};

// `table`: the summary table drawn under the panels (an HTML report has it as an HTML table instead).
Layout layout(Painter& pt, const std::vector<RunData>& runs, size_t n_panels, bool table) {
  Layout L;
  L.legend_y = kMargin + 54;
  pt.font(14);
  double x = kMargin, y = L.legend_y;
  for (const RunData& r : runs) {
    const double w = 34 + pt.text_width(r.name) + 26;
    if (x > kMargin && x + w > kWidth - kMargin) {
      x = kMargin;
      y += 22;
    }
    L.legend_at.emplace_back(x, y);
    x += w;
  }
  L.panels_y = y + 20;
  const size_t rows = (n_panels + 1) / 2;
  L.table_y = L.panels_y + static_cast<double>(rows) * (kPanelH + kGap) + 6;
  L.height = table ? std::ceil(L.table_y + kRowH * static_cast<double>(runs.size() + 1) + 30 + kMargin)
                   : std::ceil(L.table_y - kGap - 6 + kMargin);
  return L;
}

void draw_report(Painter& pt, const std::vector<RunData>& runs, std::vector<Panel>& panels, const Layout& L,
                 XAxis xaxis, const std::vector<Rgb>& colours, bool table) {
  pt.grey(0.97);
  pt.api().cairo_paint(pt.cr());
  pt.grey(0.1);
  pt.font(22, true);
  const std::string title = "Primus training report";
  pt.text(title, kMargin, kMargin + 22);
  const double title_w = pt.text_width(title);
  pt.grey(0.4);
  pt.font(13);
  pt.text(fmt::format("{} run{}, aligned by {}", runs.size(), runs.size() == 1 ? "" : "s",
                      xaxis == XAxis::Step ? "step" : "tokens seen"),
          kMargin + title_w + 14, kMargin + 22);
  for (size_t r = 0; r < runs.size(); ++r) {
    auto [x, y] = L.legend_at[r];
    pt.colour(colours[r]);
    pt.rect(x, y - 7, 26, 5, true);
    pt.grey(0.1);
    pt.font(14);
    pt.text(runs[r].name, x + 34, y);
  }
  const double panel_w = (kWidth - 2 * kMargin - kGap) / 2;
  for (size_t i = 0; i < panels.size(); ++i) {
    Panel& p = panels[i];
    p.x = kMargin + static_cast<double>(i % 2) * (panel_w + kGap);
    p.y = L.panels_y + static_cast<double>(i / 2) * (kPanelH + kGap);
    p.w = panel_w;
    p.h = kPanelH;
    p.px = p.x + kPlotLeft;
    p.py = p.y + kPlotTop;
    p.pw = p.w - kPlotLeft - kPlotRight;
    p.ph = p.h - kPlotTop - kPlotBottom;
    for (auto& s : p.series) s.points = thin_points(s.points, p.xa.lo, p.xa.hi, p.pw);
    draw_panel(pt, p, xaxis, colours);
  }
  if (!table) return;
  // The summary table.
  std::vector<std::vector<std::string>> rows = {summary_header()};
  for (const RunData& r : runs) rows.push_back(summary_cells(summarize(r)));
  const std::vector<double> xs = table_columns(pt, rows, kMargin);
  pt.grey(1.0);
  pt.rect(kMargin, L.table_y, xs.back() - kMargin, kRowH * static_cast<double>(rows.size()) + 12, true);
  for (size_t r = 0; r < rows.size(); ++r) {
    const double y = L.table_y + 22 + kRowH * static_cast<double>(r);
    if (r > 0) {
      pt.colour(colours[r - 1]);
      pt.rect(kMargin + 6, y - 10, 10, 10, true);
    }
    pt.font(13, r == 0);
    pt.grey(r == 0 ? 0.1 : 0.2);
    for (size_t c = 0; c < rows[r].size(); ++c) {
      // Figures right-aligned in their column, the run name left-aligned.
      if (c == 0) pt.text(rows[r][c], xs[c], y);
      else pt.text(rows[r][c], xs[c + 1] - 28, y, 1);
    }
  }
}

nlohmann::json describe(const std::vector<RunData>& runs, const std::vector<Panel>& panels,
                        const ReportOptions& opts, const std::vector<Rgb>& colours, double height) {
  nlohmann::json j;
  j["out"] = opts.out.string();
  j["x"] = opts.x == XAxis::Step ? "step" : "tokens";
  j["width"] = kWidth;
  j["height"] = height;
  for (size_t r = 0; r < runs.size(); ++r) {
    const RunSummary s = summarize(runs[r]);
    auto num = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
    j["runs"].push_back({{"name", runs[r].name},
                         {"metrics", runs[r].metrics.string()},
                         {"color", hex_colour(colours[r])},
                         {"summary",
                          {{"steps", s.steps},
                           {"final_loss", num(s.final_loss)},
                           {"final_val_loss", num(s.final_val_loss)},
                           {"mean_tokens_per_s", num(s.mean_tokens_per_s)},
                           {"wall_s", s.wall_s}}}});
  }
  j["panels"] = nlohmann::json::array();
  for (const Panel& p : panels) {
    nlohmann::json jp = {{"id", p.spec->id},
                         {"title", p.spec->title},
                         {"log_y", p.ya.log},
                         {"area", {{"x", p.px}, {"y", p.py}, {"w", p.pw}, {"h", p.ph}}},
                         {"series", nlohmann::json::array()}};
    for (const DrawnSeries& s : p.series) {
      nlohmann::json steps = nlohmann::json::array(), pts = nlohmann::json::array();
      for (auto& q : s.points) {
        steps.push_back(q.step);
        pts.push_back({q.x, q.y});
      }
      jp["series"].push_back({{"run", runs[s.run].name},
                              {"key", s.key},
                              {"source_points", s.source_points},
                              {"steps", steps},
                              {"points", pts}});
    }
    j["panels"].push_back(jp);
  }
  return j;
}

cairo_status_t append_to_string(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

std::string lower_extension(const fsys::path& p) {
  std::string e = p.extension().string();
  for (char& ch : e) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return e;
}

// Text for HTML element content and attribute values: a run is named after its folder, and a
// folder name may hold any of these.
std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += ch;
    }
  }
  return out;
}

// One self-contained page: Cairo's SVG of the panels inline (drawn with the legend, without the
// summary table), the runs with their colours and metrics files, and the summary as a table
// whose cells are text a browser can select and copy.
std::string html_page(const std::string& svg_document, const std::vector<RunData>& runs, const std::vector<Rgb>& colours,
                      XAxis xaxis) {
  // Inline SVG in HTML takes the <svg> element alone, not the XML declaration before it.
  const size_t at = svg_document.find("<svg");
  if (at == std::string::npos) throw RuntimeError("Cairo's SVG output has no <svg> element");
  std::string svg = svg_document.substr(at);
  while (!svg.empty() && std::isspace(static_cast<unsigned char>(svg.back()))) svg.pop_back();
  std::string h;
  h += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  h += "<title>Primus training report</title>\n<style>\n"
       "body{font-family:sans-serif;background:#f7f7f7;color:#1a1a1a;margin:16px}\n"
       "div.charts svg{max-width:100%;height:auto}\n"
       "table{border-collapse:collapse;background:#fff;margin:8px 0}\n"
       "th,td{padding:4px 12px;border-bottom:1px solid #ddd;text-align:right}\n"
       "th.run,td.run{text-align:left}\n"
       "span.swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:middle}\n"
       "</style>\n</head>\n<body>\n";
  h += fmt::format("<p>{} run{}, aligned by {}.</p>\n", runs.size(), runs.size() == 1 ? "" : "s",
                   xaxis == XAxis::Step ? "step" : "tokens seen");
  h += "<div class=\"charts\">\n" + svg + "\n</div>\n";
  h += "<h2>Summary</h2>\n<table class=\"summary\">\n<thead><tr>";
  const std::vector<std::string> head = summary_header();
  for (size_t c = 0; c < head.size(); ++c)
    h += fmt::format("<th{}>{}</th>", c == 0 ? " class=\"run\"" : "", html_escape(head[c]));
  h += "<th class=\"run\">metrics</th></tr></thead>\n<tbody>\n";
  for (size_t r = 0; r < runs.size(); ++r) {
    const std::vector<std::string> cells = summary_cells(summarize(runs[r]));
    h += "<tr>";
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c == 0)
        h += fmt::format("<td class=\"run\"><span class=\"swatch\" style=\"background:{}\"></span>{}</td>",
                         hex_colour(colours[r]), html_escape(cells[c]));
      else
        h += "<td>" + html_escape(cells[c]) + "</td>";
    }
    h += "<td class=\"run\"><code>" + html_escape(runs[r].metrics.string()) + "</code></td></tr>\n";
  }
  h += "</tbody>\n</table>\n</body>\n</html>\n";
  return h;
}

void check_cairo(const CairoApi& c, cairo_status_t st, const fsys::path& out, const char* what) {
  if (st != CAIRO_STATUS_SUCCESS)
    throw RuntimeError(fmt::format("drawing '{}' failed ({}): {}", out.string(), what, c.cairo_status_to_string(st)));
}

}  // namespace

void check_output_path(const fsys::path& out) {
  const std::string e = lower_extension(out);
  if (e != ".png" && e != ".svg" && e != ".pdf" && e != ".html") {
    throw UsageError(fmt::format("'{}': unknown output extension '{}'; use .png, .svg, .pdf or .html", out.string(),
                                 out.extension().string()));
  }
}

void write_report(const std::vector<RunData>& runs, const ReportOptions& opts) {
  check_output_path(opts.out);
  if (runs.empty()) throw UsageError("primus report: no runs given");
  if (opts.x == XAxis::Tokens) {
    for (const RunData& r : runs)
      if (!r.has_tokens)
        throw UsageError(fmt::format("run '{}' ({}) has no token counts (no tokens_per_s and step_s); use --x step",
                                     r.name, r.metrics.string()));
  }
  const CairoApi& c = cairo();
  // Every Cairo object is gone when the caches are released (on the way out, also after an
  // error), so reports are drawn one at a time.
  static std::mutex one_at_a_time;
  std::lock_guard lock(one_at_a_time);
  struct ReleaseCaches {
    ~ReleaseCaches() {
      try {
        release_cairo_caches();
      } catch (...) {  // Cairo loaded above; nothing to release otherwise
      }
    }
  } release_at_exit;
  std::vector<Rgb> colours;
  for (size_t r = 0; r < runs.size(); ++r) colours.push_back(run_colour(r));
  const std::vector<PanelSpec> specs = report_panels(opts.log_loss);
  std::vector<Panel> panels = collect_panels(specs, runs, opts.x);
  for (Panel& p : panels) set_axes(p);

  // Text is measured on a scratch surface: an image surface's size is fixed at creation, and the
  // height depends on how the legend wraps.
  const std::string ext = lower_extension(opts.out);
  const bool html = ext == ".html";
  Layout L;
  {
    SurfacePtr scratch = own(c, c.cairo_image_surface_create(CAIRO_FORMAT_ARGB32, 1, 1));
    ContextPtr cr = own(c, c.cairo_create(scratch.get()));
    Painter pt(c, cr.get());
    L = layout(pt, runs, panels.size(), /*table=*/!html);
  }
  std::string bytes;
  auto draw_on = [&](cairo_surface_t* s) {
    check_cairo(c, c.cairo_surface_status(s), opts.out, "surface");
    ContextPtr cr = own(c, c.cairo_create(s));
    Painter pt(c, cr.get());
    draw_report(pt, runs, panels, L, opts.x, colours, /*table=*/!html);
    check_cairo(c, c.cairo_status(cr.get()), opts.out, "drawing");
  };
  if (ext == ".png") {
    SurfacePtr s =
        own(c, c.cairo_image_surface_create(CAIRO_FORMAT_ARGB32, static_cast<int>(kWidth), static_cast<int>(L.height)));
    draw_on(s.get());
    check_cairo(c, c.cairo_surface_write_to_png_stream(s.get(), append_to_string, &bytes), opts.out, "PNG encoding");
  } else {
    const bool pdf = ext == ".pdf";
    SurfacePtr s = own(c, pdf ? c.cairo_pdf_surface_create_for_stream(append_to_string, &bytes, kWidth, L.height)
                              : c.cairo_svg_surface_create_for_stream(append_to_string, &bytes, kWidth, L.height));
    draw_on(s.get());
    c.cairo_surface_finish(s.get());  // writes the document's tail into `bytes`
    check_cairo(c, c.cairo_surface_status(s.get()), opts.out, pdf ? "PDF" : "SVG");
    if (html) bytes = html_page(bytes, runs, colours, opts.x);
  }
  if (opts.out.has_parent_path()) fsys::create_directories(opts.out.parent_path());
  fs::atomic_write_file(opts.out, bytes);
  if (!opts.json.empty()) fs::atomic_write_file(opts.json, describe(runs, panels, opts, colours, L.height).dump(1) + "\n");
}

void write_end_of_run_report(const fsys::path& metrics) {
  if (metrics.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const fsys::path out = metrics.parent_path() / "report.png";
  try {
    std::vector<RunData> runs;
    runs.push_back(load_run(metrics));
    runs.back().name = metrics.parent_path().filename().string();
    ReportOptions opts;
    opts.out = out;
    write_report(runs, opts);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    spdlog::info("[report] charts of this run: {} ({:.0f} ms; compare runs with `primus report DIR...`)", out.string(), ms);
  } catch (const std::exception& e) {
    spdlog::warn("[report] {} not written: {} (the run itself is complete; report_at_end=false skips this)",
                 out.string(), e.what());
  }
}

}  // namespace primus::report
