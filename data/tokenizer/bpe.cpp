#include "data/tokenizer/bpe.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <queue>
#include <span>
#include <unordered_map>

#include "core/util/error.h"
#include "data/tokenizer/byte_level.h"
#include "data/tokenizer/piece_cache.h"
#include "data/tokenizer/unicode.h"

namespace primus::data {
namespace {

struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
struct SvEq {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const noexcept { return a == b; }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, SvHash, SvEq>;

struct Merge {
  int32_t rank;
  int32_t id;  // the merged token
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(BpeSpec spec);

  void encode_into(std::string_view text, std::vector<int32_t>& out) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int vocab_size() const override { return static_cast<int>(id_to_bytes_.size()); }
  int32_t eod_id() const override { return eod_id_; }
  std::string name() const override { return name_; }

 private:
  void encode_segment(std::string_view text, std::vector<int32_t>& out, PieceCache& cache) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out, PieceCache& cache) const;
  void merge_piece(std::string_view piece, std::vector<int32_t>& out) const;
  int32_t byte_token(unsigned char b) const;
  // Which added tokens a pass over the text matches.
  enum class AddedPass { All, Raw, Normalized };
  // Longest added token of `pass` starting at text[pos], or nullptr.
  const AddedToken* added_at(std::string_view text, size_t pos, AddedPass pass) const;
  // Splits `text` at the added tokens of `pass`: calls on_text(segment) for the text between
  // them (possibly empty) and appends each token's id to `out`, in order.
  template <class OnText>
  void split_added(std::string_view text, AddedPass pass, std::vector<int32_t>& out, OnText&& on_text) const;

  std::string name_;
  Normalizer normalizer_;
  PreTokenizerKind pre_;
  PrefixSpace prefix_space_;
  bool ignore_merges_;
  int32_t eod_id_;
  int32_t unk_id_ = -1;
  std::vector<std::string> id_to_bytes_;  // raw bytes of each id; empty for unused ids
  std::vector<bool> id_used_;
  StringMap<int32_t> bytes_to_id_;  // only kept for ignore_merges
  std::array<int32_t, 256> byte_id_{};
  std::unordered_map<uint64_t, Merge> merges_;
  std::vector<AddedToken> added_;  // longest first; content as matched (normalized ones normalized)
  std::array<bool, 256> added_first_byte_{};
  const uint64_t uid_;  // names this tokenizer's per-thread caches (PieceCache::local)
};

std::atomic<uint64_t> next_tokenizer_uid{1};

BpeTokenizer::BpeTokenizer(BpeSpec spec)
    : name_(std::move(spec.name)),
      normalizer_(std::move(spec.normalizer)),
      pre_(spec.pre),
      prefix_space_(spec.prefix_space),
      ignore_merges_(spec.ignore_merges),
      eod_id_(spec.eod_id),
      uid_(next_tokenizer_uid.fetch_add(1)) {
  const std::string& src = spec.source;
  int32_t max_id = -1;
  for (auto& [tok, id] : spec.vocab) max_id = std::max(max_id, id);
  for (auto& a : spec.added) max_id = std::max(max_id, a.id);
  if (max_id < 0) throw FormatError(fmt::format("{}: the vocabulary is empty", src));
  id_to_bytes_.resize(static_cast<size_t>(max_id) + 1);
  id_used_.assign(id_to_bytes_.size(), false);

  StringMap<int32_t> form_to_id;  // byte-level form -> id, to resolve merges
  form_to_id.reserve(spec.vocab.size());
  std::string bytes;
  for (auto& [tok, id] : spec.vocab) {
    if (id < 0) throw FormatError(fmt::format("{}: vocab entry '{}' has negative id {}", src, tok, id));
    if (id_used_[id]) {
      throw FormatError(fmt::format("{}: id {} is given to two vocab entries (second: '{}')", src,
                                    id, tok));
    }
    if (!byte_level::decode_token(tok, &bytes)) {
      throw FormatError(fmt::format(
          "{}: vocab entry '{}' (id {}) is not in the byte-level alphabet; only byte-level BPE "
          "vocabularies are supported",
          src, tok, id));
    }
    id_used_[id] = true;
    id_to_bytes_[id] = bytes;
    form_to_id.emplace(tok, id);
    if (ignore_merges_) bytes_to_id_.emplace(bytes, id);
  }
  byte_id_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    auto it = form_to_id.find(byte_level::encode_token(std::string(1, static_cast<char>(b))));
    if (it != form_to_id.end()) byte_id_[b] = it->second;
  }
  if (spec.unk_token) {
    auto it = form_to_id.find(*spec.unk_token);
    if (it == form_to_id.end()) {
      throw FormatError(fmt::format("{}: unk_token '{}' is not in the vocabulary", src, *spec.unk_token));
    }
    unk_id_ = it->second;
  }

  merges_.reserve(spec.merges.size());
  for (size_t r = 0; r < spec.merges.size(); ++r) {
    auto& [a, b] = spec.merges[r];
    auto ia = form_to_id.find(a), ib = form_to_id.find(b), iab = form_to_id.find(a + b);
    const char* missing = ia == form_to_id.end()    ? "its left part"
                          : ib == form_to_id.end()  ? "its right part"
                          : iab == form_to_id.end() ? "the merged token"
                                                    : nullptr;
    if (missing) {
      throw FormatError(fmt::format("{}: merge #{} '{} {}': {} is not in the vocabulary", src, r,
                                    a, b, missing));
    }
    // A repeated pair keeps its first (lowest) rank, as the reference implementations do.
    merges_.emplace(pair_key(ia->second, ib->second),
                    Merge{static_cast<int32_t>(r), iab->second});
  }

  for (auto& a : spec.added) {
    if (a.content.empty()) throw FormatError(fmt::format("{}: added token {} is empty", src, a.id));
    id_to_bytes_[a.id] = a.content;
    id_used_[a.id] = true;
    // tokenizers matches a normalized token's normalized content in the normalized text.
    if (a.normalized && !normalizer_.empty()) {
      a.content = normalizer_.apply(a.content);
      if (a.content.empty()) {
        throw FormatError(fmt::format("{}: added token {} is empty after the normalizer", src, a.id));
      }
    }
    added_first_byte_[static_cast<unsigned char>(a.content[0])] = true;
  }
  added_ = std::move(spec.added);
  std::stable_sort(added_.begin(), added_.end(), [](const AddedToken& x, const AddedToken& y) {
    return x.content.size() > y.content.size();
  });
  if (eod_id_ >= static_cast<int32_t>(id_to_bytes_.size()) || (eod_id_ >= 0 && !id_used_[eod_id_])) {
    throw FormatError(fmt::format("{}: end-of-document id {} is not in the vocabulary", src, eod_id_));
  }
}

const AddedToken* BpeTokenizer::added_at(std::string_view text, size_t pos, AddedPass pass) const {
  for (const auto& a : added_) {  // longest first, so the first hit is the longest match
    if (pass != AddedPass::All && a.normalized != (pass == AddedPass::Normalized)) continue;
    if (text.compare(pos, a.content.size(), a.content) == 0) return &a;
  }
  return nullptr;
}

bool is_space_char(std::string_view text, size_t pos, size_t* len) {
  auto c = unicode::char_at(text.data() + pos, text.data() + text.size());
  *len = c.len;
  return c.cls == unicode::CharClass::Space;
}

template <class OnText>
void BpeTokenizer::split_added(std::string_view text, AddedPass pass, std::vector<int32_t>& out,
                               OnText&& on_text) const {
  size_t start = 0;  // start of the text not yet handed on
  if (!added_.empty()) {
    for (size_t pos = 0; pos < text.size();) {
      const AddedToken* a = added_first_byte_[static_cast<unsigned char>(text[pos])]
                                ? added_at(text, pos, pass)
                                : nullptr;
      if (!a) {
        ++pos;
        continue;
      }
      size_t seg_end = pos, next = pos + a->content.size(), len = 0;
      if (a->lstrip) {  // drop the whitespace run that ends right before the token
        size_t run_start = pos;  // pos: no run
        for (size_t p = start; p < pos; p += len) {
          if (!is_space_char(text, p, &len)) run_start = pos;
          else if (run_start == pos) run_start = p;
        }
        seg_end = run_start;
      }
      if (a->rstrip) {
        while (next < text.size() && is_space_char(text, next, &len)) next += len;
      }
      on_text(text.substr(start, seg_end - start));
      out.push_back(a->id);
      start = pos = next;
    }
  }
  on_text(text.substr(start));
}

void BpeTokenizer::encode_into(std::string_view text, std::vector<int32_t>& out) const {
  PieceCache& cache = PieceCache::local(uid_);
  if (normalizer_.empty()) {
    split_added(text, AddedPass::All, out, [&](std::string_view seg) { encode_segment(seg, out, cache); });
    return;
  }
  split_added(text, AddedPass::Raw, out, [&](std::string_view seg) {
    if (seg.empty()) return;
    std::string normalized = normalizer_.apply(seg);
    split_added(normalized, AddedPass::Normalized, out,
                [&](std::string_view piece) { encode_segment(piece, out, cache); });
  });
}

std::string with_space(std::string_view s) {
  std::string r;
  r.reserve(s.size() + 1);
  r += ' ';
  r += s;
  return r;
}

void BpeTokenizer::encode_segment(std::string_view text, std::vector<int32_t>& out,
                                  PieceCache& cache) const {
  if (text.empty()) return;
  std::string prefixed;
  if (prefix_space_ == PrefixSpace::PerSegment && text[0] != ' ') {
    prefixed = with_space(text);
    text = prefixed;
  }
  for (size_t pos = 0; pos < text.size();) {
    size_t end = next_piece(pre_, text, pos);
    std::string_view piece = text.substr(pos, end - pos);
    if (prefix_space_ == PrefixSpace::PerPiece && piece[0] != ' ') {
      encode_piece(with_space(piece), out, cache);
    } else {
      encode_piece(piece, out, cache);
    }
    pos = end;
  }
}

int32_t BpeTokenizer::byte_token(unsigned char b) const {
  int32_t id = byte_id_[b] >= 0 ? byte_id_[b] : unk_id_;
  if (id < 0) {
    throw RuntimeError(fmt::format("tokenizer {}: byte 0x{:02X} has no token and there is no unk_token",
                                   name_, b));
  }
  return id;
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out,
                                PieceCache& cache) const {
  if (piece.size() == 1) {
    out.push_back(byte_token(static_cast<unsigned char>(piece[0])));
    return;
  }
  if (ignore_merges_) {
    auto it = bytes_to_id_.find(piece);
    if (it != bytes_to_id_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (cache.get(piece, out)) return;
  size_t before = out.size();
  merge_piece(piece, out);
  cache.put(piece, std::span<const int32_t>(out.data() + before, out.size() - before));
}

// BPE over one piece: start from one symbol per byte and repeatedly apply the lowest-ranked
// merge among adjacent pairs (ties: leftmost first). A heap of candidate pairs over a linked
// list keeps this O(n log n) even for a megabyte-long piece; stale candidates are detected
// when popped by checking that both symbols still hold the ids they were pushed with.
void BpeTokenizer::merge_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const int n = static_cast<int>(piece.size());
  std::vector<int32_t> id(n), prev(n), next(n);
  for (int i = 0; i < n; ++i) {
    id[i] = byte_token(static_cast<unsigned char>(piece[i]));
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Cand {
    int32_t rank, pos, left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int pos) {
    if (pos < 0 || next[pos] < 0) return;
    auto it = merges_.find(pair_key(id[pos], id[next[pos]]));
    if (it != merges_.end()) heap.push({it->second.rank, pos, id[pos], id[next[pos]]});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    int r = next[c.pos];
    if (id[c.pos] != c.left || r < 0 || id[r] != c.right) continue;  // stale
    id[c.pos] = merges_.find(pair_key(c.left, c.right))->second.id;
    id[r] = -1;
    next[c.pos] = next[r];
    if (next[r] >= 0) prev[next[r]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  for (int i = 0; i >= 0; i = next[i]) out.push_back(id[i]);
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string s;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= id_to_bytes_.size() || !id_used_[id]) {
      throw RuntimeError(fmt::format("tokenizer {}: cannot decode id {}: not in the vocabulary (size {})",
                                     name_, id, id_to_bytes_.size()));
    }
    s += id_to_bytes_[id];
  }
  return s;
}

}  // namespace

std::unique_ptr<Tokenizer> make_bpe_tokenizer(BpeSpec spec) {
  return std::make_unique<BpeTokenizer>(std::move(spec));
}

}  // namespace primus::data
