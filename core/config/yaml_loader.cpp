#include "core/config/yaml_loader.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <regex>

#include "core/util/error.h"
#include "core/util/fs.h"

namespace primus::config {

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

std::string interpolate(const std::string& text, const EnvLookup& env, const Origin& where) {
  std::string out;
  size_t pos = 0;
  while (true) {
    size_t start = text.find("${", pos);
    if (start == std::string::npos) {
      out.append(text, pos, std::string::npos);
      return out;
    }
    out.append(text, pos, start - pos);
    size_t end = text.find('}', start);
    if (end == std::string::npos) {
      throw ConfigError(fmt::format("{}: unterminated '${{' in '{}'", where.str(), text));
    }
    std::string body = text.substr(start + 2, end - start - 2);
    size_t colon = body.find(':');
    std::string name = body.substr(0, colon);
    static const std::regex kName("[A-Za-z_][A-Za-z0-9_]*");
    if (!std::regex_match(name, kName)) {
      throw ConfigError(fmt::format("{}: '${{{}}}' is not a valid variable reference "
                                    "(use ${{NAME}} or ${{NAME:default}})",
                                    where.str(), body));
    }
    auto value = env(name);
    if (value) {
      out += *value;
    } else if (colon != std::string::npos) {
      out += body.substr(colon + 1);
    } else {
      throw ConfigError(fmt::format(
          "{}: environment variable '{}' is not set (used as ${{{}}}); set it or give a default "
          "with ${{{}:default}}",
          where.str(), name, name, name));
    }
    pos = end + 1;
  }
}

Value typed_scalar(const std::string& t, const Origin& origin) {
  static const std::regex kInt("[-+]?(0|[1-9][0-9]*)");
  static const std::regex kHex("0x[0-9a-fA-F]+");
  static const std::regex kFloat(
      "[-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\\.(inf|Inf|INF)|\\.(nan|NaN|NAN)");
  if (t.empty() || t == "~" || t == "null" || t == "Null" || t == "NULL") return Value::null(origin);
  if (t == "true" || t == "True" || t == "TRUE") return Value::boolean(true, origin);
  if (t == "false" || t == "False" || t == "FALSE") return Value::boolean(false, origin);
  if (std::regex_match(t, kInt) || std::regex_match(t, kHex)) {
    errno = 0;
    char* end = nullptr;
    long long v = std::strtoll(t.c_str(), &end, 0);
    if (errno == ERANGE) {
      throw ConfigError(fmt::format("{}: integer '{}' is out of range", origin.str(), t));
    }
    return Value::integer(v, origin);
  }
  if (std::regex_match(t, kFloat)) {
    std::string s = t;
    std::string lower = s;
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    if (lower.find("inf") != std::string::npos) {
      return Value::floating(lower[0] == '-' ? -HUGE_VAL : HUGE_VAL, origin);
    }
    if (lower.find("nan") != std::string::npos) return Value::floating(NAN, origin);
    return Value::floating(std::strtod(s.c_str(), nullptr), origin);
  }
  return Value::string(t, origin);
}

namespace {


void check_utf8_impl(const Value& v, const std::string& key) {
  if (v.kind() == Value::Kind::String && !valid_utf8(v.as_string())) {
    throw ConfigError(fmt::format("{}: the value of '{}' is not valid UTF-8", v.origin().str(), key));
  }
  if (v.is_list())
    for (auto& it : v.items()) check_utf8_impl(it, key);
}

Origin origin_of(const YAML::Node& n, const std::string& file) {
  auto m = n.Mark();
  if (m.line < 0) return {file, 0, 0};
  return {file, m.line + 1, m.column + 1};
}

// Aliases make a YAML document a graph: an anchor used inside its own definition is a cycle,
// and aliases of aliases expand exponentially ("billion laughs"). Both are refused, naming the
// file and line, instead of recursing until the stack overflows or memory runs out.
constexpr int kMaxYamlDepth = 64;
constexpr int64_t kMaxYamlValues = 1'000'000;

struct ConvertBudget {
  int depth = 0;
  int64_t values = 0;
};

Value convert(const YAML::Node& n, const std::string& file, const EnvLookup& env, ConvertBudget& budget) {
  Origin o = origin_of(n, file);
  if (budget.depth >= kMaxYamlDepth) {
    throw ConfigError(fmt::format("{}: values nested more than {} deep (an anchor used inside its own definition?)",
                                  o.str(), kMaxYamlDepth));
  }
  if (++budget.values > kMaxYamlValues) {
    throw ConfigError(fmt::format("{}: the document expands to more than {} values (aliases of aliases?)", o.str(),
                                  kMaxYamlValues));
  }
  struct Nest {
    int& d;
    explicit Nest(int& depth) : d(depth) { ++d; }
    ~Nest() { --d; }
  } nest(budget.depth);
  switch (n.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined: return Value::null(o);
    case YAML::NodeType::Scalar: {
      std::string text = interpolate(n.Scalar(), env, o);
      // yaml-cpp tags quoted scalars "!" and plain ones "?": only plain scalars are typed.
      if (n.Tag() == "!") return Value::string(text, o);
      return typed_scalar(text, o);
    }
    case YAML::NodeType::Sequence: {
      std::vector<Value> items;
      for (const auto& item : n) items.push_back(convert(item, file, env, budget));
      return Value::list(std::move(items), o);
    }
    case YAML::NodeType::Map: {
      Value m = Value::map(o);
      for (const auto& kv : n) {
        Origin ko = origin_of(kv.first, file);
        if (!kv.first.IsScalar()) {
          throw ConfigError(fmt::format("{}: mapping keys must be plain words", ko.str()));
        }
        std::string key = kv.first.Scalar();
        if (!valid_utf8(key)) throw ConfigError(fmt::format("{}: a key is not valid UTF-8", ko.str()));
        if (const Value* prev = m.find(key)) {
          throw ConfigError(fmt::format("{}: key '{}' is set twice in the same mapping "
                                        "(first at line {})",
                                        ko.str(), key, prev->origin().line));
        }
        Value v = convert(kv.second, file, env, budget);
        check_utf8_impl(v, key);
        // A key with no value (`key:`) takes the key's position so errors point at it.
        if (v.is_null() && v.origin().line == 0) v.set_origin(ko);
        m.set(key, std::move(v));
      }
      return m;
    }
  }
  return Value::null(o);
}

Value parse_node_text(const std::string& text, const std::string& name, const EnvLookup& env) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    throw ConfigError(fmt::format("{}:{}:{}: YAML syntax error: {}", name, e.mark.line + 1,
                                  e.mark.column + 1, e.msg));
  }
  ConvertBudget budget;
  Value v = convert(root, name, env, budget);
  if (v.is_null()) return Value::map({name, 1, 1});
  if (!v.is_map()) {
    throw ConfigError(fmt::format("{}: a config file must be a mapping of keys to values, "
                                  "found a {}",
                                  v.origin().str(), Value::kind_name(v.kind())));
  }
  return v;
}

Value load_with_chain(const std::filesystem::path& path, const LoadOptions& opts,
                      std::vector<std::filesystem::path>& chain) {
  std::error_code ec;
  auto canonical = std::filesystem::weakly_canonical(path, ec);
  if (ec) canonical = path;
  for (size_t i = 0; i < chain.size(); ++i) {
    if (chain[i] == canonical) {
      std::string cycle;
      for (size_t j = i; j < chain.size(); ++j) cycle += chain[j].string() + " -> ";
      throw ConfigError(fmt::format("extends cycle: {}{}", cycle, canonical.string()));
    }
  }
  std::error_code file_ec;  // the non-throwing form: a name too long for the OS is "not found" too
  if (!std::filesystem::is_regular_file(path, file_ec)) {
    std::string why = file_ec ? fmt::format(" ({})", file_ec.message()) : "";
    std::string via = chain.empty() ? "" : fmt::format(" (extended from {})", chain.back().string());
    throw ConfigError(fmt::format("config file not found: {}{}{}", path.string(), why, via));
  }
  std::string text = fs::read_file(path);
  Value self = parse_node_text(text, path.string(), opts.env);
  if (opts.each_file) opts.each_file(self);
  Value* ext = self.find("extends");
  if (!ext) return self;

  std::vector<Value> bases;
  if (ext->is_list()) {
    bases = ext->items();
  } else {
    bases.push_back(*ext);
  }
  chain.push_back(canonical);
  Value merged = Value::map(self.origin());
  for (const Value& b : bases) {
    if (b.kind() != Value::Kind::String) {
      throw ConfigError(fmt::format("{}: `extends` takes a file name or a list of file names",
                                    b.origin().str()));
    }
    std::filesystem::path base = b.as_string();
    if (base.is_relative()) base = path.parent_path() / base;
    Value loaded;
    try {
      loaded = load_with_chain(base, opts, chain);
    } catch (const ConfigError& e) {
      std::string msg = e.what();
      if (msg.rfind("config file not found: " + base.string(), 0) != 0) throw;
      throw ConfigError(fmt::format("{}: `extends` names a file that cannot be read: {}", b.origin().str(), msg));
    }
    merge_into(merged, loaded, opts.notes);
  }
  chain.pop_back();
  self.erase("extends");
  merge_into(merged, self, opts.notes);
  return merged;
}

}  // namespace

// YAML is Unicode text; a byte string that is not UTF-8 would surface later as a JSON or
// terminal error far from its source, so it is refused here, naming the key.
bool valid_utf8(const std::string& s) {
  // RFC 3629 (what nlohmann::json accepts): no overlong forms, no surrogates, <= U+10FFFF.
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    unsigned char lo = 0x80, hi = 0xBF;  // bounds of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (n - i < static_cast<size_t>(len)) return false;
    if (p[i + 1] < lo || p[i + 1] > hi) return false;
    for (int k = 2; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
    }
    i += static_cast<size_t>(len);
  }
  return true;
}

void check_utf8(const Value& v, const std::string& key) { check_utf8_impl(v, key); }

Value parse_yaml_text(const std::string& text, const std::string& origin_name,
                      const LoadOptions& opts) {
  return parse_node_text(text, origin_name, opts.env);
}

Value load_yaml_file(const std::filesystem::path& path, const LoadOptions& opts) {
  std::vector<std::filesystem::path> chain;
  return load_with_chain(path, opts, chain);
}

}  // namespace primus::config
