#include "core/config/experiment.h"

#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <sstream>

#include "core/config/schema.h"
#include "core/util/error.h"

namespace primus::config {

namespace fsys = std::filesystem;

Value parse_override_value(const std::string& text, const Origin& origin) {
  if (!text.empty() && (text.front() == '[' || text.front() == '{')) {
    Value wrapped = parse_yaml_text("v: " + text, origin.file, LoadOptions{});
    Value v = *wrapped.find("v");
    // Every element of a flow value points at the command line.
    std::vector<Value*> stack{&v};
    while (!stack.empty()) {
      Value* cur = stack.back();
      stack.pop_back();
      cur->set_origin(origin);
      if (cur->is_list())
        for (auto& it : cur->items()) stack.push_back(&it);
      if (cur->is_map())
        for (auto& [k, it] : cur->entries()) stack.push_back(&it);
    }
    return v;
  }
  if (text.size() >= 2 && (text.front() == '"' || text.front() == '\'') && text.back() == text.front()) {
    return Value::string(text.substr(1, text.size() - 2), origin);
  }
  return typed_scalar(text, origin);
}

std::vector<CliOverride> parse_cli_overrides(const std::vector<std::string>& args) {
  std::vector<CliOverride> out;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    std::string key, value;
    if (a.rfind("--", 0) == 0) {
      a = a.substr(2);
      auto eq = a.find('=');
      if (eq != std::string::npos) {
        key = a.substr(0, eq);
        value = a.substr(eq + 1);
      } else {
        if (i + 1 >= args.size()) {
          throw UsageError(fmt::format("override '--{}' has no value (write --{} VALUE or {}=VALUE)",
                                       a, a, a));
        }
        key = a;
        value = args[++i];
      }
    } else {
      auto eq = a.find('=');
      if (eq == std::string::npos || eq == 0) {
        throw UsageError(fmt::format("cannot read '{}': overrides are key=value or --key value", a));
      }
      key = a.substr(0, eq);
      value = a.substr(eq + 1);
    }
    std::replace(key.begin(), key.end(), '-', '_');
    if (key.empty() || key.front() == '.' || key.back() == '.' || key.find("..") != std::string::npos) {
      throw UsageError(fmt::format("'{}' is not a valid config key", key));
    }
    if (!valid_utf8(key)) throw UsageError("a command-line override's key is not valid UTF-8");
    Origin o{fmt::format("<command line: {}={}>", key, value), 0, 0};
    Value v = parse_override_value(value, o);
    check_utf8(v, key);
    out.push_back({key, std::move(v)});
  }
  return out;
}

ConfigPaths ConfigPaths::defaults() {
  ConfigPaths p;
  if (const char* env = std::getenv("PRIMUS_CONFIG_DIR")) p.roots.emplace_back(env);
  // The binary lives in <repo>/build/bin; its configs are in <repo>/configs.
  std::error_code ec;
  auto exe = fsys::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (auto dir = exe.parent_path(); !dir.empty() && dir != dir.root_path(); dir = dir.parent_path()) {
      if (fsys::is_directory(dir / "configs" / "modules")) {
        p.roots.push_back(dir / "configs");
        break;
      }
    }
  }
#ifdef PRIMUS_SOURCE_DIR
  p.roots.emplace_back(fsys::path(PRIMUS_SOURCE_DIR) / "configs");
#endif
  return p;
}

fsys::path Experiment::output_dir() const {
  return fsys::path(workspace) / work_group / user_name / exp_name;
}

const ModuleSpec& Experiment::module(const std::string& name) const {
  std::vector<std::string> names;
  for (auto& m : modules) {
    if (m.name == name) return m;
    names.push_back(m.name);
  }
  throw ConfigError(fmt::format("{}: no module '{}' in this experiment (it has: {})",
                                file.string(), name, fmt::join(names, ", ")));
}

namespace {

const std::vector<std::string> kExperimentKeys = {"work_group", "user_name", "exp_name",
                                                  "workspace", "modules"};
const std::vector<std::string> kModuleKeys = {"framework", "config", "model", "overrides"};

std::string suggest(const std::string& key, const std::vector<std::string>& known) {
  std::string best;
  size_t bd = SIZE_MAX;
  for (auto& k : known) {
    size_t d = edit_distance(key, k);
    if (d < bd) bd = d, best = k;
  }
  return bd <= std::max<size_t>(2, key.size() / 3) ? fmt::format("; did you mean '{}'?", best) : "";
}

void check_keys(const Value& map, const std::vector<std::string>& known, const std::string& what) {
  for (auto& [k, v] : map.entries()) {
    if (std::find(known.begin(), known.end(), k) == known.end()) {
      throw ConfigError(fmt::format("{}: unknown {} key '{}'{} (known: {})", v.origin().str(), what,
                                    k, suggest(k, known), fmt::join(known, ", ")));
    }
  }
}

std::string string_field(const Value& map, const std::string& key, const std::string& def,
                         const Origin& where) {
  const Value* v = map.find(key);
  if (!v || v->is_null()) {
    if (def.empty()) {
      throw ConfigError(fmt::format("{}: required key '{}' is missing", where.str(), key));
    }
    return def;
  }
  if (!v->is_scalar()) {
    throw ConfigError(fmt::format("{}: '{}' must be a single value", v->origin().str(), key));
  }
  return v->scalar_text();
}

bool is_experiment_key(const std::string& key) {
  return key == "work_group" || key == "user_name" || key == "exp_name" || key == "workspace";
}

// A preset's name reduced to its letters and digits, lower case, without ".yaml" and a trailing
// version ("_v0.1"): Primus' mixtral_8x7B_v0.1.yaml and our mixtral-8x7B.yaml then match.
std::string preset_stem(const fsys::path& p) {
  std::string out;
  std::string n = p.filename().string();
  if (n.size() > 5 && n.compare(n.size() - 5, 5, ".yaml") == 0) n.resize(n.size() - 5);
  if (const size_t v = n.find_last_of("vV"); v != std::string::npos && v > 0 && v + 1 < n.size() &&
                                              (n[v - 1] == '_' || n[v - 1] == '-') &&
                                              n.find_first_not_of("0123456789.", v + 1) == std::string::npos)
    n.resize(v - 1);
  for (unsigned char c : n)
    if (std::isalnum(c)) out += static_cast<char>(std::tolower(c));
  return out;
}

// The model presets under the roots (folder/name.yaml) nearest to `name` by edit distance of their
// stems, at most three, each within a third of the name's stem.
std::vector<std::string> nearest_presets(const ConfigPaths& paths, const std::string& name) {
  const std::string want = preset_stem(name);
  if (want.empty()) return {};
  std::vector<std::pair<size_t, std::string>> scored;
  for (const auto& root : paths.roots) {
    std::error_code ec;
    const fsys::path models = root / "models";
    if (!fsys::is_directory(models, ec)) continue;
    for (fsys::recursive_directory_iterator it(models, ec), end; !ec && it != end; it.increment(ec)) {
      if (!it->is_regular_file(ec) || it->path().extension() != ".yaml") continue;
      const std::string stem = preset_stem(it->path());
      if (stem == "base") continue;
      const std::string rel = it->path().lexically_relative(models).generic_string();
      const size_t d = edit_distance(want, stem);
      if (d <= std::max<size_t>(2, want.size() / 3) &&
          std::none_of(scored.begin(), scored.end(), [&](const auto& e) { return e.second == rel; }))
        scored.emplace_back(d, rel);
    }
  }
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  for (const auto& [d, rel] : scored)
    if (out.size() < 3) out.push_back(rel);
  return out;
}

fsys::path find_preset(const Experiment& exp, const std::string& kind, const std::string& sub,
                       const std::string& name, const ConfigPaths& paths, const Origin& where) {
  std::vector<fsys::path> tried;
  fsys::path direct(name);
  if (direct.is_absolute()) {
    tried.push_back(direct);
  } else {
    tried.push_back(exp.file.parent_path() / name);
    for (auto& root : paths.roots) tried.push_back(root / kind / sub / name);
  }
  for (auto& p : tried) {
    std::error_code ec;  // e.g. a name too long for the OS: not found, not an exception
    if (fsys::is_regular_file(p, ec)) return p;
  }
  std::vector<std::string> s;
  for (auto& p : tried)
    if (std::find(s.begin(), s.end(), p.string()) == s.end()) s.push_back(p.string());
  std::string near;
  if (kind == "models") {
    const std::vector<std::string> presets = nearest_presets(paths, name);
    if (!presets.empty())
      near = fmt::format("; nearest here: {} (Primus' model files are not shipped: compare the preset's shape "
                         "with yours, `primus config show`)",
                         fmt::join(presets, ", "));
  }
  throw ConfigError(fmt::format("{}: {} preset '{}' not found (looked in: {}){}", where.str(),
                                kind == "models" ? "model" : "module", name, fmt::join(s, ", "), near));
}

}  // namespace

Experiment load_experiment(const fsys::path& file, std::vector<CliOverride> cli,
                           const LoadOptions& opts, const ConfigPaths& paths) {
  Experiment exp;
  exp.file = file;
  LoadOptions o = opts;
  o.notes = &exp.notes;
  Value root = load_yaml_file(file, o);
  if (const Value* platform = root.find("platform")) {
    throw ConfigError(fmt::format("{}: Primus' `platform` section is not read here: the ranks and nodes of a job come "
                                  "from `primus launch`, torchrun or Slurm (docs/launch.md), and the console's log "
                                  "level from stderr_sink_level or PRIMUS_LOG_LEVEL; remove the section",
                                  platform->origin().str()));
  }
  check_keys(root, kExperimentKeys, "experiment");
  Origin top{file.string(), 1, 1};
  exp.work_group = string_field(root, "work_group", "local", top);
  exp.user_name = string_field(root, "user_name", "local", top);
  exp.exp_name = string_field(root, "exp_name", file.stem().string(), top);
  exp.workspace = string_field(root, "workspace", "./output", top);
  const Value* modules = root.find("modules");
  if (!modules || !modules->is_map() || modules->entries().empty()) {
    throw ConfigError(fmt::format("{}: an experiment needs `modules:` with at least one module "
                                  "(e.g. pre_trainer: {{framework: reference, config: pretrain.yaml, "
                                  "model: gpt2/tiny.yaml}})",
                                  modules ? modules->origin().str() : top.str()));
  }
  for (auto& [name, m] : modules->entries()) {
    if (!m.is_map()) {
      throw ConfigError(fmt::format("{}: module '{}' must be a mapping with framework, config, "
                                    "model and overrides",
                                    m.origin().str(), name));
    }
    check_keys(m, kModuleKeys, fmt::format("module '{}'", name));
    ModuleSpec spec;
    spec.name = name;
    spec.origin = m.origin();
    spec.framework = string_field(m, "framework", "", m.origin());
    spec.config = string_field(m, "config", "pretrain.yaml", m.origin());
    spec.model = m.find("model") ? string_field(m, "model", "", m.origin()) : "";
    if (const Value* ov = m.find("overrides"); ov && !ov->is_null()) {
      if (!ov->is_map()) {
        throw ConfigError(fmt::format("{}: `overrides` must be a mapping of keys to values",
                                      ov->origin().str()));
      }
      spec.overrides = *ov;
    }
    exp.modules.push_back(std::move(spec));
  }
  // Experiment-level keys from the command line apply now; the rest wait for the module.
  for (auto& c : cli) {
    if (!is_experiment_key(c.key)) continue;
    std::string before = c.key == "work_group" ? exp.work_group
                         : c.key == "user_name" ? exp.user_name
                         : c.key == "exp_name"  ? exp.exp_name
                                                : exp.workspace;
    const Value* prev = root.find(c.key);
    exp.notes.push_back({c.key, prev ? prev->origin() : Origin{"<default>", 0, 0}, c.value.origin(),
                         before, c.value.scalar_text()});
    std::string v = c.value.scalar_text();
    if (c.key == "work_group") exp.work_group = v;
    if (c.key == "user_name") exp.user_name = v;
    if (c.key == "exp_name") exp.exp_name = v;
    if (c.key == "workspace") exp.workspace = v;
  }
  exp.cli = std::move(cli);
  (void)paths;
  return exp;
}

ModuleConfig resolve_module(const Experiment& exp, const std::string& module, const Schema& schema,
                            const LoadOptions& opts, const ConfigPaths& paths) {
  const ModuleSpec& spec = exp.module(module);
  ModuleConfig out;
  out.module = module;
  out.framework = spec.framework;
  LoadOptions o = opts;
  o.notes = &out.notes;

  // Each layer's aliases become their targets before it merges (Schema::translate_aliases): each
  // file of a preset's extends chain as it loads, the overrides and the command line here.
  o.each_file = [&schema](Value& file) {
    schema.read_int_bools(file);
    schema.translate_aliases(file);
  };
  auto merge_layer = [&](Value layer) {
    schema.read_int_bools(layer);
    schema.translate_aliases(layer);
    merge_into(out.params, layer, &out.notes);
  };
  if (!spec.model.empty()) {
    auto p = find_preset(exp, "models", "", spec.model, paths, spec.origin);
    merge_into(out.params, load_yaml_file(p, o), &out.notes);
    out.layers.push_back("model preset " + p.string());
  }
  {
    auto p = find_preset(exp, "modules", spec.framework, spec.config, paths, spec.origin);
    merge_into(out.params, load_yaml_file(p, o), &out.notes);
    out.layers.push_back("module preset " + p.string());
  }
  merge_layer(spec.overrides);
  out.layers.push_back("experiment overrides " + exp.file.string());

  std::string prefix = "modules." + module + ".";
  Value cli = Value::map({"<command line>", 0, 0});
  for (auto& c : exp.cli) {
    if (is_experiment_key(c.key)) continue;
    std::string key = c.key;
    if (key.rfind("modules.", 0) == 0) {
      if (key.rfind(prefix, 0) != 0) continue;  // another module's override
      key = key.substr(prefix.size());
    }
    // The same key twice on the command line: the last wins, reported like any other layer.
    Value one = Value::map(c.value.origin());
    one.set_path(key, c.value);
    merge_into(cli, one, &out.notes);
  }
  if (!cli.entries().empty()) {
    merge_layer(std::move(cli));
    out.layers.push_back("command line");
  }
  schema.validate(out.params);
  schema.apply_defaults(out.params);
  return out;
}

std::string render_yaml(const Value& params, bool explain) {
  if (!explain) return params.to_yaml();
  std::ostringstream out;
  size_t width = 0;
  auto flat = flatten(params);
  std::vector<std::string> lines;
  for (auto& [k, v] : flat) {
    std::string line = k + ": " + (v->is_list() ? v->to_json().dump() : v->scalar_text());
    width = std::max(width, line.size());
    lines.push_back(line);
  }
  for (size_t i = 0; i < flat.size(); ++i) {
    const Value* v = flat[i].second;
    out << lines[i] << std::string(width + 2 - lines[i].size(), ' ') << "# " << v->origin().str();
    if (!v->overridden().empty()) {
      out << "  (overrides";
      for (auto& o : v->overridden()) out << " " << o.str();
      out << ")";
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace primus::config
