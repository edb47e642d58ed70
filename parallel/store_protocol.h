// The TCP store's wire format, shared by client and server. Every message is a frame:
//   u32 body length (little-endian), then the body.
// A request body starts with a u8 Op, a reply body with a u8 Status; the fields follow in order.
// Strings are u32 length + bytes; integers are little-endian (u32, u64, i64).
//
//   Hello  u32 magic, u32 version           -> Ok
//   Set    str key, str value               -> Ok
//   Get    str key, u64 timeout_ms          -> Ok str value | Timeout
//   Add    str key, i64 delta               -> Ok i64 new value | Error str why
//   Wait   u32 n, n x str key, u64 timeout_ms -> Ok | Timeout u32 m, m x str missing key
//   Check  u32 n, n x str key               -> Ok u8 all present
//   Delete str key                          -> Ok u8 existed
//
// The server answers blocking requests (Get, Wait) itself when the keys arrive or the timeout
// passes, so a client's connection never carries a stale reply. Counters (Add) are stored as
// decimal text, so Get on a counter returns e.g. "3".
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/util/error.h"

namespace primus::parallel::wire {

inline constexpr uint32_t kMagic = 0x53525250;  // "PRRS": Primus rendezvous store
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kMaxFrame = 64u << 20;  // a garbage length closes the connection

enum class Op : uint8_t { Hello = 1, Set, Get, Add, Wait, Check, Delete };
enum class Status : uint8_t { Ok = 0, Timeout = 1, Error = 2 };

// Appends fields to a frame body.
class Writer {
 public:
  Writer& u8(uint8_t v) { return raw(&v, 1); }
  Writer& u32(uint32_t v) { return raw(&v, 4); }  // hosts are little-endian (x86-64, aarch64)
  Writer& u64(uint64_t v) { return raw(&v, 8); }
  Writer& i64(int64_t v) { return raw(&v, 8); }
  Writer& str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    return raw(s.data(), s.size());
  }
  // The frame: length prefix, then the body.
  std::string frame() const {
    std::string f(4, '\0');
    uint32_t n = static_cast<uint32_t>(body_.size());
    std::memcpy(f.data(), &n, 4);
    return f + body_;
  }

 private:
  Writer& raw(const void* p, size_t n) {
    body_.append(static_cast<const char*>(p), n);
    return *this;
  }
  std::string body_;
};

// Reads fields from a frame body; FormatError when the body is shorter than its fields say.
class Reader {
 public:
  explicit Reader(std::string_view body) : b_(body) {}
  explicit Reader(std::string&&) = delete;  // it would view a temporary that dies at once
  uint8_t u8() { return get<uint8_t>(); }
  uint32_t u32() { return get<uint32_t>(); }
  uint64_t u64() { return get<uint64_t>(); }
  int64_t i64() { return get<int64_t>(); }
  std::string str() {
    uint32_t n = u32();
    need(n);
    std::string s(b_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  bool done() const { return pos_ == b_.size(); }

 private:
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  void need(size_t n) const {
    if (b_.size() - pos_ < n) throw FormatError("TCP store: truncated message");
  }
  std::string_view b_;
  size_t pos_ = 0;
};

}  // namespace primus::parallel::wire
