// A small bounded map that forgets the least recently used entry when full: the autotune
// cache (shape key -> winning backend) must not grow without bound when shapes vary (e.g.
// variable sequence lengths). Not thread-safe; the dispatcher locks around it.
#pragma once
#include <cstddef>
#include <list>
#include <optional>
#include <unordered_map>
#include <utility>

namespace primus::turbo {

template <class K, class V>
class LruCache {
 public:
  explicit LruCache(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

  // The value for `key`, which becomes the most recently used; nullopt when absent.
  std::optional<V> get(const K& key) {
    auto it = index_.find(key);
    if (it == index_.end()) return std::nullopt;
    order_.splice(order_.begin(), order_, it->second);
    return it->second->second;
  }

  // Inserts or replaces; evicts the least recently used entry when over capacity.
  void put(const K& key, V value) {
    auto it = index_.find(key);
    if (it != index_.end()) {
      it->second->second = std::move(value);
      order_.splice(order_.begin(), order_, it->second);
      return;
    }
    order_.emplace_front(key, std::move(value));
    index_.emplace(key, order_.begin());
    if (index_.size() > capacity_) {
      index_.erase(order_.back().first);
      order_.pop_back();
      ++evictions_;
    }
  }

  bool contains(const K& key) const { return index_.count(key) != 0; }
  size_t size() const { return index_.size(); }
  size_t capacity() const { return capacity_; }
  size_t evictions() const { return evictions_; }
  void clear() { index_.clear(); order_.clear(); }

 private:
  size_t capacity_;
  size_t evictions_ = 0;
  std::list<std::pair<K, V>> order_;  // front = most recent
  std::unordered_map<K, typename std::list<std::pair<K, V>>::iterator> index_;
};

}  // namespace primus::turbo
