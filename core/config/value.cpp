#include "core/config/value.h"

#include <fmt/format.h>

#include <cmath>
#include <sstream>

#include "core/util/error.h"

namespace primus::config {

std::string Origin::str() const {
  if (line <= 0) return file.empty() ? "<unknown>" : file;
  if (column <= 0) return fmt::format("{}:{}", file, line);
  return fmt::format("{}:{}:{}", file, line, column);
}

Value Value::null(Origin o) {
  Value v;
  v.origin_ = std::move(o);
  return v;
}
Value Value::boolean(bool b, Origin o) {
  Value v = null(std::move(o));
  v.kind_ = Kind::Bool;
  v.b_ = b;
  return v;
}
Value Value::integer(int64_t i, Origin o) {
  Value v = null(std::move(o));
  v.kind_ = Kind::Int;
  v.i_ = i;
  return v;
}
Value Value::floating(double d, Origin o) {
  Value v = null(std::move(o));
  v.kind_ = Kind::Float;
  v.f_ = d;
  return v;
}
Value Value::string(std::string s, Origin o) {
  Value v = null(std::move(o));
  v.kind_ = Kind::String;
  v.s_ = std::move(s);
  return v;
}
Value Value::list(std::vector<Value> items, Origin o) {
  Value v = null(std::move(o));
  v.kind_ = Kind::List;
  v.list_ = std::move(items);
  return v;
}
Value Value::map(Origin o) {
  Value v = null(std::move(o));
  v.kind_ = Kind::Map;
  return v;
}

const char* Value::kind_name(Kind k) {
  switch (k) {
    case Kind::Null: return "null";
    case Kind::Bool: return "boolean";
    case Kind::Int: return "integer";
    case Kind::Float: return "number";
    case Kind::String: return "string";
    case Kind::List: return "list";
    case Kind::Map: return "mapping";
  }
  return "?";
}

namespace {
[[noreturn]] void kind_error(const Value& v, const char* want) {
  throw ConfigError(fmt::format("{}: expected a {}, got {} '{}'", v.origin().str(), want,
                                Value::kind_name(v.kind()), v.scalar_text()));
}
}  // namespace

bool Value::as_bool() const {
  if (kind_ != Kind::Bool) kind_error(*this, "boolean");
  return b_;
}
int64_t Value::as_int() const {
  if (kind_ != Kind::Int) kind_error(*this, "integer");
  return i_;
}
double Value::as_double() const {
  if (kind_ == Kind::Int) return static_cast<double>(i_);
  if (kind_ != Kind::Float) kind_error(*this, "number");
  return f_;
}
const std::string& Value::as_string() const {
  if (kind_ != Kind::String) kind_error(*this, "string");
  return s_;
}
const std::vector<Value>& Value::items() const {
  if (kind_ != Kind::List) kind_error(*this, "list");
  return list_;
}
std::vector<Value>& Value::items() {
  if (kind_ != Kind::List) kind_error(*this, "list");
  return list_;
}
const std::vector<Value::Entry>& Value::entries() const {
  if (kind_ != Kind::Map) kind_error(*this, "mapping");
  return map_;
}
std::vector<Value::Entry>& Value::entries() {
  if (kind_ != Kind::Map) kind_error(*this, "mapping");
  return map_;
}

const Value* Value::find(const std::string& key) const {
  if (kind_ != Kind::Map) return nullptr;
  for (auto& [k, v] : map_)
    if (k == key) return &v;
  return nullptr;
}
Value* Value::find(const std::string& key) {
  return const_cast<Value*>(static_cast<const Value*>(this)->find(key));
}
Value& Value::set(const std::string& key, Value v) {
  if (kind_ == Kind::Null) kind_ = Kind::Map;
  if (kind_ != Kind::Map) kind_error(*this, "mapping");
  if (Value* old = find(key)) {
    *old = std::move(v);
    return *old;
  }
  map_.emplace_back(key, std::move(v));
  return map_.back().second;
}
bool Value::erase(const std::string& key) {
  if (kind_ != Kind::Map) return false;
  for (auto it = map_.begin(); it != map_.end(); ++it) {
    if (it->first == key) {
      map_.erase(it);
      return true;
    }
  }
  return false;
}

const Value* Value::find_path(const std::string& dotted) const {
  const Value* cur = this;
  size_t start = 0;
  while (cur) {
    size_t dot = dotted.find('.', start);
    std::string part = dotted.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    cur = cur->find(part);
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
  return nullptr;
}

Value& Value::set_path(const std::string& dotted, Value v) {
  size_t dot = dotted.find('.');
  if (dot == std::string::npos) return set(dotted, std::move(v));
  std::string head = dotted.substr(0, dot);
  Value* child = find(head);
  if (!child || !child->is_map()) child = &set(head, Value::map(v.origin()));
  return child->set_path(dotted.substr(dot + 1), std::move(v));
}

std::string Value::scalar_text() const {
  switch (kind_) {
    case Kind::Null: return "null";
    case Kind::Bool: return b_ ? "true" : "false";
    case Kind::Int: return std::to_string(i_);
    case Kind::Float: {
      std::string s = fmt::format("{}", f_);
      if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
      return s;
    }
    case Kind::String: return s_;
    case Kind::List: return to_json().dump();
    case Kind::Map: return to_json().dump();
  }
  return "";
}

nlohmann::json Value::to_json() const {
  switch (kind_) {
    case Kind::Null: return nullptr;
    case Kind::Bool: return b_;
    case Kind::Int: return i_;
    case Kind::Float: return f_;
    case Kind::String: return s_;
    case Kind::List: {
      auto j = nlohmann::json::array();
      for (auto& v : list_) j.push_back(v.to_json());
      return j;
    }
    case Kind::Map: {
      auto j = nlohmann::json::object();
      for (auto& [k, v] : map_) j[k] = v.to_json();
      return j;
    }
  }
  return nullptr;
}

namespace {
std::string yaml_scalar(const Value& v) {
  if (v.kind() != Value::Kind::String) return v.scalar_text();
  const std::string& s = v.as_string();
  bool plain = !s.empty() && s.find_first_of(":#{}[],&*!|>'\"%@`\n") == std::string::npos &&
               s.front() != ' ' && s.back() != ' ' && s != "true" && s != "false" &&
               s != "null" && s != "~" && s.find_first_not_of("0123456789.-+eE") != std::string::npos;
  return plain ? s : nlohmann::json(s).dump();
}
}  // namespace

std::string Value::to_yaml(int indent) const {
  std::ostringstream out;
  std::string pad(indent, ' ');
  if (kind_ == Kind::Map) {
    if (map_.empty()) return pad + "{}\n";
    for (auto& [k, v] : map_) {
      if (v.is_map() && !v.map_.empty()) {
        out << pad << k << ":\n" << v.to_yaml(indent + 2);
      } else if (v.is_list()) {
        out << pad << k << ": " << v.to_json().dump() << "\n";
      } else if (v.is_map()) {
        out << pad << k << ": {}\n";
      } else {
        out << pad << k << ": " << yaml_scalar(v) << "\n";
      }
    }
    return out.str();
  }
  return pad + (is_list() ? to_json().dump() : yaml_scalar(*this)) + "\n";
}

bool Value::same_content(const Value& o) const {
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::Null: return true;
    case Kind::Bool: return b_ == o.b_;
    case Kind::Int: return i_ == o.i_;
    case Kind::Float: return f_ == o.f_;
    case Kind::String: return s_ == o.s_;
    case Kind::List:
      if (list_.size() != o.list_.size()) return false;
      for (size_t i = 0; i < list_.size(); ++i)
        if (!list_[i].same_content(o.list_[i])) return false;
      return true;
    case Kind::Map:
      if (map_.size() != o.map_.size()) return false;
      for (auto& [k, v] : map_) {
        const Value* ov = o.find(k);
        if (!ov || !v.same_content(*ov)) return false;
      }
      return true;
  }
  return false;
}

void merge_into(Value& dst, const Value& src, std::vector<OverrideNote>* notes,
                const std::string& prefix) {
  if (!src.is_map()) {
    throw ConfigError(fmt::format("{}: expected a mapping at the top of a config layer",
                                  src.origin().str()));
  }
  if (dst.is_null()) dst = Value::map(src.origin());
  for (auto& [key, sv] : src.entries()) {
    std::string full = prefix.empty() ? key : prefix + "." + key;
    Value* dv = dst.find(key);
    if (!dv) {
      dst.set(key, sv);
      continue;
    }
    if (dv->is_map() && sv.is_map()) {
      merge_into(*dv, sv, notes, full);
      continue;
    }
    if (notes) {
      notes->push_back({full, dv->origin(), sv.origin(), dv->scalar_text(), sv.scalar_text()});
    }
    std::vector<Origin> history = dv->overridden();
    history.push_back(dv->origin());
    *dv = sv;
    for (auto& h : history) dv->add_overridden(h);
  }
}

std::vector<std::pair<std::string, const Value*>> flatten(const Value& map) {
  std::vector<std::pair<std::string, const Value*>> out;
  if (!map.is_map()) return out;
  for (auto& [k, v] : map.entries()) {
    if (v.is_map() && !v.entries().empty()) {
      for (auto& [sub, sv] : flatten(v)) out.emplace_back(k + "." + sub, sv);
    } else {
      out.emplace_back(k, &v);
    }
  }
  return out;
}

}  // namespace primus::config
