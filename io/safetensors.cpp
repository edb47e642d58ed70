#include "io/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>

#include "core/util/error.h"
#include "core/util/fs.h"
#include "io/mapped_file.h"

namespace primus::io {
namespace {

using nlohmann::json;

// Collects the messages of one file: "safetensors file 'x': tensor 'w': ...".
struct Context {
  const std::string& source;

  [[noreturn]] void fail(std::string_view msg) const {
    throw FormatError(fmt::format("safetensors file '{}': {}", source, msg));
  }
  [[noreturn]] void fail(std::string_view tensor, std::string_view msg) const {
    throw FormatError(fmt::format("safetensors file '{}': tensor '{}': {}", source, tensor, msg));
  }
};

uint64_t read_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Parses the header, refusing duplicate top-level keys (nlohmann would keep the last silently,
// which would hide a tensor).
json parse_header(const Context& ctx, std::string_view text) {
  if (text.empty() || text.front() != '{') ctx.fail("header does not start with '{'");
  std::set<std::string, std::less<>> seen;
  std::string duplicate;
  auto cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    ctx.fail(fmt::format("header is not valid JSON: {}", e.what()));
  }
  if (!duplicate.empty()) ctx.fail(duplicate, "appears twice in the header");
  if (!header.is_object()) ctx.fail("header is not a JSON object");
  return header;
}

uint64_t as_u64(const Context& ctx, std::string_view tensor, const json& v, std::string_view what) {
  if (!v.is_number_unsigned()) {
    if (v.is_number_integer()) ctx.fail(tensor, fmt::format("{} {} is negative", what, v.dump()));
    ctx.fail(tensor, fmt::format("{} {} is not a non-negative integer", what, v.dump()));
  }
  return v.get<uint64_t>();
}

TensorInfo parse_entry(const Context& ctx, const std::string& name, const json& e) {
  if (!e.is_object()) ctx.fail(name, "entry is not an object");
  for (const auto& [k, v] : e.items()) {
    if (k != "dtype" && k != "shape" && k != "data_offsets") {
      ctx.fail(name, fmt::format("unknown field '{}'", k));
    }
  }
  TensorInfo info;
  info.name = name;

  auto dt = e.find("dtype");
  if (dt == e.end() || !dt->is_string()) ctx.fail(name, "missing string field 'dtype'");
  auto parsed = parse_dtype(dt->get_ref<const std::string&>());
  if (!parsed) ctx.fail(name, fmt::format("unknown dtype {}", dt->dump()));
  info.dtype = *parsed;

  auto sh = e.find("shape");
  if (sh == e.end() || !sh->is_array()) ctx.fail(name, "missing array field 'shape'");
  for (const auto& d : *sh) {
    uint64_t v = as_u64(ctx, name, d, "dimension");
    if (v > static_cast<uint64_t>(INT64_MAX)) ctx.fail(name, fmt::format("dimension {} too large", v));
    info.shape.push_back(static_cast<int64_t>(v));
  }

  auto off = e.find("data_offsets");
  if (off == e.end() || !off->is_array() || off->size() != 2) {
    ctx.fail(name, "missing field 'data_offsets' of two integers");
  }
  uint64_t begin = as_u64(ctx, name, (*off)[0], "data offset");
  uint64_t end = as_u64(ctx, name, (*off)[1], "data offset");
  if (end < begin) ctx.fail(name, fmt::format("data_offsets [{}, {}] end before begin", begin, end));
  info.offset = begin;
  info.nbytes = end - begin;

  uint64_t want;
  try {
    want = checked_nbytes(info.dtype, info.shape);
  } catch (const FormatError& err) {
    ctx.fail(name, err.what());
  }
  if (want != info.nbytes) {
    ctx.fail(name, fmt::format("shape [{}] of {} needs {} bytes but data_offsets [{}, {}] hold {}",
                               fmt::join(info.shape, ", "), dtype_name(info.dtype), want, begin,
                               end, info.nbytes));
  }
  return info;
}

// The tensors must tile the data buffer: no overlap, no gap, nothing past its end, nothing left.
void check_layout(const Context& ctx, std::vector<TensorInfo>& tensors, uint64_t buffer_size) {
  for (const auto& t : tensors) {
    if (t.offset + t.nbytes > buffer_size) {
      ctx.fail(t.name, fmt::format("data_offsets [{}, {}] run past the data buffer of {} bytes",
                                   t.offset, t.offset + t.nbytes, buffer_size));
    }
  }
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.offset, a.nbytes, a.name) < std::tie(b.offset, b.nbytes, b.name);
  });
  uint64_t covered = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : tensors) {
    if (t.offset < covered) {
      ctx.fail(t.name, fmt::format("data_offsets [{}, {}] overlap tensor '{}' (ends at {})",
                                   t.offset, t.offset + t.nbytes, prev->name, covered));
    }
    if (t.offset > covered) {
      ctx.fail(t.name, fmt::format("bytes [{}, {}) before it belong to no tensor (tensors must "
                                   "be contiguous)", covered, t.offset));
    }
    covered = t.offset + t.nbytes;
    prev = &t;
  }
  if (covered != buffer_size) {
    ctx.fail(fmt::format("the last {} bytes of the data buffer belong to no tensor",
                         buffer_size - covered));
  }
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  auto mapped = MappedFile::open(path);
  auto bytes = mapped->bytes();
  return parse(bytes, std::move(mapped), path.string());
}

SafetensorsFile SafetensorsFile::parse(std::span<const std::byte> bytes,
                                       std::shared_ptr<const void> owner, std::string source) {
  SafetensorsFile f;
  f.source_ = std::move(source);
  f.owner_ = std::move(owner);
  Context ctx{f.source_};

  if (bytes.size() < 8) {
    ctx.fail(fmt::format("file of {} bytes is too short for the 8-byte header length",
                         bytes.size()));
  }
  uint64_t n = read_le64(bytes.data());
  if (n > bytes.size() - 8) {
    ctx.fail(fmt::format("header length {} is larger than the {} bytes after it", n,
                         bytes.size() - 8));
  }
  if (n > kMaxSafetensorsHeader) {
    ctx.fail(fmt::format("header length {} exceeds the limit of {}", n, kMaxSafetensorsHeader));
  }
  std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), n);
  json header = parse_header(ctx, text);

  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) ctx.fail("__metadata__ is not an object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) ctx.fail(fmt::format("__metadata__ value of '{}' is not a string", mk));
        f.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    f.tensors_.push_back(parse_entry(ctx, key, value));
  }
  f.buffer_ = bytes.subspan(8 + n);
  check_layout(ctx, f.tensors_, f.buffer_.size());
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

const TensorInfo& SafetensorsFile::info(std::string_view name) const {
  auto it = index_.find(name);
  if (it != index_.end()) return tensors_[it->second];
  std::vector<std::string> some;
  for (const auto& [k, i] : index_) {
    if (some.size() == 5) {
      some.push_back(fmt::format("... ({} in all)", index_.size()));
      break;
    }
    some.push_back(k);
  }
  throw FormatError(fmt::format("safetensors file '{}' has no tensor '{}' (it has: {})", source_,
                                name, some.empty() ? "none" : fmt::format("{}", fmt::join(some, ", "))));
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [k, i] : index_) out.push_back(k);
  return out;
}

std::span<const std::byte> SafetensorsFile::data(std::string_view name) const {
  const TensorInfo& i = info(name);
  return buffer_.subspan(i.offset, i.nbytes);
}

TensorBlob SafetensorsFile::blob(std::string_view name) const {
  const TensorInfo& i = info(name);
  return TensorBlob::view(i.dtype, i.shape, buffer_.subspan(i.offset, i.nbytes), owner_);
}

std::vector<float> SafetensorsFile::read_fp32(std::string_view name) const {
  const TensorInfo& i = info(name);
  if (i.dtype != DType::F32 && i.dtype != DType::F64 && i.dtype != DType::BF16 &&
      i.dtype != DType::F16) {
    throw_type_mismatch(i, DType::F32);
  }
  return blob(name).to_fp32();
}

void SafetensorsFile::throw_type_mismatch(const TensorInfo& info, DType want) const {
  throw FormatError(fmt::format("safetensors file '{}': tensor '{}' is {} of shape [{}], cannot "
                                "be read as {}",
                                source_, info.name, dtype_name(info.dtype),
                                fmt::join(info.shape, ", "), dtype_name(want)));
}

// ---- writer ----

void SafetensorsWriter::add(std::string name, TensorBlob blob) {
  if (name.empty() || name == "__metadata__") {
    throw RuntimeError(fmt::format("safetensors: invalid tensor name '{}'", name));
  }
  auto [it, inserted] = tensors_.emplace(std::move(name), std::move(blob));
  if (!inserted) throw RuntimeError(fmt::format("safetensors: tensor '{}' added twice", it->first));
}

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape,
                            const void* data, size_t nbytes) {
  add(std::move(name), TensorBlob::borrow(dtype, std::move(shape), data, nbytes));
}

void SafetensorsWriter::add_copy(std::string name, DType dtype, std::vector<int64_t> shape,
                                 const void* data, size_t nbytes) {
  add(std::move(name), TensorBlob::copy_of(dtype, std::move(shape), data, nbytes));
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

std::vector<const SafetensorsWriter::Entry*> SafetensorsWriter::layout() const {
  std::vector<const Entry*> order;
  order.reserve(tensors_.size());
  for (const auto& e : tensors_) order.push_back(&e);
  // Largest elements first, then by name (the map is sorted, and stable_sort keeps that).
  std::stable_sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return dtype_size(a->second.dtype()) > dtype_size(b->second.dtype());
  });
  return order;
}

std::string SafetensorsWriter::header() const {
  // Built by hand, not through nlohmann's object (which sorts keys), so the layout order and the
  // field order {dtype, shape, data_offsets} match what the reference implementation writes.
  auto quote = [](const std::string& s) {
    try {
      return json(s).dump();
    } catch (const json::exception& e) {
      throw RuntimeError(fmt::format("safetensors: name or metadata '{}' is not valid UTF-8 ({})",
                                     s, e.what()));
    }
  };
  std::string h = "{";
  bool first = true;
  if (!metadata_.empty()) {
    h += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata_) {
      if (!first) h += ',';
      first = false;
      h += quote(k) + ':' + quote(v);
    }
    h += '}';
    first = false;
  }
  uint64_t offset = 0;
  for (const Entry* e : layout()) {
    const TensorBlob& b = e->second;
    if (!first) h += ',';
    first = false;
    h += fmt::format("{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                     quote(e->first), dtype_name(b.dtype()), fmt::join(b.shape(), ","), offset,
                     offset + b.nbytes());
    offset += b.nbytes();
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  return h;
}

uint64_t SafetensorsWriter::file_size() const {
  uint64_t n = 8 + header().size();
  for (const auto& [name, b] : tensors_) n += b.nbytes();
  return n;
}

FileDigest SafetensorsWriter::write_to(std::FILE* f, const std::string& where) const {
  std::string h = header();
  unsigned char len[8];
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  DigestWriter out(f, where);
  out.write(len, 8);
  out.write(h);
  for (const Entry* e : layout()) out.write(e->second.data(), e->second.nbytes());
  return out.digest();
}

FileDigest SafetensorsWriter::write(const std::filesystem::path& path) const {
  FileDigest d;
  fs::atomic_write_with(path, [&](std::FILE* f) { d = write_to(f, path.string()); });
  return d;
}

}  // namespace primus::io
