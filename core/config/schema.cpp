#include "core/config/schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "core/util/error.h"

namespace primus::config {

const char* key_type_name(KeyType t) {
  switch (t) {
    case KeyType::Bool: return "boolean";
    case KeyType::Int: return "integer";
    case KeyType::Float: return "number";
    case KeyType::String: return "string";
    case KeyType::StringList: return "list of strings";
    case KeyType::List: return "list";
    case KeyType::Map: return "mapping";
    case KeyType::Any: return "any";
  }
  return "?";
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

Schema& Schema::add(KeySpec spec) {
  if (find(spec.key)) throw std::logic_error("schema key defined twice: " + spec.key);
  spec.default_value.set_origin({kSchemaDefaultOrigin, 0, 0});
  keys_.push_back(std::move(spec));
  return *this;
}

Schema& Schema::flag(const std::string& key, bool def, const std::string& doc) {
  return add({key, KeyType::Bool, Value::boolean(def), {}, {}, {}, doc});
}
Schema& Schema::integer(const std::string& key, std::optional<int64_t> def,
                        const std::string& doc, std::optional<double> min,
                        std::optional<double> max) {
  return add({key, KeyType::Int, def ? Value::integer(*def) : Value::null(), min, max, {}, doc});
}
Schema& Schema::number(const std::string& key, std::optional<double> def, const std::string& doc,
                       std::optional<double> min, std::optional<double> max) {
  return add({key, KeyType::Float, def ? Value::floating(*def) : Value::null(), min, max, {}, doc});
}
Schema& Schema::text(const std::string& key, std::optional<std::string> def,
                     const std::string& doc, std::vector<std::string> choices) {
  return add({key, KeyType::String, def ? Value::string(*def) : Value::null(), {}, {},
              std::move(choices), doc});
}
Schema& Schema::any(const std::string& key, KeyType type, const std::string& doc, Value def) {
  return add({key, type, std::move(def), {}, {}, {}, doc});
}

Schema& Schema::alias(const std::string& key, const std::string& target, Value if_true, Value if_false,
                      const std::string& doc) {
  if (find(key)) throw std::logic_error("alias shadows a schema key: " + key);
  if (!find(target)) throw std::logic_error("alias of an unknown key: " + key + " -> " + target);
  for (const KeyAlias& a : aliases_)
    if (a.key == key) throw std::logic_error("alias defined twice: " + key);
  aliases_.push_back({key, target, std::move(if_true), std::move(if_false), doc});
  return *this;
}

void Schema::translate_aliases(Value& layer) const {
  if (!layer.is_map()) return;
  for (const KeyAlias& a : aliases_) {
    const Value* v = layer.find(a.key);
    if (!v) continue;
    if (v->kind() != Value::Kind::Bool) {
      throw ConfigError(fmt::format("{}: key '{}' expects a boolean, got {} '{}' ({})", v->origin().str(), a.key,
                                    Value::kind_name(v->kind()), v->scalar_text(), a.doc));
    }
    Value to = v->as_bool() ? a.if_true : a.if_false;
    if (to.is_null()) {  // this value of the alias sets nothing (Megatron-LM's recompute_activations: false)
      layer.erase(a.key);
      continue;
    }
    to.set_origin(v->origin());
    if (const Value* t = layer.find(a.target); t && !t->same_content(to)) {
      throw ConfigError(fmt::format("{}: {}: {} means {}: {}, but {} sets {}: {}", v->origin().str(), a.key,
                                    v->scalar_text(), a.target, to.scalar_text(), t->origin().str(), a.target,
                                    t->scalar_text()));
    }
    layer.set(a.target, std::move(to));
    layer.erase(a.key);
  }
}

void Schema::read_int_bools(Value& layer) const {
  auto walk_layer = [this](auto& self, Value& node, const std::string& prefix) -> void {
    for (auto& [k, v] : node.entries()) {
      const std::string key = prefix.empty() ? k : prefix + "." + k;
      if (v.is_map()) {
        self(self, v, key);
        continue;
      }
      if (v.kind() != Value::Kind::Int || (v.as_int() != 0 && v.as_int() != 1)) continue;
      const KeySpec* spec = find(key);
      const bool boolean_alias = std::any_of(aliases_.begin(), aliases_.end(),
                                             [&key](const KeyAlias& a) { return a.key == key; });
      if ((spec && spec->type == KeyType::Bool) || boolean_alias) v = Value::boolean(v.as_int() == 1, v.origin());
    }
  };
  if (layer.is_map()) walk_layer(walk_layer, layer, "");
}

const KeySpec* Schema::find(const std::string& key) const {
  for (auto& k : keys_)
    if (k.key == key) return &k;
  return nullptr;
}

std::string Schema::nearest(const std::string& key) const {
  std::string best;
  size_t best_d = SIZE_MAX;
  auto leaf = [](const std::string& k) {
    auto dot = k.rfind('.');
    return dot == std::string::npos ? k : k.substr(dot + 1);
  };
  auto consider = [&](const std::string& name) {
    size_t d = std::min(edit_distance(key, name), edit_distance(leaf(key), leaf(name)) + 1);
    if (d < best_d) {
      best_d = d;
      best = name;
    }
  };
  for (auto& k : keys_) consider(k.key);
  for (auto& a : aliases_) consider(a.key);
  size_t limit = std::max<size_t>(2, key.size() / 3);
  return best_d <= limit ? best : "";
}

namespace {

bool fits(KeyType t, const Value& v) {
  using K = Value::Kind;
  if (v.is_null()) return true;  // null means "unset" everywhere
  switch (t) {
    case KeyType::Bool: return v.kind() == K::Bool;
    case KeyType::Int: return v.kind() == K::Int;
    case KeyType::Float: return v.kind() == K::Int || v.kind() == K::Float;
    case KeyType::String: return v.kind() == K::String;
    case KeyType::StringList:
      if (v.kind() == K::String) return true;  // a single name is a one-element list
      if (v.kind() != K::List) return false;
      for (auto& it : v.items())
        if (it.kind() != K::String) return false;
      return true;
    case KeyType::List: return v.kind() == K::List;
    case KeyType::Map: return v.kind() == K::Map;
    case KeyType::Any: return true;
  }
  return false;
}

// An unknown key is added to `unknown` (every one of a config is reported at once: a config
// brought from another framework names all that does not carry over in one run); any other
// error throws.
void check_leaf(const Schema& schema, const std::string& key, const Value& v, std::vector<std::string>& unknown) {
  const KeySpec* spec = schema.find(key);
  if (!spec) {
    // A key under a Map-typed key (free-form section) is accepted as is.
    for (size_t dot = key.rfind('.'); dot != std::string::npos; dot = key.rfind('.', dot - 1)) {
      const KeySpec* parent = schema.find(key.substr(0, dot));
      if (parent && (parent->type == KeyType::Map || parent->type == KeyType::Any)) return;
      if (dot == 0) break;
    }
    std::string near = schema.nearest(key);
    unknown.push_back(fmt::format("{}: unknown key '{}'{}", v.origin().str(), key,
                                  near.empty() ? "" : fmt::format("; did you mean '{}'?", near)));
    return;
  }
  if (!fits(spec->type, v)) {
    std::string want = key_type_name(spec->type);
    bool vowel = std::string("aeiou").find(want[0]) != std::string::npos;
    throw ConfigError(fmt::format("{}: key '{}' expects {} {}, got {} '{}'", v.origin().str(), key,
                                  vowel ? "an" : "a", want, Value::kind_name(v.kind()),
                                  v.scalar_text()));
  }
  if ((spec->type == KeyType::Int || spec->type == KeyType::Float) && !v.is_null()) {
    double x = v.as_double();
    if (!std::isfinite(x) || (spec->min && x < *spec->min) || (spec->max && x > *spec->max)) {
      throw ConfigError(fmt::format("{}: key '{}' = {} is out of range [{}, {}]", v.origin().str(),
                                    key, v.scalar_text(),
                                    spec->min ? fmt::format("{}", *spec->min) : "-inf",
                                    spec->max ? fmt::format("{}", *spec->max) : "inf"));
    }
  }
  if (spec->type == KeyType::String && !spec->choices.empty() && !v.is_null() &&
      std::find(spec->choices.begin(), spec->choices.end(), v.as_string()) == spec->choices.end()) {
    throw ConfigError(fmt::format("{}: key '{}' = '{}' is not one of: {}", v.origin().str(), key,
                                  v.as_string(), fmt::join(spec->choices, ", ")));
  }
}

void walk(const Schema& schema, const Value& node, const std::string& prefix, std::vector<std::string>& unknown) {
  for (auto& [k, v] : node.entries()) {
    std::string key = prefix.empty() ? k : prefix + "." + k;
    const KeySpec* spec = schema.find(key);
    if (v.is_map() && (!spec || spec->type != KeyType::Map) && !(spec && spec->type == KeyType::Any)) {
      if (spec) {  // a mapping where a scalar is expected
        check_leaf(schema, key, v, unknown);
      }
      walk(schema, v, key, unknown);
      continue;
    }
    check_leaf(schema, key, v, unknown);
  }
}

}  // namespace

void Schema::validate(const Value& config) const {
  std::vector<std::string> unknown;
  walk(*this, config, "", unknown);
  if (unknown.size() == 1) throw ConfigError(unknown[0]);
  if (!unknown.empty()) {
    throw ConfigError(fmt::format("{} unknown keys:\n  {}", unknown.size(), fmt::join(unknown, "\n  ")));
  }
  for (auto& k : keys_) {
    if (!k.required) continue;
    const Value* v = config.find_path(k.key);
    if (!v || v->is_null()) {
      throw ConfigError(fmt::format("{}: required key '{}' is not set ({})",
                                    config.origin().str(), k.key, k.doc));
    }
  }
}

void Schema::apply_defaults(Value& config) const {
  for (auto& k : keys_) {
    if (k.default_value.is_null()) continue;
    // null means unset (as validate() takes it): `no_load_rng: null`, as Primus' Megatron-LM configs
    // write keys they leave alone, is the key's default.
    const Value* v = config.find_path(k.key);
    if (!v || v->is_null()) config.set_path(k.key, k.default_value);
  }
}

}  // namespace primus::config
