// Reads YAML config files into Values: typed scalars (plain scalars become integers, numbers,
// booleans or null; quoted ones stay strings), ${VAR} / ${VAR:default} interpolation, and
// `extends` chains (a scalar or a list of files, relative to the extending file; the bases are
// merged first, in order, then the file itself; cycles are an error).
#pragma once
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/config/value.h"

namespace primus::config {

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
EnvLookup process_env();  // reads the real environment

struct LoadOptions {
  EnvLookup env = process_env();
  std::vector<OverrideNote>* notes = nullptr;  // keys set in a base and again in the file
  // Called on each file of an extends chain, its own keys only (`extends` still in it), before it
  // merges over its bases: a rewrite that must not see the chain as one file (schema aliases).
  std::function<void(Value&)> each_file;
};

// Loads `path` with its extends chain resolved. Throws ConfigError naming file:line:column.
Value load_yaml_file(const std::filesystem::path& path, const LoadOptions& opts = {});

// Parses YAML text (no extends); `origin_name` stands in for the file in origins and errors.
Value parse_yaml_text(const std::string& text, const std::string& origin_name,
                      const LoadOptions& opts = {});

// Replaces ${VAR} and ${VAR:default} in `text`; `where` names the place for errors.
std::string interpolate(const std::string& text, const EnvLookup& env, const Origin& where);

// Refuses (ConfigError naming `key` and the value's origin) a string that is not UTF-8.
void check_utf8(const Value& v, const std::string& key);
// True when s is well-formed UTF-8 (YAML text and every config key and string must be).
bool valid_utf8(const std::string& s);

// Types a plain scalar as YAML 1.2's core schema does (int, float, bool, null, else string).
Value typed_scalar(const std::string& text, const Origin& origin);

}  // namespace primus::config
