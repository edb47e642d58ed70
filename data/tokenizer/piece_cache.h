// The BPE result cache: pre-token bytes -> token ids. Text repeats its pieces (" the", ",",
// "\n"), so after a short warm-up nearly every piece is a cache hit and encoding costs one
// hash probe per piece instead of a BPE merge loop.
//
// One cache per thread and tokenizer (PieceCache::local): no locks, no cache lines shared
// between encoding threads, which is what lets `data prepare --workers N` scale. Each is an
// open-addressing table over two arenas (piece bytes, ids): a hit touches one slot and two
// contiguous ranges. Memory is bounded: when kMaxEntries pieces are held, it starts over.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace primus::data {

class PieceCache {
 public:
  static constexpr size_t kMaxPieceBytes = 64;  // longer pieces are rare and not kept
  static constexpr size_t kMaxIds = 64;
  static constexpr size_t kMaxEntries = size_t{1} << 18;

  PieceCache();

  // Appends the ids cached for `piece` to out and returns true, or returns false.
  bool get(std::string_view piece, std::vector<int32_t>& out) const;
  void put(std::string_view piece, std::span<const int32_t> ids);
  size_t size() const { return entries_; }

  // This thread's cache for the tokenizer with unique id `owner` (a thread keeps the caches of
  // its last few tokenizers; ids are never reused, so a cache never outlives its meaning).
  static PieceCache& local(uint64_t owner);

 private:
  struct Slot {
    uint64_t hash = 0;  // 0: empty
    uint32_t key_off = 0, ids_off = 0;
    uint16_t key_len = 0, n_ids = 0;
  };
  const Slot* find(std::string_view piece, uint64_t h) const;
  void rehash(size_t capacity);

  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<int32_t> ids_;
  size_t entries_ = 0;
};

}  // namespace primus::data
