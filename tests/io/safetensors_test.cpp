#include "io/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "io_test_util.h"

namespace {

using namespace primus::io;
using primus::FormatError;
using primus::RuntimeError;
using primus::io::testing::expect_error;
using primus::io::testing::read_bytes;
using primus::io::testing::write_bytes;

class Safetensors : public primus::io::testing::TempDirTest {
 protected:
  // A file from a hand-written header and data buffer; `declared` overrides the length field.
  std::filesystem::path make_file(const std::string& header, size_t data_bytes,
                                  std::optional<uint64_t> declared = std::nullopt) {
    uint64_t n = declared.value_or(header.size());
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
    bytes += header;
    auto data = random_bytes(data_bytes);
    bytes.append(reinterpret_cast<const char*>(data.data()), data.size());
    auto path = dir() / "bad.safetensors";
    write_bytes(path, bytes);
    return path;
  }
  // Expects opening a file with this header to fail, naming the file and `parts`.
  void expect_bad(const std::string& header, size_t data_bytes, std::vector<std::string> parts,
                  std::optional<uint64_t> declared = std::nullopt) {
    auto path = make_file(header, data_bytes, declared);
    parts.push_back(path.string());
    expect_error<FormatError>([&] { SafetensorsFile::open(path); }, parts);
  }
};

struct Sample {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

TEST_F(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  std::vector<Sample> samples;
  std::uniform_int_distribution<int> rank(0, 3), dim(1, 5);
  for (DType t : kAllDTypes) {
    Sample s{fmt::format("layers.{}.{}", samples.size(), dtype_name(t)), t, {}, {}};
    int r = rank(rng_);
    for (int i = 0; i < r; ++i) s.shape.push_back(dim(rng_));
    s.bytes = random_bytes(checked_nbytes(t, s.shape));
    if (t == DType::BOOL) {
      for (auto& b : s.bytes) b = static_cast<std::byte>(static_cast<uint8_t>(b) & 1);
    }
    samples.push_back(std::move(s));
  }
  samples.push_back({"empty", DType::F32, {0, 7}, {}});  // zero elements are legal

  SafetensorsWriter w;
  for (auto it = samples.rbegin(); it != samples.rend(); ++it) {
    w.add(it->name, it->dtype, it->shape, it->bytes.data(), it->bytes.size());
  }
  w.set_metadata("format", "pt");
  w.set_metadata("step \"7\"", "ünïcode\nline");
  auto path = dir() / "all.safetensors";
  FileDigest d = w.write(path);
  EXPECT_EQ(d.size, std::filesystem::file_size(path));
  EXPECT_EQ(d.size, w.file_size());

  auto f = SafetensorsFile::open(path);
  ASSERT_EQ(f.tensors().size(), samples.size());
  std::map<std::string, std::string> want_meta{{"format", "pt"}, {"step \"7\"", "ünïcode\nline"}};
  EXPECT_EQ(f.metadata(), want_meta);
  uint64_t header = w.header().size();
  EXPECT_EQ(header % 8, 0u);
  for (const auto& s : samples) {
    const TensorInfo& info = f.info(s.name);
    EXPECT_EQ(info.dtype, s.dtype) << s.name;
    EXPECT_EQ(info.shape, s.shape) << s.name;
    ASSERT_EQ(info.nbytes, s.bytes.size()) << s.name;
    auto data = f.data(s.name);
    EXPECT_TRUE(std::equal(data.begin(), data.end(), s.bytes.begin())) << s.name;
    // The layout keeps every tensor aligned to its element size within the file.
    EXPECT_EQ((8 + header + info.offset) % dtype_size(s.dtype), 0u) << s.name;
  }
  auto f32 = std::find_if(samples.begin(), samples.end(), [](auto& s) { return s.dtype == DType::F32; });
  auto vals = f.read_as<float>(f32->name);
  ASSERT_EQ(vals.size() * 4, f32->bytes.size());
  EXPECT_EQ(std::memcmp(vals.data(), f32->bytes.data(), f32->bytes.size()), 0);
  auto i32 = std::find_if(samples.begin(), samples.end(), [](auto& s) { return s.dtype == DType::I32; });
  expect_error<FormatError>([&] { f.read_as<float>(i32->name); },
                            {path.string(), i32->name, "I32", "F32"});
}

TEST_F(Safetensors, OutputIsDeterministicWhateverTheAddOrder) {
  auto a = random_floats(10), b = random_floats(3);
  std::vector<int32_t> c{1, 2, 3};
  SafetensorsWriter w1, w2;
  w1.add("b", DType::F32, {3}, b.data(), 12);
  w1.add("a", DType::F32, {2, 5}, a.data(), 40);
  w1.add("c", DType::I32, {3}, c.data(), 12);
  w2.add("c", DType::I32, {3}, c.data(), 12);
  w2.add("a", DType::F32, {2, 5}, a.data(), 40);
  w2.add("b", DType::F32, {3}, b.data(), 12);
  w1.write(dir() / "1.safetensors");
  w2.write(dir() / "2.safetensors");
  EXPECT_EQ(read_bytes(dir() / "1.safetensors"), read_bytes(dir() / "2.safetensors"));
}

// Byte-exact agreement with the reference implementation's own serialisation tests.
TEST_F(Safetensors, MatchesReferenceBytes) {
  float v[6] = {0, 1, 2, 3, 4, 5};
  SafetensorsWriter w;
  w.add("attn.0", DType::F32, {1, 2, 3}, v, sizeof v);
  EXPECT_EQ(w.header(), R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})");
  w.write(dir() / "a.safetensors");
  std::string bytes = read_bytes(dir() / "a.safetensors");
  ASSERT_EQ(bytes.size(), 8u + 64 + 24);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x40\0\0\0\0\0\0\0", 8));

  SafetensorsWriter empty;
  EXPECT_EQ(empty.header(), "{}      ");
  SafetensorsWriter meta;
  meta.set_metadata("framework", "pt");
  EXPECT_EQ(meta.header(), R"({"__metadata__":{"framework":"pt"}})" + std::string(5, ' '));
  meta.write(dir() / "m.safetensors");
  auto f = SafetensorsFile::open(dir() / "m.safetensors");
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.metadata().at("framework"), "pt");
}

TEST_F(Safetensors, BlobIsAZeroCopyViewThatKeepsTheMappingAlive) {
  auto v = random_floats(1000);
  SafetensorsWriter w;
  w.add("w", DType::F32, {10, 100}, v.data(), v.size() * 4);
  w.write(dir() / "z.safetensors");
  TensorBlob blob;
  const std::byte* inside = nullptr;
  {
    auto f = SafetensorsFile::open(dir() / "z.safetensors");
    blob = f.blob("w");
    inside = f.data("w").data();
  }
  EXPECT_EQ(blob.bytes().data(), inside);  // same address: no copy was made
  auto span = blob.as<float>();           // still mapped after the file object is gone
  ASSERT_EQ(span.size(), v.size());
  EXPECT_TRUE(std::equal(span.begin(), span.end(), v.begin()));
}

TEST_F(Safetensors, UnknownNameListsSomeAvailable) {
  float x = 1.f;
  SafetensorsWriter w;
  w.add("wte", DType::F32, {1}, &x, 4);
  w.add("wpe", DType::F32, {1}, &x, 4);
  w.write(dir() / "n.safetensors");
  auto f = SafetensorsFile::open(dir() / "n.safetensors");
  expect_error<FormatError>([&] { f.info("lm_head"); }, {"lm_head", "wte", "wpe", "n.safetensors"});
}

TEST_F(Safetensors, WriterRefusesInconsistentInput) {
  float x[4] = {1, 2, 3, 4};
  SafetensorsWriter w;
  w.add("a", DType::F32, {4}, x, 16);
  EXPECT_THROW(w.add("a", DType::F32, {4}, x, 16), RuntimeError);       // duplicate
  EXPECT_THROW(w.add("b", DType::F32, {3}, x, 16), RuntimeError);       // size mismatch
  EXPECT_THROW(w.add("__metadata__", DType::F32, {4}, x, 16), RuntimeError);
  EXPECT_THROW(w.add("", DType::F32, {4}, x, 16), RuntimeError);
}

TEST_F(Safetensors, TooShort) {
  write_bytes(dir() / "s.safetensors", "abc");
  expect_error<FormatError>([&] { SafetensorsFile::open(dir() / "s.safetensors"); },
                            {"s.safetensors", "too short"});
}

TEST_F(Safetensors, HeaderLengthLargerThanFile) {
  expect_bad(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8,
             {"header length 1000", "larger"}, 1000);
}

TEST_F(Safetensors, InvalidJson) {
  expect_bad(R"({"a":{"dtype":"F32","shape":[2],)", 8, {"not valid JSON"});
  expect_bad(R"({"a":1} trailing)", 0, {"not valid JSON"});
  expect_bad(R"([1,2])", 0, {"does not start with"});
}

TEST_F(Safetensors, UnknownDtype) {
  expect_bad(R"({"w":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})", 8,
             {"tensor 'w'", "unknown dtype \"F128\""});
}

TEST_F(Safetensors, NegativeDimension) {
  expect_bad(R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,16]}})", 16,
             {"tensor 'w'", "negative"});
}

TEST_F(Safetensors, OverflowingShape) {
  // 2^62 * 4 elements overflows the element count; [2^62] of F32 overflows the byte count.
  expect_bad(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})",
             16, {"tensor 'w'", "2^64"});
  expect_bad(R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,16]}})",
             16, {"tensor 'w'", "2^64"});
}

TEST_F(Safetensors, OffsetsOutOfRange) {
  expect_bad(R"({"w":{"dtype":"F32","shape":[250],"data_offsets":[0,1000]}})", 16,
             {"tensor 'w'", "past the data buffer"});
  expect_bad(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 16,
             {"tensor 'w'", "end before begin"});
  expect_bad(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,-16]}})", 16,
             {"tensor 'w'", "negative"});
}

TEST_F(Safetensors, OverlappingTensors) {
  expect_bad(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
             R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
             24, {"tensor 'b'", "overlap tensor 'a'"});
}

TEST_F(Safetensors, NonContiguousTensors) {
  expect_bad(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})",
             24, {"tensor 'b'", "[8, 16)", "no tensor"});
  expect_bad(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12,
             {"last 4 bytes"});
}

TEST_F(Safetensors, ShapeDisagreesWithByteLength) {
  expect_bad(R"({"w":{"dtype":"BF16","shape":[3,2],"data_offsets":[0,16]}})", 16,
             {"tensor 'w'", "needs 12 bytes", "hold 16"});
}

TEST_F(Safetensors, OtherMalformedHeaders) {
  expect_bad(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
             R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
             8, {"tensor 'w'", "twice"});
  expect_bad(R"({"__metadata__":{"step":7}})", 0, {"__metadata__", "step"});
  expect_bad(R"({"w":{"dtype":"F32","shape":[1]}})", 4, {"tensor 'w'", "data_offsets"});
  expect_bad(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4,
             {"tensor 'w'", "dimension"});
  expect_bad(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", 4,
             {"tensor 'w'", "unknown field 'extra'"});
}

}  // namespace

namespace {

// Random corruptions of a valid file's length field and header either parse into tensors that
// lie inside the buffer or throw FormatError; nothing else (run under PRIMUS_SANITIZE to catch
// stray reads).
TEST_F(Safetensors, RandomCorruptionsParseSafelyOrThrowFormatError) {
  auto a = random_floats(12);
  std::vector<uint16_t> b(5, 0x3f80);
  SafetensorsWriter w;
  w.add("a", DType::F32, {3, 4}, a.data(), 48);
  w.add("b", DType::BF16, {5}, b.data(), 10);
  w.set_metadata("k", "v");
  w.write(dir() / "ok.safetensors");
  const std::string good = read_bytes(dir() / "ok.safetensors");
  const size_t header_end = 8 + w.header().size();
  int parsed = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string bytes = good;
    int edits = 1 + static_cast<int>(rng_() % 3);
    for (int e = 0; e < edits; ++e) {
      size_t at = rng_() % header_end;
      bytes[at] = (rng_() % 2) ? static_cast<char>(rng_()) : "0123456789[]{},:\"-"[rng_() % 18];
    }
    if (rng_() % 10 == 0) bytes.resize(rng_() % bytes.size());
    auto span = std::as_bytes(std::span(bytes));
    try {
      auto f = SafetensorsFile::parse(span, nullptr, "mutated");
      for (const auto& t : f.tensors()) {
        auto d = f.data(t.name);
        ASSERT_EQ(d.size(), t.nbytes);
        ASSERT_GE(d.data(), span.data());
        ASSERT_LE(d.data() + d.size(), span.data() + span.size());
      }
      ++parsed;
    } catch (const FormatError& e) {
      ASSERT_NE(std::string(e.what()).find("mutated"), std::string::npos) << e.what();
      ++refused;
    }
  }
  EXPECT_GT(refused, 0);
  std::printf("%d corrupted files parsed, %d refused\n", parsed, refused);
}

}  // namespace
