// The one config representation: a tree of typed values, each knowing where it was set.
// YAML files, presets, experiment overrides and command-line overrides all become Values and
// are merged layer by layer; a key set in two layers keeps the history of both places.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace primus::config {

// Where a value was set: a file with 1-based line and column, or a named layer such as
// "<command line>" or "<schema default>" (line 0).
struct Origin {
  std::string file;
  int line = 0;
  int column = 0;
  std::string str() const;  // "path:12:3", or the layer name
  bool operator==(const Origin&) const = default;
};

class Value {
 public:
  enum class Kind { Null, Bool, Int, Float, String, List, Map };
  using Entry = std::pair<std::string, Value>;

  Value() = default;
  static Value null(Origin o = {});
  static Value boolean(bool b, Origin o = {});
  static Value integer(int64_t i, Origin o = {});
  static Value floating(double d, Origin o = {});
  static Value string(std::string s, Origin o = {});
  static Value list(std::vector<Value> items, Origin o = {});
  static Value map(Origin o = {});

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::Null; }
  bool is_map() const { return kind_ == Kind::Map; }
  bool is_list() const { return kind_ == Kind::List; }
  bool is_scalar() const { return kind_ != Kind::Map && kind_ != Kind::List; }
  static const char* kind_name(Kind k);

  // Typed access; throws ConfigError naming the origin when the kind does not fit.
  bool as_bool() const;
  int64_t as_int() const;
  double as_double() const;  // accepts Int too
  const std::string& as_string() const;
  const std::vector<Value>& items() const;
  std::vector<Value>& items();
  const std::vector<Entry>& entries() const;
  std::vector<Entry>& entries();

  // Map access (insertion order preserved).
  const Value* find(const std::string& key) const;
  Value* find(const std::string& key);
  Value& set(const std::string& key, Value v);  // inserts or replaces, no history kept
  bool erase(const std::string& key);

  // Dotted paths: "optimizer.lr". Missing intermediate maps are created by set_path.
  const Value* find_path(const std::string& dotted) const;
  Value& set_path(const std::string& dotted, Value v);

  const Origin& origin() const { return origin_; }
  void set_origin(Origin o) { origin_ = std::move(o); }
  // Earlier layers that set this key before the one that won (oldest first).
  const std::vector<Origin>& overridden() const { return overridden_; }
  void add_overridden(const Origin& o) { overridden_.push_back(o); }

  std::string scalar_text() const;  // a scalar as the user would write it
  nlohmann::json to_json() const;
  std::string to_yaml(int indent = 0) const;
  bool same_content(const Value& other) const;  // deep equality, origins ignored

 private:
  Kind kind_ = Kind::Null;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;
  std::vector<Value> list_;
  std::vector<Entry> map_;
  Origin origin_;
  std::vector<Origin> overridden_;
};

// One override recorded while merging: `key` was set at `earlier` and again at `later`.
struct OverrideNote {
  std::string key;
  Origin earlier, later;
  std::string earlier_value, later_value;
};

// Deep-merges `src` over `dst` (maps merge key by key, anything else replaces). Every key
// that both set is appended to `notes` (when given) and remembered in the value's history.
void merge_into(Value& dst, const Value& src, std::vector<OverrideNote>* notes = nullptr,
                const std::string& prefix = "");

// Flattens a map into dotted leaf keys (lists are leaves), in order.
std::vector<std::pair<std::string, const Value*>> flatten(const Value& map);

}  // namespace primus::config
