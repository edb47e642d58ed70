// docs/environment.md against the sources: every string literal in the product code that starts
// with PRIMUS_ is an environment variable the code reads (or is allow-listed below), and each
// needs a table row of its own in the doc, so that a new switch cannot ship undocumented. The
// reverse check catches rows whose variable is gone from the tree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fsys = std::filesystem;

namespace {

const fsys::path kRoot = PRIMUS_SOURCE_DIR;
constexpr const char* kDoc = "docs/environment.md";
// The product code: what the primus binary and its libraries are built from.
const std::vector<std::string> kProductDirs = {"backends", "turbo", "core", "train", "cli", "io", "data", "parallel",
                                                "report"};
const std::vector<std::string> kProductExts = {".cpp", ".cu", ".h", ".cuh"};

// Literals that start with PRIMUS_ but are not a variable the code reads, with the reason.
const std::map<std::string, std::string> kNotVariables = {
    // backend_manager.cpp builds PRIMUS_TURBO_<OP>_BACKEND from this prefix and the op's name;
    // the doc has a row for the pattern and a table of the ops.
    {"PRIMUS_TURBO_", "a prefix"},
};

struct Literal {
  std::string text;  // as written between the quotes, escapes not processed
  int line = 0;
};

bool ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// The string literals of C++ / CUDA source, raw strings included, outside comments and
// character literals; digit separators (1'000) are not taken for character literals.
std::vector<Literal> string_literals(const std::string& s) {
  std::vector<Literal> out;
  const size_t n = s.size();
  size_t i = 0;
  int line = 1;
  auto skip_to = [&](size_t end) {
    line += static_cast<int>(std::count(s.begin() + static_cast<std::ptrdiff_t>(i),
                                        s.begin() + static_cast<std::ptrdiff_t>(end), '\n'));
    i = end;
  };
  // A quoted run from s[i] (the opening quote) to the matching unescaped quote, or the line's end.
  auto quoted = [&](char q) {
    size_t j = i + 1;
    while (j < n && s[j] != q && s[j] != '\n') j += s[j] == '\\' ? 2 : 1;
    j = std::min(j, n);
    Literal lit{s.substr(i + 1, j - i - 1), line};
    skip_to(j < n && s[j] == q ? j + 1 : j);
    return lit;
  };
  while (i < n) {
    const char c = s[i];
    if (c == '/' && i + 1 < n && s[i + 1] == '/') {
      const size_t end = s.find('\n', i);
      skip_to(end == std::string::npos ? n : end);
    } else if (c == '/' && i + 1 < n && s[i + 1] == '*') {
      const size_t end = s.find("*/", i + 2);
      skip_to(end == std::string::npos ? n : end + 2);
    } else if (std::isdigit(static_cast<unsigned char>(c))) {  // a number, separators and exponents included
      size_t j = i + 1;
      while (j < n && (ident_char(s[j]) || s[j] == '.' || s[j] == '\'' ||
                       ((s[j] == '+' || s[j] == '-') && std::strchr("eEpP", s[j - 1]))))
        ++j;
      skip_to(j);
    } else if (ident_char(c)) {
      size_t j = i;
      while (j < n && ident_char(s[j])) ++j;
      const std::string word = s.substr(i, j - i);
      skip_to(j);
      const bool raw = word == "R" || word == "u8R" || word == "LR" || word == "uR" || word == "UR";
      if (raw && i < n && s[i] == '"') {
        const size_t open = s.find('(', i);
        if (open == std::string::npos) break;
        std::string close(1, ')');  // ")delim\"", built in steps: g++ 12 misreads the one-liner (-Wrestrict)
        close.append(s, i + 1, open - i - 1).push_back('"');
        size_t end = s.find(close, open);
        if (end == std::string::npos) end = n;
        out.push_back({s.substr(open + 1, end - open - 1), line});
        skip_to(std::min(n, end + close.size()));
      }
      // Other prefixes (u8, L, u, U) leave the quote that follows to the next round.
    } else if (c == '"') {
      out.push_back(quoted('"'));
    } else if (c == '\'') {
      quoted('\'');
    } else {
      skip_to(i + 1);
    }
  }
  return out;
}

// "PRIMUS_X" from a literal that starts with PRIMUS_ and at least one [A-Z0-9_]; "" otherwise.
std::string variable_name(const std::string& literal) {
  const std::string prefix = "PRIMUS_";
  if (literal.rfind(prefix, 0) != 0) return "";
  size_t j = prefix.size();
  while (j < literal.size() && (std::isupper(static_cast<unsigned char>(literal[j])) ||
                                std::isdigit(static_cast<unsigned char>(literal[j])) || literal[j] == '_'))
    ++j;
  return j > prefix.size() ? literal.substr(0, j) : "";
}

std::string read_text(const fsys::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool has_ext(const fsys::path& p, const std::vector<std::string>& exts) {
  return std::find(exts.begin(), exts.end(), p.extension().string()) != exts.end();
}

// Files under root/dir with one of `exts`, sorted (the order of failure messages is stable).
std::vector<fsys::path> files_under(const std::vector<std::string>& dirs, const std::vector<std::string>& exts) {
  std::vector<fsys::path> out;
  for (const auto& d : dirs) {
    if (!fsys::is_directory(kRoot / d)) continue;
    for (const auto& e : fsys::recursive_directory_iterator(kRoot / d))
      if (e.is_regular_file() && has_ext(e.path(), exts)) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Variable -> "file:line" of every literal that names it.
std::map<std::string, std::vector<std::string>> variables_in_product_code() {
  std::map<std::string, std::vector<std::string>> found;
  for (const auto& file : files_under(kProductDirs, kProductExts)) {
    const std::string rel = fsys::relative(file, kRoot).string();
    for (const Literal& lit : string_literals(read_text(file))) {
      if (std::string name = variable_name(lit.text); !name.empty())
        found[name].push_back(rel + ":" + std::to_string(lit.line));
    }
  }
  return found;
}

// The PRIMUS_ names in the first cell of the doc's table rows, in `code` spans.
std::set<std::string> documented_rows(const std::string& doc) {
  std::set<std::string> rows;
  std::istringstream in(doc);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| ", 0) != 0) continue;
    const size_t end = line.find(" |", 1);
    if (end == std::string::npos) continue;
    const std::string cell = line.substr(2, end - 2);
    for (size_t open = cell.find('`'); open != std::string::npos; open = cell.find('`', open)) {
      const size_t close = cell.find('`', open + 1);
      if (close == std::string::npos) break;
      const std::string span = cell.substr(open + 1, close - open - 1);
      if (variable_name(span) == span) rows.insert(span);
      open = close + 1;
    }
  }
  return rows;
}

bool contains_word(const std::string& text, const std::string& word) {
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const bool before = at == 0 || !ident_char(text[at - 1]);
    const bool after = at + word.size() >= text.size() || !ident_char(text[at + word.size()]);
    if (before && after) return true;
  }
  return false;
}

TEST(EnvironmentDocScanner, FindsLiteralsOutsideCommentsAndCharacters) {
  const std::string src =
      "// \"PRIMUS_IN_LINE_COMMENT\"\n"
      "/* \"PRIMUS_IN_BLOCK\n COMMENT\" */ int big = 1'000'000; char q = '\"';\n"
      "auto a = std::getenv(\"PRIMUS_PLAIN\"); auto b = \"esc\\\"aped\";\n"
      "auto r = R\"x(PRIMUS_RAW \"quoted\" )\" inside)x\"; auto c = u8\"PRIMUS_U8\";\n"
      "auto d = \"PRIMUS_WITH_TAIL={}\"; auto e = \"PRIMUS_TURBO_\"; auto f = \"PRIMUS_lower\";\n";
  std::vector<std::string> names;
  std::vector<int> lines;
  for (const Literal& l : string_literals(src)) {
    if (std::string v = variable_name(l.text); !v.empty()) {
      names.push_back(v);
      lines.push_back(l.line);
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"PRIMUS_PLAIN", "PRIMUS_RAW", "PRIMUS_U8", "PRIMUS_WITH_TAIL",
                                             "PRIMUS_TURBO_"}));
  EXPECT_EQ(lines, (std::vector<int>{4, 5, 5, 6, 6}));
  EXPECT_EQ(documented_rows("| `PRIMUS_A` | x |\n| `PRIMUS_B`, `PRIMUS_C` | y |\n| `gemm` | `PRIMUS_D` |\n"
                            "text `PRIMUS_E`\n| `PRIMUS_TURBO_<OP>_BACKEND` | z |\n"),
            (std::set<std::string>{"PRIMUS_A", "PRIMUS_B", "PRIMUS_C"}));
}

TEST(EnvironmentDoc, EveryVariableTheCodeReadsHasARow) {
  const auto found = variables_in_product_code();
  ASSERT_GE(found.size(), 20u) << "too few PRIMUS_ literals under " << kRoot << ": is PRIMUS_SOURCE_DIR right?";
  const std::string doc = read_text(kRoot / kDoc);
  ASSERT_FALSE(doc.empty()) << kRoot / kDoc << " is missing or empty";
  const std::set<std::string> rows = documented_rows(doc);
  for (const auto& [name, where] : found) {
    if (kNotVariables.count(name)) continue;
    if (rows.count(name)) continue;
    std::string places;
    for (const auto& w : where) places += (places.empty() ? "" : ", ") + w;
    ADD_FAILURE() << name << " is named by the string literals at " << places << " but " << kDoc
                  << " has no table row for it: add one whose first cell is `" << name << "`";
  }
  for (const auto& [name, why] : kNotVariables) {
    EXPECT_TRUE(found.count(name)) << "the allow-listed literal \"" << name << "\" (" << why
                                   << ") is gone from the sources: drop it from kNotVariables";
  }
}

TEST(EnvironmentDoc, EveryRowNamesAVariableStillInTheTree) {
  const std::set<std::string> rows = documented_rows(read_text(kRoot / kDoc));
  ASSERT_FALSE(rows.empty()) << kRoot / kDoc << " has no rows";
  // Where variables are read or set: the product, the tests and tools, the example configs.
  std::vector<std::string> dirs = kProductDirs;
  for (const char* d : {"tests", "fuzz", "scripts", "bench/tools", "examples"}) dirs.push_back(d);
  const fsys::path self = fsys::path(__FILE__).filename();
  std::string tree;
  for (const auto& file : files_under(dirs, {".cpp", ".cu", ".h", ".cuh", ".sh", ".py", ".yaml"}))
    if (file.filename() != self) tree += read_text(file) + "\n";
  for (const auto& name : rows)
    EXPECT_TRUE(contains_word(tree, name)) << kDoc << " has a row for " << name
                                           << ", which nothing in the tree mentions any more: remove the row";
}

}  // namespace
