#include "data/tokenizer/piece_cache.h"

#include <cstring>
#include <memory>
#include <utility>

namespace primus::data {
namespace {

constexpr size_t kInitialSlots = size_t{1} << 12;

// A fast hash for short byte strings (pieces average ~4 bytes): 8 bytes per multiply.
uint64_t hash_piece(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0xC2B2AE3D27D4EB4Full);
  const char* p = s.data();
  size_t n = s.size();
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  uint64_t v = 0;
  std::memcpy(&v, p, n);
  h = (h ^ v) * 0x94D049BB133111EBull;
  h ^= h >> 29;
  return h | 1;  // 0 marks an empty slot
}

}  // namespace

PieceCache::PieceCache() : slots_(kInitialSlots) {}

const PieceCache::Slot* PieceCache::find(std::string_view piece, uint64_t h) const {
  const size_t mask = slots_.size() - 1;
  for (size_t i = h & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.hash == 0) return &s;
    if (s.hash == h && s.key_len == piece.size() &&
        std::memcmp(keys_.data() + s.key_off, piece.data(), piece.size()) == 0) {
      return &s;
    }
  }
}

bool PieceCache::get(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() > kMaxPieceBytes) return false;
  const Slot* s = find(piece, hash_piece(piece));
  if (s->hash == 0) return false;
  if (s->n_ids == 1) {  // most pieces are one token
    out.push_back(ids_[s->ids_off]);
  } else {
    out.insert(out.end(), ids_.begin() + s->ids_off, ids_.begin() + s->ids_off + s->n_ids);
  }
  return true;
}

void PieceCache::rehash(size_t capacity) {
  std::vector<Slot> old(capacity);
  old.swap(slots_);
  const size_t mask = slots_.size() - 1;
  for (const Slot& s : old) {
    if (s.hash == 0) continue;
    size_t i = s.hash & mask;
    while (slots_[i].hash != 0) i = (i + 1) & mask;
    slots_[i] = s;
  }
}

void PieceCache::put(std::string_view piece, std::span<const int32_t> ids) {
  if (piece.size() > kMaxPieceBytes || ids.size() > kMaxIds) return;
  if (entries_ >= kMaxEntries) {  // start over rather than track recency
    slots_.assign(kInitialSlots, Slot{});
    keys_.clear();
    ids_.clear();
    entries_ = 0;
  }
  if ((entries_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);  // load <= 1/2
  uint64_t h = hash_piece(piece);
  auto* s = const_cast<Slot*>(find(piece, h));
  if (s->hash != 0) return;  // already there
  s->hash = h;
  s->key_off = static_cast<uint32_t>(keys_.size());
  s->key_len = static_cast<uint16_t>(piece.size());
  s->ids_off = static_cast<uint32_t>(ids_.size());
  s->n_ids = static_cast<uint16_t>(ids.size());
  keys_.append(piece);
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  ++entries_;
}

PieceCache& PieceCache::local(uint64_t owner) {
  thread_local std::vector<std::pair<uint64_t, std::unique_ptr<PieceCache>>> caches;
  for (auto& [id, cache] : caches) {
    if (id == owner) return *cache;
  }
  if (caches.size() >= 4) caches.erase(caches.begin());
  caches.emplace_back(owner, std::make_unique<PieceCache>());
  return *caches.back().second;
}

}  // namespace primus::data
