// The schema of every key a backend accepts: type, default, range or choices, and a one-line
// doc. Validation turns typos and wrong types into errors that name the file and line and
// suggest the nearest known key; defaults fill what no layer set (origin "<schema default>").
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/config/value.h"

namespace primus::config {

enum class KeyType { Bool, Int, Float, String, StringList, List, Map, Any };
const char* key_type_name(KeyType t);

struct KeySpec {
  std::string key;  // dotted, e.g. "optimizer.lr" (a Map key admits any sub-keys)
  KeyType type = KeyType::Any;
  Value default_value;  // Null = no default (the key is optional)
  std::optional<double> min, max;  // for Int and Float
  std::vector<std::string> choices;  // for String
  std::string doc;
  bool required = false;
};

// Another project's name for a value of a key (Megatron-LM's `swiglu: true` for
// `activation: swiglu`): a boolean whose true and false each stand for one value of the target,
// or for nothing (a null value: the alias set to it leaves the target as the other layers set it).
struct KeyAlias {
  std::string key;     // top-level, as the target
  std::string target;
  Value if_true, if_false;
  std::string doc;
};

class Schema {
 public:
  Schema& add(KeySpec spec);  // duplicate key -> logic_error (a programming mistake)
  // Short forms used by backends.
  Schema& flag(const std::string& key, bool def, const std::string& doc);
  Schema& integer(const std::string& key, std::optional<int64_t> def, const std::string& doc,
                  std::optional<double> min = std::nullopt, std::optional<double> max = std::nullopt);
  Schema& number(const std::string& key, std::optional<double> def, const std::string& doc,
                 std::optional<double> min = std::nullopt, std::optional<double> max = std::nullopt);
  Schema& text(const std::string& key, std::optional<std::string> def, const std::string& doc,
               std::vector<std::string> choices = {});
  // def: the default (Null: none); for a key that takes a value or a list, say.
  Schema& any(const std::string& key, KeyType type, const std::string& doc, Value def = Value::null());

  // An alias (see KeyAlias); its key must be no schema key, its target one.
  Schema& alias(const std::string& key, const std::string& target, Value if_true, Value if_false,
                const std::string& doc);

  const KeySpec* find(const std::string& key) const;
  const std::vector<KeySpec>& keys() const { return keys_; }

  // Rewrites the aliases one config layer sets into their targets, each with the alias's origin,
  // before the layer is merged: a later layer's alias then overrides an earlier layer's target
  // (and the reverse) as the target itself would. A layer that sets an alias and its target to
  // different values, or an alias to a non-boolean, is a ConfigError naming the origins.
  void translate_aliases(Value& layer) const;
  // Reads the integers 0 and 1 a layer gives a boolean key (or a boolean alias) as false and
  // true, keeping their origins, as Megatron-LM's argparse namespace and Primus' YAML take them
  // (`sequence_parallel: 1`); any other integer stays and validate() refuses it. Runs before
  // translate_aliases.
  void read_int_bools(Value& layer) const;

  // Checks every leaf key of `config` (unknown key, type, range, choice) and throws a
  // ConfigError naming the key's origin. Integers are accepted where numbers are expected.
  void validate(const Value& config) const;
  // Adds schema defaults for keys that no layer set, or that a layer set to null (unset).
  void apply_defaults(Value& config) const;
  // The known key nearest to `key` by edit distance (empty when nothing is close).
  std::string nearest(const std::string& key) const;

 private:
  std::vector<KeySpec> keys_;
  std::vector<KeyAlias> aliases_;
};

// The origin apply_defaults gives the values it fills in.
inline constexpr const char* kSchemaDefaultOrigin = "<schema default>";
// Whether a config layer set `v`: present, not null, not filled in from the schema's default.
inline bool set_by_a_layer(const Value* v) { return v && !v->is_null() && v->origin().file != kSchemaDefaultOrigin; }

// Levenshtein distance, used for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace primus::config
