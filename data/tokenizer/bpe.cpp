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
  // BPE merges over the symbols in `id` (consumed), appending the result to `out`.
  void merge_ids(std::vector<int32_t>& id, std::vector<int32_t>& out) const;
  // SentencePiece-style encoding (sp_ set): segments between added tokens, then pieces.
  void encode_sp(std::string_view text, std::vector<int32_t>& out, PieceCache& cache) const;
  void encode_sp_segment(std::string_view seg, bool at_start, std::vector<int32_t>& out,
                         PieceCache& cache) const;
  void encode_sp_piece(std::string_view piece, std::vector<int32_t>& out, PieceCache& cache) const;
  std::string decode_sp(std::span<const int32_t> ids) const;
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
  std::optional<SentencePieceSpec> sp_;
  StringMap<int32_t> piece_to_id_;  // sentencepiece only: vocabulary piece -> id
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
      sp_(std::move(spec.sentencepiece)),
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
    if (sp_) {
      bytes = tok;  // SentencePiece pieces are plain UTF-8; decode_sp maps them
    } else if (!byte_level::decode_token(tok, &bytes)) {
      throw FormatError(fmt::format(
          "{}: vocab entry '{}' (id {}) is not in the byte-level alphabet; only byte-level BPE "
          "vocabularies are supported",
          src, tok, id));
    }
    id_used_[id] = true;
    id_to_bytes_[id] = bytes;
    form_to_id.emplace(tok, id);
    if (ignore_merges_ && !sp_) bytes_to_id_.emplace(bytes, id);
  }
  byte_id_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    // SentencePiece: the byte-fallback token "<0xNN>" (tokenizers spells it with upper-case hex).
    auto it = form_to_id.find(sp_ ? fmt::format("<0x{:02X}>", b)
                                  : byte_level::encode_token(std::string(1, static_cast<char>(b))));
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
  if (sp_) {
    if (sp_->replacement.empty()) throw FormatError(fmt::format("{}: the Metaspace replacement is empty", src));
    piece_to_id_ = std::move(form_to_id);
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
  if (sp_) {
    encode_sp(text, out, cache);
    return;
  }
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
  std::vector<int32_t> id(n);
  for (int i = 0; i < n; ++i) id[i] = byte_token(static_cast<unsigned char>(piece[i]));
  merge_ids(id, out);
}

void BpeTokenizer::merge_ids(std::vector<int32_t>& id, std::vector<int32_t>& out) const {
  const int n = static_cast<int>(id.size());
  if (n == 0) return;
  std::vector<int32_t> prev(n), next(n);
  for (int i = 0; i < n; ++i) {
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

// ---- SentencePiece-style BPE (tokenizers' BPE with byte_fallback, Metaspace, its decoders) ----

std::string replace_every(std::string_view text, std::string_view pattern, std::string_view content) {
  std::string r;
  r.reserve(text.size());
  for (size_t pos = 0;;) {
    size_t hit = text.find(pattern, pos);
    if (hit == std::string_view::npos) {
      r.append(text.substr(pos));
      return r;
    }
    r.append(text.substr(pos, hit - pos));
    r.append(content);
    pos = hit + pattern.size();
  }
}

// As tokenizers: added tokens split out of the raw text (then the normalizer on each segment
// between them, then the normalized added tokens), each remaining segment through the Metaspace
// pre-tokenizer when there is one. `at_start`: the segment begins at offset 0 of the original
// text (Metaspace's prepend_scheme "first" prepends there only).
void BpeTokenizer::encode_sp(std::string_view text, std::vector<int32_t>& out, PieceCache& cache) const {
  if (normalizer_.empty()) {
    split_added(text, AddedPass::All, out, [&](std::string_view seg) {
      encode_sp_segment(seg, seg.data() == text.data(), out, cache);
    });
    return;
  }
  split_added(text, AddedPass::Raw, out, [&](std::string_view seg) {
    if (seg.empty()) return;
    bool start = seg.data() == text.data();
    std::string normalized = normalizer_.apply(seg);
    split_added(normalized, AddedPass::Normalized, out, [&](std::string_view piece) {
      encode_sp_segment(piece, start && piece.data() == normalized.data(), out, cache);
    });
  });
}

void BpeTokenizer::encode_sp_segment(std::string_view seg, bool at_start, std::vector<int32_t>& out,
                                     PieceCache& cache) const {
  if (seg.empty()) return;
  if (!sp_->metaspace) {  // no pre-tokenizer: the whole normalized segment is one word
    encode_sp_piece(seg, out, cache);
    return;
  }
  const std::string& rep = sp_->replacement;
  std::string s = replace_every(seg, " ", rep);
  using Scheme = SentencePieceSpec::PrependScheme;
  bool prepend = sp_->prepend == Scheme::Always || (sp_->prepend == Scheme::First && at_start);
  if (prepend && s.compare(0, rep.size(), rep) != 0) s.insert(0, rep);
  if (!sp_->split) {
    encode_sp_piece(s, out, cache);
    return;
  }
  // Split with the replacement merged with the next piece: "a▁b▁▁c" -> "a", "▁b", "▁", "▁c".
  std::string_view v = s;
  size_t start = 0;
  for (size_t hit = v.find(rep, 1); hit != std::string_view::npos; hit = v.find(rep, hit + rep.size())) {
    if (hit > start) encode_sp_piece(v.substr(start, hit - start), out, cache);
    start = hit;
  }
  encode_sp_piece(v.substr(start), out, cache);
}

// tokenizers' BPE on one word: one symbol per Unicode character (its token if the vocabulary
// has it; else, with byte_fallback, one "<0xNN>" token per UTF-8 byte when all exist; else unk,
// consecutive ones fused with fuse_unk; with no unk_token the character is dropped), then the
// merges by rank. A malformed UTF-8 byte (which tokenizers never sees) is a character of its own.
void BpeTokenizer::encode_sp_piece(std::string_view piece, std::vector<int32_t>& out, PieceCache& cache) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    auto it = piece_to_id_.find(piece);
    if (it != piece_to_id_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (cache.get(piece, out)) return;
  std::vector<int32_t> id;
  id.reserve(piece.size());
  bool pending_unk = false;
  const char* end = piece.data() + piece.size();
  for (size_t pos = 0; pos < piece.size();) {
    int len = 1;
    unicode::decode_utf8(piece.data() + pos, end, &len);
    std::string_view ch = piece.substr(pos, static_cast<size_t>(len));
    pos += static_cast<size_t>(len);
    if (auto it = piece_to_id_.find(ch); it != piece_to_id_.end()) {
      if (pending_unk) id.push_back(unk_id_);
      pending_unk = false;
      id.push_back(it->second);
      continue;
    }
    if (sp_->byte_fallback &&
        std::all_of(ch.begin(), ch.end(), [&](char b) { return byte_id_[static_cast<unsigned char>(b)] >= 0; })) {
      // tokenizers adds these without flushing a pending unk first: the unk lands after them.
      for (char b : ch) id.push_back(byte_id_[static_cast<unsigned char>(b)]);
      continue;
    }
    if (unk_id_ < 0) continue;  // no unk_token: tokenizers drops the character
    if (pending_unk && !sp_->fuse_unk) id.push_back(unk_id_);
    pending_unk = true;
  }
  if (pending_unk) id.push_back(unk_id_);
  size_t before = out.size();
  merge_ids(id, out);
  cache.put(piece, std::span<const int32_t>(out.data() + before, out.size() - before));
}

// The decoder Sequence over the token strings (added tokens as their content), as tokenizers'
// decode_chain, except that ByteFallback keeps the bytes as they are where tokenizers writes
// U+FFFD for a run that is not valid UTF-8 (the same text whenever the bytes are valid).
std::string BpeTokenizer::decode_sp(std::span<const int32_t> ids) const {
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= id_to_bytes_.size() || !id_used_[id]) {
      throw RuntimeError(fmt::format("tokenizer {}: cannot decode id {}: not in the vocabulary (size {})",
                                     name_, id, id_to_bytes_.size()));
    }
    toks.push_back(id_to_bytes_[id]);
  }
  auto byte_of = [](const std::string& t) -> int {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; ++i) {
      char c = t[i];
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return -1;
      v = v * 16 + d;
    }
    return v;
  };
  for (const SpDecodeStep& step : sp_->decoder) {
    switch (step.kind) {
      case SpDecodeStep::Kind::Replace:
        for (auto& t : toks) t = replace_every(t, step.pattern, step.content);
        break;
      case SpDecodeStep::Kind::ByteFallback: {
        std::vector<std::string> next;
        next.reserve(toks.size());
        bool in_run = false;
        for (auto& t : toks) {
          int b = byte_of(t);
          if (b < 0) {
            next.push_back(std::move(t));
            in_run = false;
          } else {
            if (!in_run) next.emplace_back();
            next.back() += static_cast<char>(b);
            in_run = true;
          }
        }
        toks = std::move(next);
        break;
      }
      case SpDecodeStep::Kind::Fuse: {
        std::string all;
        for (auto& t : toks) all += t;
        toks.assign(1, std::move(all));
        break;
      }
      case SpDecodeStep::Kind::Strip: {
        const std::string& c = step.content;
        if (c.empty()) break;
        for (auto& t : toks) {
          size_t b = 0, e = t.size();
          for (int i = 0; i < step.start && t.compare(b, c.size(), c) == 0 && b + c.size() <= e; ++i) b += c.size();
          for (int i = 0; i < step.stop && e >= b + c.size() && t.compare(e - c.size(), c.size(), c) == 0; ++i) e -= c.size();
          t = t.substr(b, e - b);
        }
        break;
      }
    }
  }
  std::string s;
  for (auto& t : toks) s += t;  // without a Fuse step tokenizers joins; all real files fuse
  return s;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  if (sp_) return decode_sp(ids);
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
