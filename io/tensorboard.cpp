#include "io/tensorboard.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/util/error.h"
#include "io/crc32c.h"

namespace primus::io {
namespace {

// ---- protobuf wire format: just what Event/Summary need ----
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_tag(std::string& out, uint32_t field, Wire wire) { put_varint(out, (field << 3) | wire); }
template <class T>
void put_le(std::string& out, T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // the host is little-endian (checked in crc32c.cpp)
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}
void put_bytes(std::string& out, uint32_t field, std::string_view s) {
  put_tag(out, field, kLengthDelimited);
  put_varint(out, s.size());
  out.append(s);
}

// Summary.Value { tag = 1; simple_value = 2 }
std::string encode_value(std::string_view tag, float value) {
  std::string v;
  put_bytes(v, 1, tag);
  put_tag(v, 2, kFixed32);
  put_le(v, value);
  return v;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == 0) return "localhost";
  std::string h(buf);
  for (char& c : h) {
    if (c == '/') c = '_';
  }
  return h;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::filesystem::path& dir, double flush_secs)
    : flush_every_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(flush_secs))),
      last_flush_(std::chrono::steady_clock::now()) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw IoError(fmt::format("cannot create TensorBoard folder '{}': {}", dir.string(), ec.message()));
  double t = now_seconds();
  std::string base = fmt::format("events.out.tfevents.{}.{}", static_cast<int64_t>(t), host_name());
  path_ = dir / base;
  for (int n = 0; std::filesystem::exists(path_, ec); ++n) {
    path_ = dir / fmt::format("{}.{}.{}", base, ::getpid(), n);
  }
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) throw IoError(fmt::format("cannot create '{}': {}", path_.string(), std::strerror(errno)));
  std::string what;
  put_bytes(what, 3, "brain.Event:2");
  std::lock_guard lock(mu_);
  write_event(t, 0, what);
  flush_locked();
}

TensorBoardWriter::~TensorBoardWriter() {
  try {
    close();
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
  }
}

void TensorBoardWriter::write_event(double wall_time, int64_t step, const std::string& what) {
  if (!file_) throw RuntimeError(fmt::format("TensorBoard file '{}' is closed", path_.string()));
  std::string ev;
  put_tag(ev, 1, kFixed64);
  put_le(ev, wall_time);
  if (step != 0) {  // proto3 leaves default values out
    put_tag(ev, 2, kVarint);
    put_varint(ev, static_cast<uint64_t>(step));
  }
  ev += what;

  std::string rec;
  rec.reserve(ev.size() + 16);
  put_le(rec, static_cast<uint64_t>(ev.size()));
  put_le(rec, crc32c_mask(crc32c(rec.data(), 8)));
  rec += ev;
  put_le(rec, crc32c_mask(crc32c(ev)));
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size()) {
    throw IoError(fmt::format("cannot write to '{}': {}", path_.string(), std::strerror(errno)));
  }
  if (std::chrono::steady_clock::now() - last_flush_ >= flush_every_) flush_locked();
}

void TensorBoardWriter::add_scalar(std::string_view tag, float value, int64_t step) {
  add_scalar(tag, value, step, now_seconds());
}

void TensorBoardWriter::add_scalar(std::string_view tag, float value, int64_t step,
                                   double wall_time) {
  std::string what;
  std::string summary;
  put_bytes(summary, 1, encode_value(tag, value));
  put_bytes(what, 5, summary);
  std::lock_guard lock(mu_);
  write_event(wall_time, step, what);
}

void TensorBoardWriter::add_scalars(int64_t step,
                                    const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) put_bytes(summary, 1, encode_value(tag, v));
  std::string what;
  put_bytes(what, 5, summary);
  std::lock_guard lock(mu_);
  write_event(now_seconds(), step, what);
}

void TensorBoardWriter::flush_locked() {
  if (file_ && std::fflush(file_) != 0) {
    throw IoError(fmt::format("cannot flush '{}': {}", path_.string(), std::strerror(errno)));
  }
  last_flush_ = std::chrono::steady_clock::now();
}

void TensorBoardWriter::flush() {
  std::lock_guard lock(mu_);
  flush_locked();
}

void TensorBoardWriter::close() {
  std::lock_guard lock(mu_);
  if (!file_) return;
  std::FILE* f = file_;
  file_ = nullptr;
  if (std::fclose(f) != 0) {
    throw IoError(fmt::format("cannot close '{}': {}", path_.string(), std::strerror(errno)));
  }
}

}  // namespace primus::io
