// primus report --out x.html: one self-contained page with Cairo's SVG of the panels inline and the
// summary as an HTML table. The page is read back with a small tokenizer that checks what a
// browser relies on (every element closed in order, text and attribute values free of raw '<' and
// of '&' that is not an entity), then its structure: one <svg> (Cairo's, the height the --json
// sidecar gives), one table row per run whose first cell is the run's name, and a run named after
// a folder holding `<&>"` appears only escaped.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/util/fs.h"
#include "report/report.h"

namespace fsys = std::filesystem;
using namespace primus::report;

namespace {

struct HtmlElement {
  std::string name;
  std::vector<std::pair<std::string, std::string>> attrs;  // values decoded
  std::vector<HtmlElement> children;
  std::string text;  // decoded text directly inside this element (concatenated)
  const std::string* attr(const std::string& key) const {
    for (auto& [k, v] : attrs)
      if (k == key) return &v;
    return nullptr;
  }
};

// Decodes the entities the page may use; fails the test on an '&' that starts none of them.
std::string html_decode(const std::string& s, const std::string& where) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    const size_t semi = s.find(';', i);
    const std::string ent = semi == std::string::npos ? "" : s.substr(i + 1, semi - i - 1);
    if (ent == "amp") out += '&';
    else if (ent == "lt") out += '<';
    else if (ent == "gt") out += '>';
    else if (ent == "quot") out += '"';
    else if (ent == "#39") out += '\'';
    else if (ent.size() > 1 && ent[0] == '#' && ent.find_first_not_of("0123456789", 1) == std::string::npos)
      out += static_cast<char>(std::stoi(ent.substr(1)) & 0x7f);  // numeric references: ASCII is enough here
    else {
      ADD_FAILURE() << "unescaped '&' in " << where << ": " << s.substr(i, 20);
      out += '&';
      continue;
    }
    i = semi;
  }
  return out;
}

bool html_void_element(const std::string& n) {
  return n == "meta" || n == "br" || n == "img" || n == "hr" || n == "link" || n == "input";
}

// Parses the whole document into a tree under a synthetic root; fails the test on a tag closed
// out of order, one never closed, or a '<' that starts no tag.
HtmlElement parse_html(const std::string& doc) {
  HtmlElement root;
  root.name = "#root";
  std::vector<HtmlElement*> open = {&root};
  size_t i = 0;
  while (i < doc.size()) {
    if (doc[i] != '<') {
      const size_t next = doc.find('<', i);
      const std::string raw = doc.substr(i, next == std::string::npos ? std::string::npos : next - i);
      if (raw.find('>') != std::string::npos) ADD_FAILURE() << "raw '>' in text: " << raw.substr(0, 60);
      open.back()->text += html_decode(raw, "text of <" + open.back()->name + ">");
      i = next == std::string::npos ? doc.size() : next;
      continue;
    }
    if (doc.compare(i, 4, "<!--") == 0) {
      const size_t e = doc.find("-->", i);
      EXPECT_NE(e, std::string::npos) << "unterminated comment";
      i = e == std::string::npos ? doc.size() : e + 3;
      continue;
    }
    const size_t close = doc.find('>', i);
    if (close == std::string::npos) {
      ADD_FAILURE() << "'<' without a closing '>' at byte " << i;
      break;
    }
    std::string tag = doc.substr(i + 1, close - i - 1);
    i = close + 1;
    if (tag.empty() || tag[0] == '!' || tag[0] == '?') {  // doctype, XML declaration
      EXPECT_FALSE(tag.empty()) << "empty tag";
      continue;
    }
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (open.size() < 2 || open.back()->name != name) {
        ADD_FAILURE() << "</" << name << "> closes <" << open.back()->name << ">";
        break;
      }
      open.pop_back();
      continue;
    }
    const bool self_closing = tag.back() == '/';
    if (self_closing) tag.pop_back();
    HtmlElement el;
    size_t p = 0;
    while (p < tag.size() && !std::isspace(static_cast<unsigned char>(tag[p]))) ++p;
    el.name = tag.substr(0, p);
    EXPECT_EQ(el.name.find_first_of("<&\"'"), std::string::npos) << "tag name " << el.name;
    // Attributes: name="value" or name='value'.
    while (p < tag.size()) {
      while (p < tag.size() && std::isspace(static_cast<unsigned char>(tag[p]))) ++p;
      if (p >= tag.size()) break;
      const size_t eq = tag.find('=', p);
      if (eq == std::string::npos || eq + 1 >= tag.size() || (tag[eq + 1] != '"' && tag[eq + 1] != '\'')) {
        ADD_FAILURE() << "attribute without a quoted value in <" << tag.substr(0, 80) << ">";
        break;
      }
      const char q = tag[eq + 1];
      const size_t end = tag.find(q, eq + 2);
      if (end == std::string::npos) {
        ADD_FAILURE() << "unterminated attribute value in <" << tag.substr(0, 80) << ">";
        break;
      }
      const std::string raw = tag.substr(eq + 2, end - eq - 2);
      EXPECT_EQ(raw.find('<'), std::string::npos) << "raw '<' in an attribute of <" << el.name << ">";
      el.attrs.emplace_back(tag.substr(p, eq - p), html_decode(raw, "attribute of <" + el.name + ">"));
      p = end + 1;
    }
    open.back()->children.push_back(std::move(el));
    if (!self_closing && !html_void_element(open.back()->children.back().name))
      open.push_back(&open.back()->children.back());
  }
  EXPECT_EQ(open.size(), 1u) << "<" << open.back()->name << "> never closed";
  return root;
}

void find_all(const HtmlElement& e, const std::string& name, std::vector<const HtmlElement*>& out) {
  for (const HtmlElement& c : e.children) {
    if (c.name == name) out.push_back(&c);
    find_all(c, name, out);
  }
}
std::vector<const HtmlElement*> all_of(const HtmlElement& e, const std::string& name) {
  std::vector<const HtmlElement*> out;
  find_all(e, name, out);
  return out;
}
// The text of an element and everything inside it.
std::string deep_text(const HtmlElement& e) {
  std::string s = e.text;
  for (const HtmlElement& c : e.children) s += deep_text(c);
  return s;
}

class ReportHtmlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fsys::temp_directory_path() / ("primus_report_html_" + std::to_string(rd()));
    fsys::create_directories(dir_);
  }
  void TearDown() override { fsys::remove_all(dir_); }
  // A run of `steps` steps, validation every 5; `with_memory` adds the memory panel's keys.
  fsys::path write_run(const std::string& folder, int steps, double loss0, bool with_memory) {
    std::string s;
    for (int i = 1; i <= steps; ++i) {
      nlohmann::json j = {{"step", i}, {"loss", loss0 - 0.05 * i}, {"lr", 1e-3}, {"grad_norm", 1.0},
                          {"tokens_per_s", 1000.0}, {"step_s", 1.0}, {"tokens", 1000 * i}};
      if (with_memory) j["mem_gib"] = 0.5, j["arena_gib"] = 0.4;
      s += j.dump() + "\n";
      if (i % 5 == 0) s += nlohmann::json({{"step", i}, {"val_loss", loss0 - 0.04 * i}}).dump() + "\n";
    }
    const fsys::path d = dir_ / "runs" / folder;
    fsys::create_directories(d);
    std::ofstream(d / "metrics.jsonl") << s;
    return d;
  }
  fsys::path dir_;
};

TEST_F(ReportHtmlTest, OnePageWithCairosSvgAndTheSummaryAsATable) {
  const std::string odd = "x<&>\"y";  // a folder name is any bytes but '/'
  const auto runs = load_runs({write_run("plain", 20, 5.0, true), write_run(odd, 12, 4.0, false)});
  ASSERT_EQ(runs[1].name, odd);
  ReportOptions o;
  o.out = dir_ / "out" / "Report.HTML";  // the extension in any case
  o.json = dir_ / "r.json";
  write_report(runs, o);
  const std::string doc = primus::fs::read_file(o.out);
  EXPECT_EQ(doc.rfind("<!DOCTYPE html>", 0), 0u) << doc.substr(0, 60);
  // Self-contained: nothing fetched from elsewhere.
  EXPECT_EQ(doc.find(" src="), std::string::npos);
  EXPECT_EQ(doc.find("<link"), std::string::npos);
  EXPECT_EQ(doc.find("<?xml"), std::string::npos);  // the SVG inlined without its XML declaration
  // The odd name never appears raw, only escaped.
  EXPECT_EQ(doc.find(odd), std::string::npos);
  EXPECT_EQ(doc.find("x<&"), std::string::npos);
  EXPECT_NE(doc.find("x&lt;&amp;&gt;&quot;y"), std::string::npos);

  const HtmlElement root = parse_html(doc);
  if (::testing::Test::HasFailure()) return;  // the structure checks below would only repeat it
  ASSERT_EQ(root.children.size(), 1u);
  const HtmlElement& html = root.children[0];
  EXPECT_EQ(html.name, "html");
  ASSERT_EQ(all_of(html, "head").size(), 1u);
  ASSERT_EQ(all_of(html, "body").size(), 1u);

  // One chart set: exactly one <svg>, Cairo's (glyphs and paths, not text elements), as tall as
  // the drawing the --json sidecar describes.
  const auto svgs = all_of(html, "svg");
  ASSERT_EQ(svgs.size(), 1u);
  const HtmlElement& svg = *svgs[0];
  const auto j = nlohmann::json::parse(primus::fs::read_file(o.json));
  ASSERT_NE(svg.attr("height"), nullptr);
  EXPECT_NEAR(std::stod(*svg.attr("height")), j["height"].get<double>(), 1.0);
  ASSERT_NE(svg.attr("width"), nullptr);
  EXPECT_NEAR(std::stod(*svg.attr("width")), j["width"].get<double>(), 1.0);
  EXPECT_GT(all_of(svg, "path").size(), 20u);
  EXPECT_TRUE(all_of(svg, "text").empty());
  // The panels drawn: loss, lr, grad norm, throughput, memory (from "plain" alone).
  EXPECT_EQ(j["panels"].size(), 5u);

  // The summary: a header and one row per run, in order, the first cell the run's name.
  const auto tables = all_of(html, "table");
  ASSERT_EQ(tables.size(), 1u);
  const auto heads = all_of(*tables[0], "th");
  ASSERT_FALSE(heads.empty());
  EXPECT_EQ(deep_text(*heads[0]), "run");
  const auto bodies = all_of(*tables[0], "tbody");
  ASSERT_EQ(bodies.size(), 1u);
  const auto rows = all_of(*bodies[0], "tr");
  ASSERT_EQ(rows.size(), 2u);
  const std::vector<std::string> want_names = {"plain", odd};
  const std::vector<std::string> want_steps = {"20", "12"};
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto cells = all_of(*rows[r], "td");
    ASSERT_EQ(cells.size(), heads.size()) << "row " << r;
    EXPECT_EQ(deep_text(*cells[0]), want_names[r]);
    EXPECT_EQ(deep_text(*cells[1]), want_steps[r]);
    // The run's colour swatch, the colour the charts give it.
    const auto sw = all_of(*cells[0], "span");
    ASSERT_EQ(sw.size(), 1u);
    ASSERT_NE(sw[0]->attr("style"), nullptr);
    EXPECT_NE(sw[0]->attr("style")->find(j["runs"][r]["color"].get<std::string>()), std::string::npos);
    // The metrics file read, for finding the run again.
    EXPECT_EQ(deep_text(*cells.back()), runs[r].metrics.string());
  }
  // The final losses as the text table prints them.
  EXPECT_EQ(deep_text(*all_of(*rows[0], "td")[2]), summary_cells(summarize(runs[0]))[2]);
}

TEST_F(ReportHtmlTest, TheSvgLeavesTheTableToTheHtml) {
  // The inlined drawing is the SVG report without its summary rows: shorter by them.
  const auto runs = load_runs({write_run("a", 10, 5.0, false), write_run("b", 10, 4.5, false)});
  ReportOptions svg, html;
  svg.out = dir_ / "r.svg";
  svg.json = dir_ / "svg.json";
  html.out = dir_ / "r.html";
  html.json = dir_ / "html.json";
  write_report(runs, svg);
  write_report(runs, html);
  const double h_svg = nlohmann::json::parse(primus::fs::read_file(svg.json))["height"].get<double>();
  const double h_html = nlohmann::json::parse(primus::fs::read_file(html.json))["height"].get<double>();
  EXPECT_GT(h_svg - h_html, 24.0 * 3);  // a header and two rows of 24 points, at least
  EXPECT_LT(h_svg - h_html, 200.0);
}

}  // namespace
