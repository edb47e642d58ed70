// A backend's replaceable parts as named slots (`cuda.attention.forward`, `cuda.linear.gemm`),
// each holding a typed callable. Patches change slots only through `replace` and `wrap`, which
// record which patch changed which slot, so the engine can say what every patch touched.
#pragma once
#include <any>
#include <functional>
#include <map>
#include <string>
#include <typeindex>
#include <vector>

#include <fmt/format.h>

#include "core/util/error.h"

namespace primus::patches {

struct SlotChange {
  std::string patch_id;
  std::string action;  // "replace" or "wrap"
};

class HookTable {
 public:
  // Declares a slot with its default implementation. Defining a slot twice is an error.
  template <class Sig>
  void define(const std::string& name, std::function<Sig> fn, std::string doc = "") {
    if (slots_.count(name)) throw RuntimeError(fmt::format("hook slot '{}' defined twice", name));
    slots_[name] = Slot{std::move(fn), std::type_index(typeid(Sig)), std::move(doc), {}};
    order_.push_back(name);
  }

  template <class Sig>
  const std::function<Sig>& get(const std::string& name) const {
    return *std::any_cast<std::function<Sig>>(&typed<Sig>(name).fn);
  }

  template <class Sig>
  void replace(const std::string& name, std::function<Sig> fn, const std::string& patch_id) {
    Slot& s = typed<Sig>(name);
    s.fn = std::move(fn);
    s.history.push_back({patch_id, "replace"});
  }

  // `wrapper` receives the slot's current callable and returns the new one.
  template <class Sig>
  void wrap(const std::string& name, const std::function<std::function<Sig>(std::function<Sig>)>& wrapper,
            const std::string& patch_id) {
    Slot& s = typed<Sig>(name);
    auto inner = *std::any_cast<std::function<Sig>>(&s.fn);
    s.fn = wrapper(std::move(inner));
    s.history.push_back({patch_id, "wrap"});
  }

  bool has(const std::string& name) const { return slots_.count(name) > 0; }
  const std::vector<std::string>& names() const { return order_; }
  const std::string& doc(const std::string& name) const { return slot(name).doc; }
  const std::vector<SlotChange>& history(const std::string& name) const { return slot(name).history; }

 private:
  struct Slot {
    std::any fn;
    std::type_index type = typeid(void);
    std::string doc;
    std::vector<SlotChange> history;
  };
  const Slot& slot(const std::string& name) const {
    auto it = slots_.find(name);
    if (it == slots_.end()) {
      throw RuntimeError(fmt::format("no hook slot '{}' (slots: {})", name, fmt::join(order_, ", ")));
    }
    return it->second;
  }
  template <class Sig>
  Slot& typed(const std::string& name) const {
    Slot& s = const_cast<Slot&>(slot(name));
    if (s.type != std::type_index(typeid(Sig))) {
      throw RuntimeError(fmt::format("hook slot '{}' used with the wrong signature", name));
    }
    return s;
  }
  std::map<std::string, Slot> slots_;
  std::vector<std::string> order_;
};

}  // namespace primus::patches
